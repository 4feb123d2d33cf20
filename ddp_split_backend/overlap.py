"""Measure how much gradient communication a real DDP run hides behind backward.

:func:`watch_overlap` registers a DDP comm hook that wraps the user's own (or DDP's default
allreduce) and, for a window of steps, records per bucket when its gradients were ready
(DDP called the hook), when its communication was launched (the wrapped hook returned) and
when it completed (its future finished), together with when backward started (the gradient
reached the DDP module's output). Nothing the wrapped hook returns is changed, so training
results are the same with and without the watch.

Note [What "exposed" means]
---------------------------
Backward's end, for DDP, is when the last bucket's gradients are ready: after that no
parameter gradient is computed and only communication can still run. The *exposed*
communication of a step is the time from that moment until the last bucket completed; its
*share* is that time over the time communication was under way (the union of every
bucket's interval from the hook's call to its completion). 0 % means every byte was sent while backward still
computed; 100 % means nothing overlapped. On a GPU the times come from CUDA events recorded
on the streams the work runs on, read once the window has closed.

Note [The link a run measured]
------------------------------
``min_piece_mb="auto"`` groups buckets against a link speed the user gives (``link_gbps``);
a watched run measures one to give it. Model the link as DDP's buckets meet it: one link
sends buckets in the order they were ready, each once it is ready and the one before it is
sent, at one speed. Then when the last bucket completes is an increasing function of that
speed (the last bucket always waits its own bytes' time), so exactly one speed ends the
step's communication when it really ended; :func:`link_seconds_per_byte` finds it by
bisection. The report gives the median over its steps (:attr:`OverlapReport.link_gbps`).
Whatever slows the communication (the comm hook's own work, the other ranks arriving late)
counts as the link's: the figure is the speed this run's gradients actually moved at.
"""

from __future__ import annotations

import logging
import math
import statistics
import textwrap
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from . import _torch
from .clock import Clock
from .diagnostics import summary_log
from .plan import TABLE_WIDTH
from .ready_order import pieces_of_buckets

__all__ = [
    "BucketTiming", "OverlapReport", "OverlapWatch", "StepOverlap", "link_seconds_per_byte", "watch_overlap",
]

log = logging.getLogger("ddp_split")

_BISECTIONS = 60
"""Halvings of the bracket :func:`link_seconds_per_byte` searches (far below a clock's resolution)."""


def link_seconds_per_byte(ready: Sequence[float], nbytes: Sequence[int], end: float) -> float:
    """The link speed, in seconds per byte, at which one link sending buckets of ``nbytes``
    in the order they are ``ready`` (each once ready and the one before it sent) finishes at
    ``end`` (Note [The link a run measured]). Times share any origin. 0 when ``end`` is no
    later than the last bucket was ready (a free link)."""
    pairs = sorted(zip(ready, nbytes, strict=True))
    total = sum(size for _, size in pairs)
    if not pairs or total <= 0:
        return 0.0

    def finish(per_byte: float) -> float:
        link = -math.inf
        for at, size in pairs:
            link = max(link, at) + size * per_byte
        return link

    if end <= finish(0.0):
        return 0.0
    low, high = 0.0, (end - pairs[0][0]) / max(1, pairs[-1][1])  # the last bucket alone takes its bytes' time
    while finish(high) < end:  # a last bucket of 0 bytes: widen until the bracket holds the end
        high *= 2
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        low, high = (middle, high) if finish(middle) < end else (low, middle)
    return high


@dataclass(frozen=True, slots=True)
class BucketTiming:
    """One bucket in one step, times in seconds relative to the end of backward."""

    bucket: int
    """DDP's bucket index (0: the gradients ready first)."""
    nbytes: int
    ready: float
    """DDP handed the bucket to the comm hook (its gradients were all computed)."""
    launched: float
    """The wrapped hook returned (its communication was enqueued)."""
    completed: float
    """Its future completed."""


