"""Uneven inputs: ``lags_hvd.join()`` keeps a rank out of batches in the others' exchanges.

Horovod's own join runs no allgather or alltoall while a rank is in it, so a joined
rank here takes part in every iteration the others still train, with a contribution of
nothing to every bucket (``Engine.shadow``, with ``Bucket.nothing``), at their k and regions,
until the step check says every rank has joined. Its parameters, residuals and
iteration stay as they were; the others' average divides by P, the joined counting as
zeros, as with Horovod's join.
"""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable

from .errors import ExchangeTimeoutError

__all__ = ["join_all", "live", "register"]

_LIVE: list[weakref.ref] = []
"""Every DistributedOptimizer of this process, in the order they were built (``join``)."""


def join_all(device: int, fallback: Callable[[int], int]) -> int:
    """``join()`` of a front-end (see ``horovod_api.join``): until every rank has joined,
    take part in the others' iterations with zero gradients (``Engine.shadow``) in every
    live ``DistributedOptimizer`` of this process, so their exchanges complete; its
    parameters, residuals and iteration stay as they are. Returns the rank that joined
    last (the most iterations). Without an optimizer: ``fallback(device)``, the
    front-end's own join. Waits are bounded by the optimizers' ``exchange_timeout``; an
    optimizer that failed takes no part."""
    gc.collect()  # an optimizer the program dropped is collected with its hooks (``_weak_hook``)
    optimizers = [o for o in (ref() for ref in _LIVE) if o is not None and o._member and not o._failure.cause]
    if not optimizers:
        return fallback(device)
    for optimizer in optimizers:
        if not optimizer._engine.idle:
            raise RuntimeError(
                "lags_hvd.join() after a backward pass that no step() followed: "
                "step (or zero_grad() before backward) first, then join"
            )
    timeouts = [o._options.exchange_timeout for o in optimizers if o._options.exchange_timeout is not None]
    waiting, last = list(optimizers), None
    for optimizer in waiting:
        optimizer._engine.start_shadow()
    progress = time.monotonic()
    while waiting:
        ready = [o for o in waiting if o._engine.shadow_ready]
        for optimizer in ready:
            try:
                check = optimizer._engine.shadow()
            except BaseException as error:
                optimizer._failure.latch(error)
                raise
            if check.iteration is None:  # every rank has joined
                waiting.remove(optimizer)
                last = check.last if last is None else last
            else:
                optimizer._engine.start_shadow()
        if ready:
            progress = time.monotonic()
        elif timeouts and time.monotonic() - progress > min(timeouts):
            for optimizer in optimizers:  # their shadow exchanges stay in flight
                optimizer._context.config.collectives.abandon()
            raise ExchangeTimeoutError(
                f"lags_hvd.join() on rank {optimizers[0]._context.config.collectives.global_rank()} waited "
                f"{min(timeouts):g} s for an iteration of the ranks still training: one stalled, or "
                "stopped without calling lags_hvd.join()"
            )
        else:
            time.sleep(5e-4)
    return last


def live() -> list:
    """This process's live DistributedOptimizers."""
    return [o for o in (ref() for ref in _LIVE) if o is not None]


def register(optimizer) -> None:
    """Count ``optimizer`` among this process's live ones (held weakly)."""
    _LIVE[:] = [ref for ref in _LIVE if ref() is not None] + [weakref.ref(optimizer)]
