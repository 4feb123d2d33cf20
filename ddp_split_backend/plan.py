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

Note [Pieces and buckets]
-------------------------
By default every bucket is its own piece. With ``min_piece_mb`` consecutive buckets are
grouped into one piece, in backward order (bucket 0 first), until the group holds at least
that many bytes; the group the walk ends on (the front of the graph, whose gradients are
ready last) keeps what is left, however small: its communication can never overlap, so a
small last piece is the cheap one. Grouping only removes cuts between buckets, so no cut
ever falls inside a bucket and DDP's buckets are unchanged; each piece's buckets still
launch together, as soon as that piece's backward has run.

Note [Choosing pieces by cost]
------------------------------
``min_piece_mb="auto"`` groups consecutive buckets by predicted step time instead of by
bytes. Backward visits the pieces last first; piece j's buckets are ready when its backward
has run, after every piece before it in backward order, each of which also paid the fixed
cost of a piece (Note [Piece cost model] in ``cost.py``), and DDP then launches them one by
one on the same thread, each launch taking its time. One link sends buckets in the order
they are launched, so a bucket's communication ends at ``max(end of the one before's,
launched) + comm``; the step ends when the last communication, or the last launch, does,
and every piece's forward pays its fixed cost too. The candidates are *even* groupings: for
piece counts growing geometrically (:data:`_LADDER`), the buckets cut into groups of equal
backward time, and of equal communication, and groups of 1, 2, 4, ... buckets each; each is evaluated in one pass
(O(buckets x log(buckets)) in all; ``benchmarks/plan_scaling.py``). Of them, the fewest pieces
predicted within :data:`TOLERANCE` of the best is chosen. Until 2026-12-07 the search was
exact up to 32 buckets (a dynamic programme over every grouping), and where communication
dominates, its optimum was uneven: a small piece first in backward, to start the link early,
then large ones. Measured, those were slower than the even groupings beside them (RESULTS.md,
grid runs 2 and 3: 57.2 ms for 5 uneven pieces against 49.9 ms for 4 even ones), what the
model leaves out (the engine's order within a piece, the link's start) favouring
evenness; among even groupings its ranking held.
Communication per bucket is its bytes over ``link_gbps`` (``inf``: an instant link), which
``min_piece_mb="auto"`` requires: nothing at compile time can tell the link, and a plan that
every rank derives alone must not depend on anything measured while training
(``watch_overlap``'s report measures a run's link speed, ready to pass).
Grouping never cuts inside a bucket: it only chooses which bucket boundaries to keep.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field

from .config import BucketCaps
from .cost import DeviceRates, bucket_launch_s
from .layout import AdjustReason, GraphLayout, StateSpan, state_spans
from .params import ParamTable, ParamUse

__all__ = [
    "AdjustReason",
    "BACKWARD_SHARE",
    "BoundaryAdjustment",
    "BucketPlan",
    "CostInputs",
    "GraphShare",
    "PiecePlan",
    "PieceSizing",
    "RegionCut",
    "RegionOutcome",
    "SplitPlan",
    "StateSpan",
    "TOLERANCE",
    "WholeReason",
    "ddp_packing",
    "plan_buckets",
    "ready_order",
]


class WholeReason(enum.Enum):
    """Why a graph with several buckets was compiled as one piece."""

    NO_BACKWARD = "grad is disabled throughout the graph (evaluation): no backward runs and nothing is sent"


TABLE_WIDTH = 120
"""Columns of :meth:`SplitPlan.table` (and of every other table ddp_split logs)."""


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


class RegionOutcome(enum.Enum):
    """What was done with an activation-checkpoint region that DDP's buckets cross (Note
    [Cutting checkpoint regions] in regions.py)."""

    CUT = "cut at every bucket boundary inside it"
    PARTLY_CUT = "cut where the activations the cuts keep fit checkpoint_budget; the other boundaries left out"
    WHOLE_BUDGET = "kept whole: no cut keeps few enough activations for checkpoint_budget"
    WHOLE_NEVER = "kept whole: split_checkpoints='never'"
    WHOLE_NO_PLACE = "kept whole: no boundary has a legal place inside it"
    WHOLE_GROUPED = "kept whole: the graph's plan runs all its parts in one piece (grouped buckets, or no cut there)"
    WHOLE_UNSPLITTABLE = "kept whole"


