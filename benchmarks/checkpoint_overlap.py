#!/usr/bin/env python
"""Overlap and memory of one activation-checkpoint region, whole against cut at DDP's buckets.

The model: a small stem, then one non-reentrant ``checkpoint`` over six ``Linear`` + tanh
layers, each layer's gradients a DDP bucket of their own. DDP (one gloo rank) sends buckets
over the simulated link of ``overlap.py`` (one thread, bytes over bandwidth, sleeping). The
link's bandwidth is set so that sending every bucket takes as long as the ``whole`` mode's
backward measured just before (communication costs as much as backward).

Modes, per inner backend (aot_eager, inductor), stepped round-robin:

* ``whole``  ``backend="ddp_split"``-style backend with ``split_checkpoints="never"`` (what
  torch's DDPOptimizer does too: the region is one node)
* ``split``  the default options: the region cut at the bucket boundaries, within
  ``checkpoint_budget``
* ``ddp_optimizer``  torch's DDPOptimizer, for reference

Reported per mode: the median step with an instant link and with the slow one, the exposed
communication (their difference), how many buckets were sent while backward still computed
(a transfer that started before the last bucket was ready), and the bytes the step saves for
backward (a ``saved_tensors_hooks`` pack hook counting every non-parameter tensor saved in a
forward), with the same model without checkpointing for scale.

Example::

    .venv/bin/python benchmarks/checkpoint_overlap.py            # ~3 min on 2 cores
    .venv/bin/python benchmarks/checkpoint_overlap.py --quick    # aot_eager only, few steps
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint

import ddp_split_backend
from _common import environment, free_port, own_code
from ddp_split_backend import DDPSplitBackend, SplitConfig
from overlap import HookState, Link, link_hook

HERE = Path(__file__).resolve().parent
MODES = ("whole", "split", "ddp_optimizer", "no_checkpoint")
LINK_MODES = ("whole", "split", "ddp_optimizer")


class _Base(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.stem = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(6))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _checkpointed(self: _Base, x: torch.Tensor) -> torch.Tensor:
    return checkpoint(self.body, torch.tanh(self.stem(x)), use_reentrant=False)


def _plain(self: _Base, x: torch.Tensor) -> torch.Tensor:
    return self.body(torch.tanh(self.stem(x)))


MODEL_CLASS = {
    mode: type(f"Region_{mode}", (_Base,), {"forward": own_code(_plain if mode == "no_checkpoint" else _checkpointed, mode)})
    for mode in MODES
}


@dataclass
class Mode:
    name: str
    ddp: DDP
    context: Callable[[], contextlib.AbstractContextManager[Any]]
    backend: Any = None
    samples: dict[str, list[dict[str, float]]] = field(default_factory=dict)
    saved_bytes: int = 0


def build(name: str, inner: str, width: int, cap_mb: float, link: Link) -> Mode:
    torch.manual_seed(0)
    module = MODEL_CLASS[name](width)
    names = {id(p): n for n, p in module.named_parameters()}
    context: Callable[[], contextlib.AbstractContextManager[Any]] = ddp_split_backend.own_split
    backend: Any = None
    if name == "ddp_optimizer":
        target = torch.compile(module, backend=inner)
        context = lambda: torch._dynamo.config.patch(optimize_ddp=True)  # noqa: E731
    else:
        policy = "never" if name == "whole" else "budget"
        backend = DDPSplitBackend(SplitConfig(inner=inner, split_checkpoints=policy))
        target = torch.compile(module, backend=backend)
    ddp = DDP(target, bucket_cap_mb=cap_mb)
    ddp.register_comm_hook(HookState(link, name, names, record_params=False), link_hook)
    return Mode(name, ddp, context, backend)


def step(mode: Mode, x: torch.Tensor, link: Link) -> dict[str, float]:
    for p in mode.ddp.parameters():
        p.grad = None
    link.reset()
    with mode.context():
        t0 = time.perf_counter()
        loss = mode.ddp(x).square().mean()
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
    transfers = sorted(link.transfers, key=lambda t: t.ready)
    last_ready = max((t.ready for t in transfers), default=t2)
    return {
        "step": t2 - t0,
        "backward": t2 - t1,
        "early": sum(t.start < last_ready for t in transfers),
        "buckets": len(transfers),
        "bytes": sum(t.nbytes for t in transfers),
    }


def saved_bytes(mode: Mode, x: torch.Tensor) -> int:
    """Bytes of non-parameter tensors saved for backward by one forward."""
    count = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter):
            count[0] += t.numel() * t.element_size()
        return t

    with mode.context(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = mode.ddp(x).square().mean()
    with mode.context():
        loss.backward()
    return count[0]


def median(samples: list[dict[str, float]], key: str) -> float:
    return statistics.median(s[key] for s in samples)


def run_inner(inner: str, args: argparse.Namespace, link: Link) -> dict[str, Any]:
    torch._dynamo.reset()
    x = torch.randn(args.batch, args.width)
    link.bandwidth = float("inf")
    modes = {name: build(name, inner, args.width, args.cap_mb, link) for name in MODES}
    for mode in modes.values():
        t0 = time.perf_counter()
        step(mode, x, link)
        print(f"[{inner}] {mode.name}: first step {time.perf_counter() - t0:.1f} s", flush=True)
    for _ in range(args.warmup):
        for mode in modes.values():
            step(mode, x, link)
    for mode in modes.values():
        mode.saved_bytes = saved_bytes(mode, x)
    probe = [step(modes["whole"], x, link) for _ in range(5)]
    total_bytes = probe[0]["bytes"]
    link_s = args.comm_ratio * median(probe, "backward")
    settings = {"instant": float("inf"), "slow": total_bytes / link_s}
    for key, bandwidth in settings.items():
        link.bandwidth = bandwidth
        for mode in modes.values():
            mode.samples[key] = []
        for _ in range(args.steps):
            for name in LINK_MODES:
                modes[name].samples[key].append(step(modes[name], x, link))
    rows = {}
    for name, mode in modes.items():
        row: dict[str, Any] = {"saved_mib": mode.saved_bytes / 2**20}
        if name in LINK_MODES:
            instant, slow = median(mode.samples["instant"], "step"), median(mode.samples["slow"], "step")
            row.update(
                step_instant_ms=1e3 * instant,
                step_slow_ms=1e3 * slow,
                exposed_ms=1e3 * (slow - instant),
                early=median(mode.samples["slow"], "early"),
                buckets=mode.samples["slow"][0]["buckets"],
            )
        if isinstance(mode.backend, DDPSplitBackend) and mode.backend.records:
            plan = mode.backend.records[-1].plan
            row["pieces"] = len(plan.pieces)
            row["plan"] = plan.summary()
        rows[name] = row
    whole, split = rows["whole"], rows["split"]
    ratios = {
        "step_slow_split_over_whole": split["step_slow_ms"] / whole["step_slow_ms"],
        "exposed_split_over_whole": split["exposed_ms"] / whole["exposed_ms"] if whole["exposed_ms"] > 0 else None,
        "saved_split_over_whole": split["saved_mib"] / whole["saved_mib"],
        "saved_no_checkpoint_over_whole": rows["no_checkpoint"]["saved_mib"] / whole["saved_mib"],
    }
    return {"inner": inner, "link_gbps": settings["slow"] / 1e9, "link_s": link_s, "rows": rows, "ratios": ratios}


def table(run: dict[str, Any]) -> str:
    lines = [f"inner={run['inner']}, link {run['link_gbps']:.3g} GB/s (sending all buckets takes "
             f"{1e3 * run['link_s']:.1f} ms, = whole's backward)",
             f"{'mode':>14} {'pieces':>6} {'step instant':>12} {'step slow':>10} {'exposed':>8} "
             f"{'sent early':>10} {'saved MiB':>9}"]
    for name, r in run["rows"].items():
        if "step_slow_ms" in r:
            lines.append(f"{name:>14} {r.get('pieces', '-')!s:>6} {r['step_instant_ms']:>10.1f}ms "
                         f"{r['step_slow_ms']:>8.1f}ms {r['exposed_ms']:>6.1f}ms "
                         f"{r['early']:>4g} of {r['buckets']:<3} {r['saved_mib']:>9.2f}")
        else:
            lines.append(f"{name:>14} {'-':>6} {'-':>12} {'-':>10} {'-':>8} {'-':>10} {r['saved_mib']:>9.2f}")
    lines.append("ratios: " + ", ".join(f"{k} {v:.3f}" if v is not None else f"{k} -" for k, v in run["ratios"].items()))
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inner", nargs="+", default=["aot_eager", "inductor"])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--cap-mb", type=float, default=4.0, help="DDP bucket cap: one 1024-wide layer per bucket")
    p.add_argument("--comm-ratio", type=float, default=1.0, help="sending all buckets takes this x whole's backward")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="aot_eager, 5 steps")
    p.add_argument("--out", type=Path, default=HERE / "results" / "checkpoint_overlap.json")
    args = p.parse_args(argv)
    if args.quick:
        args.inner, args.steps, args.warmup = ["aot_eager"], 5, 1
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*DDPOptimizer.*")
    torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    link = Link()
    result: dict[str, Any] = {"environment": environment(), "config": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "runs": []}
    try:
        for inner in args.inner:
            run = run_inner(inner, args, link)
            print("\n" + table(run), flush=True)
            result["runs"].append(run)
    finally:
        link.close()
        torch._dynamo.reset()
        dist.destroy_process_group()
    result["environment"]["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
