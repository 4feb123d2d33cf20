"""Diagnostics: TORCH_LOGS tables, tlparse artifacts, explain() and its picture, the CLI."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import torch

from ddp_split_backend import DDPSplitBackend, SplitConfig, explain

from .helpers import assert_no_fallback
from .models import MLP, StateRegions

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = """
import torch
from tests.models import MLP
from ddp_split_backend import DDPSplitBackend, SplitConfig
backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner="aot_eager", bucket_cap_mb=0.02))
torch.compile(MLP(width=64, depth=3), backend=backend)(torch.randn(2, 64))
"""


BREAK_SCRIPT = """
import torch
from tests.models import MLP
from ddp_split_backend import DDPSplitBackend, SplitConfig

class Breaks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = MLP(width=64, depth=3), MLP(width=64, depth=3)

    def forward(self, x):
        x = self.a(x)
        print("break here")
        return self.b(x)

backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner="aot_eager", bucket_cap_mb=0.02))
torch.compile(Breaks(), backend=backend)(torch.randn(2, 64))
"""


def _run(env_extra: dict[str, str], script: str = SCRIPT) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_extra}
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    assert_no_fallback(done.stdout + done.stderr)
    return done


def test_torch_logs_prints_fqn_bucket_table() -> None:
    out = _run({"TORCH_LOGS": "ddp_split"}).stderr
    assert "ddp_split plan graph 0" in out
    assert "2 pieces" in out
    assert "net.0.weight, net.0.bias" in out and "net.2.weight, net.2.bias" in out
    assert "compiled by: aot_eager" in out
    assert "def forward" not in out  # piece code only at +ddp_split


def test_torch_logs_plus_adds_piece_code_and_composes_with_graph_breaks() -> None:
    """Both loggers print, for a program with a real graph break: Dynamo's break reason
    and a ddp_split table (with piece code) for the graph on each side of it."""
    out = _run({"TORCH_LOGS": "+ddp_split,graph_breaks"}, BREAK_SCRIPT).stderr
    assert "Graph break" in out and "print" in out, out[-3000:]
    assert "ddp_split plan graph 0" in out and "ddp_split plan graph 1" in out
    assert "piece 1" in out and "def forward" in out
    assert out.index("Graph break") < out.index("ddp_split plan graph 1")


def test_trace_structured_artifacts_are_written(tmp_path) -> None:
    _run({"TORCH_TRACE": str(tmp_path)})
    text = "".join(p.read_text() for p in tmp_path.glob("*"))
    assert '"name": "ddp_split_plan"' in text
    assert '"name": "ddp_split_piece_0"' in text and '"name": "ddp_split_piece_1"' in text


def test_explain_returns_the_plan_the_backend_used(counting) -> None:
    model = StateRegions(kind="autocast")
    x = torch.randn(4, 32)
    options = {"min_piece_mb": None, "bucket_cap_mb": 0.001, "first_bucket_cap_mb": 0.001}
    backend = DDPSplitBackend(SplitConfig(inner=counting, **options))
    torch.compile(model, backend=backend)(x)
    result = explain(model, x, **options)
    assert len(result.plans) == 1
    used, explained = backend.records[-1].plan, result.plans[0]
    assert explained.buckets == used.buckets
    assert explained.state_spans == used.state_spans
    assert any(s.kind == "autocast" for s in explained.state_spans)


def test_explain_shows_each_dynamo_graph_after_a_graph_break() -> None:
    class Breaks(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = MLP(width=32, depth=2)
            self.b = MLP(width=32, depth=2)

        def forward(self, x):
            x = self.a(x)
            torch._dynamo.graph_break()
            return self.b(x)

    result = explain(Breaks(), torch.randn(2, 32), bucket_cap_mb=0.001, first_bucket_cap_mb=0.001)
    assert len(result.plans) == 2
    assert result.plans[0].buckets[0].params[0] == "a.net.0.weight"
    assert result.plans[1].buckets[0].params[0] == "b.net.0.weight"
    assert "graph 0" in result.table() and "graph 1" in result.table()


def test_png_is_drawn(tmp_path) -> None:
    result = explain(StateRegions(kind="inference"), torch.randn(4, 32), bucket_cap_mb=0.001, first_bucket_cap_mb=0.001)
    path = result.render_png(tmp_path / "plan.png")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_cli_explain(tmp_path) -> None:
    png = tmp_path / "cli.png"
    out = subprocess.run(
        [sys.executable, "-m", "ddp_split_backend", "explain", "tests.test_plan:ToyModel",
         "--input-shape", "4,10", "--min-piece-mb", "none", "--png", str(png)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=300, check=True,
    ).stdout
    assert "3 pieces" in out and "net.2.weight" in out
    assert png.exists()


class NormDropoutBreak(torch.nn.Module):
    """BatchNorm statistics and dropout's random numbers change on every training forward;
    the graph break gives a resume function with its own Dynamo cache."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.a = torch.nn.Linear(width, width)
        self.bn = torch.nn.BatchNorm1d(width)
        self.drop = torch.nn.Dropout(0.5)
        self.b = torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.bn(self.a(x)))
        torch._dynamo.graph_break()
        return self.b(x)


def _entries(code) -> list:
    return torch._dynamo.eval_frame._debug_get_cache_entry_list(code)


def test_explain_leaves_no_cache_entries_buffers_or_rng_changes(counting) -> None:
    torch.manual_seed(0)
    model = NormDropoutBreak()
    x = torch.randn(4, 32)
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    rng = torch.get_rng_state()
    code = NormDropoutBreak.forward.__code__
    for _ in range(torch._dynamo.config.recompile_limit + 2):  # past the limit if entries piled up
        result = explain(model, x, bucket_cap_mb=0.001, first_bucket_cap_mb=0.001)
        assert len(result.plans) == 2
        assert _entries(code) == []
    for name, value in model.named_buffers():
        assert torch.equal(value, buffers[name]), name  # running stats and num_batches_tracked
    assert torch.equal(torch.get_rng_state(), rng)

    reference = copy.deepcopy(model)
    backend = DDPSplitBackend(SplitConfig(min_piece_mb=None, inner=counting, bucket_cap_mb=0.001, first_bucket_cap_mb=0.001))
    torch.manual_seed(1)
    expected = reference(x)
    torch.manual_seed(1)
    actual = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(actual, expected)
    assert len(backend.records) == 2 and len(_entries(code)) == 1
    for name, value in model.named_buffers():
        torch.testing.assert_close(value, reference.get_buffer(name))


def test_a_compile_made_before_explain_still_runs_correctly_after_it(counting) -> None:
    """Dynamo drops a code object's cache whole: the earlier compile compiles again, once."""
    torch.manual_seed(0)
    model = NormDropoutBreak().eval()
    x = torch.randn(4, 32)
    compiled = torch.compile(model, backend=DDPSplitBackend(SplitConfig(inner=counting)))
    expected = compiled(x)
    compiles = counting.count
    explain(model, x)
    torch.testing.assert_close(compiled(x), expected)
    torch.testing.assert_close(compiled(x), expected)
    assert counting.count == 2 * compiles
