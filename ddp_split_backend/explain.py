"""See the plan for a model without training it: ``explain`` and its picture.

Example::

    >>> result = explain(MyModel(), torch.randn(8, 1000), bucket_cap_mb=3.5)
    >>> print(result.table())            # doctest: +SKIP
    >>> result.render_png("plan.png")    # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx

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

    def render_png(self, path: str | Path) -> Path:
        """Draw the plans: buckets as bars sized by bytes along the graph, cuts and state
        regions marked. Needs matplotlib (``pip install ddp-split-backend[plot]``)."""
        from .picture import draw_plans

        return draw_plans(self.plans, Path(path))


def _plan_recorder(config: SplitConfig, plans: list[SplitPlan]) -> Callable[..., Any]:
    def record(gm: fx.GraphModule, example_inputs: Sequence[Any], **_: Any) -> Callable[..., Any]:
        plans.append(plan_split(gm, example_inputs, config=config, graph_name=f"graph {len(plans)}"))
        return gm.forward

    return record


def explain(model: torch.nn.Module, *example_inputs: Any, **options: Any) -> ExplainResult:
    """The plans ``ddp_split`` makes for ``model(*example_inputs)``, without compiling pieces.

    Args:
        model: the model, DDP-wrapped or not (a DDP module's bucket cap applies).
        example_inputs: inputs for one forward call (run once, eagerly, under Dynamo).
        options: the backend's options (``bucket_cap_mb``, ``first_bucket_cap_mb``).

    Returns:
        An :class:`ExplainResult` with one plan per Dynamo graph.
    """
    config = SplitConfig.from_options(options)
    plans: list[SplitPlan] = []
    compiled = _torch.dynamo_optimize(_plan_recorder(config, plans))(model)
    with own_split():
        compiled(*example_inputs)
    return ExplainResult(tuple(plans))
