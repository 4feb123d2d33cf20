"""The prepared GPU check (benchmarks/gpu_check.py) runs here on every change, so it cannot rot.

On this CPU machine the script runs its parts on the CPU and must say so: the CUDA-only parts
(the CUDA half of the device tests, reduce-overhead) report "no GPU here", never "passed",
while correctness against eager DDP (world 1 and 2 gloo ranks), the step-time modes and the
first-call processes really run. ``--quick --inner aot_eager`` keeps it to a couple of minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
PARTS = ("device_tests", "correctness_world1", "correctness_two_ranks", "steps", "reduce_overhead", "first_call")


@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run is `make gpu-check`; this is its CPU twin")
def test_gpu_check_runs_on_cpu_and_says_so(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "--inner", "aot_eager", "--out-dir", str(tmp_path),
         "--rank-timeout", "180"],
        capture_output=True, text=True, timeout=420, cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    results = json.loads((tmp_path / "gpu_check_cpu_quick.json").read_text())
    report = (tmp_path / "gpu_check_cpu_quick.md").read_text()

    assert all("error" not in results[part] for part in PARTS), {p: results[p].get("error") for p in PARTS}
    # The CUDA-only parts say they did not run; nothing claims a CUDA pass.
    assert results["device_tests"]["status"] == "no GPU here"
    assert results["reduce_overhead"]["status"] == "no GPU here"
    assert "**no GPU here**" in report and "passed" not in json.dumps(results["device_tests"])

    # Correctness really ran, on both world sizes, and every case matched eager DDP.
    for part, world in (("correctness_world1", 1), ("correctness_two_ranks", 2)):
        rows = results[part]["rows"]
        assert results[part]["world"] == world and rows, results[part]
        assert all(row["ok"] for row in rows), rows
        assert all(row["pieces"] and max(row["pieces"]) > 1 for row in rows), rows  # ddp_split really split

    # Every step-time mode ran on every link, and ddp_split launched buckets before backward ended.
    steps = results["steps"]
    assert set(steps["links"]) and all(
        {"eager_ddp", "ddp_split"} <= set(link["modes"]) for link in steps["links"].values())
    for link in steps["links"].values():
        split = link["modes"]["ddp_split"]
        assert split["step_ms"] > 0 and split["buckets"] > 1
        assert split["buckets_ready_before_backward_end"] >= 1, split
    assert steps["pieces"]["ddp_split"] > 1

    # Both first-call processes compiled and stepped.
    assert results["first_call"]["ddp_split"]["seconds"] > 0
    assert results["first_call"]["ddp_optimizer"]["seconds"] > 0
