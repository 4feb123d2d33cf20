"""Options: validated up front, errors name the option, the bad value and the fix."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from ddp_split_backend import DDPSplitBackend, SplitConfig, SplitConfigError
from ddp_split_backend.config import MIB

from .models import MLP

BAD_OPTIONS = [
    ({"bucket_cap": 4}, ["bucket_cap", "valid options", "bucket_cap_mb"]),
    ({"bucket_cap_mb": 0}, ["bucket_cap_mb", "0", "positive"]),
    ({"bucket_cap_mb": -3}, ["bucket_cap_mb", "-3", "positive"]),
    ({"bucket_cap_mb": math.inf}, ["bucket_cap_mb", "inf", "finite"]),
    ({"bucket_cap_mb": math.nan}, ["bucket_cap_mb", "nan", "finite"]),
    ({"bucket_cap_mb": "25"}, ["bucket_cap_mb", "'25'", "number"]),
    ({"bucket_cap_mb": True}, ["bucket_cap_mb", "True"]),
    ({"first_bucket_cap_mb": 0.0}, ["first_bucket_cap_mb", "0.0"]),
    ({"inner": "no_such_backend"}, ["inner", "no_such_backend", "aot_eager", "inductor"]),
    ({"inner": "ddp_split"}, ["inner", "ddp_split", "split every piece again"]),
    ({"inner": 3}, ["inner", "int", "3"]),
    ({"bucket_cap_mb": 1, "first_bucket_cap_mb": 2}, ["first_bucket_cap_mb", "2", "bucket_cap_mb", "Lower"]),
    ({"on_inner_failure": "ignore"}, ["on_inner_failure", "'ignore'", "'eager'", "'raise'"]),
]


@pytest.mark.parametrize("options,fragments", BAD_OPTIONS, ids=[str(o) for o, _ in BAD_OPTIONS])
def test_bad_option_error_names_option_value_and_fix(options, fragments) -> None:
    with pytest.raises(SplitConfigError) as info:
        SplitConfig.from_options(options)
    for fragment in fragments:
        assert fragment in str(info.value), (fragment, str(info.value))


@pytest.mark.parametrize("options,fragments", BAD_OPTIONS[:3], ids=[str(o) for o, _ in BAD_OPTIONS[:3]])
def test_bad_option_through_torch_compile_reaches_user(options, fragments) -> None:
    compiled = torch.compile(MLP(width=8, depth=2), backend="ddp_split", options=options)
    with pytest.raises(Exception) as info:
        compiled(torch.randn(2, 8))
    assert fragments[0] in str(info.value)
    assert torch.ones(2).sum().item() == 2.0  # the process is still usable


def test_options_must_be_a_mapping() -> None:
    with pytest.raises(SplitConfigError, match="must be a dict"):
        SplitConfig.from_options(["inner"])  # type: ignore[arg-type]


def test_defaults_are_ddp_defaults() -> None:
    caps = SplitConfig().caps()
    assert caps.bytes == 25 * MIB
    assert caps.first_bytes == torch.distributed._DEFAULT_FIRST_BUCKET_BYTES


def test_first_bucket_clamped_to_small_cap() -> None:
    caps = SplitConfig(bucket_cap_mb=0.25).caps()
    assert caps.bytes == MIB // 4 and caps.first_bytes == MIB // 4


def test_callable_inner_compiles_every_piece() -> None:
    """A callable inner backend is called once per piece (reuse is off for callables)."""
    calls: list[int] = []

    def inner(gm, inputs):
        calls.append(len(gm.graph.nodes))
        return gm.forward

    backend = DDPSplitBackend(SplitConfig(inner=inner, bucket_cap_mb=0.015, min_piece_mb=None))
    model = MLP(width=64, depth=3)
    x = torch.randn(2, 64)
    torch.testing.assert_close(torch.compile(model, backend=backend)(x), model(x))
    assert len(calls) == len(backend.records[-1].plan.buckets) == 3


def test_caps_follow_the_active_ddp_module(world1) -> None:
    """DDP gives its first bucket a 1 MiB cap only when the user leaves the cap unset; with a
    cap given, every bucket has it (2.11 keeps this on the module, later releases in a config)."""
    ddp = DDP(MLP(width=8, depth=2), bucket_cap_mb=3)
    caps = SplitConfig().caps(ddp)
    assert (caps.bytes, caps.first_bytes) == (3 * MIB, 3 * MIB)
    assert SplitConfig(bucket_cap_mb=5).caps(ddp).bytes == 5 * MIB
    default = SplitConfig().caps(DDP(MLP(width=8, depth=2)))
    assert (default.bytes, default.first_bytes) == (25 * MIB, MIB)


def test_registered_by_entry_point_without_import() -> None:
    import subprocess
    import sys

    code = (
        "import torch, sys;"
        "assert 'ddp_split' not in sys.modules and 'ddp_split_backend' not in sys.modules;"
        "assert 'ddp_split' in torch._dynamo.list_backends();"
        "from torch._dynamo.backends.registry import lookup_backend;"
        "print(type(lookup_backend('ddp_split')).__name__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "DDPSplitBackend"


def test_backend_object_keeps_records() -> None:
    backend = DDPSplitBackend(SplitConfig(inner="aot_eager", bucket_cap_mb=0.0001))
    model = MLP(width=16, depth=3)
    torch.compile(model, backend=backend)(torch.randn(2, 16))
    assert len(backend.records) == 1
    assert backend.plans[0].buckets[0].params == ("net.0.weight", "net.0.bias")


def test_options_overlay_the_instances_config_and_are_validated_once(monkeypatch) -> None:
    from ddp_split_backend import DDPSplitBackend, config as config_module

    backend = DDPSplitBackend(SplitConfig(inner="aot_eager", bucket_cap_mb=0.015, min_piece_mb=None))
    validations = []
    real = config_module.SplitConfig.__post_init__
    monkeypatch.setattr(config_module.SplitConfig, "__post_init__", lambda self: (validations.append(1), real(self)))
    for width in (8, 16, 32):  # three graphs (recompiles), the same options
        model = MLP(width=width, depth=3)
        torch.compile(model, backend=backend, options={"on_inner_failure": "raise"})(torch.randn(2, width))
    configs = {id(c) for c, _ in backend._configs.values()}
    assert len(configs) == 1 and len(validations) == 1, validations
    (config, _), = backend._configs.values()
    assert config.inner == "aot_eager" and config.bucket_cap_mb == 0.015 and config.on_inner_failure == "raise"
    assert len(backend.records) == 3


def test_dynamo_reset_forgets_records_count_and_warning() -> None:
    from ddp_split_backend import DDPSplitBackend

    backend = DDPSplitBackend(SplitConfig(inner="aot_eager"))
    torch.compile(MLP(width=8, depth=2), backend=backend)(torch.randn(2, 8))
    backend._warned_ddp_optimizer = True
    torch._dynamo.reset()  # calls backend.reset()
    assert not backend.records and not backend._warned_ddp_optimizer and not backend._configs
    torch.compile(MLP(width=8, depth=2), backend=backend)(torch.randn(2, 8))
    assert backend.records[-1].plan.graph_name.startswith("graph 0")
