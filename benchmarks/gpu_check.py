#!/usr/bin/env python
"""The prepared GPU check: is ddp_split right and fast where DDP users train?

One script, five parts, run from the working tree with whatever torch the machine has
(nothing is installed; ``make gpu-check PYTHON=python3``):

1. ``correctness``: training steps against eager DDP on the device: world size 1 (NCCL on a
   GPU, gloo on a CPU) and 2 ranks over gloo (on one GPU, since NCCL takes a GPU per rank); a
   GPT-like and a conv model of our own, inductor pieces, fp32 with dropout, bf16 autocast,
   fp16 autocast with a ``GradScaler``, both wrapping orders. Losses, gradients and parameters
   must match eager within inductor's tolerances; where they do not, the same steps compiled
   as one graph without the split decide: a case passes when ddp_split matches that (the
   difference is the inner backend's own numerics, reported with both figures).
2. ``reduce_overhead``: ``mode="reduce-overhead"`` (one CUDA graph per piece): correct, how
   many CUDA graphs were recorded, DDP's bucket hooks still launched between the pieces'
   graphs, peak memory against the default mode. CUDA only.
3. ``step``: step time and peak memory of eager DDP, one compiled graph, torch's
   DDPOptimizer, ddp_split (a piece per bucket, and grouped with ``min_piece_mb``), on a simulated link
   whose speed is set from the backward time measured in the same run (communication 0.5x
   and 2x backward), modes stepped round-robin, device-synchronised timing.
4. ``overlap`` (measured with 3): when each bucket was ready/launched relative to the end of
   backward, and the share of communication left exposed after it.
5. ``first_call``: the first step's time (compiles included) with a fresh inductor cache,
   ddp_split against DDPOptimizer, each in its own process.

Without a GPU it runs the same code on the CPU and says so: CUDA-only parts are reported as
"no GPU here", never as passed. Each part's failure is recorded and the others still run.
Results: ``benchmarks/results/gpu_check_<device>.json`` and ``.md``.

Example::

    make gpu-check PYTHON=python3                      # on the GPU machine (under 5 min)
    .venv/bin/python benchmarks/gpu_check.py --quick --inner aot_eager   # CPU smoke (CI)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run from the working tree, nothing installed

import ddp_split_backend  # noqa: E402
from _common import environment, free_port, own_code  # noqa: E402
from ddp_split_backend import close_ddp  # noqa: E402

NO_GPU = "no GPU here"
MIB = 2**20


# ---------------------------------------------------------------------------------------
# Models of our own (the GPU machine may have no model libraries)
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Size:
    """Model and batch sizes for one device class."""

    width: int
    layers: int
    seq: int
    batch: int
    image: int
    cap_mb: float  # bucket cap: several buckets per model


SIZES = {
    "cuda": Size(width=1024, layers=8, seq=256, batch=16, image=64, cap_mb=25),
    "cpu": Size(width=192, layers=4, seq=32, batch=4, image=16, cap_mb=1),  # DDPOptimizer needs >= 1 MB
}


class Block(nn.Module):
    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        self.heads, self.dropout = max(1, width // 64), dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, t, c)), self.dropout, self.training)
        return x + F.dropout(self.out(F.gelu(self.fc(self.norm2(x)))), self.dropout, self.training)


class GPT(nn.Module):
    """GPT-like: blocks of attention and MLP on float inputs (so a hook on the input's
    gradient marks the end of backward), a head, a mean-square loss taken outside."""

    def __init__(self, size: Size, dropout: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(size.width, dropout) for _ in range(size.layers)])
        self.norm, self.head = nn.LayerNorm(size.width), nn.Linear(size.width, size.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


class ConvNet(nn.Module):
    """Conv, BatchNorm (buffers), ReLU stages, pooled to a linear classifier."""

    def __init__(self, size: Size, dropout: float = 0.0) -> None:
        super().__init__()
        chans = [3, 32, 64, 128, 128]
        self.stages = nn.ModuleList(
            nn.Sequential(nn.Conv2d(a, b, 3, padding=1, bias=False), nn.BatchNorm2d(b), nn.ReLU())
            for a, b in zip(chans, chans[1:])
        )
        self.dropout, self.fc = dropout, nn.Linear(chans[-1], 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for stage in self.stages:
            x = stage(x)
        return self.fc(F.dropout(x.mean((2, 3)), self.dropout, self.training))


def batch_of(model: str, size: Size, device: str, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    if model == "gpt":
        x = torch.randn(size.batch, size.seq, size.width, generator=gen)
        return x.to(device), torch.randn(size.batch, size.seq, size.width, generator=gen).to(device)
    x = torch.randn(size.batch * 2, 3, size.image, size.image, generator=gen)
    return x.to(device), torch.randint(0, 10, (size.batch * 2,), generator=gen).to(device)


def loss_of(model: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    out = out.float()
    return F.mse_loss(out, target) if model == "gpt" else F.cross_entropy(out, target)


MODELS: dict[str, Callable[..., nn.Module]] = {"gpt": GPT, "conv": ConvNet}


# ---------------------------------------------------------------------------------------
# Process groups and modes
# ---------------------------------------------------------------------------------------


@contextlib.contextmanager
def process_group(backend: str, rank: int = 0, world: int = 1, port: int | None = None) -> Iterator[None]:
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port or free_port())
    dist.init_process_group(backend, rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


class _Wrapper(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner


def _forward(self: _Wrapper, x: torch.Tensor) -> torch.Tensor:
    return self.inner(x)


MODE_NAMES = ("eager_ddp", "one_graph", "ddp_optimizer", "ddp_split", "ddp_split_grouped",
              "ddp_split_reduce_overhead")
WRAPPER = {name: type(f"Mode_{name}", (_Wrapper,), {"forward": own_code(_forward, name)}) for name in MODE_NAMES}
"""One wrapper class per mode, each with its own ``forward`` code object, so Dynamo's code
cache never hands one mode's graph to another (see ``_common.own_code``)."""


