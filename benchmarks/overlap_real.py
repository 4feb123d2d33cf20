#!/usr/bin/env python
"""Overlap on a real model: Hugging Face GPT-2 (built from a config), one gloo rank, a link
as slow as backward, eager DDP, torch's DDPOptimizer and ddp_split stepped round-robin in one
process.

The link is ``overlap.py``'s: one thread sends buckets in the order DDP hands them over, each
taking bytes / bandwidth, and DDP's backward returns once the last one is sent. Its speed is
set after warm-up so that all of a step's gradient bytes take as long as eager DDP's
backward (``--comm-ratio`` times that). Per mode: the step, the communication still running
after the last bucket became ready ("exposed"), and how many buckets were sent before it.

Each mode has its own wrapper class (its own ``forward`` code object, ``_common.own_code``),
and the loss is computed in the wrapper, so no graph of one mode is reused by another.
Run it at two commits to compare them (the ratio to DDPOptimizer in the same run is what
carries over between runs)::

    .venv/bin/python benchmarks/overlap_real.py --inner inductor
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_split_backend
from _common import environment, free_port, own_code
from overlap import HookState, Link, link_hook

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
MODES = ("eager_ddp", "ddp_optimizer", "ddp_split")


class _Wrapped(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model


def _forward(self: _Wrapped, ids: torch.Tensor) -> torch.Tensor:
    logits = self.model(input_ids=ids).logits
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())


WRAPPER = {mode: type(f"GPT2_{mode}", (_Wrapped,), {"forward": own_code(_forward, mode)}) for mode in MODES}


def _gpt2(args: argparse.Namespace) -> nn.Module:
    import sys

    sys.path.insert(0, str(ROOT))
    from tests.torchvision_cpu import define_torchvision_operators

    define_torchvision_operators()  # transformers imports torchvision when it is installed
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(vocab_size=512, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                        n_head=4, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(config)


def _build(mode: str, args: argparse.Namespace, link: Link) -> tuple[nn.Module, DDP, Any]:
    module = WRAPPER[mode](_gpt2(args))
    names = {id(p): n for n, p in module.named_parameters()}
    ddp = DDP(module, bucket_cap_mb=args.bucket_cap_mb)
    ddp.register_comm_hook(HookState(link, mode, names), link_hook)
    if mode == "eager_ddp":
        return ddp, ddp, contextlib.nullcontext
    if mode == "ddp_optimizer":
        return torch.compile(ddp, backend=args.inner), ddp, lambda: torch._dynamo.config.patch(optimize_ddp=True)
    return torch.compile(ddp, backend="ddp_split", options={"inner": args.inner}), ddp, ddp_split_backend.own_split


def _step(model: nn.Module, ddp: DDP, context: Any, ids: torch.Tensor, link: Link) -> dict[str, float]:
    for p in ddp.parameters():
        p.grad = None
    link.reset()
    with context():
        t0 = time.perf_counter()
        loss = model(ids)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
    transfers = sorted(link.transfers, key=lambda t: t.ready)
    last_ready = max((t.ready for t in transfers), default=t2)
    return {
        "step": t2 - t0,
        "backward": t2 - t1,
        "exposed": t2 - last_ready,
        "sent_before": sum(t.end <= last_ready for t in transfers),
        "buckets": len(transfers),
        "bytes": sum(t.nbytes for t in transfers),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inner", default="inductor")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--comm-ratio", type=float, default=1.0, help="link time / eager DDP's backward")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--out", type=Path, default=HERE / "results" / "overlap_real.json")
    args = p.parse_args()

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    link = Link()
    link.bandwidth = float("inf")
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (args.batch, args.seq), generator=gen)
    modes = {mode: _build(mode, args, link) for mode in MODES}
    for _ in range(args.warmup):
        for model, ddp, context in modes.values():
            _step(model, ddp, context, ids, link)
    backward = statistics.median(_step(*modes["eager_ddp"], ids, link)["backward"] for _ in range(3))
    total = _step(*modes["eager_ddp"], ids, link)["bytes"]
    link.bandwidth = total / (args.comm_ratio * backward)
    samples: dict[str, list[dict[str, float]]] = {mode: [] for mode in MODES}
    for _ in range(args.rounds):
        for mode, (model, ddp, context) in modes.items():
            samples[mode].append(_step(model, ddp, context, ids, link))
    rows = {}
    for mode, got in samples.items():
        rows[mode] = {key: statistics.median(s[key] for s in got) for key in got[0]}
    base = rows["ddp_optimizer"]["step"]
    print(f"GPT-2 ({args.layers} x {args.width}, batch {args.batch} x {args.seq}), inner {args.inner}, "
          f"cap {args.bucket_cap_mb} MiB, link {link.bandwidth / 1e9:.3f} GB/s (comm {args.comm_ratio} x eager backward "
          f"{backward * 1e3:.1f} ms); medians of {args.rounds} rounds")
    print("| mode | step ms | exposed comm ms | buckets sent before backward ended | step / DDPOptimizer |")
    print("|---|---|---|---|---|")
    for mode, row in rows.items():
        print(f"| {mode} | {row['step'] * 1e3:.1f} | {row['exposed'] * 1e3:.1f} | "
              f"{row['sent_before']:.0f} of {row['buckets']:.0f} | {row['step'] / base:.3f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"environment": environment(), "args": {k: str(v) for k, v in vars(args).items()},
                                    "bandwidth": link.bandwidth, "rows": rows, "samples": samples}, indent=1))
    link.close()
    ddp_split_backend.close_ddp(*(ddp for _, ddp, _ in modes.values()))


if __name__ == "__main__":
    main()
