"""Graph analysis shared by the planner and the splitter: state at every node, legal cuts.

:func:`layout_graph` walks a Dynamo graph once, simulating the global state before every
node (``state.simulate``) and finding, for every position, whether a cut may go there and
if not why (:class:`AdjustReason`; Note [Bucket plan] in ``plan.py`` lists the rules).
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.fx as fx

from . import _torch
from .state import Ambient, PointState, StateAction, StateKind, classify, simulate, unpaired_toggles

__all__ = ["AdjustReason", "GraphLayout", "StateSpan", "compute_nodes", "layout_graph", "state_spans"]


class AdjustReason(enum.Enum):
    OPAQUE_REGION = "inside a functorch transform, profiler range or unknown state region"
    NON_TENSOR_VALUE = "a non-tensor value (tuple or object) would cross the cut"
    DUAL_TENSOR = "a forward-AD dual tensor would cross the cut"
    FLOAT_VALUE = (
        "a Python float traced as a symbol would cross the cut (AOTAutograd turns it into "
        "tensor math only inside the graph that reads it)"
    )
    INFERENCE_INPUT = (
        "a value viewed inside an inference_mode region would become a piece input "
        "(AOTAutograd cannot trace views of inputs there)"
    )
    NO_OUTPUT = "the piece in front of the cut would have no output"
    LEADING_NO_PARAMS = "the first piece holds no parameters; folded into the next one"
    SHARED_NODE = (
        "DDP closes the bucket between two parameters one node completes (no cut can fall "
        "inside a node): both buckets share a piece"
    )


@dataclass(frozen=True, slots=True)
class StateSpan:
    """A stretch of the graph under some global state (for pictures and tables)."""

    kind: str
    """``autocast``, ``inference mode``, ``forward-AD dual level``, ``grad mode`` (grad mode
    differs from the ambient one), ``forward-AD grad mode`` or ``uncuttable region``."""
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class GraphLayout:
    """The facts about a graph the planner and the splitter share."""

    nodes: tuple[fx.Node, ...]
    """Compute nodes in forward order: no placeholders, ``get_attr`` or output."""
    states: tuple[PointState, ...]
    """Global state before each node, and after the last (``len(nodes) + 1`` entries)."""
    blocked: tuple[AdjustReason | None, ...]
    """Why no cut may go in front of ``nodes[i]`` (``None``: it may)."""
    ambient: Ambient


_TRANSPORTABLE = (torch.Tensor, torch.SymInt, torch.SymFloat, torch.SymBool, int, float, bool)


def _is_state_token(node: fx.Node) -> bool:
    op = classify(node)
    return (
        op is not None
        and op.kind in (StateKind.AUTOCAST, StateKind.INFERENCE, StateKind.DUAL)
        and op.action is StateAction.ENTER
    )


_MISSING = object()


def _transportable(node: fx.Node) -> bool:
    """Whether the value of ``node`` may be a piece's output and the next piece's input."""
    value = node.meta.get("example_value", node.meta.get("val", _MISSING))
    return value is _MISSING or isinstance(value, _TRANSPORTABLE)


def _storage_id(value: object) -> int | None:
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return _torch.storage_id(value)
    except (RuntimeError, NotImplementedError):
        return None


def _aliases_input(user: fx.Node, value: fx.Node) -> bool:
    """Whether ``user``'s result may share storage with ``value`` (a view, ``detach``, ...)."""
    out = user.meta.get("example_value", _MISSING)
    if out is _MISSING or not isinstance(value.meta.get("example_value"), torch.Tensor):
        return True  # unknown: assume the worst
    storage = _storage_id(value.meta["example_value"])
    outs = out if isinstance(out, (tuple, list)) else (out,)
    return any(_storage_id(o) == storage for o in outs if isinstance(o, torch.Tensor))


