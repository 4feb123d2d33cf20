"""Nothing ddp_split keeps for diagnostics holds the model: after a failed piece (the eager
fallback), dropping the model and the compiled function frees its parameters, as after a
successful compile (issue 25, point 1)."""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any

import pytest
import torch
import torch.fx as fx

from ddp_split_backend import CompileRecord, DDPSplitBackend, Outcome, SplitConfig

from .helpers import TINY
from .models import MLP


class FailOn:
    """Inner backend failing on the pieces (by compile order) in ``fail_on``; it keeps no
    graph nor input, so only ddp_split could keep the model alive."""

    def __init__(self, fail_on: frozenset[int]) -> None:
        self.fail_on = fail_on
        self.calls = 0
        self.__name__ = "fail_on"

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        index, self.calls = self.calls, self.calls + 1
        if index in self.fail_on:
            raise RuntimeError(f"planned failure on piece {index}")
        return torch._dynamo.backends.registry.lookup_backend("aot_eager")(gm, example_inputs)


def _compile_and_drop(backend: DDPSplitBackend) -> tuple[list[weakref.ref], CompileRecord]:
    """The model's parameters, weakly, and the graph's record, kept past the reset (which
    clears ``backend.records``) as a user keeping it for diagnostics would."""
    model = MLP(width=16, depth=4)
    refs = [weakref.ref(p) for p in model.parameters()]
    compiled = torch.compile(model, backend=backend)
    compiled(torch.randn(2, 16)).sum().backward()
    (record,) = backend.records
    del model, compiled
    torch._dynamo.reset()
    gc.collect()
    return refs, record


@pytest.mark.parametrize("fail", [False, True], ids=["compiled", "failed"])
@pytest.mark.parametrize("whole", [False, True], ids=["pieces", "whole"])
def test_parameters_die_with_the_model(fail: bool, whole: bool) -> None:
    caps = {"min_piece_mb": None, "bucket_cap_mb": 100.0} if whole else TINY
    backend = DDPSplitBackend(SplitConfig(inner=FailOn(frozenset({0} if fail else ())), **caps))
    with pytest.warns(UserWarning, match="failed on piece") if fail else _no_warning():
        refs, record = _compile_and_drop(backend)
    assert len(record.pieces) == (1 if whole else 4)
    assert (record.pieces[0].outcome is Outcome.EAGER_FALLBACK) == fail
    alive = [r() for r in refs if r() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} parameters outlive the model"
    if fail:  # what people read is kept
        error = record.pieces[0].error
        assert error.exc_type == "RuntimeError" and error.message == "planned failure on piece 0"
        assert "planned failure on piece 0" in error.traceback and "Traceback" in error.traceback


def _no_warning() -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()
