"""The ``ddp_split`` Dynamo backend: graph -> plan -> pieces -> compiled callable.

Example::

    >>> model = torch.compile(DDP(MyModel()), backend="ddp_split",
    ...                       options={"inner": "aot_eager", "bucket_cap_mb": 8})
    >>> from ddp_split_backend import ddp_split
    >>> print(ddp_split.records[-1].plan.table())  # doctest: +SKIP
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import inspect
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from . import _torch
from .agree import agreed_grouping
from .compile import CompiledPieces, InnerCompile, Outcome, PieceRecord, compile_pieces, compile_whole, copy_module
from .config import BACKEND_NAME, BucketCaps, SplitConfig, SplitConfigError
from .cost import device_rates, fixed_cost_s, node_backward_s
from .diagnostics import log_backward_compiled, log_compiled, show_summaries, summary_log
from .first_backward import BackwardCompile, forget_all, watch
from .guards import preserve_global_state, track_state_calls
from .inner import inner_compile, inductor_patches
from .layout import GraphLayout, layout_graph
from .params import ParamTable, find_params
from .plan import BACKWARD_SHARE, PAYBACK_STEPS, BucketPlan, CostInputs, GraphShare, Payback, SplitPlan, WholeReason, plan_buckets
from .regroup import STEPS_BEFORE_REPLAN, Declined, Measurement, RegroupingCallable
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
        The :class:`SplitPlan`. With ``min_piece_mb="auto"`` (the default) and no
        ``link_gbps`` this is the static estimate, as if under DDP with communication as long
        as backward: nothing is measured here.
    """
    return _plan_graph(gm, example_inputs, config or SplitConfig(), ddp_module, graph_name, measure=False).plan


@dataclass(frozen=True, slots=True)
class _Planned:
    """A graph's plan and what it was made from (a later re-plan starts from it)."""

    plan: SplitPlan
    layout: GraphLayout
    params: ParamTable
    caps: BucketCaps
    ddp_module: torch.nn.Module | None
    costs: CostInputs | None
    measures_link: bool
    """Compiled one piece per bucket until the first steps were measured (Note [Measuring the link])."""


def _plan_graph(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    config: SplitConfig,
    ddp_module: torch.nn.Module | None,
    graph_name: str,
    *,
    measure: bool = True,
) -> _Planned:
    """The plan of one graph. ``measure``: for the backend's own run (``min_piece_mb="auto"``
    measures under DDP, and without DDP has nothing to send); ``False`` for ``plan_split``,
    which plans as if under DDP and measures nothing."""
    ddp_module = ddp_module if ddp_module is not None else _torch.active_ddp_module()
    names, ignored = _ddp_names(ddp_module)
    layout = layout_graph(gm, Ambient.capture())
    params = find_params(gm, layout.nodes, example_inputs, names=names, ddp_ignored=ignored)
    caps = config.caps(ddp_module)
    measures = measure and _measures_link(config, ddp_module, example_inputs)
    costs = (
        _cost_inputs(gm, layout, example_inputs, config, measure and ddp_module is None, measures)
        if config.sized_by_cost
        else None
    )
    plan = plan_buckets(
        layout, params, caps, graph_name=graph_name, min_piece_bytes=config.min_piece_bytes, costs=costs
    )
    if plan.whole is None:  # a graph without backward sends nothing, whatever it holds
        plan = dataclasses.replace(plan, share=_share(params, ddp_module))
    measures = measures and plan.whole is None and len(plan.buckets) > 1
    if measures:  # Note [Measuring the link]: compiled as the default compiles it until measured
        plan = dataclasses.replace(
            plan.regrouped(range(len(plan.buckets)), f"measured in its first {STEPS_BEFORE_REPLAN} training steps"),
            sizing=None,
        )
    return _Planned(plan, layout, params, caps, ddp_module, costs, measures)


def _share(params: ParamTable, ddp_module: torch.nn.Module | None) -> GraphShare | None:
    """What part of ``ddp_module``'s gradients the graph holds, when not all of them."""
    if ddp_module is None:
        return None
    ddp_bytes = sum(p.numel() * p.element_size() for p in _torch.ddp_reduced_params(ddp_module))
    graph_bytes = sum(p.nbytes for p in params.params)
    return GraphShare(graph_bytes, ddp_bytes) if graph_bytes < ddp_bytes else None


def _measures_link(config: SplitConfig, ddp_module: torch.nn.Module | None, example_inputs: Sequence[Any]) -> bool:
    """Whether ``min_piece_mb="auto"`` measures the first steps (Note [Measuring the link]):
    not when told the link, without DDP (nothing to send), with dynamic shapes (a later
    compile could not add guards) or CUDA graphs (recorded once, kept)."""
    if not config.sized_by_cost or config.link_gbps is not None or ddp_module is None:
        return False
    if any(_symbolic(v) for v in example_inputs):
        return False
    return not inductor_patches(config.mode, config.inner_options).get("triton.cudagraphs", False)


def _symbolic(value: Any) -> bool:
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    return isinstance(value, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in value.shape)


