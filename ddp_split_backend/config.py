"""Options of the ``ddp_split`` backend: one frozen dataclass, validated up front.

Example::

    >>> SplitConfig.from_options({"inner": "aot_eager", "bucket_cap_mb": 8})
    SplitConfig(inner='aot_eager', bucket_cap_mb=8, first_bucket_cap_mb=None, min_piece_mb=None, link_gbps=None, reuse_identical_pieces=None, mode=None, inner_options=None, on_inner_failure='eager', split_checkpoints='budget', checkpoint_budget=0.5)
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


from . import _torch

__all__ = [
    "BACKEND_NAME",
    "DDP_DEFAULT_BUCKET_CAP_MB",
    "MIB",
    "BucketCaps",
    "SplitConfig",
    "SplitConfigError",
]

BACKEND_NAME = "ddp_split"
MIB = 1024 * 1024
DDP_DEFAULT_BUCKET_CAP_MB = 25.0
INNER_FAILURE_CHOICES = ("eager", "raise")
CHECKPOINT_CHOICES = ("budget", "always", "never")


def _ddp_first_bucket_bytes() -> int:
    """DDP's first-bucket size in bytes (1 MiB in torch 2.13)."""
    return _torch.default_first_bucket_bytes()


class SplitConfigError(ValueError, _torch.ShortenTraceback):
    """A ``ddp_split`` option has a bad value; the message names option, value and fix.

    Note [Option errors reach the user as themselves]: options given to ``torch.compile``
    reach the backend only when Dynamo compiles the first graph, inside the first forward,
    and Dynamo wraps whatever a backend raises in ``BackendCompilerFailed`` ("please report
    this to PyTorch"), except its own ``ShortenTraceback``, which it raises as it is, its
    traceback starting at :attr:`first_useful_frame`. So this error is one as well: the user
    sees ``SplitConfigError`` and its message, raised from the backend's call (set by the
    backend), not torch's internals, and without the hints for reporting a torch bug that
    Dynamo appends to the message on the way. It is still a ``ValueError``."""

    def __init__(self, message: str) -> None:
        ValueError.__init__(self, message)
        self.message = message
        self.first_useful_frame: types.FrameType | None = None

    def remove_dynamo_frames(self) -> SplitConfigError:
        """What Dynamo raises: this error with its own message, its traceback from
        :attr:`first_useful_frame` on (all of it when that frame is not in it, or with
        ``TORCHDYNAMO_VERBOSE=1``)."""
        self.args = (self.message,)
        frame, self.first_useful_frame = self.first_useful_frame, None
        tb = None if _torch.dynamo_config.verbose else self.__traceback__
        while tb is not None and tb.tb_frame is not frame:
            tb = tb.tb_next
        return self.with_traceback(tb) if tb is not None else self

    def __reduce__(self) -> tuple[type[SplitConfigError], tuple[str]]:
        return type(self), (self.message,)  # picklable (a frame is not), e.g. across processes


