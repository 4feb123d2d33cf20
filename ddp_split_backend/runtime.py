"""Run compiled pieces in order, and keep the global state intact when something fails.

The stitched callable is what the backend returns to Dynamo. Its hot path is a loop over
pieces that moves values through a flat list of slots; everything else (naming the failing
piece, restoring global state) happens only when an exception passes through. Each call
reads only the state that can differ between calls (:data:`guards.CallState`); the rest
(autocast for every device, its cache, inference mode) Dynamo guards, so it is read once, at
the first call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


from . import _torch
from .guards import GlobalState, capture_call
from .ready_order import ReadyOrder, make_views
from .split import SplitGraph

__all__ = ["GuardedCallable", "StitchedCallable"]


def _piece_error_note(index: int, count: int, name: str) -> str:
    return f"raised in ddp_split piece {index} of {count} (compiled with {name})"


class GuardedCallable:
    """One compiled graph that changes global state: restores the state if it raises."""

    def __init__(self, fn: Callable[..., Any], compiler_name: str) -> None:
        self._fn = fn
        self._name = compiler_name
        self._first_call: GlobalState | None = None

    def __call__(self, *args: Any) -> Any:
        if self._first_call is None:
            self._first_call = GlobalState.capture()
        call = capture_call()
        try:
            return self._fn(*args)
        except BaseException as error:
            self._first_call.with_call(call).restore()
            error.add_note(_piece_error_note(0, 1, self._name))
            raise


@dataclass(frozen=True, slots=True)
class _Step:
    """One piece as the hot path runs it (see :class:`split.Piece` for the fields)."""

    fn: Callable[..., Any]
    """The piece's compiled function."""
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    release: tuple[int, ...]
    grad: bool


class StitchedCallable:
    """Runs the compiled pieces of one graph in order; returned to Dynamo by the backend."""

    def __init__(
        self,
        split: SplitGraph,
        compiled: Sequence[Callable[..., Any]],
        compiler_names: Sequence[str],
        order: ReadyOrder | None = None,
    ) -> None:
        self._steps = tuple(
            _Step(fn, piece.inputs, piece.outputs, piece.release, piece.grad)
            for fn, piece in zip(compiled, split.pieces, strict=True)
        )
        self._names = tuple(compiler_names)
        self._num_slots = split.num_slots
        self._num_inputs = split.num_inputs
        self._leaves = split.output_leaves
        self._flat_tuple = all(s is not None for s in split.output_leaves) and (
            split.output_spec == _torch.pytree.tree_flatten(tuple(range(len(split.output_leaves))))[1]
        )
        self._constants = split.output_constants
        self._spec = split.output_spec
        self._first_call: GlobalState | None = None
        self._order = order
        """Until DDP has rebuilt its buckets: the views that order each piece's gradients
        (Note [Pieces are DDP's buckets] in ready_order.py)."""

    def __call__(self, *args: Any) -> Any:
        values: list[Any] = [*args, *([None] * (self._num_slots - self._num_inputs))]
        if self._first_call is None:
            self._first_call = GlobalState.capture()
        call = capture_call()
        ordering = self._order is not None and self._order.pending()
        index = 0
        try:
            for index, step in enumerate(self._steps):
                _torch.set_grad_enabled(step.grad)  # as the piece was compiled
                piece_args = [values[s] for s in step.inputs]
                if ordering and step.grad:
                    make_views(self._order.views[index], piece_args)  # type: ignore[union-attr]
                results = step.fn(*piece_args)
                for s, v in zip(step.outputs, results):
                    values[s] = v
                for s in step.release:
                    values[s] = None
            _torch.set_grad_enabled(call[0])  # the caller's grad mode
        except BaseException as error:
            self._first_call.with_call(call).restore()
            error.add_note(_piece_error_note(index, len(self._steps), self._names[index]))
            raise
        if self._flat_tuple:
            return tuple(values[s] for s in self._leaves)
        leaves = [
            c if s is None else values[s] for s, c in zip(self._leaves, self._constants)
        ]
        return _torch.pytree.tree_unflatten(leaves, self._spec)
