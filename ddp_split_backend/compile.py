"""Compile the pieces of a split graph in order with the inner backend.

Each piece is compiled with fake example inputs: the graph's own fake inputs, and for values
made by earlier pieces the fake outputs of those pieces as *compiled* (inductor may choose
output strides that differ from eager's; with ``fakify_first_call`` the AOTAutograd runtime
returns outputs with the strides the compiled code really produces). A piece the inner
backend cannot compile runs eagerly; the others stay compiled.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.backends.distributed import DDPOptimizerContext
from torch._guards import TracingContext, detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from .runtime import call_inner, preserve_global_state, track_state_calls
from .split import SplitGraph

__all__ = ["EAGER_FALLBACK", "CompiledPieces", "PieceFailure", "compile_pieces", "copy_module"]

CompilerFn = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]


@dataclass(frozen=True, slots=True)
class PieceFailure:
    """The inner backend raised on a piece; the piece runs eagerly."""

    piece: int
    error: str


@dataclass(frozen=True, slots=True)
class CompiledPieces:
    callables: tuple[Callable[..., Any], ...]
    compiled_by: tuple[str, ...]
    """Per piece: the inner backend's name, or ``eager (fallback)``."""
    failures: tuple[PieceFailure, ...]


def _fake_input(node: fx.Node, example: Any, fake_mode: FakeTensorMode) -> Any:
    value = node.meta.get("example_value")
    if isinstance(value, FakeTensor) and value.fake_mode is fake_mode:
        return value
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value
    if isinstance(example, FakeTensor):
        return example
    if isinstance(example, torch.Tensor):
        return fake_mode.from_tensor(example)
    return example


@contextlib.contextmanager
def _fakify_first_call(context: TracingContext | None) -> Iterator[None]:
    """Like DDPOptimizer: compiled AOT pieces return output metadata on their first, fake call."""
    if context is None:
        yield
        return
    previous = context.fakify_first_call
    context.fakify_first_call = True
    try:
        yield
    finally:
        context.fakify_first_call = previous


@contextlib.contextmanager
def _allow_non_fake_inputs(fake_mode: FakeTensorMode) -> Iterator[None]:
    previous = fake_mode.allow_non_fake_inputs
    fake_mode.allow_non_fake_inputs = True
    try:
        with fake_mode:
            yield
    finally:
        fake_mode.allow_non_fake_inputs = previous


EAGER_FALLBACK = "eager (fallback)"


def copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` sharing its attributes: inner backends may rewrite the graph in place."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)


def _set_example_values(gm: fx.GraphModule, args: Sequence[Any]) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, args):
        if "grapharg" not in node.meta:
            node.meta["example_value"] = value


def compile_pieces(
    split: SplitGraph,
    example_inputs: Sequence[Any],
    inner: CompilerFn,
    inner_name: str,
) -> CompiledPieces:
    """Compile every piece of ``split`` with ``inner``, in order, on fake inputs.

    Args:
        split: the pieces.
        example_inputs: what Dynamo passed the backend (real tensors, SymInts, ...).
        inner: the inner compiler, ``(gm, example_inputs) -> callable``.
        inner_name: its name, for diagnostics.

    Returns:
        The compiled callables, one per piece, and the pieces that fell back to eager.
    """
    fake_mode = detect_fake_mode(example_inputs) or detect_fake_mode(
        [p.meta.get("example_value") for p in split.placeholders]
    )
    if fake_mode is None:
        fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    values: list[Any] = [None] * split.num_slots
    for i, node in enumerate(split.placeholders):
        example = example_inputs[i] if i < len(example_inputs) else None
        values[i] = _fake_input(node, example, fake_mode)

    context = TracingContext.try_get()
    if context is not None:
        context.ddp_optimizer_ctx = DDPOptimizerContext()

    callables: list[Callable[..., Any]] = []
    compiled_by: list[str] = []
    failures: list[PieceFailure] = []
    count = len(split.pieces)
    for piece in split.pieces:
        args = [values[s] for s in piece.inputs]
        _set_example_values(piece.gm, args)
        metadata_before = context.fw_metadata if context is not None else None
        with _fakify_first_call(context):
            pristine = copy_module(piece.gm)
            compiled, error = call_inner(inner, piece.gm, list(args))
            used_aot = compiled is not None and context is not None and (
                context.fw_metadata is not metadata_before
            )
            if compiled is None:
                failures.append(PieceFailure(piece.index, error or ""))
                warnings.warn(
                    f"ddp_split: inner backend {inner_name!r} failed on piece {piece.index} "
                    f"of {count} ({len(pristine.graph.nodes)} nodes); running that piece "
                    f"eagerly. Error: {(error or '')[:2000]}",
                    stacklevel=3,
                )
                compiled = track_state_calls(pristine)
                compiled_by.append(EAGER_FALLBACK)
            else:
                compiled_by.append(inner_name)
            if used_aot:
                assert context is not None and context.ddp_optimizer_ctx is not None
                context.ddp_optimizer_ctx.curr_bucket += 1
                context.ddp_optimizer_ctx.metadata_per_bucket.append(context.fw_metadata)
            runner = compiled if used_aot else pristine
            with preserve_global_state(), _allow_non_fake_inputs(fake_mode):
                outputs = runner(*args)
        for s, value in zip(piece.outputs, outputs):
            values[s] = value
        callables.append(compiled)
    return CompiledPieces(tuple(callables), tuple(compiled_by), tuple(failures))
