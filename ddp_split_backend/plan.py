"""Plan where to cut a Dynamo graph: buckets like DDP's reducer, boundaries only where legal.

Note [Bucket plan]
------------------
DDP's reducer launches a gradient bucket's allreduce as soon as every gradient in it is
complete. Backward visits the graph from the output back, so the planner walks the graph
in reverse, adding each node to the current bucket and counting a parameter's bytes at the
node where its gradient becomes complete: its *first* use in forward order (a tied weight
used at the start and at the end is complete only when backward reaches the start). When
the bucket has reached its capacity (the first bucket has its own, smaller one), the next
node opens a new bucket, i.e. a cut is wanted in front of the nodes collected so far.

A cut is only placed where both sides can be compiled on their own. It is moved earlier
(in forward order; the bucket grows) while the wanted position is

* inside an opaque region: a functorch transform (``torch.vmap``, ``torch.func.*``), a
  profiler range, or a state-like call we do not know (see Note [Global state across pieces]);
* crossed by a value that cannot be a graph input: a tuple, an object, a forward-AD dual
  tensor (exiting the dual level at the end of a piece would strip its tangent);
* crossed by a value that a later piece views (``detach``, ``view``, ...) inside an
  ``inference_mode`` region: as a piece input it would be a graph input there, and
  AOTAutograd fails on views of graph inputs inside inference mode (plain
  ``torch.compile`` fails the same way on real inputs);
* crossed by nothing at all: the piece in front would have no output.

Higher-order ops (activation checkpoint, flex_attention's ``score_mod``) are single nodes
whose bodies are ``get_attr`` modules; the splitter copies those attributes into every piece
that needs them, so no cut can fall inside one. A leading piece without parameters is folded
into its neighbour. Every moved cut is recorded, with its reason, in the plan.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .config import BucketCaps
from .params import ParamTable
from .state import Ambient, PointState, StateAction, StateKind, classify, simulate

__all__ = [
    "AdjustReason",
    "BoundaryAdjustment",
    "BucketPlan",
    "GraphLayout",
    "SplitPlan",
    "StateSpan",
    "layout_graph",
    "plan_buckets",
]


class AdjustReason(enum.Enum):
    OPAQUE_REGION = "inside a functorch transform, profiler range or unknown state region"
    NON_TENSOR_VALUE = "a non-tensor value (tuple or object) would cross the cut"
    DUAL_TENSOR = "a forward-AD dual tensor would cross the cut"
    INFERENCE_INPUT = (
        "a value viewed inside an inference_mode region would become a piece input "
        "(AOTAutograd cannot trace views of inputs there)"
    )
    NO_OUTPUT = "the piece in front of the cut would have no output"
    LEADING_NO_PARAMS = "the first piece holds no parameters; folded into the next one"


@dataclass(frozen=True, slots=True)
class BoundaryAdjustment:
    """A cut that could not go where the bucket capacity wanted it."""

    reason: AdjustReason
    wanted_before: str
    """Name of the node the cut was wanted in front of."""
    placed_before: str | None
    """Name of the node the cut was placed in front of; ``None``: no cut was made."""

    def describe(self) -> str:
        where = f"moved before {self.placed_before}" if self.placed_before else "dropped"
        return f"cut before {self.wanted_before} {where}: {self.reason.value}"


@dataclass(frozen=True, slots=True)
class BucketPlan:
    """One piece of the split graph, which is one DDP gradient bucket."""

    piece: int
    """Position in forward order (piece 0 runs first)."""
    bucket: int
    """DDP's bucket index: 0 holds the gradients that are ready first (the last piece)."""
    nbytes: int
    params: tuple[str, ...]
    """Trainable parameters completed in this piece, as module FQNs (``net.0.weight``)."""
    start: int
    stop: int
    """Node range ``[start, stop)`` in the graph's node list (placeholders/output excluded)."""
    adjustments: tuple[BoundaryAdjustment, ...] = ()
    """Cuts in front of this piece that were moved or dropped, and why."""

    @property
    def node_count(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True)
class StateSpan:
    """A stretch of the graph under some global state (for pictures and tables)."""

    kind: str
    """``autocast``, ``inference mode``, ``forward-AD dual level``, ``grad mode`` (grad mode
    differs from the ambient one), ``forward-AD grad mode`` or ``uncuttable region``."""
    start: int
    stop: int


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """Where one Dynamo graph is cut. Returned by :func:`ddp_split_backend.plan_split`."""

    buckets: tuple[BucketPlan, ...]
    """Pieces in forward order."""
    caps: BucketCaps
    node_count: int
    ignored_params: tuple[str, ...] = ()
    graph_name: str = ""
    state_spans: tuple[StateSpan, ...] = ()
    source: str = "ddp_split"
    """``ddp_split`` for our own plan; ``DDPOptimizer piece`` when torch's DDPOptimizer had
    already cut the graph and the piece was compiled whole."""
    notes: tuple[str, ...] = field(default=())

    @property
    def cuts(self) -> tuple[int, ...]:
        return tuple(b.start for b in self.buckets[1:])

    @property
    def adjustments(self) -> tuple[BoundaryAdjustment, ...]:
        return tuple(a for b in self.buckets for a in b.adjustments)

    def table(self) -> str:
        """The plan as a text table (what ``TORCH_LOGS=ddp_split`` prints)."""
        rows = [("piece", "bucket", "bytes", "nodes", "parameters")]
        for b in self.buckets:
            rows.append(
                (str(b.piece), str(b.bucket), f"{b.nbytes:,}", str(b.node_count), ", ".join(b.params) or "-")
            )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = [
            f"ddp_split plan {self.graph_name or ''} ({self.source}): {len(self.buckets)} pieces, "
            f"{self.node_count} nodes, cap {self.caps.bytes:,} B, first cap {self.caps.first_bytes:,} B"
        ]
        for r in rows:
            lines.append("  ".join(r[i].rjust(widths[i]) for i in range(4)) + "  " + r[4])
        for b in self.buckets:
            for a in b.adjustments:
                lines.append(f"  piece {b.piece}: {a.describe()}")
        if self.ignored_params:
            lines.append("  ignored by DDP: " + ", ".join(self.ignored_params))
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


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


