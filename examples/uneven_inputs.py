"""Ranks with uneven inputs (the last rank has a tenth fewer batches), Horovod's join pattern:
``horovodrun -np 2 -H localhost:2 python examples/uneven_inputs.py``."""

import itertools

import torch

import lags_hvd as hvd
from fashion import Net, batches, command_line, loss_fn, report

args = command_line(__doc__)
hvd.init()
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), density=0.001)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)
fewer = args.steps // 10 if hvd.rank() == hvd.size() - 1 else 0
my_batches = itertools.islice(batches(args, hvd.rank(), hvd.size()), args.steps - fewer)
# fmt: off
# [readme]
for x, y in my_batches:              # as many as this rank has
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()
    optimizer.step()
last = hvd.join()                    # lags_hvd.join, not horovod.torch.join
hvd.broadcast_parameters(model.state_dict(), root_rank=last)
hvd.broadcast_optimizer_state(optimizer, root_rank=last)
# [/readme]
# fmt: on
report(args, "uneven-inputs", model, hvd.rank())