@dataclass(frozen=True, slots=True)
class RegionCut:
    """An activation-checkpoint region that DDP's buckets cross, and the cuts made inside it."""

    region: str
    """Its node in the Dynamo graph (``tag_activation_checkpoint``)."""
    body: str
    """Its body's attribute (``wrap_body_0``)."""
    boundaries: int
    """Bucket boundaries falling inside it."""
    before: tuple[str, ...]
    """Body nodes a cut was made in front of: it runs as ``len(before) + 1`` regions."""
    extra_bytes: int
    """Activations the cuts keep for backward beyond what the whole region keeps (estimate)."""
    allowed_bytes: int | None
    """``checkpoint_budget`` in bytes for this region; ``None``: no budget (``"always"``)."""
    kept_whole_bytes: int
    """What the whole region keeps for backward: its inputs other than parameters."""
    unrolled_bytes: int
    """What its body makes (views not counted): about what it would keep without checkpointing."""
    outcome: RegionOutcome
    adjustments: tuple[BoundaryAdjustment, ...] = ()
    """Boundaries moved earlier inside the body, or dropped, and why."""
    why_whole: str | None = None
    """Set when the region could not be rewritten at all."""

    def describe(self) -> str:
        head = f"checkpoint region {self.region} ({self.body}), {self.boundaries} bucket {'boundary' if self.boundaries == 1 else 'boundaries'} inside"
        if self.before:
            cut = f"cut into {len(self.before) + 1} regions (before {', '.join(self.before)})"
            budget = "no budget" if self.allowed_bytes is None else f"budget {_mib(self.allowed_bytes)}"
            said = f"{head}: {cut}, keeping {_mib(self.extra_bytes)} more for backward ({budget})"
            if self.outcome is RegionOutcome.PARTLY_CUT:
                said += f"; {self.boundaries - len(self.before)} boundaries left out for the budget or the graph's cuts"
        else:
            said = f"{head}: {self.outcome.value}" + (f" ({self.why_whole})" if self.why_whole else "")
        if self.allowed_bytes is not None:
            said += (f"; checkpointing it saves {_mib(max(self.unrolled_bytes - self.kept_whole_bytes, 0))} "
                     f"(keeps {_mib(self.kept_whole_bytes)} of about {_mib(self.unrolled_bytes)})")
        moved = "; ".join(a.describe() for a in self.adjustments)
        return f"{said}; {moved}" if moved else said


@dataclass(frozen=True, slots=True)
class BucketPlan:
    """One DDP gradient bucket as the planner predicts it, and the piece that holds it."""

    piece: int
    """The piece holding this bucket (pieces in forward order: piece 0 runs first)."""
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
class PiecePlan:
    """One piece of the split graph: one or more consecutive buckets (Note [Pieces and buckets])."""

    piece: int
    """Position in forward order (piece 0 runs first)."""
    buckets: tuple[BucketPlan, ...]
    """The buckets it holds, in forward order (so DDP bucket indices descend)."""

    @property
    def start(self) -> int:
        return self.buckets[0].start

    @property
    def stop(self) -> int:
        return self.buckets[-1].stop

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def params(self) -> tuple[str, ...]:
        return tuple(name for b in self.buckets for name in b.params)

    @property
    def node_count(self) -> int:
        return self.stop - self.start

    @property
    def bucket_label(self) -> str:
        """``3`` for one bucket, ``5-3`` for buckets 5, 4 and 3."""
        first, last = self.buckets[0].bucket, self.buckets[-1].bucket
        return str(first) if first == last else f"{first}-{last}"


@dataclass(frozen=True, slots=True)
class CostInputs:
    """What ``min_piece_mb="auto"`` knows (Note [Choosing pieces by cost])."""

    node_backward_s: tuple[float, ...]
    """Estimated backward seconds of each compute node (``GraphLayout.nodes`` order)."""
    fixed_s: float
    """One piece's fixed cost per step (forward and backward together)."""
    link_bytes_per_s: float
    """``link_gbps`` in bytes per second (``inf``: an instant link)."""
    rates: DeviceRates
    """The device's rates; DDP's launch of a bucket is estimated from them."""


