"""Mixed precision with a GradScaler on the Horovod drop-in: float16 autocast on a GPU, bfloat16 on
the CPU (whose float16 kernels are slow): ``horovodrun -np 2 -H localhost:2 python examples/mixed_precision.py``."""

import torch

import lags_hvd as hvd
from fashion import Net, batches, command_line, loss_fn, report

args = command_line(__doc__)
hvd.init()
device = "cuda" if torch.cuda.is_available() else "cpu"
half = torch.float16 if device == "cuda" else torch.bfloat16
model = Net().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
# fmt: off
# [readme]
scaler = torch.amp.GradScaler(device)
optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                     grad_scaler=scaler)

for x, y in batches(args, hvd.rank(), hvd.size()):
    optimizer.zero_grad()
    with torch.autocast(device, dtype=half):
        loss = loss_fn(model(x.to(device)), y.to(device))
    scaler.scale(loss).backward()
    optimizer.synchronize()
    scaler.unscale_(optimizer)             # optional: clip here
    with optimizer.skip_synchronize():
        scaler.step(optimizer)
    scaler.update()
# [/readme]
# fmt: on
report(args, "mixed-precision", model.cpu(), hvd.rank())
