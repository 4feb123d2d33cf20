"""Faults: the inner backend failing on pieces, pieces raising at run time inside state
regions, a compile torch itself cannot do inside inference mode, and bad option
combinations. Each must leave correct results or a clear error, the global state as it was,
and a process that keeps working."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn

from ddp_split_backend import DDPSplitBackend, SplitConfig
from ddp_split_backend import Outcome, _torch
from ddp_split_backend.guards import AutogradCheckpoint, GlobalState, attempt

from .helpers import TINY, CountingCompiler, assert_grads_equal, leak_nested_inference_guards_and_raise, take_grads
from .models import MLP, StateRegions



def _assert_process_usable() -> None:
    """Ordinary tensor ops, module construction and a fresh plain compile all still work."""
    assert torch.ones(3).sum().item() == 3.0
    nn.Linear(2, 2)(torch.ones(1, 2)).sum().backward()
    assert not torch.is_inference_mode_enabled()
    assert torch.is_grad_enabled()
    assert not torch.is_autocast_enabled("cpu")

    def fresh(t: torch.Tensor) -> torch.Tensor:
        return torch.sin(t) * 2 + 1

    t = torch.linspace(0, 1, 5)
    torch.testing.assert_close(torch.compile(fresh, backend="aot_eager")(t), fresh(t))


def _failure_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if "failed on piece" in str(w.message)]


# ---------------------------------------------------------------------------------------
# The inner backend raises on some pieces
# ---------------------------------------------------------------------------------------

MODELS = {
    "mlp": lambda: MLP(width=16, depth=4),
    "autocast": lambda: StateRegions(width=8, kind="autocast"),
    "inference": lambda: StateRegions(width=8, kind="inference"),
    "dual": lambda: StateRegions(width=8, kind="dual"),
    "no_grad": lambda: StateRegions(width=8, kind="grad"),
}
WHERE = ("first", "middle", "last", "every")


def _pieces(make_model, x: torch.Tensor, options: dict = TINY) -> tuple[int, set[int]]:
    """How many pieces the model splits into, and which of them AOTAutograd itself cannot
    compile (they run eagerly)."""
    backend = DDPSplitBackend(SplitConfig(inner="aot_eager", **options))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.compile(make_model(), backend=backend)(x)
    assert len(backend.records) == 1
    (record,) = backend.records
    torch._dynamo.reset()  # also clears backend.records
    natural = {r.piece for r in record.pieces if r.outcome is Outcome.EAGER_FALLBACK}
    return len(record.plan.buckets), natural


def _fail_on(where: str, count: int) -> set:
    return {"first": {0}, "middle": {count // 2}, "last": {count - 1}, "every": {"all"}}[where]


@pytest.mark.parametrize("where", WHERE, ids=str)
@pytest.mark.parametrize("model_name", sorted(MODELS), ids=str)
def test_inner_failure_falls_back_per_piece(model_name: str, where: str) -> None:
    make_model = MODELS[model_name]
    x = torch.randn(4, 16 if model_name == "mlp" else 8)
    count, natural = _pieces(make_model, x)
    assert count >= 3, f"{model_name}: want cuts at first/middle/last, got {count} pieces"
    # Only inference_mode under autograd, on releases whose AOTAutograd cannot compile it.
    assert not natural or (model_name == "inference" and not _torch.aot_compiles_inference_mode_under_autograd())
    fail_on = _fail_on(where, count)
    planned = set(range(count)) if "all" in fail_on else fail_on
    failing_pieces = planned | natural

    torch.manual_seed(0)
    model = make_model()
    expected = model(x)
    expected.sum().backward()
    expected_grads = take_grads(model)

    failing = CountingCompiler(fail_on=fail_on)
    backend = DDPSplitBackend(SplitConfig(inner=failing, **TINY))
    compiled = torch.compile(model, backend=backend)
    before = GlobalState.capture()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = compiled(x)
    assert GlobalState.capture() == before

    messages = _failure_warnings(caught)
    assert len(messages) == len(failing_pieces), messages
    named = sorted(int(re.search(r"failed on piece (\d+) of", m).group(1)) for m in messages)
    assert named == sorted(failing_pieces)
    assert all(f"of {count}" in m for m in messages)
    assert sum("planned failure" in m for m in messages) == len(planned)
    record = backend.records[-1]
    assert [r.piece for r in record.pieces if r.outcome is Outcome.EAGER_FALLBACK] == sorted(failing_pieces)
    assert sorted(f.piece for f in record.failures) == sorted(failing_pieces)

    torch.testing.assert_close(actual, expected)
    assert actual.dtype == expected.dtype and actual.requires_grad == expected.requires_grad
    actual.sum().backward()
    assert_grads_equal(model, expected_grads)

    compiles = failing.count
    for _ in range(2):  # a second and a third call: no recompile, no new warning
        with warnings.catch_warnings(record=True) as again:
            warnings.simplefilter("always")
            torch.testing.assert_close(compiled(x), expected)
        assert not _failure_warnings(again)
        assert failing.count == compiles
        assert len(backend.records) == 1
    assert GlobalState.capture() == before
    _assert_process_usable()


# ---------------------------------------------------------------------------------------
# A piece raises at run time inside state regions
# ---------------------------------------------------------------------------------------


class IndexInRegion(nn.Module):
    """Layers inside a (nested) state region, then an ``index_select`` whose index is only
    out of range on a later call: the error comes from a late piece, inside the region."""

    def __init__(self, region: str, width: int = 8) -> None:
        super().__init__()
        self.region = region
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(4)])

    def _body(self, h: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[1](h))
        h = torch.tanh(self.layers[2](h))
        return torch.index_select(h, 0, index)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        h = self.layers[0](x)
        if self.region == "autocast":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self._body(h, index)
        elif self.region == "no_grad":
            with torch.no_grad():
                h = self._body(h, index)
        elif self.region == "inference":
            with torch.inference_mode():
                h = self._body(h, index)
            h = h.clone()
        elif self.region == "nested":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                with torch.no_grad():
                    with torch.inference_mode():
                        with torch.autocast("cpu", enabled=False):
                            h = self._body(h.float(), index)
            h = h.clone()
        elif self.region == "double_inference":  # guards must be exited innermost first
            with torch.inference_mode():
                h = torch.tanh(self.layers[1](h))
                with torch.inference_mode():
                    h = self._body(h, index)
            h = h.clone()
        else:
            raise ValueError(self.region)
        return self.layers[3](h.float())


@pytest.mark.parametrize("inner", ["aot_eager", "eager", "eager_fallback"], ids=str)
@pytest.mark.parametrize(
    "region", ["autocast", "no_grad", "inference", "double_inference", "nested"], ids=str
)
def test_runtime_error_in_region_names_piece_and_restores_state(region: str, inner: str) -> None:
    """``eager`` (torch's backend that returns the piece's own ``forward``) and the eager
    fallback run the piece's state nodes as Python: the regions they entered are exited,
    innermost first, when the piece raises."""
    compiler = inner if inner != "eager_fallback" else CountingCompiler(fail_on={"all"})
    backend = DDPSplitBackend(SplitConfig(inner=compiler, **TINY))
    torch.manual_seed(0)
    model = IndexInRegion(region)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 8)
    good, bad = torch.tensor([0, 3]), torch.tensor([0, 99])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager-fallback warnings are tested above
        torch.testing.assert_close(compiled(x, good), model(x, good))
    plan = backend.records[-1].plan
    assert len(plan.buckets) >= 3, plan.table()

    before = GlobalState.capture()
    with pytest.raises((IndexError, RuntimeError)) as info:
        compiled(x, bad)
    notes = getattr(info.value, "__notes__", [])
    piece_notes = [n for n in notes if "ddp_split piece" in n]
    assert len(piece_notes) == 1, notes
    match = re.search(r"ddp_split piece (\d+) of (\d+)", piece_notes[0])
    assert match and int(match.group(2)) == len(plan.buckets), piece_notes
    assert int(match.group(1)) >= 1, "the index_select sits behind the first cut"
    assert GlobalState.capture() == before
    _assert_process_usable()

    # The compiled model itself still works, without recompiling.
    torch.testing.assert_close(compiled(x, good), model(x, good))
    assert len(backend.records) == 1
    assert GlobalState.capture() == before


@pytest.mark.parametrize("region", ["double_inference", "nested"], ids=str)
def test_runtime_error_in_unsplit_graph_run_by_eager_backend_restores_state(region: str) -> None:
    """One piece (a cap larger than the model), inner ``eager``: the whole graph runs as
    Python; the inference-mode guards it entered are exited when it raises."""
    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner="eager", bucket_cap_mb=100))
    model = IndexInRegion(region)
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 8)
    torch.testing.assert_close(compiled(x, torch.tensor([1])), model(x, torch.tensor([1])))
    assert len(backend.records[-1].plan.buckets) == 1
    before = GlobalState.capture()
    with pytest.raises((IndexError, RuntimeError)):
        compiled(x, torch.tensor([99]))
    assert GlobalState.capture() == before
    _assert_process_usable()


# ---------------------------------------------------------------------------------------
# torch cannot compile the piece: a view of a graph input inside inference_mode
# ---------------------------------------------------------------------------------------


class DetachInputInInference(nn.Module):
    """``x.detach()`` of a graph input inside ``inference_mode``: AOTAutograd fails to trace
    it (plain ``torch.compile(backend="aot_eager")`` fails here, and torch leaves the process
    broken: "PythonDispatcherTLS was not set" on every later tensor op)."""

    def __init__(self, width: int = 8, nested: bool = False) -> None:
        super().__init__()
        self.nested = nested
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(4)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.layers[0](x))
        h = torch.tanh(self.layers[1](h))
        with torch.inference_mode():
            if self.nested:  # the failed trace leaves two guards: see AutogradCheckpoint
                with torch.inference_mode():
                    side = self.layers[2](x.detach()) * 2
            else:
                side = self.layers[2](x.detach()) * 2
        return self.layers[3](h + side.clone())


@pytest.mark.parametrize("nested", [False, True], ids=["single", "nested"])
@pytest.mark.parametrize("caps", ["split", "whole"], ids=str)
def test_inference_mode_compile_failure_falls_back_and_process_stays_usable(
    caps: str, nested: bool
) -> None:
    options = TINY if caps == "split" else {"min_piece_mb": None, "bucket_cap_mb": 25}
    _, natural = _pieces(lambda: DetachInputInInference(nested=nested), torch.randn(4, 8), options)
    # The detach fails on every release; 2.11 and 2.12 fail on every inference_mode piece.
    assert len(natural) == 1 or (len(natural) > 1 and not _torch.aot_compiles_inference_mode_under_autograd())
    counting = CountingCompiler()
    backend = DDPSplitBackend(SplitConfig(inner=counting, **options))
    torch.manual_seed(0)
    model = DetachInputInInference(nested=nested)
    x = torch.randn(4, 8)
    expected = model(x)
    expected.sum().backward()
    expected_grads = take_grads(model)

    compiled = torch.compile(model, backend=backend)
    before = GlobalState.capture()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        actual = compiled(x)
    assert GlobalState.capture() == before
    _assert_process_usable()

    messages = _failure_warnings(caught)
    record = backend.records[-1]
    assert len(messages) == len(natural), messages
    assert len(record.failures) == len(natural)
    assert {r.piece for r in record.pieces if r.outcome is Outcome.EAGER_FALLBACK} == natural
    if caps == "split":
        assert len(record.plan.buckets) >= 3, record.plan.table()
        still_compiled = [r for r in record.pieces if r.outcome is Outcome.COMPILED and r.backend == counting.__name__]
        assert len(still_compiled) >= 2  # the other pieces stay compiled
    torch.testing.assert_close(actual, expected)
    actual.sum().backward()
    assert_grads_equal(model, expected_grads)

    compiles = counting.count
    for _ in range(2):
        torch.testing.assert_close(compiled(x), expected)
    assert counting.count == compiles and len(backend.records) == 1
    assert GlobalState.capture() == before
    _assert_process_usable()


@pytest.mark.parametrize("ambient", ["grad", "no_grad", "inference"], ids=str)
def test_attempt_restores_autograd_state_leaked_out_of_order(ambient: str) -> None:
    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}
    with ctx[ambient]():
        torch._C._set_view_replay_enabled(True)
        try:
            before = GlobalState.capture()
            result = attempt(leak_nested_inference_guards_and_raise)
            assert not result.ok and result.value is None
            assert isinstance(result.error, RuntimeError) and str(result.error) == "trace failed"
            assert result.error.__traceback__ is not None  # kept for whoever reports it
            assert GlobalState.capture() == before
            assert torch._C._is_view_replay_enabled()

            with AutogradCheckpoint():  # taking one changes nothing
                assert GlobalState.capture() == before and torch._C._is_view_replay_enabled()
        finally:
            torch._C._set_view_replay_enabled(False)
    _assert_process_usable()


# ---------------------------------------------------------------------------------------
# Bad option combinations through torch.compile
# ---------------------------------------------------------------------------------------

BAD_COMBINATIONS = [
    (
        "first_above_cap",
        {"min_piece_mb": None, "inner": "aot_eager", "bucket_cap_mb": 1, "first_bucket_cap_mb": 2},
        ["'first_bucket_cap_mb'=2", "'bucket_cap_mb'=1", "Lower first_bucket_cap_mb"],
    ),
    (
        "first_above_small_cap",
        {"min_piece_mb": None, "bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.25},
        ["'first_bucket_cap_mb'=0.25", "'bucket_cap_mb'=0.001", "Lower first_bucket_cap_mb"],
    ),
    (
        "inner_is_ddp_split",
        {"min_piece_mb": None, "inner": "ddp_split", "bucket_cap_mb": 4, "first_bucket_cap_mb": 1},
        ["'inner'='ddp_split'", "split every piece again", "inner='aot_eager'"],
    ),
    (
        "inner_is_ddp_split_and_first_above_cap",
        {"min_piece_mb": None, "inner": "ddp_split", "bucket_cap_mb": 1, "first_bucket_cap_mb": 2},
        ["'inner'", "ddp_split", "inner='aot_eager'"],
    ),
]


@pytest.mark.parametrize(
    "options,fragments", [c[1:] for c in BAD_COMBINATIONS], ids=[c[0] for c in BAD_COMBINATIONS]
)
def test_bad_option_combination_through_torch_compile(options, fragments) -> None:
    before = GlobalState.capture()
    compiled = torch.compile(MLP(width=8, depth=2), backend="ddp_split", options=options)
    with pytest.raises(Exception) as info:
        compiled(torch.randn(2, 8))
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)
    assert GlobalState.capture() == before
    _assert_process_usable()


def test_bad_option_combination_is_rejected_before_compiling() -> None:
    counting = CountingCompiler()
    compiled = torch.compile(
        MLP(width=8, depth=2),
        backend="ddp_split",
        options={"min_piece_mb": None, "inner": counting, "bucket_cap_mb": 0.5, "first_bucket_cap_mb": 0.75},
    )
    with pytest.raises(Exception, match="first_bucket_cap_mb"):
        compiled(torch.randn(2, 8))
    assert counting.count == 0
    _assert_process_usable()