@dataclass(frozen=True, slots=True)
class StepOverlap:
    """One measured step (Note [What "exposed" means])."""

    step: int
    """The step's index, counting DDP forwards from 0."""
    backward_s: float
    """From the gradient reaching the DDP module's output to the last bucket being ready."""
    buckets: tuple[BucketTiming, ...]
    """In the order DDP handed them over."""

    @property
    def exposed_s(self) -> float:
        """Communication still running after backward ended."""
        return max(0.0, max((b.completed for b in self.buckets), default=0.0))

    @property
    def comm_s(self) -> float:
        """Time communication was under way: the union of every bucket's interval from the
        hook's call to its completion (what the hook itself does, e.g. dividing by the world
        size, is communication work too)."""
        busy, end = 0.0, float("-inf")
        for b in sorted(self.buckets, key=lambda b: b.ready):
            start = max(b.ready, end)
            if b.completed > start:
                busy += b.completed - start
            end = max(end, b.completed)
        return busy

    @property
    def exposed_share(self) -> float:
        comm = self.comm_s
        return self.exposed_s / comm if comm > 0 else 0.0

    @property
    def ready_before_end(self) -> int:
        """Buckets handed to the hook before the last one (launched while backward ran)."""
        return sum(b.ready < 0 for b in self.buckets)


