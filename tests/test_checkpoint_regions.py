"""Activation-checkpoint regions cut at DDP's bucket boundaries (Note [Cutting checkpoint
regions] in regions.py): the plan, the memory budget, exactness of every structure a region
can hold, and 2-rank training against eager DDP with the buckets going out during backward."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import ddp_split_backend
from ddp_split_backend import _torch
from ddp_split_backend import DDPSplitBackend, RegionOutcome, SplitConfig, SplitConfigError

from .checkpoint_cases import SAVE_MATMULS, Mixed, SixLayers
from .helpers import assert_grads_equal, take_grads
from .multiproc import run_ranks

WIDTH = 128
LAYER_MB = (WIDTH * WIDTH + WIDTH) * 4 / 2**20
"""One layer's gradients: at this cap every layer is a bucket of its own."""


def _layers(n: int = 6) -> nn.ModuleList:
    return nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(n))


class _Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = _layers()

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.layers[3](torch.tanh(self.layers[2](x))))

    def body(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.layers[1](torch.tanh(self.layers[0](x))))
        x = checkpoint(self.inner, x, use_reentrant=False)
        return torch.tanh(self.layers[5](torch.tanh(self.layers[4](x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, x, use_reentrant=False).sum()


class _Outputs(nn.Module):
    """A region with three outputs, one made early and read after the region; checkpoint's
    own keywords set."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = _layers()

    def body(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        a = torch.tanh(self.layers[0](x))
        b = torch.tanh(self.layers[2](torch.tanh(self.layers[1](a))))
        e = torch.tanh(self.layers[4](torch.tanh(self.layers[3](b)) + a))
        return a, e, torch.tanh(self.layers[5](e))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, e, f = checkpoint(self.body, x, use_reentrant=False, determinism_check="none", preserve_rng_state=True)
        return a.sum() + e.mean() + f.sum()


class _Dropout(SixLayers):
    def __init__(self) -> None:
        super().__init__(width=WIDTH, dropout=0.2)


class _Reentrant(SixLayers):
    """``use_reentrant=True``: Dynamo traces it as the same region (its implementation runs
    every traced region non-reentrantly)."""

    def __init__(self) -> None:
        super().__init__(width=WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.body, torch.tanh(self.stem(x)), use_reentrant=True).square().mean()


STRUCTURES = {
    "dropout": (_Dropout, 7),
    "autocast_no_grad_sac_two_regions": (Mixed, 6),
    "nested": (_Nested, 5),  # a nested region is one node of the outer body: its two buckets share a piece
    "several_outputs": (_Outputs, 6),
    "reentrant": (_Reentrant, 7),
}


def _compile_and_compare(model: nn.Module, steps: int = 2, **options) -> DDPSplitBackend:
    """Train ``model`` compiled and an eager copy on the same inputs and random seeds; the
    gradients must match (aot_eager: to 1e-5)."""
    reference = copy.deepcopy(model)
    backend = DDPSplitBackend(SplitConfig(bucket_cap_mb=LAYER_MB, first_bucket_cap_mb=LAYER_MB, **options))
    compiled = torch.compile(model, backend=backend)
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        x = torch.randn(16, WIDTH, generator=gen, requires_grad=True)
        for m, run in ((model, compiled), (reference, reference)):
            torch.manual_seed(step)
            run(x).backward()
    tol = {"rtol": 1e-5, "atol": 1e-5} if options.get("inner") == "aot_eager" else {"rtol": 2e-3, "atol": 2e-3}
    assert_grads_equal(model, take_grads(reference), **tol)
    return backend


@pytest.mark.parametrize("structure", list(STRUCTURES))
def test_each_structure_is_exact_when_cut(structure: str) -> None:
    build, pieces = STRUCTURES[structure]
    torch.manual_seed(0)
    backend = _compile_and_compare(build(), inner="aot_eager", split_checkpoints="always")
    plan = backend.records[-1].plan
    assert len(plan.pieces) == pieces, plan.table()
    assert plan.regions and all(r.outcome is RegionOutcome.CUT for r in plan.regions if r.before), plan.table()
    assert sum(len(r.before) for r in plan.regions) >= pieces - 2, plan.table()


def test_every_part_carries_the_selective_checkpointing_policy() -> None:
    """Dynamo keeps a ``context_fn`` on the region's body; every part's body has it."""
    seen: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, example_inputs):  # a callable inner backend: sees every piece
        seen.append(gm)
        return gm.forward

    torch.manual_seed(0)
    backend = DDPSplitBackend(SplitConfig(inner=keep, bucket_cap_mb=LAYER_MB, first_bucket_cap_mb=LAYER_MB,
                                          split_checkpoints="always"))
    torch.compile(Mixed(), backend=backend)(torch.randn(16, WIDTH)).backward()
    bodies = [
        getattr(gm, str(node.args[0].target))
        for gm in seen for node in gm.graph.nodes
        if node.op == "call_function" and "tag_activation_checkpoint" in str(node.target)
    ]
    policies = [b.meta.get(_torch.CHECKPOINT_POLICY_KEY) for b in bodies]
    with_policy = [p for p in policies if p is not None]
    assert len(bodies) == 6 and len(with_policy) == 5, policies  # five parts of the first region, the second has none
    assert all(p.func is SAVE_MATMULS.func and p.args == SAVE_MATMULS.args for p in with_policy), with_policy


class _Blocks(nn.Module):
    """Three identical blocks, each a checkpoint region over two layers (a bucket each)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = _layers()

    def block(self, x: torch.Tensor, first: nn.Linear, second: nn.Linear) -> torch.Tensor:
        return x + torch.tanh(second(torch.tanh(first(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(0, 6, 2):
            x = checkpoint(self.block, x, self.layers[i], self.layers[i + 1], use_reentrant=False)
        return x.square().mean()


def test_parts_of_identical_blocks_share_one_compile() -> None:
    """The parts of repeated blocks are pieces with the same ops (their bodies compared by
    their graphs): compiled once, as identical pieces without regions are."""
    from ddp_split_backend import Outcome

    torch.manual_seed(0)
    backend = _compile_and_compare(_Blocks(), inner="aot_eager")
    record = backend.records[-1]
    assert len(record.plan.pieces) == 6 and all(len(r.before) == 1 for r in record.plan.regions), record.plan.table()
    assert sum(p.outcome is Outcome.SHARED for p in record.pieces) >= 3, [p.outcome for p in record.pieces]


def test_inductor_replays_dropout_and_autocast_in_each_region() -> None:
    import torch._inductor.config as inductor_config

    torch.manual_seed(0)
    with inductor_config.patch(fallback_random=True):  # inductor's masks from eager's generator
        backend = _compile_and_compare(Mixed(), split_checkpoints="always")
    assert len(backend.records[-1].plan.pieces) == 6


def test_default_cuts_the_six_layer_region_within_its_budget() -> None:
    torch.manual_seed(0)
    backend = _compile_and_compare(SixLayers(width=WIDTH), inner="aot_eager")
    plan = backend.records[-1].plan
    (region,) = plan.regions
    assert region.outcome is RegionOutcome.CUT and len(region.before) == 5
    assert len(plan.pieces) == 7 and len(plan.buckets) == 7
    # Five cuts keep five 16 x 128 activations; checkpointing saves far more.
    assert region.extra_bytes == 5 * 16 * WIDTH * 4
    assert region.extra_bytes <= region.allowed_bytes == int(0.5 * (region.unrolled_bytes - region.kept_whole_bytes))
    assert "1 checkpoint region cut into 6" in plan.summary()
    assert "cut into 6 regions (before linear_1, " in plan.table(width=400)


@pytest.mark.parametrize(
    ("options", "outcome", "cuts", "pieces"),
    [
        ({"split_checkpoints": "never"}, RegionOutcome.WHOLE_NEVER, 0, 2),
        ({"checkpoint_budget": 0.0}, RegionOutcome.WHOLE_BUDGET, 0, 2),
        ({"checkpoint_budget": 0.1}, RegionOutcome.PARTLY_CUT, 1, 3),
        ({"split_checkpoints": "always", "checkpoint_budget": 0.0}, RegionOutcome.CUT, 5, 7),
        ({"min_piece_mb": 2.5 * LAYER_MB}, RegionOutcome.PARTLY_CUT, 1, 3),
        ({"min_piece_mb": 100.0}, RegionOutcome.WHOLE_GROUPED, 0, 1),
    ],
    ids=["never", "no_budget", "small_budget", "always", "grouped_pieces", "one_piece"],
)
def test_options_and_budget_decide_the_cuts(options, outcome, cuts, pieces) -> None:
    torch.manual_seed(0)
    backend = _compile_and_compare(SixLayers(width=WIDTH), steps=1, inner="aot_eager", **options)
    plan = backend.records[-1].plan
    (region,) = plan.regions
    assert (region.outcome, len(region.before), len(plan.pieces)) == (outcome, cuts, pieces), plan.table()
    assert region.describe() in plan.table(width=10_000)
    if region.allowed_bytes is not None:
        assert region.extra_bytes <= region.allowed_bytes


def test_saved_bytes_grow_by_the_planned_activations_only() -> None:
    """Bytes the compiled pieces save for backward, counted by a pack hook on a training
    step after the compile: cut at every boundary, the region keeps what the plan says more."""
    saved = {}
    for policy in ("never", "always"):
        torch.manual_seed(0)
        model = SixLayers(width=WIDTH)
        backend = DDPSplitBackend(SplitConfig(inner="aot_eager", bucket_cap_mb=LAYER_MB, split_checkpoints=policy))
        compiled = torch.compile(model, backend=backend)
        x = torch.randn(16, WIDTH)
        compiled(x).backward()
        count = [0]

        def pack(t: torch.Tensor, count=count) -> torch.Tensor:
            if not isinstance(t, nn.Parameter):
                count[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = compiled(x)
        loss.backward()
        saved[policy] = (count[0], backend.records[-1].plan.regions[0])
    extra = saved["always"][0] - saved["never"][0]
    assert 0 < extra <= saved["always"][1].extra_bytes * 1.5, (saved, extra)


def test_options_are_checked() -> None:
    with pytest.raises(SplitConfigError, match="split_checkpoints.*'sometimes'"):
        SplitConfig(split_checkpoints="sometimes")
    with pytest.raises(SplitConfigError, match="checkpoint_budget.*2"):
        SplitConfig(checkpoint_budget=2)


def test_explain_shows_the_cuts_inside_the_region() -> None:
    torch.manual_seed(0)
    result = ddp_split_backend.explain(
        SixLayers(width=WIDTH), torch.randn(4, WIDTH), bucket_cap_mb=LAYER_MB, first_bucket_cap_mb=LAYER_MB
    )
    assert "checkpoint region tag_activation_checkpoint (wrap_body_0), 5 bucket boundaries inside: cut into 6" in (
        result.table().replace("\n    ", " ")
    )


# ---------------------------------------------------------------------------------------------
# 2 gloo ranks, 12 steps, backend="ddp_split" by name, against eager DDP
# ---------------------------------------------------------------------------------------------

CASES = ("six_aot_eager", "six_static_graph", "six_never", "six_inductor", "mixed_inductor", "gpt2_checkpointing")
"""``static_graph=True`` with a checkpoint region also trains in tests/test_default_lifecycle.py."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> list[dict]:
    pytest.importorskip("transformers", reason="install the 'models' extra (make test does)")
    from .checkpoint_cases import run_checkpoint_cases

    return run_ranks(run_checkpoint_cases, tmp_path_factory.mktemp("checkpoint"), world=2, timeout=900, cases=CASES)


_TOLERANCE = {"six_inductor": {"rtol": 1e-4, "atol": 1e-4}, "mixed_inductor": {"rtol": 2e-2, "atol": 2e-3}}


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_train_like_eager_ddp(trained, case: str) -> None:
    for rank, result in enumerate(trained):
        r = result[case]
        assert not r["failures"], r["failures"]
        for actual, expected in zip(r["params"], r["expected"], strict=True):
            torch.testing.assert_close(actual, expected, **_TOLERANCE.get(case, {"rtol": 1e-5, "atol": 1e-5}))
        training = [i for i, regions in enumerate(r["regions"]) if regions]
        assert training, (rank, r["regions"])
        outcome = "WHOLE_NEVER" if case == "six_never" else "CUT"
        assert all(o == outcome for i in training for o, _ in r["regions"][i]), r["regions"]
        if case != "six_never":  # whole, the region's piece holds six buckets
            checked = [(matched, pieces) for done, matched, pieces in r["matched"] if done]
            assert checked and all(m == p for m, p in checked), r["matched"]


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", ["six_aot_eager", "six_static_graph", "six_inductor"])
def test_buckets_go_out_while_backward_runs(trained, case: str) -> None:
    """Counted by hooks on the pieces' backward nodes (no clock). Once DDP has rebuilt its
    buckets, the six region's buckets launch one by one, each with the backward of every part
    in front of it still to run; with the region whole they all wait for its whole backward
    and launch together, with only the small stem's backward left."""
    for result in trained:
        for launches in result[case]["launches"][3:]:
            assert launches == [6, 5, 4, 3, 2, 1, 0], launches
        for launches in result["six_never"]["launches"][3:]:
            assert launches == [1, 1, 1, 1, 1, 1, 0], launches
