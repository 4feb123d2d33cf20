"""``min_piece_mb="auto"`` (opt-in) without ``link_gbps``: measure the first steps, then re-plan once.

Note [Measuring the link]
-------------------------
How long DDP's communication takes decides how many pieces pay off (Note [Choosing pieces
by cost] in ``plan.py``), and nothing at compile time says it: the process group, the
network, the comm hook the user registered and the other ranks all play a part. So a graph
sized automatically is compiled as *one* piece (the fastest compile, and the best grouping
when communication is free: one rank, an instant hook) and its first training steps (grad
enabled, DDP synchronising gradients) are used as follows.

1. While the DDP module running the graph has yet to rebuild its buckets (its first
   synchronised step; the first two with ``static_graph=True``; again for every new DDP
   module of the model class), the graph's FX code runs eagerly. DDP rebuilds its buckets
   once, from the order in which gradients became ready; one compiled piece makes them all
   ready at once in an arbitrary order, and buckets rebuilt from that would mix parameters
   of the whole model, so that no later grouping could hand DDP a bucket before backward
   ends. Eagerly, gradients become ready in the order the plan predicts (Note [Bucket plan]).
   This holds for the callable's whole life, not only while measuring.
2. The window binds (weakly) to the first DDP module that trains through the graph after
   that. When the graph holds only part of that module's gradients (graph breaks, regional
   compilation), the probe times all of DDP's backward instead (:attr:`Measurement.partial`):
   if nothing worth a cut was exposed the graph stays one piece, otherwise which graph's
   cuts would help cannot be told and the grouping comes from the static estimate
   (:class:`Declined`), as it does when the graph runs again before its backward ended.
   The first bound step runs the compiled piece unmeasured: its backward compiles.
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

Each rank measures for itself; at the re-plan every rank takes the grouping of its DDP
group's first rank (Note [One plan for every rank] in ``agree.py``: through the store, with a
bounded wait, no collective). docs/design.md, "The measuring window", draws the window's
life cycle.
"""

from __future__ import annotations

import enum
import statistics
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _torch
from .measure import StepProbe, StepSample, copy_back_seconds
from .plan import TOLERANCE, CostInputs

__all__ = [
    "Declined", "MEASURED_STEPS", "STEPS_BEFORE_REPLAN", "Measurement", "RegroupingCallable", "replan_pending",
]

MEASURED_STEPS = 4
"""Training steps timed before re-planning (after the step that compiles backward)."""
_UNMEASURED_STEPS = 1
STEPS_BEFORE_REPLAN = 1 + _UNMEASURED_STEPS + MEASURED_STEPS
"""Training steps a measured graph runs as one piece under a DDP that rebuilds its buckets
after its first step (one eager step; ``static_graph=True`` takes two)."""