def _dual_sources() -> tuple[object, ...]:
    fp = torch._functorch.predispatch
    return tuple(t for t in (getattr(fp, "_make_dual", None), torch._make_dual) if t is not None)


def _unpack_targets() -> tuple[object, ...]:
    fp = torch._functorch.predispatch
    return tuple(t for t in (getattr(fp, "_unpack_dual", None), torch._unpack_dual) if t is not None)


def _storage_id(value: object) -> int | None:
    if not isinstance(value, torch.Tensor):
        return None
    try:
        return value.untyped_storage()._cdata
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


def layout_graph(gm: fx.GraphModule, ambient: Ambient) -> GraphLayout:
    """Simulate global state and find the legal cut positions of ``gm``; linear in its size."""
    nodes = tuple(n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output"))
    count = len(nodes)
    index = {n: i for i, n in enumerate(nodes)}
    states = simulate(nodes, ambient)

    # Difference arrays over cut positions 1..count-1: value defined at i crosses cuts i+1..last.
    live = [0] * (count + 2)
    odd = [0] * (count + 2)
    dual = [0] * (count + 2)
    inference_read = [0] * (count + 2)
    in_inference = [any(r.kind is StateKind.INFERENCE for r in s.regions) for s in states]
    make_dual, unpack = _dual_sources(), _unpack_targets()
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
    n_live = n_odd = n_dual = n_inference = 0
    for p in range(count):
        n_live += live[p]
        n_odd += odd[p]
        n_dual += dual[p]
        n_inference += inference_read[p]
        if p == 0:
            blocked[p] = AdjustReason.NO_OUTPUT
        elif not states[p].cuttable:
            blocked[p] = AdjustReason.OPAQUE_REGION
        elif n_odd:
            blocked[p] = AdjustReason.NON_TENSOR_VALUE
        elif n_dual:
            blocked[p] = AdjustReason.DUAL_TENSOR
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


def plan_buckets(
    layout: GraphLayout,
    params: ParamTable,
    caps: BucketCaps,
    *,
    graph_name: str = "",
) -> SplitPlan:
    """Choose the cuts of a graph (see Note [Bucket plan])."""
    nodes = layout.nodes
    count = len(nodes)
    completed = params.completed_at()

    # Reverse walk: each entry is (start, nbytes, names, adjustments) of a bucket, last piece first.
    built: list[tuple[int, int, list[str], list[BoundaryAdjustment]]] = []
    nbytes, names, adjustments = 0, [], []
    size = 0  # nodes in the current bucket
    wanted: int | None = None
    wanted_reason: AdjustReason | None = None
    bytes_since_wanted = 0  # parameter bytes in front of the wanted cut
    for i in range(count - 1, -1, -1):
        cap = caps.first_bytes if not built else caps.bytes
        if size and nbytes >= cap:
            cut = i + 1
            if wanted is None:
                wanted = cut
            reason = layout.blocked[cut] if cut < count else AdjustReason.NO_OUTPUT
            if reason is None:
                if wanted != cut and wanted_reason is not None:
                    adjustments.append(
                        BoundaryAdjustment(wanted_reason, nodes[wanted].name, nodes[cut].name)
                    )
                built.append((cut, nbytes, names, adjustments))
                nbytes, names, adjustments, size = 0, [], [], 0
                wanted = wanted_reason = None
                bytes_since_wanted = 0
            elif wanted_reason is None:
                wanted_reason = reason
        size += 1
        for use in reversed(completed.get(i, ())):
            nbytes += use.nbytes
            names.append(use.name)
            if wanted is not None:
                bytes_since_wanted += use.nbytes
    # A cut still wanted at the start only matters if parameters lie in front of it (a
    # parameter-free front would be folded back anyway).
    if wanted is not None and wanted < count and wanted_reason is not None and bytes_since_wanted:
        adjustments.append(BoundaryAdjustment(wanted_reason, nodes[wanted].name, None))
    built.append((0, nbytes, names, adjustments))
    built.reverse()

    if len(built) > 1 and built[0][1] == 0:
        first, second = built[0], built[1]
        merged_adjustments = [
            *first[3],
            *second[3],
            BoundaryAdjustment(AdjustReason.LEADING_NO_PARAMS, nodes[second[0]].name, None),
        ]
        built[:2] = [(0, second[1], first[2] + second[2], merged_adjustments)]

    buckets = []
    for piece, (start, size_bytes, piece_names, piece_adjustments) in enumerate(built):
        stop = built[piece + 1][0] if piece + 1 < len(built) else count
        buckets.append(
            BucketPlan(
                piece=piece,
                bucket=len(built) - 1 - piece,
                nbytes=size_bytes,
                params=tuple(reversed(piece_names)),
                start=start,
                stop=stop,
                adjustments=tuple(piece_adjustments),
            )
        )
    return SplitPlan(
        buckets=tuple(buckets),
        caps=caps,
        node_count=count,
        ignored_params=params.ignored,
        graph_name=graph_name,
        state_spans=state_spans(layout),
    )