@dataclass
class Mode:
    """One way of training the same model: how it is wrapped, and the context each call needs."""

    name: str
    model: nn.Module
    ddp: DDP
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    samples: list[dict[str, Any]] = field(default_factory=list)


def build_mode(name: str, base: nn.Module, *, inner: str, cap_mb: float,
               wrap: str = "outside", options: dict[str, Any] | None = None) -> Mode:
    """A copy of ``base`` trained as mode ``name`` (one of :data:`MODE_NAMES`; every
    ``ddp_split*`` mode is ddp_split with its ``options``)."""
    model = WRAPPER[name](copy.deepcopy(base))
    split_options = {"inner": inner, **(options or {})}
    if name == "eager_ddp":
        ddp = DDP(model, bucket_cap_mb=cap_mb)
        return Mode(name, ddp, ddp)
    if name in ("one_graph", "ddp_optimizer"):
        flag = name == "ddp_optimizer"
        ddp = DDP(model, bucket_cap_mb=cap_mb)
        compiled = torch.compile(ddp, backend=inner)
        return Mode(name, compiled, ddp, lambda: torch._dynamo.config.patch(optimize_ddp=flag))
    if wrap == "outside":
        ddp = DDP(model, bucket_cap_mb=cap_mb)
        compiled = torch.compile(ddp, backend="ddp_split", options=split_options)
    else:
        ddp = DDP(torch.compile(model, backend="ddp_split", options=split_options), bucket_cap_mb=cap_mb)
        compiled = ddp
    return Mode(name, compiled, ddp, ddp_split_backend.own_split)


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------
# Part 1: correctness against eager DDP
# ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Case:
    model: str
    precision: str  # fp32 | bf16 | fp16 (with GradScaler)
    wrap: str  # outside: torch.compile(DDP(m)); inside: DDP(torch.compile(m))
    dropout: float

    @property
    def id(self) -> str:
        return f"{self.model}-{self.precision}-{self.wrap}{'-dropout' if self.dropout else ''}"


CASES = [
    Case("gpt", "fp32", "outside", 0.1),
    Case("gpt", "bf16", "inside", 0.1),
    Case("gpt", "fp16", "outside", 0.0),
    Case("conv", "fp32", "inside", 0.1),
    Case("conv", "bf16", "outside", 0.0),
    Case("conv", "fp16", "inside", 0.0),
]
TWO_RANK_CASES = [Case("gpt", "bf16", "outside", 0.1), Case("conv", "fp16", "inside", 0.0)]
TOLERANCE = {"fp32": 1e-4, "bf16": 2e-2, "fp16": 5e-3}
"""rtol = atol per precision: inductor fuses and reorders float work, so it is judged by
inductor's own accuracy tolerances (1e-4 in fp32, looser under reduced precision)."""


