"""Identical-piece reuse: when two pieces may share one compiled function.

Repeated blocks (transformer layers, residual stages) split into pieces with the same ops on
inputs with the same metadata. Such pieces compile to interchangeable code, so the compile
stage compiles the first and hands its function to the others. Whether two pieces are alike
is decided by a *structure key*: a hashable description of the piece's ops, their arguments
and its inputs' metadata.

The key is conservative by construction: every node argument is described by a tagged,
hashable value; an argument it does not know how to describe (a tensor constant, an opaque
object) makes the piece not reusable. Computing a key never raises, so this optimisation can
never fail a frame: when it cannot decide, it does not reuse.
"""

from __future__ import annotations

import enum
import functools
import types
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx as fx


from . import _torch

__all__ = ["fresh_outputs", "reusable_outputs", "structure_key"]


class _NotDescribable(Exception):
    """An argument the key cannot describe faithfully: the piece is not shared."""


_PLAIN = (type(None), bool, int, float, complex, str, bytes, type(Ellipsis))
_TORCH_ATOMS = (torch.dtype, torch.device, torch.layout, torch.memory_format)
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def _arg_key(value: Any, position: dict[fx.Node, int]) -> object:
    """A hashable description of one node argument; equal descriptions mean equal arguments.

    Every description carries its type, so ``1``, ``1.0`` and ``True`` (equal and of equal
    hash in Python) stay apart, as do a list and a tuple of the same items.
    """
    if isinstance(value, fx.Node):
        return ("node", position[value])
    kind = type(value)
    if kind in _PLAIN:
        return (kind.__name__, value)
    if isinstance(value, _TORCH_ATOMS):
        return (kind.__name__, str(value))
    if isinstance(value, torch.Size):
        return ("Size", tuple(_arg_key(v, position) for v in value))
    if isinstance(value, _SYMBOLIC):
        return (kind.__name__, str(value))
    if isinstance(value, slice):
        return ("slice", tuple(_arg_key(v, position) for v in (value.start, value.stop, value.step)))
    if isinstance(value, (tuple, list)):  # also named tuples: their type is part of the key
        return (kind.__qualname__, kind.__module__, tuple(_arg_key(v, position) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((_arg_key(k, position), _arg_key(v, position)) for k, v in value.items()))
    if isinstance(value, enum.Enum):
        return ("enum", kind.__module__, kind.__qualname__, value.name)
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, _torch.OpOverload, _torch.OpOverloadPacket)):
        return ("callable", _target_key(value))
    raise _NotDescribable(kind.__qualname__)


def _target_key(target: object) -> object:
    if isinstance(target, str):
        return ("name", target)
    # The object itself identifies the target; module and name make the key readable.
    return ("object", getattr(target, "__module__", None), getattr(target, "__qualname__", None), id(target))


_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter, _torch.FakeTensor)
"""Tensor types the key describes; a subclass carries inner tensors and a context it does not."""


def _tensor_key(value: torch.Tensor, shares_with: int) -> object:
    if type(value) not in _PLAIN_TENSORS:
        raise _NotDescribable(type(value).__qualname__)
    return (
        "tensor", tuple(str(s) for s in value.shape), tuple(str(s) for s in value.stride()),
        str(value.storage_offset()), value.dtype, value.device, value.requires_grad,
        isinstance(value, torch.nn.Parameter), value.is_inference(), _torch.is_view(value), shares_with,
    )


def _inputs_key(args: Sequence[Any]) -> tuple:
    """Each input's metadata, and for a tensor the first input on its storage (itself when
    it shares storage with no earlier input): aliasing changes what AOTAutograd compiles."""
    first_on_storage: dict[int, int] = {}
    keys: list[object] = []
    for i, value in enumerate(args):
        if not isinstance(value, torch.Tensor):
            keys.append(("input", _arg_key(value, {})))
            continue
        if value.layout is not torch.strided:  # no storage to compare
            raise _NotDescribable(str(value.layout))
        keys.append(_tensor_key(value, first_on_storage.setdefault(_torch.storage_id(value), i)))
    return tuple(keys)


