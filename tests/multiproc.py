"""Run a function on N gloo ranks in spawned processes; every process is joined or killed.

A rank must write its result and then *exit 0 promptly*: a process that lingers after its
work is a failure (a training job whose slot never frees), reported as ``rank N did not
exit`` with the tail of that rank's output.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .helpers import free_port

EXIT_GRACE_S = 30.0
"""How long a rank may take to exit after writing its result (process-group teardown,
interpreter shutdown; well under a second when nothing hangs)."""


def _entry(fn: Callable[..., Any], rank: int, world: int, port: int, out: str, kwargs: dict) -> None:
    log = os.open(f"{out}/rank{rank}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)  # C++ output too: the harness shows the tail when a rank misbehaves
    os.dup2(log, 2)
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    from ddp_split_backend import InnerFallbackWarning

    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", InnerFallbackWarning)
            result = fn(rank, world, **kwargs)
        for w in caught:
            print(warnings.formatwarning(w.message, w.category, w.filename, w.lineno), end="", flush=True)
        fallbacks = [str(w.message) for w in caught if issubclass(w.category, InnerFallbackWarning)]
        dist.barrier()
        payload = {"ok": True, "result": result, "fallbacks": fallbacks}
    except BaseException:
        payload = {"ok": False, "error": traceback.format_exc()}
    finally:
        # Reducers made by ``fn`` go while the group is alive: Note [Teardown deadlock].
        torch._dynamo.reset()
        gc.collect()
    torch.save(payload, f"{out}/rank{rank}.tmp")
    os.replace(f"{out}/rank{rank}.tmp", f"{out}/rank{rank}.pt")  # appears whole or not at all
    print(f"rank {rank}: result written", flush=True)
    if dist.is_initialized():
        dist.destroy_process_group()
    if not payload["ok"]:
        raise SystemExit(1)


def _tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return "(no output)"
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


def _wait(procs: list[Any], tmp: Path, timeout: float, grace: float) -> None:
    """Until every rank exited; fails on a rank that outlives ``timeout`` or lingers more than
    ``grace`` seconds after writing its result."""
    start = time.monotonic()
    written: dict[int, float] = {}
    while any(p.is_alive() for p in procs):
        now = time.monotonic()
        for rank, p in enumerate(procs):
            if not p.is_alive():
                continue
            if rank not in written and (tmp / f"rank{rank}.pt").exists():
                written[rank] = now
            if rank in written and now - written[rank] > grace:
                raise AssertionError(
                    f"rank {rank} did not exit within {grace:g} s after writing its result; "
                    f"last output:\n{_tail(tmp / f'rank{rank}.log')}"
                )
            if now - start > timeout:
                raise AssertionError(
                    f"rank {rank} did not finish within {timeout:g} s; last output:\n"
                    f"{_tail(tmp / f'rank{rank}.log')}"
                )
        time.sleep(0.05)


PRELOAD = ["torch", "torch.distributed", "ddp_split_backend", "tests.multiproc"]
"""What the rank processes' fork server imports once (Note [Ranks from a fork server])."""


def _context() -> Any:
    """Note [Ranks from a fork server]: ranks are forked from a server process that imported
    torch and ddp_split once (``multiprocessing``'s ``forkserver``), instead of each starting
    a fresh interpreter (``spawn``) that spends 3-4 s importing them: about 7 s of CPU per
    2-rank run, with some 40 runs in the suite. The server imports nothing else and runs
    nothing, so every rank still starts with no Dynamo cache, no process group and no
    threads of a parent; it is started with the environment of the first run (the suite sets
    none per test)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def stop_fork_server() -> None:
    """End the fork server of :func:`_context` (the session's end does; it would also exit
    with this process)."""
    import multiprocessing.forkserver

    multiprocessing.forkserver._forkserver._stop()


def run_ranks(
    fn: Callable[..., Any],
    tmp: Path,
    world: int = 2,
    timeout: float = 300,
    grace: float = EXIT_GRACE_S,
    expects_fallback: bool = False,
    **kwargs: Any,
) -> list[Any]:
    """``fn(rank, world, **kwargs)`` on every rank; returns each rank's result.

    Fails when a rank raises, does not finish within ``timeout`` seconds, does not exit
    within ``grace`` seconds after writing its result, or exits with a non-zero code; and,
    unless ``expects_fallback``, when a piece fell back to eager on a rank
    (``InnerFallbackWarning``) without ``fn`` catching the warning itself.
    """
    ctx = _context()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, str(tmp), kwargs)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        _wait(procs, tmp, timeout, grace)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    results = []
    for r, p in enumerate(procs):
        path = tmp / f"rank{r}.pt"
        assert path.exists(), f"rank {r} wrote no result (exit code {p.exitcode}):\n{_tail(tmp / f'rank{r}.log')}"
        payload = torch.load(path, weights_only=False)
        assert payload["ok"], f"rank {r} failed:\n{payload['error']}"
        assert p.exitcode == 0, f"rank {r} exited with code {p.exitcode}:\n{_tail(tmp / f'rank{r}.log')}"
        assert expects_fallback or not payload["fallbacks"], f"rank {r}: unexpected eager fallback:\n" + "\n".join(
            m[:1000] for m in payload["fallbacks"]
        )
        results.append(payload["result"])
    return results
