"""Randomized equivalence: random programs with nested global-state regions, compiled with
ddp_split at random bucket caps, must match eager exactly where plain ``torch.compile`` does.

Two generators:

* **Programs** (:class:`Program`): a stack of small ``nn.Linear`` layers and pointwise ops run
  inside randomly nested regions of every global-state kind Dynamo records (grad mode,
  autocast incl. ``enabled=False``, inference mode, forward-AD dual level and forward-AD grad
  mode). :class:`FuzzNet` interprets the spec in ``forward``; Dynamo specialises on it (it is
  constant Python data on the module). Bucket caps of 0.0001..0.003 MiB against layers of
  ~300..1100 bytes put cuts inside regions, at their edges and between nested regions.
  A program is only used when eager runs it and plain ``torch.compile(backend="aot_eager")``
  matches eager; ddp_split must then match eager too (outputs, dtypes, ``requires_grad``,
  parameter and input gradients) and leave the global state as it found it.
* **FX graphs** (:class:`FxProgram`): random graphs of pointwise/matmul ops and raw state
  nodes (grad mode, autocast, inference mode), without ``meta``, split directly at random
  legal cuts and run piece by piece eagerly.

A failure prints the falsifying spec as Python (``Program(...)``/``FxProgram(...)``, the
names are importable from this module) and, as a hypothesis note, the generated
``forward`` source; :func:`render_forward` turns any spec into that source.

Profiles: the default tests run a fixed-seed (derandomized) set of examples: 150 compiled
programs, 400 FX graphs and 60 source-rendering checks, about 80 s on 2 CPU cores (a compiled
program costs ~0.5 s: an aot_eager compile and a ddp_split compile; 300 until 2026-12-07, cut
to keep the default suite near 10 minutes).
``-m slow`` runs the deep profile with new random seeds on every run: 5000 compiled programs
(about an hour) and 10000 FX graphs. Counts can be set with the environment variables
``DDP_SPLIT_FUZZ_PROGRAMS``/``DDP_SPLIT_FUZZ_FX`` (default profile) and
``DDP_SPLIT_FUZZ_PROGRAMS_DEEP``/``DDP_SPLIT_FUZZ_FX_DEEP`` (deep profile).
"""

from __future__ import annotations

import copy
import os
import operator
import traceback
import warnings
from typing import Any, NamedTuple

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.fx as fx
import torch.nn as nn
from hypothesis import HealthCheck, assume, event, given, note, settings
from hypothesis.control import currently_in_test_context
from hypothesis.errors import UnsatisfiedAssumption
from hypothesis import strategies as st

from ddp_split_backend import DDPSplitBackend, SplitConfig, ddp_split
from ddp_split_backend import Outcome as PieceOutcome
from ddp_split_backend.compile import copy_module
from ddp_split_backend.guards import GlobalState, attempt, dual_level_open, track_state_calls
from ddp_split_backend.layout import layout_graph
from ddp_split_backend.runtime import StitchedCallable
from ddp_split_backend.split import split_graph
from ddp_split_backend.state import Ambient

from .helpers import CountingCompiler, leak_nested_inference_guards_and_raise

pytestmark = pytest.mark.fuzz

# ---------------------------------------------------------------------------------------
# Program specs
# ---------------------------------------------------------------------------------------

OPS = ("linear", "tanh", "relu", "sin", "double", "residual", "roll", "ellipsis", "dtype", "zeros", "memory_format")
"""Leaf ops. ``residual`` adds the input of the innermost enclosing body. The last five put
the node arguments Dynamo records into the graph: slices (``roll``), ``Ellipsis`` and
``None`` indices (``ellipsis``), dtypes (``dtype``), sizes, dtypes and devices as keywords
(``zeros``), memory formats (``memory_format``)."""

PATHS = ("name", "counting")
"""How ddp_split is reached: ``name`` is the path users take (``backend="ddp_split"``, inner
backend by name, default options, so identical pieces are shared); ``counting`` passes a
counting callable as the inner backend (every piece compiled on its own)."""

