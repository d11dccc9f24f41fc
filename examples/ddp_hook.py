"""The DDP hook on an existing DDP job: ``torchrun --nproc-per-node 2 examples/ddp_hook.py``."""

import torch.distributed as dist

from fashion import Net, batches, command_line, loss_fn, report

args = command_line(__doc__)
dist.init_process_group("gloo")
# fmt: off
# [readme]
import torch
from lags_hvd.ddp import LAGSHookState, lags_hook

model = torch.nn.parallel.DistributedDataParallel(Net())
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * dist.get_world_size(), momentum=0.9)  # or AdamW
model.register_comm_hook(LAGSHookState(named_parameters=model.module.named_parameters(),
                                       optimizer=optimizer, density=0.001), lags_hook)
# the loop is unchanged:
for x, y in batches(args, dist.get_rank(), dist.get_world_size()):
    optimizer.zero_grad()
    loss_fn(model(x), y).backward()
    optimizer.step()
# [/readme]
# fmt: on
report(args, "ddp-hook", model.module, dist.get_rank())
