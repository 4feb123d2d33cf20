"""The ``ddp_split`` Dynamo backend: graph -> plan -> pieces -> compiled callable.

Example::

    >>> model = torch.compile(DDP(MyModel()), backend="ddp_split",
    ...                       options={"inner": "aot_eager", "bucket_cap_mb": 8})
    >>> from ddp_split_backend import ddp_split
    >>> print(ddp_split.records[-1].plan.table())  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import inspect
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from . import _torch
from .compile import CompiledPieces, InnerCompile, Outcome, PieceRecord, compile_pieces, compile_whole
from .config import BACKEND_NAME, BucketCaps, SplitConfig, SplitConfigError
from .cost import device_rates, fixed_cost_s, node_backward_s
from .diagnostics import log_backward_compiled, log_buckets_checked, log_compiled, show_summaries
from .first_backward import BackwardCompile, forget_all, watch
from .ready_order import BucketCheck, ReadyOrder
from .inner import inner_compile
from .layout import GraphLayout, compute_nodes, layout_graph
from .params import ParamTable, find_params, parameter_placeholders
from .plan import BucketPlan, CostInputs, GraphShare, SplitPlan, WholeReason, plan_buckets
from .regions import RegionSplit, cut_regions
from .runtime import GuardedCallable, StitchedCallable
from .split import SplitGraph, split_graph
from .state import Ambient, classify
from .timing import StageTimes

__all__ = ["CompileRecord", "DDPSplitBackend", "ddp_split", "plan_split"]


@dataclass(frozen=True, slots=True)
class CompileRecord:
    """What the backend did with one graph: its plan and how each piece was compiled."""

    plan: SplitPlan
    pieces: tuple[PieceRecord, ...]
    times: StageTimes = field(default_factory=StageTimes)
    """Seconds spent in each stage of this graph's compile (plan, split, inner, ...)."""
    compile_id: str | None = None
    """Dynamo's id of the frame compile that made the graph (``1/0``: frame 1, first
    compile), or ``None`` outside Dynamo; the id in ``plan.graph_name``."""
    backward: BackwardCompile = field(default_factory=BackwardCompile)
    buckets: BucketCheck = field(default_factory=BucketCheck)
    """Once DDP has rebuilt its buckets: whether they are the pieces (Note [Pieces are DDP's
    buckets] in ready_order.py); never filled in without DDP or for part of the model."""
    """The backward compile AOTAutograd defers to the graph's first backward, filled in when
    that backward has run (Note [The first backward's compile] in first_backward.py)."""

    @property
    def compiled_by(self) -> tuple[str, ...]:
        """Per piece, for people: ``inductor``, ``inductor (same as piece 3)``, ``eager (fallback)``."""
        return tuple(r.describe() for r in self.pieces)

    @property
    def failures(self) -> tuple[PieceRecord, ...]:
        """The pieces the inner backend failed on (they run eagerly)."""
        return tuple(r for r in self.pieces if r.outcome is Outcome.EAGER_FALLBACK)


def _ddp_names(ddp_module: torch.nn.Module | None) -> tuple[dict[int, str], frozenset[str]]:
    """FQNs of the user's module (as DDP wraps it) and the names DDP was told to ignore."""
    if ddp_module is None:
        return {}, frozenset()
    inner = getattr(ddp_module, "module", ddp_module)
    names: dict[int, str] = {}
    for name, param in inner.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), _user_fqn(name))
    ignored = frozenset(_user_fqn(n) for n in getattr(ddp_module, "parameters_to_ignore", ()) or ())
    return names, ignored


def _user_fqn(name: str) -> str:
    """``net.0.weight`` also when DDP wraps a compiled module (``_orig_mod.net.0.weight``)."""
    return ".".join(part for part in name.split(".") if part != "_orig_mod")


def _compile_id() -> str | None:
    """Dynamo's frame/recompile id of the graph being compiled (``1/0``), if under Dynamo."""
    compile_id = _torch.CompileContext.current_compile_id()
    return None if compile_id is None else str(compile_id)


def _graph_name(index: int) -> str:
    """``graph 3 [1/0]``: our count, and Dynamo's compile id when compiling under it."""
    compile_id = _compile_id()
    return f"graph {index} [{compile_id}]" if compile_id is not None else f"graph {index}"