@dataclass(frozen=True, slots=True)
class OverlapReport:
    """The measured window of a :class:`OverlapWatch`."""

    steps: tuple[StepOverlap, ...]
    device: str
    pieces: dict[int, str] = field(default_factory=dict)
    """Per DDP bucket index, the ddp_split piece it ended up as, once DDP rebuilt its buckets
    (Note [Pieces are DDP's buckets]); empty without one."""

    @property
    def median_exposed_share(self) -> float:
        return statistics.median(s.exposed_share for s in self.steps) if self.steps else float("nan")

    @property
    def median_exposed_s(self) -> float:
        return statistics.median(s.exposed_s for s in self.steps) if self.steps else float("nan")

    @property
    def link_gbps(self) -> float:
        """The speed the gradients moved at, in GB/s (the median of each step's fit; Note [The
        link a run measured]): what to pass as ``link_gbps`` with ``min_piece_mb="auto"``.
        ``inf``: nothing was left to send once each bucket was ready; ``nan``: no step."""
        if not self.steps:
            return math.nan
        per_byte = statistics.median(
            link_seconds_per_byte(
                [b.ready for b in s.buckets], [b.nbytes for b in s.buckets], max(b.completed for b in s.buckets)
            )
            for s in self.steps
        )
        return 1.0 / per_byte / 1e9 if per_byte > 0 else math.inf

    def median_step(self) -> StepOverlap | None:
        """The step whose exposed share is the median one (what the table details)."""
        if not self.steps:
            return None
        return sorted(self.steps, key=lambda s: s.exposed_share)[len(self.steps) // 2]

    def summary(self) -> str:
        """One line: how much of the communication backward hid (the median step)."""
        median = self.median_step()
        if median is None:
            return "ddp_split overlap: no step measured yet"
        return (
            f"ddp_split overlap, training forwards {self.steps[0].step}-{self.steps[-1].step}: "
            f"{1 - self.median_exposed_share:.0%} of the communication was hidden behind backward "
            f"({median.ready_before_end} of {len(median.buckets)} buckets sent before backward ended; "
            f"{self.median_exposed_s * 1e3:.2f} ms exposed, median); link {self.link_gbps:.3g} GB/s"
        )

    def table(self) -> str:
        """Per step the exposed communication; per bucket of the median step its times."""
        if not self.steps:
            return "ddp_split overlap: no step measured yet"
        lines = [
            textwrap.fill(
                f"ddp_split overlap ({self.device}, {len(self.steps)} steps): exposed communication "
                f"{self.median_exposed_s * 1e3:.2f} ms, {self.median_exposed_share:.0%} of the time communication "
                f"was under way (median); link {self.link_gbps:.3g} GB/s (pass it as link_gbps)",
                TABLE_WIDTH, subsequent_indent="    ",
            ),
            "  step  backward ms  comm ms  exposed ms  exposed  buckets ready before backward end",
        ]
        for s in self.steps:
            lines.append(
                f"  {s.step:4d}  {s.backward_s * 1e3:11.2f}  {s.comm_s * 1e3:7.2f}  {s.exposed_s * 1e3:10.2f}  "
                f"{s.exposed_share:7.0%}  {s.ready_before_end}/{len(s.buckets)}"
            )
        median = self.median_step()
        assert median is not None
        lines.append(f"  step {median.step}, ms relative to the end of backward:")
        lines.append("  bucket       bytes    ready  launched  completed  ddp_split piece")
        for b in median.buckets:
            lines.append(
                f"  {b.bucket:6d}  {b.nbytes:10,}  {b.ready * 1e3:7.2f}  {b.launched * 1e3:8.2f}  {b.completed * 1e3:9.2f}"
                f"  {self.pieces.get(b.bucket, '-')}"
            )
        return "\n".join(lines)

    def draw(self, path: str | Path) -> Path | None:
        """A timeline PNG of the median step: backward as a band, each bucket as a bar from
        launch to completion, a dot where it was ready. Needs matplotlib (``pip install
        'ddp-split-backend[plot]'``): without it, one warning naming the extra and ``None``."""
        from .picture import draw_overlap, drawn

        return drawn(lambda: draw_overlap(self.median_step(), self.device, Path(path)))


@dataclass
class _Pending:
    """One bucket of the step in progress: host times, or CUDA events read later."""

    bucket: int
    nbytes: int
    ready: Any
    launched: Any
    completed: Any = None


@dataclass
class _Step:
    index: int
    start: Any = None
    """When the gradient reached the output (backward's start)."""
    buckets: list[_Pending] = field(default_factory=list)


class OverlapWatch:
    """The comm hook and step hooks of :func:`watch_overlap`; :meth:`report` reads them."""

    def __init__(self, ddp: torch.nn.Module, hook: Callable[..., Any], state: Any, warmup: int, steps: int) -> None:
        self.hook, self.state = hook, state
        self.warmup, self.steps = warmup, steps
        self._ddp = weakref.ref(ddp)
        self._forwards = 0
        self._measured: list[_Step] = []
        self._current: _Step | None = None
        self._clock: Clock | None = None
        self._logged = False
        self._handles = [
            ddp.register_forward_pre_hook(torch.compiler.disable(self._on_forward)),
            ddp.register_forward_hook(torch.compiler.disable(self._on_output)),
        ]

    @property
    def done(self) -> bool:
        """The window has closed: every forward of it ran, and the next one began (or the
        watch was removed)."""
        return self._forwards >= self.warmup + self.steps and self._current is None

    def remove(self) -> None:
        """Stop watching the forwards (the comm hook stays: DDP cannot unregister one; it then
        only forwards to the wrapped hook)."""
        for handle in self._handles:
            handle.remove()
        self._close_step()

    def _on_forward(self, module: torch.nn.Module, args: Any) -> None:
        self._close_step()
        index = self._forwards
        self._forwards += 1
        if not (self.warmup <= index < self.warmup + self.steps and module.training):
            return
        self._current = _Step(index)

    def _on_output(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        step = self._current
        if step is None:
            return
        for leaf in _torch.pytree.tree_leaves(output):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                if self._clock is None:
                    self._clock = Clock(leaf.device)
                leaf.register_hook(lambda grad, step=step: self._backward_started(step))

    def _backward_started(self, step: _Step) -> None:
        if step.start is None and self._clock is not None:
            step.start = self._clock.now()

    def comm_hook(self, state, bucket):  # no annotations: DDP checks them, and here they are strings
        step = self._current
        if step is None or step.start is None:
            return self.hook(self.state, bucket)
        clock = self._clock or Clock(bucket.buffer().device)
        buffer = bucket.buffer()
        ready = clock.now()
        fut = self.hook(self.state, bucket)
        pending = _Pending(bucket.index(), buffer.numel() * buffer.element_size(), ready, clock.now())
        step.buckets.append(pending)

        def completed(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            pending.completed = clock.now()
            return done.value()

        return fut.then(completed)

    def _close_step(self) -> None:
        if self._current is not None and self._current.start is not None and self._current.buckets:
            self._measured.append(self._current)
        self._current = None
        if self.done and not self._logged:
            self._logged = True
            report = self.report()
            summary_log.info("%s", report.summary())
            if log.isEnabledFor(logging.INFO):
                log.info("%s", report.table())

    def report(self) -> OverlapReport:
        """The steps measured so far (a step counts once the next forward began or the
        watch was removed)."""
        clock = self._clock or Clock(torch.device("cpu"))
        steps = []
        for step in self._measured:
            pending = [b for b in step.buckets if b.completed is not None]
            if not pending:
                continue
            rel = [(b, clock.seconds(step.start, b.ready), clock.seconds(step.start, b.launched),
                    clock.seconds(step.start, b.completed)) for b in pending]
            end = max(ready for _, ready, _, _ in rel)
            buckets = tuple(BucketTiming(b.bucket, b.nbytes, r - end, la - end, c - end) for b, r, la, c in rel)
            steps.append(StepOverlap(step.index, end, buckets))
        ddp = self._ddp()
        pieces = pieces_of_buckets(ddp) if ddp is not None else {}
        return OverlapReport(tuple(steps), "cuda" if clock.cuda else "cpu", pieces)


def watch_overlap(
    ddp: torch.nn.Module,
    *,
    hook: Callable[[Any, dist.GradBucket], torch.futures.Future[torch.Tensor]] | None = None,
    state: Any = None,
    warmup: int = 3,
    steps: int = 5,
) -> OverlapWatch:
    """Measure overlap in a real run: call it instead of ``ddp.register_comm_hook``.

    ``ddp`` is the ``DistributedDataParallel`` module (also when it is compiled:
    ``torch.compile(DDP(m))`` -> pass the DDP module, ``DDP(torch.compile(m))`` -> the outer
    one). ``hook``/``state``: the comm hook you would have registered (default: DDP's
    allreduce averaged over ``state`` or the default group). Steps ``warmup`` to
    ``warmup + steps - 1`` (counting training forwards from 0) are measured; the first steps
    compile and let DDP rebuild its buckets. ``watch.report()`` returns the :class:`OverlapReport`. When the window closes, its
    one-line summary is logged (``ddp_split.summary``, shown by default) and, with
    ``TORCH_LOGS=ddp_split``, its table. Results are unchanged: the wrapped hook's futures
    pass through.
    """
    ddp = _torch.compiled_original(ddp) or ddp
    if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"watch_overlap needs the DistributedDataParallel module, got {type(ddp).__name__}")
    if _torch.ddp_comm_hooks(ddp):
        raise RuntimeError(
            "watch_overlap: this DDP module already has a comm hook, and DDP takes only one. "
            "Pass yours instead of registering it: watch_overlap(ddp, hook=your_hook, state=your_state)."
        )
    for name, value in (("warmup", warmup), ("steps", steps)):
        if not isinstance(value, int) or value < (1 if name == "steps" else 0):
            raise ValueError(f"watch_overlap: {name} must be an int >= {1 if name == 'steps' else 0}, got {value!r}")
    watch = OverlapWatch(ddp, hook or allreduce_hook, state, warmup, steps)
    ddp.register_comm_hook(None, watch.comm_hook)
    return watch

