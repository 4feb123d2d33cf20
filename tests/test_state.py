"""Every global-state kind Dynamo emits, with a cut inside its region: results equal eager,
the region is re-created inside the piece (so it holds at compile time too), and the state
after the call equals the state before."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

from ddp_split_backend import DDPSplitBackend, Outcome, SplitConfig, WholeReason, _torch
from ddp_split_backend.guards import GlobalState
from ddp_split_backend.state import StateKind, classify

from .helpers import AOT_FAILS_INFERENCE_MODE, assert_grads_equal, compare_with_eager_ddp, take_grads
from .models import StateRegions

STATE_TARGET_NAMES = {
    "grad": "_set_grad_enabled",
    "enable_grad": "_set_grad_enabled",
    "autocast": "_enter_autocast",
    "autocast_fp16": "_enter_autocast",
    "inference": "_enter_inference_mode",
    "dual": "_enter_dual_level",
    "fwd_grad_off": "_set_fwd_grad_enabled",
}


def _targets(gm) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target)) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("kind", sorted(STATE_TARGET_NAMES), ids=str)
@pytest.mark.parametrize("ambient_grad", [True, False], ids=["grad_on", "grad_off"])
def test_state_region_across_cut_matches_eager(request, world1, counting, kind: str, ambient_grad: bool) -> None:
    if kind == "inference":
        request.applymarker(pytest.mark.expects_fallback(AOT_FAILS_INFERENCE_MODE))
    torch._dynamo.config.optimize_ddp = False
    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner=counting, bucket_cap_mb=0.001, first_bucket_cap_mb=0.001))
    x = torch.randn(4, 32)
    before = GlobalState.capture()
    with torch.set_grad_enabled(ambient_grad):
        compare_with_eager_ddp(lambda: StateRegions(kind=kind), [x], backend=backend, bucket_cap_mb=0.001)
    assert GlobalState.capture() == before
    plan = backend.records[-1].plan
    assert len(plan.buckets) >= 3, plan.table()
    if not ambient_grad and kind != "enable_grad":  # no backward anywhere: nothing to overlap
        assert plan.whole is WholeReason.NO_BACKWARD and len(plan.pieces) == 1, plan.table()
        return
    # Some piece other than the one holding the region's entry re-creates the state itself.
    name = STATE_TARGET_NAMES[kind]
    if (kind, ambient_grad) in {("enable_grad", True), ("grad", False)}:
        return  # Dynamo drops the no-op state change: nothing to re-create
    holders = [i for i, gm in enumerate(counting.graphs) if name in _targets(gm)]
    assert len(holders) >= 2, (kind, [(_targets(g)) for g in counting.graphs])


def test_nested_autocast_cut_inside_inner_region_replays_both(counting) -> None:
    model = StateRegions(kind="autocast")
    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner=counting, bucket_cap_mb=0.001, first_bucket_cap_mb=0.001))
    x = torch.randn(4, 32)
    out = torch.compile(model, backend=backend)(x)
    expected = model(x)
    torch.testing.assert_close(out, expected)
    assert out.dtype == expected.dtype
    nested = [
        gm for gm in counting.graphs
        if sum(t == "_enter_autocast" for t in _targets(gm)) == 2
        and sum(t == "_exit_autocast" for t in _targets(gm)) == 2
    ]
    assert nested, "a piece cut inside the nested region must re-enter both autocast regions"
    for gm in counting.graphs:  # every piece is balanced: it leaves the ambient state
        targets = _targets(gm)
        assert targets.count("_enter_autocast") == targets.count("_exit_autocast")


def test_piece_state_holds_at_compile_time(counting) -> None:
    """The inner backend traces each piece on its own: autocast must be set inside it."""
    seen = []

    def tracing_inner(gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd

        def fw(g, inputs):
            seen.append([n.meta.get("val").dtype for n in g.graph.nodes
                         if n.op == "call_function" and "mm" in str(n.target) and "val" in n.meta])
            return g

        return aot_autograd(fw_compiler=fw)(gm, example_inputs)

    model = StateRegions(kind="autocast_fp16")
    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner=tracing_inner, bucket_cap_mb=0.001, first_bucket_cap_mb=0.001))
    torch.compile(model, backend=backend)(torch.randn(4, 32))
    dtypes = [d for piece in seen for d in piece]
    assert dtypes.count(torch.float16) == 3, dtypes  # the three layers inside the region


def test_ambient_autocast_is_respected(counting) -> None:
    model = StateRegions(kind="grad")
    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner=counting, bucket_cap_mb=0.001, first_bucket_cap_mb=0.001))
    compiled = torch.compile(model, backend=backend)
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = model(x)
        actual = compiled(x)
        assert torch.is_autocast_enabled("cpu")
    assert actual.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(actual, expected)
    assert not torch.is_autocast_enabled("cpu")


def test_classify_treats_unknown_state_calls_as_opaque() -> None:
    def _enter_custom_mode(): ...
    def _exit_custom_mode(token): ...

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    enter = graph.call_function(_enter_custom_mode)
    y = graph.call_function(torch.sin, (x,))
    graph.call_function(_exit_custom_mode, (enter,))
    graph.output(y)
    kinds = [classify(n) for n in graph.nodes]
    assert kinds[1].kind is StateKind.OPAQUE and kinds[3].kind is StateKind.OPAQUE
    assert kinds[2] is None


def test_unknown_state_region_blocks_cuts(counting) -> None:
    """A cut never falls between an unknown state call's enter and exit."""
    from ddp_split_backend.layout import layout_graph
    from ddp_split_backend.state import Ambient

    def _enter_custom_mode():
        return None

    def _exit_custom_mode(token):
        return None

    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.sin, (x,))
    enter = graph.call_function(_enter_custom_mode)
    b = graph.call_function(torch.cos, (a,))
    c = graph.call_function(torch.tan, (b,))
    graph.call_function(_exit_custom_mode, (enter,))
    d = graph.call_function(torch.exp, (c,))
    graph.output(d)
    layout = layout_graph(torch.fx.GraphModule(nn.Module(), graph), Ambient.capture())
    names = [n.name for n in layout.nodes]
    blocked = {names[i]: r for i, r in enumerate(layout.blocked)}
    assert blocked["cos"] is not None and blocked["tan"] is not None
    assert blocked["_exit_custom_mode"] is not None
    assert blocked["exp"] is None


