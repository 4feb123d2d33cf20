"""The launcher recipes (``examples/launch_*.py``) under torchrun, 2 gloo ranks on 127.0.0.1.

For each launcher the compiled run and the ``--no-compile`` run start together; both must
exit 0 promptly, ddp_split must have planned the DDP graph itself (its plan table in the
``TORCH_LOGS=ddp_split`` log, at least two pieces, no DDPOptimizer piece), and the compiled
run must end with the parameters and losses of the run without compile (inner backend
``aot_eager``, so the same arithmetic runs).
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from .helpers import assert_no_fallback, free_port

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parent.parent
TORCHRUN = Path(sys.executable).with_name("torchrun")
RUN_TIMEOUT_S = 150.0
EXIT_GRACE_S = 30.0
"""How long a launch may run after its result file appeared (teardown, interpreter exit)."""

LAUNCHERS = {
    "hf_trainer": ("launch_hf_trainer.py", ("transformers", "accelerate")),
    "accelerate": ("launch_accelerate.py", ("accelerate",)),
    "lightning": ("launch_lightning.py", ("lightning",)),
}

# transformers and lightning (through torchmetrics) import torchvision, whose release for torch
# 2.13 is a CUDA build that cannot load beside the CPU wheel (tests/torchvision_cpu.py). Every
# process torchrun starts runs this first, so the examples stay free of that workaround.
_SITECUSTOMIZE = """\
import glob, importlib.util, os
_spec = importlib.util.find_spec("torchvision")
if _spec is not None and _spec.submodule_search_locations:
    import torch
    _libs = glob.glob(os.path.join(_spec.submodule_search_locations[0], "_C*.so"))
    try:
        for _lib in _libs:
            torch.ops.load_library(_lib)
        _broken = not _libs
    except OSError:
        _broken = True
    if _broken:
        _shim = importlib.util.spec_from_file_location("_torchvision_cpu", {shim!r})
        _module = importlib.util.module_from_spec(_shim)
        _shim.loader.exec_module(_module)
        _module.define_torchvision_operators()
"""


def launch_env(site_dir: Path | None = None) -> dict[str, str]:
    """The environment of a test launch: one thread per rank, ddp_split's log, loopback gloo;
    ``site_dir``: a directory put first on PYTHONPATH (the torchvision shim)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", TORCH_LOGS="ddp_split", PYTHONUNBUFFERED="1")
    if site_dir is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site_dir), env.get("PYTHONPATH")) if p)
    if Path("/sys/class/net/lo").exists():
        env["GLOO_SOCKET_IFNAME"] = "lo"
    return env


@pytest.fixture(scope="module")
def site_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("site")
    shim = str(ROOT / "tests" / "torchvision_cpu.py")
    (path / "sitecustomize.py").write_text(_SITECUSTOMIZE.format(shim=shim))
    return path


def torchrun_args(nnodes: int, nproc: int, port: int, run_id: str) -> list[str]:
    return [
        str(TORCHRUN), "--nnodes", str(nnodes), "--nproc-per-node", str(nproc),
        "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
        "--local-addr", "127.0.0.1", "--max-restarts", "0",
    ]


def start(command: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    """A launcher in its own session, stdout and stderr into ``log`` (a file: no pipe can fill)."""
    with log.open("wb") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)


def _descendants(pid: int) -> list[int]:
    """Processes below ``pid`` (torchrun starts each worker in a session of its own)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def stop(proc: subprocess.Popen) -> None:
    """End a launcher that is still running: SIGTERM (torchrun passes it on), then SIGKILL."""
    if proc.poll() is not None:
        return
    below = _descendants(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        pass
    for pid in [proc.pid, *below]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def tail(log: Path, chars: int = 4000) -> str:
    return log.read_text(errors="replace")[-chars:] if log.exists() else "(no output)"


def wait_all(runs: list[tuple[subprocess.Popen, Path, list[Path]]], timeout: float = RUN_TIMEOUT_S) -> None:
    """Until every launcher exited 0; ``runs``: (process, log, result files it writes).

    Fails when one runs past ``timeout``, lingers ``EXIT_GRACE_S`` after its results
    appeared, or exits non-zero. Every launcher is ended before this returns or raises.
    """
    start_time = time.monotonic()
    written: dict[int, float] = {}
    try:
        while any(proc.poll() is None for proc, _, _ in runs):
            now = time.monotonic()
            for i, (proc, log, outs) in enumerate(runs):
                if proc.poll() is not None:
                    continue
                if i not in written and outs and all(p.exists() for p in outs):
                    written[i] = now
                if i in written and now - written[i] > EXIT_GRACE_S:
                    pytest.fail(f"{log.name}: no exit {EXIT_GRACE_S:g} s after writing results:\n{tail(log)}")
                if now - start_time > timeout:
                    pytest.fail(f"{log.name}: did not finish within {timeout:g} s:\n{tail(log)}")
            time.sleep(0.1)
    finally:
        for proc, _, _ in runs:
            stop(proc)
    for proc, log, _ in runs:
        assert proc.returncode == 0, f"{log.name}: exit code {proc.returncode}\n{tail(log)}"
        assert_no_fallback(log.read_text(errors="replace"), log.name)


@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_launcher_recipe_matches_run_without_compile(launcher: str, tmp_path: Path, site_dir: Path) -> None:
    script, needs = LAUNCHERS[launcher]
    for module in needs:
        if importlib.util.find_spec(module) is None:  # not importorskip: importing needs the shim
            pytest.skip(f"{module} is not installed (the 'launchers' extra)")
    env = launch_env(site_dir)
    runs = []
    for mode, extra in (("compiled", ["--inner", "aot_eager"]), ("eager", ["--no-compile"])):
        out, log = tmp_path / f"{mode}.pt", tmp_path / f"{launcher}-{mode}.log"
        command = [*torchrun_args(1, 2, free_port(), uuid.uuid4().hex), f"examples/{script}", "--out", str(out), *extra]
        runs.append((start(command, log, env), log, [out]))
    wait_all(runs)

    log = runs[0][1].read_text(errors="replace")
    assert "DDPOptimizer already split" not in log and "DDPOptimizer piece" not in log, tail(runs[0][1])
    # The default cuts a piece per bucket: only if the recipe put ddp_split in charge of a
    # DDP module (the recipes' models have several buckets).
    pieces = [int(n) for n in re.findall(r"ddp_split plan .* \(ddp_split\): (\d+) pieces", log)]
    assert any(n > 1 for n in pieces), f"no graph was cut:\n{tail(runs[0][1])}"

    compiled = torch.load(tmp_path / "compiled.pt")
    eager = torch.load(tmp_path / "eager.pt")
    assert compiled["plans"] and {source for source, _ in compiled["plans"]} == {"ddp_split"}
    assert eager["plans"] == []
    assert len(compiled["losses"]) == len(eager["losses"]) > 0
    torch.testing.assert_close(compiled["losses"], eager["losses"])
    torch.testing.assert_close(compiled["params"], eager["params"])
