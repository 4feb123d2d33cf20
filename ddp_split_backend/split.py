"""Cut a graph into self-contained pieces at the planned positions.

Pieces are contiguous runs of the graph's nodes, so building them is one linear pass. Every
piece is an ``fx.GraphModule`` that takes the values it reads (original inputs and outputs
of earlier pieces), returns a tuple of the values later pieces or the graph output need, and
re-creates the global state of its stretch of the original graph (see
Note [Global state across pieces] in ``state.py``).

Example::

    >>> split = split_graph(gm, layout, cuts=(5,))
    >>> print(split.pieces[1].gm.code)  # doctest: +SKIP
    def forward(self, y, l_w_):
        _enter_autocast = torch.amp.autocast_mode._enter_autocast('cpu', torch.bfloat16, True, None)
        ...
        _exit_autocast = torch.amp.autocast_mode._exit_autocast(_enter_autocast)
        return (z,)

Note [Gradient order inside a piece]
------------------------------------
All gradients of a piece become ready together, when the piece's backward finishes, and
autograd accumulates them in an order its ready queue chooses. The order DDP's rebuild sees
is fixed at run time instead (Note [Pieces are DDP's buckets] in ready_order.py); a piece's
parameters are still placed last among its inputs, in ascending size, so that its graph
reads the same whatever order Dynamo lifted them in.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from operator import attrgetter
from typing import Any

import torch
import torch.fx as fx

from . import _torch
from .layout import GraphLayout
from .state import Ambient, PointState, StateKind, grad_after_enter

__all__ = ["Piece", "SplitGraph", "split_graph"]

_SET_GRAD = _torch.set_grad_enabled
_SET_FWD_GRAD = _torch.set_fwd_grad_enabled
_EXITS = {
    StateKind.AUTOCAST: _torch.exit_autocast,
    StateKind.INFERENCE: _torch.exit_inference_mode,
}


@dataclass(frozen=True, slots=True)
class Piece:
    """One piece of the split graph; values travel between pieces through numbered slots."""

    index: int
    gm: fx.GraphModule
    inputs: tuple[int, ...]
    """Slots read, in the order of the piece's placeholders."""
    outputs: tuple[int, ...]
    """Slots written, in the order of the piece's output tuple."""
    release: tuple[int, ...]
    """Slots no later piece reads and the graph does not return: dropped after this piece."""
    grad: bool
    """Whether grad mode is on anywhere inside the piece. The piece is compiled and called
    with grad mode set to this: AOTAutograd decides from the grad mode at call time whether
    to record autograd at all (its own state nodes then switch it inside the piece)."""


@dataclass(frozen=True, slots=True)
class SplitGraph:
    """The pieces of a graph and how their values connect."""

    pieces: tuple[Piece, ...]
    num_inputs: int
    """Slots ``0 .. num_inputs - 1`` hold the graph's own inputs."""
    num_slots: int
    output_leaves: tuple[int | None, ...]
    """Per leaf of the graph output: the slot holding it, or ``None`` for a constant."""
    output_constants: tuple[Any, ...]
    output_spec: _torch.pytree.TreeSpec
    placeholders: tuple[fx.Node, ...]


def _emit_entry(graph: fx.Graph, state: PointState, ambient: Ambient, grad: bool, env: dict) -> None:
    """Re-create ``state`` at the top of a piece called with grad mode ``grad`` and otherwise
    the ambient state."""
    for region in state.regions:
        if region.kind is StateKind.INFERENCE and region.grad_before != grad:
            graph.call_function(_SET_GRAD, (region.grad_before,))
            grad = region.grad_before
        enter = region.enter
        args = fx.node.map_arg(enter.args, lambda n: env[n])
        kwargs = fx.node.map_arg(enter.kwargs, lambda n: env[n])
        replayed = graph.call_function(enter.target, args, kwargs)
        replayed.meta = dict(enter.meta)
        env[enter] = replayed
        grad = grad_after_enter(region.kind, enter, grad)
    if state.grad != grad:
        graph.call_function(_SET_GRAD, (state.grad,))
    if state.fwd_grad != ambient.fwd_grad:
        graph.call_function(_SET_FWD_GRAD, (state.fwd_grad,))


def _emit_exit(graph: fx.Graph, state: PointState, ambient: Ambient, call_grad: bool, env: dict) -> None:
    """Undo ``state`` at the bottom of a piece, back to the state it was called with."""
    grad = state.grad
    dual_depth = sum(r.kind is StateKind.DUAL for r in state.regions)
    for region in reversed(state.regions):
        if region.kind is StateKind.DUAL:
            dual_depth -= 1
            graph.call_function(
                _torch.exit_dual_level, (), {"level": dual_depth}
            )
            continue
        graph.call_function(_EXITS[region.kind], (env[region.enter],))
        if region.kind is StateKind.INFERENCE:
            grad = region.grad_before
    if grad != call_grad:
        graph.call_function(_SET_GRAD, (call_grad,))
    if state.fwd_grad != ambient.fwd_grad:
        graph.call_function(_SET_FWD_GRAD, (ambient.fwd_grad,))


