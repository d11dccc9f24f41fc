"""LAGS under torchrun, no Horovod: ``torchrun --nproc-per-node 2 examples/torchrun_optimizer.py``."""

from fashion import Net, batches, command_line, loss_fn, report

args = command_line(__doc__)
# fmt: off
# [readme]
import torch
import torch.distributed as dist
import lags_hvd.distributed as lags    # imports no Horovod

dist.init_process_group("gloo")       # "nccl" for CUDA tensors; torchrun sets the rest
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * dist.get_world_size(), momentum=0.9)
optimizer = lags.DistributedOptimizer(optimizer, model.named_parameters(), density=0.001)
lags.broadcast_parameters(model.state_dict(), root_rank=0)
lags.broadcast_optimizer_state(optimizer, root_rank=0)

for x, y in batches(args, dist.get_rank(), dist.get_world_size()):
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()   # the sparse exchanges start inside backward
    optimizer.step()                  # waits, merges, then the SGD update
# [/readme]
# fmt: on
report(args, "torchrun", model, dist.get_rank())