@dataclass(frozen=True, slots=True)
class BucketCaps:
    """Resolved bucket capacities in bytes, as the planner uses them."""

    first_bytes: int
    """Capacity of the first bucket (the parameters whose gradients are ready first)."""
    bytes: int
    """Capacity of every later bucket."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SplitConfig:
    """Options of the ``ddp_split`` backend.

    Pass them as ``torch.compile(model, backend="ddp_split", options={...})`` or to
    :class:`~ddp_split_backend.DDPSplitBackend` directly.
    """

    inner: str | Callable[..., Any] = "inductor"
    """Backend each piece is compiled with: a registered backend name or a callable
    ``(gm, example_inputs) -> callable``."""
    bucket_cap_mb: float | None = None
    """Bucket capacity in MiB. ``None``: the active DDP module's cap, else DDP's default (25)."""
    first_bucket_cap_mb: float | None = None
    """First-bucket capacity in MiB. ``None``: DDP's first-bucket size, clamped to the cap."""
    min_piece_mb: float | str | None = None
    """How buckets are grouped into pieces (never cutting inside a bucket; DDP's buckets stay
    as they are). ``None`` (the default): one piece per bucket, the same plan on every rank
    and every step. A number: pieces of at least this many MiB of gradients. ``"auto"``
    (opt-in, needs ``link_gbps``): the grouping with the smallest predicted step time, from
    each bucket's estimated backward, the fixed cost of a piece and ``link_gbps`` (Note
    [Choosing pieces by cost] in plan.py). Every plan is made from the graph, its parameters
    and these options alone, at the first call, the same on every rank; nothing is measured
    while training. Fewer pieces cost less per step (each piece is one autograd node and one inner-backend call); more pieces start
    communication earlier. See "Choosing pieces" in docs/performance.md."""
    link_gbps: float | None = None
    """With ``min_piece_mb="auto"`` (required there, unused otherwise): how many GB/s the
    gradient allreduce moves (bucket bytes over this is its time; ``float("inf")``:
    communication costs nothing). ``watch_overlap``'s report measures it in a real run
    (``OverlapReport.link_gbps``, also in its summary line)."""
    reuse_identical_pieces: bool | None = None
    """Compile pieces with the same ops and input metadata once (repeated transformer blocks).
    ``None``: on for registered backend names, off for callables (which may record or
    specialise per graph)."""
    mode: str | None = None
    """Inductor mode for every piece, as ``torch.compile(mode=...)`` takes it (``"default"``,
    ``"max-autotune-no-cudagraphs"``, ...). ``torch.compile(model, backend="ddp_split",
    mode=...)`` sets it. Only with ``inner="inductor"``."""
    inner_options: Mapping[str, Any] | None = field(default=None, hash=False)
    """Inductor options for every piece (keys of ``torch._inductor.list_options()``), laid
    over the mode's settings. Only with ``inner="inductor"``."""
    on_inner_failure: str = "eager"
    """When the inner backend fails on a piece: ``"eager"`` runs that piece eagerly (with a
    warning; the other pieces stay compiled), ``"raise"`` lets the inner backend's exception
    propagate, with the piece named in a note and the global state restored."""

    split_checkpoints: str = "budget"
    """What to do with an activation-checkpoint region (non-reentrant
    ``torch.utils.checkpoint``) that DDP's buckets cross, whose gradients otherwise all wait
    for its whole recompute and backward: ``"budget"`` (the default) cuts it at the bucket
    boundaries into consecutive checkpoint regions as far as the activations the cuts keep
    for backward fit ``checkpoint_budget``; ``"always"`` cuts at every boundary; ``"never"``
    keeps every region whole. Note [Cutting checkpoint regions] in regions.py."""
    checkpoint_budget: float = 0.5
    """With ``split_checkpoints="budget"``: the share of the memory checkpointing a region
    saves that its cuts may give back (0: none, no cut; 1: all of it)."""

    def __post_init__(self) -> None:
        _check_inner(self.inner)
        _check_size("bucket_cap_mb", self.bucket_cap_mb)
        _check_size("first_bucket_cap_mb", self.first_bucket_cap_mb)
        if self.min_piece_mb != "auto":
            _check_size(
                "min_piece_mb", self.min_piece_mb, unset="one piece per bucket", also="'auto'"
            )
        _check_link(self.link_gbps, self.min_piece_mb)
        if self.on_inner_failure not in INNER_FAILURE_CHOICES:
            raise SplitConfigError(
                f"ddp_split option 'on_inner_failure' must be one of "
                f"{', '.join(repr(c) for c in INNER_FAILURE_CHOICES)}, got {self.on_inner_failure!r}. "
                "Use 'eager' to run a failing piece eagerly or 'raise' to see the inner backend's error."
            )
        if self.split_checkpoints not in CHECKPOINT_CHOICES:
            raise SplitConfigError(
                f"ddp_split option 'split_checkpoints' must be one of "
                f"{', '.join(repr(c) for c in CHECKPOINT_CHOICES)}, got {self.split_checkpoints!r}. "
                "Use 'budget' (the default) to cut checkpoint regions within checkpoint_budget, "
                "'always' to cut at every bucket boundary, 'never' to keep them whole."
            )
        budget = self.checkpoint_budget
        if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 <= budget <= 1:
            raise SplitConfigError(
                f"ddp_split option 'checkpoint_budget' must be a number from 0 to 1 (the share of the "
                f"memory checkpointing saves that cuts may give back), got {budget!r}. Use e.g. "
                "checkpoint_budget=0.5, or split_checkpoints='always' for no budget."
            )
        _check_inductor_settings(self.inner, self.mode, self.inner_options)
        if self.inner_options is not None:
            object.__setattr__(self, "inner_options", dict(self.inner_options))
        if self.reuse_identical_pieces not in (None, True, False):
            raise SplitConfigError(
                f"ddp_split option 'reuse_identical_pieces' must be True, False or None, got "
                f"{self.reuse_identical_pieces!r}."
            )
        if (
            self.bucket_cap_mb is not None
            and self.first_bucket_cap_mb is not None
            and self.first_bucket_cap_mb > self.bucket_cap_mb
        ):
            raise SplitConfigError(
                f"ddp_split option 'first_bucket_cap_mb'={self.first_bucket_cap_mb!r} exceeds "
                f"'bucket_cap_mb'={self.bucket_cap_mb!r}; the first bucket must not be larger "
                "than the others. Lower first_bucket_cap_mb or leave it out."
            )

    @classmethod
    def from_options(cls, options: Mapping[str, Any] | None, base: SplitConfig | None = None) -> SplitConfig:
        """Build a config from the ``options`` dict of ``torch.compile``, overlaid on ``base``
        (the backend instance's config; default: the defaults)."""
        base = base if base is not None else cls()
        if options is None:
            return base
        if not isinstance(options, Mapping):
            raise SplitConfigError(
                f"ddp_split options must be a dict, got {type(options).__name__} {options!r}. "
                f"Pass e.g. options={{'inner': 'aot_eager'}}."
            )
        known = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in known:
                raise SplitConfigError(
                    f"unknown ddp_split option {key!r} (value {options[key]!r}); "
                    f"valid options are {', '.join(known)}."
                )
        return dataclasses.replace(base, **options)

    @property
    def reuse(self) -> bool:
        """Whether identical pieces share one compiled function."""
        if self.reuse_identical_pieces is None:
            return isinstance(self.inner, str)
        return self.reuse_identical_pieces

    @property
    def min_piece_bytes(self) -> int | None:
        """``min_piece_mb`` in bytes (``None`` when unset or ``"auto"``)."""
        if self.min_piece_mb is None or self.min_piece_mb == "auto":
            return None
        return max(1, int(self.min_piece_mb * MIB))

    @property
    def sized_by_cost(self) -> bool:
        """``min_piece_mb="auto"``: pieces grouped by predicted step time."""
        return self.min_piece_mb == "auto"

    def caps(self, ddp_module: torch.nn.Module | None = None) -> BucketCaps:
        """Resolve capacities in bytes, reading the active DDP module where options are unset."""
        if self.bucket_cap_mb is not None:
            cap = int(self.bucket_cap_mb * MIB)
        elif ddp_module is not None and hasattr(ddp_module, "bucket_bytes_cap"):
            cap = int(ddp_module.bucket_bytes_cap)
        else:
            cap = int(DDP_DEFAULT_BUCKET_CAP_MB * MIB)
        cap = max(cap, 1)
        if self.first_bucket_cap_mb is not None:
            first = int(self.first_bucket_cap_mb * MIB)
        else:
            first = _ddp_first_bucket_bytes()
            ddp_first = _torch.ddp_first_bucket_bytes(ddp_module)
            if self.bucket_cap_mb is None and ddp_first is not None:
                first = ddp_first
        return BucketCaps(first_bytes=max(1, min(first, cap)), bytes=cap)


