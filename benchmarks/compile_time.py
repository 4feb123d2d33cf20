#!/usr/bin/env python
"""First-call latency (compile + forward + backward) of a deep model under three DDP modes.

Model: 48 residual blocks ``x + GELU(LayerNorm(Linear(512, 512)(x)))`` (one block holds
1,054,720 B of parameters), DDP ``bucket_cap_mb=1`` so that every block is its own bucket:
48 pieces for torch's DDPOptimizer and for ddp_split.

Modes (inner backend inductor for all):

* ``no_split``       DDP(torch.compile(model)), optimize_ddp=False: one graph
* ``ddp_optimizer``  DDP(torch.compile(model)), optimize_ddp=True: torch's DDPOptimizer
* ``ddp_split``      DDP(torch.compile(model, backend=DDPSplitBackend(...))) under own_split()

Each measurement runs in a fresh subprocess with its own empty TORCHINDUCTOR_CACHE_DIR and
inductor's FX-graph and AOTAutograd caches off. Before the measured model, the subprocess
compiles a tiny unrelated function (forward + backward) so that one-time costs (imports,
inductor's compile worker pool, C++ toolchain probing) are not charged to the first mode.
Modes are interleaved (A B C A B C ...) when ``--repeats`` > 1.

Example::

    .venv/bin/python benchmarks/compile_time.py              # 3 modes x 2 repeats (~8 min)
    .venv/bin/python benchmarks/compile_time.py --quick      # 8 blocks, aot_eager, 1 repeat
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_split_backend
from _common import environment
from ddp_split_backend import DDPSplitBackend, SplitConfig

HERE = Path(__file__).resolve().parent
MODES = ("no_split", "ddp_optimizer", "ddp_split")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--blocks", type=int, default=None, help="residual blocks (default 48; --quick: 8)")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument("--inner", default=None, help="inner backend (default inductor; --quick: aot_eager)")
    p.add_argument("--repeats", type=int, default=None, help="runs per mode (default 2; --quick: 1)")
    p.add_argument("--timeout", type=float, default=400.0, help="seconds per subprocess")
    p.add_argument("--no-reuse", action="store_true",
                   help="ddp_split compiles every piece, also identical ones (reuse_identical_pieces=False)")
    p.add_argument("--quick", action="store_true", help="short smoke run")
    p.add_argument("--out", type=Path, default=HERE / "results" / "compile_time.json")
    p.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.blocks = args.blocks or (8 if args.quick else 48)
    args.inner = args.inner or ("aot_eager" if args.quick else "inductor")
    args.repeats = args.repeats or (1 if args.quick else 2)
    return args


# --------------------------------------------------------------------------------------------
# Model and instrumented backends
# --------------------------------------------------------------------------------------------


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.gelu(self.norm(self.linear(x)))


class ResidualStack(nn.Module):
    def __init__(self, blocks: int, width: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Counting:
    """The registered inner backend, counting graphs and the time spent compiling them."""

    def __init__(self, name: str) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        self.fn = lookup_backend(name)
        self.calls = 0
        self.seconds = 0.0
        self.__name__ = name

    def __call__(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        self.calls += 1
        t0 = time.perf_counter()
        try:
            return self.fn(gm, example_inputs, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


class TimedSplit(DDPSplitBackend):
    """ddp_split, timing its whole backend call (plan + split + piece compiles)."""

    seconds = 0.0

    def __call__(self, gm: Any, example_inputs: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return super().__call__(gm, example_inputs, **kwargs)
        finally:
            self.seconds += time.perf_counter() - t0


# --------------------------------------------------------------------------------------------
# Worker (runs in its own subprocess)
# --------------------------------------------------------------------------------------------


def _worker(args: argparse.Namespace) -> dict[str, Any]:
    torch._inductor.config.fx_graph_cache = False
    if hasattr(torch._functorch.config, "enable_autograd_cache"):
        torch._functorch.config.enable_autograd_cache = False
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.reset()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    # Warm-up: a tiny unrelated compile (forward + backward) pays one-time costs.
    t0 = time.perf_counter()
    warm = torch.compile(_warmup_fn, backend=args.inner)
    w = torch.randn(16, 16, requires_grad=True)
    warm(w).sum().backward()
    warmup_s = time.perf_counter() - t0

    torch.manual_seed(0)
    model = ResidualStack(args.blocks, args.width)
    counting = Counting(args.inner)
    split_backend = None
    if args.worker == "ddp_split":
        # A callable inner backend turns piece reuse off by default; ask for what a backend
        # *name* gets (identical blocks compiled once).
        split_backend = TimedSplit(
            SplitConfig(inner=counting, bucket_cap_mb=args.bucket_cap_mb, reuse_identical_pieces=not args.no_reuse,
                        min_piece_mb=None)  # DDPOptimizer's pieces (auto's first call compiles one)
        )
        compiled = torch.compile(model, backend=split_backend)
        context = ddp_split_backend.own_split()
    else:
        compiled = torch.compile(model, backend=counting)
        context = torch._dynamo.config.patch(optimize_ddp=args.worker == "ddp_optimizer")
    ddp = DDP(compiled, bucket_cap_mb=args.bucket_cap_mb)
    x = torch.randn(args.batch, args.width)
    with context:
        c0 = time.process_time()
        t0 = time.perf_counter()
        out = ddp(x)
        t1 = time.perf_counter()
        out.sum().backward()
        t2 = time.perf_counter()
        c2 = time.process_time()
        # second call: steady state, to tell the first call's compiles from its execution
        out = ddp(x)
        t3 = time.perf_counter()
        out.sum().backward()
        t4 = time.perf_counter()
    result = {
        "mode": args.worker,
        "first_call_s": t2 - t0,
        # CPU time of this process only (less sensitive to other load on the machine; excludes
        # inductor's compile worker subprocesses)
        "first_call_cpu_s": c2 - c0,
        "first_forward_s": t1 - t0,
        "first_backward_s": t2 - t1,
        "second_step_s": t4 - t2,
        "second_forward_s": t3 - t2,
        "second_backward_s": t4 - t3,
        "warmup_s": warmup_s,
        "pieces": counting.calls,
        "inner_backend_s": counting.seconds,
    }
    if split_backend is not None:
        result["ddp_split_backend_s"] = split_backend.seconds
        result["plan_pieces"] = sum(len(r.plan.pieces) for r in split_backend.records)
        result["stage_s"] = {
            stage: sum(r.times.seconds[stage] for r in split_backend.records)
            for stage in split_backend.records[-1].times.seconds
        }
    ddp_split_backend.close_ddp(ddp)  # reducers before the group: Note [Teardown deadlock]
    return result


def breakdown(run: dict[str, Any]) -> dict[str, float]:
    """Split one first call into its parts (seconds).

    ``tracing``: the first forward less the backend call and one steady forward: Dynamo's
    work (for ``ddp_optimizer`` this includes DDPOptimizer's own splitting, which cannot be
    timed apart from outside). ``ours``: ddp_split's own stages (plan, split, copy, fake
    runs, reuse keys; ``CompileRecord.times``). ``inner_fw``: the inner backend's forward
    compiles. ``bw_compile``: the first backward less a steady one (AOTAutograd compiles
    the backward graphs on the first backward).
    """
    backend = run.get("ddp_split_backend_s", run["inner_backend_s"])
    stages = run.get("stage_s")
    return {
        "tracing": run["first_forward_s"] - backend - run["second_forward_s"],
        "ours": sum(v for k, v in stages.items() if k != "inner") if stages else 0.0,
        "inner_fw": run["inner_backend_s"],
        "bw_compile": run["first_backward_s"] - run["second_backward_s"],
        "first_call": run["first_call_s"],
    }


def _warmup_fn(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ x.t()).relu() + 1


# --------------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------------


def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"inductor-cache-{mode}-") as cache:
        env = dict(os.environ)
        env.update(
            TORCHINDUCTOR_CACHE_DIR=cache,
            TORCHINDUCTOR_FX_GRAPH_CACHE="0",
            TORCHINDUCTOR_AUTOGRAD_CACHE="0",
            TRITON_CACHE_DIR=os.path.join(cache, "triton"),
        )
        cmd = [
            sys.executable, str(Path(__file__).resolve()), "--worker", mode,
            "--blocks", str(args.blocks), "--width", str(args.width), "--batch", str(args.batch),
            "--bucket-cap-mb", str(args.bucket_cap_mb), "--inner", args.inner,
            *(["--no-reuse"] if args.no_reuse else []),
        ]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    result["process_wall_s"] = wall
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        import warnings

        warnings.filterwarnings("ignore")
        print("RESULT " + json.dumps(_worker(args)), flush=True)
        return 0
    env = environment()
    runs: list[dict[str, Any]] = []
    for repeat in range(args.repeats):
        for mode in args.modes:
            r = run_mode(mode, args)
            r["repeat"] = repeat
            runs.append(r)
            print(f"[{repeat}] {mode:<14} first call {r['first_call_s']:7.2f} s  "
                  f"(fwd {r['first_forward_s']:.2f}, bwd {r['first_backward_s']:.2f}, "
                  f"cpu {r['first_call_cpu_s']:.2f}, inner {r['inner_backend_s']:.2f}, pieces {r['pieces']}, "
                  f"warm-up {r['warmup_s']:.1f} s)", flush=True)
    rows: dict[str, dict[str, Any]] = {}
    for mode in args.modes:
        mine = [r for r in runs if r["mode"] == mode]
        rows[mode] = {
            "first_call_s": statistics.median(r["first_call_s"] for r in mine),
            "first_call_all_s": [r["first_call_s"] for r in mine],
            "first_call_cpu_s": statistics.median(r["first_call_cpu_s"] for r in mine),
            "first_forward_s": statistics.median(r["first_forward_s"] for r in mine),
            "first_backward_s": statistics.median(r["first_backward_s"] for r in mine),
            "inner_backend_s": statistics.median(r["inner_backend_s"] for r in mine),
            "ddp_split_overhead_s": (
                statistics.median(r["ddp_split_backend_s"] - r["inner_backend_s"] for r in mine)
                if mode == "ddp_split" else None
            ),
            "second_step_ms": 1e3 * statistics.median(r["second_step_s"] for r in mine),
            "pieces": mine[0]["pieces"],
            "breakdown_s": {part: statistics.median(breakdown(r)[part] for r in mine) for part in breakdown(mine[0])},
        }
        if mode == "ddp_split":
            rows[mode]["stage_s"] = {k: statistics.median(r["stage_s"][k] for r in mine) for k in mine[0]["stage_s"]}
    print(f"\n{args.blocks} residual blocks x Linear({args.width})+LayerNorm+GELU, batch {args.batch}, "
          f"cap {args.bucket_cap_mb:g} MB, inner {args.inner}, median of {args.repeats}")
    print(f"{'mode':<15}{'first call s':>13}{'all runs':>20}{'cpu s':>8}{'fwd s':>8}{'bwd s':>8}"
          f"{'inner s':>9}{'split ovh s':>12}{'pieces':>8}{'2nd step ms':>12}")
    for mode, r in rows.items():
        allruns = ", ".join(f"{v:.1f}" for v in r["first_call_all_s"])
        ovh = "-" if r["ddp_split_overhead_s"] is None else f"{r['ddp_split_overhead_s']:.2f}"
        print(f"{mode:<15}{r['first_call_s']:>13.2f}{allruns:>20}{r['first_call_cpu_s']:>8.2f}"
              f"{r['first_forward_s']:>8.2f}"
              f"{r['first_backward_s']:>8.2f}{r['inner_backend_s']:>9.2f}{ovh:>12}{r['pieces']:>8}"
              f"{r['second_step_ms']:>12.1f}")
    print(f"\nwhere the first call goes (s, median):\n{'mode':<15}{'tracing':>9}{'ddp_split':>11}"
          f"{'inner fw':>10}{'bw compile':>12}{'first call':>12}")
    for mode, r in rows.items():
        b = r["breakdown_s"]
        ours = f"{b['ours']:.3f}" if mode == "ddp_split" else "-"
        print(f"{mode:<15}{b['tracing']:>9.2f}{ours:>11}{b['inner_fw']:>10.2f}{b['bw_compile']:>12.2f}"
              f"{b['first_call']:>12.2f}")
    floor = None
    if "ddp_split" in rows and "no_split" in rows:
        split = rows["ddp_split"]["breakdown_s"]
        floor = rows["no_split"]["breakdown_s"]["tracing"] + split["inner_fw"] + split["bw_compile"]
        stages = ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in rows["ddp_split"]["stage_s"].items())
        print(f"floor (one-graph tracing + ddp_split's distinct inner compiles) {floor:.2f} s; ddp_split "
              f"{split['first_call']:.2f} s = {split['first_call'] / floor:.3f} x floor; "
              f"ddp_split's own {split['ours']:.3f} s = {split['ours'] / split['first_call']:.2%} of its first call "
              f"({stages})")
    ratio = cpu_ratio = None
    if "ddp_split" in rows and "ddp_optimizer" in rows:
        ratio = rows["ddp_split"]["first_call_s"] / rows["ddp_optimizer"]["first_call_s"]
        cpu_ratio = rows["ddp_split"]["first_call_cpu_s"] / rows["ddp_optimizer"]["first_call_cpu_s"]
        per_repeat = [
            a["first_call_s"] / b["first_call_s"]
            for a, b in zip([r for r in runs if r["mode"] == "ddp_split"],
                            [r for r in runs if r["mode"] == "ddp_optimizer"])
        ]
        print(f"ddp_split / DDPOptimizer first-call ratio: {ratio:.3f} wall (per repeat: "
              f"{', '.join(f'{v:.3f}' for v in per_repeat)}), {cpu_ratio:.3f} CPU "
              f"(pieces {rows['ddp_split']['pieces']} vs {rows['ddp_optimizer']['pieces']})")
    env["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"environment": env, "config": config, "rows": rows, "floor_s": floor,
                                    "ratio_ddp_split_over_ddp_optimizer": ratio,
                                    "cpu_ratio_ddp_split_over_ddp_optimizer": cpu_ratio, "runs": runs}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
