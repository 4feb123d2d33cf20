"""``min_piece_mb="auto"`` without ``link_gbps``: measure the first steps, then re-plan once.

Note [Measuring the link]
-------------------------
How long DDP's communication takes decides how many pieces pay off (Note [Choosing pieces
by cost] in ``plan.py``), and nothing at compile time says it: the process group, the
network, the comm hook the user registered and the other ranks all play a part. So a graph
sized automatically is compiled as *one* piece (the fastest compile, and the best grouping
when communication is free: one rank, an instant hook) and its first training steps (grad
enabled, DDP synchronising gradients) are used as follows.

1. The first runs the graph's FX code eagerly. DDP rebuilds its buckets once, from the
   order in which gradients became ready in its first synchronised backward; one compiled
   piece makes them all ready at once in an arbitrary order, and buckets rebuilt from that
   would mix parameters of the whole model, so that no later grouping could hand DDP a
   bucket before backward ends. Eagerly, gradients become ready in the order the plan
   predicts (Note [Bucket plan]).
2. The second runs the compiled piece unmeasured: its backward compiles.
3. The next :data:`MEASURED_STEPS` are timed with a :class:`measure.StepProbe`. With one
   piece every bucket is launched when backward ends, so the time from the end of the
   graph's backward until DDP's ``finalize_backward`` returns is all of the communication;
   its median, less DDP's copy of the buckets back into the gradients (which ends every
   step, whatever the grouping), over the graph's gradient bytes, is the link's speed. The median backward
   rescales the per-node estimates of ``cost.py`` (they rank nodes well and miss by a
   roughly constant factor).
4. At the next, the buckets are grouped as if the user had given that ``link_gbps``, once.
   If the grouping is still one piece nothing is recompiled; otherwise the pieces are
   compiled under the frame's tracing context, as they would have been at the first call,
   and replace the whole graph. Either way a new :class:`CompileRecord` (in
   ``DDPSplitBackend.records``, and a ``TORCH_LOGS=ddp_split`` table) shows what was
   measured, the grouping and the recompile's seconds.

Each rank measures and decides for itself; DDP's buckets and the order in which they are
reduced do not depend on the pieces, so ranks that group differently still agree.
Communication overlapped with another graph's backward (a model with graph breaks) is not
seen, so such models lean towards fewer pieces.
"""

from __future__ import annotations

import statistics
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .measure import StepProbe, StepSample
from .plan import CostInputs

__all__ = ["MEASURED_STEPS", "STEPS_BEFORE_REPLAN", "Measurement", "RegroupingCallable"]

MEASURED_STEPS = 4
"""Training steps timed before re-planning (after one eager step and one that compiles backward)."""
_UNMEASURED_STEPS = 2
STEPS_BEFORE_REPLAN = _UNMEASURED_STEPS + MEASURED_STEPS
"""Training steps a measured graph runs as one piece."""


@dataclass(frozen=True, slots=True)
class Measurement:
    """What the first steps of one graph showed (the medians of its samples)."""

    samples: tuple[StepSample, ...]
    grad_bytes: int
    ddp_work_s: float = 0.0
    """Of the time after backward, what DDP does whatever the link (copying each bucket back
    into the gradients; estimated from the device's copy speed), not sending."""

    @property
    def backward_s(self) -> float:
        return statistics.median(s.backward_s for s in self.samples)

    @property
    def comm_s(self) -> float:
        """The link's time: the median time after backward, less DDP's own work in it."""
        return max(0.0, statistics.median(s.comm_s for s in self.samples) - self.ddp_work_s)

    def cost_inputs(self, node_backward_s: Sequence[float], fixed_s: float, backward_share: float) -> CostInputs:
        """The grouping's inputs: estimates rescaled to the measured backward (less the one
        piece's own fixed cost in it), the link's speed from the measured communication."""
        estimated = sum(node_backward_s)
        computed = max(0.0, self.backward_s - backward_share * fixed_s)
        scale = computed / estimated if estimated > 0 else 0.0
        comm = self.comm_s
        return CostInputs(
            node_backward_s=tuple(t * scale for t in node_backward_s),
            fixed_s=fixed_s,
            link_bytes_per_s=self.grad_bytes / comm if comm > 0 else float("inf"),
            link_source=(
                f"measured over {len(self.samples)} steps as one piece: communication "
                f"{comm * 1e3:.2f} ms for {self.grad_bytes / 2**20:.2f} MiB after a "
                f"{self.backward_s * 1e3:.2f} ms backward (less {self.ddp_work_s * 1e3:.2f} ms "
                "of DDP copying buckets back)"
            ),
        )