REGIONS = (
    "no_grad",
    "enable_grad",
    "grad_on",  # torch.set_grad_enabled(True)
    "grad_off",  # torch.set_grad_enabled(False)
    "autocast_bf16",
    "autocast_fp16",
    "autocast_off",  # torch.autocast("cpu", enabled=False)
    "inference",
    "dual",  # forward-AD dual_level with make_dual / unpack_dual
    "fwd_grad_off",  # forward_ad._set_fwd_grad_enabled(False)
)


class Region(NamedTuple):
    """``with <kind>: h = body(x)``, then ``x = x + h`` (``keep``) or ``x = h``."""

    kind: str
    body: tuple
    keep: bool = False


class Program(NamedTuple):
    body: tuple
    width: int = 8
    input_grad: bool = True
    ambient_grad: bool = True
    bucket_cap_mb: float = 0.001
    first_bucket_cap_mb: float | None = None
    path: str = "name"
    min_piece_mb: float | None = None


def _note(text: str) -> None:
    """``hypothesis.note`` (printed with a falsifying example); ignored outside hypothesis."""
    if currently_in_test_context():
        note(text)


def _event(text: str) -> None:
    if currently_in_test_context():
        event(text)


def count_linears(body: tuple) -> int:
    return sum(
        (item == "linear") if isinstance(item, str) else count_linears(item.body) for item in body
    )


def uses_low_precision(body: tuple) -> bool:
    return any(
        isinstance(item, Region)
        and (item.kind in ("autocast_bf16", "autocast_fp16") or uses_low_precision(item.body))
        for item in body
    )