def train(mode: Mode, case: Case, batches: list, device: str) -> dict[str, list[torch.Tensor]]:
    opt = torch.optim.SGD(mode.ddp.parameters(), lr=0.01)
    scaler = torch.amp.GradScaler(device) if case.precision == "fp16" else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(case.precision)
    losses, grads = [], []
    for step, (x, target) in enumerate(batches):
        opt.zero_grad(set_to_none=True)
        torch.manual_seed(1000 + step)  # dropout draws the same masks in every mode
        with mode.context(), torch.autocast(device, dtype=dtype, enabled=dtype is not None):
            loss = loss_of(case.model, mode.model(x), target)
        if scaler is None:
            loss.backward()
            grads = [p.grad.detach().clone() for p in mode.ddp.parameters()]
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            grads = [p.grad.detach().clone() for p in mode.ddp.parameters()]
            scaler.step(opt)
            scaler.update()
        losses.append(loss.detach().float())
    return {"losses": losses, "grads": grads, "params": [p.detach().clone() for p in mode.ddp.parameters()]}


def compare(actual: dict, expected: dict, tol: float) -> tuple[bool, float, str]:
    """Within tolerance everywhere? The largest absolute difference, and the first miss."""
    worst, miss = 0.0, ""
    for what in ("losses", "grads", "params"):
        for i, (a, e) in enumerate(zip(actual[what], expected[what], strict=True)):
            worst = max(worst, (a.float() - e.float()).abs().max().item())
            try:
                torch.testing.assert_close(a, e, rtol=tol, atol=tol)
            except AssertionError as error:
                miss = miss or f"{what}[{i}]: {str(error).splitlines()[0]}"
    return not miss, worst, miss


def splitting_cap_mb(model: nn.Module, size: Size) -> float:
    """The device's cap, lowered where it would leave the model in fewer than 4 buckets: a
    correctness case must cross cuts (ddp_split takes any cap; DDPOptimizer is not run here)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return min(size.cap_mb, total / 4 / MIB)


def run_case(case: Case, *, inner: str, device: str, size: Size, rank: int, steps: int) -> dict[str, Any]:
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = MODELS[case.model](size, case.dropout).to(device)
    gen = torch.Generator().manual_seed(100 + rank)
    batches = [batch_of(case.model, size, device, gen) for _ in range(steps)]
    cap_mb = splitting_cap_mb(base, size)
    eager = build_mode("eager_ddp", base, inner=inner, cap_mb=cap_mb)
    expected = train(eager, case, batches, device)
    options: dict[str, Any] = {"min_piece_mb": None}  # a piece per bucket: every case crosses cuts
    if inner == "inductor" and case.dropout:
        options["inner_options"] = {"fallback_random": True}
    split = build_mode("ddp_split", base, inner=inner, cap_mb=cap_mb, wrap=case.wrap,
                       options=options)
    ddp_split_backend.ddp_split.records.clear()
    actual = train(split, case, batches, device)
    ok, worst, miss = compare(actual, expected, TOLERANCE[case.precision])
    records = list(ddp_split_backend.ddp_split.records)
    row = {
        "case": case.id, "ok": ok, "max_abs_diff": worst, "first_miss": miss,
        "pieces": [len(r.plan.pieces) for r in records],
        "outcomes": sorted({p.outcome.value for r in records for p in r.pieces}),
    }
    close_ddp(eager.ddp, split.ddp, destroy_process_group=False)
    if not ok:  # the inner backend's own numerics, or the split's? Ask the unsplit compile.
        unsplit = build_mode("one_graph", base, inner=inner, cap_mb=cap_mb)
        with _torch_config(inner, fallback_random=bool(case.dropout)):
            reference = train(unsplit, case, batches, device)
        close_ddp(unsplit.ddp, destroy_process_group=False)
        same, gap, _ = compare(actual, reference, TOLERANCE[case.precision])
        _, compiler_gap, _ = compare(reference, expected, TOLERANCE[case.precision])
        row.update(ok=same, max_abs_diff_vs_one_graph=gap, one_graph_vs_eager=compiler_gap,
                   first_miss=f"{miss} (one graph of {inner} without the split differs from eager by "
                              f"{compiler_gap:.2e}; ddp_split differs from it by {gap:.2e})")
    return row


def _torch_config(inner: str, **settings: Any) -> contextlib.AbstractContextManager[Any]:
    """Inductor settings for the unsplit reference (ddp_split takes them as ``inner_options``)."""
    if inner != "inductor":
        return contextlib.nullcontext()
    import torch._inductor.config as inductor_config

    return inductor_config.patch(**settings)


def correctness_world1(args: argparse.Namespace) -> dict[str, Any]:
    backend = "nccl" if args.device == "cuda" else "gloo"
    with process_group(backend):
        rows = [_guarded(lambda c=c: run_case(c, inner=args.inner, device=args.device, size=args.size,
                                               rank=0, steps=args.steps), c.id)
                for c in args.cases]
    return {"backend": backend, "world": 1, "rows": rows}


def correctness_two_ranks(args: argparse.Namespace) -> dict[str, Any]:
    """Two processes over gloo on this one device, each checked against eager DDP."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--port", str(port),
                                   "--out-dir", tmp, "--inner", args.inner,
                                   *(["--quick"] if args.quick else [])])
                 for r in range(2)]
        codes = []
        for proc in procs:
            try:
                codes.append(proc.wait(timeout=args.rank_timeout))
            except subprocess.TimeoutExpired:
                proc.kill()
                codes.append(proc.wait())
        results = [json.loads((Path(tmp) / f"rank{r}.json").read_text())
                   if (Path(tmp) / f"rank{r}.json").exists() else None for r in range(2)]
    rows = []
    for case in TWO_RANK_CASES:
        per_rank = [r["rows"].get(case.id) if r else None for r in results]
        ok = all(p is not None and p["ok"] for p in per_rank)
        worst = max((p["max_abs_diff"] for p in per_rank if p), default=float("nan"))
        misses = "; ".join(f"rank {i}: {p['first_miss'] or p.get('error', '')}" for i, p in enumerate(per_rank)
                           if p and not p["ok"])
        rows.append({"case": case.id, "ok": ok, "max_abs_diff": worst, "first_miss": misses,
                     "pieces": per_rank[0]["pieces"] if per_rank[0] else []})
    return {"backend": "gloo", "world": 2, "exit_codes": codes, "rows": rows}


