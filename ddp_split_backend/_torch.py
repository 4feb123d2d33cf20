"""Every private torch name ddp_split uses, in one place.

ddp_split works on Dynamo graphs, AOTAutograd's tracing context and DDP's reducer, and those
have no public API. Each private name is resolved here, once, at import, with a line saying
what it is for; the rest of the package uses only this module. When a torch release moves
or removes one, importing ddp_split fails with one message naming the symbol and the torch
version, and ``PRIVATE_NAMES`` lists them all (checked by ``tests/test_compile_stage.py``,
which also scans the package for private names used outside this module). Public names (``torch.fx``,
``torch.is_grad_enabled``, ...) are used directly elsewhere.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

__all__ = [  # every name the package uses (tests/test_compile_stage.py checks the list)
    "CHECKPOINT_POLICY_KEY",
    "CompileContext",
    "DDP_OPTIMIZER_MARK",
    "DIFFERENCES",
    "DYNAMO_SIGNALS",
    "DispatchKey",
    "FakeTensor",
    "FakeTensorMode",
    "InferenceModeGuard",
    "OpOverload",
    "OpOverloadPacket",
    "PRIVATE_NAMES",
    "PrivateName",
    "ReleaseDifference",
    "SUPPORTED",
    "ShortenTraceback",
    "TorchInternalsError",
    "TracingContext",
    "UnsupportedTorchError",
    "active_ddp_module",
    "aot_compiles_inference_mode_under_autograd",
    "aot_fw_metadata",
    "aot_metadata_counts",
    "backward_reads_own_metadata",
    "c_enter_dual_level",
    "c_exit_dual_level",
    "check_release",
    "checkpoint_region_op",
    "compiled_original",
    "ddp_comm_hooks",
    "ddp_first_bucket_bytes",
    "ddp_ignored",
    "ddp_rebuilds_buckets_later",
    "ddp_reduced_params",
    "default_first_bucket_bytes",
    "detect_fake_mode",
    "dispatch_exclude_set",
    "dispatch_include_set",
    "dispatch_key_excluded",
    "dispatch_key_included",
    "dual_makers",
    "dual_unpackers",
    "dynamo_config",
    "dynamo_optimize",
    "dynamo_source",
    "enter_autocast",
    "enter_dual_level",
    "enter_inference_mode",
    "exit_autocast",
    "exit_dual_level",
    "exit_inference_mode",
    "float_symbols",
    "forget_compiles",
    "frame_compile_seconds",
    "free_unbacked_symbols",
    "grapharg",
    "inductor_config",
    "inductor_list_options",
    "inductor_mode_options",
    "is_ddp_optimizer_piece",
    "is_fwd_grad_enabled",
    "is_multithreading_enabled",
    "is_view",
    "is_view_replay_enabled",
    "list_backends",
    "lookup_backend",
    "nesting_pairs",
    "on_lazy_backward_compile",
    "only_float_symbols",
    "piece_tracing_context",
    "pytree",
    "queue_after_backward",
    "record_function_enter",
    "record_function_exit",
    "record_function_pairs",
    "set_dispatch_key_excluded",
    "set_dispatch_key_included",
    "set_dynamo_source",
    "set_fakify_first_call",
    "set_fwd_grad_enabled",
    "set_grad_enabled",
    "set_inplace_requires_grad_allowed",
    "set_multithreading_enabled",
    "set_view_replay_enabled",
    "size_hint",
    "storage_id",
    "trace_structured",
    "tracing",
    "user_saved_tensor_hooks_off",
]

SUPPORTED = "torch>=2.11,<2.16"
"""The releases ddp_split is tested on (the CI matrix); ``pyproject.toml`` declares the same."""
_LOWEST, _BEYOND = (2, 11), (2, 16)


class TorchInternalsError(ImportError):
    """A private torch name ddp_split depends on is missing from the installed torch."""


class UnsupportedTorchError(ImportError):
    """The installed torch is outside the releases ddp_split supports."""


def _release(version: str | None = None) -> tuple[int, int]:
    major, minor = (int(part) for part in (version or torch.__version__).split("+")[0].split(".")[:2])
    return major, minor


def check_release(version: str) -> None:
    """Raise :class:`UnsupportedTorchError` naming the supported range unless ``version`` is in it."""
    if not _LOWEST <= _release(version) < _BEYOND:
        raise UnsupportedTorchError(
            f"ddp_split supports {SUPPORTED}; this is torch {version}. Install a torch in that "
            "range, or a ddp_split release that supports yours."
        )


check_release(torch.__version__)


@dataclass(frozen=True, slots=True)
class ReleaseDifference:
    """One way supported torch releases differ that ddp_split handles (README: Supported torch)."""

    what: str
    """What differs."""
    releases: str
    """Which releases behave which way."""
    handled: str
    """How this module tells them apart and what the package does about it."""
    upstream: str = ""
    """The upstream issue or pull request, where there is one."""


DIFFERENCES: list[ReleaseDifference] = []
"""Every release difference handled here, in the order they are declared."""


def _differs(what: str, releases: str, handled: str, upstream: str = "") -> None:
    DIFFERENCES.append(ReleaseDifference(what, releases, handled, upstream))


@dataclass(frozen=True, slots=True)
class PrivateName:
    path: str
    """Dotted path: a module, then attributes."""
    purpose: str


PRIVATE_NAMES: list[PrivateName] = []
"""Every private name resolved here, in the order they are declared."""


def _resolve(path: str, purpose: str) -> Any:
    PRIVATE_NAMES.append(PrivateName(path, purpose))
    return _lookup(path, purpose)


def _lazy(path: str, purpose: str) -> Callable[[], Any]:
    """Like :func:`_resolve` for a name in a module that is slow to import (inductor): it is
    listed now and imported on first use."""
    PRIVATE_NAMES.append(PrivateName(path, purpose))
    return functools.cache(lambda: _lookup(path, purpose))


def _first_present(paths: tuple[str, ...], purpose: str) -> Any:
    """The first of ``paths`` the installed torch has (releases name one thing differently)."""
    for path in paths:
        value = _optional(path, purpose)
        if value is not None:
            return value
    return _resolve(paths[0], purpose)  # raises, naming the newest spelling


def _optional(path: str, purpose: str) -> Any | None:
    """A private name only some supported releases have; ``None`` where it is missing."""
    try:
        value = _lookup(path, purpose)
    except TorchInternalsError:
        return None
    PRIVATE_NAMES.append(PrivateName(path, purpose))
    return value


def _lookup(path: str, purpose: str) -> Any:
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: Any = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attr in parts[cut:]:
                value = getattr(value, attr)
        except AttributeError:
            break
        return value
    raise TorchInternalsError(
        f"ddp_split needs the private torch name {path!r} ({purpose}), which torch "
        f"{torch.__version__} does not have. ddp_split supports {SUPPORTED}; "
        "ddp_split_backend/_torch.py lists every private name it uses."
    )


# --- global-state calls Dynamo records as graph nodes (torch/_dynamo/variables/ctx_manager.py)
set_grad_enabled = _resolve("torch._C._set_grad_enabled", "grad-mode state node; piece prologues")
set_fwd_grad_enabled = _resolve("torch._C._set_fwd_grad_enabled", "forward-AD grad-mode state node")
is_fwd_grad_enabled = _resolve("torch._C._is_fwd_grad_enabled", "reads forward-AD grad mode")
enter_autocast = _resolve("torch.amp.autocast_mode._enter_autocast", "autocast region enter node")
exit_autocast = _resolve("torch.amp.autocast_mode._exit_autocast", "autocast region exit node")
enter_inference_mode = _resolve("torch.autograd.grad_mode._enter_inference_mode", "inference-mode enter node")
exit_inference_mode = _resolve("torch.autograd.grad_mode._exit_inference_mode", "inference-mode exit node")
_PREDISPATCH = "torch._functorch.predispatch"
enter_dual_level = _first_present(
    (f"{_PREDISPATCH}._enter_dual_level", "torch._C._enter_dual_level"), "dual-level enter node"
)
exit_dual_level = _first_present(
    (f"{_PREDISPATCH}._exit_dual_level", "torch._C._exit_dual_level"), "dual-level exit node"
)
dual_makers: tuple[Any, ...] = tuple(
    f for f in (_optional(f"{_PREDISPATCH}._make_dual", "pre-dispatch make_dual node"),
                _resolve("torch._make_dual", "makes a forward-AD dual tensor (never cut across)"))
    if f is not None
)
"""Targets that make a dual tensor in a graph (every spelling the installed torch records)."""
dual_unpackers: tuple[Any, ...] = tuple(
    f for f in (_optional(f"{_PREDISPATCH}._unpack_dual", "pre-dispatch unpack_dual node"),
                _resolve("torch._unpack_dual", "unpacks a dual tensor"))
    if f is not None
)
"""Targets that unpack a dual tensor in a graph."""
_differs(
    "How Dynamo records forward-AD dual levels and dual tensors",
    "2.11, 2.12: torch._C._enter_dual_level() / _exit_dual_level(level) (positional), torch._make_dual, "
    "torch._unpack_dual; 2.13+: the torch._functorch.predispatch wrappers",
    "enter_dual_level / exit_dual_level resolve to the first spelling present; dual_makers and "
    "dual_unpackers hold every spelling present",
)


def _nesting(module: str, transform: str, what: str) -> tuple[Any, Any] | None:
    """The enter/exit pair functorch records around a transform's region (uncuttable), or
    ``None`` where this torch has no such pair in ``module``."""
    enter = _optional(f"{module}._{transform}_increment_nesting", f"{what} region enter (uncuttable)")
    exit_ = _optional(f"{module}._{transform}_decrement_nesting", f"{what} region exit")
    if enter is None or exit_ is None:
        return None
    return enter, exit_


_FUNCTORCH = "torch._C._functorch"
nesting_pairs: tuple[tuple[Any, Any], ...] = tuple(
    pair for pair in (
        _nesting(_PREDISPATCH, "vmap", "pre-dispatch vmap"),
        _nesting(_PREDISPATCH, "jvp", "pre-dispatch torch.func.jvp"),
        _nesting(_FUNCTORCH, "vmap", "vmap"),
        _nesting(_FUNCTORCH, "grad", "torch.func.grad"),
        _nesting(_FUNCTORCH, "jvp", "torch.func.jvp"),
    ) if pair is not None
)
"""Enter/exit pairs of functorch transform regions, every spelling the installed torch has."""
_differs(
    "Pre-dispatch jvp nesting calls",
    "2.11, 2.12: torch._functorch.predispatch has no _jvp_increment_nesting / _jvp_decrement_nesting "
    "(its _vmap_* pair exists); 2.13+: both",
    "nesting_pairs holds the pairs present",
)
set_inplace_requires_grad_allowed = _resolve(
    "torch._C._functorch.set_inplace_requires_grad_allowed", "functorch setter inside transforms (uncuttable)"
)
record_function_enter = _resolve("torch.ops.profiler._record_function_enter_new", "profiler range enter (uncuttable)")
record_function_exit = _resolve("torch.ops.profiler._record_function_exit", "profiler range exit")
record_function_pairs: tuple[tuple[Any, Any], ...] = (
    (record_function_enter, record_function_exit),
    (record_function_enter.default, _resolve(
        "torch.ops.profiler._record_function_exit._RecordFunction", "profiler range exit (overload)")),
)
"""Enter/exit pairs of profiler ranges, as packets and as the overloads Dynamo may record."""

# --- thread-local autograd and dispatcher state, restored after failures
c_enter_dual_level = _resolve("torch._C._enter_dual_level", "probes and leaves forward-AD levels")
c_exit_dual_level = _resolve("torch._C._exit_dual_level", "closes a dual level a failed trace left open")
InferenceModeGuard = _resolve("torch._C._InferenceMode", "the only way to leave inference mode (no setter)")
is_multithreading_enabled = _resolve("torch._C._is_multithreading_enabled", "autograd TLS kept by checkpoints")
set_multithreading_enabled = _resolve("torch._C._set_multithreading_enabled", "autograd TLS kept by checkpoints")
is_view_replay_enabled = _resolve("torch._C._is_view_replay_enabled", "autograd TLS kept by checkpoints")
set_view_replay_enabled = _resolve("torch._C._set_view_replay_enabled", "autograd TLS kept by checkpoints")
DispatchKey = _resolve("torch._C.DispatchKey", "dispatch keys a failed trace can leave switched on")
dispatch_include_set = _resolve("torch._C._dispatch_tls_local_include_set", "thread-local dispatch keys")
dispatch_exclude_set = _resolve("torch._C._dispatch_tls_local_exclude_set", "thread-local dispatch keys")
dispatch_key_included = _resolve("torch._C._dispatch_tls_is_dispatch_key_included", "restores dispatch keys")
dispatch_key_excluded = _resolve("torch._C._dispatch_tls_is_dispatch_key_excluded", "restores dispatch keys")
set_dispatch_key_included = _resolve("torch._C._dispatch_tls_set_dispatch_key_included", "restores dispatch keys")
set_dispatch_key_excluded = _resolve("torch._C._dispatch_tls_set_dispatch_key_excluded", "restores dispatch keys")

# --- Dynamo, AOTAutograd and fake tensors
CHECKPOINT_POLICY_KEY = "_checkpoint_context_fn"
"""Where Dynamo keeps a checkpoint's selective-checkpointing ``context_fn``: the body's ``meta``
(torch/_dynamo/variables/higher_order_ops.py, read by torch/_higher_order_ops/wrap.py)."""
checkpoint_region_op = _resolve(
    "torch._higher_order_ops.wrap.tag_activation_checkpoint",
    "the node a non-reentrant activation checkpoint becomes; its body is its first argument",
)
pytree = _resolve("torch.utils._pytree", "flattens graph outputs into pieces' outputs and back")
ShortenTraceback = _resolve(
    "torch._dynamo.exc.ShortenTraceback",
    "the one exception Dynamo passes on from a backend unwrapped (option errors reach the user as themselves)",
)
DYNAMO_SIGNALS: tuple[type[BaseException], ...] = (
    _resolve(
        "torch._dynamo.exc.RestartAnalysis",
        "Dynamo's signal to re-trace the frame (TensorifyScalarRestartAnalysis from AOTAutograd's "
        "scalar pass, and its siblings): passed on from a piece's compile, never a failure",
    ),
    _resolve("torch._dynamo.exc.SkipFrame", "Dynamo's signal to leave the frame to eager: passed on, never a failure"),
)
"""Exceptions Dynamo raises as control flow, not errors (Note [Dynamo's signals] in guards.py)."""
TracingContext = _resolve("torch._guards.TracingContext", "AOT fw_metadata stack and fakify_first_call")
CompileContext = _resolve("torch._guards.CompileContext", "Dynamo's compile id for log lines")
detect_fake_mode = _resolve("torch._guards.detect_fake_mode", "the fake mode Dynamo traced with")
FakeTensor = _resolve("torch._subclasses.fake_tensor.FakeTensor", "tells fake example values from real ones")
FakeTensorMode = _resolve("torch._subclasses.fake_tensor.FakeTensorMode", "runs pieces on fake inputs")
tracing = _resolve("torch._guards.tracing", "installs a piece's own tracing context while it compiles")
lookup_backend = _resolve("torch._dynamo.backends.registry.lookup_backend", "inner backend by name")
list_backends = _resolve("torch._dynamo.list_backends", "valid inner backend names")
dynamo_config = _resolve("torch._dynamo.config", "optimize_ddp, switched off by own_split()")
dynamo_optimize = _resolve("torch._dynamo.optimize", "explain(): compile with a recording backend")
_dynamo_input_codes = _resolve("torch._dynamo.convert_frame.input_codes", "explain(): code objects Dynamo compiled")
_cache_entries = _resolve("torch._dynamo.eval_frame._debug_get_cache_entry_list", "explain(): a code's cache entries")
_reset_code = _resolve("torch._C._dynamo.eval_frame.reset_code", "explain(): empties a code's Dynamo cache")
trace_structured = _resolve("torch._logging.trace_structured", "tlparse artifacts")
OpOverload = _resolve("torch._ops.OpOverload", "op targets in identical-piece keys")
OpOverloadPacket = _resolve("torch._ops.OpOverloadPacket", "op targets in identical-piece keys")
free_unbacked_symbols = _resolve(
    "torch.fx.experimental.symbolic_shapes.free_unbacked_symbols", "outputs with piece-made symbols are not shared"
)
_size_hints: tuple[Any, ...] = tuple(
    f for f in (
        _optional("torch.fx.experimental.symbolic_shapes.optimization_hint", "sizes for estimates, without guards"),
        _optional("torch.fx.experimental.symbolic_shapes.hint_int", "sizes for estimates, without guards"),
    ) if f is not None
)


def size_hint(value: Any, fallback: int) -> int:
    """``value`` (an int or a SymInt) as an int for estimates, never guarding on it: a backed
    symbol's hint (the size it had when traced), ``fallback`` for an unbacked one. ``int()``
    on a SymInt would guard on its value: a recompile per size, or an error where the size
    was marked dynamic or is data-dependent."""
    if not isinstance(value, torch.SymInt):
        return int(value)
    for hint in _size_hints:
        try:
            found = hint(value, fallback=fallback)
        except Exception:  # a release whose helper raises for unbacked symbols
            return fallback
        return fallback if found is None else int(found)
    found = getattr(value.node, "hint", None)
    return fallback if found is None else int(found)


inductor_config = _lazy("torch._inductor.config", "checks inner_options keys and value types")
inductor_list_options = _lazy("torch._inductor.list_options", "the valid inner_options keys")
inductor_mode_options = _lazy("torch._inductor.list_mode_options", "what each torch.compile mode sets")
DDP_OPTIMIZER_MARK = "DDPOptimizer"
"""What DDPOptimizer writes into ``gm.compile_subgraph_reason`` of the pieces it cut."""


def set_fakify_first_call(context: Any, value: bool) -> bool:
    """Set ``TracingContext.fakify_first_call`` (compiled AOT pieces then return outputs with
    their real strides on the first, fake call); returns the previous value."""
    previous = context.fakify_first_call
    context.fakify_first_call = value
    return previous


def aot_fw_metadata(context: Any) -> Any:
    """The forward metadata AOTAutograd left on the tracing context for the last compile."""
    return context.fw_metadata


def piece_tracing_context(context: Any) -> Any:
    """A tracing context for one piece of the frame's graph (Note [Backward metadata per piece]).

    It shares everything of the frame's ``context`` (guards, fake mode, parameters, ...) but
    its forward metadata and DDPOptimizer stack: AOTAutograd keeps the context current at a
    compile for that compile's lazy backward, which reads ``fw_metadata`` from it (and pops
    the DDPOptimizer stack instead where there is one)."""
    piece = copy.copy(context)
    piece.fw_metadata = None
    piece.ddp_optimizer_ctx = None
    piece.aot_graph_name = None
    return piece


def aot_metadata_counts(metadata: Any) -> tuple[int, int]:
    """How many inputs and user outputs AOTAutograd's forward metadata describes."""
    return len(metadata.input_info), len(metadata.output_info)


def backward_reads_own_metadata(context: Any) -> bool:
    """Whether a lazy backward compiled under ``context`` reads ``context.fw_metadata``
    (no DDPOptimizer stack to pop instead)."""
    return getattr(context, "ddp_optimizer_ctx", None) is None


_saved_tensors_hooks_set_tracing = _resolve(
    "torch._C._autograd._saved_tensors_hooks_set_tracing", "keeps users' pack hooks off fake runs and traces"
)


@contextlib.contextmanager
def user_saved_tensor_hooks_off() -> Iterator[None]:
    """While ddp_split runs or traces pieces on fake inputs, the user's
    ``saved_tensors_hooks`` are not applied to what autograd saves (a pack hook that reads
    data, ``t.cpu()`` or ``.data_ptr()``, would raise on a fake tensor). The hooks stay
    registered and apply again at run time. The public ``disable_saved_tensors_hooks``
    raises when hooks are active, so this is the tracing switch Dynamo itself uses."""
    previous = _saved_tensors_hooks_set_tracing(True)
    try:
        yield
    finally:
        _saved_tensors_hooks_set_tracing(previous)


def is_ddp_optimizer_piece(gm: fx.GraphModule) -> bool:
    """Whether torch's DDPOptimizer cut ``gm`` out of a larger graph."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    return DDP_OPTIMIZER_MARK in str(getattr(reason, "reason", reason or ""))


_symbol_is_type = _resolve("torch.utils._sympy.symbol.symbol_is_type", "tells float symbols from size symbols")
_SYMBOL_FLOAT = _resolve("torch.utils._sympy.symbol.SymT.FLOAT", "the kind of a Python float's symbol")


def float_symbols(value: Any) -> frozenset[Any]:
    """The float symbols (a Python float Dynamo traced as a symbol) ``value`` depends on."""
    if not isinstance(value, torch.SymFloat):
        return frozenset()
    return frozenset(s for s in value.node.expr.free_symbols if _symbol_is_type(s, _SYMBOL_FLOAT))


@contextlib.contextmanager
def only_float_symbols(fake_mode: Any, keep: frozenset[Any]) -> Iterator[None]:
    """While the body runs, the frame's shape environment shows no backed float symbol but
    ``keep`` (Note [Python floats in pieces] in compile.py): AOTAutograd's pass that turns
    floats into tensor math asks Dynamo to re-trace the frame, specialising each backed float
    symbol of the environment that the graph it compiles did not use."""
    shape_env = getattr(fake_mode, "shape_env", None)
    if shape_env is None:
        yield
        return
    table = shape_env.backed_var_to_val
    hidden = {k: v for k, v in table.items() if k not in keep and _symbol_is_type(k, _SYMBOL_FLOAT)}
    for k in hidden:
        del table[k]
    try:
        yield
    finally:
        table.update(hidden)


_metrics_context = _resolve("torch._dynamo.utils.get_metrics_context", "when Dynamo began compiling the frame")


def frame_compile_seconds() -> float | None:
    """Seconds since Dynamo began compiling the current frame (its trace, and the attempts a
    restart signal cut short), or ``None`` outside a frame compile."""
    context = _metrics_context()
    start = getattr(context, "_start_time_ns", 0)
    if not context.in_progress() or not start:
        return None
    return (time.time_ns() - start) / 1e9


_autograd_engine = _resolve(
    "torch.autograd.variable.Variable._execution_engine",
    "runs a callback when the running backward ends (the first backward's compile line)",
)


def queue_after_backward(callback: Callable[[], None]) -> None:
    """Run ``callback`` when the running backward has finished (raises ``RuntimeError``
    outside a backward)."""
    _autograd_engine.queue_callback(callback)


_callback_handler = _resolve(
    "torch._dynamo.callback.callback_handler",
    "start/end callbacks around the backward compile AOTAutograd defers to the first backward",
)
_LAZY_BACKWARD = _resolve(
    "torch._dynamo.callback.CallbackTrigger.LAZY_BACKWARD", "tells a lazy backward compile from Dynamo's own"
)


def on_lazy_backward_compile(started: Callable[[str], None], ended: Callable[[str], None]) -> None:
    """Call ``started(compile_id)`` and ``ended(compile_id)`` around every backward compile
    AOTAutograd defers to a graph's first backward (``compile_id``: the frame's, as
    ``str(CompileContext.current_compile_id())`` gives it). Registers once; again after
    ``torch._dynamo.reset()``, which drops every callback."""
    if any(getattr(c, "_ddp_split_calls", None) is started for c in _callback_handler.start_callbacks):
        return

    def on_start(args: Any) -> None:
        if args.callback_trigger is _LAZY_BACKWARD:
            started(args.compile_id)

    def on_end(args: Any) -> None:
        if args.callback_trigger is _LAZY_BACKWARD:
            ended(args.compile_id)

    on_start._ddp_split_calls = started  # type: ignore[attr-defined]
    _callback_handler.register_start_callback(on_start)
    _callback_handler.register_end_callback(on_end)


def ddp_rebuilds_buckets_later(ddp: torch.nn.Module) -> bool:
    """Whether ``ddp`` will still rebuild its buckets from the gradient order of a coming
    synchronised backward: it has not yet, and it does at all (with ``static_graph=True``,
    or without ``find_unused_parameters``; the reducer's rule). Read from the flag DDP's
    forward sets once ``Reducer._rebuild_buckets`` has run."""
    if getattr(ddp, "_has_rebuilt_buckets", True):
        return False
    return bool(getattr(ddp, "static_graph", False)) or not getattr(ddp, "find_unused_parameters", False)


def ddp_reduced_params(ddp: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters whose gradients ``ddp`` reduces: its module's trainable parameters,
    less the ones it was told to ignore."""
    ignored = set(getattr(ddp, "parameters_to_ignore", ()) or ())
    module = getattr(ddp, "module", ddp)
    return [
        param for name, param in module.named_parameters()
        if param.requires_grad and name not in ignored and not ddp_ignored(param)
    ]


def active_ddp_module() -> torch.nn.Module | None:
    """The DDP module whose forward is running (DDP sets it while Dynamo converts a frame)."""
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._get_active_ddp_module()


def ddp_first_bucket_bytes(ddp_module: torch.nn.Module | None) -> int | None:
    """DDP's first-bucket capacity, or ``None`` without a DDP module."""
    if ddp_module is None:
        return None
    config = getattr(ddp_module, "_bucket_config", None)
    if config is not None:
        return int(config.first_bucket_bytes_cap)
    if hasattr(ddp_module, "bucket_bytes_cap_default"):
        # DDP gives the first bucket its own (smaller) cap only when the user left the cap unset.
        if ddp_module.bucket_bytes_cap_default:
            return default_first_bucket_bytes()
        return int(ddp_module.bucket_bytes_cap)
    return None


_differs(
    "Where DDP keeps its first-bucket cap",
    "2.11: DistributedDataParallel.bucket_bytes_cap / bucket_bytes_cap_default; 2.12+: _bucket_config",
    "ddp_first_bucket_bytes reads whichever the DDP module has",
)
_differs(
    "Backward's thread-local context stash (Note [Teardown deadlock])",
    "2.11: no stash; 2.12: stashes and leaves the key behind; 2.13+: stashes and removes it",
    "nothing to resolve: close_ddp releases reducers before the process group on every release",
)


def aot_compiles_inference_mode_under_autograd() -> bool:
    """Whether AOTAutograd compiles an ``inference_mode`` region inside a graph that records
    autograd. Where it cannot, such a piece (and plain ``torch.compile`` of the whole graph)
    fails to compile and ddp_split runs it eagerly. A bug fix leaves no name to probe, so
    this one question is answered from the release."""
    return _release() >= (2, 13)


_differs(
    "AOTAutograd and inference_mode inside a graph that records autograd",
    "2.11, 2.12: fails (RuntimeError: <weakref ... UntypedStorage>); 2.13+: compiles",
    "aot_compiles_inference_mode_under_autograd(); such a piece runs eagerly (a recorded fallback)",
    "pytorch/pytorch#169477, #181512; fixed by #181913",
)


def ddp_ignored(param: torch.Tensor) -> bool:
    """Whether DDP was told to ignore ``param`` (``param._ddp_ignored``)."""
    return bool(getattr(param, "_ddp_ignored", False))


def ddp_comm_hooks(ddp: torch.nn.Module) -> tuple[Any, ...]:
    """The comm hooks registered on a DDP module (``ddp._comm_hooks``; DDP takes one)."""
    return tuple(getattr(ddp, "_comm_hooks", ()) or ())


def dynamo_source(node: fx.Node) -> Any:
    """Dynamo's source annotation on a placeholder (``node._dynamo_source``), if any."""
    return getattr(node, "_dynamo_source", None)


def set_dynamo_source(node: fx.Node, source: Any) -> None:
    """Carry Dynamo's source annotation over to a copied placeholder."""
    node._dynamo_source = source  # type: ignore[attr-defined]


def default_first_bucket_bytes() -> int:
    """DDP's default first-bucket size (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``)."""
    return int(getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", 1024 * 1024))


def grapharg(node: fx.Node) -> Any:
    """Dynamo's record of a placeholder's real value and source (``node.meta["grapharg"]``)."""
    return node.meta.get("grapharg")


def storage_id(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage (views share it)."""
    return tensor.untyped_storage()._cdata


def forget_compiles(backend: Callable[..., Any]) -> int:
    """Empty Dynamo's cache for every code object ``backend`` compiled; returns how many.

    Dynamo can only drop a code object's cache whole (``reset_code``, what its own ``export``
    does before and after tracing): invalidating one entry keeps it in the list, and it
    still counts toward ``recompile_limit``. A code object that also holds other backends'
    compiles loses those too; they compile again at their next call.
    """
    dropped = 0
    for seen in list(_dynamo_input_codes.seen):
        code = seen() if isinstance(seen, weakref.ref) else seen  # weak references, some releases
        if code is not None and any(entry.backend is backend for entry in _cache_entries(code)):
            _reset_code(code)
            dropped += 1
    return dropped


def is_view(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a view of another tensor (``Tensor._is_view``)."""
    return bool(tensor._is_view())


def compiled_original(module: object) -> object:
    """The module ``torch.compile`` wrapped (``OptimizedModule._orig_mod``), if any."""
    return getattr(module, "_orig_mod", None)
