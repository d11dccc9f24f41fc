"""Save on rank 0, load everywhere, bit for bit: half the steps, a checkpoint, a fresh model and
optimizer loaded from it, the other half.
``horovodrun -np 2 -H localhost:2 python examples/checkpoint_rank0.py``."""

import tempfile
from pathlib import Path

import torch

import lags_hvd as hvd
from fashion import Net, batches, command_line, loss_fn, report


def job():
    """The model and optimizer a job starts with."""
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), density=0.001)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    return model, optimizer


def train(model, optimizer, my_batches, steps: int) -> None:
    for _, (x, y) in zip(range(steps), my_batches):
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        optimizer.step()


args = command_line(__doc__)
hvd.init()
folder = hvd.broadcast_object(tempfile.mkdtemp() if hvd.rank() == 0 else None, root_rank=0)
path = Path(folder) / "checkpoint.pt"
my_batches = batches(args, hvd.rank(), hvd.size())
model, optimizer = job()
train(model, optimizer, my_batches, args.steps // 2)
# fmt: off
# [readme]
state = optimizer.gathered_state_dict(root_rank=0)   # every rank's residuals, on rank 0
if hvd.rank() == 0:
    torch.save({"model": model.state_dict(), "optimizer": state}, path)
# [/readme]
# fmt: on
hvd.barrier()  # the file is written before the "later" job below reads it
model, optimizer = job()
# fmt: off
# [readme]
checkpoint = torch.load(path)
model.load_state_dict(checkpoint["model"])
optimizer.load_state_dict(checkpoint["optimizer"])   # each rank takes its own part
# [/readme]
# fmt: on
train(model, optimizer, my_batches, args.steps - args.steps // 2)
report(args, "checkpoint", model, hvd.rank())
