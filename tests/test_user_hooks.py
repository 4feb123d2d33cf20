"""A user's saved-tensor pack hook does not reach ddp_split's compile (issue 38, part 2).

A pack hook that reads data (offloading with ``t.cpu()``, anything calling ``.data_ptr()``)
raises on fake tensors; plain ``torch.compile`` and DDPOptimizer run such a model. ddp_split
switches the hooks off while it compiles (Note [User hooks at compile time] in compile.py)
and they still apply to the real backward at run time.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

import ddp_split_backend
from ddp_split_backend import Outcome, ddp_split

from .helpers import CountingCompiler
from .models import TanhStack

pytestmark = pytest.mark.usefixtures("world1")

STEPS = 3


class Offload:
    """A pack hook that reads the tensor's data, as offloading and compression do."""

    def __init__(self) -> None:
        self.packed = 0

    def pack(self, tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        tensor.data_ptr()  # raises on a fake tensor
        self.packed += 1
        return tensor.device, tensor.cpu()

    @staticmethod
    def unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, tensor = packed
        return tensor.to(device)


def _train(model: torch.nn.Module, hooks: Offload) -> list[torch.Tensor]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    losses = []
    with ddp_split_backend.own_split():
        for _ in range(STEPS):
            x = torch.randn(8, 32, generator=gen)
            with torch.autograd.graph.saved_tensors_hooks(hooks.pack, hooks.unpack):
                loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
    return losses


@pytest.mark.parametrize("inner", ["aot_eager", "inductor", "failing"])
def test_a_pack_hook_that_reads_data_trains_like_eager_ddp(inner: str) -> None:
    """``failing``: the inner backend fails on every piece, so each runs its eager fallback,
    whose fake run also happens under the user's hooks."""
    torch.manual_seed(0)
    base = TanhStack(32, 4)
    eager = DDP(copy.deepcopy(base), bucket_cap_mb=0.001)
    split = DDP(copy.deepcopy(base), bucket_cap_mb=0.001)
    backend = CountingCompiler(fail_on={"all"}) if inner == "failing" else inner
    compiled = torch.compile(split, backend="ddp_split", options={"inner": backend})

    eager_hooks, split_hooks = Offload(), Offload()
    expected = _train(eager, eager_hooks)
    if inner == "failing":
        with pytest.warns(UserWarning, match="running it eagerly"):
            losses = _train(compiled, split_hooks)
    else:
        losses = _train(compiled, split_hooks)

    record = ddp_split.records[-1]
    assert len(record.plan.pieces) > 1, record.plan.table()
    wanted = Outcome.EAGER_FALLBACK if inner == "failing" else Outcome.COMPILED
    assert any(r.outcome is wanted for r in record.pieces), record.compiled_by
    assert split_hooks.packed > 0  # the hooks still apply to the real run
    torch.testing.assert_close(losses, expected)
    for a, e in zip(split.parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(a, e)
