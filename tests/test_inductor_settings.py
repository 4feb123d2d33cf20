"""``mode=`` and ``inner_options``: inductor's settings reach every piece's compile.

A post-grad pass records the inductor config it sees each time inductor compiles a graph
(every piece's forward, and its backward when backward first runs), so the tests check
the settings are in force where inductor reads them, not only that they were accepted.
"""

from __future__ import annotations

import pytest
import torch
import torch._inductor.config as inductor_config
from torch._inductor.custom_graph_pass import CustomGraphPass
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_split_backend import DDPSplitBackend, Outcome, SplitConfig, SplitConfigError, ddp_split, own_split

from .models import MLP

WATCHED = ("max_autotune", "coordinate_descent_tuning", "size_asserts")


class RecordConfig(CustomGraphPass):
    """Records the watched inductor settings each time inductor runs its post-grad passes."""

    def __init__(self) -> None:
        self.seen: list[dict[str, object]] = []

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.seen.append({name: getattr(inductor_config, name) for name in WATCHED})

    def uuid(self) -> None:
        return None


@pytest.fixture
def recorder() -> RecordConfig:
    record = RecordConfig()
    inductor_config.post_grad_custom_post_pass = record  # the autouse fixture restores config
    inductor_config.force_disable_caches = True  # a cache hit would skip the pass
    return record


def _train_step(compiled: torch.nn.Module, width: int, steps: int = 1) -> None:
    """``steps`` training steps under ``own_split()`` (backward compiles at the first)."""
    with own_split():
        for _ in range(steps):
            compiled(torch.randn(4, width)).sum().backward()


def _compiled_pieces() -> int:
    record = ddp_split.records[-1]
    assert len(record.plan.buckets) >= 2, record.plan.table()
    return sum(r.outcome is Outcome.COMPILED for r in record.pieces)


def test_torch_compile_mode_is_in_force_while_every_piece_compiles(world1, recorder) -> None:
    torch.manual_seed(0)
    model = DDP(MLP(width=16, depth=4), bucket_cap_mb=0.001)
    compiled = torch.compile(model, backend="ddp_split", mode="max-autotune-no-cudagraphs")
    _train_step(compiled, 16, steps=2)
    pieces = _compiled_pieces()
    assert len(recorder.seen) == 2 * pieces  # forward and backward of every distinct piece
    for seen in recorder.seen:
        assert seen["max_autotune"] is True and seen["coordinate_descent_tuning"] is True, seen
    assert inductor_config.max_autotune is False  # only while compiling
    assert ddp_split.records[-1].compiled_by[0] == "inductor"


def test_default_mode_leaves_inductor_settings_alone(world1, recorder) -> None:
    model = DDP(MLP(width=16, depth=4), bucket_cap_mb=0.001)
    _train_step(torch.compile(model, backend="ddp_split"), 16, steps=2)
    assert len(recorder.seen) == 2 * _compiled_pieces()
    assert all(s["max_autotune"] is False for s in recorder.seen)


def test_inner_options_are_in_force_over_the_mode(world1, recorder) -> None:
    model = DDP(MLP(width=16, depth=4))
    options = {
        "inner": "inductor",
        "bucket_cap_mb": 0.001,
        "min_piece_mb": None,
        "mode": "max-autotune-no-cudagraphs",
        "inner_options": {"size_asserts": False, "coordinate_descent_tuning": False},
    }
    _train_step(torch.compile(model, backend="ddp_split", options=options), 16)
    assert len(recorder.seen) == 2 * _compiled_pieces()
    for seen in recorder.seen:
        assert seen == {"max_autotune": True, "coordinate_descent_tuning": False, "size_asserts": False}


def test_mode_and_options_keep_numerics(world1) -> None:
    torch.manual_seed(0)
    net = MLP(width=16, depth=4)
    reference = DDP(MLP(width=16, depth=4))
    reference.load_state_dict(DDP(net).state_dict())
    x = torch.randn(4, 16)
    reference(x).sum().backward()
    model = DDP(net, bucket_cap_mb=0.001)
    with own_split():
        torch.compile(model, backend="ddp_split", mode="max-autotune-no-cudagraphs")(x).sum().backward()
    for got, want in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=1e-4, atol=1e-5)


BAD_SETTINGS = [
    ({"inner": "aot_eager", "mode": "max-autotune"}, ["'mode'", "'max-autotune'", "'aot_eager'", "only inductor"]),
    ({"inner": "aot_eager", "inner_options": {"max_autotune": True}}, ["'inner_options'", "'aot_eager'", "only inductor"]),
    ({"mode": "fastest"}, ["'mode'", "'fastest'", "'max-autotune-no-cudagraphs'", "'reduce-overhead'"]),
    ({"inner_options": {"max_autotun": True}}, ["'max_autotun'", "not an inductor option", "'max_autotune'"]),
    ({"inner_options": {"zzzz_qqqq": 1}}, ["'zzzz_qqqq'", "no option has a similar name", "list_options"]),
    ({"inner_options": {"max_autotune": "yes"}}, ["'max_autotune'", "bool", "str 'yes'"]),
    ({"inner_options": ["max_autotune"]}, ["'inner_options'", "must be a dict", "list"]),
]


@pytest.mark.parametrize("options,fragments", BAD_SETTINGS, ids=[str(o) for o, _ in BAD_SETTINGS])
def test_bad_inductor_settings_name_the_value_and_the_fix(options, fragments) -> None:
    with pytest.raises(SplitConfigError) as info:
        SplitConfig.from_options(options)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


def test_torch_compile_mode_with_a_non_inductor_inner_names_the_inner_backend() -> None:
    backend = DDPSplitBackend(SplitConfig(inner="aot_eager"))
    compiled = torch.compile(MLP(width=8, depth=2), backend=backend, mode="max-autotune-no-cudagraphs")
    with pytest.raises(Exception, match="inner backend is 'aot_eager'; only inductor takes a mode"):
        compiled(torch.randn(2, 8))


def _eager_inner(gm, inputs):
    return gm.forward


def test_callable_inner_takes_no_inductor_options() -> None:
    with pytest.raises(SplitConfigError, match="inner backend is '_eager_inner'"):
        SplitConfig(inner=_eager_inner, inner_options={"max_autotune": True})
