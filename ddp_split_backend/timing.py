"""Where a graph's compile time goes, recorded as data on its :class:`CompileRecord`.

Stages: ``plan`` (layout and bucket plan), ``split`` (building the pieces), ``copy`` (the
pristine copy of each piece kept for an eager fallback), ``inner`` (the inner backend's
compile of each piece's forward; AOTAutograd compiles backward later, on the first backward),
``fake_run`` (running compiled pieces once on fake inputs for their output metadata) and
``reuse`` (structure keys and fresh fake outputs of shared pieces). ``ours`` is everything
but ``inner``. ``traced`` is Dynamo's time on the frame before it called the backend (its
trace, and attempts a restart signal cut short), not a stage of ours.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["StageTimes"]

STAGES = ("plan", "split", "copy", "inner", "fake_run", "reuse")


@dataclass(slots=True)
class StageTimes:
    """Seconds per stage of one graph's compile."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    traced: float | None = None
    """Seconds Dynamo spent on the frame before calling the backend; ``None`` outside Dynamo."""

    @contextlib.contextmanager
    def measure(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[stage] += time.perf_counter() - start

    @property
    def total(self) -> float:
        return sum(self.seconds.values())

    @property
    def ours(self) -> float:
        """ddp_split's own share: every stage but the inner backend's compiles."""
        return sum(s for stage, s in self.seconds.items() if stage != "inner")

    def describe(self) -> str:
        parts = ", ".join(f"{stage} {1e3 * s:.1f}" for stage, s in self.seconds.items())
        return f"ms: {parts} (ddp_split's own {1e3 * self.ours:.1f})"
