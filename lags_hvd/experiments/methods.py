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
                buckets, 1-D parameters dense, momentum correction) with the density
                warm-up over: its steady state
lags-adaptive   lags with ``density="adaptive"``: per-layer densities from the planner
lags-rs         lags-merged with ``aggregation="reduce_scatter"`` (Ok-Topk's split and reduce)
lags-mc, lags-dense1d, lags-clip, lags-clipfb, lags-dgc
                lags with the fidelity options (``FIDELITY``)
==============  ===================================================================

The optimizers come from the backend's front-end (``backend.Backend``): ``lags_hvd`` on
Horovod, ``lags_hvd.distributed`` on torch.distributed.
"""

from __future__ import annotations

import torch

from lags_hvd.density import ADAPTIVE

from .backend import Backend

__all__ = ["METHODS", "MERGE_NUMEL", "FIDELITY", "build_optimizer"]

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
METHODS = ("local", "dense", "topk", "lags-auto", "lags-default", "lags-adaptive", *_VARIANTS)


def build_optimizer(
    method: str,
    base: torch.optim.Optimizer,
    named_parameters,
    *,
    density: float,
    backend: Backend,
    network_profile=None,
    bucket_warmup: int = 5,
    warmup_iterations: int = 4,
    **lags_options,
) -> torch.optim.Optimizer:
    """``base`` wrapped for ``method`` by ``backend``'s front-end; ``lags_options`` go to every
    LAGS variant (e.g. ``monitor_every``), ``network_profile`` to the planners."""
    named = list(named_parameters)
    if method == "local":
        return base
    if method == "dense":
        return backend.dense(base, named)
    if method == "topk":
        return backend.front_end.TopKDistributedOptimizer(base, named_parameters=named, density=density)
    if method in ("lags-auto", "lags-default"):
        lags_options = {
            **({"recipe": "paper"} if method == "lags-auto" else {"density_warmup": 0}),
            **lags_options,
            "buckets": "auto",
            "bucket_warmup": bucket_warmup,
            "network_profile": network_profile,
        }
    elif method == "lags-adaptive":
        lags_options = {
            "recipe": "paper",
            **lags_options,
            "min_density": density,
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
