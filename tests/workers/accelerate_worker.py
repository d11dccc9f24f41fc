"""Runs under torchrun: Hugging Face Accelerate's DDP with lags_hook registered on the model
``prepare`` returns (the README's pattern), ``STEPS`` optimizer steps of the same per-rank data
  whole        each step's batch at once
  accumulate   each step's batch in ``MICRO`` micro-batches under ``accelerator.accumulate``
and at density 1.0 the same with Accelerate's own DDP (no hook); and whole batches under a GradScaler
(what ``mixed_precision="fp16"`` makes on a GPU), with the optimizer wrapped before Accelerate
prepares it (the README's order), and after (refused at the first step). Writes ``<run>.<rank>.pt``: the
parameters, the LAGS iterations and Accelerate's ``step`` count."""

import argparse
import os
from pathlib import Path

import torch
from accelerate import Accelerator

from lags_hvd.ddp import LAGSHookState, lags_hook

torch.set_num_threads(1)
STEPS, BATCH, MICRO = 6, 16, 4


def run(out: Path, name: str, micro: int, density: float | None, scaled=False, wrapped_first=True) -> None:
    """The README's pattern: the model prepared, the optimizer wrapped, then prepared. ``scaled``:
    the GradScaler fp16 would make on a GPU (a scale doubling every 2 steps), in float32;
    ``wrapped_first`` False: the optimizer prepared with the model, before it was wrapped."""
    accelerator = Accelerator(gradient_accumulation_steps=micro, cpu=True)
    if scaled:
        accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    if not wrapped_first:
        model, optimizer = accelerator.prepare(model, optimizer)
        optimizer, prepared = optimizer.optimizer, optimizer
    else:
        model = accelerator.prepare(model)
    state = None
    if density is not None:
        named = accelerator.unwrap_model(model).named_parameters()
        state = LAGSHookState(
            named_parameters=named, optimizer=optimizer, density=density, grad_scaler=accelerator.scaler
        )
        model.register_comm_hook(state, lags_hook)
    if wrapped_first:
        prepared = accelerator.prepare(optimizer)
    g = torch.Generator().manual_seed(1 + accelerator.process_index)
    refused = None
    try:
        for _ in range(STEPS):
            x, y = torch.randn(BATCH, 10, generator=g), torch.randn(BATCH, 3, generator=g)
            for micro_x, micro_y in zip(x.chunk(micro), y.chunk(micro)):
                with accelerator.accumulate(model):
                    accelerator.backward(torch.nn.functional.mse_loss(model(micro_x), micro_y))
                    prepared.step()
                    prepared.zero_grad()
    except RuntimeError as error:
        refused = str(error)
    saved = {
        "params": [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()],
        "iterations": None if state is None else state.iteration,
        "scale": accelerator.scaler.get_scale() if scaled else None,
        "refused": refused,
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
    run(out, "scaled", 1, 0.1, scaled=True)
    run(out, "scaled-prepared-first", 1, 0.1, scaled=True, wrapped_first=False)


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
