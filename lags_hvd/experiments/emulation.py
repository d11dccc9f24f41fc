"""An emulated accelerator: a model whose layers take their time on a stated device without
using the CPU, so that the exchanges run on free host cores as they would beside a GPU.

``emulate(name, batch_size, tflops)`` returns a model with the real model's parameters (names,
shapes, order) whose forward and backward pass, layer by layer, *wait* for the layer's time
on the device (``time.sleep``: the core is released) instead of computing. Backward hands each
layer's parameters a gradient from a pool recorded on the real model, so every
post-accumulate-grad hook fires in the real order, at the emulated moment, on a gradient with
a real distribution for top-k. Everything else is real: the optimizer, its selection and
merge, the collectives, the link.

Per layer (a module that owns parameters), with F its forward FLOPs at the batch counted by
``torch.utils.flop_counter`` (on the meta device: nothing is computed)::

    forward  = F / throughput               backward = 2 F / throughput

``throughput`` is the device's effective training rate (5 TFLOP/s: the paper's GPU
generation, as the simulator assumes; 50 TFLOP/s: a recent one). What this leaves out, and
what a real GPU would differ in: element-wise and normalisation kernels (no FLOPs counted;
each layer pays ``LAUNCH_S``), the host work a GPU would take over (the optimizer's update,
top-k, the merge, here on the CPU and reported apart: ``host_cpu``), the copy of the pooled
gradient into ``p.grad`` (device memory on a GPU), and PCIe transfers to and from the NIC.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from .models.registry import MODELS, build

__all__ = ["Layer", "layer_times", "EmulatedModel", "emulate", "LAUNCH_S", "POOL"]

LAUNCH_S = 10e-6
"""Seconds every layer pays per pass besides its FLOPs (kernel launches, element-wise work)."""
POOL = 2
"""Gradients recorded per parameter on the real model, handed out in turn."""
POOL_BATCH = 4
"""The batch the pool is recorded at (the distribution of top-k matters, not the batch)."""


@dataclass(frozen=True)
class Layer:
    """One layer of the emulation: its parameters (names, in registration order) and times."""

    name: str
    params: tuple[str, ...]
    forward_s: float
    backward_s: float


def layer_times(model_name: str, batch_size: int | None, tflops: float) -> list[Layer]:
    """Every module that owns parameters, in registration (forward) order, with its time at
    ``tflops`` for ``batch_size`` samples (None: the paper's; FLOPs counted on two samples on the meta device,
    scaled linearly: these models' FLOPs are linear in the batch)."""
    batch_size, counted = batch_size or MODELS[model_name].paper_batch, 2
    with torch.device("meta"):
        model, batch, loss_fn = build(model_name, counted)
        with FlopCounterMode(display=False) as counter:
            loss_fn(model, batch).backward()
    counts, prefix = counter.get_flop_counts(), type(model).__name__
    scale = batch_size / counted / (tflops * 1e12)
    layers = []
    for path, module in model.named_modules():
        own = tuple(f"{path}.{n}" if path else n for n, _ in module.named_parameters(recurse=False))
        if not own:
            continue
        # a module with parameters of its own and children: its count includes theirs, so none
        counted_children = next(module.children(), None) is not None
        ops = {} if counted_children else counts.get(f"{prefix}.{path}" if path else prefix, {})
        backward = sum(v for op, v in ops.items() if "backward" in str(op))
        forward = sum(ops.values()) - backward
        layers.append(Layer(path or prefix, own, LAUNCH_S + forward * scale, LAUNCH_S + 2 * forward * scale))
    return layers


class _Wait(torch.autograd.Function):
    """One layer: forward waits its time; backward waits its time and returns the pooled
    gradients of the layer's parameters (fresh tensors, so autograd adopts them as ``p.grad``)."""

    @staticmethod
    def forward(ctx, x, layer, pool, *params):
        ctx.layer, ctx.pool = layer, pool
        pool.wait(layer.forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        ctx.pool.wait(ctx.layer.backward_s, starts_pass=ctx.pool.backward_due)
        ctx.pool.backward_due = False
        return (grad, None, None, *ctx.pool.take(ctx.layer.params))


class _Pool:
    """Recorded gradients by parameter name, handed out in turn (one iteration each), and the
    clock of a pass: each layer waits until its deadline (the pass's start plus the layers'
    times so far), so a sleep's overshoot is taken from the next layer's wait, not added."""

    def __init__(self, recorded: list[dict[str, torch.Tensor]]):
        self.recorded, self.turn = recorded, -1  # the first forward pass makes it 0
        self.deadline, self.backward_due = 0.0, False

    def wait(self, seconds: float, starts_pass: bool = False) -> None:
        now = time.perf_counter()
        self.deadline = (now if starts_pass else self.deadline) + seconds
        if self.deadline > now:
            time.sleep(self.deadline - now)

    def take(self, names) -> list[torch.Tensor]:
        grads = self.recorded[self.turn % len(self.recorded)]
        return [grads[n].clone() for n in names]

    def next_iteration(self) -> None:
        """A forward pass begins: its backward takes the next recorded gradients."""
        self.turn += 1


class EmulatedModel(nn.Module):
    """The real model's parameters behind a chain of timed waits (module docstring).

    ``forward(batch)`` returns a scalar whose backward runs the layers in reverse; the
    parameters are the real model's own ``nn.Parameter`` objects, under their real names."""

    def __init__(self, model: nn.Module, layers: list[Layer], pool: _Pool):
        super().__init__()
        self.real = model  # its parameters are ours: named "real.<name>" would differ, see named_parameters
        self.layers, self.pool = layers, pool
        self._by_name = dict(model.named_parameters())

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.real.named_parameters(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        return self.real.state_dict(*args, **kwargs)

    def forward(self, batch=None):
        x = torch.zeros(1, requires_grad=True)
        self.pool.next_iteration()
        self.pool.deadline = time.perf_counter()
        for layer in self.layers:
            x = _Wait.apply(x, layer, self.pool, *(self._by_name[n] for n in layer.params))
        self.pool.backward_due = True
        return x.sum()


@functools.cache
def _recorded(model_name: str, seed: int) -> list[dict[str, torch.Tensor]]:
    """``POOL`` gradients of the real model (its ``seed``'s weights) on batches of ``POOL_BATCH``,
    recorded once per process and shared, read only, by every emulated copy."""
    model, _, loss_fn = build(model_name, POOL_BATCH, seed=seed)
    recorded = []
    for turn in range(POOL):
        _, batch, _ = build(model_name, POOL_BATCH, seed=seed + 1000 * (turn + 1))
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        recorded.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
    return recorded


def emulate(model_name: str, batch_size: int | None, tflops: float, seed: int = 0):
    """``(emulated model, batch, loss_fn)`` like ``models.build``: the real model's parameters,
    the layers' times at ``tflops`` for the batch (default: the paper's), and a pool of
    ``POOL`` gradients recorded on the real model at batch ``POOL_BATCH``."""
    batch_size = batch_size or MODELS[model_name].paper_batch
    model, _, _ = build(model_name, POOL_BATCH, seed=seed)
    emulated = EmulatedModel(model, layer_times(model_name, batch_size, tflops), _Pool(_recorded(model_name, seed)))
    placeholder = (torch.zeros(batch_size, 1), torch.zeros(batch_size, dtype=torch.long))  # its size is the batch
    return emulated, placeholder, lambda m, batch: m(batch)
