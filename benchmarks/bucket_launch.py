#!/usr/bin/env python
"""How fast DDP launches the buckets of one piece: the rates ``cost.DeviceRates.bucket_s`` and
``copy_bytes_per_s`` hold (Note [Piece cost model]).

When a piece's backward has run, the engine accumulates its gradients one by one, DDP's
reducer copies each into its bucket, and a full bucket calls the comm hook. This script
compiles both models of ``step_overhead.py`` as one piece (``min_piece_mb`` above the model)
under DDP on one gloo rank, with the simulated link of ``overlap.py`` made instant (its
schedule, no thread that would take the GIL between launches), and reads off the link's record
when each bucket reached the comm hook: the interval between the first
and the last, over the buckets between them, median over the steps. Two bucket sizes give
the fixed host cost per bucket and the copy rate.

    .venv/bin/python benchmarks/bucket_launch.py [--inner aot_eager] [--steps 30]
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch

import step_overhead as grid
from overlap import HookState, ScheduledLink, link_hook

MIB = 2**20


def launch_interval_s(work: grid.Workload, inner: str, steps: int) -> tuple[float, int]:
    """Median seconds between two buckets' launches, and how many buckets DDP made."""
    link = ScheduledLink()
    link.bandwidth = math.inf
    try:
        with grid.threads_of(work):
            mode = grid.build(work, f"ddp_split_x{work.depth}", inner, link_hook,
                              HookState(link, "one piece", {}, record_params=False))
            x = torch.randn(work.batch, work.width)
            intervals, count = [], 0
            for index in range(steps + 5):
                link.reset()
                grid.step(mode, x)
                ready = sorted(t.ready for t in link.transfers)
                if index >= 5:  # after the compile and DDP's rebuild
                    assert mode.pieces() == 1 and len(ready) >= work.depth, (mode.pieces(), len(ready))
                    intervals.append((ready[-1] - ready[0]) / (len(ready) - 1))
                    count = len(ready)
            return statistics.median(intervals), count
    finally:
        link.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--inner", default="aot_eager")
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    seen = {}
    with grid.process_group():
        for work in (grid.OVERHEAD, grid.TRADEOFF):
            nbytes = (work.width + 1) * work.width * 4
            seen[nbytes], count = launch_interval_s(work, args.inner, args.steps)
            print(f"{work.name}: {count} buckets of {nbytes / MIB:.2f} MiB, one piece, {args.inner}: "
                  f"launched {1e3 * seen[nbytes]:.3f} ms apart")
    (small, t_small), (large, t_large) = sorted(seen.items())
    per_byte = max(t_large - t_small, 0.0) / (large - small)
    fixed = t_small - per_byte * small
    rate = f"{1 / per_byte / 1e9:.1f} GB/s" if per_byte > 0 else "free"
    print(f"fit: {1e3 * fixed:.3f} ms a bucket + its bytes copied at {rate}")


if __name__ == "__main__":
    main()
