"""Real models trained on every rank of a gloo world, default options, to compare the buckets
DDP rebuilds with ddp_split's pieces (Note [Pieces are DDP's buckets] in ready_order.py)."""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from .helpers import piece_bucket_agreement, reducer_bucket_names
from .real_models import BATCH, MODELS, MORE_MODELS, SEQ, VOCAB, cap_mb

STEPS = 10

BUCKET_CASES = ("gpt2", "gpt2_varying", "llama", "t5", "mixtral", "vit", "resnet18")


def _spec(case: str) -> Any:
    name = "gpt2" if case == "gpt2_varying" else case
    return {**MODELS, **MORE_MODELS}[name]


def _batches(case: str, rank: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(100 + rank)
    if case != "gpt2_varying":
        return [_spec(case).batch(gen) for _ in range(STEPS)]
    batches = []
    for step in range(STEPS):  # the sequence length changes every step: a dynamic graph follows
        ids = torch.randint(0, VOCAB, (BATCH, SEQ - step % 4), generator=gen)
        batches.append({"input_ids": ids, "labels": ids.clone()})
    return batches


def _train(model: torch.nn.Module, loss_fn: Any, batches: list[dict], lr: float) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for batch in batches:
        opt.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        opt.step()


def run_bucket_case(rank: int, case: str, inner: str = "aot_eager") -> dict[str, Any]:
    import ddp_split_backend
    from ddp_split_backend import ddp_split

    torch._dynamo.reset()
    spec = _spec(case)
    torch.manual_seed(0)
    base = spec.build()
    cap = cap_mb(base, "several")
    batches = _batches(case, rank)
    eager = DDP(copy.deepcopy(base), bucket_cap_mb=cap)
    _train(eager, spec.loss, batches, spec.lr)
    ddp = DDP(copy.deepcopy(base), bucket_cap_mb=cap)
    model = torch.compile(ddp, backend="ddp_split", options={"inner": inner})
    ddp_split.records.clear()
    with ddp_split_backend.own_split():
        _train(model, spec.loss, batches, spec.lr)
    records = [r for r in ddp_split.records if r.plan.source == "ddp_split"]
    matched, param_pieces, spans = piece_bucket_agreement(ddp, [r.plan for r in records])
    return {
        "matched": matched,
        "param_pieces": param_pieces,
        "spans": spans,
        "reducer": [sorted(b) for b in reducer_bucket_names(ddp)],
        "checks": [(r.buckets.done, r.buckets.pieces_matched, r.buckets.pieces) for r in records],
        "partial": [r.plan.share is not None and r.plan.share.graph_bytes > 0 for r in records],
        "graphs": len(records),
        "params": [p.detach().clone() for p in ddp.parameters()],
        "expected": [p.detach().clone() for p in eager.parameters()],
    }


def run_bucket_cases(rank: int, world: int, cases: tuple[str, ...] = BUCKET_CASES) -> dict[str, Any]:
    return {case: run_bucket_case(rank, case) for case in cases}
