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

from .reuse import fresh_outputs, reusable_outputs, structure_key
from .runtime import attempt, call_inner, preserve_global_state, track_state_calls
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


@dataclass(frozen=True, slots=True)
class _Reusable:
    piece: int
    fn: Callable[..., Any]
    outputs: tuple[Any, ...]


def _compile_one(
    piece: Any,
    args: list[Any],
    inner: CompilerFn,
    inner_name: str,
    context: TracingContext | None,
    fake_mode: FakeTensorMode,
    count: int,
    failures: list[PieceFailure],
) -> tuple[Callable[..., Any], str, list[Any], Any]:
    """Compile one piece; returns (callable, compiled_by, fake outputs, AOT fw_metadata)."""
    _set_example_values(piece.gm, args)
    metadata_before = context.fw_metadata if context is not None else None
    with _fakify_first_call(context), torch.set_grad_enabled(piece.grad):
        pristine = copy_module(piece.gm)
        compiled, error = call_inner(inner, piece.gm, list(args))
        used_aot = compiled is not None and context is not None and (
            context.fw_metadata is not metadata_before
        )
        outputs = None
        if compiled is not None and used_aot:
            # The compiled piece's first call on fake inputs gives its real output metadata.
            # It can still fail where compiling did not (AOTAutograd saving an inference
            # tensor for backward in a piece that starts inside inference_mode, say).
            outputs, error = attempt(_run_on_fakes, compiled, args, fake_mode)
            if outputs is None:
                compiled, used_aot = None, False
        if compiled is None:
            failures.append(PieceFailure(piece.index, error or ""))
            warnings.warn(
                f"ddp_split: inner backend {inner_name!r} failed on piece {piece.index} "
                f"of {count} ({len(pristine.graph.nodes)} nodes); running that piece "
                f"eagerly. Error: {(error or '')[:2000]}",
                stacklevel=4,
            )
            compiled = track_state_calls(pristine)
            name = EAGER_FALLBACK
        else:
            name = inner_name
        if outputs is None:
            outputs = _run_on_fakes(pristine, args, fake_mode)
    metadata = context.fw_metadata if used_aot and context is not None else None
    return compiled, name, outputs, metadata


def _run_on_fakes(fn: Callable[..., Any], args: Sequence[Any], fake_mode: FakeTensorMode) -> list[Any]:
    with preserve_global_state(), _allow_non_fake_inputs(fake_mode):
        return list(fn(*args))


def compile_pieces(
    split: SplitGraph,
    example_inputs: Sequence[Any],
    inner: CompilerFn,
    inner_name: str,
    *,
    reuse: bool = False,
) -> CompiledPieces:
    """Compile every piece of ``split`` with ``inner``, in order, on fake inputs.

    Args:
        split: the pieces.
        example_inputs: what Dynamo passed the backend (real tensors, SymInts, ...).
        inner: the inner compiler, ``(gm, example_inputs) -> callable``.
        inner_name: its name, for diagnostics.
        reuse: compile pieces with identical structure and input metadata once (see
            ``SplitConfig.reuse_identical_pieces``).

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
    callables: list[Callable[..., Any]] = []
    compiled_by: list[str] = []
    failures: list[PieceFailure] = []
    reusable: dict[tuple, _Reusable] = {}
    aot_last_use: dict[int, tuple[int, Any]] = {}  # id(fn) -> (last piece using it, fw_metadata)
    count = len(split.pieces)
    for piece in split.pieces:
        args = [values[s] for s in piece.inputs]
        key = structure_key(piece.gm, args, piece.grad) if reuse else None
        hit = reusable.get(key) if key is not None else None
        if hit is not None:
            outputs = fresh_outputs(hit.outputs, fake_mode)
            callables.append(hit.fn)
            compiled_by.append(f"{inner_name} (same as piece {hit.piece})")
            if id(hit.fn) in aot_last_use:
                aot_last_use[id(hit.fn)] = (piece.index, aot_last_use[id(hit.fn)][1])
        else:
            compiled, name, outputs, metadata = _compile_one(
                piece, args, inner, inner_name, context, fake_mode, count, failures
            )
            callables.append(compiled)
            compiled_by.append(name)
            if metadata is not None:
                aot_last_use[id(compiled)] = (piece.index, metadata)
            if key is not None and name == inner_name and reusable_outputs(outputs):
                reusable[key] = _Reusable(piece.index, compiled, tuple(outputs))
        for s, value in zip(piece.outputs, outputs):
            values[s] = value
    if context is not None:
        # AOTAutograd compiles backward lazily, latest piece first, popping this stack; a
        # reused function's backward is compiled at its last use (Note [DDPOptimizer and
        # fw_metadata] in torch's runtime_wrappers.py explains the stack).
        ddp_ctx = DDPOptimizerContext()
        ddp_ctx.metadata_per_bucket = [m for _, m in sorted(aot_last_use.values(), key=lambda t: t[0])]
        ddp_ctx.curr_bucket = len(ddp_ctx.metadata_per_bucket) - 1
        context.ddp_optimizer_ctx = ddp_ctx
    return CompiledPieces(tuple(callables), tuple(compiled_by), tuple(failures))
