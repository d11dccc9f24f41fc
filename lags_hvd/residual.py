"""Residual memory (error feedback) for sparsified exchange units.

For one unit with residual ``eps`` and fresh gradient ``g``::

    acc = eps + g              # accumulate(): written over g's buffer; eps untouched
    s   = TopK(acc, k)         # selection.py
    eps = acc - s              # retain(): zero the sent entries of acc, stage it

Nothing is lost: per worker, ``sum of everything sent + eps == sum of all g``.

Updates are transactional. During backprop a hook only *stages* the next
residual; ``commit()`` makes every staged residual current once the step is known
to go ahead, ``discard()`` drops them when it is skipped (a NaN/Inf somewhere, a
GradScaler overflow), leaving every residual exactly as it was. Staging costs no
copy and no memory: ``acc`` lives in the gradient's own buffer, which becomes
the residual on commit (the old residual buffer is released).

Residuals are per rank and are optimizer state: ``state_dict()`` /
``load_state_dict()`` carry them through checkpoints.

The same class holds DGC's velocities under ``momentum_correction`` (``u = m u + g``
via ``accumulate(residual_scale=m)``; masking is ``retain``; a dense unit's velocity
is staged whole with ``keep``). There the residual is updated from the velocity,
``acc = eps + u``, which must not overwrite ``u``: ``accumulate_into_spare`` writes
``acc`` into a spare buffer, and each commit recycles the replaced buffer as the
next spare, so no iteration allocates.
"""
from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = ["ResidualMemory"]


class ResidualMemory:
    """One flat residual buffer per exchange unit, keyed by the unit's name."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._staged: dict[str, torch.Tensor | None] = {}   # None: becomes zero on commit
        self._spare: dict[str, torch.Tensor | None] = {}    # recycled buffers (accumulate_into_spare)

    def register(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        """Allocate a zero residual for ``name`` (once; a second call is an error)."""
        if name in self._buffers:
            raise ValueError(f"residual {name!r} is already registered")
        self._buffers[name] = torch.zeros(numel, dtype=dtype, device=device)

    def __contains__(self, name: str) -> bool:
        return name in self._buffers

    def residual(self, name: str) -> torch.Tensor:
        """The committed residual of ``name`` (staged updates are not visible)."""
        return self._buffers[name]

    def accumulate(self, name: str, grad: torch.Tensor, *, residual_scale: float = 1.0,
                   grad_scale: float = 1.0) -> torch.Tensor:
        """``acc = residual_scale * eps + grad_scale * grad``, flat, written over ``grad``'s
        buffer (a copy only when ``grad`` is not contiguous). ``eps`` is not modified."""
        acc = grad.reshape(-1)
        if grad_scale != 1.0:
            acc.mul_(grad_scale)
        return acc.add_(self._buffers[name], alpha=residual_scale)

    def accumulate_into_spare(self, name: str, x: torch.Tensor) -> torch.Tensor:
        """``acc = eps + x`` in a spare buffer; neither ``eps`` nor ``x`` is modified."""
        buffer = self._buffers[name]
        spare = self._spare.get(name)
        if spare is None:
            spare = torch.empty_like(buffer)
        self._spare[name] = None     # in use until commit() or discard() hands a buffer back
        return torch.add(buffer, x.reshape(-1), out=spare)

    def keep(self, name: str, x: torch.Tensor) -> None:
        """Stage ``x`` (flat, as it is) as the next value of ``name``."""
        self._staged[name] = x.reshape(-1)

    def retain(self, name: str, acc: torch.Tensor, sent_indices: torch.Tensor) -> None:
        """Stage ``eps = acc - s``: zero the sent entries of ``acc``, which becomes the
        residual on ``commit()``. ``acc`` must not be used for anything else afterwards."""
        buffer = self._buffers[name]
        if acc.shape != buffer.shape or acc.dtype != buffer.dtype:
            raise ValueError(f"residual {name!r}: acc of shape {tuple(acc.shape)} and {acc.dtype} "
                             f"does not fit {tuple(buffer.shape)} and {buffer.dtype}")
        self._staged[name] = acc.index_fill_(0, sent_indices, 0)

    def drain_into(self, name: str, grad: torch.Tensor, scale: float = 1.0) -> None:
        """Dense exchange: ``grad += scale * eps`` and stage ``eps = 0``, so the residual
        is sent in full."""
        grad.add_(self._buffers[name].view_as(grad), alpha=scale)
        self._staged[name] = None

    def commit(self) -> None:
        """Make every staged residual the current one."""
        for name, staged in self._staged.items():
            if staged is None:
                self._buffers[name].zero_()
            else:
                if name in self._spare:
                    self._spare[name] = self._buffers[name]
                self._buffers[name] = staged
        self._staged.clear()

    def discard(self) -> None:
        """Drop every staged residual: the committed ones stay exactly as they were."""
        for name, staged in self._staged.items():
            if name in self._spare and staged is not None:
                self._spare[name] = staged
        self._staged.clear()

    def state_dict(self) -> dict[str, torch.Tensor]:
        return dict(self._buffers)

    def check_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Raise ValueError unless names, sizes and dtypes match these buffers exactly."""
        self.check_saved(state, {name: (b.shape, b.dtype) for name, b in self._buffers.items()})

    @staticmethod
    def check_saved(state, expected: Mapping[str, tuple[torch.Size, torch.dtype]]) -> None:
        """Raise ValueError unless ``state`` holds exactly the ``expected`` {name: (shape, dtype)}."""
        if not isinstance(state, Mapping):
            raise ValueError(f"residual state must be a mapping, got {type(state).__name__}")
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"residual state does not match the model: missing {missing}, "
                             f"unexpected {unexpected}")
        for name, saved in state.items():
            shape, dtype = expected[name]
            if not isinstance(saved, torch.Tensor) or saved.shape != shape or saved.dtype != dtype:
                found = (tuple(saved.shape), saved.dtype) if isinstance(saved, torch.Tensor) else type(saved)
                raise ValueError(f"residual {name!r}: expected shape {tuple(shape)} and {dtype}, got {found}")

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy saved residuals in (after ``check_state_dict``)."""
        self.check_state_dict(state)
        self._staged.clear()
        for name, saved in state.items():
            self._buffers[name].copy_(saved)

    def reset(self) -> None:
        self._staged.clear()
        for buffer in self._buffers.values():
            buffer.zero_()