@dataclass(frozen=True, slots=True)
class Measurement:
    """What the first steps of one graph showed (the medians of its samples)."""

    samples: tuple[StepSample, ...]
    grad_bytes: int
    ddp_work_s: float = 0.0
    """Of the time after backward, what DDP does whatever the link (copying each bucket back
    into the gradients, timed on the measured parameters), not sending."""
    partial: bool = False
    """The graph holds only part of DDP's gradients (graph breaks, regional compilation):
    the samples time the whole of DDP's backward, which says whether communication was left
    exposed, not which graph's cuts would hide it."""

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
        whole = " (all of DDP's backward: the graph holds part of its gradients)" if self.partial else ""
        seen = (
            f"measured over {len(self.samples)} steps as one piece{whole}: {self.backward_s * ms:.2f} ms of "
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


class Declined(enum.Enum):
    """Why a graph's steps could not be measured; it is grouped by the static estimate."""

    PART_OF_THE_MODEL = (
        "the graph holds only part of DDP's gradients (graph breaks or regional compilation) and "
        "communication was left exposed: which graph's cuts would hide it cannot be told"
    )
    CALLED_TWICE = "the graph ran again before its last backward ended (several calls per step)"


@dataclass(slots=True)
class _Window:
    """The measuring state of one graph until it is re-planned."""

    params_of: Callable[[torch.nn.Module], list[torch.Tensor]]
    """The graph's parameters in a DDP module (by name: every DDP of the model class)."""
    grad_bytes: int
    replan: Callable[[Measurement | Declined, torch.nn.Module | None], Callable[..., Any] | None]
    """Plans from the measurement (or the static estimate, when declined) for the measured
    DDP module; the new callable, or ``None`` to keep the one piece."""
    ddp: weakref.ReferenceType[torch.nn.Module] | None = None
    """The DDP module measured: the first that trains through the graph once it rebuilt its
    buckets (another takes its place if it is freed before the re-plan)."""
    params: tuple[weakref.ReferenceType[torch.Tensor], ...] = ()
    """The parameters timed: the graph's, or all of DDP's when the graph holds part of them."""
    partial: bool = False
    steps: int = 0
    probe: StepProbe | None = None
    samples: list[StepSample] = field(default_factory=list)

    def bind(self, ddp: torch.nn.Module) -> None:
        """Measure ``ddp``'s steps from now on (a new DDP starts over). A graph holding only
        part of DDP's gradients times all of DDP's backward (:attr:`Measurement.partial`)."""
        self.ddp, self.steps, self.probe, self.samples = weakref.ref(ddp), 0, None, []
        params = self.params_of(ddp)
        reduced = _torch.ddp_reduced_params(ddp)
        held = {id(p) for p in params}
        self.partial = any(id(p) not in held for p in reduced)
        self.params = tuple(weakref.ref(p) for p in (reduced if self.partial else params))

    def live_params(self) -> list[torch.Tensor]:
        return [p for p in (ref() for ref in self.params) if p is not None]


@dataclass(slots=True, weakref_slot=True, eq=False)
class _Current:
    """What a :class:`RegroupingCallable` runs now. Held in one object because Dynamo wraps
    the callable a backend returns with ``functools.wraps``, which copies its ``__dict__``:
    attributes replaced later on the callable would not reach the copy, but changes made to
    this object do (the copy shares it), so ending the window lets go of it everywhere."""

    fn: Callable[..., Any]
    window: _Window | None


_WINDOWS: weakref.WeakSet[_Current] = weakref.WeakSet()
"""Every live measured graph's state (weakly: a freed graph drops out), for :func:`replan_pending`."""


def replan_pending(ddp: torch.nn.Module) -> bool:
    """Whether a graph of ``ddp``'s model is still to be re-planned: measured on ``ddp``, or
    not bound yet and using parameters of ``ddp``'s module (``watch_overlap`` waits for it:
    it measures the plan that stays)."""
    for current in list(_WINDOWS):
        window = current.window
        if window is None:
            continue
        bound = window.ddp() if window.ddp is not None else None
        if bound is ddp or (bound is None and window.params_of(ddp)):
            return True
    return False


class RegroupingCallable:
    """A graph compiled as one piece that re-plans itself once it has measured (Note
    [Measuring the link]). Whatever the plan, a training step under a DDP module that has
    yet to rebuild its buckets runs the graph's FX code eagerly, so that DDP learns the
    gradient order of the graph's real backward (Note [Measuring the link], step 1)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        eager: Callable[..., Any],
        params_of: Callable[[torch.nn.Module], list[torch.Tensor]],
        grad_bytes: int,
        copies_back: bool,
        replan: Callable[[Measurement | Declined, torch.nn.Module | None], Callable[..., Any] | None],
    ) -> None:
        self._current = _Current(fn, _Window(params_of, grad_bytes, replan))
        _WINDOWS.add(self._current)
        self._eager = eager
        self._copies_back = copies_back

    @property
    def measuring(self) -> bool:
        return self._current.window is not None

    def __call__(self, *args: Any) -> Any:
        current = self._current
        ddp = _torch.active_ddp_module()
        if ddp is None or not (torch.is_grad_enabled() and ddp.training and getattr(ddp, "require_backward_grad_sync", True)):
            return current.fn(*args)  # evaluation, gradient accumulation, no DDP: nothing to learn or measure
        if _torch.ddp_rebuilds_buckets_later(ddp):
            return self._eager(*args)  # DDP learns its bucket order from this backward
        if current.window is None:
            return current.fn(*args)
        return self._measured_call(current, current.window, ddp, args)

    def _measured_call(self, current: _Current, window: _Window, ddp: torch.nn.Module, args: Sequence[Any]) -> Any:
        probe = window.probe
        if probe is not None and not probe.finished and window.ddp is not None and window.ddp() is ddp:
            probe.remove()
            return self._decline(current, window, Declined.CALLED_TWICE, args)
        self._collect(window)
        bound = window.ddp() if window.ddp is not None else None
        if bound is None:
            window.bind(ddp)
        elif bound is not ddp:
            return current.fn(*args)  # another DDP module of the same model class: not measured
        window.steps += 1
        if len(window.samples) >= MEASURED_STEPS:
            current.window = None
            self._regroup(current, window)
            return current.fn(*args)
        if window.steps <= _UNMEASURED_STEPS:
            return current.fn(*args)
        probe = StepProbe(window.live_params())
        try:
            outputs = current.fn(*args)
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

    def _decline(self, current: _Current, window: _Window, reason: Declined, args: Sequence[Any]) -> Any:
        current.window = None
        self._regroup(current, window, reason)
        return current.fn(*args)

    def _regroup(self, current: _Current, window: _Window, declined: Declined | None = None) -> None:
        """Re-plan from what was seen: the measured samples, or why there are none."""
        ddp = window.ddp() if window.ddp is not None else None
        try:
            if declined is None:
                copying = copy_back_seconds(window.live_params()) if self._copies_back else 0.0
                measured = Measurement(tuple(window.samples), window.grad_bytes, copying, window.partial)
                fn = window.replan(measured, ddp)
            else:
                fn = window.replan(declined, ddp)
        except Exception as error:  # keep training on the one piece
            warnings.warn(
                f"ddp_split: min_piece_mb='auto' could not re-plan, and keeps the graph as one piece: "
                f"{type(error).__name__}: {error}",
                stacklevel=3,
            )
            return
        if fn is not None:
            current.fn = fn