def plan_split(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    config: SplitConfig | None = None,
    ddp_module: torch.nn.Module | None = None,
    graph_name: str = "",
) -> SplitPlan:
    """Where ``ddp_split`` cuts ``gm``, without compiling anything.

    Args:
        gm: a Dynamo graph (or any FX graph whose placeholders line up with ``example_inputs``).
        example_inputs: the graph's inputs; parameters among them are counted into buckets.
        config: options; bucket caps default to ``ddp_module``'s, else DDP's defaults.
        ddp_module: the DDP module the graph runs under (default: the active one, if any).

    Returns:
        The :class:`SplitPlan`: the one the backend compiles with the same ``config``. With
        the default ``min_piece_mb=None`` one piece per bucket; with ``min_piece_mb="auto"``
        the grouping predicted fastest over the given ``link_gbps``. Nothing is measured.
    """
    return _plan_graph(gm, example_inputs, config or SplitConfig(), ddp_module, graph_name).plan


@dataclass(frozen=True, slots=True)
class _Planned:
    """A graph's plan and what it was made from (the split and the run time need them)."""

    plan: SplitPlan
    layout: GraphLayout
    params: ParamTable
    ddp_module: torch.nn.Module | None
    gm: fx.GraphModule
    """The graph planned: the Dynamo graph, with its checkpoint regions cut where they were."""


def _plan_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: SplitConfig,
    ddp_module: torch.nn.Module | None,
    graph_name: str,
) -> _Planned:
    """The plan of one graph: a function of the graph, its parameters and the options only
    (every rank derives the same one alone). The grouping search runs only for
    ``min_piece_mb="auto"``."""
    ddp_module = ddp_module if ddp_module is not None else _torch.active_ddp_module()
    names, ignored = _ddp_names(ddp_module)
    caps = config.caps(ddp_module)
    source = _PlanSource(example_inputs, config, caps, ddp_module, names, ignored, graph_name, Ambient.capture())
    first = _plan_once(gm, source)
    regions = _cut_regions(first, source, keep=None)
    planned = first
    if regions.part_starts:  # Note [Cutting checkpoint regions]: parts in one piece are joined again
        planned = _plan_once(regions.gm, source)
        keep = _parts_cut_apart(planned, regions)
        if keep is not None:
            regions = _cut_regions(first, source, keep=keep)
            planned = _plan_once(regions.gm, source)
    plan = dataclasses.replace(planned.plan, regions=regions.records)
    if plan.whole is None:  # a graph without backward sends nothing, whatever it holds
        plan = dataclasses.replace(plan, share=_share(planned.params, ddp_module))
    return dataclasses.replace(planned, plan=plan)


@dataclass(frozen=True, slots=True)
class _PlanSource:
    """Everything but the graph that a plan is made from."""

    example_inputs: Sequence[Any]
    config: SplitConfig
    caps: BucketCaps
    ddp_module: torch.nn.Module | None
    names: dict[int, str]
    ignored: frozenset[str]
    graph_name: str
    ambient: Ambient


def _plan_once(gm: fx.GraphModule, source: _PlanSource) -> _Planned:
    config = source.config
    layout = layout_graph(gm, source.ambient)
    params = find_params(gm, layout.nodes, source.example_inputs, names=source.names, ddp_ignored=source.ignored)
    costs = _cost_inputs(gm, layout, source.example_inputs, config) if config.sized_by_cost else None
    plan = plan_buckets(
        layout, params, source.caps, graph_name=source.graph_name, min_piece_bytes=config.min_piece_bytes,
        costs=costs,
    )
    return _Planned(plan, layout, params, source.ddp_module, gm)


def _cut_regions(planned: _Planned, source: _PlanSource, keep: Mapping[str, frozenset[str]] | None) -> RegionSplit:
    if planned.plan.whole is not None:
        return RegionSplit(planned.gm, (), {})
    return cut_regions(
        planned.gm, planned.layout, planned.params, parameter_placeholders(planned.gm, source.example_inputs),
        source.caps, policy=source.config.split_checkpoints, budget=source.config.checkpoint_budget, keep=keep,
    )


def _parts_cut_apart(planned: _Planned, regions: RegionSplit) -> dict[str, frozenset[str]] | None:
    """Per cut region, the body nodes starting a part that the plan put in a piece of its own
    (the parts' first body nodes, by the regions' records); ``None`` when every part is."""
    piece_starts = {planned.layout.nodes[c].name for c in planned.plan.cuts}
    keep: dict[str, frozenset[str]] = {}
    joined = False
    for record in regions.records:
        starts = regions.part_starts.get(record.region, ())
        kept = frozenset(body for body, node in zip(record.before, starts) if node in piece_starts)
        joined |= len(kept) < len(starts)
        keep[record.region] = kept
    return keep if joined else None


