"""A tiny model and per-rank data shared by the workers and the oracle (test code only)."""

import torch
from torch import nn

LR, MOMENTUM, WEIGHT_DECAY = 0.1, 0.9, 1e-4
DENSITY = 0.1
# conv.weight goes dense (k = d); fc.bias sends a single entry (k = 1).
LAYER_DENSITIES = {"conv.weight": 1.0, "fc.bias": 0.01}
UNUSED_ON_RANK = 1  # `aux` is skipped in the forward pass on this rank


class TinyNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3)  # 27 + 3
        self.fc = nn.Linear(3 * 4 * 4, 5)  # 240 + 5
        self.aux = nn.Linear(5, 5, bias=False)  # 25, unused on one rank
        self.shift = nn.Parameter(torch.zeros(5))

    def forward(self, x, use_aux=True):
        h = self.fc(torch.relu(self.conv(x)).flatten(1)) + self.shift
        return h + self.aux(h) if use_aux else h


def make_model(seed: int = 0) -> TinyNet:
    torch.manual_seed(seed)
    return TinyNet()


def batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(4, 1, 6, 6, generator=gen), torch.randn(4, 5, generator=gen)


def uses_aux(rank: int, step: int, sometimes: bool = False) -> bool:
    """Never on UNUSED_ON_RANK; with ``sometimes``, also not on every third step."""
    return rank != UNUSED_ON_RANK and not (sometimes and step % 3 == 2)


def loss_of(model: TinyNet, rank: int, step: int, sometimes: bool = False):
    device = next(model.parameters()).device
    x, y = (t.to(device) for t in batch(rank, step))
    return nn.functional.mse_loss(model(x, use_aux=uses_aux(rank, step, sometimes)), y)


def gradients(model: TinyNet, rank: int, step: int, sometimes: bool = False) -> dict:
    """This rank's raw gradients at ``step`` (None for parameters the rank did not use)."""
    model.zero_grad(set_to_none=True)
    loss_of(model, rank, step, sometimes).backward()
    return {n: (p.grad.detach().clone() if p.grad is not None else None) for n, p in model.named_parameters()}