@dataclass(slots=True)
class _Window:
    """The measuring state of one graph until it is re-planned."""

    ddp: weakref.ReferenceType[torch.nn.Module]
    params: tuple[weakref.ReferenceType[torch.Tensor], ...]
    grad_bytes: int
    ddp_work_s: float
    replan: Callable[[Measurement], Callable[..., Any] | None]
    """Plans from the measurement; the new callable, or ``None`` to keep the one piece."""
    eager: Callable[..., Any] | None
    """The graph's FX code, for the first training step."""
    steps: int = 0
    probe: StepProbe | None = None
    samples: list[StepSample] = field(default_factory=list)


class RegroupingCallable:
    """A graph compiled as one piece that re-plans itself once it has measured (Note
    [Measuring the link]); after that, a call is one attribute check away from the pieces."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        eager: Callable[..., Any],
        ddp: torch.nn.Module,
        params: Sequence[torch.Tensor],
        grad_bytes: int,
        ddp_work_s: float,
        replan: Callable[[Measurement], Callable[..., Any] | None],
    ) -> None:
        self._fn = fn
        self._window: _Window | None = _Window(
            weakref.ref(ddp), tuple(weakref.ref(p) for p in params), grad_bytes, ddp_work_s, replan, eager
        )

    @property
    def measuring(self) -> bool:
        return self._window is not None

    def __call__(self, *args: Any) -> Any:
        if self._window is None:
            return self._fn(*args)
        return self._measured_call(self._window, args)

    def _measured_call(self, window: _Window, args: Sequence[Any]) -> Any:
        self._collect(window)
        ddp = window.ddp()
        if ddp is None:
            self._window = None
            return self._fn(*args)
        if not (torch.is_grad_enabled() and ddp.training and getattr(ddp, "require_backward_grad_sync", True)):
            return self._fn(*args)  # evaluation or gradient accumulation: nothing to measure
        window.steps += 1
        if len(window.samples) >= MEASURED_STEPS:
            self._window = None
            self._regroup(window)
            return self._fn(*args)
        if window.eager is not None:  # the first training step: DDP learns the bucket order
            eager, window.eager = window.eager, None
            return eager(*args)
        if window.steps <= _UNMEASURED_STEPS:
            return self._fn(*args)
        params = [p for p in (ref() for ref in window.params) if p is not None]
        probe = StepProbe(params)
        try:
            outputs = self._fn(*args)
        except BaseException:
            probe.remove()
            raise
        probe.watch(outputs)
        window.probe = probe
        return outputs

    def _collect(self, window: _Window) -> None:
        """The previous call's sample, if its backward ran to the end."""
        probe, window.probe = window.probe, None
        if probe is None:
            return
        probe.remove()
        sample = probe.sample()
        if sample is not None:
            window.samples.append(sample)

    def _regroup(self, window: _Window) -> None:
        measurement = Measurement(tuple(window.samples), window.grad_bytes, window.ddp_work_s)
        try:
            fn = window.replan(measurement)
        except Exception as error:  # keep training on the one piece
            warnings.warn(
                f"ddp_split: min_piece_mb='auto' could not re-plan after measuring, and keeps the "
                f"graph as one piece: {type(error).__name__}: {error}",
                stacklevel=3,
            )
            return
        if fn is not None:
            self._fn = fn