def _ready_order(planned: _Planned, split: SplitGraph, check: BucketCheck) -> ReadyOrder | None:
    """How the graph's pieces hand DDP their gradients in the plan's order (Note [Pieces are
    DDP's buckets]), or ``None`` without DDP or when DDP will not rebuild its buckets."""
    ddp, plan = planned.ddp_module, planned.plan
    if ddp is None or not _torch.ddp_rebuilds_buckets_later(ddp) or plan.whole is not None:
        return None
    uses = {use.name: use for use in planned.params.params}
    views, pieces = [], []
    for piece, inputs in zip(plan.pieces, (p.inputs for p in split.pieces), strict=True):
        slots = [uses[name].slot for name in piece.params if name in uses]
        views.append(tuple(inputs.index(slot) for slot in slots if slot is not None and slot in inputs))
        pieces.append(frozenset(piece.params))
    named = dict(_ddp_parameters(ddp))
    params = {name: named[name] for name in uses if name in named}
    whole = plan.share is None
    buckets = [frozenset(b.params) for b in plan.buckets]
    return ReadyOrder(
        ddp, views, pieces, buckets, {name: use.nbytes for name, use in uses.items()}, params, plan.caps,
        check if whole else None, functools.partial(log_buckets_checked, plan.graph_name), plan.graph_name,
    )


