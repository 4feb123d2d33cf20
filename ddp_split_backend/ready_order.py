"""Make the buckets DDP rebuilds the pieces: gradients ready in the plan's order until then.

Note [Pieces are DDP's buckets]
-------------------------------
DDP rebuilds its buckets once, packing gradients by its caps in the order their hooks fire
in its first synchronised backward (the second with ``static_graph=True``): a bucket closes
on the gradient that brings it to its cap. Inside a compiled piece every gradient becomes
ready when the piece's backward ends, and autograd then accumulates them in an order of its
own (its ready queue breaks the tie between accumulation nodes as its heap falls). DDP would
then close a bucket inside a piece wherever that order put a small parameter (a LayerNorm's
bias, a position embedding) after the cap was reached, and every boundary behind it would
shift: on tiny GPT-2, 0 of 4 pieces were DDP's buckets.

So ddp_split fixes the order instead of guessing it. The plan packs the graph's parameters
by DDP's rule in an order it chooses (``plan.ready_order``: the completing node last first,
smallest first within a node) and cuts at those buckets' boundaries. Until DDP has rebuilt,
each piece receives the parameters it completes through one view apiece, made just before
the piece runs, in the reverse of that order. Autograd runs the ready node made last first
(the highest sequence number), so once the piece's backward has run it runs the views one
by one, each followed at once by its parameter's accumulation (the highest priority there
is) and DDP's hook: the hooks fire in the plan's order, and DDP's packing, the same rule
over the same order, makes the plan's buckets. Exact by construction, not usually right:
what it rests on is the engine's priority rule and DDP's packing rule, both checked by
``tests/test_ddp_buckets.py`` against the buckets DDP's reducer really holds. The views cost
one autograd node per parameter, for the one or two steps before DDP rebuilds.

Once DDP has rebuilt, the order the hooks fired in (recorded with post-accumulate hooks
while views are made) is packed by DDP's rule once more and compared with the plan:
:class:`BucketCheck`, on the graph's record. A piece that is not one of DDP's buckets warns
once, naming the buckets that straddle pieces. A graph that holds part of DDP's gradients
(a graph break) cannot match DDP's buckets, which span graphs, and is not checked.
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _torch
from .config import BucketCaps

__all__ = ["BucketCheck", "ReadyOrder", "ddp_packing"]


@dataclass(slots=True)
class BucketCheck:
    """Whether the buckets DDP rebuilt are the graph's pieces (filled in after the rebuild)."""

    done: bool = False
    """DDP has rebuilt and the buckets were compared; the fields below are final."""
    ddp_buckets: tuple[tuple[str, ...], ...] = ()
    """DDP's buckets over this graph's parameters, bucket 0 (ready first) first."""
    piece_of_bucket: tuple[tuple[int, ...], ...] = ()
    """Per DDP bucket, the pieces holding its parameters (one piece when it matches)."""
    pieces_matched: int = 0
    """Pieces whose parameters are exactly one DDP bucket."""
    pieces: int = 0
    """Pieces holding parameters."""

    @property
    def straddling(self) -> tuple[int, ...]:
        """DDP buckets whose parameters come from more than one piece."""
        return tuple(i for i, held in enumerate(self.piece_of_bucket) if len(held) > 1)


def ddp_packing(order: Sequence[tuple[str, int]], caps: BucketCaps) -> list[tuple[str, ...]]:
    """DDP's buckets (bucket 0 first) over gradients ready in ``order`` (name, bytes): a
    bucket closes on the gradient that brings it to its cap, the first bucket's cap first."""
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


@dataclass(slots=True)
class _Seen:
    """Hook order of the backward running now (reset at each forward while ordering)."""

    names: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class ReadyOrder:
    """Per piece, which inputs to pass through a view, and whether to (Note [Pieces are
    DDP's buckets]); then, once, the check of DDP's rebuilt buckets.

    Args:
        ddp: the DDP module whose buckets the plan predicts (held weakly).
        views: per piece, positions among its inputs, in the order to make the views.
        pieces: per piece, the parameter names it completes.
        sizes: bytes of every parameter of the graph, by name.
        params: the parameters of the graph, by name (hooks record their ready order).
        caps: the caps the plan packed with.
        check: where the comparison goes; ``None``: not compared (part of the model).
        on_checked: called once with the filled-in check.
    """

    def __init__(
        self,
        ddp: torch.nn.Module,
        views: Sequence[tuple[int, ...]],
        pieces: Sequence[frozenset[str]],
        sizes: dict[str, int],
        params: dict[str, torch.Tensor],
        caps: BucketCaps,
        check: BucketCheck | None,
        on_checked: Callable[[BucketCheck], None],
    ) -> None:
        self.views = tuple(views)
        self._ddp = weakref.ref(ddp)
        self._pieces = tuple(pieces)
        self._sizes = sizes
        self._caps = caps
        self._check = check
        self._on_checked = on_checked
        self._seen = _Seen()
        self._hooks = [] if check is None else [
            p.register_post_accumulate_grad_hook(self._recorder(name)) for name, p in params.items()
        ]
        self._pending = True

    def _recorder(self, name: str) -> Callable[[torch.Tensor], None]:
        seen = self._seen

        def record(_: torch.Tensor) -> None:
            with seen.lock:
                seen.names.append(name)

        return record

    def pending(self) -> bool:
        """Whether this call makes the views: DDP has yet to rebuild its buckets. The first
        call that finds it rebuilt compares the buckets and ends the ordering for good."""
        if not self._pending:
            return False
        ddp = self._ddp()
        if ddp is not None and _torch.ddp_rebuilds_buckets_later(ddp):
            with self._seen.lock:
                self._seen.names.clear()  # a new step: its backward's order is what counts
            return torch.is_grad_enabled()
        self._pending = False
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        if ddp is not None and self._check is not None and self._seen.names:
            self._compare()
        return False

    def _compare(self) -> None:
        check = self._check
        assert check is not None
        order = [(name, self._sizes[name]) for name in self._seen.names if name in self._sizes]
        buckets = ddp_packing(order, self._caps)
        piece_of = {name: i for i, names in enumerate(self._pieces) for name in names}
        check.ddp_buckets = tuple(buckets)
        check.piece_of_bucket = tuple(tuple(sorted({piece_of[n] for n in b if n in piece_of})) for b in buckets)
        found = {frozenset(b) for b in buckets}
        held = [names for names in self._pieces if names]
        check.pieces = len(held)
        check.pieces_matched = sum(names in found for names in held)
        check.done = True
        self._on_checked(check)


def warn_straddling(graph_name: str, check: BucketCheck) -> None:
    """One warning when DDP's rebuilt buckets are not the pieces."""
    if check.pieces_matched == check.pieces:
        return
    spans = ", ".join(f"bucket {i} (pieces {', '.join(map(str, check.piece_of_bucket[i]))})" for i in check.straddling)
    warnings.warn(
        f"ddp_split: {graph_name}: after DDP rebuilt its buckets, {check.pieces_matched} of {check.pieces} "
        f"pieces are one DDP bucket each; straddling pieces: {spans or 'none (pieces hold several buckets)'}. "
        "Such a bucket waits for its last piece's backward. Please report this with the model.",
        stacklevel=2,
    )


def make_views(views: Sequence[int], args: list[Any]) -> None:
    """Pass ``args[i]`` for ``i`` in ``views`` through a fresh view, in that order."""
    for i in views:
        args[i] = args[i].view_as(args[i])