@dataclass(frozen=True, slots=True)
class PieceSizing:
    """Why ``min_piece_mb="auto"`` grouped the buckets as it did: its predictions."""

    bucket_backward_s: tuple[float, ...]
    """Estimated backward seconds per bucket, in forward order."""
    bucket_comm_s: tuple[float, ...]
    """Communication seconds per bucket (bytes over ``link_gbps``)."""
    bucket_launch_s: tuple[float, ...]
    """Seconds DDP takes to launch each bucket once its piece has run."""
    fixed_s: float
    link: str
    """Where the communication times came from, for people."""
    predicted_s: float
    """Predicted step (fixed costs, backward, communication left after it) of the choice."""
    one_per_bucket_s: float
    one_piece_s: float

    def describe(self) -> str:
        ms = 1e3
        return (
            f"auto: predicted step {self.predicted_s * ms:.2f} ms (one piece per bucket "
            f"{self.one_per_bucket_s * ms:.2f} ms, one piece {self.one_piece_s * ms:.2f} ms); "
            f"fixed cost {self.fixed_s * ms:.3f} ms per piece; backward {sum(self.bucket_backward_s) * ms:.2f} ms "
            f"estimated; DDP's launches {sum(self.bucket_launch_s) * ms:.2f} ms; communication "
            f"{sum(self.bucket_comm_s) * ms:.2f} ms ({self.link})"
        )


@dataclass(frozen=True, slots=True)
class GraphShare:
    """How much of its DDP module's gradients a graph holds, when not all of them: a graph
    break (or regional compilation) splits the model into several graphs, and DDP's buckets
    then span graphs. This graph's buckets are counted from its own parameters alone."""

    graph_bytes: int
    """Bytes of the DDP-reduced parameters this graph holds."""
    ddp_bytes: int
    """Bytes of every parameter the DDP module reduces."""

    def describe(self) -> str:
        held = _mib(self.graph_bytes) if self.graph_bytes else "none"
        return f"holds {held} of the {_mib(self.ddp_bytes)} of gradients DDP reduces (a graph break splits the model)"


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3g} MiB"


