#!/usr/bin/env python
"""Where one training step of the overhead-dominated model goes, mode by mode (py-spy).

Each mode runs in its own subprocess under ``py-spy record --native`` on the overhead model of
``step_overhead.py`` (32 x Linear(512) + GELU, batch 2, 32 buckets, instant comm hook, one
thread). Only samples taken inside the measured steps count (warm-up and compiles are left out).
Each sample is charged to one layer, by its innermost Python frame and the native frames under it:

* ``kernels``: native compute (aten, MKL/oneDNN, inductor's C++ kernels) and the Python that
  issues it (the module's forward in eager, an FX graph's code);
* ``inductor_py``: inductor's generated wrapper around its kernels (``Runner.call`` in the
  output-code module), once per compiled graph per call: its size asserts, buffer
  allocations and the dispatch of extern kernels (not the compute under them);
* ``ddp_split``: this package's runtime (piece loop, slots, state guards);
* ``aot_autograd``: the inner backend's per-call wrappers (runtime wrapper, autograd Function,
  forward and backward);
* ``ddp_cpp``: DDP's reducer in C++ (autograd hooks, copies into and out of buckets);
* ``ddp_python``: DDP's Python forward (``DistributedDataParallel.forward`` and its helpers);
* ``autograd``: the autograd engine and graph nodes, outside kernels and DDP;
* ``dynamo``: the Dynamo frame and its guards;
* ``other``: the rest (the step loop, allocator, Python runtime).

Example::

    .venv/bin/python benchmarks/profile_step.py                     # 4 modes x 2 inners (~4 min)
    .venv/bin/python benchmarks/profile_step.py --inner aot_eager --modes eager_ddp ddp_split_x1
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
LAYERS = ("kernels", "inductor_py", "ddp_split", "aot_autograd", "ddp_cpp", "ddp_python", "autograd", "dynamo", "other")
MARKER = "measured_steps"
KERNEL_MARKS = ("at::native::", "at::vec::", "mkl", "dnnl", "gemm", "sleef", "cpp_fused", "vectorized_loop")
PYTHON_LAYERS = (  # (file fragment, layer), first match wins
    ("ddp_split_backend/", "ddp_split"),
    ("torch/_functorch/", "aot_autograd"),
    ("torch/nn/parallel/distributed.py", "ddp_python"),
    ("torch/_dynamo/", "dynamo"),
    ("<eval_with_key>", "kernels"),  # an FX graph's generated forward
    ("torch/nn/modules/", "kernels"),
    ("torch/nn/functional.py", "kernels"),
    ("torch/autograd/", "autograd"),
    ("torch/_tensor.py", "autograd"),
)


def measured_steps(mode, x: torch.Tensor, steps: int) -> None:  # noqa: ANN001 (a step_overhead.Mode)
    from step_overhead import step

    for _ in range(steps):
        step(mode, x)


def worker(mode_name: str, inner: str, steps: int, result: str) -> None:
    from step_overhead import OVERHEAD, _instant_hook, build, process_group, step, threads_of

    with process_group(), threads_of(OVERHEAD):
        mode = build(OVERHEAD, mode_name, inner, _instant_hook, None)
        x = torch.randn(OVERHEAD.batch, OVERHEAD.width)
        for _ in range(10):
            step(mode, x)
        measured_steps(mode, x, steps)
        Path(result).write_text(json.dumps({"pieces": mode.pieces()}))


INDUCTOR_CODE = re.compile(r"\(c[a-z0-9]{40,}\.py:\d+\)")
"""A frame of inductor's output code: py-spy names the module file by its hashed name only."""


def _is_python(frame: str) -> bool:
    return ".py:" in frame or "<eval_with_key>" in frame


def layer_of(frames: list[str]) -> str:
    """The layer one sample (frames root first) is charged to."""
    innermost = max((i for i, f in enumerate(frames) if _is_python(f)), default=-1)
    native = frames[innermost + 1:]
    if any("c10d::" in f or "Reducer" in f for f in native):
        return "ddp_cpp"
    if any(any(mark in f for mark in KERNEL_MARKS) for f in native):
        return "kernels"
    for frame in reversed(frames[: innermost + 1]):
        if INDUCTOR_CODE.search(frame):
            return "inductor_py"
        for fragment, layer in PYTHON_LAYERS:
            if fragment in frame:
                return layer
    return "other"


def breakdown(raw: str) -> Counter[str]:
    """Samples per layer in py-spy's raw (collapsed) output, only those inside the measured steps."""
    counts: Counter[str] = Counter()
    for line in raw.splitlines():
        stack, _, n = line.rpartition(" ")
        frames = stack.split(";")
        start = next((i for i, f in enumerate(frames) if f.startswith(f"{MARKER} ")), None)
        if start is not None:
            counts[layer_of(frames[start + 1:])] += int(n)
    return counts


def profile(mode: str, inner: str, steps: int, rate: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "stacks.txt"
        cmd = [str(Path(sys.executable).with_name("py-spy")), "record", "--native", "--format", "raw",
               "--rate", str(rate), "-o", str(out), "--", sys.executable, __file__,
               "--worker", mode, "--inner", inner, "--steps", str(steps), "--result", str(Path(tmp) / "w.json")]
        subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=True)
        pieces = json.loads((Path(tmp) / "w.json").read_text())["pieces"]
        counts = breakdown(out.read_text())
    total = sum(counts.values())
    per_step_us = {layer: 1e6 * counts[layer] / rate / steps for layer in LAYERS}
    return {"mode": mode, "inner": inner, "pieces": pieces, "samples": total,
            "step_us": sum(per_step_us.values()), "us_per_step": per_step_us,
            "share": {layer: counts[layer] / total for layer in LAYERS}}


def print_table(rows: list[dict]) -> None:
    print(f"\n{'inner':10s} {'mode':14s} {'pieces':>6s} {'step us':>8s} " + " ".join(f"{l:>12s}" for l in LAYERS))
    for r in rows:
        cells = " ".join(f"{r['us_per_step'][l]:7.0f} {100 * r['share'][l]:3.0f}%" for l in LAYERS)
        print(f"{r['inner']:10s} {r['mode']:14s} {r['pieces'] or '-':>6} {r['step_us']:8.0f} {cells}")
    print("(each layer: microseconds per step from samples, and its share of the step)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inner", nargs="+", default=["aot_eager", "inductor"])
    p.add_argument("--modes", nargs="+", default=["eager_ddp", "one_graph", "ddp_optimizer", "ddp_split_x1"])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    p.add_argument("--out", type=Path, default=HERE / "results" / "profile_step.json")
    p.add_argument("--worker", metavar="MODE", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.inner[0], args.steps, args.result)
    from _common import environment

    rows = []
    for inner in args.inner:
        for mode in args.modes:
            if mode == "eager_ddp" and any(r["mode"] == "eager_ddp" for r in rows):
                continue  # eager does not depend on the inner backend
            rows.append(profile(mode, inner, args.steps, args.rate))
            print(f"{inner} {mode}: {rows[-1]['step_us']:.0f} us/step sampled", flush=True)
    print_table(rows)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"environment": environment(), "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
