"""A user's first hour (issue 33): the README's script as printed, what a normal run prints,
option errors, pictures without matplotlib and the demo's last lines."""

from __future__ import annotations

import ast
import logging
import os
import pickle
import re
import subprocess
import sys
import textwrap
import traceback
from pathlib import Path

import pytest
import torch

import ddp_split_backend
from ddp_split_backend import OverlapReport, SplitConfigError, explain
from ddp_split_backend.__main__ import main as cli

from .helpers import assert_no_fallback, free_port

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
TORCHRUN = Path(sys.executable).with_name("torchrun")
RUN_S = 300
"""Bound on one torchrun of a small script: it must return, not only print the right lines."""


def _block(after: str, language: str) -> str:
    """The first fenced ``language`` block of the README after the line ``after``."""
    rest = README[README.index(after + "\n"):]
    match = re.search(rf"```{language}\n(.*?)```", rest, re.S)
    assert match, f"no ```{language} block after {after!r}"
    return match.group(1)


def _shape(line: str) -> str:
    """A log line with its figures blanked out (they change from run to run)."""
    return re.sub(r"\d+(\.\d+)?", "#", line.strip())


def _ddp_split_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("ddp_split")]


def _run(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    environ = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    environ.pop("TORCH_LOGS", None)
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=RUN_S, env=environ)
    except subprocess.TimeoutExpired as error:
        pytest.fail(f"{command} did not return within {RUN_S} s:\n{error.stdout!r}\n{error.stderr!r}")
    assert_no_fallback(done.stdout + done.stderr, " ".join(command))
    return done


@pytest.mark.multiprocess
def test_the_readme_script_runs_as_printed_and_prints_what_the_readme_shows(tmp_path: Path) -> None:
    script = _block("## Use it in your script", "python")
    assert len(script.strip().splitlines()) <= 16, "the README's script is meant to be about ten lines"
    (tmp_path / "train.py").write_text(script)
    done = _run([str(TORCHRUN), "--standalone", "--nproc_per_node=2", "train.py"], tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    printed = _ddp_split_lines(done.stdout + done.stderr)
    shown = [line for line in _block("### What you see", "").splitlines() if line.strip()]
    # Rank 0 alone prints, each line once; the README shows them as a run prints them.
    assert [_shape(line) for line in printed] == [_shape(line) for line in shown], printed


def _script_run(tmp_path: Path, body: str) -> subprocess.CompletedProcess[str]:
    """``body`` in a fresh interpreter that has not configured logging (a user's script)."""
    (tmp_path / "user.py").write_text(textwrap.dedent(body))
    return _run([sys.executable, "user.py"], tmp_path, PYTHONPATH=str(ROOT), MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(free_port()))


_TRAIN_AND_EVALUATE = """
    import logging, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    import ddp_split_backend
    {logging}
    dist.init_process_group("gloo", rank=0, world_size=1, init_method="env://")
    net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    model = DDP(torch.compile(net, backend="ddp_split", options={{"inner": "aot_eager"}}), bucket_cap_mb=0.25)
    watch = ddp_split_backend.watch_overlap(model, warmup=1, steps=2)
    with ddp_split_backend.own_split():
        for step in range(4):
            model(torch.randn(8, 256)).sum().backward()
        with torch.no_grad():
            model(torch.randn(8, 256))
    watch.remove()
    {after}
    ddp_split_backend.close_ddp(model)
    print("closed", flush=True)
"""


def test_a_normal_run_says_once_per_graph_what_it_did(tmp_path: Path) -> None:
    done = _script_run(tmp_path, _TRAIN_AND_EVALUATE.format(logging="", after=""))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = _ddp_split_lines(done.stderr)
    # The training graph, its backward compile, the overlap window, the evaluation graph.
    assert len(lines) == 4, lines
    training, backward, overlap, evaluation = lines  # the eval forward closes the overlap window
    assert training.startswith("ddp_split: graph 0") and "4 pieces for 4 DDP buckets (one per bucket)" in training
    assert "traced in" in training and "compiled in" in training
    assert "(2 reused)" in training  # the middle two are the first's twin
    assert backward.startswith("ddp_split: graph 0 [0/0]: backward compiled in") and "(2 compiles)" in backward
    assert "1 piece for 4 DDP buckets: grad is disabled throughout the graph" in evaluation
    assert "of the communication was hidden behind backward" in overlap
    assert all(len(line) <= 200 for line in lines), lines  # short lines, no tables
    assert done.stdout.strip().endswith("closed")


def test_the_users_own_logging_gets_the_lines_once_and_can_silence_them(tmp_path: Path) -> None:
    configured = "logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s')"
    done = _script_run(tmp_path, _TRAIN_AND_EVALUATE.format(logging=configured, after=""))
    assert done.returncode == 0, done.stderr[-3000:]
    mine = [line for line in done.stderr.splitlines() if line.startswith("ddp_split.summary ddp_split: graph")]
    bare = [line for line in done.stderr.splitlines() if line.startswith("ddp_split:")]
    assert len(mine) == 3 and not bare, done.stderr[-3000:]  # training (and its backward), eval: the user's handler only

    silenced = "logging.getLogger('ddp_split.summary').setLevel(logging.WARNING)"
    done = _script_run(tmp_path, _TRAIN_AND_EVALUATE.format(logging=silenced, after=""))
    assert done.returncode == 0 and not _ddp_split_lines(done.stderr), done.stderr[-3000:]


def test_a_picture_that_cannot_be_drawn_does_not_stop_the_teardown(tmp_path: Path) -> None:
    blocked = "sys.modules['matplotlib'] = None  # as if matplotlib were not installed"
    drawn = "print('drawn:', watch.report().draw('overlap.png'), flush=True)"
    done = _script_run(tmp_path, _TRAIN_AND_EVALUATE.format(logging=blocked, after=drawn))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "drawn: None" in done.stdout and done.stdout.strip().endswith("closed")
    warned = [line for line in done.stderr.splitlines() if "needs matplotlib" in line]
    assert len(warned) == 1 and "pip install 'ddp-split-backend[plot]'" in warned[0], done.stderr[-3000:]


def test_missing_matplotlib_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    result = explain(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)), torch.randn(2, 8))
    with pytest.warns(UserWarning, match=r"pip install 'ddp-split-backend\[plot\]'") as caught:
        assert result.render_png(tmp_path / "plan.png") is None
    with pytest.warns(UserWarning, match="needs matplotlib"):
        assert OverlapReport((), "cpu").draw(tmp_path / "overlap.png") is None
    assert "\n" not in str(caught[0].message)
    # The command line says so before it builds or runs anything.
    status = cli(["explain", "no_such_module:build", "--input-shape", "2,8", "--png", str(tmp_path / "p.png")])
    err = capsys.readouterr().err
    assert status == 2 and err.count("\n") == 1 and "ddp-split-backend[plot]" in err, err
    assert not list(tmp_path.iterdir())