def _check_size(name: str, value: object, unset: str = "DDP's default", also: str = "") -> None:
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value) or value <= 0:  # type: ignore[arg-type]
        raise SplitConfigError(
            f"ddp_split option {name!r} must be a positive, finite number of MiB{' or ' + also if also else ''}, "
            f"got {value!r}. Use e.g. {name}=25, or leave it out for {unset}."
        )


def _check_link(value: object, min_piece_mb: object) -> None:
    if value is None:
        if min_piece_mb == "auto":
            raise SplitConfigError(
                "ddp_split option min_piece_mb='auto' needs 'link_gbps', the GB/s your gradient "
                "allreduce moves (got link_gbps=None): pieces are grouped against it, and nothing "
                "at compile time can tell it. Pass e.g. link_gbps=10 (float('inf') for a free "
                "link); ddp_split_backend.watch_overlap(ddp) measures it in your run and its "
                "summary line ends 'link ... GB/s'. Or leave min_piece_mb out for one "
                "piece per bucket."
            )
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if not ok or value <= 0:  # type: ignore[operator]
        raise SplitConfigError(
            f"ddp_split option 'link_gbps' must be a positive number of GB/s (or float('inf') for an "
            f"instant link), got {value!r}. Use e.g. link_gbps=10, or leave it out."
        )
    if min_piece_mb != "auto":
        raise SplitConfigError(
            f"ddp_split option 'link_gbps'={value!r} only sizes pieces with min_piece_mb='auto', but "
            f"min_piece_mb is {min_piece_mb!r}. Set min_piece_mb='auto' or leave link_gbps out."
        )


