"""Cut activation-checkpoint regions at DDP's bucket boundaries, before the graph is planned.

Note [Cutting checkpoint regions]
---------------------------------
A non-reentrant ``torch.utils.checkpoint.checkpoint`` reaches the backend as one node,
``tag_activation_checkpoint(body, *inputs, **checkpoint_kwargs)``, whose body is a graph of
its own. Its backward (recompute, then the body's backward) is one autograd node, so every
bucket whose gradients it completes waits for all of it, and cutting the graph around the
node changes nothing: with one region over six layers, each a bucket, no bucket goes out
before backward ends (torch's DDPOptimizer keeps regions whole too).

So a region that DDP's buckets cross is itself cut at the bucket boundaries into consecutive
regions: the body is split like a graph (``split.py``, each part re-creating the global state
of its stretch: an autocast or ``no_grad`` inside the body stays exact), and each part becomes
a ``tag_activation_checkpoint`` node of its own, with the region's keyword arguments
(``preserve_rng_state``, ``determinism_check``, ...) and its body's metadata (a selective
checkpointing ``context_fn`` travels there). Each part recomputes in its own backward and
replays its own forward's random state, and the pieces the planner then cuts between parts
hand their buckets to DDP while the region's earlier parts are still to run.

Where the boundaries fall: the gradients of a region's parameters complete in reverse order
of their first use inside its body (``ParamUse.within``), so DDP's packing (``plan.ddp_packing``
over ``plan.ready_order``) says which body node each bucket begins at. A boundary inside a body
goes in front of that node, or is moved earlier by the same rules as a cut of the graph
(``layout.py``), never past the bucket in front; nested regions are single nodes of the body
and are never cut into.

Memory. Whole, a region keeps only its inputs for backward; each part keeps its own, so a cut
keeps every activation crossing it (made in one part, read by a later one) until backward
reaches it. Checkpointing is there to save memory, so by default (``split_checkpoints=
"budget"``) a region is cut only where those extra bytes stay within ``checkpoint_budget`` of
what checkpointing the region saves: the bytes its body makes (estimated from Dynamo's example
values, views not counted) less the inputs it keeps whole. Cuts are taken cheapest first
while the union of their crossing activations fits; the rest are left out, and the plan says
which and why (:class:`~ddp_split_backend.plan.RegionCut`). ``"always"`` cuts at every boundary,
``"never"`` keeps every region whole.

A cut only helps where the graph is also cut between the parts: after planning, parts that
ended up in one piece (grouped buckets, a cut the graph could not take) are joined again and
the graph planned once more.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from operator import attrgetter

import torch.fx as fx

from . import _torch
from .config import BucketCaps
from .cost import value_bytes
from .layout import AdjustReason, GraphLayout, layout_graph
from .params import ParamTable, is_checkpoint_region
from .plan import BoundaryAdjustment, RegionCut, RegionOutcome, ddp_packing, ready_order
from .split import split_graph
from .state import Ambient

__all__ = ["RegionSplit", "cut_regions"]


@dataclass(frozen=True, slots=True)
class RegionSplit:
    """The graph with its checkpoint regions cut, and what was done to each region."""

    gm: fx.GraphModule
    """The rewritten graph (the input graph itself when no region was cut)."""
    records: tuple[RegionCut, ...]
    """One per region a bucket boundary falls inside, in graph order."""
    part_starts: Mapping[str, tuple[str, ...]]
    """Per cut region (node name): the nodes of ``gm`` that start its second, third, ... part."""


@dataclass(frozen=True, slots=True)
class _Wanted:
    before: int
    """Body node index a bucket begins at."""
    floor: int
    """Body index of the last node completing a parameter of the bucket in front."""


def _wanted_region_cuts(layout: GraphLayout, params: ParamTable, caps: BucketCaps) -> dict[int, list[_Wanted]]:
    """Bucket boundaries that fall inside checkpoint regions, by the region's node index."""
    order = ready_order(params)
    position = {use.name: use.position for use in order}
    packed = list(reversed(ddp_packing([(use.name, use.nbytes) for use in order], caps)))  # forward order
    wanted: dict[int, list[_Wanted]] = {}
    for ahead, bucket in zip(packed, packed[1:]):
        back = max(position[name] for name in ahead)
        front = min(position[name] for name in bucket)
        inside = len(front) > 1 and len(back) > 1 and front[0] == back[0]
        if inside and back[1] < front[1] and is_checkpoint_region(layout.nodes[front[0]]):
            wanted.setdefault(front[0], []).append(_Wanted(before=front[1], floor=back[1]))
    return wanted


