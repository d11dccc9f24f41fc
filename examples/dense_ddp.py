"""The examples' reference: plain DistributedDataParallel, every gradient averaged whole.
``torchrun --nproc-per-node 2 examples/dense_ddp.py --lr 0.1`` (the per-worker lr times P)."""

import torch
import torch.distributed as dist

from fashion import Net, batches, command_line, loss_fn, report

args = command_line(__doc__)
dist.init_process_group("gloo")
model = torch.nn.parallel.DistributedDataParallel(Net())
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * dist.get_world_size(), momentum=0.9)
for x, y in batches(args, dist.get_rank(), dist.get_world_size()):
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()
    optimizer.step()
report(args, "dense-ddp", model.module, dist.get_rank())
