"""Diagnostics made from plans: log lines (``TORCH_LOGS=ddp_split``) and tlparse artifacts.

The plan object is the source of truth; everything here only renders it.

* ``TORCH_LOGS=ddp_split``: one bucket table per compiled graph (logger ``ddp_split``).
* ``TORCH_LOGS=+ddp_split``: also the split graph and every piece's code (``ddp_split.graphs``).
* ``TORCH_TRACE=dir``: structured artifacts ``ddp_split_plan`` (JSON) and
  ``ddp_split_piece_<k>`` (code), shown by tlparse next to Dynamo's own.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
from collections.abc import Sequence
from typing import Any

from . import _torch
from .plan import SplitPlan
from .split import SplitGraph
from .timing import StageTimes

__all__ = ["log_compiled", "plan_to_dict"]

log = logging.getLogger("ddp_split")
graph_log = logging.getLogger("ddp_split.graphs")


def _jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def plan_to_dict(plan: SplitPlan) -> dict[str, Any]:
    """The plan as plain JSON-able data, with the DDP buckets each piece holds."""
    return {**_jsonable(plan), "pieces": [[b.bucket for b in p.buckets] for p in plan.pieces]}


def log_compiled(
    plan: SplitPlan, split: SplitGraph | None, compiled_by: Sequence[str], times: StageTimes
) -> None:
    """Log and trace what the backend did with one graph."""
    if log.isEnabledFor(logging.INFO):
        log.info("%s\n  compiled by: %s\n  compile %s", plan.table(), ", ".join(compiled_by), times.describe())
    _torch.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": "ddp_split_plan", "encoding": "json"},
        payload_fn=lambda: json.dumps(
            {**plan_to_dict(plan), "compiled_by": list(compiled_by), "compile_seconds": times.seconds}
        ),
    )
    if split is None:
        return
    if graph_log.isEnabledFor(logging.DEBUG):
        for piece in split.pieces:
            graph_log.debug(
                "ddp_split %s piece %d (slots in %s, out %s):\n%s",
                plan.graph_name, piece.index, piece.inputs, piece.outputs, piece.gm.code,
            )
    for piece in split.pieces:
        _torch.trace_structured(
            "artifact",
            metadata_fn=lambda k=piece.index: {"name": f"ddp_split_piece_{k}", "encoding": "string"},
            payload_fn=lambda gm=piece.gm: gm.print_readable(print_output=False),
        )
