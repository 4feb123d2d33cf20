"""ddp_split: a torch.compile backend that cuts Dynamo graphs at DDP bucket boundaries.

``torch.compile(model, backend="ddp_split")`` compiles each bucket's piece with an inner
backend, so DDP can launch each gradient bucket's allreduce while backward is still running.
"""

from __future__ import annotations

from .backend import CompileRecord, DDPSplitBackend, ddp_split, plan_split
from .compile import Failure, InnerFallbackWarning, Outcome, PieceRecord
from .config import SplitConfig, SplitConfigError
from .ddp_mode import own_split
from .explain import ExplainResult, explain
from .extras import MissingExtra
from .overlap import BucketTiming, OverlapReport, OverlapWatch, StepOverlap, watch_overlap
from .plan import (
    AdjustReason,
    BoundaryAdjustment,
    BucketPlan,
    PieceSizing,
    RegionCut,
    RegionOutcome,
    SplitPlan,
    WholeReason,
)
from .teardown import close_ddp

__all__ = [
    "AdjustReason",
    "BoundaryAdjustment",
    "BucketPlan",
    "BucketTiming",
    "CompileRecord",
    "DDPSplitBackend",
    "ExplainResult",
    "Failure",
    "InnerFallbackWarning",
    "MissingExtra",
    "Outcome",
    "OverlapReport",
    "OverlapWatch",
    "PieceRecord",
    "PieceSizing",
    "RegionCut",
    "RegionOutcome",
    "SplitConfig",
    "SplitConfigError",
    "SplitPlan",
    "StepOverlap",
    "WholeReason",
    "close_ddp",
    "ddp_split",
    "explain",
    "own_split",
    "plan_split",
    "watch_overlap",
]

__version__ = "0.1.0"
