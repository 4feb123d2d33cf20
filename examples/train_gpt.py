"""Train a small GPT with DDP + torch.compile(backend="ddp_split").

Launch with torchrun (gloo on CPU, nccl with one GPU per rank)::

    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --steps 200
    torchrun --standalone --nproc_per_node=2 examples/train_gpt.py --steps 50 --compare eager

The data is a character-level corpus generated on the spot from a small grammar with a fixed
seed: nothing is downloaded, and the model can learn it (the loss falls well below the
uniform ln(vocab)).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import os
import random
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_split_backend
from ddp_split_backend import DDPSplitBackend, SplitConfig

# ----------------------------------------------------------------------------- data

_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "every child", "our teacher", "the bird"]
_VERBS = ["sees", "likes", "finds", "carries", "paints", "follows", "hears"]
_OBJECTS = ["a red ball", "the green door", "some bread", "the tall tree", "a small boat", "the river"]
_ENDINGS = ["today", "at night", "in the garden", "again", "with joy", "near the house"]


def make_corpus(sentences: int = 4000, seed: int = 1234) -> str:
    """A deterministic, learnable character corpus."""
    rng = random.Random(seed)
    lines = []
    for _ in range(sentences):
        lines.append(
            f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_ENDINGS)}."
        )
    return "\n".join(lines) + "\n"


class CharData:
    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        index = {c: i for i, c in enumerate(self.chars)}
        self.tokens = torch.tensor([index[c] for c in text], dtype=torch.long)

    @property
    def vocab(self) -> int:
        return len(self.chars)

    def batch(self, generator: torch.Generator, batch: int, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(self.tokens) - block - 1, (batch,), generator=generator)
        x = torch.stack([self.tokens[s : s + block] for s in starts.tolist()])
        y = torch.stack([self.tokens[s + 1 : s + block + 1] for s in starts.tolist()])
        return x, y


# ----------------------------------------------------------------------------- model


@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    block: int = 64
    width: int = 96
    layers: int = 4
    heads: int = 4
    dropout: float = 0.1


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.width)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.ln2 = nn.LayerNorm(cfg.width)
        self.fc = nn.Linear(cfg.width, 4 * cfg.width)
        self.out = nn.Linear(4 * cfg.width, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.width)
        self.pos = nn.Embedding(cfg.block, cfg.width)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.layers)])
        self.ln = nn.LayerNorm(cfg.width)
        self.head = nn.Linear(cfg.width, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.drop(self.tok(idx) + self.pos(torch.arange(t, device=idx.device)))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


class GPTReference(GPT):
    """Same model, its own code object: Dynamo's cache keeps the compared modes apart."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return super().forward(idx)


def demo_model() -> GPT:
    """The example's model, for ``python -m ddp_split_backend explain examples.train_gpt:demo_model``."""
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab=CharData(make_corpus()).vocab))


# ----------------------------------------------------------------------------- training


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default 200)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per micro-batch per rank")
    p.add_argument("--accum", type=int, default=2, help="micro-batches per step (no_sync between)")
    p.add_argument("--bucket-cap-mb", type=float, default=0.25, help="DDP bucket cap in MiB")
    p.add_argument("--inner", choices=["inductor", "aot_eager"], default="inductor")
    p.add_argument("--compare", choices=["eager", "ddp_optimizer"], default=None,
                   help="also train eager DDP or torch's DDPOptimizer on the same batches")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--dropout", type=float, default=0.1,
                   help="dropout; compiled and eager code draw different random masks, so use "
                        "--dropout 0 with --compare for a parameter-exact comparison")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overlap-png", metavar="PNG", default=None,
                   help="also draw the overlap measured over the last 10 steps (needs matplotlib: "
                        "pip install 'ddp-split-backend[plot]') and print its per-bucket table")
    p.add_argument("--save-params", metavar="PATH", default=None,
                   help="every rank writes its final parameters to PATH.rank<global rank>")
    return p.parse_args(argv)


def setup() -> tuple[int, int, torch.device]:
    if torch.cuda.is_available():
        dist.init_process_group("nccl")
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // dist.get_world_size()))
        device = torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager:
    dtype = torch.bfloat16 if device.type == "cpu" or torch.cuda.is_bf16_supported() else torch.float16
    return torch.autocast(device.type, dtype=dtype)


@dataclass
class Trainer:
    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer
    step_times: list[float]


