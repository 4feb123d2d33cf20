#!/usr/bin/env python
"""Step time of ddp_split at two commits, in one run: before/after ratios a noisy machine can trust.

Each commit is checked out in a temporary git worktree. The overhead part of
``step_overhead.py`` (this tree's copy, so both commits run the same benchmark) runs for
each commit in turn, in its own process, with that commit's package first on ``PYTHONPATH``;
commits alternate for ``--repeats`` rounds. Within a process, each ddp_split mode is read as
a ratio to eager DDP's step in the same process, so the two commits compare as ratios of
ratios, and machine drift between processes cancels out.

Example (the hot-path change of issue 25, point 5)::

    .venv/bin/python benchmarks/ab_commits.py 7c54f4b^ 7c54f4b --inner aot_eager --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from _common import environment  # noqa: E402


def step_ratios(tree: Path, inner: str, rounds: int, out: Path) -> dict[str, float]:
    """One process of ``step_overhead.py --part overhead`` on ``tree``'s package: each mode's
    median step over eager DDP's."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), str(HERE)])}
    probe = subprocess.run([sys.executable, "-c", "import ddp_split_backend as m; print(m.__file__)"],
                           env=env, capture_output=True, text=True, check=True)
    assert probe.stdout.strip().startswith(str(tree)), f"{tree}'s package is not the one imported: {probe.stdout}"
    subprocess.run([sys.executable, str(HERE / "step_overhead.py"), "--part", "overhead", "--inner", inner,
                    "--rounds", str(rounds), "--out", str(out), "--picture", str(out.with_suffix(".png"))],
                   env=env, check=True, capture_output=True, text=True)
    rows = json.loads(out.read_text())["overhead"][0]["rows"]
    return {mode: row["vs_eager_ddp"] for mode, row in rows.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("before", help="commit before the change")
    p.add_argument("after", help="commit after the change")
    p.add_argument("--inner", default="aot_eager")
    p.add_argument("--rounds", type=int, default=15, help="round-robin steps per process")
    p.add_argument("--repeats", type=int, default=3, help="processes per commit, alternating")
    p.add_argument("--out", type=Path, default=HERE / "results" / "ab_commits.json")
    args = p.parse_args()
    record: dict[str, Any] = {"environment": environment(), "before": args.before, "after": args.after, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {}
        for label in ("before", "after"):
            trees[label] = Path(tmp) / label
            subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(trees[label]),
                            getattr(args, label)], check=True)
        try:
            for repeat in range(args.repeats):
                for label, tree in trees.items():
                    ratios = step_ratios(tree, args.inner, args.rounds, Path(tmp) / f"{label}{repeat}.json")
                    record["runs"].append({"commit": label, "repeat": repeat, "ratio_to_eager": ratios})
                    print(f"{label:6} run {repeat}: ddp_split_x1 / eager DDP = {ratios['ddp_split_x1']:.3f}", flush=True)
        finally:
            for tree in trees.values():
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(tree)], check=False)
    modes = record["runs"][0]["ratio_to_eager"].keys()
    summary = {}
    print(f"\nmedian step / eager DDP's, {args.inner}, {args.repeats} processes per commit")
    print(f"{'mode':16} {'before':>8} {'after':>8} {'after/before':>12}")
    for mode in modes:
        med = {label: statistics.median(r["ratio_to_eager"][mode] for r in record["runs"] if r["commit"] == label)
               for label in ("before", "after")}
        summary[mode] = {**med, "after_over_before": med["after"] / med["before"]}
        print(f"{mode:16} {med['before']:8.3f} {med['after']:8.3f} {med['after'] / med['before']:12.3f}")
    record["summary"] = summary
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
