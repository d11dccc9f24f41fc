"""``Bucket``: the per-bucket step of LAGS, the one place every door runs it.

For bucket u on worker p, ``start`` (called from the hook of u's last member, from a DDP
bucket's report, or by ``lags_hvd.join()`` with nothing to give)::

    1. transforms      a torch.sparse gradient made dense; local_clip's share of the clip
    2. the rule        v = rule.local(g)        g itself, or the corrected velocity or Adam step
    3. sparse u        acc = r eps + v / S       staged in the residual memory (r: the lr ratio
                       s = TopK(acc, k_u)        under lr_scaled_residual, else 1)
       dense u         grad_u = v + eps          the residual drained; sent whole
    4. the launch      what the aggregation sends: s (times S) at its indices, or grad_u

S is the GradScaler's scale (1 without one). With ``cuda_graphs``, step 3 of a sparse bucket
and the packing of its message are the replay of one CUDA graph (``lags_hvd.capture``), and
step 4 the collective's launch alone. Nothing is read to the host: a NaN or Inf
reaches the selected values and so every rank's merge, where ``Engine.finish`` checks all
buckets at once. What follows the launch is about all buckets and so the engine's: the
order of the collectives, the batched merge, and the commit or discard of the staged
residuals (``LAGSState.commit``, ``discard``: every bucket's at once, in one flip).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from . import capture, selection, transforms
from .aggregation import Aggregation
from .arena import copy_into
from .layout import ExchangeUnit
from .state import LAGSState

__all__ = ["Bucket", "Launch"]


class Launch(NamedTuple):
    """A bucket's contribution, ready for its aggregation's ``start``.

    ``values`` go on the wire (times the loss scale); ``indices`` are None for a bucket sent
    whole; ``unscaled`` are the values without the loss scale (the clip's give-back);
    ``acc`` the accumulated vector the selection read (the delta monitor's input, unscaled);
    ``packed`` the message already written (``Aggregation.packer``), or None."""

    unit: ExchangeUnit
    aggregation: Aggregation
    values: torch.Tensor
    indices: torch.Tensor | None
    unscaled: torch.Tensor | None
    acc: torch.Tensor | None
    packed: object = None  # the message, where a packer wrote it (``Aggregation.send`` launches it)


class Bucket:
    """One bucket of one bucketing: its unit, its range of the merge buffer and the members'
    views of it, its local clip, and the two aggregations it may go by (sparse, or dense at
    k = numel). The residuals and the rule's memories are the ``state``'s, by the bucket's name.
    """

    def __init__(
        self,
        unit: ExchangeUnit,
        grad: torch.Tensor,
        views: list[torch.Tensor],
        context,
        state: LAGSState,
        aggregations: tuple[Aggregation, Aggregation],
        clip_norm: float | None,
    ):
        self.unit, self.grad, self.views = unit, grad, views
        self._context, self._state = context, state
        self._sparse, self._dense = aggregations
        self._clip_norm = clip_norm
        graphs = context.options.cuda_graphs and capture.capturable(unit.device)
        self.graphs = capture.BucketGraphs(capture.cuda_graph) if graphs else None
        """Its hook's device work as CUDA graphs (``cuda_graphs=True`` on CUDA), else None."""
        self._packer_at: tuple | None = None  # (k, the aggregation's packer at k)

    @property
    def dense(self) -> bool:
        """Sent whole in this iteration (its k is its size, or a dense policy holds it)."""
        return self._state.is_dense(self.unit)

    def start(self, scale: float, lr_ratio) -> Launch:
        """Steps 1 to 4 of the module docstring on the members' ``.grad`` (loss scale
        ``scale``); ``lr_ratio()`` is r, read only where ``lr_scaled_residual`` needs it."""
        if torch.is_grad_enabled():  # synchronize() outside step(); a hook runs with it off
            with torch.no_grad():
                return self.start(scale, lr_ratio)
        unit, context, state = self.unit, self._context, self._state
        transforms.densify(unit.params, unit.param_names, context.sparse_grads, context.sparse_as_dense)
        transforms.clip_locally(unit.params, self._clip_norm, scale)
        rule, group = context.rule, context.param_groups[unit.group_index]
        if self.dense:
            parts, factor = rule.local(unit, group, scale, state, True, self.grad)
            whole = parts[0] if len(parts) == 1 else None
            if whole is not None and whole.dim() == 1 and whole.numel() == unit.numel:
                torch.mul(whole, factor * scale, out=self.grad)
            else:  # the members' gradients as they are (factor is 1 / scale)
                copy_into(self.views, parts)
                if factor * scale != 1.0:
                    self.grad.mul_(factor * scale)
            if unit.name in state.residuals:
                state.residuals.drain_into(unit.name, self.grad, scale)
            return Launch(unit, self._dense, self.grad, None, None, None)
        residual_scale = 1.0 if rule.steps_itself or not context.options.lr_scaled_residual else lr_ratio()
        k, select = state.k[unit.name], self._sparse.selector(unit)
        if self.graphs is not None and select in capture.CAPTURABLE:
            return self._replayed(group, scale, residual_scale, k)
        parts, factor = rule.local(unit, group, scale, state, False, self.grad)
        acc, values, indices = selection.accumulate_select(
            state.residuals, unit.name, parts, k, factor, residual_scale, select
        )
        return Launch(unit, self._sparse, values * scale if scale != 1.0 else values, indices, values, acc)

    def _replayed(self, group: dict, scale: float, residual_scale: float, k: int) -> Launch:
        """Steps 2 and 3 and the packing replayed from the bucket's CUDA graph
        (``lags_hvd.capture``): the rule's own work in it too where the rule can be replayed
        (``UpdateRule.replayed``: the members' gradients are the graph's inputs), else the
        rule's result is."""
        unit, state, rule = self.unit, self._state, self._context.rule
        baked = rule.replayed(unit, group, scale, state)
        if baked is not None:
            inputs = [p.grad for p in unit.params]

            def prologue(*_grads):  # reads the .grad the inputs are
                return rule.local(unit, group, scale, state, False, self.grad)

        else:
            inputs, baked = rule.local(unit, group, scale, state, False, self.grad)

            def prologue(*parts, factor=baked):
                return parts, factor

        packer = self._packer(k)
        acc, values, indices, sent = self.graphs(
            state.residuals, unit.name, inputs, prologue, baked, k, residual_scale, scale, packer
        )
        return Launch(unit, self._sparse, sent, indices, values, acc, packer and packer.packed)

    def _packer(self, k: int):
        """The sparse aggregation's ``packer`` at k, kept while k stays (its message's buffer)."""
        if self._packer_at is None or self._packer_at[0] != k:
            self._packer_at = (k, self._sparse.packer(self.unit, k))
        return self._packer_at[1]

    def nothing(self) -> Launch:
        """A rank in ``lags_hvd.join()``: a contribution of nothing, at the k in force and
        shaped as the aggregation expects (zeros at distinct indices, or a zero bucket)."""
        unit = self.unit
        aggregation = self._dense if self.dense else self._sparse
        values, indices = aggregation.nothing(unit, self._state.k[unit.name])
        return Launch(unit, aggregation, values, indices, values, None)
