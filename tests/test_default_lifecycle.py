"""The default options over a training run's whole life, on 2 gloo ranks (issue 31).

Every case trains through the path users take (``backend="ddp_split"`` by name, the inner
backend by name, no other option) next to eager DDP from the same weights on the same
per-rank data, for at least 12 synchronised steps, and checks

* the gradients against eager DDP's at every step (``torch.testing.assert_close``);
* overlap in the last steps: how many buckets DDP handed to its comm hook before backward
  reached the model's first layer (the gradient of the input, which only the first layer's
  backward makes). One compiled piece hands over none; eager DDP all but the first layer's.

The setups are the ones in which a plan learnt from the first steps went wrong:
``static_graph=True`` (DDP learns its bucket order at its second step), two DDP models of one
class (one Dynamo graph), a sweep's second trial (the first model freed, no
``torch._dynamo.reset()``), regional compilation (one graph called per block), and a first
call that raises. Since activation-checkpoint regions are cut by default (Note [Cutting
checkpoint regions]), the static-graph, sweep and failed-first-call setups train a model whose
middle layers are one checkpoint region, and so does ``checkpointed``, which also takes an
evaluation step under ``no_grad`` and a ``no_sync`` accumulation step in the middle.
"""

from __future__ import annotations

import copy
import gc
import time
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_split_backend
from ddp_split_backend import ddp_split

from .models import CheckpointedTanhStack, TanhStack
from .multiproc import run_ranks

pytestmark = pytest.mark.multiprocess

WIDTH, DEPTH, BATCH, STEPS = 64, 6, 8, 12
CAP_MB = (WIDTH * WIDTH + WIDTH) * 4 / 2**20 * 0.9
"""Under one layer's bytes: every layer is its own DDP bucket."""
OPTIONS = {"inner": "aot_eager"}
"""The defaults, with the inner backend named (inductor would spend these tests' minutes compiling)."""


def _record_launch(state, bucket):  # no annotations: DDP checks them, and here they are strings
    state["launched"].append(time.perf_counter())
    return allreduce_hook(None, bucket)


class _Watched:
    """A DDP module and the times its comm hook was handed each bucket."""

    def __init__(self, ddp: DDP, model: Any) -> None:
        self.ddp, self.model = ddp, model
        self.state: dict = {"launched": []}
        ddp.register_comm_hook(self.state, _record_launch)
        self.counts: list[int] = []
        """Per step, the buckets launched before backward reached the first layer."""

    def step(self, x: torch.Tensor) -> None:
        self.state["launched"].clear()
        x = x.clone().requires_grad_(True)
        reached: list[float] = []
        x.register_hook(lambda g: reached.append(time.perf_counter()))
        self.ddp.zero_grad()
        self.model(x).square().mean().backward()
        self.counts.append(sum(t < reached[0] for t in self.state["launched"]))