@dataclass(frozen=True, slots=True)
class SplitPlan:
    """Where one Dynamo graph is cut. Returned by :func:`ddp_split_backend.plan_split`."""

    buckets: tuple[BucketPlan, ...]
    """DDP's buckets as predicted, in forward order (the last bucket first)."""
    caps: BucketCaps
    node_count: int
    ignored_params: tuple[str, ...] = ()
    graph_name: str = ""
    state_spans: tuple[StateSpan, ...] = ()
    source: str = "ddp_split"
    """``ddp_split`` for our own plan; ``DDPOptimizer piece`` when torch's DDPOptimizer had
    already cut the graph and the piece was compiled whole."""
    notes: tuple[str, ...] = field(default=())
    min_piece_bytes: int | None = None
    """``min_piece_mb`` in bytes: buckets are grouped into pieces of at least this size."""
    sizing: PieceSizing | None = None
    """``min_piece_mb="auto"``: the predictions the grouping was chosen by."""
    whole: WholeReason | None = None
    """Set when the buckets were kept in one piece whatever the options said, and why."""
    share: GraphShare | None = None
    """Set when the graph holds only part of its DDP module's gradients."""
    regions: tuple[RegionCut, ...] = ()
    """Activation-checkpoint regions that DDP's buckets cross, and what was done with each
    (the plan's nodes are those of the graph with the cut regions rewritten)."""

    @property
    def pieces(self) -> tuple[PiecePlan, ...]:
        """The pieces in forward order, each with the buckets it holds."""
        groups: dict[int, list[BucketPlan]] = {}
        for b in self.buckets:
            groups.setdefault(b.piece, []).append(b)
        return tuple(PiecePlan(piece, tuple(held)) for piece, held in sorted(groups.items()))

    @property
    def cuts(self) -> tuple[int, ...]:
        return tuple(p.start for p in self.pieces[1:])

    @property
    def adjustments(self) -> tuple[BoundaryAdjustment, ...]:
        return tuple(a for b in self.buckets for a in b.adjustments)

    def _piece_backward_ms(self) -> dict[int, float]:
        """Estimated backward ms per piece, when the plan was sized by cost."""
        if self.sizing is None:
            return {}
        per_piece: dict[int, float] = {}
        for b, seconds in zip(self.buckets, self.sizing.bucket_backward_s, strict=True):
            per_piece[b.piece] = per_piece.get(b.piece, 0.0) + seconds * 1e3
        return per_piece

    def summary(self) -> str:
        """The plan in a few words: pieces, buckets and why (the line a normal run logs)."""
        pieces, buckets = _count(len(self.pieces), "piece"), len(self.buckets)
        if self.source != "ddp_split":
            return f"{pieces}, already cut by torch's DDPOptimizer"
        if self.share is not None:
            said = f"{pieces}; {self.share.describe()}"
            return f"{said}: {self.whole.value}" if self.whole is not None else said
        said = f"{pieces} for {_count(buckets, 'DDP bucket')}"
        if self.whole is not None:
            return f"{said}: {self.whole.value}"
        if buckets <= 1:
            return said
        if self.min_piece_bytes is not None:
            return f"{said} (pieces of at least {self.min_piece_bytes / 2**20:.3g} MiB, min_piece_mb)" + self._regions_summary()
        if self.sizing is not None:
            said = f"{said} (grouped by predicted step time, min_piece_mb='auto')"
        else:
            said = f"{said} (one per bucket)"
        return said + self._regions_summary()

    def _regions_summary(self) -> str:
        if not self.regions:
            return ""
        cut = [r for r in self.regions if r.before]
        parts = sum(len(r.before) + 1 for r in cut)
        said = f"; {_count(len(cut), 'checkpoint region')} cut into {parts}" if cut else ""
        whole = len(self.regions) - len(cut)
        return said + (f"; {_count(whole, 'checkpoint region')} crossed by buckets kept whole" if whole else "")

    def table(self, width: int = TABLE_WIDTH) -> str:
        """The plan as a text table (what ``TORCH_LOGS=ddp_split`` prints), no line wider
        than ``width``: a piece's parameter names are cut short with a count of the rest."""
        pieces = self.pieces
        grouped = len(pieces) != len(self.buckets)
        rows = [("piece", "buckets" if grouped else "bucket", "bytes", "nodes", "bwd ms", ("parameters",))]
        backward = self._piece_backward_ms()
        for p in pieces:
            rows.append(
                (str(p.piece), p.bucket_label, f"{p.nbytes:,}", str(p.node_count),
                 f"{backward[p.piece]:.2f}" if backward else "-", p.params)
            )
        if not backward:
            rows = [r[:4] + r[5:] for r in rows]
        columns = len(rows[0]) - 1
        widths = [max(len(r[i]) for r in rows) for i in range(columns)]
        grouping = ""
        if self.min_piece_bytes is not None:
            grouping = f", {len(self.buckets)} buckets, min piece {self.min_piece_bytes:,} B"
        elif self.sizing is not None:
            grouping = f", {len(self.buckets)} buckets grouped by predicted cost (min_piece_mb='auto')"
        header = (f"ddp_split plan {self.graph_name or ''} ({self.source}): {_count(len(pieces), 'piece')}, "
                  f"{self.node_count} nodes")
        notes = [f"cap {self.caps.bytes:,} B, first cap {self.caps.first_bytes:,} B{grouping}"]
        if self.sizing is not None:
            notes.append(self.sizing.describe())
        notes.extend(f"piece {b.piece}: {a.describe()}" for b in self.buckets for a in b.adjustments)
        notes.extend(r.describe() for r in self.regions)
        if self.ignored_params:
            notes.append(f"ignored by DDP: {_names(self.ignored_params, width - 17)}")
        if self.whole is not None:
            notes.append(f"one piece: {self.whole.value}")
        notes.extend(f"note: {n}" for n in self.notes)
        lines = [textwrap.fill(header, width, subsequent_indent="    ")]
        for r in rows:
            front = "  ".join(r[i].rjust(widths[i]) for i in range(columns)) + "  "
            lines.append(front + _names(r[columns], width - len(front)))
        lines.extend(textwrap.fill(n, width, initial_indent="  ", subsequent_indent="    ") for n in notes)
        return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _names(names: Sequence[str], width: int) -> str:
    """``a, b, c`` within ``width`` columns, else as many as fit and ``(+N more)``."""
    if not names:
        return "-"
    text = ", ".join(names)
    if len(text) <= width:
        return text
    shown: list[str] = []
    for i, name in enumerate(names):
        more = f", ... (+{len(names) - i - 1} more)" if i + 1 < len(names) else ""
        if len(", ".join([*shown, name]) + more) > width and shown:
            break
        shown.append(name)
    rest = len(names) - len(shown)
    return ", ".join(shown) + (f", ... (+{rest} more)" if rest else "")


