#!/usr/bin/env python
"""Time to plan and split large FX graphs: ddp_split vs torch.fx.passes.split_module.

Synthetic Dynamo-like graphs of 1k .. 50k nodes: a chain of small ops with a residual add
every 25 nodes, a parameter use every ``--nodes-per-param`` nodes (half of the parameters are
placeholders, half ``get_attr`` attributes; 1 MiB each, on the meta device), grad-mode
regions (``torch._C._set_grad_enabled(False)`` ... ``(True)``, 35 of every 70 nodes) and
autocast regions (``_enter_autocast('cpu', torch.bfloat16, True, None)`` ... ``_exit_autocast``,
100 of every 130 nodes). Region periods do not divide the parameter period, so most cuts fall
inside a region (column "cuts in rgn").

For each graph, ddp_split plans the cuts (``bucket_cap_mb``, default 4: a piece every ~200
nodes) and splits; ``split_module`` (what torch's DDPOptimizer uses) splits the same graph
with the same partition. Reported: microseconds per graph node, best of ``--repeats``.

ddp_split is timed the way ``DDPSplitBackend.__call__`` runs it: one ``layout_graph`` (state
simulation + legal cut positions), the parameter table and bucket plan on that layout, then
``split_graph`` (column "ddp_split"; "shared lay" is the sum of the three parts timed apart).

Example::

    .venv/bin/python benchmarks/split_scaling.py               # 1k 5k 25k 50k (~2-3 min)
    .venv/bin/python benchmarks/split_scaling.py --quick       # 1k 5k, one repeat
    .venv/bin/python benchmarks/split_scaling.py --lazy        # + lazy-GraphModule experiment
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.passes.split_module import split_module

from _common import environment
from ddp_split_backend import SplitConfig, plan_split
from ddp_split_backend.backend import _plan_graph
from ddp_split_backend.layout import layout_graph
from ddp_split_backend.params import find_params
from ddp_split_backend.plan import plan_buckets
from ddp_split_backend.split import split_graph
from ddp_split_backend.state import Ambient

HERE = Path(__file__).resolve().parent
PARAM_NUMEL = 262_144  # 1 MiB of float32

_UNARY = (torch.relu, torch.sigmoid, torch.tanh, torch.neg, torch.abs)


def build_graph(nodes: int, nodes_per_param: int) -> tuple[fx.GraphModule, list[Any]]:
    """A Dynamo-like graph with about ``nodes`` nodes (placeholders and output included)."""
    params_total = max(1, nodes // nodes_per_param)
    root = nn.Module()
    graph = fx.Graph()
    x = graph.placeholder("l_x_")
    example_inputs: list[Any] = [torch.empty(8, 8, device="meta")]
    as_placeholder = [k for k in range(params_total) if k % 2 == 0]
    placeholder_of: dict[int, fx.Node] = {}
    for k in as_placeholder:
        placeholder_of[k] = graph.placeholder(f"l_self_modules_layers_{k}_parameters_weight_")
        example_inputs.append(nn.Parameter(torch.empty(PARAM_NUMEL, device="meta")))
    for k in range(params_total):
        if k not in placeholder_of:
            root.register_parameter(f"w{k}", nn.Parameter(torch.empty(PARAM_NUMEL, device="meta")))
    count = len(graph.nodes) + 1  # + output
    y = skip = x
    autocast: fx.Node | None = None
    k = 0
    pos = 0
    while count < nodes:
        if pos % nodes_per_param == 0 and k < params_total:
            if k in placeholder_of:
                w = placeholder_of[k]
            else:
                w = graph.get_attr(f"w{k}")
                count += 1
            y = graph.call_function(torch.mul, (y, w))
            k += 1
        elif pos % 130 == 10 and autocast is None:
            autocast = graph.call_function(
                torch.amp.autocast_mode._enter_autocast, ("cpu", torch.bfloat16, True, None)
            )
        elif pos % 130 == 110 and autocast is not None:
            graph.call_function(torch.amp.autocast_mode._exit_autocast, (autocast,))
            autocast = None
        elif pos % 70 == 5:
            graph.call_function(torch._C._set_grad_enabled, (False,))
        elif pos % 70 == 40:
            graph.call_function(torch._C._set_grad_enabled, (True,))
        elif pos % 25 == 0:
            y = graph.call_function(torch.add, (y, skip))
            skip = y
        else:
            y = graph.call_function(_UNARY[pos % len(_UNARY)], (y,))
        count += 1
        pos += 1
    if autocast is not None:
        graph.call_function(torch.amp.autocast_mode._exit_autocast, (autocast,))
    graph.output((y,))
    return fx.GraphModule(root, graph), example_inputs


def best_of(repeats: int, fn: Callable[[], Any]) -> float:
    best = float("inf")
    for _ in range(repeats):
        gc.collect()
        t0 = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - t0)
        del result
    return best


class _LazyFx:
    """``torch.fx`` as ``ddp_split_backend.split`` sees it, with GraphModule made lazy
    (``_LazyGraphModule`` defers code generation to the first call, as split_module_simple
    does). Only for the ``--lazy`` experiment; the package itself is unchanged."""

    def __init__(self) -> None:
        from torch.fx._lazy_graph_module import _LazyGraphModule

        self.GraphModule = _LazyGraphModule

    def __getattr__(self, name: str) -> Any:
        return getattr(fx, name)


def measure(nodes: int, args: argparse.Namespace) -> dict[str, Any]:
    gm, example_inputs = build_graph(nodes, args.nodes_per_param)
    n = len(gm.graph.nodes)
    config = SplitConfig(bucket_cap_mb=args.bucket_cap_mb)
    ambient = Ambient.capture()

    plan = plan_split(gm, example_inputs, config=config)
    layout = layout_graph(gm, ambient)
    pieces = len(plan.buckets)
    # The same partition for split_module: compute node -> piece index.
    piece_of: dict[fx.Node, int] = {}
    for b in plan.buckets:
        for node in layout.nodes[b.start : b.stop]:
            piece_of[node] = b.piece
    in_regions = sum(
        1 for b in plan.buckets[1:] if layout.states[b.start].regions or not layout.states[b.start].grad
    )

    def ddp_split_backend_path() -> Any:
        planned = _plan_graph(gm, example_inputs, config, None, "")  # the backend's own path
        return split_graph(gm, planned.layout, planned.plan.cuts)

    def layout_only() -> Any:
        return layout_graph(gm, ambient)

    def params_and_plan() -> Any:
        params = find_params(gm, layout.nodes, example_inputs)
        return plan_buckets(layout, params, config.caps())

    def split_only() -> Any:
        return split_graph(gm, layout, plan.cuts)

    def torch_split_module() -> Any:
        return split_module(gm, None, lambda node: piece_of[node])  # type: ignore[arg-type]

    r = args.repeats
    t_total = best_of(r, ddp_split_backend_path)
    t_layout = best_of(r, layout_only)
    t_plan = best_of(r, params_and_plan)
    t_split = best_of(r, split_only)
    t_torch = float("nan") if args.skip_split_module else best_of(r, torch_split_module)
    t_lazy = float("nan")
    if args.lazy:
        import ddp_split_backend.split as split_mod
        from unittest import mock

        with mock.patch.object(split_mod, "fx", _LazyFx()):
            t_lazy = best_of(r, ddp_split_backend_path)
    us = 1e6 / n
    return {
        "nodes": n,
        "pieces": pieces,
        "cuts_inside_state_regions": in_regions,
        "ddp_split_us_per_node": t_total * us,
        "ddp_split_shared_layout_us_per_node": (t_layout + t_plan + t_split) * us,
        "layout_us_per_node": t_layout * us,
        "params_plan_us_per_node": t_plan * us,
        "split_graph_us_per_node": t_split * us,
        "split_module_us_per_node": t_torch * us,
        "ddp_split_lazy_experiment_us_per_node": t_lazy * us,
        "ddp_split_s": t_total,
        "split_module_s": t_torch,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", nargs="+", type=int, default=None,
                   help="graph sizes in nodes (default 1000 5000 25000 50000; --quick: 1000 5000)")
    p.add_argument("--nodes-per-param", type=int, default=50)
    p.add_argument("--bucket-cap-mb", type=float, default=4.0)
    p.add_argument("--repeats", type=int, default=None, help="best of N (default 3; --quick: 1)")
    p.add_argument("--skip-split-module", action="store_true", help="time ddp_split only")
    p.add_argument("--lazy", action="store_true",
                   help="also time ddp_split with its pieces built as _LazyGraphModule (experiment)")
    p.add_argument("--quick", action="store_true", help="short smoke run")
    p.add_argument("--out", type=Path, default=HERE / "results" / "split_scaling.json")
    args = p.parse_args(argv)
    args.sizes = args.sizes or ([1000, 5000] if args.quick else [1000, 5000, 25000, 50000])
    args.repeats = args.repeats or (1 if args.quick else 3)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    env = environment()
    header = (f"{'nodes':>7}{'pieces':>8}{'cuts in rgn':>12}{'ddp_split':>11}{'shared lay':>11}"
              f"{'layout':>8}{'plan':>7}{'split':>7}{'split_module':>14}{'ratio':>7}")
    print(f"µs per node (ratio = split_module / ddp_split), best of {args.repeats}; cap {args.bucket_cap_mb:g} MB, "
          f"1 MiB parameter every {args.nodes_per_param} nodes")
    print(header, flush=True)
    rows = []
    for size in args.sizes:
        r = measure(size, args)
        rows.append(r)
        print(f"{r['nodes']:>7}{r['pieces']:>8}{r['cuts_inside_state_regions']:>12}"
              f"{r['ddp_split_us_per_node']:>11.1f}{r['ddp_split_shared_layout_us_per_node']:>11.1f}"
              f"{r['layout_us_per_node']:>8.1f}{r['params_plan_us_per_node']:>7.1f}"
              f"{r['split_graph_us_per_node']:>7.1f}{r['split_module_us_per_node']:>14.1f}"
              f"{r['split_module_us_per_node'] / r['ddp_split_us_per_node']:>7.2f}"
              f"{r['ddp_split_lazy_experiment_us_per_node']:>10.1f}", flush=True)
    env["loadavg_end"] = os.getloadavg()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    args.out.write_text(json.dumps({"environment": env, "config": config, "rows": rows}, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