def rank_main(args: argparse.Namespace) -> None:
    """One rank of :func:`correctness_two_ranks` (started by it)."""
    if args.device == "cuda":
        torch.cuda.set_device(0)
    with process_group("gloo", rank=args.rank, world=2, port=args.port):
        rows = {c.id: _guarded(lambda c=c: run_case(c, inner=args.inner, device=args.device, size=args.size,
                                                     rank=args.rank, steps=args.steps), c.id)
                for c in TWO_RANK_CASES}
    (Path(args.out_dir) / f"rank{args.rank}.json").write_text(json.dumps({"rows": rows}))


def _guarded(fn: Callable[[], dict[str, Any]], case: str) -> dict[str, Any]:
    try:
        return fn()
    except Exception as error:  # one case's failure is a result, the others still run
        return {"case": case, "ok": False, "max_abs_diff": float("nan"), "first_miss": "",
                "error": f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}",
                "traceback": traceback.format_exc(limit=8)}


# ---------------------------------------------------------------------------------------
# Parts 3 and 4: step time, memory and overlap on a simulated link
# ---------------------------------------------------------------------------------------


def link_hook(link, bucket):  # no annotations: DDP checks them, and they are strings here
    """DDP comm hook: hand the bucket to the simulated link (world size 1: nothing to reduce)."""
    return link.send(bucket)


class Link:
    """One simulated link: a single thread "sends" buckets in arrival order, each taking
    bytes / bandwidth, after the bucket's gradients are really computed (a CUDA event)."""

    def __init__(self, device: str) -> None:
        self.device, self.bytes_per_s = device, float("inf")
        self.events: list[dict[str, Any]] = []
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def send(self, bucket: dist.GradBucket) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        buffer = bucket.buffer()
        event = None
        if buffer.is_cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
        self._queue.put((future, buffer, event, time.perf_counter()))
        return future

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, buffer, event, launched = item
            if event is not None:
                event.synchronize()
            start = time.perf_counter()
            if self.bytes_per_s != float("inf"):
                time.sleep(buffer.numel() * buffer.element_size() / self.bytes_per_s)
            self.events.append({"bytes": buffer.numel() * buffer.element_size(), "launched": launched,
                                "event": event, "start": start, "done": time.perf_counter()})
            future.set_result(buffer)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10)


