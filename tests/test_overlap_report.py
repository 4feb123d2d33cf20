"""watch_overlap: a user's own run tells how much communication it hid (issue 26, part 2).

The user's comm hook here is the benchmarks' simulated link (``benchmarks/overlap.py``: one
link thread sends buckets in arrival order at a set bandwidth), and the benchmark's own
record of the same run (its transfers' completion times, a hook on the input's gradient for
the end of backward) is what the report must agree with.
"""

from __future__ import annotations

import importlib
import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_split_backend
from ddp_split_backend import OverlapReport, watch_overlap

from .models import TanhStack

pytestmark = pytest.mark.usefixtures("world1")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
WIDTH, DEPTH = 512, 8
"""Each layer's weight is 1 MiB: with ``bucket_cap_mb=1`` each layer is its own bucket."""
MIB = 2**20


@pytest.fixture
def bench(monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    return importlib.import_module("overlap")


@pytest.fixture
def link(bench: Any) -> Iterator[Any]:
    link = bench.Link()
    yield link
    link.close()


def send(link: Any, bucket: Any) -> torch.futures.Future[torch.Tensor]:
    return link.enqueue(bucket)


def _train(model: Any, steps: int, on_step: Any = None) -> list[tuple[float, list[Any]]]:
    """Steps of forward + backward; per step, when the input's gradient arrived."""
    ends = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        if on_step is not None:
            on_step()
        x = torch.randn(16, WIDTH, generator=gen, requires_grad=True)
        marks: list[float] = []
        x.register_hook(lambda g: marks.append(time.perf_counter()))
        with ddp_split_backend.own_split():
            model(x).sum().backward()
        ends.append(marks[0])
    return ends


@pytest.mark.parametrize("mode", ["eager", "ddp_split"])
def test_report_agrees_with_the_links_own_record(mode: str, link: Any) -> None:
    link.bandwidth = 100 * MIB  # 10 ms per 1 MiB bucket: 80 ms of communication, mostly exposed
    torch.manual_seed(0)
    ddp = DDP(TanhStack(WIDTH, DEPTH), bucket_cap_mb=1)
    watch = watch_overlap(ddp, hook=send, state=link, warmup=2, steps=3)
    model = ddp if mode == "eager" else torch.compile(
        ddp, backend="ddp_split", options={"inner": "aot_eager", "bucket_cap_mb": 1})
    records: list[list[Any]] = []
    ends = _train(model, 5, on_step=lambda: (records.append(list(link.transfers)), link.reset()))
    records = records[1:] + [list(link.transfers)]  # transfers of step i, recorded before step i + 1
    watch.remove()
    report = watch.report()

    assert [s.step for s in report.steps] == [2, 3, 4]
    for step in report.steps:
        transfers = records[step.step]
        assert len(step.buckets) == len(transfers) == DEPTH
        assert sorted(b.nbytes for b in step.buckets) == sorted(t.nbytes for t in transfers)
        # The benchmark's exposed time: last transfer done after the input's gradient arrived.
        bench_exposed = max(t.done for t in transfers) - ends[step.step]
        assert step.exposed_s == pytest.approx(bench_exposed, abs=3e-3, rel=0.1)
        assert step.comm_s == pytest.approx(DEPTH * 10e-3, rel=0.15)
        assert step.exposed_share == pytest.approx(step.exposed_s / step.comm_s)
        assert 0.0 <= step.exposed_share <= 1.0  # how much is exposed depends on the machine's speed
        assert all(b.ready <= b.launched <= b.completed for b in step.buckets)
    if mode == "ddp_split":  # buckets handed over while backward still ran
        assert all(s.ready_before_end >= DEPTH - 2 for s in report.steps)


def instant(state, bucket):  # no annotations: DDP checks them, and here they are strings
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def test_nothing_exposed_on_an_instant_link() -> None:
    torch.manual_seed(0)
    ddp = DDP(TanhStack(WIDTH, DEPTH), bucket_cap_mb=1)
    watch = watch_overlap(ddp, hook=instant, warmup=1, steps=2)
    model = torch.compile(ddp, backend="ddp_split", options={"inner": "aot_eager", "bucket_cap_mb": 1})
    _train(model, 4)
    report = watch.report()
    assert len(report.steps) == 2 and report.device == "cpu"
    assert all(s.exposed_s < 1e-3 for s in report.steps), report.table()
    assert all(len(s.buckets) == DEPTH and s.ready_before_end == DEPTH - 1 for s in report.steps)


def test_training_is_unchanged_and_the_users_hook_still_runs() -> None:
    def user_hook(state, bucket):  # as a user registers it with DDP (no string annotations)
        state.append(bucket.index())
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer() * 0.5)  # a hook that changes the gradients
        return fut

    grads, calls = [], []
    for watched in (False, True):
        torch.manual_seed(0)
        ddp = DDP(TanhStack(WIDTH, DEPTH), bucket_cap_mb=1)
        calls.append([])
        if watched:
            watch_overlap(ddp, hook=user_hook, state=calls[-1], warmup=0, steps=2)
        else:
            ddp.register_comm_hook(calls[-1], user_hook)
        _train(torch.compile(ddp, backend="ddp_split", options={"inner": "aot_eager", "bucket_cap_mb": 1}), 2)
        grads.append([p.grad.clone() for p in ddp.parameters()])
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    assert calls[1] == calls[0] and len(calls[0]) > DEPTH  # every bucket DDP handed over, both steps


