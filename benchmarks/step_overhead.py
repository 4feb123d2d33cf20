#!/usr/bin/env python
"""Step time of ddp_split against eager DDP and DDPOptimizer, and pieces against buckets.

Two parts, each stepping every mode round-robin in one process (ratios within one run):

* ``overhead``: an overhead-dominated model, 32 x Linear(512) + GELU at batch 2, bucket cap
  1 MiB (32 buckets), a comm hook that completes at once, one thread. Per-step costs of
  pieces (autograd nodes, the inner backend's wrappers) show here, communication does not.
  Modes: eager DDP, one compiled graph (``optimize_ddp=False``, no split), DDPOptimizer, and
  ddp_split with 1, 2, 4, 8 and 32 buckets per piece (``min_piece_mb``), and with
  ``min_piece_mb="auto"`` told the link is instant (``ddp_split_auto_link@inf``,
  ``link_gbps=inf``); and torch's compiled autograd with
  ``optimize_ddp="python_reducer"`` (``compiled_autograd``: backward traced whole, DDP's
  reducer in Python, the comm hook still called per bucket).
* ``tradeoff``: 16 x Linear(1024) + GELU at batch 64, cap 4 MiB (16 buckets), and then the
  overhead model, with gradients sent over the simulated link of ``overlap.py`` at speeds set
  from the backward time measured at the start of the run (communication = 0.5 x and 2 x
  backward) and at 1 GB/s. The link is ``overlap.ScheduledLink`` (a schedule, no thread: the
  step ends when backward and the last send have); ``--thread-link`` uses ``overlap.Link``'s
  thread, as grid runs 1-5 did, whose GIL use slows the backward it overlaps. ddp_split with
  1, 2, 4, 8 and 16 (32) buckets per piece, and
  ``min_piece_mb="auto"`` given the cell's own link speed as ``link_gbps``
  (``ddp_split_auto_link@<GB/s>``, built for each speed), against DDPOptimizer and eager DDP.

Examples::

    .venv/bin/python benchmarks/step_overhead.py                 # both parts, both inners (~6 min)
    .venv/bin/python benchmarks/step_overhead.py --part overhead --inner aot_eager --rounds 20
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_split_backend
from _common import environment, free_port, own_code
from ddp_split_backend import DDPSplitBackend, SplitConfig
from overlap import HookState, Link, ScheduledLink, link_hook

HERE = Path(__file__).resolve().parent
MIB = 2**20


@dataclass(frozen=True)
class Workload:
    name: str
    depth: int
    width: int
    batch: int
    cap_mb: float
    groups: tuple[int, ...]
    """Buckets per piece to measure ddp_split with (1 = the default, one piece per bucket)."""
    threads: int | None = None
    """torch.set_num_threads while it runs (None: torch's default)."""


OVERHEAD = Workload("overhead", depth=32, width=512, batch=2, cap_mb=1.0, groups=(1, 2, 4, 8, 32), threads=1)
TRADEOFF = Workload("tradeoff", depth=16, width=1024, batch=64, cap_mb=4.0, groups=(1, 2, 4, 8, 16))


class _Stack(nn.Module):
    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))


def _forward(self: _Stack, x: torch.Tensor) -> torch.Tensor:
    for layer in self.layers:
        x = F.gelu(layer(x))
    return x


def _instant_hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


@dataclass
class Mode:
    name: str
    model: nn.Module
    params: list[nn.Parameter]
    context: Callable[[], contextlib.AbstractContextManager[Any]]
    backend: DDPSplitBackend | None = None
    samples: list[float] = field(default_factory=list)

    def pieces(self) -> int | None:
        if self.backend is None or not self.backend.records:
            return None
        return len(self.backend.records[-1].plan.pieces)

    def sizing(self) -> str | None:
        """What ``min_piece_mb="auto"`` predicted, for its last plan."""
        if self.backend is None or not self.backend.records or self.backend.records[-1].plan.sizing is None:
            return None
        return self.backend.records[-1].plan.sizing.describe()


def _patch_optimize_ddp(value: bool) -> Callable[[], contextlib.AbstractContextManager[Any]]:
    return lambda: torch._dynamo.config.patch(optimize_ddp=value)