def timed_step(mode: Mode, x: torch.Tensor, target: torch.Tensor, link: Link, device: str) -> dict[str, Any]:
    """One forward+backward+optimizer-free step, with the end of backward marked by a hook on
    the input's gradient; times relative to the step's start, in seconds."""
    x = x.detach().requires_grad_(True)
    marks: dict[str, Any] = {}

    def backward_end(grad: torch.Tensor) -> None:
        marks["cpu"] = time.perf_counter()
        if device == "cuda":
            marks["event"] = torch.cuda.Event(enable_timing=True)
            marks["event"].record()

    x.register_hook(backward_end)
    link.events.clear()
    sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        if "reduce_overhead" in mode.name:
            torch.compiler.cudagraph_mark_step_begin()
        start_event = torch.cuda.Event(enable_timing=True)
        start_event.record()
    start = time.perf_counter()
    with mode.context():
        out = mode.model(x)
    loss = F.mse_loss(out.float(), target)
    loss.backward()
    sync(device)
    end = time.perf_counter()

    def at(event: Any, cpu: float) -> float:  # seconds after start, in the device's clock where it has one
        return start_event.elapsed_time(event) / 1000 if event is not None else cpu - start

    bw_end = at(marks.get("event"), marks["cpu"])
    buckets = [{"bytes": e["bytes"], "ready": at(e["event"], e["launched"]) - bw_end,
                "launched": e["launched"] - start - bw_end if e["event"] is None else at(e["event"], e["launched"]) - bw_end,
                "comm": e["done"] - e["start"], "done": e["done"] - start - bw_end} for e in link.events]
    comm = sum(b["comm"] for b in buckets)
    exposed = max((b["done"] for b in buckets), default=0.0)
    return {
        "step": end - start,
        "buckets": buckets,
        "exposed_share": max(0.0, exposed) / comm if comm > 0 else None,
        "peak_mib": torch.cuda.max_memory_allocated() / MIB if device == "cuda" else None,
        "loss": loss.item(),
    }


def backward_seconds(base: nn.Module, x: torch.Tensor, target: torch.Tensor, device: str, reps: int) -> float:
    times = []
    for _ in range(reps + 1):
        loss = F.mse_loss(base(x).float(), target)
        sync(device)
        start = time.perf_counter()
        loss.backward()
        sync(device)
        times.append(time.perf_counter() - start)
    base.zero_grad(set_to_none=True)
    return statistics.median(times[1:])


def step_modes(args: argparse.Namespace) -> dict[str, Any]:
    """Parts 3 and 4 (and the timing half of 2): every mode round-robin at each link speed."""
    size, device = args.size, args.device
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = GPT(size).to(device)
    gen = torch.Generator().manual_seed(7)
    x, target = batch_of("gpt", size, device, gen)
    total_bytes = sum(p.numel() * p.element_size() for p in base.parameters())
    names = ["eager_ddp", "one_graph", "ddp_optimizer", "ddp_split", "ddp_split_grouped"]
    if device == "cuda":
        names.append("ddp_split_reduce_overhead")
    link = Link(device)
    result: dict[str, Any] = {"param_mib": total_bytes / MIB, "cap_mb": size.cap_mb, "links": {}}
    with process_group("nccl" if device == "cuda" else "gloo"):
        modes = []
        for name in names:
            # A piece per bucket (the default): this part changes the link's speed after warm-up.
            options: dict[str, Any] = {"min_piece_mb": None}
            if name == "ddp_split_grouped":
                options = {"min_piece_mb": total_bytes / MIB / 4}
            if name == "ddp_split_reduce_overhead":
                options = {"mode": "reduce-overhead", "min_piece_mb": None}
            mode = build_mode(name, base, inner=args.inner, cap_mb=size.cap_mb, options=options)
            mode.ddp.register_comm_hook(link, link_hook)
            modes.append(mode)
        pieces = {}
        with count_cuda_graphs() as graphs:
            for mode in modes:  # compile and warm up
                ddp_split_backend.ddp_split.records.clear()
                for _ in range(args.warmup):
                    timed_step(mode, x, target, link, device)
                records = ddp_split_backend.ddp_split.records
                pieces[mode.name] = max((len(r.plan.pieces) for r in records), default=None)
        result["cuda_graphs_recorded"] = graphs["count"] if device == "cuda" else NO_GPU
        bw = backward_seconds(base, x, target, device, reps=5)
        result["backward_s"] = bw
        links = (("instant", 0.0), ("comm_0.5x_backward", 0.5), ("comm_2x_backward", 2.0))
        for label, factor in links[:2] if args.quick else links:
            link.bytes_per_s = float("inf") if factor == 0 else total_bytes / (factor * bw)
            for mode in modes:
                mode.samples = []
            for _ in range(args.rounds):
                for mode in modes:
                    mode.samples.append(timed_step(mode, x, target, link, device))
            rows = {m.name: summarize(m.samples) for m in modes}
            if factor == 0:  # nothing to expose on an instant link
                for row in rows.values():
                    row["exposed_share"] = None
            result["links"][label] = {"gbps": None if factor == 0 else link.bytes_per_s / 1e9, "modes": rows}
        result["pieces"] = pieces
        close_ddp(*(m.ddp for m in modes), destroy_process_group=False)
    link.close()
    return result


