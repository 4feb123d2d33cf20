"""Run a function on N gloo ranks in spawned processes; every process is joined or killed."""

from __future__ import annotations

import multiprocessing as mp
import os
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .conftest import free_port


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, out: str, kwargs: dict) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, **kwargs)
        dist.barrier()
        torch.save({"ok": True, "result": result}, f"{out}/rank{rank}.pt")
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, f"{out}/rank{rank}.pt")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], tmp: Path, world: int = 2, timeout: float = 300, **kwargs: Any) -> list[Any]:
    """``fn(rank, world, **kwargs)`` on every rank; returns each rank's result."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, str(tmp), kwargs)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    results = []
    for r in range(world):
        path = tmp / f"rank{r}.pt"
        assert path.exists(), f"rank {r} wrote no result (exit code {procs[r].exitcode})"
        payload = torch.load(path, weights_only=False)
        assert payload["ok"], f"rank {r} failed:\n{payload['error']}"
        results.append(payload["result"])
    return results