class FuzzNet(nn.Module):
    """Interprets a program body; ``render_forward`` writes the same computation as source."""

    def __init__(self, body: tuple, width: int) -> None:
        super().__init__()
        self.body = body
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(count_linears(body))])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, _ = self._run(self.body, x, 0)
        return x

    def _run(self, body: tuple, x: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
        skip = x
        for item in body:
            if isinstance(item, Region):
                h, k = self._region(item, x, k)
                x = x + h if item.keep else h
            elif item == "linear":
                x = self.layers[k](x.float())
                k += 1
            elif item == "tanh":
                x = torch.tanh(x)
            elif item == "relu":
                x = torch.relu(x)
            elif item == "sin":
                x = torch.sin(x)
            elif item == "double":
                x = x * 2
            elif item == "residual":
                x = x + skip
            elif item == "roll":
                x = torch.cat([x[:, 1:], x[:, :1]], dim=1)
            elif item == "ellipsis":
                x = x[..., None][:, None, ..., 0].squeeze(1)
            elif item == "dtype":
                x = (x.to(torch.float64) * 0.5).to(x.dtype)
            elif item == "zeros":
                x = x + torch.zeros(x.size(), dtype=x.dtype, device=x.device)
            elif item == "memory_format":
                x = x.contiguous(memory_format=torch.contiguous_format)
            else:
                raise ValueError(item)
        return x, k

    def _region(self, region: Region, x: torch.Tensor, k: int) -> tuple[torch.Tensor, int]:
        kind, body = region.kind, region.body
        if kind == "no_grad":
            with torch.no_grad():
                return self._run(body, x, k)
        if kind == "enable_grad":
            with torch.enable_grad():
                return self._run(body, x, k)
        if kind == "grad_on":
            with torch.set_grad_enabled(True):
                return self._run(body, x, k)
        if kind == "grad_off":
            with torch.set_grad_enabled(False):
                return self._run(body, x, k)
        if kind == "autocast_bf16":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self._run(body, x, k)
        if kind == "autocast_fp16":
            with torch.autocast("cpu", dtype=torch.float16):
                return self._run(body, x, k)
        if kind == "autocast_off":
            with torch.autocast("cpu", enabled=False):
                return self._run(body, x, k)
        if kind == "inference":
            with torch.inference_mode():
                h, k = self._run(body, x, k)
            return h.clone(), k
        if kind == "dual":
            with fwAD.dual_level():
                dual = fwAD.make_dual(x, torch.ones_like(x))
                h, k = self._run(body, dual, k)
                primal, tangent = fwAD.unpack_dual(h)
                h = primal if tangent is None else primal + tangent
            return h, k
        if kind == "fwd_grad_off":
            with fwAD._set_fwd_grad_enabled(False):
                return self._run(body, x, k)
        raise ValueError(kind)


_OP_SOURCE = {
    "tanh": "{x} = torch.tanh({x})",
    "relu": "{x} = torch.relu({x})",
    "sin": "{x} = torch.sin({x})",
    "double": "{x} = {x} * 2",
    "residual": "{x} = {x} + {skip}",
    "roll": "{x} = torch.cat([{x}[:, 1:], {x}[:, :1]], dim=1)",
    "ellipsis": "{x} = {x}[..., None][:, None, ..., 0].squeeze(1)",
    "dtype": "{x} = ({x}.to(torch.float64) * 0.5).to({x}.dtype)",
    "zeros": "{x} = {x} + torch.zeros({x}.size(), dtype={x}.dtype, device={x}.device)",
    "memory_format": "{x} = {x}.contiguous(memory_format=torch.contiguous_format)",
}
_REGION_SOURCE = {
    "no_grad": "torch.no_grad()",
    "enable_grad": "torch.enable_grad()",
    "grad_on": "torch.set_grad_enabled(True)",
    "grad_off": "torch.set_grad_enabled(False)",
    "autocast_bf16": 'torch.autocast("cpu", dtype=torch.bfloat16)',
    "autocast_fp16": 'torch.autocast("cpu", dtype=torch.float16)',
    "autocast_off": 'torch.autocast("cpu", enabled=False)',
    "inference": "torch.inference_mode()",
    "dual": "fwAD.dual_level()",
    "fwd_grad_off": "fwAD._set_fwd_grad_enabled(False)",
}


def render_forward(program: Program) -> str:
    """``FuzzNet(program.body, program.width).forward`` as straight-line Python source."""
    lines = ["def forward(self, x):"]
    counter = iter(range(10**6))

    def body_source(body: tuple, x: str, depth: int, k: int) -> int:
        pad = "    " * depth
        skip = f"skip{next(counter)}"
        if "residual" in body:
            lines.append(f"{pad}{skip} = {x}")
        for item in body:
            if isinstance(item, Region):
                h = f"h{next(counter)}"
                lines.append(f"{pad}with {_REGION_SOURCE[item.kind]}:")
                inner = pad + "    "
                if item.kind == "dual":
                    lines.append(f"{inner}{h} = fwAD.make_dual({x}, torch.ones_like({x}))")
                else:
                    lines.append(f"{inner}{h} = {x}")
                k = body_source(item.body, h, depth + 1, k)
                if item.kind == "dual":
                    lines.append(f"{inner}primal, tangent = fwAD.unpack_dual({h})")
                    lines.append(f"{inner}{h} = primal if tangent is None else primal + tangent")
                if item.kind == "inference":
                    lines.append(f"{pad}{h} = {h}.clone()")
                lines.append(f"{pad}{x} = {x} + {h}" if item.keep else f"{pad}{x} = {h}")
            elif item == "linear":
                lines.append(f"{pad}{x} = self.layers[{k}]({x}.float())")
                k += 1
            else:
                lines.append(pad + _OP_SOURCE[item].format(x=x, skip=skip))
        return k

    body_source(program.body, "x", 1, 0)
    lines.append("    return x")
    return "\n".join(lines)


_WEIGHTED_OPS = ("linear", "linear", "linear", *OPS[1:])
"""Linear layers carry the bytes that fill buckets: draw them more often."""


@st.composite
def bodies(draw: st.DrawFn, depth: int = 0, in_dual: bool = False, max_depth: int = 3) -> tuple:
    items = []
    for _ in range(draw(st.integers(1, 5))):
        if depth < max_depth and draw(st.integers(0, 2)) == 0:
            kinds = [k for k in REGIONS if not (in_dual and k == "dual")]
            kind = draw(st.sampled_from(kinds))
            body = draw(bodies(depth + 1, in_dual or kind == "dual", max_depth))
            items.append(Region(kind, body, draw(st.booleans())))
        else:
            items.append(draw(st.sampled_from(_WEIGHTED_OPS)))
    return tuple(items)


@st.composite
def programs(draw: st.DrawFn) -> Program:
    body = draw(bodies())
    if count_linears(body) == 0:
        body = ("linear", *body)
    cap = draw(st.sampled_from([0.0001, 0.0002, 0.0003, 0.0005, 0.001, 0.002, 0.003]))
    first = draw(st.one_of(st.none(), st.sampled_from([0.0001, 0.0003, 0.001])))
    return Program(
        body=body,
        width=draw(st.sampled_from([8, 16])),
        input_grad=draw(st.booleans()),
        ambient_grad=draw(st.integers(0, 3)) > 0,
        bucket_cap_mb=cap,
        first_bucket_cap_mb=None if first is None else min(first, cap),
        path=draw(st.sampled_from(PATHS)),
        min_piece_mb=draw(st.one_of(st.none(), st.none(), st.sampled_from([0.0002, 0.0005, 0.002]))),
    )


# ---------------------------------------------------------------------------------------
# Running a program three ways
# ---------------------------------------------------------------------------------------


def _tolerances(program: Program) -> dict[str, float]:
    if uses_low_precision(program.body):
        return {"atol": 3e-2, "rtol": 3e-2}
    return {"atol": 1e-5, "rtol": 1.3e-6}


def _grads(module: nn.Module) -> list[torch.Tensor]:
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in module.parameters()]


