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

At the end of each backward before DDP's rebuild, the order the hooks fired in (recorded
with post-accumulate hooks) is packed by DDP's rule once more and compared with the plan:
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
from .plan import ddp_packing

__all__ = ["BucketCheck", "ReadyOrder", "pieces_of_buckets"]


@dataclass(slots=True)
class BucketCheck:
    """Whether the buckets DDP rebuilt are the graph's pieces (filled in after the rebuild)."""

    done: bool = False
    """The buckets were compared, from the order of the first backward (refreshed by each
    backward until DDP has rebuilt: then final)."""
    ddp_buckets: tuple[tuple[str, ...], ...] = ()
    """DDP's buckets over this graph's parameters, bucket 0 (ready first) first."""
    piece_of_bucket: tuple[tuple[int, ...], ...] = ()
    """Per DDP bucket, the pieces holding its parameters (one piece when it matches)."""
    buckets_matched: int = 0
    """The plan's buckets that are exactly one of DDP's."""
    buckets: int = 0
    """The plan's buckets holding parameters."""
    pieces_matched: int = 0
    """Pieces whose parameters are exactly one DDP bucket (all of them, with a piece per
    bucket; none where ``min_piece_mb`` groups buckets)."""
    pieces: int = 0
    """Pieces holding parameters."""

    @property
    def straddling(self) -> tuple[int, ...]:
        """DDP buckets whose parameters come from more than one piece."""
        return tuple(i for i, held in enumerate(self.piece_of_bucket) if len(held) > 1)

    @property
    def as_planned(self) -> bool:
        """DDP's buckets are the plan's, and none straddles pieces."""
        return self.buckets_matched == self.buckets and not self.straddling


@dataclass(slots=True)
class _Seen:
    """Hook order of the backward running now."""

    names: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


_checks: weakref.WeakKeyDictionary[torch.nn.Module, list[tuple[str, BucketCheck]]] = weakref.WeakKeyDictionary()
"""Per DDP module, the checks of the graphs planned against it (graph name, check)."""


def pieces_of_buckets(ddp: torch.nn.Module) -> dict[int, str]:
    """Per DDP bucket index, the piece that holds it (``graph 0 piece 3``), from the latest
    graph compared against ``ddp``'s rebuilt buckets; empty when none was."""
    done = [(name, check) for name, check in _checks.get(ddp, ()) if check.done]
    if not done:
        return {}
    name, check = done[-1]
    return {i: f"{name.split(' [')[0]} piece {', '.join(map(str, held))}" for i, held in enumerate(check.piece_of_bucket)}


class ReadyOrder:
    """Per piece, which inputs to pass through a view, and whether to (Note [Pieces are
    DDP's buckets]); and the check of the buckets DDP builds from the order seen.

    Args:
        ddp: the DDP module whose buckets the plan predicts (held weakly).
        views: per piece, positions among its inputs, in the order to make the views.
        pieces: per piece, the parameter names it completes.
        buckets: per bucket of the plan, its parameter names.
        sizes: bytes of every parameter of the graph, by name.
        params: the parameters of the graph, by name (hooks record their ready order).
        caps: the caps the plan packed with.
        check: where the comparison goes; ``None``: not compared (part of the model).
        on_checked: called with the filled-in check, again only if a later backward before
            DDP's rebuild changes it.
        graph_name: the graph's name, for :func:`pieces_of_buckets`.
    """

    def __init__(
        self,
        ddp: torch.nn.Module,
        views: Sequence[tuple[int, ...]],
        pieces: Sequence[frozenset[str]],
        buckets: Sequence[frozenset[str]],
        sizes: dict[str, int],
        params: dict[str, torch.Tensor],
        caps: BucketCaps,
        check: BucketCheck | None,
        on_checked: Callable[[BucketCheck], None],
        graph_name: str = "",
    ) -> None:
        self.views = tuple(views)
        if check is not None:
            _checks.setdefault(ddp, []).append((graph_name, check))
        self._ddp = weakref.ref(ddp)
        self._pieces = tuple(pieces)
        self._buckets = tuple(b for b in buckets if b)
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
                first = not seen.names
                seen.names.append(name)
            if first:  # the backward's order is complete when it ends
                _torch.queue_after_backward(self._compare)

        return record

    def pending(self) -> bool:
        """Whether this call makes the views: DDP has yet to rebuild its buckets (and grad
        is on). The first call that finds it rebuilt ends the ordering for good."""
        if self._pending and self._rebuilt():
            self._pending = False
        return self._pending and torch.is_grad_enabled()

    def _rebuilt(self) -> bool:
        """Whether DDP has rebuilt (or is gone); then the hooks are removed."""
        ddp = self._ddp()
        if ddp is not None and _torch.ddp_rebuilds_buckets_later(ddp):
            return False
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        return True

    def _compare(self) -> None:
        """DDP's packing of the order the backward that just ended saw, against the pieces
        (DDP rebuilds from its first synchronised backward, or its second with a static
        graph: each backward before then refreshes the check)."""
        with self._seen.lock:
            names, self._seen.names = self._seen.names, []
        check = self._check
        if check is None or not self._pending or self._rebuilt():  # DDP rebuilt from an earlier backward
            return
        before = (check.ddp_buckets, check.piece_of_bucket)
        buckets = ddp_packing([(n, self._sizes[n]) for n in names if n in self._sizes], self._caps)
        piece_of = {name: i for i, held in enumerate(self._pieces) for name in held}
        check.ddp_buckets = tuple(buckets)
        check.piece_of_bucket = tuple(tuple(sorted({piece_of[n] for n in b if n in piece_of})) for b in buckets)
        found = {frozenset(b) for b in buckets}
        check.buckets = len(self._buckets)
        check.buckets_matched = sum(b in found for b in self._buckets)
        held = [names for names in self._pieces if names]
        check.pieces = len(held)
        check.pieces_matched = sum(names in found for names in held)
        reported = check.done
        check.done = True
        if not reported or before != (check.ddp_buckets, check.piece_of_bucket):
            self._on_checked(check)


def warn_straddling(graph_name: str, check: BucketCheck) -> None:
    """One warning when DDP's rebuilt buckets are not the plan's."""
    if check.as_planned:
        return
    spans = ", ".join(f"bucket {i} (pieces {', '.join(map(str, check.piece_of_bucket[i]))})" for i in check.straddling)
    warnings.warn(
        f"ddp_split: {graph_name}: DDP rebuilt {len(check.ddp_buckets)} buckets, {check.buckets_matched} of the "
        f"plan's {check.buckets} among them; buckets straddling pieces: {spans or 'none'}. A straddling bucket "
        "waits for its last piece's backward. Please report this with the model.",
        stacklevel=2,
    )


def make_views(views: Sequence[int], args: list[Any]) -> None:
    """Pass ``args[i]`` for ``i`` in ``views`` through a fresh view, in that order."""
    for i in views:
        args[i] = args[i].view_as(args[i])
