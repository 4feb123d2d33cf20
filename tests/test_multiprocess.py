"""Two gloo ranks: ddp_split training equals eager DDP training on every rank."""

from __future__ import annotations

import copy

import torch

from .multiproc import run_ranks


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