def summarize(samples: list[dict[str, Any]]) -> dict[str, Any]:
    median = sorted(samples, key=lambda s: s["step"])[len(samples) // 2]
    peaks = [s["peak_mib"] for s in samples if s["peak_mib"] is not None]
    return {
        "step_ms": statistics.median(s["step"] for s in samples) * 1000,
        "exposed_share": median["exposed_share"],
        "peak_mib": max(peaks) if peaks else None,
        "buckets_ready_before_backward_end": sum(b["ready"] < 0 for b in median["buckets"]),
        "buckets": len(median["buckets"]),
        "ready_ms_vs_backward_end": [round(b["ready"] * 1000, 3) for b in median["buckets"]],
        "launched_ms_vs_backward_end": [round(b["launched"] * 1000, 3) for b in median["buckets"]],
    }


@contextlib.contextmanager
def count_cuda_graphs() -> Iterator[dict[str, int]]:
    """Count CUDA graph captures (inductor's cudagraph trees capture through torch.cuda.CUDAGraph)."""
    counter = {"count": 0}
    if not torch.cuda.is_available():
        yield counter
        return
    original = torch.cuda.CUDAGraph.capture_begin

    def counting(self: Any, *a: Any, **k: Any) -> Any:
        counter["count"] += 1
        return original(self, *a, **k)

    torch.cuda.CUDAGraph.capture_begin = counting
    try:
        yield counter
    finally:
        torch.cuda.CUDAGraph.capture_begin = original


def reduce_overhead(args: argparse.Namespace, steps: dict[str, Any] | None) -> dict[str, Any]:
    """Part 2: correctness of mode="reduce-overhead", CUDA graphs, hooks between graphs, memory."""
    if args.device != "cuda":
        return {"status": NO_GPU}
    case = Case("gpt", "fp32", "outside", 0.0)
    torch._dynamo.reset()
    torch.manual_seed(0)
    base = GPT(args.size).to("cuda")
    gen = torch.Generator().manual_seed(3)
    batches = [batch_of("gpt", args.size, "cuda", gen) for _ in range(args.steps)]
    with process_group("nccl"):
        eager = build_mode("eager_ddp", base, inner="inductor", cap_mb=args.size.cap_mb)
        expected = train(eager, case, batches, "cuda")
        graphed = build_mode("ddp_split_reduce_overhead", base, inner="inductor", cap_mb=args.size.cap_mb,
                             options={"mode": "reduce-overhead", "min_piece_mb": None})
        original = graphed.context

        def step_marked() -> contextlib.AbstractContextManager[Any]:
            torch.compiler.cudagraph_mark_step_begin()
            return original()

        graphed.context = step_marked
        with count_cuda_graphs() as graphs:
            actual = train(graphed, case, batches, "cuda")
        ok, worst, miss = compare(actual, expected, TOLERANCE["fp32"])
        close_ddp(eager.ddp, graphed.ddp, destroy_process_group=False)
    timing = (steps or {}).get("links", {}).get("comm_0.5x_backward", {}).get("modes", {})
    return {
        "ok": ok, "max_abs_diff": worst, "first_miss": miss, "cuda_graphs_recorded": graphs["count"],
        "hooks_between_graphs": timing.get("ddp_split_reduce_overhead", {}).get("buckets_ready_before_backward_end"),
        "buckets": timing.get("ddp_split_reduce_overhead", {}).get("buckets"),
        "peak_mib": timing.get("ddp_split_reduce_overhead", {}).get("peak_mib"),
        "peak_mib_default_mode": timing.get("ddp_split", {}).get("peak_mib"),
    }


# ---------------------------------------------------------------------------------------
# Part 5: first call with a fresh inductor cache
# ---------------------------------------------------------------------------------------


def first_call(args: argparse.Namespace) -> dict[str, Any]:
    rows = {}
    for mode in ("ddp_optimizer", "ddp_split"):
        with tempfile.TemporaryDirectory() as cache:
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "TRITON_CACHE_DIR": str(Path(cache) / "triton")}
            done = subprocess.run([sys.executable, __file__, "--first-call-mode", mode, "--inner", args.inner,
                                   *(["--quick"] if args.quick else [])],
                                  env=env, capture_output=True, text=True, timeout=args.rank_timeout)
            lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
            rows[mode] = json.loads(lines[-1]) if done.returncode == 0 and lines else {
                "error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}"}
    if "seconds" in rows["ddp_optimizer"] and "seconds" in rows["ddp_split"]:
        rows["ratio_split_to_ddp_optimizer"] = rows["ddp_split"]["seconds"] / rows["ddp_optimizer"]["seconds"]
    return rows


