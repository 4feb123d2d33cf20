#!/usr/bin/env python
"""Time to plan a graph of many DDP buckets: the default against ``min_piece_mb="auto"``.

A chain graph of ``buckets`` layers, each ``x * w_k`` then ``tanh`` (``w_k``: a 256-float
parameter placeholder), planned with a bucket cap below one parameter so that every layer is
its own DDP bucket. ``plan_split`` is timed whole (layout, parameter table, bucket walk and,
for ``auto``, the cost estimates and the grouping search), best of ``--repeats``, for

* ``default``: ``min_piece_mb=None``, one piece per bucket (no grouping search runs);
* ``auto``: ``min_piece_mb="auto"`` with ``link_gbps`` given (``--link-gbps``, default 1).

The column ``search`` is the grouping search alone (``plan._best_grouping`` on the plan's
own per-bucket estimates). Issue 38 measured the search it replaces, an exact search over
every grouping, at 1.1 s for 400 buckets and 10 s for 1,070.

Example::

    .venv/bin/python benchmarks/plan_scaling.py                    # 100, 1,000, 10,000 buckets
    .venv/bin/python benchmarks/plan_scaling.py --buckets 100 1000 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn

from _common import environment
from ddp_split_backend import SplitConfig, plan_split
from ddp_split_backend.plan import _best_grouping

HERE = Path(__file__).resolve().parent
PARAM_NUMEL = 256
CAP_MB = PARAM_NUMEL * 4 / 2 / 2**20
"""Half a parameter: every parameter closes its own bucket."""


def chain(buckets: int) -> tuple[fx.GraphModule, list[Any]]:
    """``buckets`` layers ``tanh(x * w_k)``, each weight a graph input."""
    graph = fx.Graph()
    x = graph.placeholder("l_x_")
    weights = [graph.placeholder(f"l_w_{k}_") for k in range(buckets)]
    y = x
    for w in weights:
        y = graph.call_function(torch.tanh, (graph.call_function(torch.mul, (y, w)),))
    graph.output((y,))
    inputs: list[Any] = [torch.randn(PARAM_NUMEL)]
    inputs += [nn.Parameter(torch.randn(PARAM_NUMEL)) for _ in range(buckets)]
    return fx.GraphModule(nn.Module(), graph), inputs


def best_of(repeats: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def measure(buckets: int, args: argparse.Namespace) -> dict[str, Any]:
    gm, inputs = chain(buckets)
    caps = {"bucket_cap_mb": CAP_MB, "first_bucket_cap_mb": CAP_MB}
    default = SplitConfig(**caps)
    auto = SplitConfig(**caps, min_piece_mb="auto", link_gbps=args.link_gbps)
    default_s, plan = best_of(args.repeats, lambda: plan_split(gm, inputs, config=default))
    auto_s, auto_plan = best_of(args.repeats, lambda: plan_split(gm, inputs, config=auto))
    sizing = auto_plan.sizing
    assert sizing is not None and len(plan.buckets) == buckets, (len(plan.buckets), buckets)
    backward, comm, launch = sizing.bucket_backward_s[::-1], sizing.bucket_comm_s[::-1], sizing.bucket_launch_s[::-1]
    search_s, _ = best_of(args.repeats, lambda: _best_grouping(backward, comm, sizing.fixed_s, launch))
    return {
        "buckets": buckets,
        "nodes": len(gm.graph.nodes),
        "default_s": default_s,
        "auto_s": auto_s,
        "search_s": search_s,
        "auto_pieces": len(auto_plan.pieces),
    }


def table(rows: list[dict[str, Any]], link_gbps: float) -> str:
    lines = [
        f"| buckets | graph nodes | default (min_piece_mb=None) s | auto (link_gbps={link_gbps:g}) s "
        "| of which the grouping search s | auto's pieces |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['buckets']:,} | {r['nodes']:,} | {r['default_s']:.3f} | {r['auto_s']:.3f} "
            f"| {r['search_s']:.3f} | {r['auto_pieces']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--buckets", nargs="+", type=int, default=[100, 1_000, 10_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--link-gbps", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "plan_scaling.json")
    args = parser.parse_args(argv)
    rows = []
    for buckets in args.buckets:
        rows.append(measure(buckets, args))
        r = rows[-1]
        print(f"{buckets:>6,} buckets: default {r['default_s']:.3f} s, auto {r['auto_s']:.3f} s "
              f"(search {r['search_s']:.3f} s, {r['auto_pieces']} pieces)", flush=True)
    text = table(rows, args.link_gbps)
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"environment": environment(), "rows": rows, "table": text}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
