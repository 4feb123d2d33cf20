"""Run compiled pieces in order, and keep the global state intact when something fails.

The stitched callable is what the backend returns to Dynamo. Its hot path is a loop over
pieces that moves values through a flat list of slots; everything else (naming the failing
piece, restoring global state) happens only when an exception passes through.
"""

from __future__ import annotations

import contextlib
import gc
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from .split import SplitGraph

__all__ = [
    "AutogradCheckpoint",
    "GlobalState",
    "GuardedCallable",
    "StitchedCallable",
    "attempt",
    "call_inner",
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
    dispatch_include: torch._C.DispatchKeySet
    dispatch_exclude: torch._C.DispatchKeySet
    """Thread-local dispatch keys. A failed AOTAutograd trace inside an inference_mode region
    can leave Python-dispatcher keys switched on, which breaks every later tensor op."""

    @classmethod
    def capture(cls) -> GlobalState:
        return cls(
            grad=torch.is_grad_enabled(),
            fwd_grad=torch._C._is_fwd_grad_enabled(),
            inference=torch.is_inference_mode_enabled(),
            autocast=tuple(
                (d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                for d in _AUTOCAST_DEVICES
            ),
            autocast_cache=torch.is_autocast_cache_enabled(),
            dispatch_include=torch._C._dispatch_tls_local_include_set(),
            dispatch_exclude=torch._C._dispatch_tls_local_exclude_set(),
        )

    def restore(self) -> None:
        """Set the state back; regions entered by eagerly run pieces (inference mode, dual
        levels, autocast) are exited first, see :func:`track_state_calls`."""
        _unwind_tracked()
        torch._C._set_grad_enabled(self.grad)
        torch._C._set_fwd_grad_enabled(self.fwd_grad)
        for device, enabled, dtype in self.autocast:
            torch.set_autocast_enabled(device, enabled)
            torch.set_autocast_dtype(device, dtype)
        torch.set_autocast_cache_enabled(self.autocast_cache)
        _restore_dispatch_keys(self.dispatch_include, self.dispatch_exclude)


def _restore_dispatch_keys(include: torch._C.DispatchKeySet, exclude: torch._C.DispatchKeySet) -> None:
    if (
        torch._C._dispatch_tls_local_include_set() == include
        and torch._C._dispatch_tls_local_exclude_set() == exclude
    ):
        return
    for key in torch._C.DispatchKey.__members__.values():
        try:
            wanted_in, wanted_out = include.has(key), exclude.has(key)
        except RuntimeError:  # alias keys cannot be queried
            continue
        if torch._C._dispatch_tls_is_dispatch_key_included(key) != wanted_in:
            torch._C._dispatch_tls_set_dispatch_key_included(key, wanted_in)
        if torch._C._dispatch_tls_is_dispatch_key_excluded(key) != wanted_out:
            torch._C._dispatch_tls_set_dispatch_key_excluded(key, wanted_out)


def call_inner(
    inner: Callable[..., Any], gm: fx.GraphModule, args: list[Any]
) -> tuple[Callable[..., Any] | None, str | None]:
    """Compile ``gm`` with ``inner``; see :func:`attempt` and :func:`track_if_own_code`."""
    compiled, error = attempt(inner, gm, args)
    return (None if compiled is None else track_if_own_code(compiled, gm)), error


def attempt(fn: Callable[..., Any], *args: Any) -> tuple[Any, str | None]:
    """``fn(*args)``; on failure return the error text instead of raising, with the global
    state as it was before (also state a failed trace leaked into frames that only die with
    its traceback, see :class:`AutogradCheckpoint`)."""
    before = GlobalState.capture()
    dual_open = dual_level_open()
    with AutogradCheckpoint():
        try:
            return fn(*args), None
        except Exception as error:  # any failure: the caller runs the piece eagerly instead
            message = f"{type(error).__name__}: {error}".strip()
        gc.collect()  # the failed trace's frames die now, running their guards' destructors
        if not dual_open and dual_level_open():  # the failed trace entered a dual level
            torch._C._exit_dual_level(level=0)
    before.restore()
    return None, message


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
        grad, fwd_grad = torch.is_grad_enabled(), torch._C._is_fwd_grad_enabled()
        threads = torch._C._is_multithreading_enabled()
        replay = torch._C._is_view_replay_enabled()
        include = torch._C._dispatch_tls_local_include_set()
        exclude = torch._C._dispatch_tls_local_exclude_set()
        self._guard = torch._C._InferenceMode(torch.is_inference_mode_enabled())
        torch._C._set_grad_enabled(grad)
        torch._C._set_fwd_grad_enabled(fwd_grad)
        torch._C._set_multithreading_enabled(threads)
        torch._C._set_view_replay_enabled(replay)
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
        level = torch._C._enter_dual_level()
    except RuntimeError:
        return True
    torch._C._exit_dual_level(level=level)
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


def _unwind_tracked() -> None:
    stack = _open_stack()
    while stack:
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
    torch._functorch.predispatch._exit_dual_level(level=level)


def _tracked_exit_dual_level(*, level: int) -> None:
    _forget(level)
    _exit_dual(level)


_TRACKED = {
    torch.amp.autocast_mode._enter_autocast: _tracked_enter(
        torch.amp.autocast_mode._enter_autocast, torch.amp.autocast_mode._exit_autocast
    ),
    torch.amp.autocast_mode._exit_autocast: _tracked_exit(torch.amp.autocast_mode._exit_autocast),
    torch.autograd.grad_mode._enter_inference_mode: _tracked_enter(
        torch.autograd.grad_mode._enter_inference_mode,
        torch.autograd.grad_mode._exit_inference_mode,
    ),
    torch.autograd.grad_mode._exit_inference_mode: _tracked_exit(
        torch.autograd.grad_mode._exit_inference_mode
    ),
    torch._functorch.predispatch._enter_dual_level: _tracked_enter(
        torch._functorch.predispatch._enter_dual_level, _exit_dual
    ),
    torch._functorch.predispatch._exit_dual_level: _tracked_exit_dual_level,
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


def _piece_error_note(index: int, count: int, name: str) -> str:
    return f"raised in ddp_split piece {index} of {count} (compiled with {name})"


class GuardedCallable:
    """One compiled graph that changes global state: restores the state if it raises."""

    def __init__(self, fn: Callable[..., Any], compiler_name: str) -> None:
        self._fn = fn
        self._name = compiler_name

    def __call__(self, *args: Any) -> Any:
        before = GlobalState.capture()
        try:
            return self._fn(*args)
        except BaseException as error:
            before.restore()
            error.add_note(_piece_error_note(0, 1, self._name))
            raise


class StitchedCallable:
    """Runs the compiled pieces of one graph in order; returned to Dynamo by the backend."""

    def __init__(
        self,
        split: SplitGraph,
        compiled: Sequence[Callable[..., Any]],
        compiler_names: Sequence[str],
    ) -> None:
        self._steps = tuple(
            (fn, piece.inputs, piece.outputs, piece.release, piece.grad)
            for fn, piece in zip(compiled, split.pieces, strict=True)
        )
        self._names = tuple(compiler_names)
        self._num_slots = split.num_slots
        self._num_inputs = split.num_inputs
        self._leaves = split.output_leaves
        self._flat_tuple = all(s is not None for s in split.output_leaves) and (
            split.output_spec == pytree.tree_flatten(tuple(range(len(split.output_leaves))))[1]
        )
        self._constants = split.output_constants
        self._spec = split.output_spec

    def __call__(self, *args: Any) -> Any:
        values: list[Any] = [*args, *([None] * (self._num_slots - self._num_inputs))]
        before = GlobalState.capture()
        index = 0
        try:
            for index, (fn, inputs, outputs, release, grad) in enumerate(self._steps):
                torch._C._set_grad_enabled(grad)  # as the piece was compiled
                results = fn(*[values[s] for s in inputs])
                for s, v in zip(outputs, results):
                    values[s] = v
                for s in release:
                    values[s] = None
            torch._C._set_grad_enabled(before.grad)
        except BaseException as error:
            before.restore()
            error.add_note(_piece_error_note(index, len(self._steps), self._names[index]))
            raise
        if self._flat_tuple:
            return tuple(values[s] for s in self._leaves)
        leaves = [
            c if s is None else values[s] for s, c in zip(self._leaves, self._constants)
        ]
        return pytree.tree_unflatten(leaves, self._spec)