def first_call_main(args: argparse.Namespace) -> None:
    device, size = args.device, args.size
    torch.manual_seed(0)
    base = GPT(size).to(device)
    x, target = batch_of("gpt", size, device, torch.Generator().manual_seed(5))
    with process_group("nccl" if device == "cuda" else "gloo"):
        mode = build_mode(args.first_call_mode, base, inner=args.inner, cap_mb=size.cap_mb)
        sync(device)
        start = time.perf_counter()
        with mode.context():
            out = mode.model(x)
        F.mse_loss(out.float(), target).backward()
        sync(device)
        seconds = time.perf_counter() - start
        close_ddp(mode.ddp, destroy_process_group=False)
    print(json.dumps({"seconds": seconds}))


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------


def markdown(results: dict[str, Any]) -> str:
    env, lines = results["environment"], []
    lines.append(f"# GPU check: {env['device_name']} ({env['device']}), torch {env['torch']}, {env['date']}\n")
    lines.append(f"Command: `{env['command']}`\n")
    if env["device"] != "cuda":
        lines.append(f"**{NO_GPU}**: the CUDA parts (NCCL, triton, CUDA graphs, CUDA memory) did not run; "
                     "everything below ran on the CPU.\n")
    dt = results["device_tests"]
    lines.append("## Device-parameterised tests, CUDA half (`pytest -m cuda tests/test_devices.py`)\n")
    lines.append(f"{dt.get('status', dt.get('error'))}: {dt.get('summary', dt.get('note', ''))}\n")
    for part in ("correctness_world1", "correctness_two_ranks"):
        got = results[part]
        lines.append(f"## Correctness against eager DDP: world {got.get('world', '?')} over {got.get('backend', '?')}\n")
        lines.append("| case | result | max abs diff | pieces | note |\n|---|---|---|---|---|")
        for row in got.get("rows", []):
            note = row.get("error") or row.get("first_miss") or ""
            lines.append(f"| {row['case']} | {'pass' if row['ok'] else 'FAIL'} | {row['max_abs_diff']:.2e} | "
                         f"{row.get('pieces', '')} | {note} |")
        if "error" in got:
            lines.append(f"\npart failed: {got['error']}")
        lines.append("")
    ro = results["reduce_overhead"]
    lines.append("## mode=\"reduce-overhead\"\n")
    if ro.get("status") == NO_GPU:
        lines.append(f"{NO_GPU}.\n")
    else:
        lines.append("| correct | max abs diff | CUDA graphs recorded | buckets launched before backward end | "
                     "peak MiB (reduce-overhead / default) |\n|---|---|---|---|---|")
        lines.append(f"| {ro.get('ok')} | {ro.get('max_abs_diff', float('nan')):.2e} | {ro.get('cuda_graphs_recorded')} | "
                     f"{ro.get('hooks_between_graphs')}/{ro.get('buckets')} | {ro.get('peak_mib')} / "
                     f"{ro.get('peak_mib_default_mode')} |\n")
        if "error" in ro:
            lines.append(f"part failed: {ro['error']}\n")
    steps = results["steps"]
    if "links" in steps:
        lines.append(f"## Step time, memory and overlap (GPT-like, {steps['param_mib']:.0f} MiB of parameters, "
                     f"cap {steps['cap_mb']} MB, backward {steps['backward_s'] * 1000:.2f} ms)\n")
        for label, link in steps["links"].items():
            eager = link["modes"]["eager_ddp"]["step_ms"]
            speed = "instant" if link["gbps"] is None else f"{link['gbps']:.2f} GB/s"
            lines.append(f"### link: {label} ({speed})\n")
            lines.append("| mode | pieces | step ms | x eager DDP | exposed comm | buckets ready before backward end | "
                         "peak MiB |\n|---|---|---|---|---|---|---|")
            for name, row in link["modes"].items():
                exposed = "-" if row["exposed_share"] is None else f"{row['exposed_share']:.0%}"
                peak = NO_GPU if row["peak_mib"] is None else f"{row['peak_mib']:.0f}"
                lines.append(f"| {name} | {steps['pieces'].get(name) or '-'} | {row['step_ms']:.2f} | "
                             f"{row['step_ms'] / eager:.3f} | {exposed} | "
                             f"{row['buckets_ready_before_backward_end']}/{row['buckets']} | "
                             f"{peak} |")
            lines.append("")
    elif "error" in steps:
        lines.append(f"## Step time\n\npart failed: {steps['error']}\n")
    fc = results["first_call"]
    lines.append("## First call, fresh inductor cache (each mode in its own process)\n")
    lines.append("| mode | seconds |\n|---|---|")
    for mode in ("ddp_optimizer", "ddp_split"):
        row = fc.get(mode, {})
        lines.append(f"| {mode} | {row['seconds']:.1f} |" if "seconds" in row else f"| {mode} | {row.get('error', fc.get('error'))} |")
    if "ratio_split_to_ddp_optimizer" in fc:
        lines.append(f"\nddp_split / DDPOptimizer: {fc['ratio_split_to_ddp_optimizer']:.2f}")
    return "\n".join(lines) + "\n"


