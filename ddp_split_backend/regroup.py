"""``min_piece_mb="auto"`` (opt-in) without ``link_gbps``: measure the first steps, then re-plan once.

Note [Measuring the link]
-------------------------
How long DDP's communication takes decides how many pieces pay off (Note [Choosing pieces
by cost] in ``plan.py``), and nothing at compile time says it: the process group, the
network, the comm hook the user registered and the other ranks all play a part. So a graph
sized automatically is first compiled exactly as the default compiles it, one piece per
bucket (identical pieces compiled once), and its first training steps (grad enabled, DDP
synchronising gradients) are used as follows.

1. While the DDP module running the graph has yet to rebuild its buckets (its first
   synchronised step; the first two with ``static_graph=True``; again for every new DDP
   module of the model class), the graph's FX code runs eagerly. DDP rebuilds its buckets
   once, from the order in which gradients became ready; within a piece they become ready
   together in an arbitrary order, and a rebuilt bucket could then close inside a piece.
   Eagerly, gradients become ready in the order the plan predicts (Note [Bucket plan]), so
   every later grouping hands DDP whole buckets. This holds for the callable's whole life.
2. The window binds (weakly) to the first DDP module that trains through the graph after
   that. When the graph holds only part of that module's gradients (graph breaks, regional
   compilation), the probe also times the rest of DDP's gradients
   (:attr:`Measurement.partial`): if nothing worth a cut was left exposed after them the
   link is taken as free, otherwise which graph's cuts would help cannot be told and the
   grouping comes from the static estimate (:class:`Declined`), as it does when the graph
   runs again before its backward ended. The first bound step runs unmeasured: the pieces'
   backward compiles.
3. The next :data:`MEASURED_STEPS` are timed with a :class:`measure.StepProbe`: when each
   bucket's gradients are ready (its piece's backward has run and DDP launches it) and when
   ``finalize_backward`` returns, once the link has sent every bucket and DDP has copied
   each back into the gradients as it arrived (the copy timed once by
   :func:`measure.copy_back_seconds`). One link sends the buckets in the order they are
   ready, so the step's end is a known, increasing function of the link's speed: the speed
   at which it would have ended when it did is the link's (:func:`_link_seconds_per_byte`).
   A step that ended no later than with a free link takes the link as free. The medians
   over the steps are used; each bucket's measured backward rescales the per-node
   estimates of ``cost.py``.
4. At the next step the buckets are grouped as if the user had given that ``link_gbps``,
   once. If one piece per bucket is still best, or the predicted saving would not pay for
   the new pieces' compile within ``plan.PAYBACK_STEPS`` steps, nothing is compiled; otherwise
   the new pieces are compiled under the frame's tracing context, from the frame's fake
   inputs, as they would have been at the first call, and replace the per-bucket pieces
   (a new piece holding one bucket keeps that bucket's first compile, ``Outcome.KEPT``).
   Either way a new :class:`CompileRecord` (in ``DDPSplitBackend.records``, a
   ``TORCH_LOGS=ddp_split`` table and one summary line) shows what was measured, the
   grouping and the recompile's seconds.

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
    "Declined", "MEASURED_STEPS", "STEPS_BEFORE_REPLAN", "Measurement", "RegroupingCallable",
    "replan_pending",
]

MEASURED_STEPS = 4
"""Training steps timed before re-planning (after the step that compiles backward)."""
_UNMEASURED_STEPS = 1
STEPS_BEFORE_REPLAN = 1 + _UNMEASURED_STEPS + MEASURED_STEPS
"""Training steps a measured graph runs one piece per bucket before its re-plan, under a DDP
that rebuilds its buckets after its first step (one eager step; ``static_graph=True`` takes two)."""
_BISECTIONS = 60


def _link_seconds_per_byte(ready: Sequence[float], nbytes: Sequence[int], end: float, copy_s: float = 0.0) -> float:
    """The link speed (seconds per byte) at which a step ends at ``end``: one link sends
    buckets of ``nbytes`` in the order they are ``ready`` (both in backward order), each as
    soon as it is ready and the one before it is sent; once backward ended, DDP waits for
    each bucket in that order and copies it back into the gradients (``copy_s`` for all of
    them, shared by bytes), so a copy overlaps the sending of the buckets after it. 0 when
    the step ended no later than with a free link."""
    total = sum(nbytes)
    if total <= 0:
        return 0.0
    start = max(ready, default=0.0)

    def finish(per_byte: float) -> float:
        link, done = 0.0, start
        for at, size in zip(ready, nbytes, strict=True):
            link = max(link, at) + size * per_byte
            done = max(done, link) + copy_s * size / total
        return done

    if end <= finish(0.0):
        return 0.0
    low, high = 0.0, end / total  # the last bucket is sent no earlier than every byte's time
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        low, high = (middle, high) if finish(middle) < end else (low, middle)
    return high


@dataclass(frozen=True, slots=True)
class Measurement:
    """What the first steps of one graph, one piece per bucket, showed (the medians of its samples)."""

    samples: tuple[StepSample, ...]
    bucket_bytes: tuple[int, ...]
    """The graph's buckets' gradient bytes, in forward order (the probe's first groups)."""
    ddp_work_s: float = 0.0
    """Of the time after backward, what DDP does whatever the link (copying each bucket back
    into the gradients, timed on the measured parameters), not sending."""
    partial: bool = False
    """The graph holds only part of DDP's gradients (graph breaks, regional compilation):
    the samples also time the rest of DDP's backward, which says whether communication was
    left exposed, not which graph's cuts would hide it."""

    @property
    def backward_s(self) -> float:
        return statistics.median(s.backward_s for s in self.samples)

    @property
    def exposed_s(self) -> float:
        """Communication left after backward, beyond DDP's copy back (the median)."""
        return statistics.median(self._exposed(s) for s in self.samples)

    @property
    def bucket_backward_s(self) -> tuple[float, ...]:
        """Each bucket's own backward (forward order; the median): from the bucket after it
        (backward's start, for the last) being ready to it being ready."""
        count = len(self.bucket_bytes)

        def spans(sample: StepSample) -> list[float]:
            ready = sample.ready_s[:count]
            return [max(0.0, ready[k] - (ready[k + 1] if k + 1 < count else 0.0)) for k in range(count)]

        per_sample = [spans(s) for s in self.samples]
        return tuple(statistics.median(column) for column in zip(*per_sample, strict=True))

    @property
    def comm_s(self) -> float:
        """The link's time for the graph's gradients (the median of each step's fit);
        0 when nothing was exposed."""
        if self.partial:
            return 0.0
        return statistics.median(self._seconds_per_byte(s) for s in self.samples) * sum(self.bucket_bytes)

    def _exposed(self, sample: StepSample) -> float:
        return sample.after_s - self.ddp_work_s

    def _seconds_per_byte(self, sample: StepSample) -> float:
        count = len(self.bucket_bytes)
        ready = sample.ready_s[:count][::-1]  # backward visits the last bucket first
        end = sample.backward_s + sample.after_s
        return _link_seconds_per_byte(ready, self.bucket_bytes[::-1], end, self.ddp_work_s)

    def worth_a_cut(self, fixed_s: float) -> bool:
        """Whether what was exposed could pay for one more piece: a cut hides at most the
        exposed communication, and costs a piece's fixed cost plus TOLERANCE of the step."""
        return self.exposed_s > fixed_s + TOLERANCE * (self.backward_s + max(0.0, self.exposed_s))

    def cost_inputs(
        self, node_backward_s: Sequence[float], bucket_nodes: Sequence[tuple[int, int]], fixed_s: float,
        backward_share: float,
    ) -> CostInputs:
        """The grouping's inputs: each bucket's estimates (its nodes ``bucket_nodes``, forward
        order) rescaled to its measured backward less its piece's fixed cost in it, the
        link's speed from the measured communication."""
        scaled = list(node_backward_s)
        for (start, stop), measured in zip(bucket_nodes, self.bucket_backward_s, strict=True):
            computed = max(0.0, measured - backward_share * fixed_s)
            estimated = sum(node_backward_s[start:stop])
            for i in range(start, stop):
                scaled[i] = node_backward_s[i] * computed / estimated if estimated > 0 else computed / (stop - start)
        ms, comm = 1e3, self.comm_s
        whole = " (and the rest of DDP's: the graph holds part of its gradients)" if self.partial else ""
        seen = (
            f"measured over {len(self.samples)} steps as one piece per bucket{whole}: {self.backward_s * ms:.2f} ms "
            f"of backward, {max(0.0, self.exposed_s) * ms:.2f} ms exposed after it (DDP's copy back, "
            f"{self.ddp_work_s * ms:.2f} ms, not counted)"
        )
        if comm > 0:
            link, source = sum(self.bucket_bytes) / comm, f"{seen}: the link takes {comm * ms:.2f} ms"
        else:
            link, source = float("inf"), f"{seen}: nothing left to send, taken as free"
        return CostInputs(node_backward_s=tuple(scaled), fixed_s=fixed_s, link_bytes_per_s=link, link_source=source)


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

    buckets_of: Callable[[torch.nn.Module], list[list[torch.Tensor]]]
    """The parameters of each of the graph's buckets (forward order) in a DDP module (by
    name: every DDP of the model class)."""
    bucket_bytes: tuple[int, ...]
    replan: Callable[[Measurement | Declined, torch.nn.Module | None], Callable[..., Any] | None]
    """Plans from the measurement (or the static estimate, when declined) for the measured
    DDP module; the new callable, or ``None`` to keep the pieces it has."""
    ddp: weakref.ReferenceType[torch.nn.Module] | None = None
    """The DDP module measured: the first that trains through the graph once it rebuilt its
    buckets (another takes its place if it is freed before the re-plan)."""
    groups: tuple[tuple[weakref.ReferenceType[torch.Tensor], ...], ...] = ()
    """The parameters timed: the graph's buckets, and the rest of DDP's when the graph holds
    part of them."""
    partial: bool = False
    steps: int = 0
    probe: StepProbe | None = None
    samples: list[StepSample] = field(default_factory=list)

    def bind(self, ddp: torch.nn.Module) -> None:
        """Measure ``ddp``'s steps from now on (a new DDP starts over). A graph holding only
        part of DDP's gradients also times the rest of them (:attr:`Measurement.partial`)."""
        self.ddp, self.steps, self.probe, self.samples = weakref.ref(ddp), 0, None, []
        groups = self.buckets_of(ddp)
        held = {id(p) for group in groups for p in group}
        rest = [p for p in _torch.ddp_reduced_params(ddp) if id(p) not in held]
        self.partial = bool(rest)
        self.groups = tuple(tuple(weakref.ref(p) for p in group) for group in (*groups, *([rest] if rest else [])))

    def live_groups(self) -> list[list[torch.Tensor]]:
        return [[p for p in (ref() for ref in group) if p is not None] for group in self.groups]


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
        if bound is ddp or (bound is None and any(window.buckets_of(ddp))):
            return True
    return False


class RegroupingCallable:
    """A graph compiled one piece per bucket that re-plans itself once it has measured (Note
    [Measuring the link]). Whatever the plan, a training step under a DDP module that has
    yet to rebuild its buckets runs the graph's FX code eagerly, so that DDP learns the
    gradient order of the graph's real backward (Note [Measuring the link], step 1)."""

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        eager: Callable[..., Any],
        buckets_of: Callable[[torch.nn.Module], list[list[torch.Tensor]]],
        bucket_bytes: tuple[int, ...],
        copies_back: bool,
        replan: Callable[[Measurement | Declined, torch.nn.Module | None], Callable[..., Any] | None],
    ) -> None:
        self._current = _Current(fn, _Window(buckets_of, bucket_bytes, replan))
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
        probe = StepProbe(window.live_groups())
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
                params = [p for group in window.live_groups() for p in group]
                copying = copy_back_seconds(params) if self._copies_back else 0.0
                measured = Measurement(tuple(window.samples), window.bucket_bytes, copying, window.partial)
                fn = window.replan(measured, ddp)
            else:
                fn = window.replan(declined, ddp)
        except Exception as error:  # keep training on the pieces it has
            warnings.warn(
                f"ddp_split: min_piece_mb='auto' could not re-plan, and keeps one piece per bucket: "
                f"{type(error).__name__}: {error}",
                stacklevel=3,
            )
            return
        if fn is not None:
            current.fn = fn
