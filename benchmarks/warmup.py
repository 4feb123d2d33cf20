#!/usr/bin/env python
"""What a user waits for before training runs at speed: warm-up per mode (issue 32).

For each model and mode, a fresh subprocess (its own empty inductor cache, inductor's FX-graph
and AOTAutograd caches off, one gloo rank, 2 threads) trains ``--steps`` SGD steps and then
``--steady`` more. *Warm-up* is the first steps' wall time less as many steady steps (the
median): compiles and the first, slower steps together. Before the model, the
subprocess compiles a tiny unrelated function so that one-time costs (imports, inductor's
worker pool) are not charged to the first mode. Modes are interleaved, ``--rounds`` times.

Models:

* ``blocks48``: 48 residual blocks ``x + GELU(LayerNorm(Linear(512)(x)))``, batch 32,
  ``bucket_cap_mb=1``: 48 buckets (``compile_time.py``'s model).
* ``gpt2``: transformers' GPT-2 from a tiny config (6 layers, width 128), batch 8 x 64
  tokens, ``bucket_cap_mb=1`` (DDPOptimizer asserts on caps under its 1 MiB first bucket).
* ``transformer`` and ``bn_cnn``: the models of a new user's scripts (issues 31-33; the
  classes ``EncoderBlock`` and ``ConvNet`` of ``tests/models.py``): two ``TransformerEncoderLayer`` under
  bf16 autocast, batch 4 x 8 x 64, and four Conv2d + BatchNorm2d on 4 x 3 x 16 x 16 images;
  ``bucket_cap_mb=0.02``. DDPOptimizer asserts on that cap, so it is left out for them.

``--slow-link-ms D`` completes every bucket's allreduce D ms late in every mode (the tests'
``slow_allreduce``).

Modes, each ``DDP(torch.compile(model, backend=...))``, inner backend inductor:

* ``ddp_split``: ``backend="ddp_split"`` with default options (one piece per bucket),
  under ``own_split()``;
* ``ddp_split_auto``: the same with ``options={"min_piece_mb": "auto", "link_gbps": G}``
  (``--link-gbps G``, default 1);
* ``ddp_optimizer``: ``backend="inductor"``, torch's DDPOptimizer (``optimize_ddp=True``);
* ``one_graph``: ``backend="inductor"`` with ``optimize_ddp=False``.

Example::

    .venv/bin/python benchmarks/warmup.py                    # both models, 2 rounds (~12 min)
    .venv/bin/python benchmarks/warmup.py --models gpt2 --rounds 1
    .venv/bin/python benchmarks/warmup.py --models transformer bn_cnn --modes ddp_split ddp_split_auto \
        one_graph --slow-link-ms 2 --rounds 1         # a new user's models
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from _common import environment, free_port
from compile_time import ResidualStack, _warmup_fn

HERE = Path(__file__).resolve().parent
MODES = ("ddp_split", "ddp_split_auto", "ddp_optimizer", "one_graph")
MODELS = ("blocks48", "gpt2", "transformer", "bn_cnn")


def _model(name: str) -> tuple[torch.nn.Module, Any, float]:
    """The model, a function of (model, step) giving the loss, and the bucket cap in MiB."""
    if name == "blocks48":
        x = torch.randn(32, 512)
        return ResidualStack(48, 512), lambda m, step: m(x).pow(2).mean(), 1.0
    sys.path.insert(0, str(HERE.parent))
    if name in ("transformer", "bn_cnn"):
        from tests.models import ConvNet, EncoderBlock

        x = torch.randn(4, 8, 64) if name == "transformer" else torch.randn(4, 3, 16, 16)
        return (EncoderBlock() if name == "transformer" else ConvNet()), lambda m, step: m(x).square().mean(), 0.02
    from tests.torchvision_cpu import define_torchvision_operators

    define_torchvision_operators()  # transformers imports torchvision, a CUDA build beside CPU torch 2.13
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=6, n_embd=128, n_head=4, vocab_size=256, n_positions=64)
    tokens = torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))
    return GPT2LMHeadModel(config), lambda m, step: m(input_ids=tokens, labels=tokens).loss, 1.0


def _worker(mode: str, model_name: str, steps: int, steady: int, slow_link_ms: float, link_gbps: float) -> dict[str, Any]:
    torch._inductor.config.fx_graph_cache = False
    if hasattr(torch._functorch.config, "enable_autograd_cache"):
        torch._functorch.config.enable_autograd_cache = False
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    warm = torch.compile(_warmup_fn, backend="inductor")
    warm(torch.randn(16, 16, requires_grad=True)).sum().backward()

    import ddp_split_backend
    from ddp_split_backend import ddp_split

    torch.manual_seed(0)
    model, loss_of, cap = _model(model_name)
    if mode.startswith("ddp_split"):
        options = {"min_piece_mb": "auto", "link_gbps": link_gbps} if mode == "ddp_split_auto" else {}
        compiled = torch.compile(model, backend="ddp_split", options=options)
        context: Any = ddp_split_backend.own_split()
    else:
        compiled = torch.compile(model, backend="inductor")
        context = torch._dynamo.config.patch(optimize_ddp=mode == "ddp_optimizer")
    ddp = DDP(compiled, bucket_cap_mb=cap)
    if slow_link_ms:
        from tests.test_pieces import slow_allreduce

        ddp.register_comm_hook(slow_link_ms / 1e3, slow_allreduce)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    times = []
    with context:
        for step in range(steps + steady):
            start = time.perf_counter()
            loss_of(ddp, step).backward()
            optimizer.step()
            optimizer.zero_grad()
            times.append(time.perf_counter() - start)
    steady_s = statistics.median(times[steps:])
    records = list(ddp_split.records) if mode.startswith("ddp_split") else []
    result = {
        "mode": mode,
        "model": model_name,
        "first_steps_s": times[:steps],
        "steady_step_s": steady_s,
        "warmup_s": sum(times[:steps]) - steps * steady_s,
        "plans": [(r.plan.graph_name, len(r.plan.pieces), len(r.plan.buckets)) for r in records],
    }
    ddp_split_backend.close_ddp(ddp)  # reducers before the group: Note [Teardown deadlock]
    return result


def run_mode(mode: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix=f"inductor-cache-{mode}-") as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_FX_GRAPH_CACHE="0",
                   TORCHINDUCTOR_AUTOGRAD_CACHE="0", OMP_NUM_THREADS="2")
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", mode, "--models", model,
               "--steps", str(args.steps), "--steady", str(args.steady), "--slow-link-ms", str(args.slow_link_ms),
               "--link-gbps", str(args.link_gbps)]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode}/{model} worker failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def table(rows: dict[tuple[str, str], dict[str, Any]], models: list[str], modes: list[str]) -> str:
    lines = ["| model | mode | warm-up s (first steps - steady) | / one piece per bucket | / DDPOptimizer "
             "| steady step ms | pieces |", "|---|---|---|---|---|---|---|"]
    for model in models:
        per_bucket = rows.get((model, "ddp_split"), {}).get("warmup_s")
        optimizer = rows.get((model, "ddp_optimizer"), {}).get("warmup_s")
        for mode in modes:
            row = rows[(model, mode)]
            ratio = lambda base: f"{row['warmup_s'] / base:.2f}" if base else "-"  # noqa: E731
            pieces = ", ".join(str(p) for _, p, _ in row["plans"]) or "-"
            lines.append(f"| {model} | {mode} | {row['warmup_s']:.1f} | {ratio(per_bucket)} | {ratio(optimizer)} "
                         f"| {1e3 * row['steady_step_s']:.1f} | {pieces} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--steady", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--slow-link-ms", type=float, default=0.0,
                        help="every bucket's allreduce completes this many ms late, in every mode")
    parser.add_argument("--link-gbps", type=float, default=1.0, help="ddp_split_auto's link_gbps")
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--out", default=str(HERE / "results" / "warmup.json"))
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        import warnings

        warnings.filterwarnings("ignore")
        with contextlib.redirect_stdout(sys.stderr):
            result = _worker(args.worker, args.models[0], args.steps, args.steady, args.slow_link_ms, args.link_gbps)
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    runs = []
    for round_ in range(args.rounds):
        for model in args.models:
            for mode in args.modes:
                run = run_mode(mode, model, args)
                run["round"] = round_
                runs.append(run)
                print(f"[{round_}] {model:<9} {mode:<15} warm-up {run['warmup_s']:6.1f} s  steady "
                      f"{1e3 * run['steady_step_s']:6.1f} ms  plans {run['plans']}",
                      flush=True)
    rows = {}
    for model in args.models:
        for mode in args.modes:
            mine = [r for r in runs if r["model"] == model and r["mode"] == mode]
            rows[(model, mode)] = {
                "warmup_s": statistics.median(r["warmup_s"] for r in mine),
                "steady_step_s": statistics.median(r["steady_step_s"] for r in mine),
                "plans": mine[-1]["plans"],
            }
    text = table(rows, args.models, args.modes)
    print(text)
    Path(args.out).write_text(json.dumps({"environment": environment(), "runs": runs, "table": text}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