def device_tests(args: argparse.Namespace) -> dict[str, Any]:
    """Part 0: the CUDA half of the device-parameterised tests (tests/test_devices.py)."""
    if args.device != "cuda":
        return {"status": NO_GPU, "note": "their CPU half runs in the test suite"}
    try:
        import pytest  # noqa: F401
    except ImportError:
        return {"status": "pytest is not installed here"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider",
                           str(HERE.parent / "tests" / "test_devices.py")],
                          capture_output=True, text=True, timeout=args.rank_timeout, cwd=HERE.parent)
    tail = done.stdout.strip().splitlines()
    return {"status": "passed" if done.returncode == 0 else "FAILED", "summary": tail[-1] if tail else done.stderr[-500:],
            "output": done.stdout[-3000:]}


def run_part(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as error:  # recorded; the other parts still run
        result = {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc(limit=12)}
    result["seconds"] = time.perf_counter() - start
    print(f"[gpu_check] {name}: {result['seconds']:.1f} s{' (failed: ' + result['error'] + ')' if 'error' in result else ''}",
          flush=True)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inner", default="inductor", help="inner backend of every compiled mode")
    parser.add_argument("--quick", action="store_true", help="CPU smoke: fewer steps and rounds (CI)")
    parser.add_argument("--out-dir", default=str(HERE / "results"))
    parser.add_argument("--rank-timeout", type=int, default=240, help="seconds a child process may take")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--first-call-mode", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.size = SIZES[args.device]
    args.steps = 2 if args.quick else 3
    args.warmup = 1 if args.quick else 3
    args.rounds = 2 if args.quick else (15 if args.device == "cuda" else 7)
    args.cases = CASES[::2] if args.quick else CASES
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank is not None:
        rank_main(args)
        return 0
    if args.first_call_mode is not None:
        first_call_main(args)
        return 0
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else f"CPU ({os.cpu_count()} cores), {NO_GPU}"
    results: dict[str, Any] = {"environment": environment(device=args.device, device_name=device_name,
                                                          inner=args.inner, quick=args.quick)}
    results["device_tests"] = run_part("device tests", lambda: device_tests(args))
    results["correctness_world1"] = run_part("correctness, world 1", lambda: correctness_world1(args))
    results["correctness_two_ranks"] = run_part("correctness, 2 ranks", lambda: correctness_two_ranks(args))
    results["steps"] = run_part("step time and overlap", lambda: step_modes(args))
    results["reduce_overhead"] = run_part("reduce-overhead", lambda: reduce_overhead(args, results["steps"]))
    results["first_call"] = run_part("first call", lambda: first_call(args))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_check_{args.device}{'_quick' if args.quick else ''}"
    (out / f"{stem}.json").write_text(json.dumps(results, indent=1, default=str))
    report = markdown(results)
    (out / f"{stem}.md").write_text(report)
    print(report)
    failed = [row["case"] for part in ("correctness_world1", "correctness_two_ranks")
              for row in results[part].get("rows", []) if not row["ok"]]
    if results["device_tests"].get("status") == "FAILED":
        failed.append("device tests")
    broken = [p for p in ("device_tests", "correctness_world1", "correctness_two_ranks", "steps", "reduce_overhead", "first_call")
              if "error" in results[p]]
    if failed or broken:
        print(f"[gpu_check] failed cases: {failed}; parts that raised: {broken}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
