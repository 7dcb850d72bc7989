"""Helper of test_model.py (not a test): ModelNew under DistributedDataParallel, gloo, 2 CPU ranks.

    python _ddp_worker.py OUT_DIR IN_FEATURES OUT_FEATURES POOL_KERNEL SCALE BATCH

Each rank builds ModelNew from torch.manual_seed(0), draws the full batch x [BATCH, IN] from
torch.manual_seed(1), runs its half of the rows, backpropagates loss = out.mean() and saves
{"loss", "grads": {name: grad}} to OUT_DIR/rank<r>.pt. DDP averages the gradients, so they equal
the single-process gradients of out.mean() over the whole batch.

It runs as a script (torch.multiprocessing.spawn needs an importable entry point, which the test
modules are not under pytest's importlib import mode).

Teardown: a gloo rank can abort after its work ("terminate called without an active exception")
when it tears down while the other still communicates. So the rendezvous is a file store (no TCP
store server thread in rank 0, no port to race for), the DDP objects, whose reducer holds the
group, are gone before the group is destroyed, and the ranks meet at a barrier first.
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

import fused_pool_gelu

WORLD_SIZE = 2


def train_step(rank, in_features, out_features, pool_kernel_size, scale, batch):
    torch.manual_seed(0)
    model = fused_pool_gelu.ModelNew(in_features, out_features, pool_kernel_size, scale)
    ddp = DistributedDataParallel(model)
    torch.manual_seed(1)
    x = torch.randn(batch, in_features)
    loss = ddp(x.chunk(WORLD_SIZE)[rank]).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return {"loss": loss.detach(), "grads": grads}


def run(rank, out_dir, *model_args):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{os.path.join(os.path.abspath(out_dir), 'rendezvous')}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=timedelta(seconds=60),
    )
    try:
        result = train_step(rank, *model_args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    out_dir = sys.argv[1]
    in_features, out_features, pool_kernel_size = (int(a) for a in sys.argv[2:5])
    scale, batch = float(sys.argv[5]), int(sys.argv[6])
    mp.spawn(
        run,
        args=(out_dir, in_features, out_features, pool_kernel_size, scale, batch),
        nprocs=WORLD_SIZE,
        join=True,
    )
