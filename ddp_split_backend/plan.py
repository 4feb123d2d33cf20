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
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .config import BucketCaps
from .layout import AdjustReason, GraphLayout, StateSpan, state_spans
from .params import ParamTable

__all__ = [
    "AdjustReason",
    "BoundaryAdjustment",
    "BucketPlan",
    "PiecePlan",
    "SplitPlan",
    "StateSpan",
    "plan_buckets",
]


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

    def table(self) -> str:
        """The plan as a text table (what ``TORCH_LOGS=ddp_split`` prints)."""
        pieces = self.pieces
        grouped = len(pieces) != len(self.buckets)
        rows = [("piece", "buckets" if grouped else "bucket", "bytes", "nodes", "parameters")]
        for p in pieces:
            rows.append(
                (str(p.piece), p.bucket_label, f"{p.nbytes:,}", str(p.node_count), ", ".join(p.params) or "-")
            )
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        grouping = (
            f", {len(self.buckets)} buckets, min piece {self.min_piece_bytes:,} B"
            if self.min_piece_bytes is not None
            else ""
        )
        lines = [
            f"ddp_split plan {self.graph_name or ''} ({self.source}): {len(pieces)} pieces, "
            f"{self.node_count} nodes, cap {self.caps.bytes:,} B, first cap {self.caps.first_bytes:,} B"
            f"{grouping}"
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
class _Bucket:
    """A bucket as the reverse walk of :func:`plan_buckets` finds it."""

    start: int
    """Its first node."""
    nbytes: int
    """Bytes of the parameters whose gradients it holds."""
    names: tuple[str, ...]
    """Those parameters, in the order the walk met them (last used first)."""
    adjustments: tuple[BoundaryAdjustment, ...]
    """Where its front cut moved from the wanted place, and why."""


def plan_buckets(
    layout: GraphLayout,
    params: ParamTable,
    caps: BucketCaps,
    *,
    graph_name: str = "",
    min_piece_bytes: int | None = None,
) -> SplitPlan:
    """Choose the cuts of a graph (see Note [Bucket plan] and Note [Pieces and buckets])."""
    nodes = layout.nodes
    count = len(nodes)
    completed = params.completed_at()

    # Reverse walk: buckets are found last first.
    built: list[_Bucket] = []
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
                built.append(_Bucket(cut, nbytes, tuple(names), tuple(adjustments)))
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
    built.append(_Bucket(0, nbytes, tuple(names), tuple(adjustments)))
    built.reverse()

    if len(built) > 1 and built[0].nbytes == 0:
        first, second = built[0], built[1]
        folded = BoundaryAdjustment(AdjustReason.LEADING_NO_PARAMS, nodes[second.start].name, None)
        built[:2] = [_Bucket(0, second.nbytes, first.names + second.names, (*first.adjustments, *second.adjustments, folded))]

    piece_of = _group_buckets([b.nbytes for b in built], min_piece_bytes)
    buckets = []
    for index, found in enumerate(built):
        stop = built[index + 1].start if index + 1 < len(built) else count
        buckets.append(
            BucketPlan(
                piece=piece_of[index],
                bucket=len(built) - 1 - index,
                nbytes=found.nbytes,
                params=tuple(reversed(found.names)),
                start=found.start,
                stop=stop,
                adjustments=found.adjustments,
            )
        )
    return SplitPlan(
        buckets=tuple(buckets),
        caps=caps,
        node_count=count,
        ignored_params=params.ignored,
        graph_name=graph_name,
        state_spans=state_spans(layout),
        min_piece_bytes=min_piece_bytes,
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
