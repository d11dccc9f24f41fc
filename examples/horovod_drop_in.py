"""The Horovod drop-in: ``horovodrun -np 2 -H localhost:2 python examples/horovod_drop_in.py``."""

from fashion import Net, batches, command_line, loss_fn, report

args = command_line(__doc__)
# fmt: off
# [readme]
import torch
import lags_hvd as hvd            # was: import horovod.torch as hvd

hvd.init()
model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     density=0.001)   # LAGS options are keyword-only
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

for x, y in batches(args, hvd.rank(), hvd.size()):
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()   # sparse exchanges start inside backward
    optimizer.step()                  # waits, merges, then the SGD update
# [/readme]
# fmt: on
report(args, "horovod", model, hvd.rank())
