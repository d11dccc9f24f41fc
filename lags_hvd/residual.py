"""Residual memory (error feedback) for sparsified exchange units.

For one unit with residual ``eps`` and fresh gradient ``g``::

    acc = eps + g              # accumulate(): one fused pass into the staging buffer
                               # (or stage(): the caller writes it, selecting as it goes)
    s   = TopK(acc, k)         # selection.py
    eps = acc - s              # retain(): zero the sent entries of the staged acc

Nothing is lost: per worker, ``sum of everything sent + eps == sum of all g``.
Where a step applies only part c of what was sent (a clip of the merged gradient),
``give_back`` returns the rest, ``eps += (1 - c) s``, and the sum holds for what was
applied.

Updates are transactional. During backprop a hook only *stages* ``acc`` (the
sent entries are zeroed in staging once the merge has read them back, for every
unit of an arena at once: ``retain_positions``); ``commit()`` makes every staged
residual current once the step is known to go ahead, ``discard()`` drops them
when it is skipped (a NaN/Inf somewhere, a GradScaler overflow), leaving every
residual exactly as it was.

Memory is two flat buffers per arena (``arena.ArenaLayout``): the committed
residuals and the staging buffer that ``acc`` is written into. Every unit's
residual is a range of the first, its ``acc`` the same range of the second, so
``commit()`` is one swap of the two buffers (a unit registered but not staged
this iteration is copied across first), and no iteration allocates. The user's
gradient is only read.

Residuals are per rank and are optimizer state: ``state_dict()`` /
``load_state_dict()`` carry them through checkpoints, one flat tensor per
parameter, so a checkpoint does not depend on how parameters are bucketed;
``moved_to`` carries them into a new bucketing in memory.

The same class holds an update rule's own memories (``lags_hvd.updates``): DGC's
velocities under momentum correction (``u = m u + g`` via ``accumulate(residual_scale=m)``;
masking is ``retain``), Adam's moments under Adam correction (``accumulate``, its
square for the second moment); the residual is then accumulated from what the rule computes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from .arena import ArenaLayout

__all__ = ["ResidualMemory"]


class ResidualMemory:
    """Error-feedback memory of the units of one ``ArenaLayout``, keyed by unit name."""

    def __init__(self, layout: ArenaLayout) -> None:
        self._layout = layout
        buffers = (layout.allocate(), layout.allocate())
        # per buffer, every unit's range and its members' ranges, as views made once
        self._units = [{name: slot.of(b) for name, slot in layout.unit_slots.items()} for b in buffers]
        self._members = [
            {name: [slot.shaped(b) for slot in members] for name, members in layout.member_slots.items()}
            for b in buffers
        ]
        self._buffers = buffers
        self._current = 0  # which of the two buffers holds the committed residuals
        self._registered: set[str] = set()
        self._staged: set[str] = set()

    def register(self, name: str) -> None:
        """Give unit ``name`` a residual (zero until something is retained; once)."""
        if name in self._registered:
            raise ValueError(f"residual {name!r} is already registered")
        if name not in self._layout.unit_slots:
            raise ValueError(f"no exchange unit is called {name!r}")
        self._registered.add(name)

    def __contains__(self, name: str) -> bool:
        return name in self._registered

    @property
    def registered(self) -> frozenset[str]:
        """The units that have a residual."""
        return frozenset(self._registered)

    def residual(self, name: str) -> torch.Tensor:
        """The committed residual of ``name`` (a view; staged updates are not visible)."""
        return self._units[self._current][name]

    def members(self, name: str) -> list[torch.Tensor]:
        """The committed residual of ``name`` per member, in member order (views in the
        members' shapes)."""
        return self._members[self._current][name]

    def previous_members(self, name: str) -> list[torch.Tensor]:
        """``members`` as they were before the last ``commit()``: valid until the next
        ``accumulate`` or ``stage`` (the staging buffer holds them until then)."""
        return self._members[1 - self._current][name]

    def accumulate(
        self,
        name: str,
        grad: Sequence[torch.Tensor | None],
        *,
        residual_scale: float = 1.0,
        grad_scale: float = 1.0,
        square: bool = False,
    ) -> torch.Tensor:
        """Stage ``acc = residual_scale * eps + grad_scale * grad`` (``square``: ``grad^2``,
        Adam's second moment) and return it (flat, a view of the staging buffer). ``grad``:
        one tensor of the whole unit, or its members' gradients in member order (None: a
        member without one, taken as zero). One fused pass per part when ``grad_scale`` is 1;
        neither ``eps`` nor ``grad`` changes."""
        current, staging, parts = self._current, 1 - self._current, list(grad)
        eps_views, out_views = self._members[current][name], self._members[staging][name]  # shaped as theirs
        if len(parts) == 1 and len(eps_views) > 1:  # one tensor of the whole unit
            eps_views, out_views = [self._units[current][name]], [self._units[staging][name]]
        if len(parts) != len(eps_views):
            raise ValueError(f"unit {name!r} has {len(eps_views)} members, got {len(parts)} gradients")
        for part, eps, out in zip(parts, eps_views, out_views):
            if part is None:
                torch.mul(eps, residual_scale, out=out)
                continue
            if part.numel() != eps.numel():
                raise ValueError(f"unit {name!r}: a gradient of {part.numel()} entries for a range of {eps.numel()}")
            if part.shape != eps.shape:  # parts of any strides are read as they are: no copy
                eps, out = eps.view(part.shape), out.view(part.shape)
            if square:
                torch.mul(part, part, out=out).mul_(grad_scale).add_(eps, alpha=residual_scale)
            elif grad_scale == 1.0 and residual_scale == 1.0:
                torch.add(part, eps, out=out)
            elif grad_scale == 1.0:
                torch.add(part, eps, alpha=residual_scale, out=out)
            else:
                torch.mul(part, grad_scale, out=out).add_(eps, alpha=residual_scale)
        self._staged.add(name)
        return self._units[staging][name]

    def stage(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``(eps, acc)``: the committed residual of ``name`` and its staging range, flat,
        for a caller that writes ``acc = eps + g`` itself (``selection.add_select``: the
        accumulate and the selection in one pass); ``name`` counts as staged."""
        if name not in self._layout.unit_slots:
            raise ValueError(f"no exchange unit is called {name!r}")
        self._staged.add(name)
        return self._units[self._current][name], self._units[1 - self._current][name]

    def retain(self, name: str, sent_indices: torch.Tensor, where: torch.Tensor | None = None) -> None:
        """Stage ``eps = acc - s``: zero the sent entries of the staged ``acc``; with ``where``
        (a bool per sent index), only those it marks (no data-dependent size, no host read)."""
        staged = self._units[1 - self._current][name]
        if where is None:
            staged.index_fill_(0, sent_indices, 0)
        else:
            staged.index_copy_(0, sent_indices, staged.index_select(0, sent_indices).masked_fill_(where, 0))

    def retain_positions(self, key, positions: torch.Tensor) -> None:
        """``retain`` for many units of one arena at once: zero the staged entries at
        ``positions`` of arena ``key`` (arena offsets, every one in a staged unit)."""
        self._buffers[1 - self._current][key].index_fill_(0, positions, 0)

    def give_back(
        self,
        name: str,
        sent_indices: torch.Tensor,
        sent_values: torch.Tensor,
        applied: torch.Tensor,
        where: torch.Tensor | None = None,
    ) -> None:
        """Stage ``eps[i] += s[i] - c s[i]`` for the sent entries (where ``where`` marks): the
        part of what was sent that the step did not apply, when it applied the fraction c
        (a clip's factor, a 0-d tensor: no host read; ``c s`` rounded as the applied update
        is, so low precision leaks nothing extra). After ``retain``: ``eps = acc - c s``."""
        returned = sent_values - sent_values * applied.to(sent_values.device, sent_values.dtype)
        if where is not None:
            returned = returned * where
        self._units[1 - self._current][name].index_add_(0, sent_indices, returned)

    def drain_into(self, name: str, grad: torch.Tensor, scale: float = 1.0) -> None:
        """Dense exchange: ``grad += scale * eps`` and stage ``eps = 0``, so the residual
        is sent in full."""
        grad.add_(self._units[self._current][name].view_as(grad), alpha=scale)
        self._units[1 - self._current][name].zero_()
        self._staged.add(name)

    def commit(self) -> None:
        """Make every staged residual the current one (registered units not staged keep theirs)."""
        for name in self._registered - self._staged:
            self._units[1 - self._current][name].copy_(self._units[self._current][name])
        self._current = 1 - self._current
        self._staged.clear()

    def discard(self) -> None:
        """Drop every staged residual: the committed ones stay exactly as they were."""
        self._staged.clear()

    def moved_to(self, layout: ArenaLayout) -> ResidualMemory:
        """The same committed residuals in a new layout of the same parameters (buckets
        re-planned): a unit there has a residual when any of its members had one."""
        moved = ResidualMemory(layout)
        for name in sorted({layout.unit_of[p] for p, unit in self._layout.unit_of.items() if unit in self._registered}):
            moved.register(name)
        for p, slot in self._layout.param_slots.items():
            if self._layout.unit_of[p] in self._registered:
                target = layout.param_slots[p]
                target.of(moved._buffers[moved._current]).copy_(slot.of(self._buffers[self._current]))
        return moved

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Every registered unit's committed residual, one copy per parameter (by name)."""
        return {param: view.clone() for param, view in self._parameter_views()}

    def _parameter_views(self):
        for name in sorted(self._registered):
            current = self._units[self._current][name]
            offset = 0
            for param, slot in zip(self._layout.member_names[name], self._layout.member_slots[name]):
                yield param, current[offset : offset + slot.numel]
                offset += slot.numel

    def expected_state(self, units: set[str] | None = None) -> dict[str, tuple[torch.Size, torch.dtype]]:
        """``{parameter name: (shape, dtype)}`` of a state for the given units (default: the
        registered ones)."""
        units = self._registered if units is None else units
        return {
            param: (torch.Size([slot.numel]), slot.key[0])
            for name in units
            for param, slot in zip(self._layout.member_names[name], self._layout.member_slots[name])
        }

    def check_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Raise ValueError unless names, sizes and dtypes match the registered units exactly."""
        self.check_saved(state, self.expected_state())

    @staticmethod
    def check_saved(state, expected: Mapping[str, tuple[torch.Size, torch.dtype]]) -> None:
        """Raise ValueError unless ``state`` holds exactly the ``expected`` {name: (shape, dtype)}."""
        if not isinstance(state, Mapping):
            raise ValueError(f"residual state must be a mapping, got {type(state).__name__}")
        missing = sorted(set(expected) - set(state))
        unexpected = sorted(set(state) - set(expected))
        if missing or unexpected:
            raise ValueError(f"residual state does not match the model: missing {missing}, unexpected {unexpected}")
        for name, saved in state.items():
            shape, dtype = expected[name]
            if not isinstance(saved, torch.Tensor) or saved.shape != shape or saved.dtype != dtype:
                found = (tuple(saved.shape), saved.dtype) if isinstance(saved, torch.Tensor) else type(saved)
                raise ValueError(f"residual {name!r}: expected shape {tuple(shape)} and {dtype}, got {found}")

    def load_state_dict(self, state: Mapping[str, torch.Tensor]) -> None:
        """Copy saved residuals in (after ``check_state_dict``)."""
        self.check_state_dict(state)
        self._staged.clear()
        for param, view in self._parameter_views():
            view.copy_(state[param])

    def reset(self) -> None:
        self._staged.clear()
        for buffer in self._buffers[self._current].values():
            buffer.zero_()