def test_an_option_error_reaches_the_user_as_itself() -> None:
    compiled = torch.compile(torch.nn.Linear(4, 4), backend="ddp_split", options={"min_piece_mb": "fast"})
    with pytest.raises(SplitConfigError) as caught:
        compiled(torch.randn(2, 4))
    error = caught.value
    assert isinstance(error, ValueError)
    assert str(error).startswith("ddp_split option 'min_piece_mb'") and "PyTorch" not in str(error)
    shown = "".join(traceback.format_exception(error))
    assert "BackendCompilerFailed" not in shown and "please report" not in shown
    frames = traceback.extract_tb(error.__traceback__)
    assert len(frames) <= 8 and frames[-1].filename.endswith("backend.py"), shown
    assert pickle.loads(pickle.dumps(error)).args == error.args  # it can cross process boundaries
    torch._dynamo.reset()
    # The same error, and nothing else, when the config is built directly.
    with pytest.raises(SplitConfigError, match="min_piece_mb"):
        ddp_split_backend.SplitConfig(min_piece_mb="fast")


def test_tables_fit_120_columns_on_a_real_model(caplog: pytest.LogCaptureFixture) -> None:
    from .real_models import MODELS

    pytest.importorskip("transformers")
    case = MODELS["gpt2"]
    model = case.build()
    batch = case.batch(torch.Generator().manual_seed(0))
    compiled = torch.compile(model, backend="ddp_split", options={"inner": "aot_eager", "bucket_cap_mb": 0.05})
    with caplog.at_level(logging.INFO, logger="ddp_split"):
        case.loss(compiled, batch).backward()
    tables = [r.getMessage() for r in caplog.records if r.name == "ddp_split"]
    assert tables and any("more)" in t for t in tables), tables  # long name lists cut short with a count
    widths = [len(line) for t in tables for line in t.splitlines()]
    assert max(widths) <= 120, max(widths)
    torch._dynamo.reset()


def test_the_demo_imports_only_what_make_demo_installs() -> None:
    tree = ast.parse((ROOT / "examples" / "train_gpt.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and not node.level}
    assert imported - set(sys.stdlib_module_names) == {"torch", "ddp_split_backend"}
    makefile = (ROOT / "Makefile").read_text()
    recipe = makefile[makefile.index("$(DEMO_STAMP):"):makefile.index("$(STAMP):")]
    assert "-e .\n" in recipe and "[" not in recipe.replace("$(", "")  # the package, no extras
    assert re.search(r"^demo: \$\(DEMO_STAMP\)$", makefile, re.M)


@pytest.mark.multiprocess
def test_the_demo_ends_with_how_much_communication_was_hidden() -> None:
    done = _run([str(TORCHRUN), "--standalone", "--nproc_per_node=2", "examples/train_gpt.py", "--steps", "12",
                 "--inner", "aot_eager", "--log-every", "100"], ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    overlap = [line for line in _ddp_split_lines(done.stderr) if line.startswith("ddp_split overlap")]
    assert len(overlap) == 1 and re.search(r"training forwards \d+-23:", overlap[0]), done.stderr[-3000:]
    assert "one compiled graph would hide none of it" in done.stdout


@pytest.mark.parametrize(("example", "library"), [("launch_accelerate.py", "accelerate"),
                                                   ("launch_hf_trainer.py", "transformers"),
                                                   ("launch_lightning.py", "lightning")])
def test_a_launcher_example_without_its_library_says_which_extra(tmp_path: Path, example: str, library: str) -> None:
    blocked = (f"import runpy, sys; sys.modules[{library!r}] = None; "
               f"runpy.run_path({str(ROOT / 'examples' / example)!r}, run_name='__main__')")
    done = _run([sys.executable, "-c", blocked], tmp_path, PYTHONPATH=str(ROOT))
    assert done.returncode == 1 and done.stderr.count("\n") == 1, done.stderr[-3000:]
    assert f"needs {library}" in done.stderr and "pip install 'ddp-split-backend[launchers]'" in done.stderr
