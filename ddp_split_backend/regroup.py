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
   piece, DDP launches the buckets while the gradients are accumulated after the piece's
   backward, and ``finalize_backward`` returns once the link has sent them all and DDP
   has copied them back into the gradients (which ends every step, whatever the grouping;
   timed once by :func:`measure.copy_back_seconds`). What is left after backward beyond
   that copy is exposed communication. If there is none, the link kept up and costs
   nothing worth a cut. Otherwise the link was busy from the first gradient on, and that
   time, over the graph's gradient bytes, is its speed. The medians over the steps are
   used; the median backward rescales the per-node estimates of ``cost.py`` (they rank
   nodes well and miss by a roughly constant factor).
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

from .measure import StepProbe, StepSample, copy_back_seconds
from .plan import TOLERANCE, CostInputs

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
    into the gradients, timed on the graph's parameters), not sending."""

    @property
    def backward_s(self) -> float:
        return statistics.median(s.backward_s for s in self.samples)

    @property
    def exposed_s(self) -> float:
        """Communication left after backward, beyond DDP's copy back (the median)."""
        return statistics.median(self._exposed(s) for s in self.samples)

    @property
    def comm_s(self) -> float:
        """The link's time for the graph's gradients, busy from the first gradient on (the
        median); 0 when nothing was exposed."""
        return statistics.median(
            self._exposed(s) + s.accumulating_s if self._exposed(s) > 0 else 0.0 for s in self.samples
        )

    def _exposed(self, sample: StepSample) -> float:
        return sample.after_s - self.ddp_work_s

    def worth_a_cut(self, fixed_s: float) -> bool:
        """Whether what was exposed could pay for one more piece: a cut hides at most the
        exposed communication, and costs a piece's fixed cost plus TOLERANCE of the step."""
        return self.exposed_s > fixed_s + TOLERANCE * (self.backward_s + max(0.0, self.exposed_s))

    def cost_inputs(self, node_backward_s: Sequence[float], fixed_s: float, backward_share: float) -> CostInputs:
        """The grouping's inputs: estimates rescaled to the measured backward (less the one
        piece's own fixed cost in it), the link's speed from the measured communication."""
        estimated = sum(node_backward_s)
        computed = max(0.0, self.backward_s - backward_share * fixed_s)
        scale = computed / estimated if estimated > 0 else 0.0
        ms, comm = 1e3, self.comm_s
        seen = (
            f"measured over {len(self.samples)} steps as one piece: {self.backward_s * ms:.2f} ms of "
            f"backward, {max(0.0, self.exposed_s) * ms:.2f} ms exposed after it (DDP's copy back, "
            f"{self.ddp_work_s * ms:.2f} ms, not counted)"
        )
        if self.worth_a_cut(fixed_s) and comm > 0:
            link, source = self.grad_bytes / comm, f"{seen}: the link takes {comm * ms:.2f} ms"
        else:
            link, source = float("inf"), f"{seen}: too little for a cut to hide, taken as free"
        return CostInputs(
            node_backward_s=tuple(t * scale for t in node_backward_s),
            fixed_s=fixed_s,
            link_bytes_per_s=link,
            link_source=source,
        )


@dataclass(slots=True)
class _Window:
    """The measuring state of one graph until it is re-planned."""

    ddp: weakref.ReferenceType[torch.nn.Module]
    params: tuple[weakref.ReferenceType[torch.Tensor], ...]
    grad_bytes: int
    copies_back: bool
    """Whether DDP copies buckets back into the gradients (no ``gradient_as_bucket_view``)."""
    replan: Callable[[Measurement], Callable[..., Any] | None]
    """Plans from the measurement; the new callable, or ``None`` to keep the one piece."""
    eager: Callable[..., Any] | None
    """The graph's FX code, for the first training step."""
    steps: int = 0
    probe: StepProbe | None = None
    samples: list[StepSample] = field(default_factory=list)

    def live_params(self) -> list[torch.Tensor]:
        return [p for p in (ref() for ref in self.params) if p is not None]


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
        copies_back: bool,
        replan: Callable[[Measurement], Callable[..., Any] | None],
    ) -> None:
        self._fn = fn
        self._window: _Window | None = _Window(
            weakref.ref(ddp), tuple(weakref.ref(p) for p in params), grad_bytes, copies_back, replan, eager
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
        probe = StepProbe(window.live_params())
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
        try:
            copying = copy_back_seconds(window.live_params()) if window.copies_back else 0.0
            measurement = Measurement(tuple(window.samples), window.grad_bytes, copying)
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