def cut_regions(
    gm: fx.GraphModule,
    layout: GraphLayout,
    params: ParamTable,
    param_placeholders: frozenset[fx.Node],
    caps: BucketCaps,
    *,
    policy: str,
    budget: float,
    keep: Mapping[str, frozenset[str]] | None = None,
) -> RegionSplit:
    """Cut the checkpoint regions of ``gm`` that DDP's buckets cross (Note [Cutting
    checkpoint regions]).

    Args:
        policy: ``split_checkpoints``: ``"budget"``, ``"always"`` or ``"never"``.
        budget: ``checkpoint_budget``.
        keep: per region (node name), the body nodes a cut may go in front of (the parts that
            ended up in different pieces); ``None``: any.
    """
    if not any(is_checkpoint_region(node) for node in layout.nodes):
        return RegionSplit(gm, (), {})
    wanted = _wanted_region_cuts(layout, params, caps)
    records: list[RegionCut] = []
    cuts: dict[fx.Node, tuple[tuple[int, ...], GraphLayout, fx.GraphModule]] = {}
    for index, found in sorted(wanted.items()):
        region = layout.nodes[index]
        body: fx.GraphModule = attrgetter(str(region.args[0].target))(gm)  # type: ignore[union-attr]
        state = layout.states[index]
        body_layout = layout_graph(body, Ambient(grad=state.grad, fwd_grad=state.fwd_grad))
        placed, adjustments = _place(body_layout, found)
        grouped = keep is not None and bool(placed)
        if keep is not None:
            placed = [p for p in placed if body_layout.nodes[p].name in keep.get(region.name, frozenset())]
        kept_whole = sum(value_bytes(a) for a in region.all_input_nodes[1:] if a not in param_placeholders)
        unrolled = sum(value_bytes(n) for n in body_layout.nodes)
        allowed = None if policy == "always" else int(budget * max(unrolled - kept_whole, 0))
        chosen = [] if policy == "never" else _within_budget(body_layout, placed, allowed)
        unusable = _unsplittable(region, body)
        if unusable is not None:
            chosen = []
        outcome = _outcome(policy, len(found), placed, chosen, unusable, grouped)
        records.append(
            RegionCut(
                region=region.name,
                body=str(region.args[0].target),  # type: ignore[union-attr]
                boundaries=len(found),
                before=tuple(body_layout.nodes[p].name for p in chosen),
                extra_bytes=_crossing_bytes(body_layout, chosen),
                allowed_bytes=allowed,
                kept_whole_bytes=kept_whole,
                unrolled_bytes=unrolled,
                outcome=outcome,
                adjustments=tuple(adjustments),
                why_whole=unusable,
            )
        )
        if chosen:
            cuts[region] = (tuple(chosen), body_layout, body)
    if not cuts:
        return RegionSplit(gm, tuple(records), {})
    rewritten, starts = _rewrite(gm, cuts)
    return RegionSplit(rewritten, tuple(records), starts)


def _place(body_layout: GraphLayout, found: Sequence[_Wanted]) -> tuple[list[int], list[BoundaryAdjustment]]:
    """Legal cut positions in the body for the wanted boundaries (moved earlier, never past
    the bucket in front), and the moves."""
    nodes, blocked = body_layout.nodes, body_layout.blocked
    placed: list[int] = []
    adjustments: list[BoundaryAdjustment] = []
    for want in found:
        at = next((p for p in range(want.before, want.floor, -1) if blocked[p] is None), None)
        if at != want.before:
            reason = blocked[want.before] or AdjustReason.NO_OUTPUT
            adjustments.append(
                BoundaryAdjustment(reason, nodes[want.before].name, nodes[at].name if at is not None else None)
            )
        if at is not None and (not placed or at > placed[-1]):
            placed.append(at)
    return placed, adjustments


def _crossing(body_layout: GraphLayout, cut: int) -> set[fx.Node]:
    """Values made in front of body position ``cut`` and read behind it (by the body)."""
    index = {n: i for i, n in enumerate(body_layout.nodes)}
    return {
        node
        for node in body_layout.nodes[:cut]
        if any(index.get(user, -1) >= cut for user in node.users)
    }


def _crossing_bytes(body_layout: GraphLayout, cuts: Sequence[int]) -> int:
    kept: set[fx.Node] = set()
    for cut in cuts:
        kept |= _crossing(body_layout, cut)
    return sum(value_bytes(n) for n in kept)


