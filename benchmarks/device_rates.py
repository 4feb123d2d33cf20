#!/usr/bin/env python
"""Measure the rates ``ddp_split_backend.cost.DEVICE_RATES`` holds for this machine's device.

``min_piece_mb="auto"`` turns each node's FLOPs and bytes into seconds with fixed rates per
device type, so that a plan never depends on what one process timed (every rank makes the
same plan). This script measures them the way they were measured: a 256 x 256 matmul
(1024 x 1024 on CUDA) on one CPU thread, scaled by the thread count; a 4 MiB clone; a
16-element add from Python; best of 5 (50 for the add), no autograd, autocast off.

    .venv/bin/python benchmarks/device_rates.py [--device cuda]
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Callable

import torch


def _best_of(fn: Callable[[], object], device: torch.device, repeats: int = 5) -> float:
    fn()
    best = math.inf
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return max(best, 1e-9)


def measure(device: torch.device) -> dict[str, float]:
    threads = torch.get_num_threads()
    with torch.no_grad(), torch.autocast(device.type, enabled=False):
        if device.type == "cpu":
            torch.set_num_threads(1)
        try:
            n = 1024 if device.type == "cuda" else 256
            a = torch.randn(n, n, device=device)
            big = torch.empty(2**20, device=device)
            small = torch.empty(16, device=device)
            matmul = _best_of(lambda: a @ a, device)
            copy = _best_of(lambda: big.clone(), device)
            op = _best_of(lambda: small.add(1.0), device, repeats=50)
        finally:
            torch.set_num_threads(threads)
    scale = threads if device.type == "cpu" else 1
    return {"flops_per_s": scale * 2.0 * n**3 / matmul, "bytes_per_s": 2.0 * big.numel() * 4 / copy, "op_s": op}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--rounds", type=int, default=5, help="take the median of this many measurements")
    args = p.parse_args()
    runs = [measure(torch.device(args.device)) for _ in range(args.rounds)]
    for key in runs[0]:
        values = sorted(r[key] for r in runs)
        print(f"{key}: {values[len(values) // 2]:.4g}  (of {', '.join(f'{v:.3g}' for v in values)})")


if __name__ == "__main__":
    main()