def _cost_inputs(
    gm: fx.GraphModule,
    layout: GraphLayout,
    example_inputs: Sequence[Any],
    config: SplitConfig,
    nothing_to_send: bool,
    measures: bool,
) -> CostInputs:
    """What ``min_piece_mb="auto"`` groups by (Note [Piece cost model] in cost.py).
    ``nothing_to_send``: compiled for a run without DDP (``plan_split`` plans as if under it)."""
    device = next((t.device for t in example_inputs if isinstance(t, torch.Tensor)), torch.device("cpu"))
    if measures:  # the first grouping's sizing is replaced by one piece per bucket until measured
        link, source = math.inf, "not measured yet"
    elif nothing_to_send and config.link_gbps is None:
        link, source = math.inf, "no DDP module: nothing to send"
    else:
        link, source = (None if config.link_gbps is None else config.link_gbps * 1e9), None
    return CostInputs(
        node_backward_s=node_backward_s(layout.nodes, gm, device_rates(device)),
        fixed_s=fixed_cost_s(config.inner),
        link_bytes_per_s=link,
        link_source=source,
    )


@dataclass(frozen=True, slots=True)
class _Deferred:
    """What a graph measured before re-planning needs then (kept until it re-planned)."""

    gm: fx.GraphModule
    example_inputs: Sequence[Any]
    """The frame's fake inputs (never the real ones: the first batch would be kept alive)."""
    planned: _Planned
    """Without its DDP module (the measuring window holds that weakly)."""
    config: SplitConfig
    inner: InnerCompile
    context: Any
    """Dynamo's tracing context of the frame (its fake mode and guards), or ``None``."""
    split: SplitGraph
    compiled: CompiledPieces
    """The pieces, one per bucket, as first compiled."""