@dataclass(frozen=True, slots=True)
class _Bucket:
    """One of DDP's buckets as :func:`_pack_like_ddp` predicts it, then placed on the graph."""

    names: tuple[str, ...]
    """Its parameters, in the order their gradients become ready."""
    nbytes: int
    front: int
    """The first node (forward order) completing one of its parameters; the graph's length
    when it holds none."""
    back: int
    """The last node completing one of its parameters; -1 when it holds none."""
    start: int = 0
    """Its first node: where a cut in front of it goes (or would go, see ``cut``)."""
    cut: bool = True
    """Whether a cut separates it from the bucket in front (always for the first)."""
    adjustments: tuple[BoundaryAdjustment, ...] = ()
    """Where its front cut moved from the wanted place, or why it was dropped."""


def ready_order(params: ParamTable) -> tuple[ParamUse, ...]:
    """The order ddp_split makes the graph's gradients ready in (Note [Pieces are DDP's
    buckets]): the node completing them, last first; within a node, smallest first, so that
    a bucket DDP fills up inside a node closes on that node's last (largest) parameter. Inside
    an activation-checkpoint region, by the body node completing them, last first."""
    return tuple(sorted(params.params, key=lambda use: (tuple(-p for p in use.position), use.nbytes)))


def ddp_packing(order: Sequence[tuple[str, int]], caps: BucketCaps) -> list[tuple[str, ...]]:
    """DDP's buckets (bucket 0 first) over gradients ready in ``order`` (name, bytes), by the
    reducer's rule: a bucket closes on the gradient that brings it to its cap, the first
    bucket's cap first."""
    buckets: list[tuple[str, ...]] = []
    held: list[str] = []
    nbytes = 0
    for name, size in order:
        held.append(name)
        nbytes += size
        if nbytes >= (caps.bytes if buckets else caps.first_bytes):
            buckets.append(tuple(held))
            held, nbytes = [], 0
    if held:
        buckets.append(tuple(held))
    return buckets


def _pack_like_ddp(order: Sequence[ParamUse], caps: BucketCaps) -> list[_Bucket]:
    """:func:`ddp_packing` of the graph's parameters, in forward order (DDP's last bucket
    first); one empty bucket for a graph without parameters."""
    by_name = {use.name: use for use in order}
    packed = ddp_packing([(use.name, use.nbytes) for use in order], caps) or [()]
    return [_bucket_of([by_name[name] for name in names]) for names in reversed(packed)]


def _bucket_of(held: Sequence[ParamUse]) -> _Bucket:
    return _Bucket(
        names=tuple(u.name for u in held),
        nbytes=sum(u.nbytes for u in held),
        front=min((u.first_use for u in held), default=_NO_NODE),
        back=max((u.first_use for u in held), default=-1),
    )


_NO_NODE = 1 << 62


def _place_cuts(layout: GraphLayout, found: list[_Bucket]) -> list[_Bucket]:
    """Where each bucket's front cut goes (Note [Bucket plan]): in front of its first node
    if that is legal, else the nearest legal place earlier that still leaves the bucket in
    front every one of its parameters; with none, no cut (the two buckets share a piece)."""
    nodes = layout.nodes
    placed = [dataclasses.replace(found[0], start=0)]
    for ahead, bucket in zip(found, found[1:]):
        wanted = min(bucket.front, len(nodes) - 1)
        if bucket.front == _NO_NODE or ahead.back >= wanted:
            reason = AdjustReason.SHARED_NODE if bucket.front != _NO_NODE else AdjustReason.NO_OUTPUT
            at = None
        else:
            reason = layout.blocked[wanted]
            at = next((p for p in range(wanted, ahead.back, -1) if layout.blocked[p] is None), None)
        adjustments: tuple[BoundaryAdjustment, ...] = ()
        if at != wanted:
            placed_before = nodes[at].name if at is not None else None
            adjustments = (BoundaryAdjustment(reason, nodes[wanted].name, placed_before),)
        start = at if at is not None else max(wanted, placed[-1].start)
        placed.append(dataclasses.replace(bucket, start=start, cut=at is not None, adjustments=adjustments))
    return placed


