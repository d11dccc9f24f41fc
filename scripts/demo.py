"""Smallest end-to-end example: an MLP learns a synthetic classification task with LAGS-SGD.

    horovodrun -np 2 -H localhost:2 python scripts/demo.py

Each rank draws its own data from the same teacher network; rank 0 prints the
average training loss, which falls. The only change from a Horovod script is
the import.
"""

import argparse

import torch
from torch import nn

import lags_hvd as hvd


def teacher_batch(teacher: nn.Module, batch_size: int, gen: torch.Generator):
    x = torch.randn(batch_size, 32, generator=gen)
    with torch.no_grad():
        y = teacher(x).argmax(dim=1)
    return x, y


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--density", type=float, default=0.01)
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    teacher = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 10))
    model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(), density=args.density)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    gen = torch.Generator().manual_seed(1 + hvd.rank())
    running = []
    for step in range(1, args.steps + 1):
        x, y = teacher_batch(teacher, args.batch_size, gen)
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        running.append(loss.detach())
        if step % 50 == 0:
            average = hvd.allreduce(torch.stack(running).mean(), name="demo.loss").item()
            running.clear()
            if hvd.rank() == 0:
                print(f"step {step:4d}  loss {average:.4f}  (P={hvd.size()}, density={args.density})", flush=True)


if __name__ == "__main__":
    main()
