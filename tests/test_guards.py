"""Global-state guards: restore puts back every field it captures, and only what it must."""

from __future__ import annotations

import torch

from ddp_split_backend import _torch
from ddp_split_backend.guards import _TRACKED, GlobalState, _open_stack


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
