"""Every private torch name ddp_split uses, in one place.

ddp_split works on Dynamo graphs, AOTAutograd's tracing context and DDP's reducer, and those
have no public API. Each private name is resolved here, once, at import, with a line saying
what it is for; the rest of the package uses only this module. When a torch release moves
or removes one, importing ddp_split fails with one message naming the symbol and the torch
version, and ``tests/test_torch_internals.py`` lists them all. Public names (``torch.fx``,
``torch.is_grad_enabled``, ...) are used directly elsewhere.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

__all__ = ["PRIVATE_NAMES", "TorchInternalsError", "PrivateName"]

SUPPORTED = "torch>=2.13,<2.14"


class TorchInternalsError(ImportError):
    """A private torch name ddp_split depends on is missing from the installed torch."""


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
enter_dual_level = _resolve("torch._functorch.predispatch._enter_dual_level", "dual-level enter node")
exit_dual_level = _resolve("torch._functorch.predispatch._exit_dual_level", "dual-level exit node")
make_dual = _resolve("torch._make_dual", "makes a forward-AD dual tensor (never cut across)")
unpack_dual = _resolve("torch._unpack_dual", "unpacks a dual tensor")
predispatch = _resolve("torch._functorch.predispatch", "holds the pre-dispatch dual-tensor ops, where present")


def _nesting(transform: str, what: str) -> tuple[Any, Any]:
    """The enter/exit pair functorch records around a transform's region (uncuttable)."""
    return (
        _resolve(f"torch._C._functorch._{transform}_increment_nesting", f"{what} region enter (uncuttable)"),
        _resolve(f"torch._C._functorch._{transform}_decrement_nesting", f"{what} region exit"),
    )


vmap_nesting = _nesting("vmap", "vmap")
grad_nesting = _nesting("grad", "torch.func.grad")
jvp_nesting = _nesting("jvp", "torch.func.jvp")
set_inplace_requires_grad_allowed = _resolve(
    "torch._C._functorch.set_inplace_requires_grad_allowed", "functorch setter inside transforms (uncuttable)"
)
record_function_enter = _resolve("torch.ops.profiler._record_function_enter_new", "profiler range enter (uncuttable)")
record_function_exit = _resolve("torch.ops.profiler._record_function_exit", "profiler range exit")

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
TracingContext = _resolve("torch._guards.TracingContext", "AOT fw_metadata stack and fakify_first_call")
CompileContext = _resolve("torch._guards.CompileContext", "Dynamo's compile id for log lines")
detect_fake_mode = _resolve("torch._guards.detect_fake_mode", "the fake mode Dynamo traced with")
FakeTensor = _resolve("torch._subclasses.fake_tensor.FakeTensor", "tells fake example values from real ones")
FakeTensorMode = _resolve("torch._subclasses.fake_tensor.FakeTensorMode", "runs pieces on fake inputs")
DDPOptimizerContext = _resolve(
    "torch._dynamo.backends.distributed.DDPOptimizerContext",
    "the per-piece fw_metadata stack AOTAutograd pops when it compiles backward lazily",
)
lookup_backend = _resolve("torch._dynamo.backends.registry.lookup_backend", "inner backend by name")
list_backends = _resolve("torch._dynamo.list_backends", "valid inner backend names")
dynamo_config = _resolve("torch._dynamo.config", "optimize_ddp, switched off by own_split()")
dynamo_optimize = _resolve("torch._dynamo.optimize", "explain(): compile with a recording backend")
trace_structured = _resolve("torch._logging.trace_structured", "tlparse artifacts")
OpOverload = _resolve("torch._ops.OpOverload", "op targets in identical-piece keys")
OpOverloadPacket = _resolve("torch._ops.OpOverloadPacket", "op targets in identical-piece keys")
free_unbacked_symbols = _resolve(
    "torch.fx.experimental.symbolic_shapes.free_unbacked_symbols", "outputs with piece-made symbols are not shared"
)
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


def push_backward_metadata(context: Any, metadata: list[Any]) -> None:
    """Give AOTAutograd the metadata it pops (last first) when it compiles each backward."""
    ddp_ctx = DDPOptimizerContext()
    ddp_ctx.metadata_per_bucket = list(metadata)
    ddp_ctx.curr_bucket = len(metadata) - 1
    context.ddp_optimizer_ctx = ddp_ctx


def is_ddp_optimizer_piece(gm: fx.GraphModule) -> bool:
    """Whether torch's DDPOptimizer cut ``gm`` out of a larger graph."""
    reason = getattr(gm, "compile_subgraph_reason", None)
    return DDP_OPTIMIZER_MARK in str(getattr(reason, "reason", reason or ""))


def active_ddp_module() -> torch.nn.Module | None:
    """The DDP module whose forward is running (DDP sets it while Dynamo converts a frame)."""
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel._get_active_ddp_module()


def ddp_first_bucket_bytes(ddp_module: torch.nn.Module | None) -> int | None:
    """DDP's first-bucket capacity (``_bucket_config.first_bucket_bytes_cap``), if it has one."""
    config = getattr(ddp_module, "_bucket_config", None)
    return None if config is None else int(config.first_bucket_bytes_cap)


def default_first_bucket_bytes() -> int:
    """DDP's default first-bucket size (``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES``)."""
    return int(getattr(torch.distributed, "_DEFAULT_FIRST_BUCKET_BYTES", 1024 * 1024))


def grapharg(node: fx.Node) -> Any:
    """Dynamo's record of a placeholder's real value and source (``node.meta["grapharg"]``)."""
    return node.meta.get("grapharg")


def storage_id(tensor: torch.Tensor) -> int:
    """Identity of a tensor's storage (views share it)."""
    return tensor.untyped_storage()._cdata


def compiled_original(module: object) -> object:
    """The module ``torch.compile`` wrapped (``OptimizedModule._orig_mod``), if any."""
    return getattr(module, "_orig_mod", None)