class Outcome(NamedTuple):
    out: torch.Tensor
    requires_grad: bool
    grads: list[torch.Tensor]
    input_grad: torch.Tensor | None


def _run_once(module: nn.Module, fn: Any, program: Program, x: torch.Tensor) -> Outcome:
    x = x.detach().clone().requires_grad_(program.input_grad)
    with torch.set_grad_enabled(program.ambient_grad):
        out = fn(x)
    if out.requires_grad:
        out.float().sum().backward()
    return Outcome(out.detach(), out.requires_grad, _grads(module), x.grad)


def _matches(actual: Outcome, expected: Outcome, tol: dict[str, float]) -> None:
    torch.testing.assert_close(actual.out, expected.out, **tol)
    assert actual.out.dtype == expected.out.dtype
    assert actual.requires_grad == expected.requires_grad
    for a, e in zip(actual.grads, expected.grads, strict=True):
        torch.testing.assert_close(a, e, **tol)
    if expected.input_grad is None:
        assert actual.input_grad is None or not actual.input_grad.any()
    else:
        torch.testing.assert_close(actual.input_grad, expected.input_grad, **tol)


def restore(before: GlobalState) -> bool:
    """Restore ``before`` and close a leaked dual level; whether one was open."""
    leaked = dual_level_open()
    if leaked:
        torch._C._exit_dual_level(level=0)
    before.restore()
    return leaked


def _attempt(fn: Any) -> tuple[Any, str | None]:
    """``fn()``, or the formatted error it raised, through :func:`guards.attempt`: the failed
    call's frames are cleared and the autograd state put back (plain ``torch.compile`` itself
    leaves inference mode on after a failed trace inside nested ``inference_mode`` regions,
    see ``AutogradCheckpoint``, which would poison every later example)."""
    result = attempt(fn)
    if result.ok:
        return result.value, None
    return None, "".join(traceback.format_exception(result.error))


