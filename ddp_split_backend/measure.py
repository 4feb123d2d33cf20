"""Time one graph's backward and the DDP communication after it, in a real training step.

``min_piece_mb="auto"`` without ``link_gbps`` runs a graph as one piece for its first steps
and measures them (Note [Measuring the link] in ``regroup.py``). A :class:`StepProbe` watches
one step, with hooks that are removed when the step ends:

* backward starts when the gradient reaches one of the graph's outputs (a tensor hook);
* the graph's backward ends when the last of its parameters has its gradient accumulated
  (post-accumulate-grad hooks). With one piece, DDP marks every bucket ready right then
  and launches them all;
* communication ends when DDP's ``finalize_backward`` has waited for every bucket. DDP
  queues it on the autograd engine once the last bucket is ready; the probe queues a
  callback at its first parameter hook, and that callback queues a second one, which
  therefore runs after DDP's. Its time, less the end of backward, is the communication no
  backward hid: with one piece, all of it.

On a GPU the times are CUDA events on the current stream (DDP's finalize makes that stream
wait for the communication), read when the sample is taken.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import _torch
from .clock import Clock

__all__ = ["StepProbe", "StepSample"]


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured step of one graph."""

    backward_s: float
    """From the gradient reaching the graph's outputs to its last parameter's gradient."""
    comm_s: float
    """From then until DDP's communication had completed."""


class StepProbe:
    """Hooks that time one step (see the module docstring); :attr:`sample` once it ended."""

    def __init__(self, params: Sequence[torch.Tensor]) -> None:
        trainable = [p for p in params if p.requires_grad]
        self._clock = Clock(trainable[0].device) if trainable else None
        self._start: Any = None
        self._last_ready: Any = None
        self._done: Any = None
        self._queued = False
        self._handles = [p.register_post_accumulate_grad_hook(self._on_ready) for p in trainable]

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
        backward = self._clock.seconds(self._start, self._last_ready)
        comm = self._clock.seconds(self._last_ready, self._done)
        return StepSample(max(0.0, backward), max(0.0, comm))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if self._start is None and self._clock is not None:
            self._start = self._clock.now()

    def _on_ready(self, param: torch.Tensor) -> None:
        if self._clock is None:
            return
        self._last_ready = self._clock.now()
        if not self._queued:
            self._queued = True
            _torch.queue_after_backward(self._after_everything_queued)

    def _after_everything_queued(self) -> None:
        _torch.queue_after_backward(self._on_done)

    def _on_done(self) -> None:
        if self._clock is not None:
            self._done = self._clock.now()
        self.remove()