def _min_piece_mb(work: Workload, group: int) -> float | None:
    """Groups of ``group`` buckets: every bucket holds one layer, a little over cap_mb."""
    return None if group == 1 else group * work.cap_mb


def mode_names(work: Workload, compiled: bool) -> list[str]:
    names = ["eager_ddp"]
    if compiled:
        names += ["one_graph", "ddp_optimizer", "compiled_autograd", *(f"ddp_split_x{g}" for g in work.groups)]
    return names


_BUILDS = itertools.count()
AUTO_LINK = "ddp_split_auto_link"
"""``min_piece_mb="auto"`` told the link's speed: ``ddp_split_auto_link@<GB/s>`` (``inf``: instant)."""


def _auto_options(name: str) -> dict[str, Any]:
    return {"min_piece_mb": "auto", "link_gbps": float(name.split("@")[1])}


def build(work: Workload, name: str, inner: str, hook: Callable[..., Any], state: Any) -> Mode:
    torch.manual_seed(0)
    # A code object of its own per build: Dynamo's cache would otherwise see a rebuilt mode
    # (``auto`` is rebuilt for every link) as a recompile and make its shapes dynamic.
    tag = f"{name}_{inner}_{next(_BUILDS)}".replace("@", "_at_").replace(".", "_")
    cls = type(f"Stack_{tag}", (_Stack,), {"forward": own_code(_forward, tag)})
    module = cls(work.depth, work.width)
    params = list(module.parameters())
    backend = None
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    target: nn.Module = module
    if name == "one_graph":
        target, context = torch.compile(module, backend=inner), _patch_optimize_ddp(False)
    elif name == "ddp_optimizer":
        target, context = torch.compile(module, backend=inner), _patch_optimize_ddp(True)
    elif name.startswith("ddp_split_x"):
        group = int(name.removeprefix("ddp_split_x"))
        backend = DDPSplitBackend(SplitConfig(inner=inner, min_piece_mb=_min_piece_mb(work, group)))
        target, context = torch.compile(module, backend=backend), ddp_split_backend.own_split
    elif name.startswith("ddp_split_auto"):
        backend = DDPSplitBackend(SplitConfig(inner=inner, **_auto_options(name)))
        target, context = torch.compile(module, backend=backend), ddp_split_backend.own_split
    ddp = DDP(target, bucket_cap_mb=work.cap_mb)
    ddp.register_comm_hook(state, hook)
    if name == "compiled_autograd":  # torch's alternative: the whole step traced, DDP's reducer in Python
        return Mode(name, torch.compile(ddp, backend=inner), params, _compiled_autograd, backend)
    return Mode(name, ddp, params, context, backend)


def _compiled_autograd() -> contextlib.AbstractContextManager[Any]:
    return torch._dynamo.config.patch(optimize_ddp="python_reducer", compiled_autograd=True)


def _nothing() -> None:
    pass


def step(mode: Mode, x: torch.Tensor, settle: Callable[[], None] = _nothing) -> float:
    """One timed forward and backward; ``settle`` waits for the link after backward."""
    for p in mode.params:
        p.grad = None
    with mode.context():
        start = time.perf_counter()
        mode.model(x).sum().backward()
        settle()
        return time.perf_counter() - start


def round_robin(
    modes: list[Mode], x: torch.Tensor, warmup: int, rounds: int, reset: Callable[[], None],
    settle: Callable[[], None] = _nothing,
) -> None:
    for mode in modes:
        mode.samples = []
        for _ in range(warmup):
            reset()
            step(mode, x, settle)
    for _ in range(rounds):
        for mode in modes:
            reset()
            mode.samples.append(step(mode, x, settle))


def summarize(modes: list[Mode]) -> dict[str, dict[str, Any]]:
    medians = {m.name: statistics.median(m.samples) for m in modes}
    eager = medians["eager_ddp"]
    ddpo = medians.get("ddp_optimizer")
    return {
        m.name: {
            "step_ms": 1e3 * medians[m.name],
            "vs_eager_ddp": medians[m.name] / eager,
            "vs_ddp_optimizer": medians[m.name] / ddpo if ddpo else None,
            "pieces": m.pieces(),
            "min_ms": 1e3 * min(m.samples),
            "sizing": m.sizing(),
        }
        for m in modes
    }


