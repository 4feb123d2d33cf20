"""Identical-piece reuse: keys for every argument Dynamo records, never an exception."""

from __future__ import annotations

import enum
import types
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn

from ddp_split_backend import DDPSplitBackend, Outcome, SplitConfig, _torch, ddp_split
from ddp_split_backend.reuse import fresh_outputs, reusable_outputs, structure_key


class Color(enum.Enum):
    RED = 1


def _graph_with_arg(arg: object) -> Any:
    """A one-op graph holding ``arg`` (not code-generated: some arguments have no source)."""
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.view.default, (x, arg)))
    return types.SimpleNamespace(graph=graph)


DESCRIBABLE = {
    "slice": slice(None, 3, None),
    "slice_of_node_free_ints": (slice(1, None), Ellipsis, None),
    "ellipsis": Ellipsis,
    "dtype": torch.bfloat16,
    "device": torch.device("cpu"),
    "memory_format": torch.channels_last,
    "layout": torch.strided,
    "size": torch.Size([2, 3]),
    "enum": Color.RED,
    "nested": {"a": [1, (2.0, slice(0, 1))], "b": (None, True)},
    "function": torch.add,
    "complex": 1j,
}


@pytest.mark.parametrize("arg", list(DESCRIBABLE.values()), ids=list(DESCRIBABLE))
def test_key_describes_every_argument_kind_dynamo_records(arg: object) -> None:
    key = structure_key(_graph_with_arg(arg), [torch.randn(2, 3)], grad=True)
    assert key is not None
    hash(key)
    assert key == structure_key(_graph_with_arg(arg), [torch.randn(2, 3)], grad=True)


@pytest.mark.parametrize(
    "a, b",
    [(1, 1.0), (1, True), ((1, 2), [1, 2]), (slice(0, 2), slice(0, 3)), (torch.float16, torch.bfloat16)],
    ids=["int-float", "int-bool", "tuple-list", "slice-bounds", "dtype"],
)
def test_different_arguments_give_different_keys(a: object, b: object) -> None:
    x = [torch.randn(2, 3)]
    assert structure_key(_graph_with_arg(a), x, grad=True) != structure_key(_graph_with_arg(b), x, grad=True)


@pytest.mark.parametrize(
    "arg", [torch.ones(2), object(), [torch.ones(1)]], ids=["tensor-constant", "opaque-object", "tensor-in-list"]
)
def test_argument_it_cannot_describe_makes_piece_not_reusable(arg: object) -> None:
    assert structure_key(_graph_with_arg(arg), [torch.randn(2, 3)], grad=True) is None


def test_grad_mode_and_input_metadata_are_part_of_the_key() -> None:
    gm = _graph_with_arg(slice(None))
    base = structure_key(gm, [torch.randn(2, 3)], grad=True)
    assert base != structure_key(gm, [torch.randn(2, 3)], grad=False)
    assert base != structure_key(gm, [torch.randn(3, 2)], grad=True)
    assert base != structure_key(gm, [torch.randn(2, 3, dtype=torch.float64)], grad=True)