def _within_budget(body_layout: GraphLayout, placed: Sequence[int], allowed: int | None) -> list[int]:
    """The cuts to make: all with no budget, else the cheapest first while the activations
    they keep (each counted once) fit."""
    if allowed is None:
        return list(placed)
    crossing = {cut: _crossing(body_layout, cut) for cut in placed}
    chosen: list[int] = []
    kept: set[fx.Node] = set()
    for cut in sorted(placed, key=lambda c: (sum(value_bytes(n) for n in crossing[c]), -c)):
        more = kept | crossing[cut]
        if sum(value_bytes(n) for n in more) <= allowed:
            chosen.append(cut)
            kept = more
    return sorted(chosen)


def _unsplittable(region: fx.Node, body: fx.GraphModule) -> str | None:
    """Why the region cannot be rewritten as consecutive regions, if so."""
    output = next(n for n in reversed(body.graph.nodes) if n.op == "output")
    results = output.args[0]
    if not isinstance(results, (tuple, list)) or not all(isinstance(r, fx.Node) for r in results):
        return "its body does not return a flat tuple of values"
    if not all(u.op == "call_function" and u.target is operator.getitem for u in region.users):
        return "its result is used other than by indexing"
    return None


def _outcome(
    policy: str, wanted: int, placed: Sequence[int], chosen: Sequence[int], unusable: str | None, grouped: bool
) -> RegionOutcome:
    if unusable is not None:
        return RegionOutcome.WHOLE_UNSPLITTABLE
    if policy == "never":
        return RegionOutcome.WHOLE_NEVER
    if not placed:
        return RegionOutcome.WHOLE_GROUPED if grouped else RegionOutcome.WHOLE_NO_PLACE
    if not chosen:
        return RegionOutcome.WHOLE_BUDGET
    if len(chosen) < wanted:
        return RegionOutcome.PARTLY_CUT
    return RegionOutcome.CUT


def _rewrite(
    gm: fx.GraphModule, cuts: Mapping[fx.Node, tuple[tuple[int, ...], GraphLayout, fx.GraphModule]]
) -> tuple[fx.GraphModule, dict[str, tuple[str, ...]]]:
    """``gm`` with each region in ``cuts`` replaced by consecutive regions, one per part."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    bodies: dict[str, fx.GraphModule] = {}
    starts: dict[str, tuple[str, ...]] = {}
    taken = {str(n.target) for n in gm.graph.nodes if n.op in ("get_attr", "call_module")}
    for node in gm.graph.nodes:
        if node in env:  # an index into a region already cut
            continue
        if node not in cuts:
            env[node] = graph.node_copy(node, lambda n: env[n])
            continue
        positions, body_layout, body = cuts[node]
        parts = split_graph(body, body_layout, positions, called_with_ambient_grad=True)
        value_of: dict[int, fx.Node] = {i: env[a] for i, a in enumerate(node.args[1:])}  # type: ignore[index]
        part_nodes: list[str] = []
        for part in parts.pieces:
            name = _fresh(f"{node.args[0].target}_part{part.index}", taken)  # type: ignore[union-attr]
            part.gm.meta.update(body.meta)  # a selective-checkpointing context_fn lives there
            bodies[name] = part.gm
            results = next(n for n in reversed(part.gm.graph.nodes) if n.op == "output").args[0]
            call = graph.call_function(
                _torch.checkpoint_region_op,
                (graph.get_attr(name), *(value_of[s] for s in part.inputs)),
                dict(node.kwargs),
            )
            call.meta = {**node.meta, "example_value": tuple(r.meta.get("example_value") for r in results)}
            part_nodes.append(call.name)
            for j, slot in enumerate(part.outputs):
                item = graph.call_function(operator.getitem, (call, j))
                item.meta = {**node.meta, "example_value": results[j].meta.get("example_value")}
                value_of[slot] = item
        for user in node.users:
            leaf = parts.output_leaves[user.args[1]]  # type: ignore[index]
            assert leaf is not None  # _unsplittable: the body returns nodes only
            env[user] = value_of[leaf]
        starts[node.name] = tuple(part_nodes[1:])
    root = {**{t: attrgetter(t)(gm) for t in taken if _reachable(gm, t)}, **bodies}
    used = {str(n.target) for n in graph.nodes if n.op in ("get_attr", "call_module")}
    rewritten = fx.GraphModule({t: m for t, m in root.items() if t in used}, graph, class_name=type(gm).__name__)
    rewritten.meta.update(gm.meta)
    return rewritten, starts


def _reachable(gm: fx.GraphModule, target: str) -> bool:
    try:
        attrgetter(target)(gm)
    except AttributeError:
        return False
    return True


def _fresh(name: str, taken: set[str]) -> str:
    candidate, n = name, 0
    while candidate in taken:
        n += 1
        candidate = f"{name}_{n}"
    taken.add(candidate)
    return candidate
