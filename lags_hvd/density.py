"""Density schedules: how many entries each unit sends at a given iteration. Pure.

``warmup_density`` is Deep Gradient Compression's density warm-up (Lin et al.,
ICLR 2018), counted in iterations so that short runs can use it. Over the first
``iterations`` iterations the density falls geometrically, in ``stages`` equal
steps, from ``start`` to the target::

    rho(t) = start * (target / start) ** floor(stages * t / iterations)    t < iterations
    rho(t) = target                                                         afterwards

With start 0.25, target 0.001 and 4 stages this gives DGC's 0.25, 0.063, 0.016,
0.004, then 0.001. Stages keep k constant for ``iterations / stages`` iterations,
so message sizes (and Horovod's response cache) change only 4 times. A unit whose
own density is above the schedule's keeps its own.
"""
from __future__ import annotations

import math

__all__ = ["warmup_density", "WARMUP_STAGES"]

WARMUP_STAGES = 4


def warmup_density(iteration: int, target: float, start: float, iterations: int,
                   stages: int = WARMUP_STAGES) -> float:
    """The density in force at ``iteration`` (see the module docstring); never below ``target``."""
    if iterations <= 0 or iteration >= iterations or start <= target:
        return target
    stage = math.floor(stages * iteration / iterations)
    return max(target, start * (target / start) ** (stage / stages))
