"""Runs under torchrun: Hugging Face Accelerate's DDP with lags_hook registered on the model
``prepare`` returns (the README's pattern), ``STEPS`` optimizer steps of the same per-rank data
  whole        each step's batch at once
  accumulate   each step's batch in ``MICRO`` micro-batches under ``accelerator.accumulate``
and at density 1.0 the same with Accelerate's own DDP (no hook). Writes ``<run>.<rank>.pt``: the
parameters, the LAGS iterations and Accelerate's ``step`` count."""

import argparse
import os
from pathlib import Path

import torch
from accelerate import Accelerator

from lags_hvd.ddp import LAGSHookState, lags_hook

torch.set_num_threads(1)
STEPS, BATCH, MICRO = 6, 16, 4


def run(out: Path, name: str, micro: int, density: float | None) -> None:
    accelerator = Accelerator(gradient_accumulation_steps=micro, cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model, optimizer = accelerator.prepare(model, optimizer)
    state = None
    if density is not None:
        named = accelerator.unwrap_model(model).named_parameters()
        state = LAGSHookState(named_parameters=named, optimizer=optimizer.optimizer, density=density)
        model.register_comm_hook(state, lags_hook)
    g = torch.Generator().manual_seed(1 + accelerator.process_index)
    for _ in range(STEPS):
        x, y = torch.randn(BATCH, 10, generator=g), torch.randn(BATCH, 3, generator=g)
        for micro_x, micro_y in zip(x.chunk(micro), y.chunk(micro)):
            with accelerator.accumulate(model):
                accelerator.backward(torch.nn.functional.mse_loss(model(micro_x), micro_y))
                optimizer.step()
                optimizer.zero_grad()
    saved = {
        "params": [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()],
        "iterations": None if state is None else state.iteration,
    }
    torch.save(saved, out / f"{name}.{accelerator.process_index}.pt")
    accelerator.free_memory()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    out = parser.parse_args().out
    run(out, "whole", 1, 0.1)
    run(out, "accumulate", MICRO, 0.1)
    run(out, "dense-accumulate", MICRO, None)
    run(out, "lags1-accumulate", MICRO, 1.0)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
