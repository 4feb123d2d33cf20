#!/usr/bin/env python
"""Where the split's cost goes on a compute-heavy model: torch.profiler, op by op, mode by mode.

The compute-heavy model of issue 26: 16 x (Linear(1024) + GELU), batch 64, DDP cap 1 MiB
(16 buckets, so ddp_split makes 16 pieces), a comm hook that completes at once, inductor,
one thread. Modes step round-robin in one process (median step times, ratios within the
run); then each mode is profiled for ``--profiled`` steps with ``torch.profiler`` (CPU), and
every op's *self* time is charged to one layer:

* ``matmul``: ``aten::mm``, ``addmm``, ``bmm`` (the compute of this model);
* ``inductor_code``: inductor's compiled graphs (``## Call CompiledFxGraph``: their fused C++
  kernels and wrapper code, not the extern matmuls they call);
* ``copies``: ``aten::copy_`` and friends (DDP's bucket copies, layout changes);
* ``aten_other``: every other aten op;
* ``aot_runtime``: AOTAutograd's per-call wrappers (``CompiledFunction``,
  ``CompiledFunctionBackward``, ``AOTDispatcher ...``);
* ``autograd``: the autograd engine's node evaluation and gradient accumulation;
* ``ddp``: DDP's forward and reducer;
* ``compiled_region``: the Dynamo frame and what runs inside it outside the above (for
  ddp_split: its runtime loop over pieces);
* ``other``; and ``unattributed``: the profiled step's wall time not inside any recorded op
  (Python between ops: the step loop, wrappers' code outside their records).

A split that costs only its fixed per-piece price shows the same ``matmul``,
``inductor_code`` and ``copies`` as one compiled graph, and its extra time in
``aot_runtime``, ``autograd``, ``compiled_region`` and ``unattributed``.

Example::

    .venv/bin/python benchmarks/profile_ops.py        # about 2 minutes on 2 cores
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _common import environment  # noqa: E402
from step_overhead import Workload, _instant_hook, build, process_group, step, threads_of  # noqa: E402

COMPUTE = Workload("compute", depth=16, width=1024, batch=64, cap_mb=1.0, groups=(1,), threads=1)
LAYERS = ("matmul", "inductor_code", "copies", "aten_other", "aot_runtime", "autograd", "ddp", "compiled_region",
          "other", "unattributed")
RULES = (  # (name fragment, layer), first match wins
    ("aten::mm", "matmul"),
    ("aten::addmm", "matmul"),
    ("aten::bmm", "matmul"),
    ("CompiledFxGraph", "inductor_code"),
    ("aten::copy_", "copies"),
    ("aten::clone", "copies"),
    ("aten::contiguous", "copies"),
    ("CompiledFunction", "aot_runtime"),
    ("AOTDispatcher", "aot_runtime"),
    ("AccumulateGrad", "autograd"),
    ("autograd::engine", "autograd"),
    ("reducer", "ddp"),
    ("DistributedDataParallel", "ddp"),
    ("Torch-Compiled Region", "compiled_region"),
    ("TorchDynamo", "compiled_region"),
    ("aten::", "aten_other"),
)


def layer_of(name: str) -> str:
    return next((layer for fragment, layer in RULES if fragment in name), "other")


def profile_mode(mode, x: torch.Tensor, steps: int) -> dict[str, float]:  # noqa: ANN001 (a step_overhead.Mode)
    """Self CPU milliseconds per step in each layer."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = sum(step(mode, x) for _ in range(steps))
    per_layer: Counter[str] = Counter()
    for event in prof.key_averages():
        per_layer[layer_of(event.key)] += event.self_cpu_time_total / 1e3 / steps
    per_layer["unattributed"] = 1e3 * wall / steps - sum(per_layer.values())
    return {layer: per_layer[layer] for layer in LAYERS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", nargs="+", default=["eager_ddp", "one_graph", "ddp_split_x1"])
    p.add_argument("--inner", default="inductor")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--profiled", type=int, default=5)
    p.add_argument("--out", type=Path, default=HERE / "results" / "profile_ops.json")
    args = p.parse_args()
    record = {"environment": environment(), "workload": COMPUTE.__dict__, "inner": args.inner, "modes": {}}
    with process_group(), threads_of(COMPUTE):
        x = torch.randn(COMPUTE.batch, COMPUTE.width)
        modes = [build(COMPUTE, name, args.inner, _instant_hook, None) for name in args.modes]
        for mode in modes:
            for _ in range(args.warmup):
                step(mode, x)
        samples: dict[str, list[float]] = {m.name: [] for m in modes}
        for _ in range(args.rounds):
            for mode in modes:
                samples[mode.name].append(step(mode, x))
        for mode in modes:
            record["modes"][mode.name] = {
                "pieces": mode.pieces(),
                "step_ms": 1e3 * statistics.median(samples[mode.name]),
                "self_ms_per_step": profile_mode(mode, x, args.profiled),
            }
    base = record["modes"].get("one_graph")
    print(f"\n{'mode':14s} {'pieces':>6s} {'step ms':>8s} {'x 1 graph':>9s} " + " ".join(f"{l[:13]:>13s}" for l in LAYERS))
    for name, row in record["modes"].items():
        ratio = row["step_ms"] / base["step_ms"] if base else float("nan")
        cells = " ".join(f"{row['self_ms_per_step'][l]:13.2f}" for l in LAYERS)
        print(f"{name:14s} {row['pieces'] or '-':>6} {row['step_ms']:8.2f} {ratio:9.3f} {cells}")
    print("(layers: self CPU ms per profiled step)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