def _units(built: Sequence[_Bucket]) -> list[list[int]]:
    """Runs of buckets (indices, forward order) with no cut between them: the units pieces
    are made of."""
    units: list[list[int]] = []
    for index, bucket in enumerate(built):
        if bucket.cut or not units:
            units.append([index])
        else:
            units[-1].append(index)
    return units


def _stop(built: Sequence[_Bucket], index: int, count: int) -> int:
    return built[index + 1].start if index + 1 < len(built) else count


def plan_buckets(
    layout: GraphLayout,
    params: ParamTable,
    caps: BucketCaps,
    *,
    graph_name: str = "",
    min_piece_bytes: int | None = None,
    costs: CostInputs | None = None,
) -> SplitPlan:
    """Choose the cuts of a graph (see Note [Bucket plan] and Note [Pieces and buckets]);
    with ``costs``, group buckets by predicted step time (Note [Choosing pieces by cost])."""
    nodes = layout.nodes
    count = len(nodes)
    built = _place_cuts(layout, _pack_like_ddp(ready_order(params), caps))
    units = _units(built)
    sizing, whole = None, None
    if len(built) > 1 and not any(state.grad for state in layout.states):
        unit_piece, whole = [0] * len(units), WholeReason.NO_BACKWARD
    elif costs is not None:
        spans = [(built[u[0]].start, _stop(built, u[-1], count), sum(built[i].nbytes for i in u)) for u in units]
        unit_piece, sizing = _group_by_cost(spans, costs)
    else:
        unit_piece = _group_buckets([sum(built[i].nbytes for i in u) for u in units], min_piece_bytes)
    piece_of = [unit_piece[k] for k, unit in enumerate(units) for _ in unit]
    buckets = [
        BucketPlan(
            piece=piece_of[index],
            bucket=len(built) - 1 - index,
            nbytes=found.nbytes,
            params=tuple(reversed(found.names)),
            start=found.start,
            stop=_stop(built, index, count),
            adjustments=found.adjustments,
        )
        for index, found in enumerate(built)
    ]
    return SplitPlan(
        buckets=tuple(buckets),
        caps=caps,
        node_count=count,
        ignored_params=params.ignored,
        graph_name=graph_name,
        state_spans=state_spans(layout),
        min_piece_bytes=min_piece_bytes,
        sizing=sizing,
        whole=whole,
    )


def _group_buckets(sizes: list[int], min_piece_bytes: int | None) -> list[int]:
    """The piece of each bucket (both in forward order), grouping from the back (Note
    [Pieces and buckets])."""
    if min_piece_bytes is None:
        return list(range(len(sizes)))
    group_of_reversed: list[int] = []
    group, held = 0, 0
    for size in reversed(sizes):
        if held >= min_piece_bytes:
            group, held = group + 1, 0
        group_of_reversed.append(group)
        held += size
    last = group_of_reversed[-1] if group_of_reversed else 0
    return [last - g for g in reversed(group_of_reversed)]


def _group_by_cost(
    buckets: Sequence[tuple[int, int, int]], costs: CostInputs
) -> tuple[list[int], PieceSizing]:
    """The piece of each bucket (forward order) minimising the predicted step (Note
    [Choosing pieces by cost]); ``buckets`` holds (start node, stop node, bytes)."""
    backward = [sum(costs.node_backward_s[start:stop]) for start, stop, _ in buckets]
    launch = [bucket_launch_s(nbytes, costs.rates) for _, _, nbytes in buckets]
    if math.isinf(costs.link_bytes_per_s):
        comm, link = [0.0] * len(buckets), "link_gbps=inf: instant"
    else:
        comm = [nbytes / costs.link_bytes_per_s for _, _, nbytes in buckets]
        link = f"link_gbps={costs.link_bytes_per_s / 1e9:g}"
    if len(buckets) <= 1:
        link = "one bucket: nothing to group"
    in_backward = (backward[::-1], comm[::-1], costs.fixed_s, launch[::-1])  # backward visits the last bucket first
    sizes = _best_grouping(*in_backward)
    piece_of_reversed = [g for g, size in enumerate(sizes) for _ in range(size)]
    last = len(sizes) - 1
    piece_of = [last - g for g in reversed(piece_of_reversed)]
    sizing = PieceSizing(
        bucket_backward_s=tuple(backward),
        bucket_comm_s=tuple(comm),
        bucket_launch_s=tuple(launch),
        fixed_s=costs.fixed_s,
        link=link,
        predicted_s=_predicted_step(*in_backward, sizes),
        one_per_bucket_s=_predicted_step(*in_backward, [1] * len(buckets)),
        one_piece_s=_predicted_step(*in_backward, [len(buckets)]),
    )
    return piece_of, sizing


