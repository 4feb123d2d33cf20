#!/usr/bin/env python
"""What measuring and re-planning costs ``min_piece_mb="auto"`` in a run's first steps.

The compute-heavy model of ``step_overhead.py`` (16 x Linear(1024) + GELU at batch 64, cap
4 MiB: 16 buckets, 2 threads) sends its gradients over the simulated link of
``overlap.py`` at a speed where communication takes twice the measured backward. Two modes,
each in a fresh Dynamo cache, step one after the other:

* ``ddp_split_x1``: one piece per bucket, compiled at the first call;
* ``ddp_split_auto``: ``min_piece_mb="auto"``: one piece, an eager step, measured steps,
  then one re-plan (Note [Measuring the link] in ``ddp_split_backend/regroup.py``).

Printed and written to ``results/replan_cost.json``: the wall time of each of the first
steps, each compile record's stage times (the re-plan's recompile included), and the
steady-state step after them.

Example::

    .venv/bin/python benchmarks/replan_cost.py --inner inductor
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import torch

from _common import environment
from ddp_split_backend.regroup import STEPS_BEFORE_REPLAN
from overlap import HookState, Link, link_hook
from step_overhead import TRADEOFF, backward_seconds, build, process_group, step, threads_of

HERE = Path(__file__).resolve().parent


def run_mode(name: str, inner: str, link: Link, x: torch.Tensor, first: int, steady: int) -> dict[str, Any]:
    torch._dynamo.reset()
    mode = build(TRADEOFF, name, inner, link_hook, HookState(link, name, {}, record_params=False))
    times = []
    for _ in range(first + steady):
        link.reset()
        times.append(step(mode, x))
    assert mode.backend is not None
    records = [
        {"graph": r.plan.graph_name, "pieces": len(r.plan.pieces), "seconds": dict(r.times.seconds),
         "total_s": sum(r.times.seconds.values())}
        for r in mode.backend.records
    ]
    return {
        "first_steps_ms": [1e3 * t for t in times[:first]],
        "steady_step_ms": 1e3 * statistics.median(times[first:]),
        "records": records,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inner", default="inductor")
    p.add_argument("--comm-ratio", type=float, default=2.0)
    p.add_argument("--steady", type=int, default=20, help="steps timed after the first ones")
    p.add_argument("--out", type=Path, default=HERE / "results" / "replan_cost.json")
    args = p.parse_args()
    first = STEPS_BEFORE_REPLAN + 2
    result: dict[str, Any] = {"environment": environment(), "inner": args.inner, "modes": {}}
    with process_group(), threads_of(TRADEOFF):
        x = torch.randn(TRADEOFF.batch, TRADEOFF.width)
        backward = backward_seconds(TRADEOFF, x)
        grad_bytes = TRADEOFF.depth * (TRADEOFF.width + 1) * TRADEOFF.width * 4
        link = Link()
        link.bandwidth = grad_bytes / (args.comm_ratio * backward)
        try:
            for name in ("ddp_split_x1", "ddp_split_auto"):
                result["modes"][name] = run_mode(name, args.inner, link, x, first, args.steady)
        finally:
            link.close()
    result.update(backward_ms=1e3 * backward, comm_ratio=args.comm_ratio)
    print(f"inner={args.inner}, backward {1e3 * backward:.1f} ms, communication {args.comm_ratio} x backward")
    for name, row in result["modes"].items():
        steps = " ".join(f"{t:.0f}" for t in row["first_steps_ms"])
        print(f"\n{name}: first {first} steps (ms): {steps}; then {row['steady_step_ms']:.2f} ms per step")
        for r in row["records"]:
            stages = ", ".join(f"{k} {v:.2f}" for k, v in r["seconds"].items() if v >= 0.005)
            print(f"  {r['graph']}: {r['pieces']} pieces, compile {r['total_s']:.2f} s ({stages})")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
