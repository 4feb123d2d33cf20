"""The default path stays sound beyond the simple case (issue 31): dynamic sizes compile no
more Dynamo graphs than plain ``torch.compile``, ``mark_dynamic`` and data-dependent sizes
work, a trained model is freed without ``torch._dynamo.reset()``, and ``explain`` runs no
collective. Each runs the defaults and the opt-in ``min_piece_mb="auto"`` (whose cost model
reads sizes)."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_split_backend
from ddp_split_backend import ddp_split, explain

from .multiproc import run_ranks

pytestmark = pytest.mark.usefixtures("world1")

MODES = {"default": {"inner": "aot_eager"}, "auto": {"inner": "aot_eager", "min_piece_mb": "auto", "link_gbps": 1.0}}
CAP_MB = 0.01


class Tokens(nn.Module):
    """Sequence-length-agnostic: embedding, per-token layers, mean over the sequence."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, width)
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.mean()


class Selected(nn.Module):
    """Rows chosen by a data-dependent mask: an unbacked size inside the graph."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        count = (x[:, 0] > 0).sum().item()
        torch._check(count >= 0)
        x = x[:count]
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x.sum()


def _lengths() -> list[int]:
    return [5, 7, 9, 11, 13, 6, 8, 10, 12, 14]


def _train_lengths(backend: Any, options: dict | None) -> None:
    torch.manual_seed(0)
    ddp = DDP(Tokens(), bucket_cap_mb=CAP_MB)
    compiled = torch.compile(ddp, backend=backend, options=options)
    with ddp_split_backend.own_split():
        for length in _lengths():
            compiled(torch.randint(0, 50, (4, length))).backward()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_variable_lengths_compile_as_many_graphs_as_plain_torch_compile(mode) -> None:
    torch._dynamo.config.capture_scalar_outputs = False
    counter = CompileCounterWithBackend("aot_eager")
    _train_lengths(counter, None)
    plain = counter.frame_count
    torch._dynamo.reset()
    _train_lengths("ddp_split", MODES[mode])
    ours = len(ddp_split.records)
    assert plain <= 3 and ours == plain, (plain, [r.plan.graph_name for r in ddp_split.records])
    assert any(len(r.plan.buckets) > 1 for r in ddp_split.records)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_mark_dynamic_trains_on_the_default_path(mode) -> None:
    torch.manual_seed(0)
    ddp = DDP(Tokens(), bucket_cap_mb=CAP_MB)
    compiled = torch.compile(ddp, backend="ddp_split", options=MODES[mode])
    with ddp_split_backend.own_split():
        for length in _lengths():
            tokens = torch.randint(0, 50, (4, length))
            torch._dynamo.mark_dynamic(tokens, 1)
            loss = compiled(tokens)
            loss.backward()
            torch.testing.assert_close(loss, ddp.module(tokens))
    _assert_cut_by_default(mode)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_unbacked_sizes_train_on_the_default_path(mode) -> None:
    torch._dynamo.config.capture_scalar_outputs = True
    torch.manual_seed(0)
    ddp = DDP(Selected(), bucket_cap_mb=CAP_MB)
    compiled = torch.compile(ddp, backend="ddp_split", options=MODES[mode])
    gen = torch.Generator().manual_seed(0)
    with ddp_split_backend.own_split():
        for _ in range(8):
            x = torch.randn(16, 32, generator=gen)
            loss = compiled(x)
            loss.backward()
            torch.testing.assert_close(loss, ddp.module(x))
    _assert_cut_by_default(mode)


def _assert_cut_by_default(mode: str) -> None:
    """Several buckets; the defaults cut one piece per bucket (``auto`` plans dynamic graphs
    from static estimates, which may keep fewer)."""
    plans = [r.plan for r in ddp_split.records]
    assert plans and all(len(p.buckets) > 1 for p in plans), [p.table() for p in plans]
    if mode == "default":
        assert all(len(p.pieces) == len(p.buckets) for p in plans), [p.table() for p in plans]


@pytest.mark.parametrize("mode", sorted(MODES))
def test_a_trained_model_is_freed_without_a_dynamo_reset(mode) -> None:
    """Ten training steps and an evaluation graph, then the user drops everything: the
    parameters, the DDP module and the first batch go (no ``torch._dynamo.reset()``)."""
    torch.manual_seed(0)
    ddp = DDP(Tokens(), bucket_cap_mb=CAP_MB)
    compiled = torch.compile(ddp, backend="ddp_split", options=MODES[mode])
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1)
    first = torch.randint(0, 50, (4, 9))
    watched = [weakref.ref(ddp), weakref.ref(ddp.module.layers[0].weight), weakref.ref(first)]
    with ddp_split_backend.own_split():
        for step in range(10):
            tokens = first if step == 0 else torch.randint(0, 50, (4, 9))
            compiled(tokens).backward()
            optimizer.step()
            optimizer.zero_grad()
        with torch.no_grad():
            compiled(torch.randint(0, 50, (4, 9)))
    assert len(ddp_split.records) >= 2  # the training graph and the evaluation graph
    del ddp, compiled, optimizer, first, tokens
    gc.collect()
    assert [ref() is None for ref in watched] == [True, True, True]


class Normed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.a(x)))


def _explain_on_rank_zero(rank: int, world: int) -> int:
    ddp = DDP(Normed(), bucket_cap_mb=0.001)  # buffers: DDP's forward would broadcast them
    if rank == 0:  # the natural way to print a plan once
        result = explain(ddp, torch.randn(4, 16))
        assert len(result.plans) == 1
        pieces = len(result.plans[0].pieces)
    else:
        pieces = 0
    dist.barrier()
    return pieces


@pytest.mark.multiprocess
def test_explain_on_one_rank_runs_no_collective(tmp_path) -> None:
    results = run_ranks(_explain_on_rank_zero, tmp_path, world=2, timeout=120)
    assert results[0] >= 2 and results[1] == 0
