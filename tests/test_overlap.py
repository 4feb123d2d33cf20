"""Communication overlaps backward: the reason ddp_split exists (issue 25, point 9).

A DDP comm hook records when each bucket is launched (DDP launches a bucket as soon as all
its gradients are ready) and a hook on the input's gradient marks the end of backward (the
input's gradient is the last one backward computes). Split at bucket boundaries, every bucket
but the last one or two is launched before backward ends; compiled as one graph, every
gradient is ready only when the single backward node finishes, so almost none are.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_split_backend

from .models import TanhStack

pytestmark = pytest.mark.usefixtures("world1")

WIDTH, DEPTH = 512, 8
"""A layer's weight is 1 MiB: with ``bucket_cap_mb=1`` DDP gives each layer its own bucket."""


@dataclass(slots=True)
class Launches:
    times: list[float] = field(default_factory=list)


def record_launch(state, bucket):  # no annotations: DDP checks them
    state.times.append(time.perf_counter())
    future: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    future.set_result(bucket.buffer())  # one rank: the allreduce is the identity
    return future


def _launched_before_backward_ends(backend: str, inner: str | None) -> tuple[int, int]:
    torch.manual_seed(0)
    ddp = DDP(TanhStack(WIDTH, DEPTH), bucket_cap_mb=1)
    launches = Launches()
    ddp.register_comm_hook(launches, record_launch)
    options = {"min_piece_mb": None, "inner": inner, "bucket_cap_mb": 1} if backend == "ddp_split" else None
    compiled = torch.compile(ddp, backend=backend, options=options)
    before = 0
    with ddp_split_backend.own_split():
        for _ in range(3):  # the first step compiles and lets DDP rebuild its buckets
            launches.times.clear()
            ended: list[float] = []
            x = torch.randn(16, WIDTH, requires_grad=True)
            x.register_hook(lambda g: ended.append(time.perf_counter()))
            compiled(x).sum().backward()
            (end,) = ended
            before = sum(t < end for t in launches.times)
    return before, len(launches.times)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_ddp_split_launches_buckets_while_backward_runs(inner: str) -> None:
    before, buckets = _launched_before_backward_ends("ddp_split", inner)
    assert buckets >= DEPTH - 1, buckets
    assert before >= buckets - 2, f"only {before} of {buckets} buckets launched before backward ended"


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_an_unsplit_compile_launches_almost_none_before_backward_ends(inner: str) -> None:
    before, buckets = _launched_before_backward_ends(inner, None)
    assert buckets >= DEPTH - 1, buckets
    assert before <= 1, f"{before} of {buckets} buckets launched before backward ended"
    assert dist.get_world_size() == 1
