"""Time on the device the work runs on: host time on the CPU, CUDA events on a GPU."""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["Clock"]


class Clock:
    """Host time on the CPU; CUDA events on the current stream of a GPU (read later, once
    the work they follow has run)."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Any, end: Any) -> float:
        if not self.cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3
