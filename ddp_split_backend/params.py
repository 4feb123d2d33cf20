"""Which trainable parameters each node of a Dynamo graph uses, and their user-facing names.

Parameters reach a Dynamo graph as placeholders (inlined nn modules, the default), as
``get_attr`` nodes, or hidden inside ``call_module`` / ``call_method`` nodes on submodules.
Names are the user's module FQNs (``net.0.weight``), not Dynamo's placeholder names.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any

import torch
import torch.fx as fx


from . import _torch
from .layout import compute_nodes

__all__ = ["ParamUse", "ParamTable", "body_first_uses", "find_params", "is_checkpoint_region", "parameter_placeholders"]


@dataclass(frozen=True, slots=True)
class ParamUse:
    """A trainable parameter and where its gradient becomes complete."""

    name: str
    nbytes: int
    first_use: int
    """Index (in the planner's node list) of the first node that uses it; backward reaches
    that node last, so the gradient is complete there."""
    slot: int | None = None
    """The graph placeholder (its index) it arrives through; ``None`` for a parameter the
    graph reaches as an attribute."""
    within: tuple[int, ...] = ()
    """When ``first_use`` is an activation-checkpoint region: the index of the first node of
    its body that uses the parameter (the region's backward completes it there), followed by
    the same inside a region nested there; else empty."""

    @property
    def position(self) -> tuple[int, ...]:
        """Where the gradient completes, in forward order: the node, then the places in its bodies."""
        return (self.first_use, *self.within)


@dataclass(frozen=True, slots=True)
class ParamTable:
    """Trainable parameters of a graph, grouped by the node that completes them."""

    params: tuple[ParamUse, ...]
    ignored: tuple[str, ...]
    """Parameters skipped because DDP was told to ignore them."""

    def completed_at(self) -> dict[int, list[ParamUse]]:
        by_node: dict[int, list[ParamUse]] = {}
        for use in self.params:
            by_node.setdefault(use.first_use, []).append(use)
        return by_node


def _is_ignored(param: torch.Tensor, name: str, ddp_ignored: frozenset[str]) -> bool:
    return _torch.ddp_ignored(param) or name in ddp_ignored


def _fqn_from_source(source: Any) -> str | None:
    """``net.0.weight`` from a Dynamo source chain such as ``L['self']._modules['net']...``."""
    parts: list[str] = []
    while source is not None:
        member = getattr(source, "member", None)
        index = getattr(source, "index", None)
        if isinstance(member, str):
            parts.append(member)
        elif isinstance(index, (str, int)) and not isinstance(index, bool):
            parts.append(str(index))
        source = getattr(source, "base", None)
    names = [p for p in reversed(parts) if p not in ("_modules", "_parameters", "_buffers")]
    return ".".join(names) if names else None


def _placeholder_value(node: fx.Node, example: object) -> object:
    grapharg = _torch.grapharg(node)
    if grapharg is not None:
        try:
            real = grapharg.example
        except Exception:  # the weak reference may be gone
            real = None
        if real is not None:
            return real
    if isinstance(example, torch.Tensor) and not isinstance(
        example, _torch.FakeTensor
    ):
        return example
    return node.meta.get("example_value", example)


def _placeholder_name(node: fx.Node, value: object, names: dict[int, str]) -> str:
    known = names.get(id(value))
    if known is not None:
        return known
    grapharg = _torch.grapharg(node)
    source = getattr(grapharg, "source", None) or _torch.dynamo_source(node)
    return _fqn_from_source(source) or node.name


def _module_params(module: torch.nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    for name, param in module.named_parameters():
        yield (f"{prefix}.{name}" if prefix else name), param


def _node_inputs(node: fx.Node) -> list[fx.Node]:
    return list(node.all_input_nodes)


def is_checkpoint_region(node: fx.Node) -> bool:
    """Whether ``node`` is a non-reentrant activation checkpoint (``tag_activation_checkpoint``
    with its body as the first argument)."""
    return (
        node.op == "call_function"
        and node.target is _torch.checkpoint_region_op
        and bool(node.args)
        and isinstance(node.args[0], fx.Node)
        and node.args[0].op == "get_attr"
    )


def body_first_uses(gm: fx.GraphModule, region: fx.Node) -> dict[fx.Node, tuple[int, ...]]:
    """For a checkpoint region: each of its arguments (graph nodes) and where its body first
    reads it: the index among its :func:`~.layout.compute_nodes`, then, when that node is a nested
    region, the place in the nested body."""
    body = attrgetter(str(region.args[0].target))(gm)  # type: ignore[union-attr]
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    first: dict[fx.Node, tuple[int, ...]] = {}
    for index, node in enumerate(compute_nodes(body)):
        nested = body_first_uses(body, node) if is_checkpoint_region(node) else {}
        for arg in node.all_input_nodes:
            if arg.op == "placeholder" and arg not in first:
                first[arg] = (index, *nested.get(arg, ()))
    found: dict[fx.Node, tuple[int, ...]] = {}
    for arg, placeholder in zip(region.args[1:], placeholders):
        if isinstance(arg, fx.Node) and placeholder in first:
            found[arg] = min(found.get(arg, first[placeholder]), first[placeholder])
    return found


def parameter_placeholders(gm: fx.GraphModule, example_inputs: Sequence[object]) -> frozenset[fx.Node]:
    """The placeholders of ``gm`` through which parameters arrive (trainable or not)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    return frozenset(
        node
        for node, example in zip(placeholders, example_inputs)
        if isinstance(_placeholder_value(node, example), torch.nn.Parameter)
    )


def find_params(
    gm: fx.GraphModule,
    nodes: Sequence[fx.Node],
    example_inputs: Sequence[object],
    *,
    names: dict[int, str] | None = None,
    ddp_ignored: frozenset[str] = frozenset(),
) -> ParamTable:
    """Trainable parameters used by ``nodes`` (placeholders and output excluded).

    Args:
        gm: the Dynamo graph.
        nodes: the planner's node list (forward order, no placeholders, no output).
        example_inputs: the real inputs Dynamo passed to the backend, one per placeholder.
        names: ``id(param) -> FQN`` from the user's module (e.g. the active DDP module).
        ddp_ignored: FQNs DDP was told to ignore.

    Returns:
        A :class:`ParamTable`; tied parameters appear once, at their first use.
    """
    names = names or {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    values: dict[fx.Node, tuple[str, object, int]] = {}
    for i, node in enumerate(placeholders):
        example = example_inputs[i] if i < len(example_inputs) else None
        value = _placeholder_value(node, example)
        if isinstance(value, torch.nn.Parameter):
            values[node] = (_placeholder_name(node, value, names), value, i)

    first_use: dict[int, tuple[int, str, torch.Tensor, int | None, tuple[int, ...]]] = {}
    ignored: dict[int, str] = {}

    def note(
        index: int, name: str, param: torch.Tensor, slot: int | None = None, within: tuple[int, ...] = ()
    ) -> None:
        key = id(param)
        if key in first_use or key in ignored or not param.requires_grad:
            return
        name = names.get(key, name)
        if _is_ignored(param, name, ddp_ignored):
            ignored[key] = name
            return
        first_use[key] = (index, name, param, slot, within)

    for index, node in enumerate(nodes):
        within = body_first_uses(gm, node) if is_checkpoint_region(node) else {}
        for arg in _node_inputs(node):
            if arg in values:
                note(index, *values[arg], within=within.get(arg, ()))
            elif arg.op == "get_attr":
                attr = attrgetter(str(arg.target))(gm)
                if isinstance(attr, torch.nn.Parameter):
                    note(index, str(arg.target), attr)
                elif isinstance(attr, torch.nn.Module) and node.op == "call_method":
                    for name, param in _module_params(attr, str(arg.target)):
                        note(index, name, param)
        if node.op == "call_module":
            submodule = gm.get_submodule(str(node.target))
            for name, param in _module_params(submodule, str(node.target)):
                note(index, name, param)

    uses = tuple(
        ParamUse(name=name, nbytes=param.numel() * param.element_size(), first_use=index, slot=slot, within=within)
        for index, name, param, slot, within in first_use.values()
    )
    return ParamTable(params=uses, ignored=tuple(sorted(ignored.values())))