class _Pair:
    """Eager DDP and the same weights compiled with the defaults, trained side by side."""

    def __init__(self, seed: int, ddp_kwargs: dict, regional: bool = False, checkpointed: bool = False) -> None:
        torch.manual_seed(seed)
        base = (CheckpointedTanhStack if checkpointed else TanhStack)(WIDTH, DEPTH)
        eager = DDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB, **ddp_kwargs)
        split = DDP(copy.deepcopy(base), bucket_cap_mb=CAP_MB, **ddp_kwargs)
        if regional:  # each block compiled on its own (one graph shared by the blocks)
            for layer in split.module.layers:
                layer.compile(backend="ddp_split", options=OPTIONS)
            compiled = split
        else:
            compiled = torch.compile(split, backend="ddp_split", options=OPTIONS)
        self.eager, self.split = _Watched(eager, eager), _Watched(split, compiled)

    def train(self, rank: int, steps: int, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        for _ in range(steps):
            x = torch.randn(BATCH, WIDTH, generator=gen)
            self.eager.step(x)
            self.split.step(x)
            for a, e in zip(self.split.ddp.parameters(), self.eager.ddp.parameters(), strict=True):
                torch.testing.assert_close(a.grad, e.grad)


CHECKPOINTED = ("checkpointed", "static_graph", "sweep", "failed_first_call")
"""The setups whose model holds a checkpoint region."""


def _eval_and_no_sync(pair: _Pair, rank: int) -> None:
    """An evaluation forward under ``no_grad`` and an accumulation step whose first
    micro-batch runs under ``no_sync``, both ways, compared."""
    gen = torch.Generator().manual_seed(500 + rank)
    x = torch.randn(BATCH, WIDTH, generator=gen)
    with torch.no_grad():
        torch.testing.assert_close(pair.split.model(x), pair.eager.model(x))
    micro = [torch.randn(BATCH, WIDTH, generator=gen) for _ in range(2)]
    for watched in (pair.eager, pair.split):
        watched.ddp.zero_grad()
        with watched.ddp.no_sync():
            watched.model(micro[0]).square().mean().backward()
        watched.model(micro[1]).square().mean().backward()
    for a, e in zip(pair.split.ddp.parameters(), pair.eager.ddp.parameters(), strict=True):
        torch.testing.assert_close(a.grad, e.grad)


def _worker(rank: int, world: int, *, case: str) -> dict:
    kwargs = {"static_graph": True} if case == "static_graph" else {}
    out: dict = {}
    checkpointed = case in CHECKPOINTED
    with ddp_split_backend.own_split():
        pair = _Pair(0, kwargs, regional=case == "regional", checkpointed=checkpointed)
        if case == "failed_first_call":
            with pytest.raises(RuntimeError):  # a bad batch the loop skips
                pair.split.model(torch.randn(BATCH, WIDTH + 1)).sum().backward()
        if case == "two_models":  # an ensemble: both models train every step
            other = _Pair(1, kwargs)
            for step in range(STEPS):
                pair.train(rank, 1, seed=step)
                other.train(rank, 1, seed=step + STEPS)
            out["second_counts"] = other.split.counts
        elif case == "sweep":  # a trial, freed without torch._dynamo.reset(), then the next
            pair.train(rank, 5)
            freed = weakref.ref(pair.split.ddp.module.layers[0].weight)
            del pair
            gc.collect()
            out["first_trial_freed"] = freed() is None
            pair = _Pair(1, kwargs, checkpointed=checkpointed)
            pair.train(rank, STEPS, seed=1)
        elif case == "checkpointed":
            pair.train(rank, STEPS // 2)
            _eval_and_no_sync(pair, rank)
            pair.train(rank, STEPS - STEPS // 2, seed=1)
        else:
            pair.train(rank, STEPS)
        out["counts"] = pair.split.counts
        for a, b in zip(pair.eager.ddp.parameters(), pair.split.ddp.parameters(), strict=True):
            torch.testing.assert_close(a, b)
    out["plans"] = [(len(r.plan.pieces), len(r.plan.buckets)) for r in ddp_split.records]
    out["region_cuts"] = [len(c.before) for r in ddp_split.records for c in r.plan.regions]
    dist.barrier()
    return out


@pytest.mark.parametrize(
    "case", ["plain", "checkpointed", "static_graph", "two_models", "sweep", "regional", "failed_first_call"]
)
def test_every_setup_overlaps_after_the_first_steps_and_matches_eager_ddp(tmp_path, case) -> None:
    results = run_ranks(_worker, tmp_path, world=2, case=case)
    for result in results:
        # After the first steps (DDP rebuilds its buckets at the first, or with a static
        # graph the second), all but the first layer's bucket leave before backward ends.
        settled = [result["counts"][-10:], result.get("second_counts", [DEPTH - 1] * 10)[-10:]]
        assert all(c >= DEPTH - 2 for counts in settled for c in counts), (case, result)
        if case == "regional":  # one graph per block: each its own bucket, nothing to cut
            assert all(pieces == 1 for pieces, _ in result["plans"]), result["plans"]
        else:
            assert any(pieces == buckets == DEPTH for pieces, buckets in result["plans"]), result["plans"]
        if case == "sweep":
            assert result["first_trial_freed"]
        if case in CHECKPOINTED:  # the region cut between each of its layers' buckets
            assert result["region_cuts"] and set(result["region_cuts"]) == {DEPTH - 3}, result["region_cuts"]