def test_table_is_logged_once_the_window_closes(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    torch.manual_seed(0)
    ddp = DDP(TanhStack(WIDTH, DEPTH), bucket_cap_mb=1)
    watch = watch_overlap(ddp, warmup=1, steps=2)  # DDP's own allreduce (a world of one)
    with caplog.at_level(logging.INFO, logger="ddp_split"):
        _train(ddp, 4)
    summaries = [r.getMessage() for r in caplog.records if r.name == "ddp_split.summary"]
    tables = [r.getMessage() for r in caplog.records if r.name == "ddp_split"]
    assert len(tables) == 1 and "exposed communication" in tables[0] and "bucket" in tables[0]
    assert len(summaries) == 1 and "\n" not in summaries[0], summaries  # one line, shown by default
    assert "of the communication was hidden behind backward" in summaries[0]
    assert max(len(line) for line in tables[0].splitlines()) <= 120
    report = watch.report()
    assert isinstance(report, OverlapReport) and [s.step for s in report.steps] == [1, 2]
    pytest.importorskip("matplotlib")
    assert report.draw(tmp_path / "overlap.png").stat().st_size > 1000


def test_clear_errors() -> None:
    ddp = DDP(TanhStack(WIDTH, DEPTH), bucket_cap_mb=1)
    with pytest.raises(TypeError, match="DistributedDataParallel"):
        watch_overlap(TanhStack(WIDTH, DEPTH))
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        watch_overlap(ddp, steps=0)
    ddp.register_comm_hook(None, instant)
    with pytest.raises(RuntimeError, match="already has a comm hook.*hook=your_hook"):
        watch_overlap(ddp)


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU here")]),
])
def test_times_come_from_the_device(device: str) -> None:
    """On a GPU the times are CUDA events on the work's streams; on the CPU host clocks."""
    torch.manual_seed(0)
    ddp = DDP(TanhStack(WIDTH, DEPTH).to(device), bucket_cap_mb=1)
    watch = watch_overlap(ddp, hook=instant, warmup=1, steps=2)
    model = torch.compile(ddp, backend="ddp_split", options={"inner": "aot_eager", "bucket_cap_mb": 1})
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        with ddp_split_backend.own_split():
            model(torch.randn(16, WIDTH, generator=gen).to(device)).sum().backward()
    report = watch.report()
    assert report.device == device and len(report.steps) == 2
    for step in report.steps:
        assert step.backward_s > 0 and len(step.buckets) == DEPTH
        assert step.ready_before_end == DEPTH - 1, report.table()


def _fifo_step(step: int, ready: list[float], nbytes: list[int], gbps: float, launch_s: float = 0.0) -> Any:
    """A step as one link at ``gbps`` would make it: buckets sent in the order they are ready
    (times relative to backward's end), each once the one before it is sent."""
    from ddp_split_backend import BucketTiming, StepOverlap

    link, buckets = float("-inf"), []
    for index, (at, size) in enumerate(zip(ready, nbytes, strict=True)):
        link = max(link, at + launch_s) + size / (gbps * 1e9)
        buckets.append(BucketTiming(index, size, at, at + launch_s, link))
    return StepOverlap(step, -min(ready) + 1e-3, tuple(buckets))


@pytest.mark.parametrize("gbps", [0.05, 1.0, 25.0])
def test_the_report_gives_back_the_link_speed_of_its_times(gbps: float) -> None:
    """Injected times, no clock: steps made by a link of known speed give that speed back,
    whether communication was exposed (slow) or mostly hidden (fast), in the summary too."""
    nbytes = [4 * MIB, 1 * MIB, 8 * MIB, 2 * MIB]
    steps = (
        _fifo_step(3, [-0.030, -0.020, -0.008, 0.0], nbytes, gbps),
        _fifo_step(4, [-0.031, -0.019, -0.009, 0.0], nbytes, gbps),
        _fifo_step(5, [-0.012, -0.011, -0.002, 0.0], nbytes, gbps),
    )
    report = OverlapReport(steps, "cpu")
    assert report.link_gbps == pytest.approx(gbps, rel=1e-6)
    assert report.summary().endswith(f"; link {gbps:.3g} GB/s")
    assert f"link {gbps:.3g} GB/s (pass it as link_gbps)" in report.table()


def test_link_fit_edges() -> None:
    from ddp_split_backend.overlap import link_seconds_per_byte

    # one link, 100 bytes at 1e-5 s/byte: sent back to back once the first is ready
    assert link_seconds_per_byte([1e-3, 2e-3, 3e-3], [100, 100, 100], 4e-3) == pytest.approx(1e-5)
    # the second bucket waits to be ready: the link idles in between
    assert link_seconds_per_byte([1e-3, 5e-3], [100, 100], 6e-3) == pytest.approx(1e-5)
    assert link_seconds_per_byte([1e-3, 5e-3], [100, 100], 5e-3) == 0.0  # ended when the last was ready: free
    assert link_seconds_per_byte([-3e-3, -1e-3], [100, 0], 1e-3) == pytest.approx(4e-5)  # an empty last bucket
    assert OverlapReport((), "cpu").link_gbps != OverlapReport((), "cpu").link_gbps  # nan: nothing measured
    instant_step = _fifo_step(0, [-2e-3, 0.0], [MIB, MIB], math.inf)
    assert OverlapReport((instant_step,), "cpu").link_gbps == math.inf