def backward_seconds(work: Workload, x: torch.Tensor, reps: int = 10) -> float:
    """Eager backward time of the model alone (no DDP), to set the link speeds."""
    torch.manual_seed(0)
    module = _Stack(work.depth, work.width)
    module.forward = _forward.__get__(module)  # type: ignore[method-assign]
    times = []
    for _ in range(reps + 2):
        out = module(x).sum()
        start = time.perf_counter()
        out.backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[2:])


@contextlib.contextmanager
def threads_of(work: Workload) -> Iterator[None]:
    before = torch.get_num_threads()
    if work.threads is not None:
        torch.set_num_threads(work.threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_overhead(inner: str, args: argparse.Namespace) -> dict[str, Any]:
    work = OVERHEAD
    with threads_of(work):
        names = [*mode_names(work, compiled=True), f"{AUTO_LINK}@inf"]
        modes = [build(work, n, inner, _instant_hook, None) for n in names]
        x = torch.randn(work.batch, work.width)
        round_robin(modes, x, args.warmup, args.rounds, lambda: None)
        return {"workload": work.__dict__, "inner": inner, "threads": torch.get_num_threads(),
                "rows": summarize(modes)}


def run_tradeoff(work: Workload, inner: str, args: argparse.Namespace) -> dict[str, Any]:
    with threads_of(work):
        x = torch.randn(work.batch, work.width)
        backward = backward_seconds(work, x)
        grad_bytes = work.depth * (work.width + 1) * work.width * 4
        link = Link() if args.thread_link else ScheduledLink()

        def built(name: str) -> Mode:
            return build(work, name, inner, link_hook, HookState(link, name, {}, record_params=False))

        try:
            # Modes whose plan does not depend on the link are built once; ``auto`` is told
            # each cell's link speed, so it is built again for every speed.
            fixed = [built(name) for name in mode_names(work, compiled=True)]
            speeds = {"instant": math.inf}
            speeds.update({f"comm {r} x backward": grad_bytes / (r * backward) for r in args.comm_ratios})
            speeds["1 GB/s"] = 1e9
            results = {}
            for label, bandwidth in speeds.items():
                link.bandwidth = bandwidth
                told = f"{AUTO_LINK}@{bandwidth / 1e9:.6g}"  # auto, told this link's speed
                here = [*fixed, built(told)]
                round_robin(here, x, args.warmup, args.rounds, link.reset, link.settle)
                rows = summarize(here)
                results[label] = {"bandwidth": bandwidth, "comm_ms": 1e3 * grad_bytes / bandwidth, "rows": rows}
        finally:
            link.close()
        return {
            "workload": work.__dict__,
            "inner": inner,
            "threads": torch.get_num_threads(),
            "link": type(link).__name__,
            "backward_ms": 1e3 * backward,
            "grad_bytes": grad_bytes,
            "speeds": results,
        }


@contextlib.contextmanager
def process_group() -> Iterator[None]:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        torch._dynamo.reset()
        dist.destroy_process_group()


def print_overhead(result: dict[str, Any]) -> None:
    print(f"\noverhead model, inner={result['inner']}, 1 thread")
    print(f"{'mode':28s} {'pieces':>6s} {'step ms':>8s} {'x eager':>8s} {'x DDPOpt':>8s}")
    for name, row in result["rows"].items():
        vs = row["vs_ddp_optimizer"]
        print(f"{name:28s} {row['pieces'] or '-':>6} {row['step_ms']:8.2f} {row['vs_eager_ddp']:8.3f} "
              f"{vs if vs is None else format(vs, '.3f'):>8}")


def print_tradeoff(result: dict[str, Any]) -> None:
    print(f"\n{result['workload']['name']} model over a link, inner={result['inner']}, "
          f"{result['threads']} thread(s), backward {result['backward_ms']:.1f} ms")
    for label, speed in result["speeds"].items():
        print(f"  {label} (comm {speed['comm_ms']:.1f} ms)")
        for name, row in speed["rows"].items():
            print(f"    {name:28s} pieces {row['pieces'] or '-':>3}  {row['step_ms']:8.2f} ms  "
                  f"x DDPOpt {row['vs_ddp_optimizer']:.3f}")


def _cell(row: dict[str, Any]) -> str:
    pieces = f" ({row['pieces']})" if row.get("pieces") else ""
    return f"{row['step_ms']:.2f}{pieces}"


def grid(record: dict[str, Any]) -> str:
    """The tradeoff part as one markdown table: step ms per mode (pieces in brackets), the
    best fixed grouping, and ``auto`` against it and against one piece per bucket."""
    head = ("model", "inner", "link", "eager DDP", "one graph", "DDPOptimizer", "compiled autograd",
            "x1 (per bucket)", "best fixed", "auto (told the link)", "auto / best", "auto / x1")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for result in record["tradeoff"]:
        for label, speed in result["speeds"].items():
            rows = speed["rows"]
            fixed = {n: r for n, r in rows.items() if n.startswith("ddp_split_x")}
            best_name = min(fixed, key=lambda n: fixed[n]["step_ms"])
            auto = next(r for n, r in rows.items() if n.startswith(AUTO_LINK))
            cells = [
                result["workload"]["name"], result["inner"], label,
                *(_cell(rows[n]) if n in rows else "-" for n in ("eager_ddp", "one_graph", "ddp_optimizer", "compiled_autograd", "ddp_split_x1")),
                f"{best_name.removeprefix('ddp_split_')}: {_cell(fixed[best_name])}",
                _cell(auto),
                f"{auto['step_ms'] / fixed[best_name]['step_ms']:.3f}",
                f"{auto['step_ms'] / rows['ddp_split_x1']['step_ms']:.3f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def picture(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), squeeze=False)
    for ax, result in zip(axes[0], results):
        series = (
            {"instant comm": {"rows": result["rows"]}} if "rows" in result else result["speeds"]
        )
        for label, speed in series.items():
            rows = speed["rows"]
            groups = [int(n.removeprefix("ddp_split_x")) for n in rows if n.startswith("ddp_split_x")]
            ratios = [rows[f"ddp_split_x{g}"]["vs_ddp_optimizer"] for g in groups]
            ax.plot(groups, ratios, marker="o", label=label)
        ax.axhline(1.0, color="grey", linestyle="--", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("buckets per piece (min_piece_mb)")
        ax.set_ylabel("step time / DDPOptimizer's")
        comm = "instant comm" if "rows" in result else "simulated link"
        ax.set_title(f"{result['workload']['name']} model, {comm}, {result['inner']}", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("overhead", "tradeoff", "all"), default="all")
    p.add_argument("--inner", nargs="+", default=["aot_eager", "inductor"])
    p.add_argument("--comm-ratios", nargs="+", type=float, default=[0.5, 2.0])
    p.add_argument("--warmup", type=int, default=5, help="steps per mode before timing (compiles, DDP's bucket rebuild)")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--thread-link", action="store_true",
                   help="send over overlap.Link's thread (grid runs 1-5) instead of overlap.ScheduledLink")
    p.add_argument("--out", type=Path, default=HERE / "results" / "step_overhead.json")
    p.add_argument("--picture", type=Path, default=HERE / "pieces_tradeoff.png")
    args = p.parse_args()
    record: dict[str, Any] = {"environment": environment(), "overhead": [], "tradeoff": []}
    with process_group():
        for inner in args.inner:
            if args.part in ("overhead", "all"):
                record["overhead"].append(run_overhead(inner, args))
                print_overhead(record["overhead"][-1])
            if args.part in ("tradeoff", "all"):
                for work in (TRADEOFF, OVERHEAD):
                    record["tradeoff"].append(run_tradeoff(work, inner, args))
                    print_tradeoff(record["tradeoff"][-1])
                    torch._dynamo.reset()
            torch._dynamo.reset()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    if record["tradeoff"]:
        table = grid(record)
        args.out.with_suffix(".md").write_text(table + "\n")
        print("\n" + table)
    picture([r for r in record["overhead"] + record["tradeoff"] if r["inner"] == args.inner[-1]], args.picture)
    print(f"\nwrote {args.out} and {args.picture}")


if __name__ == "__main__":
    main()
