"""What the device of the graph's tensors decides, on every device this machine has.

Each test takes a ``device``: it runs on the CPU everywhere and on CUDA where a GPU exists
(``-m cuda`` selects the CUDA half, e.g. ``python -m pytest -m cuda tests/test_devices.py``
on the GPU machine; ``benchmarks/gpu_check.py`` runs it there). Nothing in ddp_split assumes
"cpu": autocast regions are re-entered with the graph's own device type, pieces run on fake
tensors of the graph's device, piece outputs keep the strides the inner backend's kernels
produce, and random ops draw from the device's generator in eager order.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ddp_split_backend import DDPSplitBackend, Outcome, SplitConfig

from .helpers import assert_grads_equal, take_grads

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="no GPU here")]),
]
CUTS = {"bucket_cap_mb": 0.015, "first_bucket_cap_mb": 0.015, "min_piece_mb": None}  # a piece per layer or two


class AutocastBlocks(nn.Module):
    """Layers before, inside (nested: bf16 inside fp16-disabled) and after an autocast region
    of the input's device type, so cuts fall inside the region."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(6)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[0](x))
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            x = torch.tanh(self.layers[1](x))
            with torch.autocast(x.device.type, enabled=False):
                x = torch.tanh(self.layers[2](x.float()))
            x = torch.tanh(self.layers[3](x))
            x = torch.tanh(self.layers[4](x))
        return self.layers[5](x.float())


class DropoutStack(nn.Module):
    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.dropout(torch.relu(layer(x)), p=0.3, training=True)
        return x


class ChannelsLast(nn.Module):
    """Convolutions in channels_last: the pieces' outputs carry non-contiguous strides."""

    def __init__(self) -> None:
        super().__init__()
        self.convs = nn.ModuleList([nn.Conv2d(c_in, 16, 3, padding=1) for c_in in (3, 16, 16, 16)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            x = torch.relu(conv(x))
        return x


def _generator_state(device: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device == "cuda" else torch.get_rng_state()


@pytest.mark.parametrize("device", DEVICES)
def test_autocast_of_the_graphs_device_across_cuts(device: str) -> None:
    torch.manual_seed(0)
    model = AutocastBlocks().to(device)
    x = torch.randn(8, 64, device=device)
    expected = model(x)
    expected.sum().backward()
    want = take_grads(model)
    model.zero_grad(set_to_none=True)

    backend = DDPSplitBackend(SplitConfig(inner="aot_eager", **CUTS))
    actual = torch.compile(model, backend=backend)(x)
    record = backend.records[-1]
    assert len(record.plan.buckets) >= 4, record.plan.table()
    assert all(r.outcome is not Outcome.EAGER_FALLBACK for r in record.pieces)
    assert actual.device.type == device and actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected)
    actual.sum().backward()
    assert_grads_equal(model, want)
    assert not torch.is_autocast_enabled(device)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("device", DEVICES)
def test_dropout_draws_in_eager_order_across_pieces(device: str, inner: str) -> None:
    """Random ops in several pieces draw the same masks as eager from the device's generator,
    and leave it where eager leaves it (inductor told to use eager's RNG: fallback_random)."""
    torch.manual_seed(0)
    model = DropoutStack().to(device)
    x = torch.randn(16, 64, device=device)
    options = {"inner_options": {"fallback_random": True}} if inner == "inductor" else {}
    backend = DDPSplitBackend(SplitConfig(inner=inner, **CUTS, **options))
    compiled = torch.compile(model, backend=backend)
    for seed in (1, 2):  # the first call compiles: it must not consume random numbers either
        torch.manual_seed(seed)
        expected = model(x)
        after_eager = _generator_state(device)
        torch.manual_seed(seed)
        actual = compiled(x)
        torch.testing.assert_close(actual, expected)
        assert torch.equal(_generator_state(device), after_eager)
    assert len(backend.records[-1].plan.buckets) >= 3


@pytest.mark.parametrize("device", DEVICES)
def test_piece_outputs_keep_the_strides_inductor_gives_them(device: str) -> None:
    torch.manual_seed(0)
    model = ChannelsLast().to(device).to(memory_format=torch.channels_last)
    x = torch.randn(2, 3, 16, 16, device=device).to(memory_format=torch.channels_last)
    expected = model(x)
    backend = DDPSplitBackend(SplitConfig(inner="inductor", bucket_cap_mb=0.005, first_bucket_cap_mb=0.005))
    compiled = torch.compile(model, backend=backend)
    actual = compiled(x)
    assert len(backend.records[-1].plan.buckets) >= 3, backend.records[-1].plan.table()
    assert actual.stride() == expected.stride()
    torch.testing.assert_close(actual, expected, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(compiled(x), expected, rtol=1e-4, atol=1e-4)  # the second, real-stride call
    actual.sum().backward()
    assert all(p.grad is not None and p.grad.device.type == device for p in model.parameters())


class CheckpointedRegion(nn.Module):
    """One activation-checkpoint region over five layers, dropout and an autocast span of
    the input's device type inside: cut at every bucket, each part replays its own masks."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(5)])

    def body(self, x: torch.Tensor) -> torch.Tensor:
        x = F.dropout(torch.relu(self.layers[0](x)), p=0.3, training=True)
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            x = torch.relu(self.layers[1](x))
            x = F.dropout(torch.relu(self.layers[2](x)), p=0.3, training=True)
        x = torch.tanh(self.layers[3](x.float()))
        return F.dropout(torch.relu(self.layers[4](x)), p=0.3, training=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.utils.checkpoint.checkpoint(self.body, x, use_reentrant=False)


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_region_cut_replays_each_parts_random_masks(device: str, inner: str) -> None:
    torch.manual_seed(0)
    model = CheckpointedRegion().to(device)
    reference = CheckpointedRegion().to(device)
    reference.load_state_dict(model.state_dict())
    options = {"inner_options": {"fallback_random": True}} if inner == "inductor" else {}
    backend = DDPSplitBackend(SplitConfig(inner=inner, split_checkpoints="always", **CUTS, **options))
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(16, 64, device=device)
    for seed in (1, 2):
        torch.manual_seed(seed)
        compiled(x).square().mean().backward()
        torch.manual_seed(seed)
        reference(x).square().mean().backward()
    tol = {"rtol": 1e-5, "atol": 1e-5} if inner == "aot_eager" else {"rtol": 2e-2, "atol": 2e-3}
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, **tol)
    (region,) = backend.records[-1].plan.regions
    assert len(region.before) >= 3, backend.records[-1].plan.table()
