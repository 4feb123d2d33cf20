"""Models that read tensors back into Python inside forward (``.item()``, ``print``), trained on
every rank of a gloo world: eager DDP, plain ``torch.compile`` and ``backend="ddp_split"``.

Dynamo answers some of these by re-tracing the frame: AOTAutograd's pass that turns Python
floats into tensors raises a restart signal from inside the backend's compile (Note
[Dynamo's signals] in guards.py). A backend that swallowed it would run a piece eagerly for
the rest of the run. Each case reports what the test asserts on: fallback warnings, graphs
compiled by each mode, and parameters and evaluation outputs against eager DDP.
"""

from __future__ import annotations

import copy
import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_split_backend
from ddp_split_backend import InnerFallbackWarning, ddp_split

WIDTH, VOCAB, STEPS = 512, 50, 12


class ItemLM(nn.Module):
    """An embedding and four Linear blocks; ``where`` says where forward reads a tensor back
    into Python: ``before`` the block loop (stored on the module, for logging), ``inside`` it,
    in the ``loss``, as a ``float`` used in later tensor math, or a ``print``."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.head = nn.Linear(WIDTH, 1)
        self.stat = 0.0
        self.block_stats = [0.0] * len(self.blocks)
        self.last_loss = 0.0

    def forward(self, tokens: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        h = self.emb(tokens)
        if self.where == "before":
            self.stat = h.abs().mean().item()
        elif self.where == "float_math":
            scale = h.abs().mean().item()
            h = h * (1.0 / (1.0 + scale))
        elif self.where == "print":
            print("ItemLM forward", tuple(tokens.shape))
        for i, block in enumerate(self.blocks):
            h = torch.tanh(block(h))
            if self.where == "inside":
                self.block_stats[i] = h.square().mean().item()
        loss = F.mse_loss(self.head(h).squeeze(-1), target)
        if self.where == "loss":
            self.last_loss = loss.detach().item()
        return loss


WHERE = ("before", "inside", "loss", "float_math", "print")


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [
        (torch.randint(0, VOCAB, (4, 6), generator=gen), torch.randn(4, 6, generator=gen))
        for _ in range(STEPS + 1)
    ]


def _train(model: nn.Module, params: list[torch.Tensor], batches: list[Any]) -> torch.Tensor:
    """``STEPS`` SGD steps, then the evaluation loss of the last batch under ``no_grad``."""
    opt = torch.optim.SGD(params, lr=0.1)
    for tokens, target in batches[:-1]:
        model(tokens, target).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        return model(*batches[-1]).detach()


def _plain_graphs(base: nn.Module, batches: list[Any], inner: str) -> list[str]:
    """The compile ids of the graphs plain ``torch.compile`` of the DDP module compiles on
    the same script (a frame re-traced after a restart signal keeps its id)."""
    ids: list[str] = []
    compiler = torch._dynamo.lookup_backend(inner)

    def counting(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        ids.append(str(torch._guards.CompileContext.current_compile_id()))
        return compiler(gm, example_inputs)

    ddp = DDP(copy.deepcopy(base), bucket_cap_mb=1)
    with ddp_split_backend.own_split():  # one graph per frame, as ddp_split receives it
        _train(torch.compile(ddp, backend=counting), list(ddp.parameters()), batches)
    return sorted(set(ids))


def run_signal_cases(rank: int, world: int, inner: str, cases: tuple[str, ...] = WHERE) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for where in cases:
        torch._dynamo.reset()  # each mode compiles the class's code afresh (no cache shared)
        torch.manual_seed(0)
        base = ItemLM(where)
        batches = _batches(rank)
        eager = DDP(copy.deepcopy(base), bucket_cap_mb=1)
        eager_eval = _train(eager, list(eager.parameters()), batches)
        plain = _plain_graphs(base, batches, inner)
        torch._dynamo.reset()
        split = DDP(copy.deepcopy(base), bucket_cap_mb=1)
        model = torch.compile(split, backend="ddp_split", options={"inner": inner})
        with warnings.catch_warnings(record=True) as caught, ddp_split_backend.own_split():
            warnings.simplefilter("always", InnerFallbackWarning)
            split_eval = _train(model, list(split.parameters()), batches)
        out[where] = {
            "fallbacks": [str(w.message) for w in caught if issubclass(w.category, InnerFallbackWarning)],
            "failures": [str(f.error) for r in ddp_split.records for f in r.failures],
            "graphs": sorted({r.compile_id for r in ddp_split.records}),
            "records": len(ddp_split.records),
            "plain_graphs": plain,
            "pieces": [len(r.plan.pieces) for r in ddp_split.records],
            "params": [p.detach().clone() for p in split.parameters()],
            "expected": [p.detach().clone() for p in eager.parameters()],
            "eval": split_eval,
            "eager_eval": eager_eval,
        }
    torch._dynamo.reset()
    return out