def _frame_fakes(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[Any]:
    """The frame's own fake value of each input (Dynamo's, with the frame's symbols), where
    it recorded one; a later compile from them sees the sizes the frame's guards name."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = []
    for node, example in zip(placeholders, example_inputs, strict=True):
        value = node.meta.get("example_value")
        fake = isinstance(value, _torch.FakeTensor) or not isinstance(example, torch.Tensor)
        fakes.append(value if fake else example)
    return fakes


def _bucket_params(buckets: Sequence[frozenset[str]], ddp: torch.nn.Module) -> list[list[torch.Tensor]]:
    """The parameters of ``ddp``'s module in each of the graph's buckets (by name)."""
    inner = getattr(ddp, "module", ddp)
    named = [(_user_fqn(name), p) for name, p in inner.named_parameters()]
    return [[p for name, p in named if name in bucket] for bucket in buckets]


def _measuring(
    fn: Callable[..., Any], ddp: torch.nn.Module | None, deferred: _Deferred, replan: Callable[..., Any]
) -> RegroupingCallable:
    """``fn`` (the graph one piece per bucket) wrapped to measure its first steps and re-plan."""
    assert ddp is not None  # only graphs under DDP are measured
    buckets = deferred.planned.plan.buckets
    copies_back = not getattr(ddp, "gradient_as_bucket_view", False)
    eager = GuardedCallable(track_state_calls(copy_module(deferred.gm)), "eager (while DDP learns its bucket order)")
    return RegroupingCallable(
        fn, eager=eager, buckets_of=functools.partial(_bucket_params, tuple(frozenset(b.params) for b in buckets)),
        bucket_bytes=tuple(b.nbytes for b in buckets), copies_back=copies_back, replan=replan,
    )


_BACKWARD_TOO = 2.0
"""The inner backend's seconds at the first compile time forward only (AOTAutograd compiles
backward at the first backward); a re-plan compiles both, taken as about as long again."""


def _recompile_s(deferred: _Deferred, plan: SplitPlan) -> float:
    """The estimated seconds of compiling ``plan``'s pieces: the first compile's lowest
    seconds per node of a piece (the first piece of a process also pays one-time costs),
    for the nodes of each distinct new piece (a piece whose buckets' first pieces were
    compiled alike as another's is taken to be compiled once, as reuse does; with reuse, a
    piece of one bucket keeps its first compile)."""
    first, records = deferred.planned.plan, deferred.compiled.records
    rates = [
        r.seconds / p.node_count
        for p, r in zip(first.pieces, records, strict=True)
        if r.outcome is Outcome.COMPILED and p.node_count
    ]
    if not rates:
        return 0.0
    alike = [r.shared_with if r.outcome is Outcome.SHARED and r.shared_with is not None else r.piece for r in records]
    groups: dict[int, list[int]] = {}
    for index, bucket in enumerate(plan.buckets):
        groups.setdefault(bucket.piece, []).append(index)
    kept = deferred.config.reuse
    distinct = {tuple(alike[i] for i in held): held for held in groups.values() if not (kept and len(held) == 1)}
    nodes = sum(first.buckets[i].node_count for held in distinct.values() for i in held)
    return _BACKWARD_TOO * min(rates) * nodes


def _paid_back(plan: SplitPlan, deferred: _Deferred) -> SplitPlan:
    """``plan``, or one piece per bucket (as compiled) when ``plan``'s predicted saving per
    step would not pay for its compile within :data:`PAYBACK_STEPS` steps."""
    count = len(plan.buckets)
    if plan.sizing is None or len(plan.pieces) == count:
        return plan
    saving = plan.sizing.one_per_bucket_s - plan.sizing.predicted_s
    compile_s = _recompile_s(deferred, plan)
    if saving * PAYBACK_STEPS >= compile_s:
        return plan
    payback = Payback(len(plan.pieces), max(0.0, saving), compile_s)
    sizing = dataclasses.replace(plan.sizing, predicted_s=plan.sizing.one_per_bucket_s)
    buckets = tuple(dataclasses.replace(b, piece=i) for i, b in enumerate(plan.buckets))
    return dataclasses.replace(plan, buckets=buckets, sizing=sizing, payback=payback)


def _ddp_optimizer_piece_plan(gm: fx.GraphModule, config: SplitConfig, graph_name: str) -> SplitPlan:
    count = sum(1 for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output"))
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
            split = split_graph(gm, planned.layout, plan.cuts)
        compiled = compile_pieces(split, example_inputs, inner, times, reuse=config.reuse)
        if not planned.measures_link:
            return self._finish(plan, split, gm, compiled, times)
        measuring = f"re-planned once its first {STEPS_BEFORE_REPLAN} training steps are measured"
        fn = self._finish(plan, split, gm, compiled, times, then=measuring)
        deferred = _Deferred(
            gm, _frame_fakes(gm, example_inputs), dataclasses.replace(planned, ddp_module=None), config, inner,
            _torch.TracingContext.try_get(), split, compiled,
        )
        return _measuring(fn, planned.ddp_module, deferred, functools.partial(self._replan, deferred))

    def _replan(
        self, deferred: _Deferred, measured: Measurement | Declined, ddp: torch.nn.Module | None
    ) -> Callable[..., Any] | None:
        """Group the buckets by what the first steps measured (Note [Measuring the link] in
        regroup.py), or by the static estimate when they could not be measured, as the first
        rank of ``ddp``'s group did (Note [One plan for every rank] in agree.py): the new
        pieces' callable, or ``None`` when the pieces as compiled (one per bucket) stay."""
        planned, config = deferred.planned, deferred.config
        assert planned.costs is not None  # measured graphs are sized by cost
        times = StageTimes()
        with times.measure("plan"):
            if isinstance(measured, Measurement) and measured.partial and measured.worth_a_cut(planned.costs.fixed_s):
                measured = Declined.PART_OF_THE_MODEL
            if isinstance(measured, Declined):
                summary_log.info("ddp_split: %s not measured, grouped by the static estimate: %s",
                                 planned.plan.graph_name, measured.value)
                costs = dataclasses.replace(
                    planned.costs, link_bytes_per_s=None,
                    link_source=f"not measured ({measured.value}); assumed as long as each bucket's backward",
                )
            else:
                spans = [(b.start, b.stop) for b in planned.plan.buckets]
                costs = measured.cost_inputs(planned.costs.node_backward_s, spans, planned.costs.fixed_s, BACKWARD_SHARE)
            plan = plan_buckets(
                planned.layout, planned.params, planned.caps, graph_name=f"{planned.plan.graph_name} re-planned",
                costs=costs,
            )
            plan = _paid_back(plan, deferred)
            grouping, leader = agreed_grouping(ddp, deferred.gm.code, [b.piece for b in plan.buckets])
            if leader is not None:
                plan = plan.regrouped(grouping, f"grouping of rank {leader}, which decides for every rank")
        if len(plan.pieces) == len(plan.buckets):
            self._finish(plan, deferred.split, deferred.gm, deferred.compiled, times, recompiled=False)
            return None
        with times.measure("split"):
            split = split_graph(deferred.gm, planned.layout, plan.cuts)
        context = _torch.tracing(deferred.context) if deferred.context is not None else contextlib.nullcontext()
        pieces = f"{len(plan.pieces)} piece" + ("s" if len(plan.pieces) > 1 else "")
        summary_log.info("ddp_split: %s: compiling %s for %d DDP buckets (training waits for it)",
                         plan.graph_name, pieces, len(plan.buckets))
        with context, preserve_global_state(), _torch.backward_compiled_with_forward():
            compiled = compile_pieces(
                split, deferred.example_inputs, deferred.inner, times, reuse=config.reuse, keep=deferred.compiled
            )
        return self._finish(plan, split, deferred.gm, compiled, times)

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
        *,
        recompiled: bool = True,
        then: str = "",
    ) -> Callable[..., Any]:
        """Record and log what was done (``recompiled``, ``then``: see
        :func:`diagnostics.summary_line`); wrap the callables for run time."""
        compile_id = _compile_id()
        backward = (
            BackwardCompile() if plan.whole is WholeReason.NO_BACKWARD
            else watch(compile_id, functools.partial(log_backward_compiled, plan.graph_name))
        )
        record = CompileRecord(plan, compiled.records, times, compile_id, backward)
        self.records.append(record)
        log_compiled(plan, split, record.pieces, times, recompiled=recompiled, then=then)
        if split is not None:
            return StitchedCallable(split, compiled.callables, record.compiled_by)
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
