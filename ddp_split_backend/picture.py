"""Pictures made with matplotlib: plans (one row per graph, buckets as bars along the graph)
and measured overlap (one step's buckets on a timeline around the end of backward)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

from .extras import MissingExtra, require
from .plan import SplitPlan

__all__ = ["draw_overlap", "draw_plans", "drawn"]

_SPAN_COLORS = {
    "autocast": "#f4a261",
    "inference mode": "#8ecae6",
    "forward-AD dual level": "#b5e48c",
    "grad mode": "#cdb4db",
    "forward-AD grad mode": "#ffafcc",
    "uncuttable region": "#adb5bd",
}


def _size(nbytes: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


def _pyplot():  # noqa: ANN202  (matplotlib is an optional extra)
    matplotlib = require("matplotlib", "drawing a picture")
    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt


def drawn(draw: Callable[[], Path]) -> Path | None:
    """The file ``draw()`` wrote, or ``None`` and one warning naming the extra when matplotlib
    is missing: a picture that cannot be drawn never stops a script before its teardown."""
    try:
        return draw()
    except MissingExtra as error:
        warnings.warn(str(error), stacklevel=3)
        return None


def draw_plans(plans: Sequence[SplitPlan], path: Path) -> Path:
    """Write a PNG: x = node position in the graph, bar height = bucket bytes (MiB); dashed
    lines are cuts, red triangles cuts that were moved, shaded bands global-state regions."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    rows = max(1, len(plans))
    fig, axes = plt.subplots(rows, 1, figsize=(11, 2.8 * rows), squeeze=False)
    for ax, plan in zip(axes[:, 0], plans):
        top = max((b.nbytes for b in plan.buckets), default=1) / 2**20 or 1.0
        lanes = sorted({span.kind for span in plan.state_spans})
        lane = 0.12 / max(1, len(lanes))
        for span in plan.state_spans:
            low = 0.88 + lane * lanes.index(span.kind)
            ax.axvspan(span.start, span.stop, ymin=low, ymax=low + lane * 0.9,
                       color=_SPAN_COLORS.get(span.kind, "#ddd"))
        for b in plan.buckets:
            height = b.nbytes / 2**20
            ax.bar(b.start, height, width=max(b.node_count, 0.5), align="edge",
                   color="#2a9d8f" if b.piece % 2 else "#264653", edgecolor="white")
            label = f"bucket {b.bucket}\n{_size(b.nbytes)}\n{len(b.params)} params"
            ax.text(b.start + b.node_count / 2, height + top * 0.02, label, ha="center", va="bottom", fontsize=7)
            if b.adjustments:
                ax.plot([b.start], [top * 1.05], marker="v", color="#e63946")
        for piece in plan.pieces[1:]:  # the cuts; buckets grouped into one piece share a colour
            ax.axvline(piece.start, color="black", linestyle="--", linewidth=0.8)
        ax.set_xlim(0, max(plan.node_count, 1))
        ax.set_ylim(0, top * 1.6)
        ax.set_ylabel("bucket MiB")
        ax.set_title(f"{plan.graph_name}: {len(plan.pieces)} pieces, {len(plan.buckets)} buckets, "
                     f"cap {_size(plan.caps.bytes)} "
                     f"({plan.source})", fontsize=9)
    axes[-1, 0].set_xlabel("node position in the graph (forward order; backward runs right to left)")
    kinds = sorted({s.kind for p in plans for s in p.state_spans})
    if kinds:
        fig.legend(handles=[Patch(color=_SPAN_COLORS.get(k, "#ddd"), label=k) for k in kinds],
                   loc="upper right", fontsize=7, ncol=len(kinds))
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


class _Bucket(Protocol):
    """One bucket's times, ``overlap.BucketTiming`` (picture.py never imports overlap.py)."""

    bucket: int
    ready: float
    launched: float
    completed: float


class _Step(Protocol):
    """One measured step, ``overlap.StepOverlap``."""

    step: int
    backward_s: float
    buckets: Sequence[_Bucket]

    @property
    def exposed_s(self) -> float: ...

    @property
    def exposed_share(self) -> float: ...


def draw_overlap(step: _Step | None, device: str, path: Path) -> Path:
    """Write a PNG of one measured step (an overlap report's median one): x = ms relative to
    the end of backward (the grey band is backward), one row per bucket in the order DDP
    handed them over, a bar from launch to completion and a dot where the bucket was ready;
    red: communication exposed."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.28 * (len(step.buckets) if step else 1)))
    if step is not None:
        ax.axvspan(-step.backward_s * 1e3, 0, color="#dee2e6", label="backward")
        if step.exposed_s > 0:
            ax.axvspan(0, step.exposed_s * 1e3, color="#ffccd5", label="exposed communication")
        for row, b in enumerate(step.buckets):
            ax.barh(row, (b.completed - b.launched) * 1e3, left=b.launched * 1e3, height=0.6, color="#2a9d8f")
            ax.plot([b.ready * 1e3], [row], marker="o", color="#264653", markersize=3)
        ax.set_yticks(range(len(step.buckets)), [f"bucket {b.bucket}" for b in step.buckets], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"step {step.step} ({device}): {step.exposed_s * 1e3:.2f} ms exposed, "
                     f"{step.exposed_share:.0%} of communication", fontsize=9)
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_xlabel("ms relative to the end of backward (bars: launch to completion; dots: ready)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
