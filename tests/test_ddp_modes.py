"""ddp_split under DDP: both wrapping orders, torch's default optimize_ddp, and own_split()."""

from __future__ import annotations

import pytest
import torch

import ddp_split_backend
from ddp_split_backend import DDPSplitBackend, SplitConfig

from .helpers import compare_with_eager_ddp
from .models import MLP

pytestmark = pytest.mark.usefixtures("world1")


@pytest.mark.parametrize("wrap", ["compile_outside", "compile_inside"])
def test_both_wrapping_orders_use_the_ddp_modules_cap(counting, wrap) -> None:
    torch._dynamo.config.optimize_ddp = False
    backend = DDPSplitBackend(SplitConfig(inner=counting, min_piece_mb=None))
    compare_with_eager_ddp(lambda: MLP(width=128, depth=4), [torch.randn(4, 128)],
                           backend=backend, bucket_cap_mb=0.06, wrap=wrap)
    plan = backend.records[-1].plan
    assert plan.caps.bytes == int(0.06 * 2**20)
    assert len(plan.buckets) == 4 == counting.count
    assert plan.buckets[0].params == ("net.0.weight", "net.0.bias")


def test_default_optimize_ddp_pieces_are_never_split_again(counting) -> None:
    """Under torch's default config DDPOptimizer cuts first; ddp_split compiles its pieces whole."""
    assert torch._dynamo.config.optimize_ddp is True
    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner=counting, bucket_cap_mb=0.0001))
    with pytest.warns(UserWarning, match="DDPOptimizer already split"):
        compare_with_eager_ddp(lambda: MLP(width=512, depth=4), [torch.randn(4, 512)],
                               backend=backend, bucket_cap_mb=1)
    sources = {r.plan.source for r in backend.records}
    assert sources == {"DDPOptimizer piece"}
    assert counting.count == len(backend.records) == 4  # one compile per DDPOptimizer piece


def test_own_split_gives_ddp_splits_plan_under_default_config(counting) -> None:
    backend = DDPSplitBackend(SplitConfig(inner=counting))
    with ddp_split_backend.own_split():
        compare_with_eager_ddp(lambda: MLP(width=128, depth=4), [torch.randn(4, 128)],
                               backend=backend, bucket_cap_mb=0.06)
    assert torch._dynamo.config.optimize_ddp is True
    assert [r.plan.source for r in backend.records] == ["ddp_split"]
    assert len(backend.records[-1].plan.buckets) == 4


def test_cap_below_one_mb_under_default_config_falls_to_ddp_optimizer_assert() -> None:
    """Documented limitation: torch's DDPOptimizer itself asserts on caps < 1 MiB before
    ddp_split is called; own_split() avoids it."""
    backend = DDPSplitBackend(SplitConfig(inner="aot_eager"))
    with pytest.raises(Exception, match="First bucket should be smaller"):
        compare_with_eager_ddp(lambda: MLP(width=64, depth=3), [torch.randn(2, 64)],
                               backend=backend, bucket_cap_mb=0.01)
    assert not backend.records  # DDPOptimizer failed before ddp_split was called
    torch._dynamo.reset()
    with ddp_split_backend.own_split():
        compare_with_eager_ddp(lambda: MLP(width=64, depth=3), [torch.randn(2, 64)],
                               backend=backend, bucket_cap_mb=0.01)
    assert len(backend.records[-1].plan.buckets) == 3
