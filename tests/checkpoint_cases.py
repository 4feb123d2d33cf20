"""Models with activation-checkpoint regions, and the 2-rank training runs of
``tests/test_checkpoint_regions.py`` (Note [Cutting checkpoint regions] in regions.py)."""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from .real_models import _hf_loss, _tokens, gpt2

STEPS = 12


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """A selective-checkpointing policy: keep matrix products, recompute the rest."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


SAVE_MATMULS = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)


class SixLayers(nn.Module):
    """One checkpoint region over six ``Linear`` layers (each 1 MiB: a DDP bucket apiece at a
    1 MiB cap), behind a small layer outside the region."""

    def __init__(self, width: int = 512, dropout: float = 0.0) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(6))
        self.dropout = dropout

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.dropout(torch.tanh(layer(x)), self.dropout, self.training)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, torch.tanh(self.stem(x)), use_reentrant=False).square().mean()


class Mixed(nn.Module):
    """Dropout, an autocast span and ``no_grad`` inside one region with a selective
    checkpointing policy; a second region reuses the first layer."""

    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(6))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(torch.tanh(self.layers[0](x)), 0.2, self.training)
        x = torch.tanh(self.layers[1](x))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            x = torch.relu(self.layers[2](x))
        with torch.no_grad():
            scale = x.float().abs().mean() + 1
        x = torch.tanh(self.layers[3](x.float() / scale))
        return F.dropout(torch.tanh(self.layers[4](x)), 0.1, self.training)

    def tail(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layers[5](torch.tanh(self.layers[0](x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self.body, x, use_reentrant=False, context_fn=SAVE_MATMULS)
        return checkpoint(self.tail, x, use_reentrant=False).square().mean()


def pending_piece_backwards(loss: torch.Tensor) -> Callable[[], int]:
    """How many of the compiled pieces' backward nodes behind ``loss`` have not run yet:
    hooks on the autograd graph, no clock."""
    nodes, seen, stack = [], set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node.name().startswith("CompiledFunctionBackward"):
            nodes.append(node)
        stack.extend(f for f, _ in node.next_functions)
    done: list[int] = []
    for node in nodes:
        node.register_hook(lambda grad_inputs, grad_outputs: done.append(1))
    return lambda: len(nodes) - len(done)


def _launch_recorder(state, bucket):  # no annotations: DDP checks them, and they are strings here
    state["launches"].append(state["pending"]())
    return default_hooks.allreduce_hook(None, bucket)


def _batches(rank: int, make: Callable[[torch.Generator], Any]) -> list[Any]:
    gen = torch.Generator().manual_seed(100 + rank)
    return [make(gen) for _ in range(STEPS)]


def _train(
    model: nn.Module, ddp: DDP, loss_fn: Callable[[nn.Module, Any], torch.Tensor], batches: list[Any], lr: float
) -> list[list[int]]:
    """SGD steps with per-rank data; returns, per step, the pending piece backwards at each
    bucket launch."""
    state: dict[str, Any] = {"launches": [], "pending": lambda: 0}
    ddp.register_comm_hook(state, _launch_recorder)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    launches = []
    for step, batch in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(step)  # dropout: the same masks in both runs
        loss = loss_fn(model, batch)
        state["pending"], state["launches"] = pending_piece_backwards(loss), []
        loss.backward()
        opt.step()
        launches.append(state["launches"])
    return launches


def _six(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(16, 512, generator=gen)


def _mixed(gen: torch.Generator) -> torch.Tensor:
    return torch.randn(16, 128, generator=gen)


def _call(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x)


def _gpt2_checkpointed() -> nn.Module:
    model = gpt2()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


CASES: dict[str, dict[str, Any]] = {
    # name: model, batches, loss, DDP cap (MiB), compile options, DDP keywords, learning rate
    "six_aot_eager": dict(build=lambda: SixLayers(dropout=0.1), data=_six, loss=_call, cap=1, options={"inner": "aot_eager"}),
    "six_static_graph": dict(build=SixLayers, data=_six, loss=_call, cap=1, options={"inner": "aot_eager"},
                             ddp={"static_graph": True}),
    "six_never": dict(build=SixLayers, data=_six, loss=_call, cap=1,
                      options={"inner": "aot_eager", "split_checkpoints": "never"}),
    "six_inductor": dict(build=lambda: SixLayers(dropout=0.1), data=_six, loss=_call, cap=1, options={}),
    "mixed_inductor": dict(build=Mixed, data=_mixed, loss=_call, cap=0.06, options={}),
    "gpt2_checkpointing": dict(build=_gpt2_checkpointed, data=_tokens, loss=_hf_loss, cap=0.015,
                               options={"inner": "aot_eager"}),
}


def run_checkpoint_case(rank: int, name: str) -> dict[str, Any]:
    import torch._inductor.config as inductor_config

    import ddp_split_backend
    from ddp_split_backend import ddp_split

    case = CASES[name]
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = case["build"]()
    batches = _batches(rank, case["data"])
    ddp_kwargs = {"bucket_cap_mb": case["cap"], **case.get("ddp", {})}
    eager = DDP(copy.deepcopy(base), **ddp_kwargs)
    _train(eager, eager, case["loss"], batches, lr=0.05)
    ddp = DDP(copy.deepcopy(base), **ddp_kwargs)
    model = torch.compile(ddp, backend="ddp_split", options=case["options"])
    ddp_split.records.clear()
    with ddp_split_backend.own_split(), inductor_config.patch(fallback_random=True):
        launches = _train(model, ddp, case["loss"], batches, lr=0.05)
    records = [r for r in ddp_split.records if r.plan.source == "ddp_split"]
    return {
        "launches": launches,
        "pieces": [len(r.plan.pieces) for r in records],
        "buckets": [len(r.plan.buckets) for r in records],
        "regions": [[(c.outcome.name, len(c.before)) for c in r.plan.regions] for r in records],
        "matched": [(r.buckets.done, r.buckets.pieces_matched, r.buckets.pieces) for r in records],
        "failures": [str(f) for r in records for f in r.failures],
        "params": [p.detach().clone() for p in ddp.parameters()],
        "expected": [p.detach().clone() for p in eager.parameters()],
    }


def run_checkpoint_cases(rank: int, world: int, cases: tuple[str, ...]) -> dict[str, Any]:
    return {name: run_checkpoint_case(rank, name) for name in cases}
