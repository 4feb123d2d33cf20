"""Soak: 300 training steps on 2 gloo ranks with batch sizes changing every 50 steps.

Run with ``make test-slow`` (``pytest -m slow``). Asserts bounded memory (RSS growth under
50 MB after warm-up), compiles bounded by the distinct shapes, identical ranks at the end.
"""

from __future__ import annotations

import resource

import pytest
import torch

from .multiproc import run_ranks

pytestmark = pytest.mark.multiprocess

BATCHES = [8, 12, 8, 16, 12, 8]  # one per 50 steps: three distinct sizes


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / 2**20


def _soak_worker(rank: int, world: int, steps: int = 300) -> dict:
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ddp_split_backend
    from ddp_split_backend import DDPSplitBackend, SplitConfig
    from tests.models import MLP

    torch.manual_seed(0)
    model = DDP(MLP(width=64, depth=4), bucket_cap_mb=0.015)
    backend = DDPSplitBackend(SplitConfig(inner="aot_eager"))
    compiled = torch.compile(model, backend=backend)  # automatic dynamic shapes after a recompile
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank)
    rss = []
    with ddp_split_backend.own_split():
        for step in range(steps):
            n = BATCHES[step // 50]
            x, y = torch.randn(n, 64, generator=gen), torch.randn(n, 64, generator=gen)
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = compiled(x)
            F.mse_loss(out.float(), y).backward()
            opt.step()
            rss.append(_rss_mb())
    return {
        "rss_after_warmup": rss[160],  # every distinct shape compiled by step 150
        "rss_end": rss[-1],
        "graphs": len(backend.records),
        "pieces": sum(len(r.plan.buckets) for r in backend.records),
        "params": [p.detach().clone() for p in model.parameters()],
    }


@pytest.mark.slow
def test_soak_300_steps_two_ranks(tmp_path) -> None:
    results = run_ranks(_soak_worker, tmp_path, world=2, timeout=1200)
    for r in results:
        growth = r["rss_end"] - r["rss_after_warmup"]
        print(f"rss after warm-up {r['rss_after_warmup']:.1f} MB, end {r['rss_end']:.1f} MB, "
              f"growth {growth:.1f} MB, graphs {r['graphs']}, pieces {r['pieces']}")
        assert growth < 50
        assert r["graphs"] <= len(set(BATCHES))
    for a, b in zip(results[0]["params"], results[1]["params"], strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
