"""Residual memory (error feedback) for sparsified exchange units.

For one unit with residual ``eps`` and fresh gradient ``g``::

    acc = eps + g              # accumulate():  in place, the buffer becomes acc
    s   = TopK(acc, k)         # selection.py
    eps = acc - s              # retain(): zero the sent entries of the buffer

Nothing is lost: per worker, ``sum of everything sent + eps == sum of all g``.
The buffers are allocated once, when a unit is registered, so the backward hook
allocates nothing residual-sized. Residuals are per rank and are optimizer
state: ``state_dict()`` / ``load_state_dict()`` carry them through checkpoints.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["ResidualMemory"]


class ResidualMemory:
    """One flat residual buffer per exchange unit, keyed by the unit's name."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}

    def register(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate a zero residual for ``name`` (once; a second call is an error)."""
        if name in self._buffers:
            raise ValueError(f"residual {name!r} is already registered")
        self._buffers[name] = torch.zeros(numel, dtype=dtype, device=device)

    def __contains__(self, name: str) -> bool:
        return name in self._buffers

    def residual(self, name: str) -> torch.Tensor:
        return self._buffers[name]

    def accumulate(self, name: str, grad: torch.Tensor) -> torch.Tensor:
        """``eps += grad`` in place; returns the buffer, which now holds ``acc``."""
        return self._buffers[name].add_(grad.reshape(-1))

    def retain(self, name: str, sent_indices: torch.Tensor) -> None:
        """``eps = acc - s``: zero the entries that were sent."""
        self._buffers[name].index_fill_(0, sent_indices, 0)

    def drain_into(self, name: str, grad: torch.Tensor) -> None:
        """Dense exchange: ``grad += eps`` and ``eps = 0``, so the residual is sent in full."""
        buffer = self._buffers[name]
        grad.add_(buffer.view_as(grad))
        buffer.zero_()

    def scale_(self, name: str, factor: float) -> None:
        self._buffers[name].mul_(factor)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._buffers)

    def check_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Raise ValueError unless names, sizes and dtypes match exactly."""
        missing = sorted(set(self._buffers) - set(state))
        unexpected = sorted(set(state) - set(self._buffers))
        if missing or unexpected:
            raise ValueError(f"residual state does not match the model: missing {missing}, "
                             f"unexpected {unexpected}")
        for name, saved in state.items():
            buffer = self._buffers[name]
            if not isinstance(saved, torch.Tensor) or saved.shape != buffer.shape or saved.dtype != buffer.dtype:
                found = (tuple(saved.shape), saved.dtype) if isinstance(saved, torch.Tensor) else type(saved)
                raise ValueError(f"residual {name!r}: expected shape {tuple(buffer.shape)} and "
                                 f"{buffer.dtype}, got {found}")

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy saved residuals in (after ``check_state_dict``)."""
        self.check_state_dict(state)
        for name, saved in state.items():
            self._buffers[name].copy_(saved)

    def reset(self) -> None:
        for buffer in self._buffers.values():
            buffer.zero_()
