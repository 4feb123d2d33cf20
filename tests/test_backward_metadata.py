"""Each AOT piece's lazy backward compile is handed that piece's own forward metadata,
whichever pieces a backward reaches and in whatever order (Note [Backward metadata per
piece] in compile.py; issue 25, point 2). The identity is asserted at every backward compile,
for inner backends by name, and gradients are compared with eager."""

from __future__ import annotations

import copy
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from torch._functorch._aot_autograd import runtime_wrappers

from ddp_split_backend import DDPSplitBackend, SplitConfig
from ddp_split_backend import compile as compile_stage
from ddp_split_backend.compile import MetadataMismatchError

from .helpers import TINY, grads


@dataclass(frozen=True, slots=True)
class BackwardCompile:
    own: object
    """The metadata of the compiled function whose backward is compiled."""
    handed: object
    """The metadata its backward compile reads from the saved tracing context."""


@pytest.fixture
def backward_compiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[BackwardCompile]]:
    """Every lazy backward compile: the function's own metadata and the one it is handed."""
    seen: list[BackwardCompile] = []
    prepare = runtime_wrappers._AutogradBackwardCompiler._prepare_lazy_backward_context

    def witnessed(self, saved_tensors_use_once: bool) -> None:
        prepare(self, saved_tensors_use_once)
        context = self.lazy_backward_info.saved_context
        seen.append(BackwardCompile(self.fw_metadata, getattr(context, "fw_metadata", None)))

    monkeypatch.setattr(runtime_wrappers._AutogradBackwardCompiler, "_prepare_lazy_backward_context", witnessed)
    yield seen


class AuxHead(nn.Module):
    """A trunk with an auxiliary head after its second layer and a logged activation."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.trunk = nn.ModuleList([nn.Linear(width, width) for _ in range(4)])
        self.aux = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = torch.tanh(self.trunk[0](x))
        x = torch.tanh(self.trunk[1](x))
        aux = self.aux(x)
        logged = x * 2
        for layer in self.trunk[2:]:
            x = torch.tanh(layer(x))
        return x, aux, logged


def _main_only(model: nn.Module, outputs: tuple[torch.Tensor, ...]) -> None:
    outputs[0].sum().backward()


def _aux_only(model: nn.Module, outputs: tuple[torch.Tensor, ...]) -> None:
    outputs[1].sum().backward()


def _grad_of_last_layers(model: nn.Module, outputs: tuple[torch.Tensor, ...]) -> None:
    """``autograd.grad`` with respect to the last two layers only: backward stops there."""
    params = [p for layer in model.trunk[2:] for p in layer.parameters()]
    for p, g in zip(params, torch.autograd.grad(outputs[0].sum(), params), strict=True):
        p.grad = g


LOSSES: dict[str, tuple[Callable[[nn.Module, tuple[torch.Tensor, ...]], None], ...]] = {
    "main-head-only": (_main_only,),
    "aux-head-only": (_aux_only,),
    "grad-wrt-subset": (_grad_of_last_layers,),
    "fewer-pieces-first": (_aux_only, _main_only),
    "subset-first": (_grad_of_last_layers, _main_only),
}
"""Per case, the loss of each step: a step's backward may reach fewer pieces than a later one."""


@pytest.mark.parametrize("case", list(LOSSES))
@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_each_backward_compile_gets_its_pieces_metadata(
    inner: str, case: str, backward_compiles: list[BackwardCompile]
) -> None:
    torch.manual_seed(0)
    eager = AuxHead()
    model = copy.deepcopy(eager)
    backend = DDPSplitBackend(SplitConfig(inner=inner, **TINY))
    compiled = torch.compile(model, backend=backend)
    tol = {} if inner == "aot_eager" else {"rtol": 1e-4, "atol": 1e-5}
    for step, loss in enumerate(LOSSES[case]):
        x = torch.randn(3, 16)
        loss(eager, eager(x))
        loss(model, compiled(x))
        names = [name for name, _ in model.named_parameters()]
        for name, actual, expected in zip(names, grads(model), grads(eager), strict=True):
            torch.testing.assert_close(actual, expected, **tol, msg=lambda m, n=name: f"step {step} {n}: {m}")
        eager.zero_grad(set_to_none=True)
        model.zero_grad(set_to_none=True)
    (record,) = backend.records
    assert len(record.pieces) >= 4 and not record.failures
    assert backward_compiles, "no lazy backward compile was seen"
    wrong = [i for i, c in enumerate(backward_compiles) if c.handed is not c.own]
    assert not wrong, f"backward compiles {wrong} of {len(backward_compiles)} got another piece's metadata"


def test_metadata_that_does_not_describe_the_piece_is_an_error_naming_it() -> None:
    gm = torch.fx.symbolic_trace(lambda a, b: (a + b, a * b))
    other = types.SimpleNamespace(input_info=[0], output_info=[0])  # one input, one output
    context = types.SimpleNamespace(fw_metadata=other, ddp_optimizer_ctx=None)
    with pytest.raises(MetadataMismatchError, match=r"piece 2 of 5 has 2 inputs and 2 outputs.*1 inputs and 1 outputs"):
        compile_stage._check_metadata(context, gm, 2, 5)
    own = types.SimpleNamespace(input_info=[0, 1], output_info=[0, 1])
    compile_stage._check_metadata(types.SimpleNamespace(fw_metadata=own, ddp_optimizer_ctx=None), gm, 2, 5)
    with pytest.raises(MetadataMismatchError, match="piece 2 of 5"):  # a stack would be popped instead
        compile_stage._check_metadata(types.SimpleNamespace(fw_metadata=own, ddp_optimizer_ctx=object()), gm, 2, 5)
