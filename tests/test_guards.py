"""Global-state guards: restore puts back every field it captures, and only what it must."""

from __future__ import annotations

import torch

from ddp_split_backend import _torch, guards
from ddp_split_backend.guards import _TRACKED, GlobalState, _open_stack, attempt

from .helpers import leak_nested_inference_guards_and_raise


def test_restore_puts_inference_mode_back() -> None:
    before = GlobalState.capture()
    assert not before.inference
    leaked = _torch.InferenceModeGuard(True)  # what a failed trace can leave behind
    assert torch.is_inference_mode_enabled()
    before.restore()
    assert not torch.is_inference_mode_enabled()
    assert GlobalState.capture() == before
    del leaked  # its exit restores "off": still off
    assert GlobalState.capture() == before


def test_restore_exits_only_regions_entered_since_the_capture() -> None:
    enter, exit_ = _TRACKED[_torch.enter_autocast], _TRACKED[_torch.exit_autocast]
    outer = enter("cpu", torch.bfloat16, True, None)
    try:
        inside_outer = GlobalState.capture()
        assert inside_outer.tracked_depth == len(_open_stack()) == 1
        enter("cpu", torch.float16, True, None)  # a piece raising half-way leaves this open
        inside_outer.restore()
        assert len(_open_stack()) == 1  # the outer region, open before the capture, stays
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    finally:
        exit_(outer)
    assert not _open_stack() and not torch.is_autocast_enabled("cpu")


def _thread_local_sizes() -> dict[str, int]:
    return {name: len(value) for name, value in vars(guards._tracked).items()}


def test_a_hundred_failures_leave_no_guard_behind() -> None:
    """Restoring inference mode (no setter) after each of 100 failures keeps no guard: the
    thread-local lists are as they were, and the leaked guards, exited later in any order,
    still end in the captured state."""
    before = GlobalState.capture()
    sizes = _thread_local_sizes()
    leaked = []
    for _ in range(100):
        leaked.append(_torch.InferenceModeGuard(True))  # a failed piece's guard, still alive
        before.restore()
        assert GlobalState.capture() == before
    assert _thread_local_sizes() == sizes
    for guard in leaked[::2] + leaked[1::2]:  # exited later, out of order
        guard.__exit__(None, None, None)
    assert GlobalState.capture() == before
    assert _torch.is_multithreading_enabled()
    for _ in range(10):  # and through attempt(), the compile stage's path (a gc each)
        assert attempt(leak_nested_inference_guards_and_raise).error is not None
    assert GlobalState.capture() == before and _thread_local_sizes() == sizes