def check_program(program: Program) -> None:
    """The property: where eager runs ``program`` and plain aot_eager compile matches eager,
    ddp_split (inner aot_eager, ``program``'s caps) matches eager and leaves no state behind."""
    _note(render_forward(program))
    tol = _tolerances(program)
    torch.manual_seed(0)
    base = FuzzNet(program.body, program.width)
    x = torch.randn(2, program.width)
    before = GlobalState.capture()

    eager_model = copy.deepcopy(base)
    expected, error = _attempt(lambda: _run_once(eager_model, eager_model, program, x))
    if error is not None:  # torch itself rejects the program
        restore(before)
        _event("skipped: eager raises")
        assume(False)
    assert GlobalState.capture() == before and not dual_level_open()

    torch._dynamo.reset()
    plain_model = copy.deepcopy(base)

    def plain_compile() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = torch.compile(plain_model, backend="aot_eager")
            _matches(_run_once(plain_model, compiled, program, x), expected, tol)

    _, error = _attempt(plain_compile)
    torch._dynamo.reset()
    restore(before)
    if error is not None:  # plain torch.compile cannot do it (or differs from eager)
        _event("skipped: plain compile fails or differs")
        assume(False)

    split_model = copy.deepcopy(base)
    options = {"inner": "aot_eager", "bucket_cap_mb": program.bucket_cap_mb}
    if program.first_bucket_cap_mb is not None:
        options["first_bucket_cap_mb"] = program.first_bucket_cap_mb
    if program.min_piece_mb is not None:
        options["min_piece_mb"] = program.min_piece_mb
    if program.path == "name":  # the shared instance registered as "ddp_split"
        backend = ddp_split
        backend.records.clear()
        compile_kwargs: dict[str, Any] = {"backend": "ddp_split", "options": options}
    else:
        backend = DDPSplitBackend(SplitConfig(**{**options, "inner": CountingCompiler()}))
        compile_kwargs = {"backend": backend}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = torch.compile(split_model, **compile_kwargs)
        actual, error = _attempt(lambda: _run_once(split_model, compiled, program, x))
    after = GlobalState.capture()
    leaked_dual_level = restore(before)
    records = list(backend.records)
    torch._dynamo.reset()  # also clears backend.records
    if any(p.outcome is PieceOutcome.SHARED for r in records for p in r.pieces):
        _event("identical pieces shared")
    for record in records:
        _note(record.plan.table())
    if any(len(piece.buckets) > 1 for r in records for piece in r.plan.pieces):
        _event("buckets grouped into one piece (min_piece_mb)")
    pieces = max((len(r.plan.pieces) for r in records), default=0)
    _event(f"pieces (largest graph): {pieces if pieces < 4 else '4+'}")
    fallbacks = [str(w.message) for w in caught if "failed on piece" in str(w.message)]
    if error is not None:
        raise AssertionError(f"ddp_split raised where plain torch.compile works:\n{error}")
    # Plain compile handled the whole program, so every piece of it must compile too.
    assert not fallbacks, "a piece fell back to eager where plain torch.compile works:\n" + "\n".join(
        f[:2000] for f in fallbacks
    )
    assert after == before, f"ddp_split left global state changed: {after} != {before}"
    assert not leaked_dual_level, "ddp_split left a forward-AD dual level open"
    _matches(actual, expected, tol)


# ---------------------------------------------------------------------------------------
# Random FX graphs, split directly
# ---------------------------------------------------------------------------------------

FX_UNARY = {
    "sin": torch.sin,
    "tanh": torch.tanh,
    "relu": torch.relu,
    "cos": torch.cos,
    "neg": operator.neg,
}
FX_BINARY = {
    "add": torch.add,
    "mul": torch.mul,
    "sub": operator.sub,
    "iadd": operator.add,
    "matmul": torch.matmul,
}
FX_METHODS = ("float", "t", "clone", "contiguous")
"""``call_method`` nodes; ``t`` is a view (an alias crossing a cut into inference mode)."""


class FxStep(NamedTuple):
    """One node. ``op``: a key of FX_UNARY/FX_BINARY, ``.method`` for a call_method, or a
    state node: ``grad_on``/``grad_off``, ``autocast_bf16``/``autocast_off``/``inference``
    (opens a region), ``exit`` (closes the innermost open region). ``args`` index the values
    made so far (inputs first), modulo their number."""

    op: str
    args: tuple[int, ...] = ()


class FxProgram(NamedTuple):
    steps: tuple[FxStep, ...]
    outputs: tuple[int, ...]
    cuts: tuple[int, ...]
    """Raw picks among the legal cut positions (modulo their number)."""
    num_inputs: int = 2
    structured_output: bool = False
    ambient_grad: bool = True
    input_grad: bool = False


