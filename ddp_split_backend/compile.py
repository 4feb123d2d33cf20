"""Compile graphs with the inner backend: a split graph piece by piece, or a graph whole.

Each piece is compiled with fake example inputs: the graph's own fake inputs, and for values
made by earlier pieces the fake outputs of those pieces as *compiled* (inductor may choose
output strides that differ from eager's; with ``fakify_first_call`` the AOTAutograd runtime
returns outputs with the strides the compiled code really produces). A piece the inner
backend cannot compile runs eagerly (``on_inner_failure="eager"``) or its error propagates
(``"raise"``). Every compile says what happened in a :class:`PieceRecord`.

Note [Backward metadata per piece]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
AOTAutograd compiles a graph's backward lazily, at its first backward call, under the
tracing context that was current when the forward was compiled, and the backward compile
(inductor's buffer donation, CUDA-graph static inputs) reads the forward metadata from
that context's ``fw_metadata``. Dynamo gives a frame one context; compiled in it, every
piece would overwrite the one before. torch's DDPOptimizer keeps the metadata on a stack
popped last first, which assumes backward reaches every piece, in reverse order: a loss made
from some outputs only (an auxiliary head, ``autograd.grad`` with respect to a subset, a
first backward reaching fewer pieces than a later one) hands a piece another's metadata.
ddp_split compiles each AOT piece under its own copy of the frame's context
(``_torch.piece_tracing_context``: shared guards and fake mode, its own ``fw_metadata``), so
a piece's backward finds its own metadata whichever backward runs first, or never. Whether
AOTAutograd ran is whether the piece's own context received metadata, and the metadata is
checked to describe the piece (its inputs and outputs) before the piece is used.

Note [Python floats in pieces]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Once a Python float that enters a frame changes value (a statistic read with ``.item()``
before a graph break, then used in tensor math), Dynamo traces it as a float symbol of the
frame's shape environment, and AOTAutograd's float pass turns its uses into tensor math.
That pass assumes it compiles the frame's only graph: every backed float symbol of the
environment that the graph it compiles did not use, it specialises and asks Dynamo to
re-trace the frame (``TensorifyScalarRestartAnalysis``). Compiled piece by piece, every piece
without the float would do so, and the frame would be recompiled for each new value of the
float until Dynamo's recompile limit (torch's DDPOptimizer does exactly that). So each piece
compiles with the environment showing only the float symbols the piece itself uses
(``_torch.only_float_symbols``), and the planner never lets a float cross a cut
(``AdjustReason.FLOAT_VALUE``): the float's uses are tensorified in the piece that reads it.

Note [User hooks at compile time]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Nothing ddp_split runs while compiling may call the user's code: its pieces run on fake
inputs (the compiled piece's first, fake call; an eager fallback's fake run; fresh outputs
of shared pieces) and the inner backend traces them, all under whatever
``torch.autograd.graph.saved_tensors_hooks`` the user's step has active. A pack hook that
reads data (``t.cpu()``, ``.data_ptr()``, compression, offloading) raises on a fake tensor.
So every compile here runs with saved-tensor hooks switched off the way Dynamo and torch's
DDPOptimizer switch them off while tracing (``_torch.user_saved_tensor_hooks_off``); they
stay registered, and the compiled pieces' real backward saves through them at run time.
"""

from __future__ import annotations

import contextlib
import enum
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from . import _torch
from .guards import Attempt, attempt, call_inner, preserve_global_state, track_state_calls
from .reuse import fresh_outputs, reusable_outputs, structure_key
from .split import SplitGraph
from .timing import StageTimes

__all__ = [
    "CompiledPieces",
    "Failure",
    "InnerFallbackWarning",
    "MetadataMismatchError",
    "Outcome",
    "PieceRecord",
    "compile_pieces",
    "compile_whole",
    "copy_module",
]

CompilerFn = Callable[[fx.GraphModule, list[Any]], Callable[..., Any]]


class Outcome(enum.Enum):
    """How one piece ended up compiled."""

    COMPILED = "compiled"
    """Compiled by the inner backend."""
    SHARED = "shared"
    """Uses the function compiled for an identical earlier piece (``shared_with``)."""
    EAGER_FALLBACK = "eager fallback"
    """The inner backend failed on it; the piece's FX code runs as Python."""


