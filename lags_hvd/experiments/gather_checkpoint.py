"""What "save on rank 0, load everywhere" costs: ``gathered_state_dict()`` on a model of
``--params`` parameters (default 25.6M, ResNet-50's count) against ``state_dict()``.

    torchrun --standalone --nproc-per-node 2 -m lags_hvd.experiments.gather_checkpoint

Under torch.distributed (Gloo): one LAGS step (the default recipe, SGD with momentum), then
``--repeats`` of each: this rank's ``state_dict()`` alone, the collective
``gathered_state_dict(root_rank=0)``, the sizes of both as ``torch.save`` writes them, and
every rank's ``load_state_dict`` of the gathered one. Rank 0 prints one JSON line (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import lags_hvd.distributed as lags


def model_of(params: int, width: int = 2048) -> nn.Module:
    """Square linear layers of ``width`` up to about ``params`` parameters."""
    layers = max(1, round(params / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])


def timed(call, repeats: int) -> tuple[float, object]:
    """The median seconds of ``repeats`` calls (ranks aligned by a barrier before each), and
    the last call's result."""
    seconds, result = [], None
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        result = call()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds), result


def main(argv=None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", type=int, default=25_600_000)
    parser.add_argument("--width", type=int, default=2048, help="of the square linear layers")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default=None, help="a folder for gather.json (rank 0)")
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = model_of(args.params, args.width)
    base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    optimizer = lags.DistributedOptimizer(base, model.named_parameters(), density=0.01, density_warmup=0)
    optimizer.zero_grad()
    model(torch.randn(8, model[0].in_features)).square().mean().backward()
    optimizer.step()
    own_seconds, own = timed(optimizer.state_dict, args.repeats)
    own_file = io.BytesIO()
    torch.save(own, own_file)
    gather_seconds, gathered = timed(lambda: optimizer.gathered_state_dict(root_rank=0), args.repeats)
    buffer = io.BytesIO()
    if dist.get_rank() == 0:
        torch.save(gathered, buffer)
    payload = [buffer.getvalue()]
    dist.broadcast_object_list(payload, src=0)  # as every rank reading rank 0's file
    load_seconds, _ = timed(lambda: optimizer.load_state_dict(torch.load(io.BytesIO(payload[0]))), args.repeats)
    result = {
        "world": dist.get_world_size(),
        "params": sum(p.numel() for p in model.parameters()),
        "file_bytes": len(payload[0]),
        "own_file_bytes": own_file.tell(),
        "state_dict_s": own_seconds,
        "gathered_state_dict_s": gather_seconds,
        "load_gathered_s": load_seconds,
    }
    if dist.get_rank() != 0:
        return None
    print(json.dumps(result))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "gather.json"), "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
