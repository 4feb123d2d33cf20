"""What a piece costs per step, estimated before anything is compiled (``min_piece_mb="auto"``).

Note [Piece cost model]
-----------------------
Each piece adds a *fixed* cost per step, whatever it computes: one AOTAutograd runtime
wrapper and autograd Function forward and backward, one more autograd node, and one turn of
ddp_split's loop. ``benchmarks/profile_ops.py`` measured where it goes (RESULTS.md, "Where
the split's cost goes": AOTAutograd's wrappers 0.29 ms, the engine 0.05 ms, our loop 0.055 ms
per piece on the project CPU), and ``benchmarks/step_overhead.py`` measured it whole per inner
backend (:data:`FIXED_COST_S`).

A bucket's *backward* time is estimated from what its nodes compute, read off the example
values Dynamo recorded (fake tensors, no compute): matrix products and convolutions by their
FLOPs, and every node by the bytes it reads and writes and one op's launch; backward does
about twice forward's work (gradients with respect to inputs and weights). These become
seconds through fixed rates per device type (:data:`DEVICE_RATES`), never timed at compile
time: a plan is a function of the graph, its parameters and the options only, so every rank
makes the same one (two ranks timing their own host could rank two nearly equal groupings
differently).

A bucket's communication cannot start when its piece's backward ends, but when DDP launches
it: after a piece, the engine accumulates its gradients one by one, DDP's reducer copies each
into its bucket, and a full bucket calls the comm hook, one bucket after another on the thread
that runs backward (:func:`bucket_launch_s`: a fixed host cost and the copy). Where that is
slower than the link, the link keeps up with the launches of one piece, and more pieces
overlap little more (on the project CPU DDP launched the 1 MiB buckets of one piece 0.10 ms
apart, RESULTS.md, "DDP's launch of a bucket").

The estimates are for choosing a grouping, not for reporting: they only need to rank
groupings the way the real step times would.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from . import _torch

__all__ = [
    "DEVICE_RATES", "FIXED_COST_S", "DeviceRates", "bucket_launch_s", "device_rates", "fixed_cost_s",
    "node_backward_s", "value_bytes",
]

FIXED_COST_S = {"inductor": 0.10e-3, "aot_eager": 0.135e-3}
"""Per-step cost of one piece, measured on the project CPU: (x1 - x32) / 31 on the overhead
model over an instant link (RESULTS.md 2026-12-07, grid run 2: 0.094 and 0.134 ms; 0.18 and
0.31 ms on 2026-12-04, before the per-step path got cheaper). Other inner backends use the
larger one."""

_MATMULS = {torch.matmul, operator.matmul, torch.mm, torch.bmm, torch.addmm, torch.baddbmm, torch.addbmm}
_MATMUL_METHODS = {"matmul", "mm", "bmm", "addmm", "baddbmm", "__matmul__"}
_CONVS = {torch.conv1d, torch.conv2d, torch.conv3d, F.conv1d, F.conv2d, F.conv3d,
          torch.conv_transpose1d, torch.conv_transpose2d, torch.conv_transpose3d}
_LINEARS = {F.linear}  # the builtin Dynamo records for F.linear and nn.Linear


@dataclass(frozen=True, slots=True)
class DeviceRates:
    """How fast a device computes, for estimates."""

    flops_per_s: float
    bytes_per_s: float
    op_s: float
    """One small op from Python (dispatch and launch, no work)."""
    bucket_s: float
    """DDP's host work to launch one bucket, its copy aside (accumulation and reducer hooks,
    the comm hook's call)."""
    copy_bytes_per_s: float
    """How fast DDP copies gradients into a bucket (one plain copy, faster than
    :attr:`bytes_per_s`, which is fitted to backward's mixed elementwise work)."""


DEVICE_RATES = {
    "cpu": DeviceRates(flops_per_s=8.8e10, bytes_per_s=6.0e9, op_s=3.1e-6, bucket_s=0.05e-3, copy_bytes_per_s=20e9),
    "cuda": DeviceRates(flops_per_s=50e12, bytes_per_s=2.0e12, op_s=10e-6, bucket_s=0.05e-3, copy_bytes_per_s=2.0e12),
}
"""Rates per device type, for ranking groupings. ``cpu``: this project's 2-core CPU, one
thread (a plan must not depend on a process's thread count): a 256 x 256 matmul's FLOP rate, and
a memory rate set so that the estimate of a measured ``Linear`` + GELU backward comes out right
(2026-12-07: 394 us a layer at width 512, batch 2, and 4.8 ms at 1024 x 64, one thread; cache-
resident micro-kernels, ``benchmarks/device_rates.py``, read 7-10 x faster and made backward look
far cheaper than communication); ``bucket_s`` and ``copy_bytes_per_s`` from the intervals at
which DDP launched the buckets of one piece, 0.10 ms for 1 MiB and 0.26 ms for 4 MiB
(``benchmarks/bucket_launch.py``, aot_eager and inductor alike). ``cuda``: an H100's order of magnitude (FP32 matmuls, HBM
bandwidth, one kernel launch from Python, the reducer's host work). Other devices use the
CPU's."""