def _ddp_parameters(ddp: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    inner = getattr(ddp, "module", ddp)
    return [(_user_fqn(name), p) for name, p in inner.named_parameters()]


def _share(params: ParamTable, ddp_module: torch.nn.Module | None) -> GraphShare | None:
    """What part of ``ddp_module``'s gradients the graph holds, when not all of them."""
    if ddp_module is None:
        return None
    ddp_bytes = sum(p.numel() * p.element_size() for p in _torch.ddp_reduced_params(ddp_module))
    graph_bytes = sum(p.nbytes for p in params.params)
    return GraphShare(graph_bytes, ddp_bytes) if graph_bytes < ddp_bytes else None


def _cost_inputs(
    gm: fx.GraphModule, layout: GraphLayout, example_inputs: Sequence[Any], config: SplitConfig
) -> CostInputs:
    """What ``min_piece_mb="auto"`` groups by (Note [Piece cost model] in cost.py)."""
    assert config.link_gbps is not None  # SplitConfig requires it with "auto"
    device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    rates = device_rates(device)
    return CostInputs(
        node_backward_s=node_backward_s(layout.nodes, gm, rates),
        fixed_s=fixed_cost_s(config.inner),
        link_bytes_per_s=config.link_gbps * 1e9,
        rates=rates,
    )


def _ddp_optimizer_piece_plan(gm: fx.GraphModule, config: SplitConfig, graph_name: str) -> SplitPlan:
    count = len(compute_nodes(gm))
    bucket = BucketPlan(piece=0, bucket=0, nbytes=0, params=(), start=0, stop=count)
    return SplitPlan(
        buckets=(bucket,),
        caps=config.caps(_torch.active_ddp_module()),
        node_count=count,
        source="DDPOptimizer piece",
        graph_name=graph_name,
        notes=("torch's DDPOptimizer already cut this graph; ddp_split compiled the piece whole",),
    )


class DDPSplitBackend:
    """A Dynamo backend that cuts graphs at DDP bucket boundaries and compiles the pieces.

    Use it by name (``torch.compile(model, backend="ddp_split")``, which uses the shared
    instance :data:`ddp_split`) or as an object with its own options and records::

        backend = DDPSplitBackend(SplitConfig(inner="aot_eager", bucket_cap_mb=4))
        compiled = torch.compile(model, backend=backend)
        compiled(x)
        backend.records[-1].plan  # what was done with the last graph
    """

    compiler_name = BACKEND_NAME

    def __init__(self, config: SplitConfig | None = None, *, keep_records: int = 256) -> None:
        self.config = config or SplitConfig()
        self.records: collections.deque[CompileRecord] = collections.deque(maxlen=keep_records)
        """The last graphs compiled, oldest first."""
        self._warned_ddp_optimizer = False
        self._graphs = 0
        """Graphs compiled so far (``records`` keeps only the last ``keep_records``)."""
        self._configs: dict[str, tuple[SplitConfig, InnerCompile]] = {}
        """Validated configs and their inner backends, by options (see :meth:`_configured`)."""

    @property
    def plans(self) -> list[SplitPlan]:
        return [r.plan for r in self.records]

    def __call__(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        *,
        options: Mapping[str, Any] | None = None,
        mode: str | None = None,
    ) -> Callable[..., Any]:
        try:
            config, inner = self._configured(options, mode)
        except SplitConfigError as error:  # Note [Option errors reach the user as themselves]
            error.first_useful_frame = inspect.currentframe()
            raise error.with_traceback(None) from None
        show_summaries()
        traced = _torch.frame_compile_seconds()
        compiled = self._compile(gm, example_inputs, config, inner, _graph_name(self._graphs), traced)
        self._graphs += 1  # not on a signal or failure (Note [Dynamo's signals] in guards.py)
        return compiled

    def _compile(
        self,
        gm: fx.GraphModule,
        example_inputs: Sequence[Any],
        config: SplitConfig,
        inner: InnerCompile,
        graph_name: str,
        traced: float | None,
    ) -> Callable[..., Any]:
        times = StageTimes(traced=traced)

        if _torch.is_ddp_optimizer_piece(gm):
            self._warn_ddp_optimizer()
            plan = _ddp_optimizer_piece_plan(gm, config, graph_name)
            return self._finish(plan, None, gm, compile_whole(gm, example_inputs, inner, times), times)

        with times.measure("plan"):
            planned = _plan_graph(gm, example_inputs, config, None, graph_name)
        plan = planned.plan
        if len(plan.pieces) == 1:
            return self._finish(plan, None, gm, compile_whole(gm, example_inputs, inner, times), times)
        with times.measure("split"):
            split = split_graph(planned.gm, planned.layout, plan.cuts)
        compiled = compile_pieces(split, example_inputs, inner, times, reuse=config.reuse)
        return self._finish(plan, split, gm, compiled, times, planned)

    def _configured(self, options: Mapping[str, Any] | None, mode: str | None) -> tuple[SplitConfig, InnerCompile]:
        """The config for ``options`` overlaid on :attr:`config`, and its inner backend:
        validated once per distinct options (graphs and recompiles pass the same ones)."""
        key = repr((self.config, sorted((k, repr(v)) for k, v in (options or {}).items()), mode))
        found = self._configs.get(key)
        if found is None:
            config = SplitConfig.from_options(options, base=self.config)
            if mode is not None:  # torch.compile(mode=...): inductor's mode for every piece
                config = dataclasses.replace(config, mode=mode)
            found = self._configs[key] = (config, inner_compile(config))
        return found

    def reset(self) -> None:
        """Forget the records, the graph count, the one-shot warning and the validated options.

        ``torch._dynamo.reset()`` calls this for every backend Dynamo has compiled with since
        the last reset (it calls ``reset()`` on each one it cached), so a reset starts the
        backend as a fresh process would."""
        self.records.clear()
        self._graphs = 0
        self._warned_ddp_optimizer = False
        self._configs.clear()
        forget_all()

    def _finish(
        self,
        plan: SplitPlan,
        split: SplitGraph | None,
        gm: fx.GraphModule,
        compiled: CompiledPieces,
        times: StageTimes,
        planned: _Planned | None = None,
    ) -> Callable[..., Any]:
        """Record and log what was done; wrap the callables for run time (a split graph under
        DDP with its pieces' gradients made ready in the plan's order until DDP rebuilds)."""
        compile_id = _compile_id()
        backward = (
            BackwardCompile() if plan.whole is WholeReason.NO_BACKWARD
            else watch(compile_id, functools.partial(log_backward_compiled, plan.graph_name))
        )
        buckets = BucketCheck()
        record = CompileRecord(plan, compiled.records, times, compile_id, backward, buckets)
        self.records.append(record)
        log_compiled(plan, split, record.pieces, times)
        if split is not None:
            order = _ready_order(planned, split, buckets) if planned is not None else None
            return StitchedCallable(split, compiled.callables, record.compiled_by, order)
        (fn,) = compiled.callables
        changes_state = any(classify(n) is not None for n in gm.graph.nodes)
        if changes_state or record.failures:
            return GuardedCallable(fn, record.compiled_by[0])
        return fn

    def _warn_ddp_optimizer(self) -> None:
        if self._warned_ddp_optimizer:
            return
        self._warned_ddp_optimizer = True
        warnings.warn(
            "ddp_split: torch's DDPOptimizer already split this graph "
            "(torch._dynamo.config.optimize_ddp is True and a DDP module is active); "
            "ddp_split compiles its pieces whole instead of splitting again. For ddp_split's "
            "own plan, compile under ddp_split_backend.own_split() or set "
            "torch._dynamo.config.optimize_ddp = False.",
            stacklevel=2,
        )


ddp_split = DDPSplitBackend()
"""The instance registered as ``backend="ddp_split"``."""
