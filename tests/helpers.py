"""Run a model under eager DDP and under ddp_split, and compare outputs and gradients."""

from __future__ import annotations

import copy
import socket
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_split_backend import DDPSplitBackend, SplitConfig, _torch


AOT_FAILS_INFERENCE_MODE = not _torch.aot_compiles_inference_mode_under_autograd()
"""torch 2.11/2.12: AOTAutograd cannot compile an ``inference_mode`` region inside a graph
that records autograd (pytorch/pytorch#169477): such a piece runs eagerly there
(``pytest.mark.expects_fallback(AOT_FAILS_INFERENCE_MODE)``)."""

FALLBACK_MARK = "running it eagerly"
"""In every ``InnerFallbackWarning``'s text: how a test of a subprocess's output finds one."""


def assert_no_fallback(output: str, where: str = "") -> None:
    """No piece fell back to eager in a subprocess whose ``output`` (stdout and stderr) this is
    (the in-process tests are checked by conftest's ``_no_unexpected_fallback``)."""
    lines = [line for line in output.splitlines() if FALLBACK_MARK in line and "ddp_split" in line]
    assert not lines, f"unexpected eager fallback{' in ' + where if where else ''}:\n" + "\n".join(
        line[:1000] for line in lines
    )


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (the OS picks, so parallel runs do not collide)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TINY = {"bucket_cap_mb": 0.0001, "first_bucket_cap_mb": 0.0001, "min_piece_mb": None}
"""Bucket caps of ~100 bytes and a piece per bucket (not ``min_piece_mb="auto"``, which
would group buckets this small): a bucket and a piece per layer, for tests of cutting."""


def take_grads(module: torch.nn.Module) -> list[torch.Tensor]:
    """The reference gradients of an eager run: cloned, then cleared on ``module``."""
    taken = [g.clone() for g in grads(module)]
    module.zero_grad(set_to_none=True)
    return taken


def assert_grads_equal(module: torch.nn.Module, expected: Sequence[torch.Tensor], **tol: Any) -> None:
    for i, (actual, want) in enumerate(zip(grads(module), expected, strict=True)):
        torch.testing.assert_close(actual, want, **tol, msg=lambda m, i=i: f"gradient {i}: {m}")


def reducer_bucket_names(ddp: DDP) -> list[frozenset[str]]:
    """Parameter names of each bucket DDP's reducer uses now (after its rebuild)."""
    names = {id(p): n.replace("_orig_mod.", "") for n, p in ddp.module.named_parameters()}
    return [frozenset(names[id(p)] for p in b.parameters()) for b in ddp.reducer._get_zeros_like_grad_buckets()]


def piece_bucket_agreement(ddp: DDP, plans: Sequence[Any]) -> tuple[int, int, list[int]]:
    """(pieces whose parameters are exactly one reducer bucket, pieces holding parameters,
    per reducer bucket: how many pieces its parameters come from)."""
    buckets = reducer_bucket_names(ddp)
    pieces = [frozenset(b.params) for plan in plans for b in plan.buckets if b.params]
    piece_of = {name: i for i, piece in enumerate(pieces) for name in piece}
    spans = [len({piece_of[n] for n in bucket if n in piece_of}) for bucket in buckets]
    return sum(p in set(buckets) for p in pieces), len(pieces), spans


def grads(module: torch.nn.Module) -> list[torch.Tensor]:
    """Gradients in parameter order; a missing gradient counts as zeros (compiled DDP fills them)."""
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]


def compare_with_eager_ddp(
    make_model: Callable[[], torch.nn.Module],
    inputs: Sequence[Any],
    *,
    backend: DDPSplitBackend | None = None,
    bucket_cap_mb: float = 25.0,
    wrap: str = "compile_outside",
    ddp_kwargs: dict[str, Any] | None = None,
    atol: float | None = None,
    rtol: float | None = None,
) -> tuple[DDPSplitBackend, Any]:
    """One forward+backward with eager DDP and with ddp_split; assert equal outputs and grads.

    ``wrap``: ``compile_outside`` = ``torch.compile(DDP(m))``; ``compile_inside`` =
    ``DDP(torch.compile(m))``.
    """
    backend = backend or DDPSplitBackend(SplitConfig(inner="aot_eager"))
    ddp_kwargs = dict(ddp_kwargs or {})
    torch.manual_seed(0)
    base = make_model()
    eager = DDP(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb, **ddp_kwargs)
    if wrap == "compile_outside":
        compiled = torch.compile(DDP(copy.deepcopy(base), bucket_cap_mb=bucket_cap_mb, **ddp_kwargs), backend=backend)
        target = compiled
    elif wrap == "compile_inside":
        target = DDP(torch.compile(copy.deepcopy(base), backend=backend), bucket_cap_mb=bucket_cap_mb, **ddp_kwargs)
    else:
        raise ValueError(wrap)
    expected = eager(*inputs)
    actual = target(*inputs)
    tol = {} if atol is None else {"atol": atol, "rtol": rtol}
    torch.testing.assert_close(actual, expected, **tol)
    assert actual.dtype == expected.dtype
    assert actual.requires_grad == expected.requires_grad
    if expected.requires_grad:
        expected.float().sum().backward()
        actual.float().sum().backward()
        for g_actual, g_expected in zip(grads(target), grads(eager), strict=True):
            torch.testing.assert_close(g_actual, g_expected, **tol)
    return backend, actual


def leak_nested_inference_guards_and_raise() -> None:
    """What a failed trace inside nested inference_mode regions can do: its guards are freed
    outer first, the outer one restoring "off", then the inner one "on"; grad mode is changed
    too. Raises ``RuntimeError("trace failed")``."""
    outer, inner = torch._C._InferenceMode(True), torch._C._InferenceMode(True)
    del outer, inner
    assert torch.is_inference_mode_enabled()
    torch._C._set_grad_enabled(True)
    raise RuntimeError("trace failed")


class CountingCompiler:
    """Inner compiler that records each piece it is given and compiles it with aot_eager."""

    def __init__(self, delegate: str = "aot_eager", fail_on: set[int] | None = None) -> None:
        self.graphs: list[fx.GraphModule] = []
        self.example_inputs: list[list[Any]] = []
        self.delegate = delegate
        self.fail_on = fail_on or set()
        self.__name__ = f"counting[{delegate}]"

    def __call__(self, gm: fx.GraphModule, example_inputs: list[Any]) -> Any:
        index = len(self.graphs)
        self.graphs.append(gm)
        self.example_inputs.append(list(example_inputs))
        if index in self.fail_on or "all" in self.fail_on:
            raise RuntimeError(f"planned failure on piece {index}")
        from torch._dynamo.backends.registry import lookup_backend

        return lookup_backend(self.delegate)(gm, example_inputs)

    @property
    def count(self) -> int:
        return len(self.graphs)
