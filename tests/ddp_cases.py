"""Training cases run on every rank of a gloo world: ddp_split against eager DDP.

Each case trains the same model twice from the same weights on the same per-rank data, once
with eager DDP and once with ddp_split, and reports the largest parameter difference, the
number of pieces compiled, and how the pieces line up with the buckets DDP's reducer uses.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_split_backend
from ddp_split_backend import DDPSplitBackend, SplitConfig

from .helpers import piece_bucket_agreement
from .models import MLP

_EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_gpt.py"


def load_example() -> Any:
    """The example script as a module (examples/ is not a package)."""
    name = "train_gpt_example"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Skipper(nn.Module):
    """Skips its middle layer when asked: DDP must find the unused parameters."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)

    def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
        x = torch.relu(self.a(x))
        if not skip:
            x = torch.relu(self.b(x))
        return self.c(x)


def _train(
    model: nn.Module,
    ddp: DDP,
    batches: list[tuple],
    *,
    optimizer: str,
    accumulate: int,
    autocast: bool,
    loss_fn: Callable[[Any, Any], torch.Tensor],
) -> None:
    opt = (torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD)(model.parameters(), lr=0.05)
    for step in range(0, len(batches), accumulate):
        opt.zero_grad(set_to_none=True)
        group = batches[step : step + accumulate]
        for i, (args, target) in enumerate(group):
            sync = contextlib.nullcontext() if i == len(group) - 1 else ddp.no_sync()
            with sync:
                amp = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
                with amp:
                    out = model(*args)
                loss_fn(out.float(), target).backward()
        opt.step()


def run_case(rank: int, case: str) -> dict[str, Any]:
    """Train one case with eager DDP and ddp_split; return what the test asserts on."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    ddp_kwargs: dict[str, Any] = {"bucket_cap_mb": 0.015}
    optimizer, accumulate, autocast, wrap = "sgd", 1, False, "outside"
    gen = torch.Generator().manual_seed(100 + rank)

    def mse(out, target):
        return F.mse_loss(out, target)

    loss_fn = mse
    if case == "gpt_autocast":
        example = load_example()
        cfg = example.GPTConfig(vocab=32, block=16, width=32, layers=2, heads=2, dropout=0.0)
        base: nn.Module = example.GPT(cfg)
        optimizer, autocast = "adamw", True
        ddp_kwargs["bucket_cap_mb"] = 0.02
        batches = []
        for _ in range(3):
            tokens = torch.randint(0, 32, (4, 17), generator=gen)
            batches.append(((tokens[:, :-1],), tokens[:, 1:]))

        def loss_fn(out, target):
            return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))
    elif case == "find_unused":
        base = Skipper()
        ddp_kwargs["find_unused_parameters"] = True
        batches = [((torch.randn(8, 64, generator=gen), step % 2 == 1), torch.randn(8, 64, generator=gen))
                   for step in range(4)]
    else:
        base = MLP(width=64, depth=4)
        sizes = [8, 8, 8]
        if case == "static_graph":
            ddp_kwargs["static_graph"] = True
        elif case == "bucket_view":
            ddp_kwargs["gradient_as_bucket_view"] = True
        elif case == "no_sync":
            accumulate, sizes = 2, [8] * 6
        elif case == "recompile":
            sizes = [8, 8, 5, 5]
        elif case == "compile_inside":
            wrap = "inside"
        elif case != "plain":
            raise ValueError(case)
        batches = [((torch.randn(n, 64, generator=gen),), torch.randn(n, 64, generator=gen)) for n in sizes]

    eager_ddp = DDP(copy.deepcopy(base), **ddp_kwargs)
    backend = DDPSplitBackend(SplitConfig(inner="aot_eager", min_piece_mb=None))  # the cuts, under each DDP mode
    if wrap == "outside":
        split_ddp = DDP(copy.deepcopy(base), **ddp_kwargs)
        split_model: nn.Module = torch.compile(split_ddp, backend=backend)
    else:
        split_ddp = DDP(torch.compile(copy.deepcopy(base), backend=backend), **ddp_kwargs)
        split_model = split_ddp
    kwargs = dict(optimizer=optimizer, accumulate=accumulate, autocast=autocast, loss_fn=loss_fn)
    _train(eager_ddp, eager_ddp, batches, **kwargs)
    with ddp_split_backend.own_split():
        _train(split_model, split_ddp, batches, **kwargs)
    diff = max(
        (a - b).abs().max().item() for a, b in zip(eager_ddp.parameters(), split_ddp.parameters(), strict=True)
    )
    matched, pieces, spans = piece_bucket_agreement(split_ddp, [r.plan for r in backend.records])
    return {
        "diff": diff,
        "graphs": len(backend.records),
        "pieces": [len(r.plan.buckets) for r in backend.records],
        "matched": matched,
        "plan_pieces": pieces,
        "spans": spans,
        "params": [p.detach().clone() for p in split_ddp.parameters()],
    }


CASES = ["plain", "gpt_autocast", "static_graph", "find_unused", "bucket_view", "no_sync", "recompile", "compile_inside"]


def run_all_cases(rank: int, world: int) -> dict[str, dict[str, Any]]:
    return {case: run_case(rank, case) for case in CASES}
