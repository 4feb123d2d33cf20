"""See the plan for a model without training it: ``explain`` and its picture.

Example::

    >>> result = explain(MyModel(), torch.randn(8, 1000), bucket_cap_mb=3.5)
    >>> print(result.table())            # doctest: +SKIP
    >>> result.render_png("plan.png")    # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.nn.parallel import DistributedDataParallel

from . import _torch
from .backend import plan_split
from .config import SplitConfig
from .ddp_mode import own_split
from .plan import SplitPlan

__all__ = ["ExplainResult", "explain"]


@dataclass(frozen=True, slots=True)
class ExplainResult:
    """The plans of every graph Dynamo made from one call (graph breaks give several)."""

    plans: tuple[SplitPlan, ...]

    def table(self) -> str:
        header = f"{len(self.plans)} graph(s) (Dynamo graph breaks make several)"
        return "\n\n".join([header, *(p.table() for p in self.plans)])

    def render_png(self, path: str | Path) -> Path | None:
        """Draw the plans: buckets as bars sized by bytes along the graph, cuts and state
        regions marked. Needs matplotlib (``pip install 'ddp-split-backend[plot]'``): without
        it, one warning naming the extra and ``None``."""
        from .picture import draw_plans, drawn

        return drawn(lambda: draw_plans(self.plans, Path(path)))


def _plan_recorder(
    config: SplitConfig, plans: list[SplitPlan], ddp_module: torch.nn.Module | None
) -> Callable[..., Any]:
    def record(gm: fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable[..., Any]:
        plans.append(
            plan_split(gm, example_inputs, config=config, ddp_module=ddp_module, graph_name=f"graph {len(plans)}")
        )
        return gm.forward

    return record


@contextlib.contextmanager
def _restoring(model: torch.nn.Module, inputs: Sequence[Any]) -> Iterator[None]:
    """Put back what running the real forward changes: every buffer's value (BatchNorm
    statistics, ``num_batches_tracked``; the tensor object too if the forward replaced it) and
    the random number generators of the CPU and of each device the model or inputs are on."""
    saved = []
    for name, buffer in model.named_buffers(remove_duplicate=False):
        owner, _, leaf = name.rpartition(".")
        saved.append((model.get_submodule(owner), leaf, buffer, buffer.detach().clone()))
    devices: dict[str, set[int]] = {}
    for tensor in (*model.parameters(), *model.buffers(), *(t for t in inputs if isinstance(t, torch.Tensor))):
        if tensor.device.type not in ("cpu", "meta"):
            devices.setdefault(tensor.device.type, set()).add(tensor.device.index or 0)
    with contextlib.ExitStack() as rngs:
        rngs.enter_context(torch.random.fork_rng(devices=[]))  # the CPU generator
        for kind, indices in devices.items():
            rngs.enter_context(torch.random.fork_rng(devices=sorted(indices), device_type=kind))
        try:
            yield
        finally:
            for owner, leaf, buffer, value in saved:
                with torch.inference_mode(buffer.is_inference()), torch.no_grad():
                    buffer.copy_(value)
                if getattr(owner, leaf, None) is not buffer:
                    setattr(owner, leaf, buffer)


def explain(model: torch.nn.Module, *example_inputs: Any, **options: Any) -> ExplainResult:
    """The plans ``ddp_split`` makes for ``model(*example_inputs)``, without compiling pieces.

    Explaining leaves no trace in the model and runs no collective: a DDP module is planned
    with its bucket caps and parameter names, but its wrapped module's forward is what runs
    (DDP's own forward would broadcast buffers, and the other ranks are not calling it). The
    forward runs once under Dynamo on the real inputs, then the model's buffers (BatchNorm
    statistics) and the random number generators are put back as they were, and the Dynamo cache of every code object this call compiled
    is emptied, so repeated calls never approach ``recompile_limit``. Dynamo can drop a
    code object's cache only whole: a ``torch.compile`` of the same model made earlier
    compiles again at its next call (``_torch.forget_compiles``).

    Args:
        model: the model, DDP-wrapped or not (a DDP module's bucket cap applies).
        example_inputs: inputs for one forward call.
        options: the backend's options (``bucket_cap_mb``, ``first_bucket_cap_mb``).

    Returns:
        An :class:`ExplainResult` with one plan per Dynamo graph.
    """
    config = SplitConfig.from_options(options)
    plans: list[SplitPlan] = []
    ddp_module = model if isinstance(model, DistributedDataParallel) else None
    runs = model.module if ddp_module is not None else model
    recorder = _plan_recorder(config, plans, ddp_module)
    try:
        with _restoring(runs, example_inputs), own_split():
            _torch.dynamo_optimize(recorder)(runs)(*example_inputs)
    finally:
        _torch.forget_compiles(recorder)
    return ExplainResult(tuple(plans))
