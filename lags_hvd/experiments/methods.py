"""The methods compared in this project, by name, as optimizers (one factory for every tool).

==============  ===================================================================
local           the wrapped optimizer alone: no communication (the floor)
dense           dense S-SGD: ``horovod.torch.DistributedOptimizer`` (``backend``)
topk            ``TopKDistributedOptimizer``: one global top-k (TopK-SGD)
lags            ``DistributedOptimizer(recipe="paper")``: per-layer buckets, the
                paper's LAGS (every ``lags-*`` below is it with one change, unless noted)
lags-merged     lags with ``buckets=MERGE_NUMEL``: small tensors merged (the authors' code)
lags-auto       lags with ``buckets="auto"``: the bucket planner
lags-default    ``DistributedOptimizer`` as it comes (``recipe="dgc"``: planned
                buckets, 1-D parameters dense, momentum or Adam correction) with the density
                warm-up over: its steady state
lags-default-ef lags-default with plain error feedback (neither momentum nor Adam correction):
                what the corrections cost per iteration
lags-default-consensus
                lags-default with Adam correction's consensus on every rank
                (``local_residual=False``): what keeping the residual in the parameters costs
lags-adaptive   lags with ``density="adaptive"``: per-layer densities from the planner
lags-rs         lags-merged with ``aggregation="reduce_scatter"`` (Ok-Topk's split and reduce)
lags-mc, lags-dense1d, lags-clip, lags-clipfb, lags-dgc
                lags with the fidelity options (``FIDELITY``)
ddp             DistributedDataParallel with its default allreduce (torch.distributed)
ddp-powersgd1, ddp-powersgd4
                DDP with PyTorch's PowerSGD hook, rank 1 or 4 (error feedback, warm start)
ddp-lags        DDP with ``lags_hvd.ddp``'s hook given the optimizer: the optimizer doors' LAGS
                under the default recipe (momentum correction for SGD with momentum, Adam
                correction with the local residual for AdamW)
==============  ===================================================================

The ``ddp*`` methods wrap the model (``build_ddp``); the others wrap the optimizer.
The optimizers come from the backend's front-end (``backend.Backend``): ``lags_hvd`` on
Horovod, ``lags_hvd.distributed`` on torch.distributed.
"""

from __future__ import annotations

import torch

from lags_hvd.density import ADAPTIVE

from .backend import Backend

__all__ = ["METHODS", "DDP_METHODS", "MERGE_NUMEL", "FIDELITY", "build_optimizer", "build_ddp", "one_bucket_at_a_time"]

MERGE_NUMEL = 16384
"""``lags-merged``: tensors below this many entries are merged with their neighbours."""

FIDELITY = {
    "lags-mc": dict(momentum_correction=True),
    "lags-dense1d": dict(dense_params="1d"),
    "lags-clip": dict(local_clip=1.0),
    "lags-clipfb": dict(max_grad_norm=1.0),
    "lags-dgc": dict(momentum_correction=True, dense_params="1d", local_clip=1.0),
}
"""The fidelity variants: their LAGS options."""

_VARIANTS = {
    "lags": {},
    "lags-merged": dict(buckets=MERGE_NUMEL),
    "lags-rs": dict(buckets=MERGE_NUMEL, aggregation="reduce_scatter"),
    **FIDELITY,
}
DDP_METHODS = ("ddp", "ddp-powersgd1", "ddp-powersgd4", "ddp-lags")
DEFAULT_METHODS = ("lags-default", "lags-default-ef", "lags-default-consensus")
METHODS = ("local", "dense", "topk", "lags-auto", *DEFAULT_METHODS, "lags-adaptive", *_VARIANTS, *DDP_METHODS)


