"""The backward compile AOTAutograd defers to a graph's first backward, timed as data.

Note [The first backward's compile]
-----------------------------------
AOTAutograd compiles a graph's forward when Dynamo calls the backend, and its backward only
when the first backward reaches it. With inductor the second is often the larger: a user's
first step is the forward's compile (the graph's summary line), the backward's, and the
step itself. Dynamo runs start and end callbacks around each such deferred compile, named
by the compile id of the frame the forward was compiled in, the id in ``graph 1 [0/0]``.
A graph that will run backward is watched under that id (:func:`watch`): the seconds of
every deferred compile under the id are added to its :class:`BackwardCompile` (one per
distinct compiled piece: shared pieces share a backward), and once the backward that
compiled them has finished (a callback queued on the autograd engine at the first compile's
end), ``on_done`` is called once, for the summary line, and the watch ends. A backward that
never comes leaves the watch open and costs nothing; ``torch._dynamo.reset()`` (the backend's
``reset``) forgets every watch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from . import _torch

__all__ = ["BackwardCompile", "forget_all", "watch"]

log = logging.getLogger("ddp_split")


@dataclass(slots=True)
class BackwardCompile:
    """The backward compiles of one graph at its first backward (filled in when it runs)."""

    seconds: float = 0.0
    """Seconds spent compiling backward, all pieces together."""
    compiles: int = 0
    """Backward compiles counted: one per distinct compiled piece that backward reached."""
    done: bool = False
    """The first backward has finished; ``seconds`` and ``compiles`` are final."""


@dataclass(slots=True)
class _Watch:
    result: BackwardCompile
    on_done: Callable[[BackwardCompile], None]
    started: float | None = None
    queued: bool = False


_watches: dict[str, _Watch] = {}
_lock = threading.Lock()


def watch(compile_id: str | None, on_done: Callable[[BackwardCompile], None]) -> BackwardCompile:
    """A :class:`BackwardCompile` for the graph compiled under ``compile_id``, filled in by its
    first backward, after which ``on_done`` gets it (Note [The first backward's compile]).
    Graphs compiled under one id (torch's DDPOptimizer pieces of one frame) share the first
    watch; without an id (compiled outside Dynamo) nothing is watched."""
    if compile_id is None:
        return BackwardCompile()
    _torch.on_lazy_backward_compile(_STARTED, _ENDED)
    with _lock:
        found = _watches.get(compile_id)
        if found is None:
            found = _watches[compile_id] = _Watch(BackwardCompile(), on_done)
    return found.result


def forget_all() -> None:
    with _lock:
        _watches.clear()


def _never_raises(callback: Callable[[str], None]) -> Callable[[str], None]:
    """``callback`` for Dynamo's callback handler, which runs it holding its own state: an
    exception there would leave the handler counting a compile that never ends (and make
    every later ``torch._dynamo.reset()`` fail), so it is logged instead."""

    def guarded(compile_id: str) -> None:
        try:
            callback(compile_id)
        except Exception:  # timing is diagnostics: it must never break a compile
            log.warning("ddp_split: timing the first backward's compile failed", exc_info=True)

    return guarded


def _started(compile_id: str) -> None:
    with _lock:
        found = _watches.get(compile_id)
        if found is not None:
            found.started = time.perf_counter()


def _ended(compile_id: str) -> None:
    with _lock:
        found = _watches.get(compile_id)
        if found is None or found.started is None:
            return
        found.result.seconds += time.perf_counter() - found.started
        found.result.compiles += 1
        found.started = None
        if found.queued:
            return
        found.queued = True
    try:
        _torch.queue_after_backward(lambda: _finish(compile_id))
    except RuntimeError:  # compiled outside a running backward: nothing more to wait for
        _finish(compile_id)


_STARTED, _ENDED = _never_raises(_started), _never_raises(_ended)


def _finish(compile_id: str) -> None:
    with _lock:
        found = _watches.pop(compile_id, None)
    if found is None:
        return
    found.result.done = True
    found.on_done(found.result)
