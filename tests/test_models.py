"""Model shapes DDP users train, where torch's DDPOptimizer is known to break."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint

from ddp_split_backend import DDPSplitBackend, Outcome, SplitConfig, WholeReason
from ddp_split_backend.guards import GlobalState

from .helpers import TINY, CountingCompiler, assert_grads_equal, take_grads
from .models import MLP, WithBatchNorm



def _backend(counting: CountingCompiler, **extra) -> DDPSplitBackend:
    return DDPSplitBackend(SplitConfig(inner=counting, **{**TINY, **extra}))


def _check_eager_equal(model: nn.Module, inputs, backend, *, backward=True, atol=None):
    torch.manual_seed(0)
    compiled = torch.compile(model, backend=backend)
    expected = model(*inputs)
    if backward:
        expected.sum().backward()
    expected_grads = take_grads(model)
    actual = compiled(*inputs)
    tol = {} if atol is None else {"atol": atol, "rtol": atol}
    torch.testing.assert_close(actual, expected, **tol)
    if backward:
        actual.sum().backward()
        assert_grads_equal(model, expected_grads, **tol)
    return actual


class Checkpointed(nn.Module):
    def __init__(self, width=32):
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(4)])

    def forward(self, x):
        for i, block in enumerate(self.blocks):
            if i % 2:
                x = checkpoint.checkpoint(lambda t, b=block: torch.tanh(b(t)), x, use_reentrant=False)
            else:
                x = torch.tanh(block(x))
        return x


def test_activation_checkpoint(counting) -> None:
    backend = _backend(counting)
    _check_eager_equal(Checkpointed(), [torch.randn(4, 32)], backend)
    assert counting.count == len(backend.records[-1].plan.pieces) >= 3


class FlexAttention(nn.Module):
    def __init__(self, width=16, heads=2):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.mlp = nn.Linear(width, width)

    def forward(self, x):
        from torch.nn.attention.flex_attention import flex_attention

        b, t, c = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)

        def score_mod(score, b_, h, q_idx, kv_idx):
            return torch.where(q_idx >= kv_idx, score, -float("inf"))

        y = flex_attention(q, k, v, score_mod=score_mod)
        y = self.out(y.transpose(1, 2).reshape(b, t, c))
        return self.mlp(y)


def test_flex_attention_score_mod(counting) -> None:
    """flex_attention has no CPU backward in torch 2.13, and refuses inputs that require grad:
    forward only, under no_grad, where the graph is one piece (nothing to overlap). Its
    several buckets would be cut with grad on (``score_mod``'s body copied into the piece
    that needs it is covered by the activation-checkpoint cases)."""
    backend = _backend(counting)
    with torch.no_grad():
        _check_eager_equal(FlexAttention(), [torch.randn(2, 8, 16)], backend, backward=False, atol=1e-4)
    plan = backend.records[-1].plan
    assert counting.count == 1 and len(plan.buckets) >= 2 and plan.whole is WholeReason.NO_BACKWARD


def test_a_graph_compiled_without_grad_is_one_piece_and_says_why(counting) -> None:
    backend = _backend(counting)
    model = MLP(width=32, depth=4)
    with torch.no_grad():
        _check_eager_equal(model, [torch.randn(2, 32)], backend, backward=False)
    plan = backend.records[-1].plan
    assert len(plan.buckets) >= 2 and len(plan.pieces) == 1 and counting.count == 1, plan.table()
    assert plan.whole is WholeReason.NO_BACKWARD and WholeReason.NO_BACKWARD.value in plan.table()


class WithMHA(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        x = self.inp(x)
        y, _ = self.attn(x, x, x, need_weights=False)
        return self.out(y)


def test_multihead_attention(counting) -> None:
    backend = _backend(counting)
    _check_eager_equal(WithMHA(), [torch.randn(2, 5, 16)], backend, atol=1e-5)
    assert len(backend.records[-1].plan.buckets) >= 2


class WithVmap(nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)

    def forward(self, x):
        x = self.a(x)
        x = torch.vmap(lambda row: torch.tanh(self.b(row)) * 2)(x)
        return self.c(x)


def test_vmap_region_is_never_cut(counting) -> None:
    backend = _backend(counting)
    _check_eager_equal(WithVmap(), [torch.randn(4, 16)], backend, atol=1e-5)
    plan = backend.records[-1].plan
    assert len(plan.buckets) >= 2
    for gm in counting.graphs:  # each piece holds a whole vmap region or none of it
        names = [getattr(n.target, "__name__", "") for n in gm.graph.nodes]
        assert sum("increment_nesting" in n for n in names) == sum("decrement_nesting" in n for n in names)


def test_batchnorm_buffers_match_eager(counting) -> None:
    torch.manual_seed(0)
    model = WithBatchNorm()
    reference = WithBatchNorm()
    reference.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend=_backend(counting))
    for step in range(3):
        x = torch.randn(8, 16) + step
        torch.testing.assert_close(compiled(x), reference(x))
    for name, buffer in reference.named_buffers():
        torch.testing.assert_close(dict(model.named_buffers())[name], buffer, msg=name)
    assert counting.count >= 3


def test_dynamic_batch_with_mark_dynamic_compiles_once(counting) -> None:
    backend = _backend(counting)
    model = MLP(width=16, depth=4)
    compiled = torch.compile(model, backend=backend)
    for batch in (3, 5, 9, 17):
        x = torch.randn(batch, 16)
        torch._dynamo.mark_dynamic(x, 0)
        torch.testing.assert_close(compiled(x), model(x))
    assert len(backend.records) == 1
    assert counting.count == len(backend.records[0].plan.buckets) >= 3


def test_symint_sizes_cross_pieces(counting) -> None:
    class Reshaper(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):
            n = x.shape[0]
            y = self.a(x)
            return self.b(y).reshape(n * 2, 4).sum(1)

    backend = _backend(counting)
    model = Reshaper()
    compiled = torch.compile(model, backend=backend, dynamic=True)
    for batch in (2, 3, 7):
        x = torch.randn(batch, 8)
        torch.testing.assert_close(compiled(x), model(x))
    assert len(backend.records) == 1 and len(backend.records[0].plan.buckets) == 2


class Unbacked(nn.Module):
    def __init__(self, pattern: str):
        super().__init__()
        self.pattern = pattern
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.c = nn.Linear(8, 8)

    def forward(self, x, counts):
        h = self.a(x)
        if self.pattern == "item":
            k = counts.sum().item()
            torch._check_is_size(k)
            torch._check(k <= h.shape[0])
            h = self.b(h)
            return self.c(h[:k]).sum(0)
        if self.pattern == "tolist":
            first, second = counts.tolist()[:2]
            torch._check_is_size(first)
            torch._check(first <= h.shape[0])
            h = self.b(h)
            return self.c(h.narrow(0, 0, first)).sum(0) + second
        if self.pattern == "nonzero":
            idx = torch.nonzero(counts)
            h = self.b(h)
            picked = h[idx.squeeze(1) % h.shape[0]]
            return self.c(picked).sum(0)
        raise ValueError(self.pattern)


@pytest.mark.parametrize("pattern", ["item", "tolist", "nonzero"])
def test_unbacked_symbols_defined_in_one_piece_used_in_another(counting, pattern) -> None:
    torch._dynamo.config.capture_scalar_outputs = True
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    backend = _backend(counting)
    model = Unbacked(pattern)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    x = torch.randn(6, 8)
    counts = torch.tensor([1, 2, 0, 1])
    torch.testing.assert_close(compiled(x, counts), model(x, counts))
    assert len(backend.records) == 1
    plan = backend.records[0].plan
    assert len(plan.buckets) >= 2, plan.table()
    assert not backend.records[0].failures


def test_inner_failure_on_one_piece_runs_it_eagerly(counting) -> None:
    failing = CountingCompiler(fail_on={1})
    backend = DDPSplitBackend(SplitConfig(inner=failing, **TINY))
    model = MLP(width=16, depth=4)
    with pytest.warns(UserWarning, match=r"failed on piece 1 of 4.*planned failure"):
        _check_eager_equal(model, [torch.randn(3, 16)], backend)
    record = backend.records[-1]
    assert record.pieces[1].outcome is Outcome.EAGER_FALLBACK
    assert str(record.pieces[1].error) == "RuntimeError: planned failure on piece 1"
    assert "Traceback" in record.pieces[1].error.traceback
    assert [(r.outcome, r.backend) for i, r in enumerate(record.pieces) if i != 1] == [
        (Outcome.COMPILED, failing.__name__)
    ] * 3
    assert [f.piece for f in record.failures] == [1]


def test_runtime_error_names_the_piece_and_restores_state(counting) -> None:
    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x, index):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.a(x)
                with torch.no_grad():
                    h = self.b(h)
                    return torch.index_select(h, 0, index)

    backend = DDPSplitBackend(SplitConfig(inner="eager", **TINY))
    compiled = torch.compile(Fails(), backend=backend)
    compiled(torch.randn(4, 8), torch.tensor([0, 1]))
    before = GlobalState.capture()
    with pytest.raises(Exception) as info:
        compiled(torch.randn(4, 8), torch.tensor([0, 99]))
    assert any("ddp_split piece" in note for note in getattr(info.value, "__notes__", []))
    assert GlobalState.capture() == before  # grad mode, autocast, inference mode, dispatch keys, ...
    assert torch.ones(3).sum().item() == 3.0


class Repeated(nn.Module):
    """Identical residual blocks: identical pieces, compiled once."""

    def __init__(self, width: int = 32, depth: int = 6) -> None:
        super().__init__()
        self.linears = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.norms = nn.ModuleList([nn.LayerNorm(width) for _ in range(depth)])

    def forward(self, x):
        for linear, norm in zip(self.linears, self.norms):
            x = x + F.gelu(norm(linear(x)))
        return x


@pytest.mark.parametrize("reuse", [True, False], ids=["reuse", "no_reuse"])
def test_identical_pieces_compile_once_and_stay_correct(reuse: bool) -> None:
    counting = CountingCompiler()
    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner=counting, reuse_identical_pieces=reuse,
                                          bucket_cap_mb=0.004, first_bucket_cap_mb=0.004))
    model = Repeated()  # one block (4,224 + 256 bytes) per piece
    for _ in range(2):  # the second step runs the shared backward again
        model.zero_grad(set_to_none=True)
        _check_eager_equal(model, [torch.randn(4, 32)], backend, atol=1e-5)
    record = backend.records[-1]
    assert len(record.plan.buckets) == 6 and len(backend.records) == 1
    shared = [r for r in record.pieces if r.outcome is Outcome.SHARED]
    if reuse:
        assert counting.count < 6 and len(shared) == 6 - counting.count
    else:
        assert counting.count == 6 and not shared


class FrozenTrunk(nn.Module):
    """Layers run under no_grad, then trainable layers of the same shape: the pieces look
    alike but only the last ones record autograd."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.trunk = nn.ModuleList([nn.Linear(width, width) for _ in range(3)])
        self.head = nn.Linear(width, width)

    def forward(self, x):
        with torch.no_grad():
            for layer in self.trunk:
                x = layer(x)
        return self.head(x)


def test_pieces_alike_but_in_other_grad_mode_are_not_shared() -> None:
    counting = CountingCompiler()
    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner=counting, reuse_identical_pieces=True,
                                          bucket_cap_mb=0.0001, first_bucket_cap_mb=0.0001))
    _check_eager_equal(FrozenTrunk(), [torch.randn(2, 8)], backend)
    record = backend.records[-1]
    assert len(record.plan.buckets) == 4, record.plan.table()
    assert record.pieces[-1].outcome is not Outcome.SHARED, record.compiled_by
    assert any(r.outcome is Outcome.SHARED for r in record.pieces[:-1]), record.compiled_by


def test_reuse_defaults_on_for_backend_names_only() -> None:
    assert SplitConfig(inner="aot_eager").reuse
    assert not SplitConfig(inner=lambda gm, inputs: gm.forward).reuse