class SlicingBlocks(nn.Module):
    """The minimal program of the crash: repeated blocks whose forward slices and indexes
    with ``Ellipsis``/``None`` (what every transformer's attention does)."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            h = layer(x)
            x = x + torch.cat([h[:, 1:], h[:, :1]], dim=1)[..., None].squeeze(-1)
        return x


def test_regression_slices_in_pieces_compile_by_name_and_share_pieces() -> None:
    """Was ``TypeError: unhashable type: 'slice'`` for every piece holding a slice, failing the
    whole frame, on the default path (inner by name, reuse on)."""
    torch.manual_seed(0)
    model = SlicingBlocks()
    x = torch.randn(4, 32, requires_grad=True)
    expected = model(x)
    expected.sum().backward()
    expected_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    x.grad = None
    ddp_split.records.clear()
    compiled = torch.compile(model, backend="ddp_split", options={"min_piece_mb": None, "inner": "aot_eager", "bucket_cap_mb": 0.004})
    actual = compiled(x)
    actual.sum().backward()
    torch.testing.assert_close(actual, expected)
    for p, g in zip(model.parameters(), expected_grads, strict=True):
        torch.testing.assert_close(p.grad, g)
    (record,) = ddp_split.records
    assert len(record.plan.buckets) == 4
    shared = [r for r in record.pieces if r.outcome is Outcome.SHARED and r.backend == "aot_eager"]
    assert len(shared) >= 2, record.compiled_by  # the middle blocks reuse one compile


class Tagged(torch.Tensor):
    """A tensor subclass: same metadata as a plain tensor, different type."""


def _two_inputs() -> Any:
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    graph.output(graph.call_function(torch.ops.aten.add.Tensor, (a, b)))
    return types.SimpleNamespace(graph=graph)


def test_a_subclass_input_makes_the_piece_not_reusable() -> None:
    gm = _graph_with_arg(slice(None))
    assert structure_key(gm, [torch.randn(2, 3)], grad=True) is not None
    assert structure_key(gm, [torch.randn(2, 3).as_subclass(Tagged)], grad=True) is None


def test_inference_inputs_are_part_of_the_key() -> None:
    gm = _graph_with_arg(slice(None))
    with torch.inference_mode():
        inference = torch.randn(2, 3)
    assert structure_key(gm, [inference], grad=False) != structure_key(gm, [torch.randn(2, 3)], grad=False)


def _fresh() -> torch.Tensor:
    return torch.randn(2, 3)


@pytest.mark.parametrize(
    "aliased, apart",
    [
        (lambda b: [b, b], lambda: [_fresh(), _fresh()]),
        (lambda b: [b, b.view(2, 3)], lambda: [_fresh(), torch.randn(6).view(2, 3)]),
        (lambda b: [b[0], b[1]], lambda: [_fresh()[0], _fresh()[1]]),
    ],
    ids=["same-tensor", "view-of-the-other", "views-of-one-base"],
)
def test_aliasing_between_inputs_is_part_of_the_key(aliased: Any, apart: Any) -> None:
    """Equal metadata input by input; only which inputs share storage differs."""
    key = structure_key(_two_inputs(), aliased(_fresh()), grad=True)
    assert key is not None
    assert key != structure_key(_two_inputs(), apart(), grad=True)
    assert key == structure_key(_two_inputs(), aliased(_fresh()), grad=True)


def test_fresh_outputs_keep_inference_ness() -> None:
    fake_mode = _torch.FakeTensorMode()
    with fake_mode, torch.inference_mode():
        inference = torch.empty(2, 3)
    with fake_mode:
        plain = torch.empty(2, 3)
    fresh = fresh_outputs([inference, plain], fake_mode)
    assert [t.is_inference() for t in fresh] == [True, False]


@pytest.mark.parametrize(
    "outputs, inputs",
    [
        (lambda x: [x.as_subclass(Tagged)], lambda x: []),
        (lambda x: [x, x.view(3, 2)], lambda x: []),
        (lambda x: [x.view(3, 2)], lambda x: [x]),
        (lambda x: [x[1]], lambda x: []),
    ],
    ids=["subclass-output", "outputs-alias", "output-aliases-input", "storage-offset"],
)
def test_outputs_new_tensors_cannot_stand_in_for_are_not_reused(outputs: Any, inputs: Any) -> None:
    x = torch.randn(2, 3)
    assert reusable_outputs([torch.randn(2, 3)], [x])
    assert not reusable_outputs(outputs(x), inputs(x))


class InferenceBlocksAndHead(nn.Module):
    """Identical blocks, then a different head, all inside ``inference_mode``: every
    activation is an inference tensor."""

    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            for block in self.blocks:
                x = torch.relu(block(x))
            return self.head(x)


@pytest.mark.skipif(
    not _torch.aot_compiles_inference_mode_under_autograd(),
    reason="this torch's AOTAutograd fails on inference_mode regions (every piece falls back)",
)
def test_a_piece_after_a_shared_one_sees_inference_inputs(counting) -> None:
    """Was: a shared piece's outputs rebuilt as normal tensors, so the head compiled for
    inputs it never gets at run time."""
    torch.manual_seed(0)
    model = InferenceBlocksAndHead()
    x = torch.randn(4, 32)
    expected = model(x)
    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, 
        inner=counting, bucket_cap_mb=0.002, first_bucket_cap_mb=0.002, reuse_identical_pieces=True,
    ))
    actual = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(actual, expected)
    record = backend.records[-1]
    assert any(r.outcome is Outcome.SHARED for r in record.pieces), record.compiled_by
    assert record.pieces[-1].outcome is Outcome.COMPILED
    head_inputs = counting.example_inputs[-1]
    activations = [t for t in head_inputs if isinstance(t, torch.Tensor) and not isinstance(t, nn.Parameter)]
    assert activations and all(t.is_inference() for t in activations)
