"""Diagnostics made from plans: log lines and tlparse artifacts.

The plan object is the source of truth; everything here only renders it.

* Always (logger ``ddp_split.summary``, INFO): one line per compiled graph, saying its
  pieces, buckets and why, and the compile's seconds. Nothing per step. Shown on the first rank by a handler of its
  own unless the user's logging would show it (Note [Lines a normal run prints]).
* ``TORCH_LOGS=ddp_split``: also one bucket table per compiled graph (logger ``ddp_split``),
  no wider than 120 columns.
* ``TORCH_LOGS=+ddp_split``: also the split graph and every piece's code (``ddp_split.graphs``).
* ``TORCH_TRACE=dir``: structured artifacts ``ddp_split_plan`` (JSON) and
  ``ddp_split_piece_<k>`` (code), shown by tlparse next to Dynamo's own.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import json
import logging
import os
import textwrap
from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from . import _torch
from .compile import Outcome, PieceRecord
from .first_backward import BackwardCompile
from .ready_order import BucketCheck, warn_straddling
from .plan import TABLE_WIDTH, SplitPlan
from .split import SplitGraph
from .timing import StageTimes

__all__ = ["log_backward_compiled", "log_buckets_checked", "log_compiled", "plan_to_dict", "show_summaries", "summary_log"]

log = logging.getLogger("ddp_split")
graph_log = logging.getLogger("ddp_split.graphs")
summary_log = logging.getLogger("ddp_split.summary")

# Note [Lines a normal run prints]
# --------------------------------
# A user who never configured logging should still learn, once per graph, what ddp_split did
# (and that a pause is a compile, not a hang). Python shows only warnings from a
# library that has no handler, so the first compile (never the import) gives the
# ``ddp_split.summary`` logger level INFO, unless the user set one, and a handler that
# prints to stderr on the process group's first rank only. That handler stays quiet when any
# other handler would receive the record (the user's logging, pytest, ``TORCH_LOGS``), so a
# line is never printed twice. To silence it:
# ``logging.getLogger("ddp_split.summary").setLevel(logging.WARNING)``.


class _FirstRankHandler(logging.StreamHandler):
    """Prints summary lines on rank 0 when no other handler would (Note [Lines a normal run prints])."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not super().filter(record) or _rank() != 0:
            return False
        logger: logging.Logger | None = summary_log
        while logger is not None:
            if any(h is not self for h in logger.handlers):
                return False
            logger = logger.parent if logger.propagate else None
        return True


def _rank() -> int:
    """This process's rank in the default group (torchrun's ``RANK`` before it exists)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0") or 0)
    except ValueError:
        return 0


def show_summaries() -> None:
    """Make ``ddp_split.summary`` lines visible by default (Note [Lines a normal run prints])."""
    if any(isinstance(h, _FirstRankHandler) for h in summary_log.handlers):
        return
    if summary_log.level == logging.NOTSET:
        summary_log.setLevel(logging.INFO)
    handler = _FirstRankHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    summary_log.addHandler(handler)


def summary_line(plan: SplitPlan, pieces: Sequence[PieceRecord], times: StageTimes) -> str:
    """``ddp_split: graph 0 [0/0]: 7 pieces for 7 DDP buckets (one per bucket); traced in 0.4 s,
    compiled in 3.1 s (4 reused)``."""
    outcomes = collections.Counter(r.outcome for r in pieces)
    extra = ", ".join(part for part in (
        f"{outcomes[Outcome.SHARED]} reused" if outcomes[Outcome.SHARED] else "",
        f"{outcomes[Outcome.EAGER_FALLBACK]} eager after the inner backend failed"
        if outcomes[Outcome.EAGER_FALLBACK] else "",
    ) if part)
    traced = f"traced in {times.traced:.1f} s, " if times.traced is not None else ""
    done = f"{traced}compiled in {times.total:.1f} s" + (f" ({extra})" if extra else "")
    return f"ddp_split: {plan.graph_name}: {plan.summary()}; {done}"


def log_backward_compiled(graph_name: str, backward: BackwardCompile) -> None:
    """The line that completes a graph's compile time, after its first backward (Note [The
    first backward's compile] in first_backward.py)."""
    pieces = f"{backward.compiles} compile" + ("s" if backward.compiles != 1 else "")
    summary_log.info(
        "ddp_split: %s: backward compiled in %.1f s at the first backward (%s)", graph_name, backward.seconds, pieces
    )


def log_buckets_checked(graph_name: str, check: BucketCheck) -> None:
    """Which DDP bucket each piece ended up as, once DDP has rebuilt (``TORCH_LOGS=ddp_split``),
    and one warning if a piece is not one of them (Note [Pieces are DDP's buckets])."""
    if log.isEnabledFor(logging.INFO):
        held = "; ".join(
            f"bucket {i}: piece {', '.join(map(str, pieces))}" for i, pieces in enumerate(check.piece_of_bucket)
        )
        log.info(
            "ddp_split %s: DDP rebuilt %d buckets, %d of the plan's %d among them; %d of %d pieces are one "
            "bucket each\n%s",
            graph_name, len(check.ddp_buckets), check.buckets_matched, check.buckets, check.pieces_matched,
            check.pieces,
            textwrap.fill(held, TABLE_WIDTH, initial_indent="  ", subsequent_indent="    "),
        )
    warn_straddling(graph_name, check)


def _compiled_by(pieces: Sequence[PieceRecord]) -> str:
    """``inductor x 5, same as an earlier piece x 43`` (one entry per kind of compile)."""
    kinds = collections.Counter(
        "same as an earlier piece" if r.outcome is Outcome.SHARED else r.describe() for r in pieces
    )
    return ", ".join(f"{kind} x {n}" if n > 1 else kind for kind, n in kinds.items())


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
    plan: SplitPlan,
    split: SplitGraph | None,
    pieces: Sequence[PieceRecord],
    times: StageTimes,
) -> None:
    """Log and trace what the backend did with one graph."""
    summary_log.info("%s", summary_line(plan, pieces, times))
    if log.isEnabledFor(logging.INFO):
        details = (f"compiled by: {_compiled_by(pieces)}", f"compile {times.describe()}")
        wrapped = (textwrap.fill(d, TABLE_WIDTH, initial_indent="  ", subsequent_indent="    ") for d in details)
        log.info("%s\n%s", plan.table(), "\n".join(wrapped))
    _torch.trace_structured(
        "artifact",
        metadata_fn=lambda: {"name": "ddp_split_plan", "encoding": "json"},
        payload_fn=lambda: json.dumps(
            {**plan_to_dict(plan), "compiled_by": [r.describe() for r in pieces], "compile_seconds": times.seconds}
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
