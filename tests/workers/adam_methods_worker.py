"""One rank of tests/test_adam_methods.py's jobs: every Adam method of the frontier through
``groups.Collective`` (this rank's worker, the collectives of its launcher) against the
one-process study's ``groups.Simulated`` over all P workers on the same gradients. Writes
``<rank>.json``: per method, the largest difference between this rank's parameters and its
simulated worker's after ``STEPS`` steps, and both word counts.

    python adam_methods_worker.py --out DIR
"""

import argparse
import json
import os
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from backend import BACKEND, hvd  # noqa: E402

from lags_hvd.experiments.adam_methods import parse_method  # noqa: E402
from lags_hvd.experiments.groups import Collective  # noqa: E402

SPECS = [
    "dense",
    "lags:density=0.1,density_warmup=2",
    "lags:density=0.1,rule=consensus",
    "lags:density=0.1,echo=1",
    "lags:density=0.1,average_every=3",
    "zero-one:variance_scaler=1,freeze=4,local_scaler=1",
    "demo:topk=3,chunk=4",
    "diloco:every=2",
    "sparseloco:every=2,topk=2,chunk=4",
    "powersgd:rank=1,start=1",
]
SHAPES = [(8, 6), (6,), (4, 3, 2)]
STEPS = 6


def gradient(step: int, worker: int, i: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * step + 10 * worker + i)
    return torch.randn(SHAPES[i], generator=generator)


def run(spec: str, size: int, rank: int, collectives) -> dict:
    cls, options = parse_method(spec)
    settings = types.SimpleNamespace(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    start = [torch.randn(shape, generator=torch.Generator().manual_seed(i)) for i, shape in enumerate(SHAPES)]
    simulated = [[torch.nn.Parameter(x.clone()) for x in start] for _ in range(size)]
    mine = [[torch.nn.Parameter(x.clone()) for x in start]]
    methods = cls(simulated, settings, options), cls(mine, settings, options, Collective(collectives, timeout=60))
    for step in range(STEPS):
        for p, params in enumerate(simulated):
            for i, x in enumerate(params):
                x.grad = gradient(step, p, i)
        for i, x in enumerate(mine[0]):
            x.grad = gradient(step, rank, i)
        lr = 0.01 * (step + 1)
        for method in methods:
            method.step(step, lr)
    differences = [float((a - b).abs().max()) for a, b in zip(mine[0], simulated[rank])]
    return {"difference": max(differences), "words": [m.words for m in methods]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    hvd.init()
    if BACKEND == "torch":
        from lags_hvd.collectives.torch_distributed import TorchDistributedCollectives

        collectives = TorchDistributedCollectives()
    else:
        from lags_hvd.collectives.horovod import HorovodCollectives

        collectives = HorovodCollectives()
    results = {spec: run(spec, collectives.size, collectives.rank, collectives) for spec in SPECS}
    (args.out / f"{collectives.rank}.json").write_text(json.dumps(results))
    hvd.shutdown()


if __name__ == "__main__":
    main()