class DualThroughMethod(nn.Module):
    """Fuzzer find: the dual tensor flows through a call_method (``.float()``), which the
    planner must still treat as dual, or the cut after it strips the tangent."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    def forward(self, x):
        import torch.autograd.forward_ad as fwAD

        x = self.layers[0](x.float())
        with fwAD.dual_level():
            d = fwAD.make_dual(x, torch.ones_like(x))
            d = self.layers[1](d.float())
            primal, tangent = fwAD.unpack_dual(d)
            x = primal + tangent
        return x


def test_regression_dual_tensor_through_call_method_is_not_cut() -> None:
    model = DualThroughMethod()
    x = torch.randn(4, 8)
    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner="aot_eager", bucket_cap_mb=0.0001, first_bucket_cap_mb=0.0001))
    with torch.no_grad():
        expected = model(x)
        actual = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(actual, expected)
    assert not backend.records[-1].failures
    from ddp_split_backend.guards import dual_level_open

    assert not dual_level_open()


class InferenceTensorEscapes(nn.Module):
    """Fuzzer find: a tensor made in inference mode is cloned and used with autograd after
    the region; a cut between would hand an inference tensor to an autograd-tracked piece."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        x = self.layers[0](x)
        with torch.inference_mode():
            h = self.layers[1](x)
            h = self.layers[2](h)
        h = h.clone()
        return self.layers[3](x * h)


