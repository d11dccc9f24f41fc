"""LAGS-SGD over torch.distributed: for jobs launched with ``torchrun`` (no Horovod needed).

    import torch.distributed as dist
    import lags_hvd.distributed as lags

    dist.init_process_group("gloo")            # "nccl" with CUDA tensors
    optimizer = lags.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                          model.named_parameters())
    lags.broadcast_parameters(model.state_dict(), root_rank=0)
    lags.broadcast_optimizer_state(optimizer, root_rank=0)

The optimizer is the one of ``import lags_hvd as hvd`` (the same options, agreement, step
check, bounded waits and errors, the same checkpoints), over a process group
(``collectives.torch_distributed``) instead of a Horovod process set. Ranks outside
``process_group`` step on their local gradients. This module imports no Horovod.
"""

from __future__ import annotations

import torch.distributed as dist

from .checks import check_count
from .collectives import DEFAULT_TIMEOUT, NoCompression, broadcast_object, broadcast_tensors
from .collectives.torch_distributed import TorchDistributedCollectives
from .density import ADAPTIVE
from .optimizer import Wiring, _LAGSOptimizer, wrap
from .uneven import join_all

__all__ = [
    "DistributedOptimizer",
    "TopKDistributedOptimizer",
    "broadcast_parameters",
    "broadcast_optimizer_state",
    "join",
]

_OPS = {"average": "average", "sum": "sum", dist.ReduceOp.AVG: "average", dist.ReduceOp.SUM: "sum"}


def DistributedOptimizer(
    optimizer,
    named_parameters=None,
    *,
    process_group=None,
    op="average",
    gradient_predivide_factor=1.0,
    backward_passes_per_step=1,
    groups=None,
    num_groups=0,
    sparse_as_dense=False,
    compression=NoCompression,
    **lags_options,
):
    """Wrap ``optimizer`` so that gradients are exchanged with LAGS-SGD over ``process_group``
    (the default group when None); the optimizer is re-classed in place and returned.

    Args mean what they mean for ``lags_hvd.DistributedOptimizer``; here ``op`` is
    ``"average"`` (or ``ReduceOp.AVG``) or ``"sum"`` (``ReduceOp.SUM``) and ``compression``
    any object with Horovod's ``compress``/``decompress``. Keyword-only LAGS options:
    ``lags_hvd.options.LAGSOptions``.

    Collective over the group: every rank compares its settings with the others' before
    any exchange and raises ``RanksDisagreeError`` where they differ. torch.distributed
    matches collectives by order, so the buckets start in one fixed order on every rank
    (the expected backward order; a bucket ready early waits for those before it, as
    DDP's do)."""
    try:
        reduction = _OPS.get(op, repr(op))
    except TypeError:  # an unhashable op
        reduction = repr(op)
    collectives = TorchDistributedCollectives(process_group)
    wiring = Wiring(
        collectives,
        collectives.member,
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
    optimizer, named_parameters=None, *, process_group=None, density=0.001, recipe="paper", **options
):
    """TopK-SGD (one top-k over the whole model, no overlap): ``lags_hvd.TopKDistributedOptimizer``
    over torch.distributed; the other arguments as ``DistributedOptimizer``'s."""
    if density == ADAPTIVE or options.get("buckets") not in (None, "layer"):
        raise ValueError("TopKDistributedOptimizer takes a fixed density and one global unit")
    everything = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    return DistributedOptimizer(
        optimizer,
        named_parameters,
        process_group=process_group,
        groups=[everything],
        density=density,
        recipe=recipe,
        **options,
    )


def broadcast_parameters(params, root_rank: int = 0, process_group=None, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Every tensor of ``params`` (a ``state_dict()`` or ``named_parameters()``) overwritten
    with ``root_rank``'s (a global rank), in place, waits bounded by ``timeout`` seconds."""
    named = params.items() if isinstance(params, dict) else params
    broadcast_tensors(
        _group_with_root(TorchDistributedCollectives(process_group), root_rank), named, root_rank, timeout
    )


def broadcast_optimizer_state(optimizer, root_rank: int = 0, process_group=None) -> None:
    """``root_rank``'s optimizer state on every rank of the group (a rank without state, as
    before its first step, takes it all the same), and for a LAGS ``DistributedOptimizer``
    its k, iteration, buckets and lr record; each rank keeps its own residuals. The resume
    pattern: load the checkpoint on rank 0, then ``broadcast_parameters`` and this."""
    lags = isinstance(optimizer, _LAGSOptimizer)
    collectives = optimizer._context.config.collectives if lags else TorchDistributedCollectives(process_group)
    timeout = optimizer._options.exchange_timeout if lags else DEFAULT_TIMEOUT
    _group_with_root(collectives, root_rank)
    state = optimizer.state_dict() if collectives.global_rank() == root_rank else None
    if state is not None:
        state.pop("lags", None)  # residuals are per rank; the shared part follows
    state = broadcast_object(collectives, state, root_rank, "broadcast.optimizer_state", timeout)
    optimizer.load_state_dict(state)  # without "lags": the LAGS state stays as it is
    if lags:
        optimizer.adopt_shared_state(root_rank)


def _group_with_root(collectives: TorchDistributedCollectives, root_rank: int) -> TorchDistributedCollectives:
    """``collectives``, once sure that this rank and ``root_rank`` (a global rank) are in its
    group: torch.distributed runs nothing on a rank outside a group (its call returns None)."""
    check_count(root_rank, "root_rank")
    if not collectives.member:
        raise ValueError(
            f"rank {collectives.global_rank()} is not in the process group given: call the broadcast on "
            "the group's ranks only"
        )
    if root_rank not in collectives.global_ranks:
        raise ValueError(
            f"root_rank {root_rank} is not in the process group (its global ranks: {collectives.global_ranks}): "
            "broadcast from one of its ranks"
        )
    return collectives


def join() -> int:
    """This rank is out of batches (uneven inputs): ``lags_hvd.join`` over torch.distributed.
    Until every rank has joined, it takes part in the others' iterations with zero gradients
    in every live ``DistributedOptimizer`` of this process; returns the rank that joined last,
    whose model is the one to share (``broadcast_parameters``, ``broadcast_optimizer_state``)."""
    return join_all(-1, _no_optimizer)


def _no_optimizer(device: int) -> int:
    raise RuntimeError(
        "lags_hvd.distributed.join() keeps this rank in the exchanges of its DistributedOptimizers, "
        "and this process has none; torch's own torch.distributed.algorithms.Join serves other models"
    )
