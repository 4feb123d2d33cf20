"""Processes end: the multi-process harness fails on a rank that lingers, DDP runs end in an
order that cannot deadlock (Note [Teardown deadlock]), and the example exits every time."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_split_backend

from .helpers import assert_no_fallback
from .multiproc import run_ranks

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent


def _lingering_worker(rank: int, world: int) -> int:
    """Does its work, then leaves a non-daemon thread that never ends: the process cannot exit."""
    print(f"rank {rank}: lingering on purpose", flush=True)
    threading.Thread(target=time.sleep, args=(10**6,), daemon=False).start()
    return rank


def test_harness_fails_fast_when_a_rank_does_not_exit(tmp_path) -> None:
    start = time.monotonic()
    with pytest.raises(AssertionError, match=r"rank \d did not exit") as failure:
        run_ranks(_lingering_worker, tmp_path, world=2, timeout=120, grace=3)
    assert time.monotonic() - start < 60
    assert "lingering on purpose" in str(failure.value)  # the rank's last output is shown


def _quick_worker(rank: int, world: int) -> int:
    return rank * 10


def test_harness_returns_results_of_ranks_that_exit(tmp_path) -> None:
    assert run_ranks(_quick_worker, tmp_path, world=2, grace=3) == [0, 10]


STASH_BEHAVIOURS = {
    (False, False): "2.11: no stash",
    (True, True): "2.12: stashed during backward and left behind",
    (True, False): "2.13+: stashed during backward, removed after",
}


def test_backward_thread_local_stash_is_one_the_teardown_note_knows() -> None:
    """The cause of Note [Teardown deadlock], checked on the installed torch: while backward
    runs (when DDP launches its allreduces) a contextvars.Context may sit in the C++
    thread-local state every collective captures. Releases differ (see _torch.DIFFERENCES);
    close_ddp is right for all three behaviours, and any other one needs a new look."""
    seen: list[bool] = []
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    y.register_hook(lambda grad: seen.append(torch._C._is_key_in_tls("context")) or grad)
    y.sum().backward()
    assert len(seen) == 1
    observed = (seen[0], torch._C._is_key_in_tls("context"))
    assert observed in STASH_BEHAVIOURS, f"torch {torch.__version__}: during/after backward = {observed}"


def test_close_ddp_releases_reducers_then_destroys_the_group(tmp_path) -> None:
    run_ranks(_close_ddp_worker, tmp_path, world=2, grace=10)


def _close_ddp_worker(rank: int, world: int) -> None:
    import torch.distributed as dist

    plain = DDP(nn.Linear(4, 4))
    compiled = torch.compile(DDP(nn.Linear(4, 4)), backend="ddp_split", options={"inner": "aot_eager"})
    with ddp_split_backend.own_split():
        for model in (plain, compiled):
            model(torch.randn(2, 4)).sum().backward()
    ddp_split_backend.close_ddp(plain, compiled, destroy_process_group=False)
    assert not hasattr(plain, "reducer") and not hasattr(compiled._orig_mod, "reducer")
    assert dist.is_initialized()  # the group outlives the reducers; the harness destroys it


EXAMPLE_RUNS = int(os.environ.get("DDP_SPLIT_EXAMPLE_RUNS", "10"))
EXAMPLE_EXIT_S = 240.0


@pytest.mark.slow
def test_example_exits_every_time() -> None:
    """``make demo``'s job (same options, fewer steps) under torchrun, repeatedly: every run
    must exit 0 within the bound (the hang of issue 12 showed as a run that never returned)."""
    torchrun = Path(sys.executable).with_name("torchrun")
    command = [str(torchrun), "--standalone", "--nproc_per_node=2", "examples/train_gpt.py", "--steps", "5"]
    walls = []
    for run in range(EXAMPLE_RUNS):
        start = time.monotonic()
        try:
            done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=EXAMPLE_EXIT_S)
        except subprocess.TimeoutExpired as error:
            tail = (error.stdout or b"")[-3000:]
            pytest.fail(f"run {run}: the example did not exit within {EXAMPLE_EXIT_S:g} s:\n{tail!r}")
        walls.append(time.monotonic() - start)
        assert done.returncode == 0, f"run {run}: exit code {done.returncode}\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        assert "loss: start" in done.stdout
        assert_no_fallback(done.stdout + done.stderr, f"run {run}")
    print(f"\nexample runs: {len(walls)}, wall s: {', '.join(f'{w:.0f}' for w in walls)}")
