"""What the benchmark scripts share: the run's environment record, a free port, and model
classes with a code object of their own per mode.

Dynamo caches compiled code per code object, and with inlined nn modules its guards do not
tell two instances of one module class apart: two modes of the same class in one process
would silently share the first one's graph. :func:`own_code` gives each mode its own.
"""

from __future__ import annotations

import datetime
import os
import platform
import socket
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["environment", "free_port", "own_code"]


def environment(**extra: Any) -> dict[str, Any]:
    """Date, machine, versions, load and the command line of this run."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": platform.machine(),
        "nproc": os.cpu_count(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "loadavg_start": os.getloadavg(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        **extra,
    }


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the OS picks, so parallel runs do not collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_code(fn: Callable[..., Any], tag: str) -> Callable[..., Any]:
    """``fn`` with a code object of its own (same body), named ``<name>_<tag>``."""
    name = f"{fn.__name__}_{tag}"
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name, fn.__defaults__, fn.__closure__)
