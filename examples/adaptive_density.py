"""Adaptive density on the Horovod drop-in: ``horovodrun -np 2 -H localhost:2 python examples/adaptive_density.py``."""

import torch

import lags_hvd as hvd
from fashion import Net, batches, command_line, loss_fn, report

args = command_line(__doc__)
hvd.init()
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
# fmt: off
# [readme]
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     density="adaptive", min_density=0.001)
# [/readme]
# fmt: on
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
for x, y in batches(args, hvd.rank(), hvd.size()):
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()
    optimizer.step()
report(args, "adaptive", model, hvd.rank())