def build_fx_graph(program: FxProgram) -> fx.GraphModule:
    """The graph of ``program``: regions left open are closed and grad mode is set back at the
    end, like Dynamo's graphs (they always leave the state they were entered with)."""
    graph = fx.Graph()
    values: list[fx.Node] = [graph.placeholder(f"x{i}") for i in range(program.num_inputs)]
    regions: list[tuple[str, fx.Node]] = []
    grad = program.ambient_grad

    def pick(raw: int) -> fx.Node:
        return values[raw % len(values)]

    def close(kind: str, enter: fx.Node) -> None:
        if kind == "inference":
            graph.call_function(torch.autograd.grad_mode._exit_inference_mode, (enter,))
        else:
            graph.call_function(torch.amp.autocast_mode._exit_autocast, (enter,))

    for step in program.steps:
        args = tuple(pick(a) for a in step.args)
        if step.op in FX_UNARY:
            values.append(graph.call_function(FX_UNARY[step.op], args[:1]))
        elif step.op in FX_BINARY:
            values.append(graph.call_function(FX_BINARY[step.op], args[:2]))
        elif step.op.startswith("."):
            values.append(graph.call_method(step.op[1:], args[:1]))
        elif step.op in ("grad_on", "grad_off"):
            grad = step.op == "grad_on"
            graph.call_function(torch._C._set_grad_enabled, (grad,))
        elif step.op == "autocast_bf16":
            enter = graph.call_function(
                torch.amp.autocast_mode._enter_autocast, ("cpu", torch.bfloat16, True, None)
            )
            regions.append(("autocast", enter))
        elif step.op == "autocast_off":
            enter = graph.call_function(
                torch.amp.autocast_mode._enter_autocast, ("cpu", torch.bfloat16, False, None)
            )
            regions.append(("autocast", enter))
        elif step.op == "inference":
            enter = graph.call_function(torch.autograd.grad_mode._enter_inference_mode, (True,))
            regions.append(("inference", enter))
        elif step.op == "exit":
            if regions:
                close(*regions.pop())
        else:
            raise ValueError(step.op)
    while regions:
        close(*regions.pop())
    if grad != program.ambient_grad:
        graph.call_function(torch._C._set_grad_enabled, (program.ambient_grad,))
    outs = tuple(pick(o) for o in program.outputs)
    if program.structured_output:
        graph.output((outs[:1], {"rest": list(outs[1:]), "constant": 1.5}, None))
    else:
        graph.output(outs)
    return fx.GraphModule(nn.Module(), graph)


def _fx_steps() -> st.SearchStrategy[FxStep]:
    index = st.integers(0, 50)
    return st.one_of(
        st.builds(FxStep, st.sampled_from(sorted(FX_UNARY)), st.tuples(index)),
        st.builds(FxStep, st.sampled_from(sorted(FX_BINARY)), st.tuples(index, index)),
        st.builds(FxStep, st.sampled_from([f".{m}" for m in FX_METHODS]), st.tuples(index)),
        st.builds(
            FxStep,
            st.sampled_from(["grad_on", "grad_off", "autocast_bf16", "autocast_off", "inference", "exit"]),
        ),
    )


@st.composite
def fx_programs(draw: st.DrawFn) -> FxProgram:
    return FxProgram(
        steps=tuple(draw(st.lists(_fx_steps(), min_size=2, max_size=14))),
        outputs=tuple(draw(st.lists(st.integers(0, 50), min_size=1, max_size=3))),
        cuts=tuple(draw(st.lists(st.integers(0, 50), min_size=1, max_size=4))),
        num_inputs=draw(st.integers(1, 3)),
        structured_output=draw(st.booleans()),
        ambient_grad=draw(st.integers(0, 3)) > 0,
        input_grad=draw(st.booleans()),
    )


