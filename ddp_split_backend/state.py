"""Global-state nodes in Dynamo graphs, and the state in force at every point of a graph.

Dynamo records context managers in the FX graph as plain calls that change global state
(see ``torch/_dynamo/variables/ctx_manager.py``)::

    _set_grad_enabled = torch._C._set_grad_enabled(False)
    _enter_autocast = torch.amp.autocast_mode._enter_autocast('cpu', torch.bfloat16, True, None)
    ...
    _exit_autocast = torch.amp.autocast_mode._exit_autocast(_enter_autocast)

Note [Global state across pieces]
---------------------------------
A piece is traced by the inner backend *on its own* (AOTAutograd runs it under fake tensors
at compile time) and runs on its own at run time, so it cannot inherit the state the graph
had when the cut was made. Every piece is therefore made self-contained:

* its prologue re-creates the state the original graph had at the piece's first node,
  starting from the *ambient* state (the state the whole graph was entered with, which
  Dynamo guards on and restores before calling the backend);
* its epilogue undoes that state again, back to the ambient state.

Between two pieces the global state is thus always the ambient one, a failing piece can be
undone by restoring the ambient state, and each piece traces identically at compile time and
at run time. One exception: grad mode. AOTAutograd decides from the grad mode *at call time*
whether to record autograd at all, so a piece is compiled and called with grad mode on iff it
is on anywhere inside the piece; its prologue sets the entry value from there and its epilogue
sets the call value back. State kinds fall in three groups:

* *values* (grad mode, forward-AD grad mode): re-created by setting the value;
* *regions* (autocast, inference mode, forward-AD dual level): re-entered with the same
  arguments and exited at the end of the piece. Inference mode also saves and restores grad
  mode, which the replay models exactly;
* *opaque regions* (functorch transforms, profiler ranges, and any state-like call this
  module does not know): no cut may fall inside them.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from . import _torch

__all__ = [
    "Ambient",
    "OpenRegion",
    "PointState",
    "StateAction",
    "StateKind",
    "StateOp",
    "classify",
    "simulate",
]


class StateKind(enum.Enum):
    GRAD = "grad mode"
    FWD_GRAD = "forward-AD grad mode"
    AUTOCAST = "autocast"
    INFERENCE = "inference mode"
    DUAL = "forward-AD dual level"
    OPAQUE = "uncuttable region"


class StateAction(enum.Enum):
    SET = "set"
    ENTER = "enter"
    EXIT = "exit"
    TOGGLE = "toggle"  # an unknown setter: consecutive calls open and close a region


@dataclass(frozen=True, slots=True)
class StateOp:
    kind: StateKind
    action: StateAction


def _known_targets() -> dict[object, StateOp]:
    known: dict[object, StateOp] = {
        _torch.set_grad_enabled: StateOp(StateKind.GRAD, StateAction.SET),
        _torch.set_fwd_grad_enabled: StateOp(StateKind.FWD_GRAD, StateAction.SET),
        _torch.enter_autocast: StateOp(StateKind.AUTOCAST, StateAction.ENTER),
        _torch.exit_autocast: StateOp(StateKind.AUTOCAST, StateAction.EXIT),
        _torch.enter_inference_mode: StateOp(StateKind.INFERENCE, StateAction.ENTER),
        _torch.exit_inference_mode: StateOp(StateKind.INFERENCE, StateAction.EXIT),
        _torch.enter_dual_level: StateOp(StateKind.DUAL, StateAction.ENTER),
        _torch.exit_dual_level: StateOp(StateKind.DUAL, StateAction.EXIT),
    }
    opaque_pairs = [
        *_torch.nesting_pairs,
        *_torch.record_function_pairs,
    ]
    for enter, exit_ in opaque_pairs:
        known[enter] = StateOp(StateKind.OPAQUE, StateAction.ENTER)
        known[exit_] = StateOp(StateKind.OPAQUE, StateAction.EXIT)
    known[_torch.set_inplace_requires_grad_allowed] = StateOp(
        StateKind.OPAQUE, StateAction.TOGGLE
    )
    return known


_KNOWN = _known_targets()

# Calls that look like global-state changes but are not in the table above are treated as
# opaque: a cut never falls between such an enter and its exit.
_ENTER_MARKS = ("_enter_", "increment_nesting", "_record_function_enter")
_EXIT_MARKS = ("_exit_", "decrement_nesting", "_record_function_exit")
_SET_PREFIXES = ("_set_", "set_")


def classify(node: fx.Node) -> StateOp | None:
    """The global-state operation ``node`` performs, or ``None`` for an ordinary node."""
    if node.op != "call_function":
        return None
    target = node.target
    try:
        known = _KNOWN.get(target)
    except TypeError:  # unhashable target
        known = None
    if known is not None:
        return known
    if target is operator.getitem:
        return None
    name = getattr(target, "__name__", "") or str(target)
    if any(mark in name for mark in _ENTER_MARKS):
        return StateOp(StateKind.OPAQUE, StateAction.ENTER)
    if any(mark in name for mark in _EXIT_MARKS):
        return StateOp(StateKind.OPAQUE, StateAction.EXIT)
    module = getattr(target, "__module__", "") or ""
    if name.startswith(_SET_PREFIXES) and module.startswith("torch") and not node.users:
        return StateOp(StateKind.OPAQUE, StateAction.TOGGLE)
    return None


@dataclass(frozen=True, slots=True)
class Ambient:
    """The global state a graph is entered with (Dynamo guards on it)."""

    grad: bool
    fwd_grad: bool

    @classmethod
    def capture(cls) -> Ambient:
        return cls(grad=torch.is_grad_enabled(), fwd_grad=_torch.is_fwd_grad_enabled())


@dataclass(frozen=True, slots=True)
class OpenRegion:
    """A re-enterable region (autocast, inference mode, dual level) open at some point."""

    kind: StateKind
    enter: fx.Node
    grad_before: bool
    """Grad mode just before the region was entered (inference mode restores it on exit)."""


@dataclass(frozen=True, slots=True)
class PointState:
    """The global state in force just before a node of the original graph."""

    grad: bool
    fwd_grad: bool
    regions: tuple[OpenRegion, ...]
    opaque_depth: int

    @property
    def cuttable(self) -> bool:
        return self.opaque_depth == 0


def grad_after_enter(region_kind: StateKind, enter: fx.Node, grad: bool) -> bool:
    """Grad mode right after entering a region (inference mode sets it to ``not mode``)."""
    if region_kind is StateKind.INFERENCE:
        mode = enter.args[0] if enter.args else enter.kwargs.get("mode", True)
        return not bool(mode)
    return grad


def simulate(nodes: Sequence[fx.Node], ambient: Ambient) -> list[PointState]:
    """State before each of ``nodes`` and after the last one (``len(nodes) + 1`` entries)."""
    grad, fwd_grad = ambient.grad, ambient.fwd_grad
    regions: tuple[OpenRegion, ...] = ()
    opaque = 0
    toggled: set[object] = set()
    states: list[PointState] = []
    current = PointState(grad, fwd_grad, regions, 0)
    for node in nodes:
        states.append(current)
        op = classify(node)
        if op is None:
            continue
        if op.kind is StateKind.GRAD:
            grad = bool(node.args[0])
        elif op.kind is StateKind.FWD_GRAD:
            fwd_grad = bool(node.args[0])
        elif op.kind is StateKind.OPAQUE:
            if op.action is StateAction.ENTER:
                opaque += 1
            elif op.action is StateAction.EXIT:
                opaque = max(0, opaque - 1)
            elif node.target in toggled:
                toggled.discard(node.target)
                opaque -= 1
            else:
                toggled.add(node.target)
                opaque += 1
        elif op.action is StateAction.ENTER:
            regions = (*regions, OpenRegion(op.kind, node, grad))
            grad = grad_after_enter(op.kind, node, grad)
        else:
            regions, grad = _exit_region(regions, op.kind, node, grad)
        current = PointState(grad, fwd_grad, regions, opaque)
    states.append(current)
    return states


def unpaired_toggles(nodes: Sequence[fx.Node]) -> list[fx.Node]:
    """Setter calls read as toggles (:attr:`StateAction.TOGGLE`) that no second call of the
    same setter closes: each leaves the rest of the graph uncuttable."""
    open_at: dict[object, fx.Node] = {}
    for node in nodes:
        op = classify(node)
        if op is None or op.action is not StateAction.TOGGLE:
            continue
        if open_at.pop(node.target, None) is None:
            open_at[node.target] = node
    return list(open_at.values())


def _exit_region(
    regions: tuple[OpenRegion, ...], kind: StateKind, exit_node: fx.Node, grad: bool
) -> tuple[tuple[OpenRegion, ...], bool]:
    """Close the region ``exit_node`` exits: the one it names, else the innermost of its kind."""
    named = exit_node.args[0] if exit_node.args else None
    for i in range(len(regions) - 1, -1, -1):
        region = regions[i]
        if region.kind is kind and (not isinstance(named, fx.Node) or region.enter is named):
            if kind is StateKind.INFERENCE:
                grad = region.grad_before
            return regions[:i] + regions[i + 1 :], grad
    return regions, grad
