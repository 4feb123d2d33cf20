"""Time one graph's backward, bucket by bucket, and the DDP communication after it.

``min_piece_mb="auto"`` without ``link_gbps`` runs a graph as one piece per bucket for its
first steps and measures them (Note [Measuring the link] in ``regroup.py``). A
:class:`StepProbe` watches one step, with hooks that are removed when the step ends:

* backward starts when the gradient reaches one of the graph's outputs (a tensor hook);
* a bucket is ready when the last of its parameters has its gradient accumulated
  (post-accumulate-grad hooks): with one piece per bucket, when that piece's backward has
  run, which is when DDP launches the bucket;
* communication ends when DDP's ``finalize_backward`` has waited for every bucket. DDP
  queues it on the autograd engine once the last bucket is ready; the probe queues a
  callback at its first parameter hook, and that callback queues a second one, which
  therefore runs after DDP's.

What these times say about the link is :class:`regroup.Measurement`'s to work out.

On a GPU the times are CUDA events on the current stream (DDP's finalize makes that stream
wait for the communication), read when the sample is taken.

Part of that time is not the link's: unless ``gradient_as_bucket_view=True``, DDP's finalize
copies every reduced bucket back into the gradients, whatever the grouping.
:func:`copy_back_seconds` times such a copy once, of the graph's own parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import _torch
from .clock import Clock

__all__ = ["StepProbe", "StepSample", "copy_back_seconds"]

_COPY_BUFFER_BYTES = 256 * 2**20
"""Largest buffer :func:`copy_back_seconds` allocates (larger models copy through it in turns)."""


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured step of one graph."""

    backward_s: float
    """From the gradient reaching the graph's outputs to the last watched gradient."""
    ready_s: tuple[float, ...]
    """Per group of parameters (the probe's order), from backward's start until the last of
    them had its gradient (0 for a group none of whose gradients came)."""
    after_s: float
    """From the last watched gradient until DDP's communication had completed."""


class StepProbe:
    """Hooks that time one step (see the module docstring); :attr:`sample` once it ended.
    ``groups``: the parameters watched, in groups timed apart (a graph's buckets)."""

    def __init__(self, groups: Sequence[Sequence[torch.Tensor]]) -> None:
        trainable = [[p for p in group if p.requires_grad] for group in groups]
        first = next((group[0] for group in trainable if group), None)
        self._clock = Clock(first.device) if first is not None else None
        self._start: Any = None
        self._ready: list[Any] = [None] * len(trainable)
        self._last_ready: Any = None
        self._done: Any = None
        self._queued = False
        self._handles = [
            p.register_post_accumulate_grad_hook(functools.partial(self._on_ready, index))
            for index, group in enumerate(trainable)
            for p in group
        ]

    def watch(self, outputs: Any) -> None:
        """Start the clock when backward reaches any of ``outputs``."""
        for leaf in _torch.pytree.tree_leaves(outputs):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad and leaf.grad_fn is not None:
                leaf.register_hook(self._on_output_grad)

    @property
    def finished(self) -> bool:
        return self._done is not None

    def sample(self) -> StepSample | None:
        """The step's times, or ``None`` when it did not run a whole backward."""
        if self._clock is None or None in (self._start, self._last_ready, self._done):
            return None
        seconds = self._clock.seconds
        return StepSample(
            backward_s=max(0.0, seconds(self._start, self._last_ready)),
            ready_s=tuple(0.0 if r is None else max(0.0, seconds(self._start, r)) for r in self._ready),
            after_s=max(0.0, seconds(self._last_ready, self._done)),
        )

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if self._start is None and self._clock is not None:
            self._start = self._clock.now()

    def _on_ready(self, group: int, param: torch.Tensor) -> None:
        if self._clock is None:
            return
        self._ready[group] = self._last_ready = self._clock.now()
        if not self._queued:
            self._queued = True
            _torch.queue_after_backward(self._after_everything_queued)

    def _after_everything_queued(self) -> None:
        _torch.queue_after_backward(self._on_done)

    def _on_done(self) -> None:
        if self._clock is not None:
            self._done = self._clock.now()
        self.remove()


def copy_back_seconds(params: Sequence[torch.Tensor]) -> float:
    """Seconds DDP takes to copy buckets holding ``params``' gradients back into them: as
    many bytes, moved between each parameter and one flat buffer (cold, like a bucket; at
    most :data:`_COPY_BUFFER_BYTES`, used in turns), the fastest of three passes."""
    tensors = [p.detach().reshape(-1) for p in params if p.requires_grad]
    if not tensors:
        return 0.0
    clock = Clock(tensors[0].device)
    sizes = [-(-t.numel() * t.element_size() // 16) * 16 for t in tensors]  # 16-byte aligned
    size = min(sum(sizes), max(_COPY_BUFFER_BYTES, max(sizes)))
    best = float("inf")
    with torch.no_grad(), _torch.unset_fake_mode():
        flat = torch.empty(size, dtype=torch.uint8, device=tensors[0].device)
        for _ in range(3):
            start, offset = clock.now(), 0
            for tensor, nbytes in zip(tensors, sizes):
                offset = 0 if offset + nbytes > size else offset
                flat[offset:offset + tensor.numel() * tensor.element_size()].view(tensor.dtype).copy_(tensor)
                offset += nbytes
            best = min(best, clock.seconds(start, clock.now()))
    return best