@dataclass(frozen=True, slots=True)
class Failure:
    """An exception as people read it. Records outlive compiles (``DDPSplitBackend.records``
    keeps the last 256 graphs), so they keep text only: an exception's traceback holds its
    frames, and their locals hold the piece's graph, its tensors and Dynamo's real inputs."""

    exc_type: str
    """The exception's class, qualified (``RuntimeError``, ``torch._dynamo.exc.Unsupported``)."""
    message: str
    """``str(exception)``."""
    traceback: str
    """The exception formatted as Python prints it: traceback, chained causes and notes."""

    @classmethod
    def of(cls, error: BaseException) -> Failure:
        kind = type(error)
        name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
        return cls(name, str(error), "".join(traceback.format_exception(error)))

    def __str__(self) -> str:
        return f"{self.exc_type}: {self.message}"


@dataclass(frozen=True, slots=True)
class PieceRecord:
    """What the compile stage did with one piece."""

    piece: int
    outcome: Outcome
    backend: str
    """The inner backend's name."""
    shared_with: int | None = None
    """For :attr:`Outcome.SHARED`: the piece whose compiled function this one runs."""
    error: Failure | None = None
    """For :attr:`Outcome.EAGER_FALLBACK`: what the inner backend (or the compiled piece's
    first, fake call) raised, as text (see :class:`Failure`)."""
    seconds: float = 0.0
    """The inner backend's seconds on this piece (its forward; 0 for a shared piece)."""

    def describe(self) -> str:
        """``inductor``, ``inductor (same as piece 3)`` or ``eager (fallback)``."""
        if self.outcome is Outcome.SHARED:
            return f"{self.backend} (same as piece {self.shared_with})"
        if self.outcome is Outcome.EAGER_FALLBACK:
            return "eager (fallback)"
        return self.backend


@dataclass(frozen=True, slots=True)
class CompiledPieces:
    callables: tuple[Callable[..., Any], ...]
    records: tuple[PieceRecord, ...]


class InnerFallbackWarning(UserWarning):
    """The inner backend failed on a piece, which runs eagerly (``on_inner_failure="eager"``).
    Its own category, so that a test suite or a training script can catch it, turn it into
    an error or silence it without matching the message."""


class MetadataMismatchError(RuntimeError):
    """AOTAutograd's forward metadata for a piece does not describe that piece; its backward
    would be compiled with another graph's metadata (Note [Backward metadata per piece])."""


@dataclass(frozen=True, slots=True)
class InnerCompile:
    """How to compile: the inner backend and what to do when it fails."""

    fn: CompilerFn
    name: str
    raise_on_failure: bool = False


def _fake_input(node: fx.Node, example: Any, fake_mode: Any) -> Any:
    value = node.meta.get("example_value")
    if isinstance(value, _torch.FakeTensor) and value.fake_mode is fake_mode:
        return value
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return value
    if isinstance(example, _torch.FakeTensor):
        return example
    if isinstance(example, torch.Tensor):
        return fake_mode.from_tensor(example)
    return example


@contextlib.contextmanager
def _fakify_first_call(context: Any) -> Iterator[None]:
    """Like DDPOptimizer: compiled AOT pieces return output metadata on their first, fake call."""
    if context is None:
        yield
        return
    previous = _torch.set_fakify_first_call(context, True)
    try:
        yield
    finally:
        _torch.set_fakify_first_call(context, previous)


@contextlib.contextmanager
def _allow_non_fake_inputs(fake_mode: Any) -> Iterator[None]:
    previous = fake_mode.allow_non_fake_inputs
    fake_mode.allow_non_fake_inputs = True
    try:
        with fake_mode:
            yield
    finally:
        fake_mode.allow_non_fake_inputs = previous