def test_regression_piece_starting_in_inference_mode_falls_back_when_aot_cannot_run_it() -> None:
    """AOTAutograd compiles the piece that re-enters inference_mode but its first (fake) call
    saves an inference tensor for backward; that piece must run eagerly, not fail the frame."""
    model = InferenceTensorEscapes()
    x = torch.randn(4, 8)
    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner="aot_eager", bucket_cap_mb=0.0003, first_bucket_cap_mb=0.0003))
    expected = model(x)
    expected.sum().backward()
    want = take_grads(model)
    # 2.13+: AOTAutograd compiles the piece, then its fake call fails; 2.11/2.12: AOTAutograd
    # cannot compile inference_mode under autograd at all. Either way the piece runs eagerly.
    why = "Inference tensors cannot be saved" if _torch.aot_compiles_inference_mode_under_autograd() else "UntypedStorage"
    with pytest.warns(UserWarning, match=why):
        actual = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(actual, expected)
    actual.sum().backward()
    assert_grads_equal(model, want)
    record = backend.records[-1]
    assert len(record.plan.pieces) == 2
    # 2.11/2.12: the first piece holds the inference_mode region too, and runs eagerly as well.
    first = Outcome.COMPILED if _torch.aot_compiles_inference_mode_under_autograd() else Outcome.EAGER_FALLBACK
    # 2.11/2.12 may compile or fall back on the first piece, as the cut falls.
    assert record.pieces[-1].outcome is Outcome.EAGER_FALLBACK
    if first is Outcome.COMPILED:
        assert record.pieces[0].outcome is Outcome.COMPILED


class EnableGradInsideNoGrad(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])

    def forward(self, x):
        with torch.no_grad():
            with torch.enable_grad():
                for layer in self.layers:
                    x = layer(x.float())
        return x


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no_reuse"])
def test_regression_enable_grad_under_ambient_no_grad_keeps_the_autograd_chain(reuse: bool) -> None:
    """Fuzzer find: with grad mode off outside and on inside, pieces must be compiled and
    called with autograd on, and a shared piece's outputs must still carry history."""
    model = EnableGradInsideNoGrad()
    x = torch.randn(8, 8)
    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner="aot_eager", bucket_cap_mb=0.0001,
                                          first_bucket_cap_mb=0.0001, reuse_identical_pieces=reuse))
    with torch.no_grad():
        expected = model(x)
        actual = torch.compile(model, backend=backend)(x)
        assert not torch.is_grad_enabled()
    expected.sum().backward()
    want = take_grads(model)
    actual.sum().backward()
    torch.testing.assert_close(actual, expected)
    assert_grads_equal(model, want)
    assert len(backend.records[-1].plan.buckets) == 4
    assert any(r.outcome is Outcome.SHARED for r in backend.records[-1].pieces) == reuse


def _toggle_graph(calls: int) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(torch.sin, (x,))
    for _ in range(calls):
        graph.call_function(torch.set_printoptions, (), {"precision": 4})  # a torch set_* call, result unused
    b = graph.call_function(torch.cos, (a,))
    c = graph.call_function(torch.tan, (b,))
    graph.output(c)
    return torch.fx.GraphModule(nn.Module(), graph)


def test_an_unpaired_setter_that_blocks_every_later_cut_is_a_warning_naming_it() -> None:
    from ddp_split_backend.layout import layout_graph
    from ddp_split_backend.state import Ambient

    with pytest.warns(UserWarning, match=r"set_printoptions.*no second call undoes.*one piece") as caught:
        layout = layout_graph(_toggle_graph(1), Ambient.capture())
    assert len([w for w in caught if "set_printoptions" in str(w.message)]) == 1
    names = [n.name for n in layout.nodes]
    blocked = {names[i]: r for i, r in enumerate(layout.blocked)}
    assert blocked["cos"] is not None and blocked["tan"] is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        layout = layout_graph(_toggle_graph(2), Ambient.capture())  # paired: a region, no warning
    assert layout.blocked[[n.name for n in layout.nodes].index("tan")] is None
