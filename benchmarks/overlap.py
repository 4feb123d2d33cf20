#!/usr/bin/env python
"""How much gradient communication each DDP mode hides behind backward, on a simulated link.

A DDP comm hook hands every gradient bucket to ONE link thread, which "sends" buckets in
arrival order, each taking ``bytes / bandwidth`` (an ideal single link: a transfer starts when
its bucket is ready and the previous transfer has ended). The hook returns a Future that the
link thread completes, so DDP's backward ends only when the last bucket has been sent.
Sleeping uses no CPU, so compute is undisturbed (see the project notes, "Measuring
overlap without a network").

Modes (all in one process, stepped round-robin after warm-up):

* ``compute``          plain eager forward+backward, no DDP (the compute-only baseline)
* ``compute_compiled`` torch.compile(model, backend=inner), no DDP (a second baseline)
* ``eager_ddp``        DDP, eager
* ``no_split``         DDP(torch.compile(model, backend=inner)), optimize_ddp=False
* ``ddp_optimizer``    DDP(torch.compile(model, backend=inner)), optimize_ddp=True (torch's)
* ``ddp_split``        DDP(torch.compile(model, backend=DDPSplitBackend(...))) under own_split()

Every compiled mode has its own model class (its own ``forward`` code object) so that
Dynamo's code cache never hands one mode's graph to another; the inner backends are run one
after the other with ``torch._dynamo.reset()`` in between.

Example::

    .venv/bin/python benchmarks/overlap.py                 # full run (~5-8 min on 2 cores)
    .venv/bin/python benchmarks/overlap.py --quick         # smoke run (aot_eager, few steps)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import statistics
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_split_backend
from _common import environment as common_environment
from _common import free_port, own_code
from ddp_split_backend import DDPSplitBackend, SplitConfig

HERE = Path(__file__).resolve().parent
MODES = ("compute", "compute_compiled", "eager_ddp", "no_split", "ddp_optimizer", "ddp_split")
COMPILED_MODES = ("compute_compiled", "no_split", "ddp_optimizer", "ddp_split")


# --------------------------------------------------------------------------------------------
# Model: 16 x (Linear(1024, 1024) + GELU). One class per mode, each with its own forward.
# --------------------------------------------------------------------------------------------


class _MLPBase(nn.Module):
    def __init__(self, depth: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))


def _mlp_forward(self: _MLPBase, x: torch.Tensor) -> torch.Tensor:
    for layer in self.layers:
        x = F.gelu(layer(x))
    return x


MODEL_CLASS = {
    mode: type(f"MLP_{mode}", (_MLPBase,), {"forward": own_code(_mlp_forward, mode)}) for mode in MODES
}
"""One class per mode, each with its own ``forward`` code object (see ``_common.own_code``)."""
assert len({cls.forward.__code__ for cls in MODEL_CLASS.values()}) == len(MODEL_CLASS)


# --------------------------------------------------------------------------------------------
# The simulated link
# --------------------------------------------------------------------------------------------


@dataclass
class Transfer:
    bucket: int
    nbytes: int
    ready: float  # hook call time: the bucket's gradients are ready
    start: float  # the link starts sending it
    end: float  # planned end of the transfer (start + bytes / bandwidth)
    done: float = 0.0  # when the future was actually completed


class Link:
    """One link thread; buckets are sent one after another in the order they arrive."""

    def __init__(self) -> None:
        self.bandwidth = 1e9  # bytes per second
        self.transfers: list[Transfer] = []
        self.bucket_params: dict[str, list[list[str]]] = {}
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._free_at = 0.0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="link", daemon=True)
        self._thread.start()

    def reset(self) -> None:
        with self._lock:
            self.transfers = []

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def settle(self) -> None:
        """Nothing to wait for: DDP's backward already waited on every bucket's future."""

    def enqueue(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        ready = time.perf_counter()
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        self._queue.put((ready, bucket.index(), bucket.buffer(), fut))
        return fut

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            ready, index, buffer, fut = item
            nbytes = buffer.numel() * buffer.element_size()
            start = max(ready, self._free_at)
            end = start + nbytes / self.bandwidth
            self._free_at = end
            delay = end - time.perf_counter()
            if delay > 0:
                time.sleep(delay)
            transfer = Transfer(index, nbytes, ready, start, end, time.perf_counter())
            with self._lock:
                self.transfers.append(transfer)
            fut.set_result(buffer)


class ScheduledLink:
    """The same ideal link as :class:`Link`, kept as a schedule instead of a thread.

    A bucket is sent from when it is ready or the link is free, whichever is later, for
    ``bytes / bandwidth``; its future completes at once, and :meth:`settle`, called when
    backward returns, sleeps until the last send ends. :class:`Link`'s thread takes the GIL
    to complete each bucket, from the Python that runs backward (AOTAutograd's wrappers, the
    comm hook): a cost real communication (C++ threads) does not have, and one that grows
    with the backward the link overlaps. Here nothing runs beside backward. What this drops
    is DDP copying a late bucket back after it arrives: the step ends at the later of
    backward's end and the last send's, a bucket's copy-back early.
    """

    def __init__(self) -> None:
        self.bandwidth = 1e9  # bytes per second
        self.transfers: list[Transfer] = []
        self.bucket_params: dict[str, list[list[str]]] = {}
        self._free_at = 0.0

    def reset(self) -> None:
        self.transfers = []

    def close(self) -> None:
        pass

    def enqueue(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        ready = time.perf_counter()
        buffer = bucket.buffer()
        nbytes = buffer.numel() * buffer.element_size()
        start = max(ready, self._free_at)
        self._free_at = end = start + nbytes / self.bandwidth
        self.transfers.append(Transfer(bucket.index(), nbytes, ready, start, end, end))
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(buffer)
        return fut

    def settle(self) -> None:
        """Wait until the last bucket sent so far has arrived."""
        delay = self._free_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)


@dataclass
class HookState:
    link: Link | ScheduledLink
    mode: str
    names: dict[int, str]
    record_params: bool = True


def link_hook(state, bucket):  # no annotations: DDP checks them, and they are strings here
    if state.record_params:
        # Bucket contents after DDP's first-iteration rebuild (recorded on measured steps).
        table = state.link.bucket_params.setdefault(state.mode, [])
        index = bucket.index()
        while len(table) <= index:
            table.append([])
        table[index] = [state.names.get(id(p), "?") for p in bucket.parameters()]
    return state.link.enqueue(bucket)


# --------------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------------


class CountingBackend:
    """The registered inner backend, counting how many graphs (pieces) it compiles."""

    def __init__(self, name: str) -> None:
        from torch._dynamo.backends.registry import lookup_backend

        self.name = name
        self.fn = lookup_backend(name)
        self.calls = 0
        self.__name__ = name

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.fn(gm, example_inputs, **kwargs)


@dataclass
class Mode:
    name: str
    model: Callable[[torch.Tensor], torch.Tensor]
    params: list[torch.nn.Parameter]
    context: Callable[[], contextlib.AbstractContextManager[Any]]
    ddp: DDP | None = None
    backend: Any = None
    compile_s: float = 0.0
    samples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)


def _no_ddp_optimizer() -> contextlib.AbstractContextManager[Any]:
    return torch._dynamo.config.patch(optimize_ddp=False)


def _ddp_optimizer() -> contextlib.AbstractContextManager[Any]:
    return torch._dynamo.config.patch(optimize_ddp=True)


def build_mode(name: str, inner: str, args: argparse.Namespace, link: Link, state: dict) -> Mode:
    torch.manual_seed(0)
    module = MODEL_CLASS[name](args.depth, args.width)
    params = list(module.parameters())
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    backend: Any = None
    if name == "compute":
        return Mode(name, module, params, context)
    if name == "compute_compiled":
        backend = CountingBackend(inner)
        return Mode(name, torch.compile(module, backend=backend), params, context, backend=backend)
    names = {id(p): n for n, p in module.named_parameters()}
    if name == "eager_ddp":
        target: nn.Module = module
    elif name == "no_split":
        backend = CountingBackend(inner)
        target, context = torch.compile(module, backend=backend), _no_ddp_optimizer
    elif name == "ddp_optimizer":
        backend = CountingBackend(inner)
        target, context = torch.compile(module, backend=backend), _ddp_optimizer
    elif name == "ddp_split":
        # A piece per bucket, as DDPOptimizer cuts (step_overhead.py compares auto's groupings).
        backend = DDPSplitBackend(SplitConfig(inner=inner, bucket_cap_mb=args.bucket_cap_mb, min_piece_mb=None))
        target, context = torch.compile(module, backend=backend), ddp_split_backend.own_split
    else:
        raise ValueError(name)
    ddp = DDP(target, bucket_cap_mb=args.bucket_cap_mb, gradient_as_bucket_view=args.bucket_view)
    ddp.register_comm_hook(HookState(link, name, names), link_hook)
    return Mode(name, ddp, params, context, ddp=ddp, backend=backend)


def run_step(mode: Mode, x: torch.Tensor, link: Link) -> dict[str, Any]:
    for p in mode.params:
        p.grad = None
    link.reset()
    with mode.context():
        t0 = time.perf_counter()
        out = mode.model(x)
        t1 = time.perf_counter()
        out.sum().backward()
        t2 = time.perf_counter()
    transfers = sorted(link.transfers, key=lambda t: t.ready)
    return {
        "step": t2 - t0,
        "forward": t1 - t0,
        "backward": t2 - t1,
        "transfers": [
            {
                "bucket": t.bucket,
                "nbytes": t.nbytes,
                "ready": t.ready - t1,
                "start": t.start - t1,
                "end": t.end - t1,
                "done": t.done - t1,
            }
            for t in transfers
        ],
    }


def pieces_of(mode: Mode) -> int | None:
    if isinstance(mode.backend, DDPSplitBackend):
        return len(mode.backend.records[-1].plan.pieces) if mode.backend.records else None
    if isinstance(mode.backend, CountingBackend):
        return mode.backend.calls
    return None


def last_piece_bytes(mode: Mode) -> int | None:
    """Bytes of the piece backward reaches last (piece 0): its gradients can never overlap."""
    if isinstance(mode.backend, DDPSplitBackend) and mode.backend.records:
        return mode.backend.records[-1].plan.pieces[0].nbytes
    return None


def ddp_buckets(mode: Mode) -> dict[str, Any]:
    if mode.ddp is None:
        return {}
    data = mode.ddp._get_ddp_logging_data()
    keep = ("bucket_sizes", "rebuilt_bucket_sizes", "has_rebuilt_buckets", "rebuilt_per_bucket_param_indices")
    return {k: data.get(k) for k in keep if k in data}


# --------------------------------------------------------------------------------------------
# Statistics and output
# --------------------------------------------------------------------------------------------


def summarize(
    modes: dict[str, Mode], bandwidth: float, key: str, baseline_key: str | None = None
) -> dict[str, dict[str, Any]]:
    compute = statistics.median(s["step"] for s in modes["compute"].samples[key])
    compute_compiled = (
        statistics.median(s["step"] for s in modes["compute_compiled"].samples[key])
        if "compute_compiled" in modes
        else None
    )
    rows: dict[str, dict[str, Any]] = {}
    for name, mode in modes.items():
        samples = mode.samples[key]
        step = statistics.median(s["step"] for s in samples)
        row: dict[str, Any] = {
            "step_ms": 1e3 * step,
            "forward_ms": 1e3 * statistics.median(s["forward"] for s in samples),
            "backward_ms": 1e3 * statistics.median(s["backward"] for s in samples),
            "step_min_ms": 1e3 * min(s["step"] for s in samples),
            "step_over_compute": step / compute,
            "pieces": pieces_of(mode),
            "last_piece_bytes": last_piece_bytes(mode),
            "compile_s": mode.compile_s,
        }
        transfers = samples[0]["transfers"]
        if transfers:
            total_bytes = sum(t["nbytes"] for t in transfers)
            comm = total_bytes / bandwidth
            last = max(transfers, key=lambda t: t["ready"])
            base = None
            if baseline_key is not None and baseline_key in mode.samples:
                base = statistics.median(s["step"] for s in mode.samples[baseline_key])
            row.update(
                buckets=len(transfers),
                comm_ms=1e3 * comm,
                exposed=(step - compute) / comm if comm else None,
                exposed_vs_compiled_compute=(
                    (step - compute_compiled) / comm if compute_compiled is not None and comm else None
                ),
                # against the same mode with an infinitely fast link: communication only, without
                # DDP's own costs (bucket copies, hooks, piece overhead)
                exposed_net=(step - base) / comm if base is not None and comm else None,
                step_inf_bw_ms=1e3 * base if base is not None else None,
                last_ready_bytes=last["nbytes"],
                last_ready_fraction=last["nbytes"] / total_bytes,
                first_ready_ms=1e3 * statistics.median(
                    min(t["ready"] for t in s["transfers"]) for s in samples
                ),
                last_ready_ms=1e3 * statistics.median(
                    max(t["ready"] for t in s["transfers"]) for s in samples
                ),
                # link still busy after the last bucket became ready (the part nothing hides)
                drain_ms=1e3 * statistics.median(
                    max(t["done"] for t in s["transfers"]) - max(t["ready"] for t in s["transfers"])
                    for s in samples
                ),
                # backward still running after the link finished (DDP finalize, copies, noise)
                after_link_ms=1e3 * statistics.median(
                    s["backward"] - max(t["done"] for t in s["transfers"]) for s in samples
                ),
            )
        rows[name] = row
    return rows


def median_sample(samples: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(samples, key=lambda s: s["step"])
    return ordered[len(ordered) // 2]


def fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: dict[str, dict[str, Any]]) -> str:
    head = (
        f"{'mode':<17}{'step ms':>9}{'fwd ms':>8}{'bwd ms':>8}{'step/comp':>10}{'exposed':>9}"
        f"{'exp(cc)':>9}{'exp(net)':>9}{'pieces':>7}{'bkts':>6}{'last MB':>9}{'piece0 MB':>10}{'1st rdy':>8}{'drain':>7}{'post':>6}"
    )
    lines = [head]
    for name, r in rows.items():
        lines.append(
            f"{name:<17}{r['step_ms']:>9.1f}{r['forward_ms']:>8.1f}{r['backward_ms']:>8.1f}"
            f"{r['step_over_compute']:>10.3f}{fmt(r.get('exposed'), '.1%'):>9}"
            f"{fmt(r.get('exposed_vs_compiled_compute'), '.1%'):>9}"
            f"{fmt(r.get('exposed_net'), '.1%'):>9}{fmt(r['pieces'], 'd'):>7}"
            f"{fmt(r.get('buckets'), 'd'):>6}{fmt(r.get('last_ready_bytes', None) and r['last_ready_bytes'] / 1e6, '.2f'):>9}"
            f"{fmt(r.get('last_piece_bytes', None) and r['last_piece_bytes'] / 1e6, '.2f'):>10}"
            f"{fmt(r.get('first_ready_ms'), '.1f'):>8}{fmt(r.get('drain_ms'), '.1f'):>7}"
            f"{fmt(r.get('after_link_ms'), '.1f'):>6}"
        )
    return "\n".join(lines)


def plot_timeline(samples: dict[str, dict[str, Any]], title: str, path: Path) -> None:
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in ("ddp_optimizer", "ddp_split") if n in samples]
    fig, axes = plt.subplots(len(names), 1, figsize=(11, 2.6 * len(names) + 0.8), sharex=True)
    if len(names) == 1:
        axes = [axes]
    for ax, name in zip(axes, names):
        sample = samples[name]
        transfers = sorted(sample["transfers"], key=lambda t: t["ready"])
        for row, t in enumerate(transfers):
            ax.barh(row, 1e3 * (t["end"] - t["start"]), left=1e3 * t["start"], height=0.6,
                    color="tab:blue", alpha=0.75, label="transfer" if row == 0 else None)
            ax.plot(1e3 * t["ready"], row, "k|", markersize=9, mew=2,
                    label="gradients ready" if row == 0 else None)
        bwd = 1e3 * sample["backward"]
        ax.axvline(bwd, color="tab:red", ls="--", lw=1, label=f"backward returns ({bwd:.0f} ms)")
        last_ready = 1e3 * max(t["ready"] for t in transfers)
        ax.axvline(last_ready, color="tab:gray", ls=":", lw=1, label=f"last gradient ready ({last_ready:.0f} ms)")
        ax.set_ylabel("bucket (ready order)")
        ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_title(f"{name}: step {1e3 * sample['step']:.0f} ms (forward {1e3 * sample['forward']:.0f} ms)",
                     fontsize=10)
        ax.legend(loc="upper right", fontsize=8)
        ax.set_xlim(left=0)
        ax.invert_yaxis()
    axes[-1].set_xlabel("ms since backward start")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------


def environment() -> dict[str, Any]:
    return common_environment(torch_threads=torch.get_num_threads())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--inner", nargs="+", default=None,
                   help="inner backends to run (default: inductor aot_eager; --quick: aot_eager)")
    p.add_argument("--bandwidth", nargs="+", type=float, default=None,
                   help="link bandwidths in GB/s (default: 1 0.25; --quick: 1)")
    p.add_argument("--comm-ratio", nargs="+", type=float, default=None,
                   help="instead of --bandwidth: choose each bandwidth so that total comm = RATIO x "
                        "the compute-only step measured after warm-up (robust to a loaded CPU); "
                        "0.6 ~ 1 GB/s and 2.4 ~ 0.25 GB/s on a quiet machine")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--bucket-cap-mb", type=float, default=4.0)
    p.add_argument("--warmup", type=int, default=None, help="warm-up steps per mode (default 3)")
    p.add_argument("--steps", type=int, default=None,
                   help="measured round-robin rounds per bandwidth (default 20)")
    p.add_argument("--bucket-view", action="store_true",
                   help="DDP gradient_as_bucket_view=True (no copy of gradients out of the buckets)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--quick", action="store_true", help="short smoke run")
    p.add_argument("--out", type=Path, default=HERE / "results" / "overlap.json")
    p.add_argument("--timeline", type=str, default=str(HERE / "overlap_timeline.png"),
                   help="timeline PNG (first inner backend, first bandwidth); '' to skip")
    args = p.parse_args(argv)
    args.inner = args.inner or (["aot_eager"] if args.quick else ["inductor", "aot_eager"])
    args.bandwidth = args.bandwidth or ([1.0] if args.quick else [1.0, 0.25])
    args.warmup = args.warmup if args.warmup is not None else (2 if args.quick else 3)
    args.steps = args.steps if args.steps is not None else (4 if args.quick else 20)
    if "compute" not in args.modes:
        args.modes.insert(0, "compute")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message=".*DDPOptimizer.*")
    if args.threads:
        torch.set_num_threads(args.threads)
    torch._dynamo.config.cache_size_limit = 64
    torch._dynamo.config.accumulated_cache_size_limit = 512
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    link = Link()
    result: dict[str, Any] = {"environment": environment(), "config": {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}, "runs": []}
    modes: dict[str, Mode] = {}
    try:
        for inner_index, inner in enumerate(args.inner):
            torch._dynamo.reset()
            modes = {}
            x = torch.randn(args.batch, args.width)
            for name in args.modes:
                modes[name] = build_mode(name, inner, args, link, {})
            # Warm-up (compiles on the first step; DDP rebuilds its buckets after the first).
            for name, mode in modes.items():
                t0 = time.perf_counter()
                run_step(mode, x, link)
                mode.compile_s = time.perf_counter() - t0
                print(f"[{inner}] {name}: first step {mode.compile_s:.1f} s", flush=True)
            for _ in range(args.warmup - 1):
                for mode in modes.values():
                    run_step(mode, x, link)
            settings: list[tuple[str, float, float | None]] = [(f"{g:g}", g, None) for g in args.bandwidth]
            # infinitely fast link first: each mode's step without communication (baseline)
            settings.insert(0, ("inf", float("inf"), None))
            if args.comm_ratio:
                # Bandwidth chosen so that total comm = ratio x the compute-only step measured now
                # (keeps the comm/compute balance when other load slows the CPU down).
                compute_s = statistics.median(run_step(modes["compute"], x, link)["step"] for _ in range(5))
                probe = next(m for m in modes.values() if m.ddp is not None)
                total_bytes = sum(t["nbytes"] for t in run_step(probe, x, link)["transfers"])
                settings = [("inf", float("inf"), None)] + [
                    (f"r{r:g}", total_bytes / (r * compute_s) / 1e9, r) for r in args.comm_ratio
                ]
            for bw_index, (key, gbps, ratio) in enumerate(settings):
                link.bandwidth = gbps * 1e9
                for mode in modes.values():  # one unmeasured round at this bandwidth
                    run_step(mode, x, link)
                    mode.samples[key] = []
                for _ in range(args.steps):
                    for mode in modes.values():
                        mode.samples[key].append(run_step(mode, x, link))
                rows = summarize(modes, gbps * 1e9, key, baseline_key="inf")
                bw_label = f"{gbps:.3g} GB/s" + (f" (comm = {ratio:g} x compute)" if ratio else "")
                title = (f"inner={inner}, {bw_label}, {args.depth} x Linear({args.width})+GELU, "
                         f"batch {args.batch}, cap {args.bucket_cap_mb:g} MB, "
                         f"median of {args.steps} round-robin steps")
                print(f"\n{title}\n{table(rows)}", flush=True)
                medians = {n: median_sample(m.samples[key]) for n, m in modes.items()}
                run = {
                    "inner": inner,
                    "bandwidth_gbps": gbps,
                    "comm_ratio": ratio,
                    "rows": rows,
                    "targets": targets(rows, gbps),
                    "median_step_timeline": {n: s for n, s in medians.items() if s["transfers"]},
                    "steps_ms": {n: [1e3 * s["step"] for s in m.samples[key]] for n, m in modes.items()},
                }
                print(json.dumps(run["targets"], indent=None))
                result["runs"].append(run)
                if args.timeline and str(args.timeline) and inner_index == 0 and bw_index == 1:
                    plot_timeline(medians, title, Path(args.timeline))
                    print(f"timeline: {args.timeline}")
            result.setdefault("ddp_buckets", {})[inner] = {n: ddp_buckets(m) for n, m in modes.items()}
            result.setdefault("bucket_params", {})[inner] = dict(link.bucket_params)
            link.bucket_params.clear()
            split = modes.get("ddp_split")
            if split is not None and split.backend.records:
                result.setdefault("ddp_split_plan", {})[inner] = split.backend.records[-1].plan.table()
                print(split.backend.records[-1].plan.table())
    finally:
        link.close()
        # Reducers before the group: Note [Teardown deadlock] in ddp_split_backend/teardown.py.
        ddp_split_backend.close_ddp(*(m.ddp for m in modes.values() if m.ddp is not None))
    result["environment"]["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {args.out}")
    return 0


def targets(rows: dict[str, dict[str, Any]], gbps: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    split, opt = rows.get("ddp_split"), rows.get("ddp_optimizer")
    if split is None:
        return out
    out["ddp_split_exposed"] = split.get("exposed")
    out["ddp_split_exposed_net"] = split.get("exposed_net")
    if opt is not None:
        out["ddp_optimizer_exposed"] = opt.get("exposed")
    if opt is not None:
        out["ddp_split_step_over_ddp_optimizer"] = split["step_ms"] / opt["step_ms"]
    if "comm_ms" in split:
        out["ddp_split_step_over_fwd_plus_comm"] = split["step_ms"] / (split["forward_ms"] + split["comm_ms"])
        compute_fwd = rows["compute"]["forward_ms"]
        out["ddp_split_step_over_compute_fwd_plus_comm"] = split["step_ms"] / (compute_fwd + split["comm_ms"])
        if opt is not None:
            out["ddp_optimizer_step_over_fwd_plus_comm"] = opt["step_ms"] / (opt["forward_ms"] + opt["comm_ms"])
    return out


if __name__ == "__main__":
    raise SystemExit(main())