def _value(arg: Any) -> Any:
    return arg.meta.get("example_value", arg.meta.get("val")) if isinstance(arg, fx.Node) else arg


def _tensors(value: Any) -> list[torch.Tensor]:
    return [v for v in _torch.pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


UNBACKED_SIZE = 64
"""What a data-dependent size counts as in estimates (no value is known at compile time)."""


def _size(size: Any) -> int:
    """A size for estimates; symbolic ones by their hint, never guarded on (a guard would
    recompile the frame for every new size)."""
    return _torch.size_hint(size, fallback=UNBACKED_SIZE)


def _numel(t: torch.Tensor) -> float:
    return float(math.prod(_size(s) for s in t.shape))


def _forward_flops(node: fx.Node, gm: fx.GraphModule) -> float:
    """FLOPs of one call, for the ops that dominate compute (others: 0)."""
    target = node.target
    out = _tensors(_value(node))
    args = [_value(a) for a in node.args]
    if node.op == "call_module":
        target = type(gm.get_submodule(str(node.target)))
        if target is torch.nn.Linear:
            target = F.linear
        elif target in (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d):
            weight = gm.get_submodule(str(node.target)).weight
            return 2.0 * sum(_numel(o) for o in out) * _numel(weight) / max(1, _size(weight.shape[0]))
    if not out:
        return 0.0
    if target in _LINEARS and args and isinstance(args[0], torch.Tensor):
        return 2.0 * _numel(out[0]) * _size(args[0].shape[-1])
    if (target in _MATMULS or (node.op == "call_method" and target in _MATMUL_METHODS)) and args:
        first = next((a for a in args if isinstance(a, torch.Tensor) and a.dim() > 0), None)
        return 2.0 * _numel(out[0]) * _size(first.shape[-1]) if first is not None else 0.0
    if target in _CONVS and len(args) > 1 and isinstance(args[1], torch.Tensor):
        weight = args[1]
        return 2.0 * _numel(out[0]) * _numel(weight) / max(1, _size(weight.shape[0]))
    if target is F.scaled_dot_product_attention and len(args) > 1:
        query, key = args[0], args[1]
        if isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor):
            return 4.0 * _numel(query) * _size(key.shape[-2])
    return 0.0


def node_backward_s(nodes: Sequence[fx.Node], gm: fx.GraphModule, rates: DeviceRates) -> tuple[float, ...]:
    """Estimated backward seconds of each node (Note [Piece cost model]): twice its forward's
    FLOPs and bytes (read and written), plus one op's fixed launch cost."""
    seconds = []
    for node in nodes:
        flops = _forward_flops(node, gm)
        inputs = [t for a in node.args for t in _tensors(_value(a))]
        moved = sum(_numel(t) * t.element_size() for t in inputs + _tensors(_value(node)))
        seconds.append(2.0 * (flops / rates.flops_per_s + moved / rates.bytes_per_s + rates.op_s))
    return tuple(seconds)


def bucket_launch_s(nbytes: int, rates: DeviceRates) -> float:
    """Seconds DDP takes to launch a bucket of ``nbytes`` once its gradients are ready (Note
    [Piece cost model])."""
    return rates.bucket_s + nbytes / rates.copy_bytes_per_s


def device_rates(device: torch.device) -> DeviceRates:
    """The rates estimates on ``device`` use (:data:`DEVICE_RATES`; nothing is timed)."""
    return DEVICE_RATES.get(device.type, DEVICE_RATES["cpu"])


def fixed_cost_s(inner: object) -> float:
    """One piece's fixed cost per step with this inner backend."""
    name = inner if isinstance(inner, str) else None
    return FIXED_COST_S.get(name, max(FIXED_COST_S.values()))


def value_bytes(node: fx.Node) -> int:
    """Estimated bytes of the tensors ``node`` makes, views of other tensors not counted
    (they hold no memory of their own); symbolic sizes by their hint."""
    return int(sum(_numel(t) * t.element_size() for t in _tensors(_value(node)) if not _torch.is_view(t)))
