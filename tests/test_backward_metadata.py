"""Each AOT piece's lazy backward compile is handed that piece's own forward metadata,
whichever pieces a backward reaches and in whatever order (Note [Backward metadata per
piece] in compile.py; issue 25, point 2). The identity is asserted at every backward compile,
for inner backends by name, and gradients are compared with eager."""

from __future__ import annotations

import contextlib
import copy
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch._functorch._aot_autograd import graph_compile, logging_utils, runtime_wrappers
from torch._guards import TracingContext

from ddp_split_backend import DDPSplitBackend, SplitConfig
from ddp_split_backend import compile as compile_stage
from ddp_split_backend.compile import MetadataMismatchError

from .helpers import TINY, grads


@dataclass(frozen=True, slots=True)
class BackwardCompile:
    own: object
    """The metadata AOTAutograd made for the graph whose backward is compiled."""
    handed: object
    """The metadata its backward compile reads from the current tracing context."""


@pytest.fixture
def backward_compiles(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[BackwardCompile]]:
    """Every backward compile: its graph's own metadata and the one it is handed.

    AOTAutograd names every compile of a graph by ``aot_config.aot_id`` through
    ``track_graph_compiling`` (all supported releases). When a graph's forward compile ends,
    the tracing context holds that graph's metadata (its own); when its backward compile
    starts, lazily or not, the context current then is what the backward reads (handed).
    """
    own: dict[int, object] = {}
    seen: list[BackwardCompile] = []
    track = logging_utils.track_graph_compiling

    @contextlib.contextmanager
    def witnessed(aot_config: Any, graph_name: str) -> Iterator[None]:
        if graph_name == "backward":
            context = TracingContext.try_get()
            seen.append(BackwardCompile(own.get(aot_config.aot_id), getattr(context, "fw_metadata", None)))
        with track(aot_config, graph_name):
            yield
        if graph_name == "forward":
            own[aot_config.aot_id] = getattr(TracingContext.try_get(), "fw_metadata", None)

    for module in (graph_compile, runtime_wrappers):
        monkeypatch.setattr(module, "track_graph_compiling", witnessed)
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
    assert backward_compiles, "no backward compile was seen"
    assert all(c.own is not None for c in backward_compiles), "a backward compiled before its forward?"
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
