"""Inductor as the inner backend: autocast regions across cuts, outputs whose strides inductor
chooses, and gradients equal to eager."""

from __future__ import annotations

import torch
import torch.nn as nn

from ddp_split_backend import DDPSplitBackend, Outcome, SplitConfig

from .helpers import assert_grads_equal, take_grads
from .models import StateRegions


class Transposer(nn.Module):
    """Piece outputs are non-contiguous views: inductor may give them other strides."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)

    def forward(self, x):
        h = self.a(x).transpose(0, 1)
        h = torch.relu(h) * 2
        h = self.b(h.transpose(0, 1)).t()
        return self.c(h.t().contiguous())


def _check(model: nn.Module, x: torch.Tensor, tol: float) -> DDPSplitBackend:
    backend = DDPSplitBackend(SplitConfig(inner="inductor", bucket_cap_mb=0.0005, first_bucket_cap_mb=0.0005))
    compiled = torch.compile(model, backend=backend)
    expected = model(x)
    expected.float().sum().backward()
    want = take_grads(model)
    actual = compiled(x)
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)
    actual.float().sum().backward()
    assert_grads_equal(model, want, atol=tol, rtol=tol)
    assert not backend.records[-1].failures, backend.records[-1].failures
    return backend


def test_inductor_autocast_regions_across_cuts() -> None:
    torch.manual_seed(0)
    backend = _check(StateRegions(kind="autocast"), torch.randn(4, 32), tol=3e-2)
    assert len(backend.records[-1].plan.buckets) >= 3
    assert all(r.backend == "inductor" and r.outcome is not Outcome.EAGER_FALLBACK for r in backend.records[-1].pieces)


def test_inductor_output_strides_cross_pieces() -> None:
    torch.manual_seed(0)
    backend = _check(Transposer(), torch.randn(8, 16), tol=1e-5)
    assert len(backend.records[-1].plan.buckets) == 3