def compute_nodes(gm: fx.GraphModule) -> tuple[fx.Node, ...]:
    """The nodes of ``gm`` that compute, in forward order: no placeholders, ``get_attr`` or output."""
    return tuple(n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output"))


def layout_graph(gm: fx.GraphModule, ambient: Ambient) -> GraphLayout:
    """Simulate global state and find the legal cut positions of ``gm``; linear in its size."""
    nodes = compute_nodes(gm)
    count = len(nodes)
    index = {n: i for i, n in enumerate(nodes)}
    states = simulate(nodes, ambient)
    for node in unpaired_toggles(nodes):
        warnings.warn(
            f"ddp_split: {node.format_node()} is read as a global-state setter (a torch function "
            "named set_* whose result is unused) that no second call undoes; no cut can fall after "
            "it, so the rest of the graph becomes one piece (Note [Global state across pieces])",
            stacklevel=2,
        )

    # Difference arrays over cut positions 1..count-1: value defined at i crosses cuts i+1..last.
    live = [0] * (count + 2)
    odd = [0] * (count + 2)
    dual = [0] * (count + 2)
    floats = [0] * (count + 2)
    inference_read = [0] * (count + 2)
    in_inference = [any(r.kind is StateKind.INFERENCE for r in s.regions) for s in states]
    make_dual, unpack = _torch.dual_makers, _torch.dual_unpackers
    tainted: set[fx.Node] = set()
    for i, node in enumerate(nodes):
        if (node.op == "call_function" and node.target in make_dual) or (
            node.op in ("call_function", "call_method", "call_module")
            and node.target not in unpack
            and any(a in tainted for a in node.all_input_nodes)
        ):
            tainted.add(node)
        if _is_state_token(node):
            continue
        last = max((index.get(u, count) for u in node.users), default=i)
        if last <= i:
            continue
        live[i + 1] += 1
        live[last + 1] -= 1
        if not _transportable(node):
            odd[i + 1] += 1
            odd[last + 1] -= 1
        if node in tainted:
            dual[i + 1] += 1
            dual[last + 1] -= 1
        if isinstance(node.meta.get("example_value"), torch.SymFloat):
            floats[i + 1] += 1
            floats[last + 1] -= 1
        last_inference = max(
            (
                index[u]
                for u in node.users
                if u in index and in_inference[index[u]] and _aliases_input(u, node)
            ),
            default=i,
        )
        if last_inference > i:
            inference_read[i + 1] += 1
            inference_read[last_inference + 1] -= 1

    blocked: list[AdjustReason | None] = [None] * count
    n_live = n_odd = n_dual = n_float = n_inference = 0
    for p in range(count):
        n_live += live[p]
        n_odd += odd[p]
        n_dual += dual[p]
        n_float += floats[p]
        n_inference += inference_read[p]
        if p == 0:
            blocked[p] = AdjustReason.NO_OUTPUT
        elif not states[p].cuttable:
            blocked[p] = AdjustReason.OPAQUE_REGION
        elif n_odd:
            blocked[p] = AdjustReason.NON_TENSOR_VALUE
        elif n_dual:
            blocked[p] = AdjustReason.DUAL_TENSOR
        elif n_float:
            blocked[p] = AdjustReason.FLOAT_VALUE
        elif n_inference:
            blocked[p] = AdjustReason.INFERENCE_INPUT
        elif not n_live:
            blocked[p] = AdjustReason.NO_OUTPUT
    return GraphLayout(nodes=nodes, states=tuple(states), blocked=tuple(blocked), ambient=ambient)


def state_spans(layout: GraphLayout) -> tuple[StateSpan, ...]:
    """Where each region, changed grad mode and uncuttable stretch begins and ends."""
    spans: list[StateSpan] = []
    open_at: dict[object, int] = {}
    states = layout.states
    for i, state in enumerate(states):
        keys: dict[object, str] = {r.enter: r.kind.value for r in state.regions}
        if state.grad != layout.ambient.grad:
            keys["grad"] = StateKind.GRAD.value
        if state.fwd_grad != layout.ambient.fwd_grad:
            keys["fwd_grad"] = StateKind.FWD_GRAD.value
        if not state.cuttable:
            keys["opaque"] = StateKind.OPAQUE.value
        for key in list(open_at):
            if key not in keys:
                spans.append(StateSpan(kind=_span_kind(key, states, open_at[key]), start=open_at.pop(key), stop=i))
        for key in keys:
            open_at.setdefault(key, i)
    for key, start in open_at.items():
        spans.append(StateSpan(kind=_span_kind(key, states, start), start=start, stop=len(states) - 1))
    return tuple(sorted(spans, key=lambda s: (s.start, s.stop)))


def _span_kind(key: object, states: Sequence[PointState], start: int) -> str:
    if isinstance(key, fx.Node):
        return next(r.kind.value for r in states[start].regions if r.enter is key)
    return {"grad": StateKind.GRAD, "fwd_grad": StateKind.FWD_GRAD, "opaque": StateKind.OPAQUE}[key].value  # type: ignore[index]
