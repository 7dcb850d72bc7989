"""Helper of test_model.py (not a test): ModelNew under DistributedDataParallel, gloo, 2 CPU ranks.

    python _ddp_worker.py OUT_DIR PORT IN_FEATURES OUT_FEATURES POOL_KERNEL SCALE BATCH

Each rank builds ModelNew from torch.manual_seed(0), draws the full batch x [BATCH, IN] from
torch.manual_seed(1), runs its half of the rows, backpropagates loss = out.mean() and saves
{"loss", "grads": {name: grad}} to OUT_DIR/rank<r>.pt. DDP averages the gradients, so they equal
the single-process gradients of out.mean() over the whole batch.

It runs as a script (torch.multiprocessing.spawn needs an importable entry point, which the test
modules are not under pytest's importlib import mode).
"""

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import fused_pool_gelu

WORLD_SIZE = 2


def run(rank, out_dir, port, in_features, out_features, pool_kernel_size, scale, batch):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD_SIZE
    )
    try:
        torch.manual_seed(0)
        model = fused_pool_gelu.ModelNew(in_features, out_features, pool_kernel_size, scale)
        ddp = DistributedDataParallel(model)
        torch.manual_seed(1)
        x = torch.randn(batch, in_features)
        loss = ddp(x.chunk(WORLD_SIZE)[rank]).mean()
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        torch.save({"loss": loss.detach(), "grads": grads}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    out_dir, port = sys.argv[1], int(sys.argv[2])
    in_features, out_features, pool_kernel_size = (int(a) for a in sys.argv[3:6])
    scale, batch = float(sys.argv[6]), int(sys.argv[7])
    mp.spawn(
        run,
        args=(out_dir, port, in_features, out_features, pool_kernel_size, scale, batch),
        nprocs=WORLD_SIZE,
        join=True,
    )