def train_step(trainer: Trainer, batches: list[tuple[torch.Tensor, torch.Tensor]], device: torch.device) -> float:
    """One optimizer step over micro-batches; gradients sync only on the last (no_sync)."""
    start = time.perf_counter()
    trainer.optimizer.zero_grad(set_to_none=True)
    total = 0.0
    ddp = trainer.model if isinstance(trainer.model, DDP) else trainer.model._orig_mod
    for i, (x, y) in enumerate(batches):
        sync = contextlib.nullcontext() if i == len(batches) - 1 else ddp.no_sync()
        with sync:
            with autocast_for(device):
                logits = trainer.model(x)
                loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1)) / len(batches)
            loss.backward()
        total += loss.item()
    trainer.optimizer.step()
    if device.type == "cuda":
        torch.cuda.synchronize()
    trainer.step_times.append(time.perf_counter() - start)
    return total


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    first_bucket_mb = torch.distributed._DEFAULT_FIRST_BUCKET_BYTES / 2**20
    if args.compare == "ddp_optimizer" and args.bucket_cap_mb < first_bucket_mb:
        raise SystemExit(
            f"--compare ddp_optimizer: torch's DDPOptimizer asserts on bucket caps below its "
            f"{first_bucket_mb:g} MiB first bucket (got --bucket-cap-mb {args.bucket_cap_mb:g}); "
            "ddp_split handles them. Rerun with --bucket-cap-mb 1 or more to compare."
        )
    rank, world, device = setup()
    data = CharData(make_corpus())
    cfg = GPTConfig(vocab=data.vocab, dropout=args.dropout)
    torch.manual_seed(args.seed)
    base = GPT(cfg).to(device)

    backend = DDPSplitBackend(SplitConfig(inner=args.inner))
    split_ddp = DDP(copy.deepcopy(base), bucket_cap_mb=args.bucket_cap_mb)
    # What the backend is for: how much of the last steps' communication backward hid.
    measured = min(10, args.steps)
    watch = ddp_split_backend.watch_overlap(
        split_ddp, warmup=(args.steps - measured) * args.accum, steps=measured * args.accum
    )
    split_model = torch.compile(split_ddp, backend=backend)
    trainers = [Trainer("ddp_split", split_model, torch.optim.AdamW(split_model.parameters(), lr=args.lr), [])]
    if args.compare:
        reference = GPTReference(cfg).to(device)
        reference.load_state_dict(base.state_dict())
        ref_ddp = DDP(reference, bucket_cap_mb=args.bucket_cap_mb)
        ref_model = ref_ddp if args.compare == "eager" else torch.compile(ref_ddp, backend=args.inner)
        trainers.append(Trainer(args.compare, ref_model, torch.optim.AdamW(ref_model.parameters(), lr=args.lr), []))

    generator = torch.Generator().manual_seed(1000 + rank)
    tokens_per_step = args.batch_size * cfg.block * args.accum * world
    first_loss = last_loss = math.nan
    wall = time.perf_counter()
    for step in range(args.steps):
        batches = [tuple(t.to(device) for t in data.batch(generator, args.batch_size, cfg.block))
                   for _ in range(args.accum)]
        for trainer in trainers:
            # DDPOptimizer is torch's default; ddp_split plans DDP graphs itself under own_split().
            mode = ddp_split_backend.own_split() if trainer.name == "ddp_split" else contextlib.nullcontext()
            torch.manual_seed(args.seed * 100003 + step)  # same dropout masks in every mode
            with mode:
                loss = train_step(trainer, batches, device)
            if trainer.name == "ddp_split":
                last_loss = loss
                if step == 0:
                    first_loss = loss
                    first_compiles = list(backend.records)  # what the first step compiled
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            seconds = trainers[0].step_times[-1]
            print(f"step {step:4d}  loss {last_loss:.4f}  {tokens_per_step / seconds:9.0f} tok/s  "
                  f"{seconds * 1000:7.1f} ms/step", flush=True)

    if rank == 0:
        logged = sum((r.times.traced or 0.0) + r.times.total + r.backward.seconds for r in first_compiles)
        first = trainers[0].step_times[0]
        print(f"first step {first:.1f} s, of which the ddp_split lines above account for {logged:.1f} s "
              f"({logged / first:.0%}: traced, compiled, backward compiled)")
        print(f"loss: start {first_loss:.4f} -> end {last_loss:.4f} "
              f"(uniform would be {math.log(data.vocab):.4f}); wall {time.perf_counter() - wall:.1f} s")
    watch.remove()  # closes the window: ddp_split logs its one-line summary (rank 0)
    if rank == 0:
        print("(one compiled graph would hide none of it: all its gradients become ready together, "
              "when its single backward ends)")
        if args.overlap_png:
            report = watch.report()
            print(report.table())
            drawn = report.draw(args.overlap_png)
            if drawn is not None:
                print(f"overlap timeline: {drawn}")
    if args.compare:
        ours, theirs = trainers[0], trainers[1]
        diff = max((a - b).abs().max().item() for a, b in zip(ours.model.parameters(), theirs.model.parameters()))
        skip = min(5, args.steps - 1)
        ratio = (sorted(ours.step_times[skip:])[len(ours.step_times[skip:]) // 2]
                 / sorted(theirs.step_times[skip:])[len(theirs.step_times[skip:]) // 2])
        if rank == 0:
            print(f"compare with {args.compare}: max |param diff| {diff:.3e}, "
                  f"median step time ratio ddp_split/{args.compare} {ratio:.3f}")
    if args.save_params:
        params = {n: t.detach().cpu() for n, t in trainers[0].model.named_parameters()}
        torch.save(params, f"{args.save_params}.rank{rank}")
    # Reducers first, then the process group: see Note [Teardown deadlock] in
    # ddp_split_backend/teardown.py (a plain destroy_process_group() can hang at exit).
    ddp_split_backend.close_ddp(*(trainer.model for trainer in trainers))


if __name__ == "__main__":
    main()
