"""Horovod's API for LAGS-SGD: ``import lags_hvd as hvd`` in place of ``import horovod.torch as hvd``.

``DistributedOptimizer`` and ``TopKDistributedOptimizer`` take ``hvd.DistributedOptimizer``'s
arguments in its order and exchange over a Horovod process set
(``collectives.horovod``); ``broadcast_optimizer_state`` and ``join`` are Horovod's, made to
share the LAGS state and to keep joined ranks in the exchanges; ``broadcast_object`` is
Horovod's with a default name that is the same on every rank. The optimizer itself
(``optimizer``) knows no backend.
"""

from __future__ import annotations

import horovod.torch as hvd

from .collectives.horovod import HorovodCollectives
from .density import ADAPTIVE
from .optimizer import Wiring, _LAGSOptimizer, wrap
from .uneven import join_all

__all__ = ["DistributedOptimizer", "TopKDistributedOptimizer", "broadcast_object", "broadcast_optimizer_state", "join"]


def DistributedOptimizer(
    optimizer,
    named_parameters=None,
    compression=hvd.Compression.none,
    backward_passes_per_step=1,
    op=hvd.Average,
    gradient_predivide_factor=1.0,
    num_groups=0,
    groups=None,
    sparse_as_dense=False,
    process_set=hvd.global_process_set,
    **lags_options,
):
    """Wrap ``optimizer`` so that gradients are exchanged with LAGS-SGD.

    The positional arguments are ``hvd.DistributedOptimizer``'s, in its order:

    Args:
        optimizer: the ``torch.optim.Optimizer`` to wrap; it is re-classed in place
            and returned, its state kept.
        named_parameters: ``model.named_parameters()``; names the exchanges and keys
            the residuals in checkpoints. Without it, names are positional.
        compression: Horovod compression of the values on the wire (``Compression.fp16``).
        backward_passes_per_step: backward passes accumulated locally before one exchange.
        op: ``hvd.Average`` (default) or ``hvd.Sum``.
        gradient_predivide_factor: with Average, scale by 1/f before the sum and f/P after.
        num_groups: split the parameters (in name order) into this many exchange units.
        groups: explicit exchange units, a list of lists of parameters; each list is
            sparsified as one vector. One list of all parameters gives TopK-SGD.
        sparse_as_dense: densify ``torch.sparse`` gradients without the warning about the
            dense buffer they cost (they are handed back sparse either way, as Horovod does).
        process_set: the Horovod process set whose ranks exchange; on a rank outside it the
            optimizer steps on local gradients, as Horovod's does.

    Keyword-only LAGS options: ``lags_hvd.options.LAGSOptions``, each explained there (``recipe``
    "dgc", the default: planned buckets, density warm-up, 1-D parameters dense, momentum or
    Adam correction where it applies; "paper": the paper's Algorithm 1; ``density`` 0.001, ...).

    Collective over the process set: every rank compares its settings with the others'
    before any exchange and raises ``RanksDisagreeError`` where they differ.
    """
    if getattr(process_set, "process_set_id", None) is None:
        raise ValueError(
            f"{process_set} is not registered with Horovod: pass it to hvd.init("
            "process_sets=[...]) or hvd.add_process_set() on every rank first"
        )
    reduction = {hvd.Average: "average", hvd.Sum: "sum"}.get(op, repr(op))
    wiring = Wiring(
        HorovodCollectives(process_set),
        bool(process_set.included()),
        named_parameters,
        compression,
        backward_passes_per_step,
        reduction,
        gradient_predivide_factor,
        num_groups,
        groups,
        sparse_as_dense,
    )
    return wrap(optimizer, wiring, lags_options)


def TopKDistributedOptimizer(
    optimizer,
    named_parameters=None,
    compression=hvd.Compression.none,
    backward_passes_per_step=1,
    op=hvd.Average,
    gradient_predivide_factor=1.0,
    sparse_as_dense=False,
    process_set=hvd.global_process_set,
    *,
    density=0.001,
    recipe="paper",
    **lags_options,
):
    """TopK-SGD ("SLGS", global sparsification): the baseline LAGS-SGD improves on.

    One exchange unit holds every trainable parameter, so a single top-k runs over
    the whole model's concatenated gradient, with the same residual scheme, once
    the last gradient of backprop is ready: no overlap with computation. Arguments
    as ``DistributedOptimizer``; ``density`` must be a number. The recipe is the
    paper's by default (the baseline as the paper measured it); ``recipe="dgc"``
    gives it the density warm-up and momentum correction (its one unit is not all
    1-D, so ``dense_params`` sends nothing whole).
    """
    if density == ADAPTIVE or lags_options.get("buckets") not in (None, "layer"):
        raise ValueError("TopKDistributedOptimizer takes a fixed density and one global unit")
    everything = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    return DistributedOptimizer(
        optimizer,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        0,
        [everything],
        sparse_as_dense,
        process_set,
        density=density,
        recipe=recipe,
        **lags_options,
    )


def broadcast_object(obj, root_rank: int = 0, name: str | None = None, process_set=hvd.global_process_set):
    """``horovod.torch.broadcast_object``: ``obj`` of rank ``root_rank`` on every rank. Horovod
    names the broadcast after ``type(obj)`` unless ``name`` is given, so the common
    ``broadcast_object(value if rank == 0 else None)`` gave the root and the others different
    names, and every rank waited for the other name forever; here the default name is the same
    on every rank."""
    return hvd.broadcast_object(obj, root_rank, name=name or "lags_hvd.broadcast_object", process_set=process_set)


def broadcast_optimizer_state(optimizer, root_rank: int, model=None) -> None:
    """Horovod's ``broadcast_optimizer_state``, which also works on a ``DistributedOptimizer``:
    the wrapped optimizer's state comes from ``root_rank`` (ranks without state initialise it
    without exchanging), and so do the LAGS k, iteration, buckets and lr record; each rank
    keeps its own residuals. Collective over every rank. Horovod's resume pattern::

        if hvd.rank() == 0:
            model.load_state_dict(ckpt["model"]); optimizer.load_state_dict(ckpt["optimizer"])
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    """
    hvd.broadcast_optimizer_state(optimizer, root_rank, model=model)
    if isinstance(optimizer, _LAGSOptimizer):
        optimizer.adopt_shared_state(root_rank)


def join(device: int = -1) -> int:
    """``hvd.join()`` with lags_hvd: this rank is out of batches (uneven inputs).

    Until every rank has joined, this rank takes part in the others' iterations with zero
    gradients, in every live ``DistributedOptimizer`` of this process, so their exchanges
    complete (``uneven.join_all``); its parameters, residuals and iteration stay as they
    are. The others' merged gradient is the average over all P ranks of what the ranks
    still training sent (the joined ones count as zeros, as with Horovod's join). Returns
    the rank that joined last (the most iterations), whose model is then the one to share::

        last = hvd.join()
        hvd.broadcast_parameters(model.state_dict(), root_rank=last)
        hvd.broadcast_optimizer_state(optimizer, root_rank=last)   # iteration and plan too

    Horovod's own ``horovod.torch.join()`` cannot serve: it runs no allgather while a rank
    is in it. Without a DistributedOptimizer this is Horovod's join. A rank that stops
    without joining makes the others raise ``ExchangeTimeoutError`` after ``exchange_timeout``.
    """
    return join_all(device, hvd.join)