def available_backends() -> list[str]:
    """Every registered Dynamo backend name a piece can be compiled with."""
    return sorted(set(_torch.list_backends(exclude_tags=())) - {BACKEND_NAME})


def _check_inner(inner: object) -> None:
    if callable(inner) and not isinstance(inner, str):
        return
    if not isinstance(inner, str):
        raise SplitConfigError(
            f"ddp_split option 'inner' must be a backend name or a callable, got "
            f"{type(inner).__name__} {inner!r}. Use e.g. inner='inductor'."
        )
    if inner == BACKEND_NAME:
        raise SplitConfigError(
            "ddp_split option 'inner'='ddp_split' would split every piece again; choose the "
            "backend that compiles each piece, e.g. inner='inductor' or inner='aot_eager'."
        )
    choices = available_backends()
    if inner not in choices:
        raise SplitConfigError(
            f"ddp_split option 'inner'={inner!r} is not a registered backend; "
            f"valid choices: {', '.join(choices)}, or a callable (gm, example_inputs) -> fn."
        )


def inductor_option_names() -> list[str]:
    """Every inductor option (``torch._inductor.list_options()``): the keys of ``inner_options``."""
    return _torch.inductor_list_options()()  # loads inductor's config (a second or two) when asked


def inductor_mode_names() -> list[str]:
    """The modes ``torch.compile`` configures inductor with."""
    return list(_torch.inductor_mode_options()())


def _check_inductor_settings(inner: object, mode: object, options: object) -> None:
    for name, value in (("mode", mode), ("inner_options", options)):
        if value is not None and inner != "inductor":
            inner_name = inner if isinstance(inner, str) else getattr(inner, "__name__", type(inner).__name__)
            raise SplitConfigError(
                f"ddp_split option {name!r}={value!r} configures inductor, but the inner backend is "
                f"{inner_name!r}; only inductor takes a mode and inner_options. Use inner='inductor' "
                f"or leave {name} out."
            )
    if mode is not None:
        modes = inductor_mode_names()
        if mode not in modes:
            raise SplitConfigError(
                f"ddp_split option 'mode' must be one of {', '.join(repr(m) for m in modes)}, got {mode!r}."
            )
    if options is None:
        return
    if not isinstance(options, Mapping):
        raise SplitConfigError(
            f"ddp_split option 'inner_options' must be a dict of inductor options, got "
            f"{type(options).__name__} {options!r}. Use e.g. inner_options={{'max_autotune': True}}."
        )
    inductor_config = _torch.inductor_config()
    names = inductor_option_names()
    for key, value in options.items():
        if key not in names:
            near = difflib.get_close_matches(str(key), names, n=3, cutoff=0.6)
            hint = f"did you mean {', '.join(repr(n) for n in near)}?" if near else "no option has a similar name;"
            raise SplitConfigError(
                f"ddp_split option 'inner_options' has {key!r}, which is not an inductor option; {hint} "
                "torch._inductor.list_options() lists them all."
            )
        expected = inductor_config.get_type(key)
        plain = typing.get_origin(expected) is None and isinstance(expected, type)
        if plain and not isinstance(value, expected):
            raise SplitConfigError(
                f"ddp_split option 'inner_options'[{key!r}] must be a {expected.__name__}, got "
                f"{type(value).__name__} {value!r}."
            )
