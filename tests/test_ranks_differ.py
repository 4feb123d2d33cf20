"""Ranks that compile different graphs still train together (issue 38, part 4).

Every plan is made from the graph, its parameters and the options alone, so a rank never
waits for another to plan. Two setups that made the measured ``min_piece_mb="auto"`` stall
both ranks for 120 s, with default options (``backend="ddp_split"`` by name, inner
``aot_eager``), on 2 gloo ranks:

* ``log``: rank 0 alone prints in the middle of forward (a graph break only rank 0 has: it
  compiles two graphs where rank 1 compiles one);
* ``sanity``: rank 0 alone runs one ``no_grad`` forward with another batch size before
  training (a graph only rank 0 compiles, and a recompile that can make its shapes dynamic).

Each trains 12 SGD steps next to eager DDP from the same weights on the same per-rank data,
and must finish promptly, with the training graph planned alike on both ranks (the same
pieces holding the same parameters) and gradients and parameters equal to eager DDP's.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_split_backend
from ddp_split_backend import ddp_split

from .multiproc import run_ranks

pytestmark = pytest.mark.multiprocess

STEPS, WIDTH, DEPTH, BATCH = 12, 64, 6, 8
TIMEOUT_S = 120
"""Far under the 120 s stall each setup caused (two ranks' compiles take a few seconds)."""


class Talker(nn.Module):
    """A stack of layers whose forward prints half-way on the rank told to (``print`` breaks
    the graph)."""

    def __init__(self, talks: bool) -> None:
        super().__init__()
        self.talks = talks
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(DEPTH))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[: DEPTH // 2]:
            x = torch.tanh(layer(x))
        if self.talks:  # outside the loops: Dynamo resumes after it (in a loop it runs the frame eagerly)
            print("rank 0 logs its activations:", tuple(x.shape), flush=True)
        for layer in self.layers[DEPTH // 2 :]:
            x = torch.tanh(layer(x))
        return x


def _plans() -> list[list[tuple[int, tuple[str, ...]]]]:
    """Each training graph's pieces and the parameters each holds (graphs with backward)."""
    return [
        [(p.piece, p.params) for p in r.plan.pieces]
        for r in ddp_split.records
        if r.plan.whole is None and len(r.plan.buckets) > 1
    ]


def _worker(rank: int, world: int, *, case: str) -> dict[str, Any]:
    torch.manual_seed(0)
    base = Talker(talks=case == "log" and rank == 0)
    eager = DDP(copy.deepcopy(base), bucket_cap_mb=0.01)
    model = copy.deepcopy(base)
    split = DDP(torch.compile(model, backend="ddp_split", options={"inner": "aot_eager"}), bucket_cap_mb=0.01)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (eager, split)]
    gen = torch.Generator().manual_seed(100 + rank)
    with ddp_split_backend.own_split():
        if case == "sanity" and rank == 0:
            with torch.no_grad():
                split(torch.randn(3, WIDTH, generator=gen))
        for _ in range(STEPS):
            x = torch.randn(BATCH, WIDTH, generator=gen)
            for ddp, optimizer in zip((eager, split), optimizers, strict=True):
                ddp(x).pow(2).mean().backward()
            for a, e in zip(split.parameters(), eager.parameters(), strict=True):
                torch.testing.assert_close(a.grad, e.grad)
            for optimizer in optimizers:
                optimizer.step()
                optimizer.zero_grad()
    for a, e in zip(split.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, e)
    result = {"plans": _plans(), "graphs": len(ddp_split.records)}
    dist.barrier()
    return result


@pytest.mark.parametrize("case", ["log", "sanity"])
def test_one_rank_compiling_another_graph_trains_promptly_with_one_plan(tmp_path, case) -> None:
    first, second = run_ranks(_worker, tmp_path, world=2, timeout=TIMEOUT_S, case=case)
    assert first["graphs"] > second["graphs"], (first, second)  # rank 0 did compile another graph
    (plan,) = second["plans"]
    assert len(plan) == DEPTH, plan  # the default: one piece per bucket, a bucket per layer
    if case == "log":  # rank 0's two graphs cut where rank 1's one graph is cut
        assert len(first["plans"]) == 2, first
        assert [params for piece in first["plans"] for _, params in piece] == [params for _, params in plan]
    else:  # rank 0's training graph (after its no_grad one, perhaps dynamic) is planned as rank 1's
        assert first["plans"][-1] == plan, (first, second)
