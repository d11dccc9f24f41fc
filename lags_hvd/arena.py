"""Flat arenas: every exchange unit as a contiguous range of one flat buffer.

Per (dtype, device) the optimizer keeps a few flat buffers of the same layout
(gradients, residuals, staged residuals, and DGC's velocities where used). Each
exchange unit (a bucket of one or more parameters) owns the range ``[start, start +
numel)`` of every such buffer, its members back to back; each parameter owns a
sub-range, whose view of the gradient buffer becomes its ``.grad``. Units are laid
out in the order backprop is expected to produce them (reverse registration order
of their first member), so merging neighbours keeps ranges contiguous.

With every buffer sharing one layout, work that was per unit becomes per arena:
the merge of all units' gathered entries is one ``index_add_`` per rank over the
whole gradient buffer (indices offset by the unit's start), and committing every
staged residual is one swap of two buffers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _kernels
from .layout import ExchangeUnit

__all__ = ["MergedGrads", "MergeTargets", "bind_grads", "copy_into", "Slot", "ArenaLayout", "zero_"]

ArenaKey = tuple[torch.dtype, torch.device]


@dataclass(frozen=True)
class Slot:
    """A contiguous range of one arena."""

    key: ArenaKey
    start: int
    numel: int
    shape: tuple[int, ...] | None = None  # a parameter's range: the parameter's shape

    def of(self, buffers: dict[ArenaKey, torch.Tensor]) -> torch.Tensor:
        """This range of the arena buffer in ``buffers`` (a flat view, no copy)."""
        return buffers[self.key][self.start : self.start + self.numel]

    def shaped(self, buffers: dict[ArenaKey, torch.Tensor]) -> torch.Tensor:
        """``of(buffers)`` in the parameter's shape (flat for a unit's range)."""
        flat = self.of(buffers)
        return flat if self.shape is None else flat.view(self.shape)


class ArenaLayout:
    """Where every unit and every parameter lives in the flat buffers.

    Attributes:
        sizes: elements per arena key.
        unit_slots: unit name -> its range.
        member_slots: unit name -> its members' ranges, in member order.
        member_names: unit name -> its members' parameter names, in member order.
        param_slots: parameter -> its range.
        unit_of: parameter -> the name of its unit.
    """

    def __init__(self, units: list[ExchangeUnit], backprop_order: list[torch.Tensor]):
        position = {p: i for i, p in enumerate(backprop_order)}
        ordered = sorted(units, key=lambda u: min(position[p] for p in u.params))
        self.sizes: dict[ArenaKey, int] = {}
        self.unit_slots: dict[str, Slot] = {}
        self.member_slots: dict[str, list[Slot]] = {}
        self.param_slots: dict[torch.Tensor, Slot] = {}
        self.member_names = {unit.name: list(unit.param_names) for unit in units}
        self.unit_of = {p: unit.name for unit in units for p in unit.params}
        for unit in ordered:
            key = (unit.dtype, unit.device)
            start = self.sizes.get(key, 0)
            self.unit_slots[unit.name] = Slot(key, start, unit.numel)
            members = []
            for p in unit.params:
                members.append(Slot(key, start, p.numel(), tuple(p.shape)))
                self.param_slots[p] = members[-1]
                start += p.numel()
            self.member_slots[unit.name] = members
            self.sizes[key] = start

    def allocate(self) -> dict[ArenaKey, torch.Tensor]:
        """One zeroed flat buffer per arena key."""
        return {key: torch.zeros(size, dtype=key[0], device=key[1]) for key, size in self.sizes.items()}


def zero_(target: torch.Tensor) -> None:
    """``target.zero_()``, for a range of the gradient buffer about to take the merge. A
    contiguous 1-D CPU range outside autograd is zeroed by ``_kernels.zero``: from 1 MiB on
    with stores that bypass the caches, which ``zero_()`` would first fill with the old
    contents (the merge then writes a few entries and the step reads the range once);
    its version counter is advanced as ``zero_()`` would. Any other tensor: ``zero_()``."""
    if (
        target.device.type != "cpu"
        or target.dim() != 1
        or not target.is_contiguous()
        or target.requires_grad
        or target.is_inference()
        or target.is_conj()
        or target.is_neg()
    ):
        target.zero_()
        return
    _kernels.zero(target.view(torch.uint8).numpy())
    torch.autograd.graph.increment_version(target)


class MergeTargets:
    """The ranges of the gradient buffers the sparse units merge into, neighbours joined
    (one view per run of consecutive sparse units), for the k in force; rebuilt only when
    k changes. ``zero(k)`` clears them (the merge adds into zeros)."""

    def __init__(self, layout: ArenaLayout, buffers: dict[ArenaKey, torch.Tensor]):
        self._layout, self._buffers = layout, buffers
        self._views: list[torch.Tensor] = []
        self._for: dict[str, int] | None = None

    def zero(self, k: dict[str, int]) -> None:
        if self._for != k:
            runs = []  # [arena key, start, end]
            slots = sorted(self._layout.unit_slots.items(), key=lambda item: (str(item[1].key), item[1].start))
            for name, slot in slots:
                if k[name] == slot.numel:
                    continue
                if runs and runs[-1][0] == slot.key and runs[-1][2] == slot.start:
                    runs[-1][2] += slot.numel
                else:
                    runs.append([slot.key, slot.start, slot.start + slot.numel])
            self._views = [self._buffers[key][start:end] for key, start, end in runs]
            self._for = dict(k)
        for view in self._views:
            zero_(view)


class MergedGrads:
    """The merged gradients of one bucketing (Megatron's grad buffer): the flat buffers, every
    parameter's view of them (``p.grad`` after a step), every bucket's flat range, and the
    sparse buckets' merge targets."""

    def __init__(self, layout: ArenaLayout):
        self.buffers = layout.allocate()
        self.views = {p: slot.shaped(self.buffers) for p, slot in layout.param_slots.items()}
        self.units = {name: slot.of(self.buffers) for name, slot in layout.unit_slots.items()}
        self.targets = MergeTargets(layout, self.buffers)

    def holds(self, p: torch.Tensor, grad: torch.Tensor) -> bool:
        """Whether ``grad`` is ``p``'s view of the buffer (where ``p.grad`` points after a step)."""
        view = self.views.get(p)
        return (
            view is not None and not grad.is_sparse and grad.data_ptr() == view.data_ptr() and grad.shape == view.shape
        )

    @torch.no_grad()
    def take(self) -> None:
        """Before a rule's step reads the views: copy every ``.grad`` that is not its view into
        it, so that what was done to ``.grad`` since the merge counts, as it does for the wrapped
        optimizer's own step. ``.grad`` is another tensor under DDP (DDP's copy of the merge),
        for a ``torch.sparse`` gradient (handed back as a copy) and where the user replaced it;
        a ``.grad`` set to None counts as zero."""
        for p, view in self.views.items():
            if p.grad is None:
                view.zero_()
            elif not self.holds(p, p.grad):
                view.copy_(p.grad.to_dense() if p.grad.is_sparse else p.grad)


def copy_into(views: list[torch.Tensor], grads) -> None:
    """Bring gradients into their views of a buffer (zeros for None), unless a gradient
    already is its view there (autograd accumulated into it)."""
    for view, g in zip(views, grads):
        if g is None:
            view.zero_()
        elif g.data_ptr() != view.data_ptr() or g.stride() != view.stride():
            view.copy_(g)


def bind_grads(views: dict[torch.Tensor, torch.Tensor], sparse_dims: dict) -> None:
    """Point every ``p.grad`` at its view of the gradient buffer; a gradient that came as
    ``torch.sparse`` (``sparse_dims[p]``: its sparse dimensions) is handed back sparse."""
    for p, view in views.items():
        if p in sparse_dims:  # as it came (nn.Embedding: one sparse dimension)
            p.grad = view.to_sparse(sparse_dims[p])
        elif p.grad is not view:
            p.grad = view