def _reducer_order_key(node: fx.Node) -> tuple[int, int]:
    """Parameters last and smallest first: see Note [Gradient order inside a piece]."""
    value = node.meta.get("example_value")
    if isinstance(value, torch.nn.Parameter):
        return (1, value.numel() * value.element_size())
    return (0, 0)


def _copy_placeholder(graph: fx.Graph, source: fx.Node) -> fx.Node:
    placeholder = graph.placeholder(source.name, type_expr=source.type)
    placeholder.meta = dict(source.meta)
    dynamo_source = _torch.dynamo_source(source)
    if dynamo_source is not None:
        _torch.set_dynamo_source(placeholder, dynamo_source)
    return placeholder


def split_graph(
    gm: fx.GraphModule, layout: GraphLayout, cuts: Sequence[int], *, called_with_ambient_grad: bool = False
) -> SplitGraph:
    """Build the pieces of ``gm`` for cuts in front of ``layout.nodes[c]`` for ``c`` in ``cuts``.

    Args:
        gm: the graph to split; it is not modified.
        layout: ``layout_graph(gm, ...)``.
        cuts: strictly increasing positions in ``1 .. len(layout.nodes) - 1``.
        called_with_ambient_grad: the pieces will be called in the graph's ambient grad mode
            (the body of a checkpoint region, cut into regions), not each in the grad mode it
            needs (:attr:`Piece.grad`, what the runtime sets for a graph's pieces).

    Returns:
        A :class:`SplitGraph` whose pieces, run in order, compute what ``gm`` computes.
    """
    nodes = layout.nodes
    bounds = [0, *cuts, len(nodes)]
    placeholders = tuple(n for n in gm.graph.nodes if n.op == "placeholder")
    output_node = next(n for n in reversed(gm.graph.nodes) if n.op == "output")

    piece_of: dict[fx.Node, int] = {}
    for k in range(len(bounds) - 1):
        for node in nodes[bounds[k] : bounds[k + 1]]:
            piece_of[node] = k
    slot: dict[fx.Node, int] = {ph: i for i, ph in enumerate(placeholders)}
    last_reader: dict[int, int] = {}
    region_enters = {r.enter for s in (layout.states[b] for b in bounds) for r in s.regions}

    built: list[Piece] = []  # their ``release`` is known once every piece is built
    for k in range(len(bounds) - 1):
        start, stop = bounds[k], bounds[k + 1]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        seen: set[fx.Node] = set()
        inputs: list[fx.Node] = []
        for node in nodes[start:stop]:
            for arg in node.all_input_nodes:
                if arg in seen or arg.op == "get_attr" or arg in region_enters:
                    continue
                if arg.op == "placeholder" or piece_of.get(arg, k) < k:
                    seen.add(arg)
                    inputs.append(arg)
        inputs.sort(key=_reducer_order_key)  # stable: other inputs keep first-use order
        for arg in inputs:
            env[arg] = _copy_placeholder(graph, arg)
        call_grad = (
            layout.ambient.grad if called_with_ambient_grad else any(s.grad for s in layout.states[start : stop + 1])
        )
        _emit_entry(graph, layout.states[start], layout.ambient, call_grad, env)
        attrs: dict[str, Any] = {}
        for node in nodes[start:stop]:
            for arg in node.all_input_nodes:
                if arg.op == "get_attr" and arg not in env:
                    attrs[str(arg.target)] = attrgetter(str(arg.target))(gm)
                    env[arg] = graph.get_attr(str(arg.target))
                    env[arg].meta = dict(arg.meta)
            env[node] = graph.node_copy(node, lambda n: env[n])
        _emit_exit(graph, layout.states[stop], layout.ambient, call_grad, env)
        outputs = [
            n
            for n in nodes[start:stop]
            if n not in region_enters
            and any(u is output_node or piece_of.get(u, k) > k for u in n.users)
        ]
        graph.output(tuple(env[n] for n in outputs))
        for n in outputs:
            slot[n] = len(slot)
        in_slots = [slot[n] for n in inputs]
        for s in in_slots:
            last_reader[s] = k
        piece_gm = fx.GraphModule(attrs, graph, class_name=f"DDPSplitPiece{k}")
        built.append(Piece(k, piece_gm, tuple(in_slots), tuple(slot[n] for n in outputs), (), call_grad))

    leaves, spec = _torch.pytree.tree_flatten(output_node.args[0])
    output_leaves = tuple(slot[x] if isinstance(x, fx.Node) else None for x in leaves)
    output_constants = tuple(None if isinstance(x, fx.Node) else x for x in leaves)
    returned = {s for s in output_leaves if s is not None}
    release: dict[int, list[int]] = {}
    for s, k in last_reader.items():
        if s not in returned:
            release.setdefault(k, []).append(s)

    pieces = tuple(replace(piece, release=tuple(sorted(release.get(piece.index, ())))) for piece in built)
    return SplitGraph(
        pieces=pieces,
        num_inputs=len(placeholders),
        num_slots=len(slot),
        output_leaves=output_leaves,
        output_constants=output_constants,
        output_spec=spec,
        placeholders=placeholders,
    )