def check_fx_program(program: FxProgram) -> None:
    """The pieces of a random graph, split at random legal cuts and run eagerly in order,
    compute what the graph computes and leave the global state as they found it."""
    gm = build_fx_graph(program)
    _note(gm.code)
    torch.manual_seed(0)
    inputs = [torch.randn(4, 4, requires_grad=program.input_grad) for _ in range(program.num_inputs)]
    before = GlobalState.capture()
    with torch.set_grad_enabled(program.ambient_grad):
        entry = GlobalState.capture()
        # Run like an eager piece: if it raises inside nested inference_mode regions, the
        # guards are exited innermost first (frames dying with the traceback free them in
        # creation order, which leaves inference mode on).
        reference = track_state_calls(copy_module(gm))
        expected, error = _attempt(lambda: reference(*inputs))
        if error is not None:  # the graph itself is invalid (dtype mix, inference tensor, ...)
            restore(before)
            _event("skipped: graph raises")
            assume(False)
        if GlobalState.capture() != entry:  # Dynamo graphs always restore what they change
            restore(before)
            _event("skipped: graph leaves global state changed")
            assume(False)
        layout = layout_graph(gm, Ambient.capture())
        legal = [i for i, reason in enumerate(layout.blocked) if reason is None]
        cuts = sorted({legal[c % len(legal)] for c in program.cuts}) if legal else []
        _note(f"legal cuts {legal}, chosen {cuts}")
        _event(f"fx pieces: {len(cuts) + 1 if len(cuts) < 3 else '4+'} (legal cuts: {min(len(legal), 3)}{'+' if len(legal) >= 3 else ''})")
        split = split_graph(gm, layout, cuts)
        for piece in split.pieces:
            _note(f"piece {piece.index}:{piece.gm.code}")
        stitched = StitchedCallable(split, [p.gm for p in split.pieces], ["eager"] * len(split.pieces))
        actual, error = _attempt(lambda: stitched(*inputs))
        inside = GlobalState.capture()
    after = GlobalState.capture()
    restore(before)
    if error is not None:
        raise AssertionError(f"the pieces raised where the graph does not:\n{error}")
    assert after == before, f"pieces left global state changed: {after} != {before}"
    assert inside.grad == program.ambient_grad
    assert type(actual) is type(expected)
    torch.testing.assert_close(actual, expected, equal_nan=True, rtol=0, atol=0)
    for a, e in zip(_tensors(actual), _tensors(expected), strict=True):
        assert a.dtype == e.dtype and a.requires_grad == e.requires_grad
        assert a.is_inference() == e.is_inference()


def _tensors(tree: Any) -> list[torch.Tensor]:
    import torch.utils._pytree as pytree

    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


# ---------------------------------------------------------------------------------------
# Tests and profiles
# ---------------------------------------------------------------------------------------

PROGRAMS_DEFAULT = int(os.environ.get("DDP_SPLIT_FUZZ_PROGRAMS", "80"))
FX_DEFAULT = int(os.environ.get("DDP_SPLIT_FUZZ_FX", "400"))
PROGRAMS_DEEP = int(os.environ.get("DDP_SPLIT_FUZZ_PROGRAMS_DEEP", "5000"))
FX_DEEP = int(os.environ.get("DDP_SPLIT_FUZZ_FX_DEEP", "10000"))

DEFAULT = settings(
    derandomize=True,  # a fixed set of examples: the default suite is deterministic
    deadline=None,
    database=None,
    print_blob=False,
    suppress_health_check=[HealthCheck.too_slow],
)
DEEP = settings(DEFAULT, derandomize=False, print_blob=True)
"""New random examples on every run; a failure prints its spec and a reproduce blob."""


@settings(DEFAULT, max_examples=PROGRAMS_DEFAULT)
@given(programs())
def test_random_state_programs_match_eager(program: Program) -> None:
    check_program(program)


@settings(DEFAULT, max_examples=FX_DEFAULT)
@given(fx_programs())
def test_random_fx_graph_pieces_match_graph(program: FxProgram) -> None:
    check_fx_program(program)


@pytest.mark.slow
@settings(DEEP, max_examples=PROGRAMS_DEEP)
@given(programs())
def test_random_state_programs_match_eager_deep(program: Program) -> None:
    check_program(program)


@pytest.mark.slow
@settings(DEEP, max_examples=FX_DEEP)
@given(fx_programs())
def test_random_fx_graph_pieces_match_graph_deep(program: FxProgram) -> None:
    check_fx_program(program)


def _exec_forward(program: Program) -> Any:
    namespace: dict[str, Any] = {"torch": torch, "fwAD": fwAD}
    exec(compile(render_forward(program), "<render_forward>", "exec"), namespace)
    return namespace["forward"]


@settings(DEFAULT, max_examples=60)
@given(programs())
def test_rendered_source_is_the_program(program: Program) -> None:
    """The source printed with a failure computes exactly what FuzzNet computes (eagerly)."""
    torch.manual_seed(0)
    model = FuzzNet(program.body, program.width)
    x = torch.randn(2, program.width)
    before = GlobalState.capture()
    expected, error = _attempt(lambda: model(x))
    if error is not None:
        restore(before)
        assume(False)
    actual = _exec_forward(program)(model, x)
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert actual.dtype == expected.dtype and actual.requires_grad == expected.requires_grad


