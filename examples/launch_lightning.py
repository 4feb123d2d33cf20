"""Lightning Fabric + ddp_split: a small MLP, a few SGD steps, 2 CPU ranks (gloo, strategy "ddp").

Launch with torchrun (Fabric sees torchrun's environment and starts no processes itself)::

    torchrun --standalone --nproc_per_node=2 examples/launch_lightning.py --out /tmp/fabric.pt
    torchrun --standalone --nproc_per_node=2 examples/launch_lightning.py --no-compile --out /tmp/fabric_eager.pt

Compile the plain module before ``fabric.setup``: Lightning records ``torch.compile``'s
arguments (it patches ``torch.compile`` on import, so import lightning first), and
``Fabric.setup`` takes the compiled wrapper off, wraps the module in DDP and compiles the DDP
module again with the same arguments: ``torch.compile(DDP(model), backend="ddp_split")``.
"""

from __future__ import annotations

from ddp_split_backend.extras import missing

if problem := missing("lightning", "examples/launch_lightning.py"):
    raise SystemExit(problem)  # one line naming the extra to install

import argparse
import contextlib
import os

import lightning as L  # before torch.compile is called: see above
import torch
import torch.nn as nn
import torch.nn.functional as F
from lightning.fabric.strategies import DDPStrategy
from torch.utils.data import DataLoader, TensorDataset

import ddp_split_backend
from ddp_split_backend import ddp_split


class MLP(nn.Module):
    def __init__(self, width: int = 64, depth: int = 4) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32 if i == 0 else width, width) for i in range(depth))
        self.head = nn.Linear(width, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = F.gelu(layer(x))
        return self.head(x)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="result file (written by rank 0)")
    p.add_argument("--no-compile", action="store_true", help="plain DDP, for comparison")
    p.add_argument("--inner", default="inductor", help="backend ddp_split compiles each piece with")
    p.add_argument("--steps", type=int, default=8, help="training steps")
    p.add_argument("--bucket-cap-mb", type=float, default=0.02, help="DDP bucket cap (MiB)")
    args = p.parse_args()

    strategy = DDPStrategy(process_group_backend="gloo", bucket_cap_mb=args.bucket_cap_mb)
    fabric = L.Fabric(accelerator="cpu", strategy=strategy, devices=int(os.environ.get("LOCAL_WORLD_SIZE", 2)),
                      num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)))
    fabric.launch()
    fabric.seed_everything(0)
    model = MLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if not args.no_compile:
        model = torch.compile(model, backend="ddp_split", options={"inner": args.inner})
    model, optimizer = fabric.setup(model, optimizer)  # now _FabricModule(compile(DDP(MLP)))
    data = torch.Generator().manual_seed(1)
    dataset = TensorDataset(torch.randn(256, 32, generator=data), torch.randint(0, 8, (256,), generator=data))
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=8, shuffle=False))

    # Dynamo decides, as it compiles a frame, whether torch's DDPOptimizer cuts the graph
    # (optimize_ddp and an active DDP module, torch/_dynamo/convert_frame.py). Fabric compiles
    # the DDP module, so without own_split() ddp_split would only see DDPOptimizer's pieces.
    losses = []
    with contextlib.nullcontext() if args.no_compile else ddp_split_backend.own_split():
        for step, (x, y) in zip(range(args.steps), loader):
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            fabric.backward(loss)
            optimizer.step()
            losses.append(fabric.all_reduce(loss.detach(), reduce_op="mean").item())

    plans = [r.plan for r in ddp_split.records]
    if fabric.global_rank == 0:
        for plan in plans:
            print(plan.table(), flush=True)
        print("losses:", " ".join(f"{v:.4f}" for v in losses), flush=True)
        torch.save({
            "params": {n: t.detach().clone() for n, t in model.module.state_dict().items()},
            "losses": losses,
            "plans": [(plan.source, len(plan.pieces)) for plan in plans],
        }, args.out)
    # Reducers first, then the process group: Note [Teardown deadlock] (ddp_split_backend/teardown.py).
    ddp_split_backend.close_ddp(model)


if __name__ == "__main__":
    main()