def build_optimizer(
    method: str,
    base: torch.optim.Optimizer,
    named_parameters,
    *,
    density: float | None,
    backend: Backend,
    network_profile=None,
    bucket_warmup: int = 5,
    warmup_iterations: int = 4,
    **lags_options,
) -> torch.optim.Optimizer:
    """``base`` wrapped for ``method`` by ``backend``'s front-end; ``lags_options`` go to every
    LAGS variant (e.g. ``monitor_every``, or ``buckets`` in place of the default methods'
    plan), ``network_profile`` to the planners."""
    named = list(named_parameters)
    if method == "local":
        return base
    if method == "dense":
        return backend.dense(base, named)
    if method == "topk":
        return backend.front_end.TopKDistributedOptimizer(base, named_parameters=named, density=density)
    if method in ("lags-auto", *DEFAULT_METHODS):
        changed = {
            "lags-default-ef": {"momentum_correction": False, "adam_correction": False},
            "lags-default-consensus": {"local_residual": False},
        }.get(method, {})
        planned = {"buckets": "auto", "bucket_warmup": bucket_warmup, "network_profile": network_profile}
        lags_options = {
            **({"recipe": "paper"} if method == "lags-auto" else {"density_warmup": 0}),
            **changed,
            **planned,
            **lags_options,  # a caller's buckets (the same for every method) win over the plan
        }
    elif method == "lags-adaptive":
        lags_options = {
            "recipe": "paper",
            **lags_options,
            **({} if density is None else {"min_density": density}),
            "warmup_iterations": warmup_iterations,
            "replan_every": 10_000,
            "network_profile": network_profile,
        }
        density = ADAPTIVE
    elif method in _VARIANTS:  # the paper's LAGS with the variant's change, unless the caller says otherwise
        lags_options = {"recipe": "paper", **_VARIANTS[method], **lags_options}
    else:
        raise ValueError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    return backend.front_end.DistributedOptimizer(base, named_parameters=named, density=density, **lags_options)


def build_ddp(
    method: str,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    density: float | None,
    powersgd_start: int = 2,
    density_warmup=None,
) -> tuple[torch.nn.Module, object]:
    """``model`` in DistributedDataParallel (the default process group) with ``method``'s
    communication hook: (the module to train through, the hook's state or None).
    ``optimizer``: the one that trains ``model`` (the LAGS hook wraps it in place);
    ``powersgd_start``: PowerSGD's ``start_powerSGD_iter`` (plain allreduce before it; at
    least 2, after DDP's bucket rebuild); ``density_warmup``: the LAGS hook's (None: the
    default recipe's)."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    from lags_hvd.ddp import LAGSHookState, lags_hook

    wrapped = torch.nn.parallel.DistributedDataParallel(model)
    if method == "ddp":
        return wrapped, None
    if method.startswith("ddp-powersgd"):
        rank = int(method.removeprefix("ddp-powersgd"))
        state = powerSGD_hook.PowerSGDState(
            dist.group.WORLD, matrix_approximation_rank=rank, start_powerSGD_iter=powersgd_start
        )
        wrapped.register_comm_hook(state, one_bucket_at_a_time(powerSGD_hook.powerSGD_hook))
        return wrapped, state
    if method == "ddp-lags":
        warmup = {} if density_warmup is None else {"density_warmup": density_warmup}
        state = LAGSHookState(named_parameters=model.named_parameters(), optimizer=optimizer, density=density, **warmup)
        wrapped.register_comm_hook(state, lags_hook)
        return wrapped, state
    raise ValueError(f"unknown DDP method {method!r}; choose from {', '.join(DDP_METHODS)}")


def one_bucket_at_a_time(hook):
    """``hook`` finished before DDP goes on to the next bucket. PowerSGD's hook starts its
    second and third collectives in callbacks, which Gloo runs as each first one arrives: with
    several buckets the ranks then issue them in different orders and the job aborts on a
    size mismatch. Waiting per bucket keeps one order (at the cost of the overlap between
    buckets; every bucket's own collectives stay as PowerSGD runs them)."""

    def serial(state, bucket):
        finished = torch.futures.Future()
        finished.set_result(hook(state, bucket).wait())
        return finished

    serial.__name__ = f"one_bucket_at_a_time({hook.__name__})"
    return serial