TOLERANCE = 0.005
"""Fewer pieces are chosen over more when predicted at most this much slower (a share of
the best predicted step). Small: where communication dominates, the step is long, and 2 % of
it (the value until 2026-12-07) let through groupings measurably slower than the best."""
BACKWARD_SHARE = 0.6
"""Share of a piece's fixed cost paid in backward (AOTAutograd's backward wrapper is the
larger part: RESULTS.md, "Where the split's cost goes")."""
_LADDER = 1.25
"""Ratio between successive piece counts tried (Note [Choosing pieces by cost])."""


def _predicted_step(
    backward: Sequence[float], comm: Sequence[float], fixed: float, launch: Sequence[float], sizes: Sequence[int]
) -> float:
    """Predicted step of groups of ``sizes`` buckets, everything in backward order: after each
    piece DDP launches its buckets one by one (``launch``), each sent once launched and the
    link free."""
    host = link = 0.0
    i = 0
    for size in sizes:
        host += sum(backward[i:i + size]) + BACKWARD_SHARE * fixed
        for bucket in range(i, i + size):
            host += launch[bucket]
            link = max(link, host) + comm[bucket]
        i += size
    return max(link, host) + (1 - BACKWARD_SHARE) * fixed * len(sizes)


def _best_grouping(
    backward: Sequence[float], comm: Sequence[float], fixed: float, launch: Sequence[float]
) -> list[int]:
    """Group sizes (backward order) with the smallest :func:`_predicted_step` among the even
    groupings of :func:`_even_groupings`; the fewest pieces within :data:`TOLERANCE` of it."""
    n = len(backward)
    if n <= 1:
        return [n] if n else []
    steps = [
        (_predicted_step(backward, comm, fixed, launch, sizes), sizes) for sizes in _even_groupings(backward, comm)
    ]
    best = min(step for step, _ in steps)
    return min((sizes for step, sizes in steps if step <= best * (1 + TOLERANCE)), key=len)


def _even_groupings(backward: Sequence[float], comm: Sequence[float]) -> list[list[int]]:
    """For piece counts 1, 2, ... growing by :data:`_LADDER`, the buckets cut into that many
    groups of about equal backward time, and of about equal communication; and groups of 1,
    2, 4, ... buckets each: O(buckets) each, O(buckets x log(buckets)) in all."""
    n = len(backward)
    counts, m = [], 1
    while m < n:
        counts.append(m)
        m = max(m + 1, round(m * _LADDER))
    counts.append(n)
    sums = (_prefix(backward), _prefix(comm))
    balanced = [_balanced(prefix, pieces) for pieces in counts for prefix in sums]
    return balanced + [_uniform(n, size) for size in _powers_of_two(n)]


def _powers_of_two(n: int) -> list[int]:
    sizes, size = [], 1
    while size < n:
        sizes.append(size)
        size *= 2
    return sizes


def _uniform(n: int, size: int) -> list[int]:
    """``size`` buckets a piece, the remainder in the last piece (backward order)."""
    return [size] * (n // size) + ([n % size] if n % size else [])


def _balanced(prefix: Sequence[float], pieces: int) -> list[int]:
    """Sizes of ``pieces`` consecutive groups whose weights (``prefix``: running sums) are
    about equal; equal counts when every weight is 0."""
    n, total = len(prefix) - 1, prefix[-1]
    cuts = [0]
    for k in range(1, pieces):
        at = bisect.bisect_left(prefix, total * k / pieces) if total > 0 else round(n * k / pieces)
        cuts.append(min(max(at, cuts[-1] + 1), n - (pieces - k)))
    cuts.append(n)
    return [b - a for a, b in zip(cuts, cuts[1:])]


def _prefix(values: Sequence[float]) -> list[float]:
    running = [0.0]
    for v in values:
        running.append(running[-1] + v)
    return running
