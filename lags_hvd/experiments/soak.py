"""Soak test: many LAGS-SGD iterations on a small model; memory must stay flat.

    horovodrun -np 2 -H localhost:2 python scripts/soak.py --iterations 2000

Each iteration trains a small conv + MLP model with LAGS-SGD (density 0.01, the
default recipe, momentum, a step learning-rate schedule); every 97th iteration one rank's
gradient is poisoned with NaN (the step is skipped everywhere) and every 250th
the optimizer state goes through a checkpoint round trip in memory. Checked:

* after every step: no exchange in flight, no Horovod handle left, the same
  residual buffers (names and sizes) as after the first step;
* resident memory (RSS) from the end of the warm-up (10% of the iterations, at
  least 50) to the end grows by at most ``--rss-bound-mib`` (8 MiB: a leak of
  4 KiB per iteration over 2,000 iterations exceeds it);
* the number of live tensors is the same at the end as after the warm-up.

Each rank writes ``soak.<rank>.json`` to ``--out`` and exits non-zero on a
violation.
"""

import argparse
import gc
import io
import json
import os
import sys
from pathlib import Path

import horovod.torch.mpi_ops as mpi_ops
import torch
from torch import nn

import lags_hvd as hvd

PAGE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * PAGE


def live_tensors() -> int:
    gc.collect()
    return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def residual_layout(optimizer) -> dict:
    return {n: tuple(r.shape) for n, r in optimizer.lags_state.residuals.state_dict().items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--rss-bound-mib", type=float, default=8.0)
    parser.add_argument("--out", default="runs/soak")
    args = parser.parse_args()
    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 14 * 14, 64), nn.ReLU(), nn.Linear(64, 10)
    )
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # the default recipe, its density warm-up shortened so that the buckets are planned
    # (iteration 30) before the memory baseline is taken
    optimizer = hvd.DistributedOptimizer(
        base, named_parameters=model.named_parameters(), density=0.01, density_warmup=20
    )
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=500, gamma=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    gen = torch.Generator().manual_seed(hvd.rank())
    poison = {"on": False}
    model[3].weight.register_hook(lambda g: torch.full_like(g, float("nan")) if poison["on"] else g)

    warmup = max(50, args.iterations // 10)
    violations, layout, at_warmup = [], None, {}
    for it in range(args.iterations):
        x, y = torch.randn(32, 1, 16, 16, generator=gen), torch.randint(10, (32,), generator=gen)
        poison["on"] = it % 97 == 96 and hvd.rank() == (it // 97) % hvd.size()
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        scheduler.step()
        if it % 250 == 249:
            buffer = io.BytesIO()
            torch.save(optimizer.state_dict(), buffer)
            buffer.seek(0)
            optimizer.load_state_dict(torch.load(buffer, weights_only=True))
        if optimizer.exchanges_in_flight or mpi_ops._handle_map:
            violations.append(
                f"iteration {it}: {optimizer.exchanges_in_flight} exchanges and "
                f"{len(mpi_ops._handle_map)} Horovod handles left after step()"
            )
        layout = layout or residual_layout(optimizer)
        if residual_layout(optimizer) != layout:
            violations.append(f"iteration {it}: the residual buffers changed")
        if it == warmup - 1:
            at_warmup = {"rss": rss_bytes(), "tensors": live_tensors()}
        if len(violations) > 10:
            break
    end = {"rss": rss_bytes(), "tensors": live_tensors()}
    growth_mib = (end["rss"] - at_warmup["rss"]) / 2**20
    if growth_mib > args.rss_bound_mib:
        violations.append(f"RSS grew by {growth_mib:.1f} MiB after the warm-up (bound {args.rss_bound_mib})")
    if end["tensors"] != at_warmup["tensors"]:
        violations.append(f"live tensors: {at_warmup['tensors']} after the warm-up, {end['tensors']} at the end")
    summary = {
        "rank": hvd.rank(),
        "iterations": it + 1,
        "warmup": warmup,
        "rss_warmup_mib": at_warmup["rss"] / 2**20,
        "rss_end_mib": end["rss"] / 2**20,
        "rss_growth_mib": growth_mib,
        "tensors_warmup": at_warmup["tensors"],
        "tensors_end": end["tensors"],
        "skipped_steps": optimizer.skipped_steps,
        "violations": violations,
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / f"soak.{hvd.rank()}.json").write_text(json.dumps(summary, indent=1))
    if hvd.rank() == 0:
        print(json.dumps(summary), flush=True)
    hvd.shutdown()
    if violations:
        print(f"rank {summary['rank']}: " + "; ".join(violations), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
