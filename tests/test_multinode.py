"""Multi-node: ``examples/train_gpt.py`` as two "nodes" on this machine.

Two torchrun launchers start at once, each with ``--nnodes 2 --nproc-per-node 1``, and meet
on 127.0.0.1: through a c10d rendezvous (what multi-node jobs use; the launchers agree on
ranks themselves) and through the static one (``--node-rank`` with ``--master-addr/--master-port``).
Both launchers must exit 0 promptly, both ranks must end with identical parameters (DDP makes
them equal even with wrong gradients), and those must match eager DDP trained beside them on the
same batches (``--compare eager``, dropout off so both draw no masks).

Needs ``train_gpt.py --save-params PATH``: every rank writes its model's parameters to
``PATH.rank<global rank>``.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest
import torch

from .helpers import free_port
from .test_launchers import TORCHRUN, launch_env, start, tail, wait_all

pytestmark = pytest.mark.multiprocess

STEPS = 3
EAGER_TOLERANCE = 1e-5
"""Largest parameter difference from eager DDP after ``STEPS`` AdamW steps: room for float sums
in another order (measured 0.0 with aot_eager, torch 2.13); a wrong gradient moves AdamW's
parameters by about its learning rate, 3e-3, per step."""


def rendezvous(kind: str, node: int, port: int, run_id: str) -> list[str]:
    if kind == "c10d":
        return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                "--local-addr", "127.0.0.1"]
    return ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]


@pytest.mark.parametrize("kind", ["c10d", "static"])
def test_two_launchers_train_as_two_nodes(kind: str, tmp_path: Path) -> None:
    params = tmp_path / "params.pt"
    outs = [tmp_path / f"params.pt.rank{rank}" for rank in range(2)]
    port, run_id, env = free_port(), uuid.uuid4().hex, launch_env()
    runs = []
    for node in range(2):
        command = [
            str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", *rendezvous(kind, node, port, run_id),
            "--max-restarts", "0", "examples/train_gpt.py", "--steps", str(STEPS), "--inner", "aot_eager",
            "--log-every", "1", "--save-params", str(params), "--compare", "eager", "--dropout", "0",
        ]
        log = tmp_path / f"node{node}.log"
        runs.append((start(command, log, env), log, outs))
    wait_all(runs)

    logs = [log.read_text(errors="replace") for _, log, _ in runs]
    assert sum("loss: start" in text for text in logs) == 1, "rank 0 reports once, in one launcher"
    assert all("DDPOptimizer already split" not in text for text in logs)
    assert any("(ddp_split):" in text for text in logs), tail(runs[0][1])
    (diff,) = (float(m) for text in logs for m in re.findall(r"compare with eager: max \|param diff\| (\S+),", text))
    assert diff <= EAGER_TOLERANCE, f"ddp_split's parameters differ from eager DDP's by {diff}"
    first, second = (torch.load(path) for path in outs)
    assert first.keys() == second.keys() and first
    for name in first:
        torch.testing.assert_close(first[name], second[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