def structure_key(gm: fx.GraphModule, args: Sequence[Any], grad: bool) -> tuple | None:
    """A key equal for two pieces that compile to interchangeable code, else ``None``.

    Equal keys mean: the same ops with the same arguments, inputs with the same metadata
    (type, shape, strides, offset, dtype, device, autograd and inference flags, and which
    inputs share storage), called in the same grad mode (AOTAutograd decides at trace time whether to record a
    backward). Pieces holding attributes other than subgraphs (constants, submodules) are
    never shared, nor are pieces with an argument the key cannot describe or an input of a
    tensor subclass.
    """
    try:
        key = (grad, _graph_key(gm), _inputs_key(args))
        hash(key)
    except (_NotDescribable, TypeError):
        return None
    return key


def _graph_key(gm: fx.GraphModule) -> tuple:
    """The ops of ``gm``'s graph and their arguments. An attribute is described by what it is:
    a subgraph (the body of an activation checkpoint, Note [Cutting checkpoint regions]) by its
    own graph and the checkpointing policy Dynamo keeps beside it; anything else (a tensor
    constant, a module) is not described."""
    position: dict[fx.Node, int] = {}
    parts: list[object] = []
    for i, node in enumerate(gm.graph.nodes):
        position[node] = i
        if node.op == "get_attr":
            parts.append(("get_attr", _body_key(getattr(gm, str(node.target), None))))
            continue
        target = _target_key(node.target) if node.op != "placeholder" else None
        arguments = _arg_key(node.args, position)
        keywords = tuple((k, _arg_key(v, position)) for k, v in node.kwargs.items())
        parts.append((node.op, target, arguments, keywords))
    return tuple(parts)


def _body_key(body: object) -> tuple:
    if not isinstance(body, fx.GraphModule):
        raise _NotDescribable(type(body).__qualname__)
    policy = body.meta.get(_torch.CHECKPOINT_POLICY_KEY)
    if isinstance(policy, functools.partial):
        policy_key: object = ("partial", _target_key(policy.func), _arg_key(policy.args, {}),
                              _arg_key(policy.keywords, {}))
    else:
        policy_key = None if policy is None else _arg_key(policy, {})
    return ("body", policy_key, _graph_key(body))


def reusable_outputs(outputs: Sequence[Any], inputs: Sequence[Any]) -> bool:
    """Whether :func:`fresh_outputs` can stand in for a piece's ``outputs`` (its fake outputs
    on ``inputs``). Not when sizes hold symbols made inside the piece, an output is of a
    tensor subclass, lies at a storage offset, or shares storage with another output or an
    input: new tensors would lose that, and later pieces would compile for other inputs."""
    if any(_torch.free_unbacked_symbols(o) for o in outputs):
        return False
    storages = {_torch.storage_id(t) for t in inputs if isinstance(t, torch.Tensor) and t.layout is torch.strided}
    for value in outputs:
        if not isinstance(value, torch.Tensor):
            continue
        if type(value) not in _PLAIN_TENSORS or value.layout is not torch.strided or value.storage_offset() != 0:
            return False
        storage = _torch.storage_id(value)
        if storage in storages:
            return False
        storages.add(storage)
    return True


def fresh_outputs(template: Sequence[Any], fake_mode: Any) -> list[Any]:
    """New fake tensors with the metadata of a shared piece's outputs (inference tensors
    where those are; :func:`reusable_outputs` says when this is faithful)."""
    fresh: list[Any] = []
    with fake_mode, torch.enable_grad():  # the clone below must record autograd history
        for value in template:
            if not isinstance(value, torch.Tensor):
                fresh.append(value)
                continue
            with torch.inference_mode(value.is_inference()):
                tensor = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)
                tensor.requires_grad_(value.requires_grad)
            if value.requires_grad and not value.is_leaf:  # an activation, as the original
                tensor = tensor.clone()
                if tensor.stride() != value.stride():
                    tensor = tensor.as_strided(value.shape, value.stride())
            fresh.append(tensor)
    return fresh