def copy_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` sharing its attributes: inner backends may rewrite the graph in place."""
    graph = fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)


def _set_example_values(gm: fx.GraphModule, args: Sequence[Any]) -> None:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, args):
        if _torch.grapharg(node) is None:
            node.meta["example_value"] = value


@dataclass(frozen=True, slots=True)
class _Compiled:
    fn: Callable[..., Any]
    record: PieceRecord
    outputs: list[Any] | None
    """Fake outputs (``None`` when no later piece needs them)."""


@dataclass(frozen=True, slots=True)
class _Reusable:
    piece: int
    fn: Callable[..., Any]
    outputs: tuple[Any, ...]


_USER_CODE_LEVEL = 6
"""The warning's ``stacklevel``: past _fallback, _compile_unit, compile_pieces (or
compile_whole) and DDPSplitBackend.__call__, to the Dynamo frame that called the backend."""


def _fallback(gm: fx.GraphModule, index: int, count: int, inner: InnerCompile, error: BaseException) -> Callable[..., Any]:
    """The inner backend's failure on piece ``index``: raise it, or run the piece eagerly."""
    where = f"piece {index} of {count} ({len(gm.graph.nodes)} nodes)"
    if inner.raise_on_failure:
        error.add_note(f"ddp_split: inner backend {inner.name!r} failed on {where}")
        raise error
    warnings.warn(
        f"ddp_split: inner backend {inner.name!r} failed on {where}; running it eagerly. "
        f"Error: {f'{type(error).__name__}: {error}'[:2000]}",
        InnerFallbackWarning,
        stacklevel=_USER_CODE_LEVEL,
    )
    return track_state_calls(gm)


def _compile_unit(
    gm: fx.GraphModule,
    args: list[Any],
    inner: InnerCompile,
    *,
    index: int,
    count: int,
    context: Any,
    fake_mode: Any | None,
    times: StageTimes,
) -> _Compiled:
    """Compile one graph with the inner backend. With ``fake_mode`` (a piece whose outputs
    feed later pieces) its compiled code also runs once on fake inputs. ``context``: the
    piece's own tracing context, current while it compiles (Note [Backward metadata per
    piece]), or ``None``."""
    with times.measure("copy"):
        pristine = copy_module(gm)
    with _torch.tracing(context) if context is not None else contextlib.nullcontext(), _fakify_first_call(context):
        start = time.perf_counter()
        with times.measure("inner"):
            result: Attempt = call_inner(inner.fn, gm, list(args))
        seconds = time.perf_counter() - start
        used_aot = result.ok and context is not None and _torch.aot_fw_metadata(context) is not None
        outputs = None
        if used_aot and fake_mode is not None:
            # The compiled piece's first call on fake inputs gives its real output metadata.
            # It can still fail where compiling did not (AOTAutograd saving an inference
            # tensor for backward in a piece that starts inside inference_mode, say).
            with times.measure("fake_run"):
                run = attempt(_run_on_fakes, result.value, args, fake_mode)
            result = Attempt(result.value) if run.ok else run
            outputs = run.value
    if result.ok:
        fn, record = result.value, PieceRecord(index, Outcome.COMPILED, inner.name, seconds=seconds)
    else:
        fn = _fallback(pristine, index, count, inner, result.error)
        record = PieceRecord(index, Outcome.EAGER_FALLBACK, inner.name, error=Failure.of(result.error), seconds=seconds)
        used_aot = False
    if outputs is None and fake_mode is not None:
        with times.measure("fake_run"):
            outputs = _run_on_fakes(pristine, args, fake_mode)
    if used_aot:
        _check_metadata(context, gm, index, count)
    return _Compiled(fn, record, outputs)


def _check_metadata(context: Any, gm: fx.GraphModule, index: int, count: int) -> None:
    """The forward metadata the piece's backward compile will read describes this piece."""
    inputs = sum(1 for n in gm.graph.nodes if n.op == "placeholder")
    (output,) = (n for n in gm.graph.nodes if n.op == "output")
    outputs = len(_torch.pytree.tree_leaves(output.args[0]))
    metadata = _torch.aot_fw_metadata(context)
    found = _torch.aot_metadata_counts(metadata)
    if found != (inputs, outputs) or not _torch.backward_reads_own_metadata(context):
        raise MetadataMismatchError(
            f"ddp_split: piece {index} of {count} has {inputs} inputs and {outputs} outputs, but the "
            f"forward metadata its backward compile would read describes {found[0]} inputs and "
            f"{found[1]} outputs (or is taken from a DDPOptimizer stack); see Note [Backward "
            "metadata per piece] in ddp_split_backend/compile.py"
        )


def _run_on_fakes(fn: Callable[..., Any], args: Sequence[Any], fake_mode: Any) -> list[Any]:
    with preserve_global_state(), _allow_non_fake_inputs(fake_mode):
        return list(fn(*args))


def _float_symbols(gm: fx.GraphModule, args: Sequence[Any]) -> frozenset[Any]:
    """The float symbols a piece uses (Note [Python floats in pieces])."""
    values = [*args, *(n.meta.get("example_value") for n in gm.graph.nodes)]
    return frozenset().union(*(_torch.float_symbols(v) for v in values))


def compile_whole(
    gm: fx.GraphModule, example_inputs: Sequence[Any], inner: InnerCompile, times: StageTimes
) -> CompiledPieces:
    """Compile ``gm`` as one piece (a one-bucket graph, or a piece DDPOptimizer cut)."""
    with _torch.user_saved_tensor_hooks_off():  # Note [User hooks at compile time]
        unit = _compile_unit(
            gm, list(example_inputs), inner, index=0, count=1, context=None, fake_mode=None, times=times
        )
    return CompiledPieces((unit.fn,), (unit.record,))


def compile_pieces(
    split: SplitGraph,
    example_inputs: Sequence[Any],
    inner: InnerCompile,
    times: StageTimes,
    *,
    reuse: bool = False,
) -> CompiledPieces:
    """Compile every piece of ``split`` with the inner backend, in order, on fake inputs.

    Args:
        split: the pieces.
        example_inputs: what Dynamo passed the backend (real tensors, SymInts, ...).
        inner: the inner backend, its name, and whether its failures propagate.
        times: where the seconds of each stage are added up.
        reuse: compile pieces with identical structure and input metadata once (see
            ``SplitConfig.reuse_identical_pieces``).

    Returns:
        The callables, one per piece, and a record of how each was compiled.
    """
    with _torch.user_saved_tensor_hooks_off():  # Note [User hooks at compile time]
        return _compile_in_order(split, example_inputs, inner, times, reuse)


def _compile_in_order(
    split: SplitGraph, example_inputs: Sequence[Any], inner: InnerCompile, times: StageTimes, reuse: bool
) -> CompiledPieces:
    fake_mode = _torch.detect_fake_mode(example_inputs) or _torch.detect_fake_mode(
        [p.meta.get("example_value") for p in split.placeholders]
    )
    if fake_mode is None:
        fake_mode = _torch.FakeTensorMode(allow_non_fake_inputs=True)
    values: list[Any] = [None] * split.num_slots
    for i, node in enumerate(split.placeholders):
        example = example_inputs[i] if i < len(example_inputs) else None
        values[i] = _fake_input(node, example, fake_mode)

    context = _torch.TracingContext.try_get()
    callables: list[Callable[..., Any]] = []
    records: list[PieceRecord] = []
    reusable: dict[tuple, _Reusable] = {}
    count = len(split.pieces)
    for piece in split.pieces:
        args = [values[s] for s in piece.inputs]
        with times.measure("reuse"):
            key = structure_key(piece.gm, args, piece.grad) if reuse else None
            hit = reusable.get(key) if key is not None else None
            outputs = fresh_outputs(hit.outputs, fake_mode) if hit is not None else None
        if hit is not None:
            callables.append(hit.fn)
            records.append(PieceRecord(piece.index, Outcome.SHARED, inner.name, shared_with=hit.piece))
        else:
            _set_example_values(piece.gm, args)
            own_context = _torch.piece_tracing_context(context) if context is not None else None
            floats = _float_symbols(piece.gm, args)
            with torch.set_grad_enabled(piece.grad), _torch.only_float_symbols(fake_mode, floats):
                unit = _compile_unit(
                    piece.gm, args, inner, index=piece.index, count=count, context=own_context,
                    fake_mode=fake_mode, times=times,
                )
            outputs = unit.outputs
            callables.append(unit.fn)
            records.append(unit.record)
            if key is not None and unit.record.outcome is Outcome.COMPILED and reusable_outputs(outputs, args):
                reusable[key] = _Reusable(piece.index, unit.fn, tuple(outputs))
        for s, value in zip(piece.outputs, outputs):
            values[s] = value
    return CompiledPieces(tuple(callables), tuple(records))
