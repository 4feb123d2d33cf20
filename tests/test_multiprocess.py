"""Two gloo ranks: ddp_split training equals eager DDP training on every rank."""

from __future__ import annotations

import copy

import pytest
import torch

from .ddp_cases import CASES, run_all_cases
from .multiproc import run_ranks

pytestmark = pytest.mark.multiprocess


def _autocast_sgd_worker(rank: int, world: int, steps: int = 3) -> dict:
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_split_backend
    from ddp_split_backend import DDPSplitBackend, SplitConfig
    from tests.models import MLP

    torch.manual_seed(0)
    base = MLP(width=64, depth=4)
    eager = DDP(copy.deepcopy(base), bucket_cap_mb=0.015)
    backend = DDPSplitBackend(SplitConfig(inner="aot_eager"))
    split = torch.compile(DDP(copy.deepcopy(base), bucket_cap_mb=0.015), backend=backend)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, split)]
    torch.manual_seed(100 + rank)  # each rank sees different data
    batches = [torch.randn(8, 64) for _ in range(steps)]
    with ddp_split_backend.own_split():
        for x in batches:
            for model, opt in zip((eager, split), optimizers):
                opt.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = model(x).float().pow(2).mean()
                loss.backward()
                opt.step()
    return {
        "eager": [p.detach().clone() for p in eager.parameters()],
        "split": [p.detach().clone() for p in split.parameters()],
        "pieces": len(backend.records[-1].plan.buckets),
    }


def test_two_ranks_autocast_sgd_matches_eager_ddp(tmp_path) -> None:
    results = run_ranks(_autocast_sgd_worker, tmp_path, world=2)
    for result in results:
        assert result["pieces"] == 4
        for a, e in zip(result["split"], result["eager"], strict=True):
            torch.testing.assert_close(a, e, atol=2e-3, rtol=2e-3)
    for a, b in zip(results[0]["split"], results[1]["split"], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)  # allreduce kept the ranks identical


@pytest.fixture(scope="module")
def case_results(tmp_path_factory) -> list[dict]:
    """All DDP cases in one 2-rank run (one process start-up for all of them)."""
    return run_ranks(run_all_cases, tmp_path_factory.mktemp("ddp_cases"), world=2, timeout=480)


TOLERANCE = {"gpt_autocast": 5e-3}


@pytest.mark.parametrize("case", CASES)
def test_ddp_case_matches_eager_on_every_rank(case_results, case: str) -> None:
    per_rank = [r[case] for r in case_results]
    for rank, result in enumerate(per_rank):
        assert result["diff"] <= TOLERANCE.get(case, 1e-5), (case, rank, result["diff"])
        assert min(result["pieces"]) >= 2, (case, result["pieces"])
    assert per_rank[0]["pieces"] == per_rank[1]["pieces"], "every rank compiles the same pieces"
    for a, b in zip(per_rank[0]["params"], per_rank[1]["params"], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    if case == "recompile":
        assert per_rank[0]["graphs"] == 2  # a new batch size compiled once more
    if case == "find_unused":
        assert per_rank[0]["graphs"] == 2  # one graph per branch


EXACT_BUCKET_CASES = ["plain", "gpt_autocast", "static_graph", "bucket_view", "no_sync", "recompile", "compile_inside"]


def test_pieces_agree_with_ddp_reducer_buckets(case_results) -> None:
    """What docs/design.md promises ("Pieces and DDP's buckets"): the pieces are DDP's
    rebuilt buckets, one for one, in every DDP mode that rebuilds buckets, the example GPT
    (LayerNorms, biases, tied embeddings) included; ``find_unused_parameters`` keeps DDP's
    initial, registration-order buckets, and there no bucket waits for more than two pieces."""
    report = {case: (r["matched"], r["plan_pieces"], r["spans"]) for case, r in case_results[0].items()}
    print("pieces matching a reducer bucket (matched, pieces, pieces per bucket):", report)
    for case in EXACT_BUCKET_CASES:
        matched, pieces, spans = report[case]
        assert matched == pieces and set(spans) == {1}, (case, report[case])
    for case, (_, _, spans) in report.items():
        assert max(spans) <= 2, (case, spans)