def test_fx_programs_reach_every_state_node_and_cut_inside_regions() -> None:
    """The FX generator's vocabulary splits: a cut inside nested autocast/inference/grad
    regions is legal there and the pieces match (a fixed example, as a smoke test)."""
    program = FxProgram(
        steps=(
            FxStep("sin", (0,)),
            FxStep("autocast_bf16"),
            FxStep("matmul", (0, 1)),
            FxStep("grad_off"),
            FxStep("inference"),
            FxStep("tanh", (2,)),
            FxStep("add", (3, 2)),
            FxStep("exit"),
            FxStep(".clone", (4,)),
            FxStep("exit"),
            FxStep("grad_on"),
            FxStep("mul", (5, 1)),
        ),
        outputs=(6, 2),
        cuts=(1, 2, 3, 4),
        structured_output=True,
    )
    check_fx_program(program)


# Regressions found by the deep profile (each failed before its fix).


def test_regression_op_before_inner_enable_grad_keeps_no_grad() -> None:
    """Pieces are called with grad on when it is on anywhere inside them; ops before the
    inner enable_grad must still run with the ambient no_grad."""
    check_fx_program(
        FxProgram(steps=(FxStep(op="cos", args=(0,)), FxStep(op="grad_on", args=())), outputs=(1,),
                  cuts=(1,), num_inputs=1, structured_output=False, ambient_grad=False, input_grad=True)
    )


def test_regression_enable_grad_after_nested_no_grad_under_ambient_no_grad() -> None:
    check_program(
        Program(body=(Region(kind='no_grad', body=(Region(kind='no_grad', body=(Region(kind='no_grad', body=('linear',), keep=False),), keep=False),), keep=False), Region(kind='enable_grad', body=('linear',), keep=False)), width=8, input_grad=False, ambient_grad=False, bucket_cap_mb=0.0001, first_bucket_cap_mb=None)
    )


def test_regression_graph_raising_inside_nested_inference_mode_is_skipped_cleanly() -> None:
    """The deep profile's leak: a random graph that raises inside two nested inference_mode
    regions (a bf16 @ float32 matmul) left inference mode on for every later example."""
    program = FxProgram(
        steps=(
            FxStep("autocast_bf16"),
            FxStep("matmul", (0, 0)),
            FxStep("exit"),
            FxStep("inference"),
            FxStep("inference"),
            FxStep("matmul", (1, 0)),
        ),
        outputs=(2,),
        cuts=(0,),
        num_inputs=1,
    )
    with pytest.raises(UnsatisfiedAssumption):
        check_fx_program(program)
    assert not torch.is_inference_mode_enabled()


def test_regression_harness_puts_back_inference_mode_leaked_by_plain_compile() -> None:
    """The deep profile's second leak: plain ``torch.compile(backend="aot_eager")`` failing
    on a dual tensor inside two nested inference_mode regions (``Program(body=(Region(
    'no_grad', ('linear',)), 'linear', Region('inference', ('linear', Region('no_grad',
    ('linear',)), 'linear', Region('inference', ('linear', Region('dual', ('linear',)),
    'linear')))), 'linear'), ambient_grad=False, bucket_cap_mb=0.0001)``) left inference
    mode on, depending on the order the collector freed the trace's frames, and every later
    example failed. The harness now restores it after each phase."""
    before = GlobalState.capture()
    result, error = _attempt(leak_nested_inference_guards_and_raise)
    assert result is None and error is not None and "trace failed" in error
    assert GlobalState.capture() == before


def test_regression_identical_pieces_in_different_grad_modes_are_not_shared() -> None:
    """A piece run under no_grad and a structurally identical one under grad were compiled
    once: the grad piece ran the no_grad compilation and its output had no autograd history
    (gradients of the last layer all zero)."""
    check_program(
        Program(body=(Region(kind='no_grad', body=('linear',) * 5), 'linear', 'linear'), width=8,
                input_grad=False, ambient_grad=True, bucket_cap_mb=0.0001, first_bucket_cap_mb=None)
    )
