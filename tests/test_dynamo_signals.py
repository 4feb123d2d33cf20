"""Dynamo's restart signals pass through the backend (Note [Dynamo's signals] in guards.py).

On 2 gloo ranks, default options, ``backend="ddp_split"`` by name with aot_eager and
inductor: a model that reads a tensor into Python inside forward trains 12 steps and runs an
evaluation under ``no_grad`` without any piece falling back to eager, with as many Dynamo
graphs as plain ``torch.compile`` of the same script, and with parameters and evaluation
loss equal to eager DDP's.
"""

from __future__ import annotations

import pytest
import torch

from ddp_split_backend import guards

from .multiproc import run_ranks
from .signal_cases import WHERE, run_signal_cases

pytestmark = pytest.mark.multiprocess

_TOLERANCE = {"aot_eager": {"atol": 1e-5, "rtol": 1e-5}, "inductor": {"atol": 1e-4, "rtol": 1e-4}}


@pytest.fixture(scope="module", params=["aot_eager", "inductor"])
def signal_results(request, tmp_path_factory) -> tuple[str, list[dict]]:
    inner = request.param
    results = run_ranks(run_signal_cases, tmp_path_factory.mktemp(f"signals_{inner}"), world=2, timeout=900, inner=inner)
    return inner, results


@pytest.mark.parametrize("where", WHERE)
def test_reading_tensors_in_forward_compiles_every_piece_and_matches_eager_ddp(signal_results, where: str) -> None:
    inner, results = signal_results
    for rank, result in enumerate(results):
        case = result[where]
        assert not case["fallbacks"], f"rank {rank}: {case['fallbacks']}"
        assert not case["failures"], f"rank {rank}: {case['failures']}"
        assert case["graphs"] == case["plain_graphs"], (rank, case["graphs"], case["plain_graphs"])
        assert case["records"] == len(case["graphs"]), case  # one record per graph: none for a restart
        # The training graphs are cut. With a graph break inside its block loop, Dynamo
        # runs the frame eagerly (torch 2.13), for plain compile and ddp_split alike.
        assert (where == "inside" and not case["pieces"]) or max(case["pieces"]) > 1, case["pieces"]
        for actual, expected in zip(case["params"], case["expected"], strict=True):
            torch.testing.assert_close(actual, expected, **_TOLERANCE[inner])
        torch.testing.assert_close(case["eval"], case["eager_eval"], **_TOLERANCE[inner])


def _restart() -> None:
    with torch.inference_mode():
        torch.set_grad_enabled(False)
        raise torch._dynamo.exc.TensorifyScalarRestartAnalysis


def test_attempt_raises_dynamos_signals_on_with_the_state_restored() -> None:
    before = guards.GlobalState.capture()
    with pytest.raises(torch._dynamo.exc.TensorifyScalarRestartAnalysis):
        guards.attempt(_restart)
    assert guards.GlobalState.capture() == before
    failed = guards.attempt(lambda: 1 / 0)  # a failure is still returned as data
    assert isinstance(failed.error, ZeroDivisionError)
