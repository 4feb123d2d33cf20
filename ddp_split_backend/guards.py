"""Global-state guards: capture, restore and checkpoint the state graph nodes change.

A compiled graph changes global state (grad mode, autocast, inference mode, dual levels,
dispatch keys) through the state nodes Dynamo records. ddp_split must leave that state as it
found it, also when an inner compile, a fake run or a piece at run time fails half-way.
This module holds the tools for that: :class:`GlobalState` (capture and restore the
settable state), :class:`AutogradCheckpoint` (the autograd state, restorable even after a
failed trace left inference mode on), :func:`attempt` (run a compile step, returning its
failure as data) and the tracking of regions entered by pieces that run as Python.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from . import _torch

__all__ = [
    "AutogradCheckpoint",
    "Attempt",
    "CallState",
    "GlobalState",
    "attempt",
    "call_inner",
    "capture_call",
    "dual_level_open",
    "preserve_global_state",
    "track_if_own_code",
    "track_state_calls",
]

_AUTOCAST_DEVICES = tuple(
    d for d in ("cpu", "cuda", "xpu", "mps", "hpu") if torch.amp.is_autocast_available(d)
)


@dataclass(frozen=True, slots=True)
class GlobalState:
    """The global state that graph state nodes change, captured so it can be restored."""

    grad: bool
    fwd_grad: bool
    inference: bool
    autocast: tuple[tuple[str, bool, torch.dtype], ...]
    autocast_cache: bool
    multithreading: bool
    view_replay: bool
    """Autograd's thread-local multithreading and view-replay modes (inference-mode guards set
    the first)."""
    dispatch_include: Any
    dispatch_exclude: Any
    """Thread-local dispatch keys (``DispatchKeySet``). A failed AOTAutograd trace inside an
    inference_mode region can leave Python-dispatcher keys switched on, which breaks every
    later tensor op."""
    tracked_depth: int = field(default=0, compare=False)
    """How many regions entered by Python-run pieces were open (see :func:`track_state_calls`)."""

    @classmethod
    def capture(cls) -> GlobalState:
        return cls(
            grad=torch.is_grad_enabled(),
            fwd_grad=_torch.is_fwd_grad_enabled(),
            inference=torch.is_inference_mode_enabled(),
            autocast=tuple(
                (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                for d in _AUTOCAST_DEVICES
            ),
            autocast_cache=torch.is_autocast_cache_enabled(),
            multithreading=_torch.is_multithreading_enabled(),
            view_replay=_torch.is_view_replay_enabled(),
            dispatch_include=_torch.dispatch_include_set(),
            dispatch_exclude=_torch.dispatch_exclude_set(),
            tracked_depth=len(_open_stack()),
        )

    def with_call(self, call: CallState) -> GlobalState:
        """This state (captured at a graph's first call) with what can differ between its
        calls taken from ``call``."""
        grad, fwd_grad, depth, include, exclude = call
        return dataclasses.replace(
            self, grad=grad, fwd_grad=fwd_grad, tracked_depth=depth,
            dispatch_include=include, dispatch_exclude=exclude,
        )

    def restore(self) -> None:
        """Set the state back. Regions entered since the capture by pieces run as Python
        (inference mode, dual levels, autocast) are exited first, innermost first (see
        :func:`track_state_calls`); if inference mode still differs after that, it is set
        by :func:`_set_inference_mode`, which leaves no guard behind."""
        _unwind_tracked(self.tracked_depth)
        if torch.is_inference_mode_enabled() != self.inference:
            _set_inference_mode(self.inference)
        _torch.set_grad_enabled(self.grad)
        _torch.set_fwd_grad_enabled(self.fwd_grad)
        for device, enabled, dtype in self.autocast:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(self.autocast_cache)
        _torch.set_multithreading_enabled(self.multithreading)
        _torch.set_view_replay_enabled(self.view_replay)
        _restore_dispatch_keys(self.dispatch_include, self.dispatch_exclude)


CallState = tuple[bool, bool, int, Any, Any]
"""What a compiled graph captures on each call, to restore if it raises: grad mode,
forward-grad mode, tracked depth and dispatch keys. The rest of :class:`GlobalState`
(inference mode, autocast and its cache) is guarded by Dynamo, so a graph runs only under
the values of its first call (see ``runtime.py``); multithreading and view replay only
inference-mode guards change."""


def capture_call() -> CallState:
    """The :data:`CallState` now."""
    return (
        torch.is_grad_enabled(), _torch.is_fwd_grad_enabled(), len(_open_stack()),
        _torch.dispatch_include_set(), _torch.dispatch_exclude_set(),
    )


def _set_inference_mode(enabled: bool) -> None:
    """Switch inference mode, which has no setter, leaving no guard alive.

    A guard sets the mode when made and, when exited, puts back the whole autograd state it
    saw when made, whatever the order guards are exited in. Two guards for ``enabled``: the
    first one saw the old state, the second one the new; exiting the first, then the second
    ends in the new state with neither alive. The guards also set grad, forward-grad and
    multithreading mode and dispatch keys, which the caller (:meth:`GlobalState.restore`)
    sets after."""
    saw_old = _torch.InferenceModeGuard(enabled)
    saw_new = _torch.InferenceModeGuard(enabled)
    saw_old.__exit__(None, None, None)
    saw_new.__exit__(None, None, None)


def _restore_dispatch_keys(include: Any, exclude: Any) -> None:
    if (
        _torch.dispatch_include_set() == include
        and _torch.dispatch_exclude_set() == exclude
    ):
        return
    for key in _torch.DispatchKey.__members__.values():
        try:
            wanted_in, wanted_out = include.has(key), exclude.has(key)
        except RuntimeError:  # alias keys cannot be queried
            continue
        if _torch.dispatch_key_included(key) != wanted_in:
            _torch.set_dispatch_key_included(key, wanted_in)
        if _torch.dispatch_key_excluded(key) != wanted_out:
            _torch.set_dispatch_key_excluded(key, wanted_out)


@dataclass(frozen=True, slots=True)
class Attempt:
    """The outcome of one compile step: its value, or the exception it raised."""

    value: Any = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def call_inner(inner: Callable[..., Any], gm: fx.GraphModule, args: list[Any]) -> Attempt:
    """Compile ``gm`` with ``inner``; see :func:`attempt` and :func:`track_if_own_code`."""
    result = attempt(inner, gm, args)
    if not result.ok:
        return result
    return Attempt(track_if_own_code(result.value, gm))


# Note [Dynamo's signals]
# -----------------------
# Dynamo steers its own work with exceptions. Some reach a backend's compile from inside:
# AOTAutograd's pass that turns Python floats into tensors raises
# ``TensorifyScalarRestartAnalysis`` when a float it cannot turn must be specialised, asking
# Dynamo to trace the frame again (a model that stores ``x.mean().item()`` on itself does
# this). They are not failures: caught, they would leave the piece eager for the rest of the
# run, and the frame would never be re-traced as Dynamo asked. So :func:`attempt` cleans up
# after them as after a failure (the global state as it was before, the trace's frames
# cleared) and raises them on, out of the backend; no record is kept of the compile they cut
# short, as Dynamo calls the backend again with the new graph. The kinds are
# ``_torch.DYNAMO_SIGNALS``.


def attempt(fn: Callable[..., Any], *args: Any) -> Attempt:
    """``fn(*args)``; a failure is returned, not raised, with the global state as it was
    before (also state a failed trace leaked into frames that only die with its traceback,
    see :class:`AutogradCheckpoint`). The exception keeps its traceback; its frames are
    cleared so that the failed trace's guards run now, not when the error is dropped.
    Dynamo's signals (Note [Dynamo's signals]) are raised on, after the same clean-up."""
    before = GlobalState.capture()
    dual_open = dual_level_open()
    with AutogradCheckpoint():
        try:
            return Attempt(fn(*args))
        except Exception as error:  # any failure: the caller decides (eager fallback or raise)
            failure = error
        _clear_frames(failure)
        gc.collect()  # the failed trace's frames die now, running their guards' destructors
        if not dual_open and dual_level_open():  # the failed trace entered a dual level
            _torch.c_exit_dual_level(level=0)
    before.restore()
    if isinstance(failure, _torch.DYNAMO_SIGNALS):
        raise failure
    return Attempt(error=failure)


def _clear_frames(error: BaseException) -> None:
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback = error.__traceback__
        while traceback is not None:
            with contextlib.suppress(RuntimeError):  # a frame still executing
                traceback.tb_frame.clear()
            traceback = traceback.tb_next
        error = error.__cause__ or error.__context__


class AutogradCheckpoint:
    """The autograd thread-local state (grad, inference and forward-grad mode, dispatch
    keys), restorable even after something left inference mode on.

    Inference mode has no setter: only the guard that entered it can leave it, by restoring
    what it saw when it was made. A trace that fails inside nested ``inference_mode``
    regions leaves its guards in the frames of the traceback, and frames free their locals
    in creation order: the outer guard restores "off", then the inner one "on". This
    checkpoint is itself such a guard, made for the current mode (so its constructor changes
    nothing but the modes it then sets back); :meth:`restore` makes it put back the state
    of the moment it was taken, whatever was leaked since; used as a context manager, it
    restores on leaving the block."""

    __slots__ = ("_guard",)

    def __init__(self) -> None:
        grad, fwd_grad = torch.is_grad_enabled(), _torch.is_fwd_grad_enabled()
        threads = _torch.is_multithreading_enabled()
        replay = _torch.is_view_replay_enabled()
        include = _torch.dispatch_include_set()
        exclude = _torch.dispatch_exclude_set()
        self._guard = _torch.InferenceModeGuard(torch.is_inference_mode_enabled())
        _torch.set_grad_enabled(grad)
        _torch.set_fwd_grad_enabled(fwd_grad)
        _torch.set_multithreading_enabled(threads)
        _torch.set_view_replay_enabled(replay)
        _restore_dispatch_keys(include, exclude)

    def restore(self) -> None:
        self._guard.__exit__(None, None, None)

    def __enter__(self) -> AutogradCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


def dual_level_open() -> bool:
    """Whether a forward-AD dual level is open (torch keeps no Python-visible record of
    levels entered through graph calls, and allows only one)."""
    try:
        level = _torch.c_enter_dual_level()
    except RuntimeError:
        return True
    _torch.c_exit_dual_level(level=level)
    return False


@contextlib.contextmanager
def preserve_global_state() -> Iterator[GlobalState]:
    """Restore the global state if the body raises."""
    before = GlobalState.capture()
    try:
        yield before
    except BaseException:
        before.restore()
        raise


# Region enters made by eagerly run pieces, innermost last, so that a failure can exit them.
_tracked = threading.local()


def _open_stack() -> list[tuple[Callable[[Any], None], Any]]:
    stack = getattr(_tracked, "stack", None)
    if stack is None:
        stack = _tracked.stack = []
    return stack


def _unwind_tracked(depth: int = 0) -> None:
    stack = _open_stack()
    while len(stack) > depth:
        exit_fn, token = stack.pop()
        with contextlib.suppress(Exception):
            exit_fn(token)


def _tracked_enter(enter: Callable[..., Any], exit_fn: Callable[[Any], None]) -> Callable[..., Any]:
    def enter_tracked(*args: Any, **kwargs: Any) -> Any:
        token = enter(*args, **kwargs)
        _open_stack().append((exit_fn, token))
        return token

    enter_tracked.__name__ = f"tracked{enter.__name__}"
    return enter_tracked


def _forget(token: Any) -> None:
    stack = _open_stack()
    for i in range(len(stack) - 1, -1, -1):
        if stack[i][1] is token or (isinstance(token, int) and stack[i][1] == token):
            del stack[i]
            return


def _tracked_exit(exit_fn: Callable[[Any], None]) -> Callable[[Any], None]:
    def exit_tracked(token: Any) -> None:
        _forget(token)
        exit_fn(token)

    exit_tracked.__name__ = f"tracked{exit_fn.__name__}"
    return exit_tracked


def _exit_dual(level: int) -> None:
    _torch.exit_dual_level(level=level)


def _tracked_exit_dual_level(level: int) -> None:  # keyword (2.13+) or positional (2.11, 2.12)
    _forget(level)
    _exit_dual(level)


_TRACKED = {
    _torch.enter_autocast: _tracked_enter(_torch.enter_autocast, _torch.exit_autocast),
    _torch.exit_autocast: _tracked_exit(_torch.exit_autocast),
    _torch.enter_inference_mode: _tracked_enter(_torch.enter_inference_mode, _torch.exit_inference_mode),
    _torch.exit_inference_mode: _tracked_exit(_torch.exit_inference_mode),
    _torch.enter_dual_level: _tracked_enter(_torch.enter_dual_level, _exit_dual),
    _torch.exit_dual_level: _tracked_exit_dual_level,
}


def track_state_calls(gm: fx.GraphModule) -> fx.GraphModule:
    """Make an eagerly run piece register its autocast/inference-mode regions, so that
    :meth:`GlobalState.restore` can exit them if the piece raises half-way."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in _TRACKED:
            node.target = _TRACKED[node.target]
    gm.recompile()
    return gm


def track_if_own_code(compiled: Callable[..., Any], gm: fx.GraphModule) -> Callable[..., Any]:
    """``compiled``, tracked like an eager piece when it is ``gm`` itself or its ``forward``
    (torch's ``eager`` backend): then it runs the state nodes as Python, holding the guards
    that alone can exit inference mode. Compiled code (AOTAutograd, inductor) sets state
    without guards, which :meth:`GlobalState.restore` can set back."""
    if compiled is gm or getattr(compiled, "__self__", None) is gm:
        return track_state_calls(gm).forward
    return compiled
