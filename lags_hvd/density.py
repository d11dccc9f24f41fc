"""Density and k: how many entries each unit sends. Pure.

The one home of the concept: a density is a number in (0, 1] (or ``ADAPTIVE``);
a unit of ``d`` entries at density rho sends ``k = max(1, ceil(rho * d))``
(``k_for_density``); the average density of a plan is sum k / sum d.

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

from .checks import check_number

__all__ = [
    "ADAPTIVE",
    "PAPER_DENSITY",
    "check_density",
    "k_for_density",
    "average_density",
    "warmup_density",
    "WARMUP_STAGES",
    "param_density",
    "param_kinds",
    "sent_dense",
    "dense_policy_units",
    "unit_k",
]

ADAPTIVE = "adaptive"
"""The ``density`` value that asks for per-unit densities from the adaptive planner."""
PAPER_DENSITY = 0.001
"""The paper's density: ``recipe="paper"``'s, and the default update rules' (``lags_hvd.updates``)."""
WARMUP_STAGES = 4


def check_density(value, what: str) -> float:
    """``value`` as a float in (0, 1], or ValueError naming ``what``."""
    return check_number(value, what, 0.0, 1.0, low_open=True, high_open=False)


def k_for_density(density: float, numel: int) -> int:
    """Number of entries a unit of ``numel`` elements sends: ``max(1, ceil(density * numel))``."""
    if not 0.0 < density <= 1.0:
        raise ValueError(f"density must be in (0, 1], got {density!r}")
    return min(numel, max(1, math.ceil(density * numel)))


def average_density(k: list[int], numels: list[int]) -> float:
    """Entries sent over entries in the model, per worker and iteration."""
    return sum(k) / max(1, sum(numels))


def warmup_density(iteration: int, target: float, start: float, iterations: int, stages: int = WARMUP_STAGES) -> float:
    """The density in force at ``iteration`` (see the module docstring); never below ``target``."""
    if iterations <= 0 or iteration >= iterations or start <= target:
        return target
    stage = math.floor(stages * iteration / iterations)
    return max(target, start * (target / start) ** (stage / stages))


# ---------------------------------------------------------------- the options' densities per parameter and unit
# ``options`` below is a ``LAGSOptions`` (density, layer_densities, dense_params, min_density).


def param_density(options, name: str) -> float:
    """The density parameter ``name`` is planned at: ``min_density`` under the adaptive mode
    (the planner raises it), else its ``layer_densities`` entry or ``density``."""
    return options.min_density if options.adaptive else options.layer_densities.get(name, options.density)


def sent_dense(options, name: str, param) -> bool:
    """Whether the ``dense_params="1d"`` policy sends this parameter whole (1-D, not named in
    ``layer_densities``)."""
    return options.dense_params == "1d" and param.dim() <= 1 and name not in options.layer_densities


def dense_policy_units(units, options) -> list[str]:
    """Units the ``dense_params`` policy sends whole: every member sent dense, and the unit
    itself not named in ``layer_densities``."""
    return [
        u.name
        for u in units
        if u.name not in options.layer_densities
        and all(sent_dense(options, n, p) for p, n in zip(u.params, u.param_names))
    ]


def unit_k(options, units) -> dict[str, int]:
    """Every unit's planned k. Adaptive: ``min_density``; fixed: ``layer_densities`` by the
    unit's name or, for a bucket of several parameters, its first parameter's (parameters
    share a bucket only at equal density), else ``density``. ValueError for a
    ``layer_densities`` name that is neither a unit nor a parameter."""
    layer = options.layer_densities
    if options.adaptive:
        density = {u.name: options.min_density for u in units}
    else:
        unknown = sorted(set(layer) - {u.name for u in units} - {n for u in units for n in u.param_names})
        if unknown:
            raise ValueError(f"layer_densities names no exchange unit: {unknown}")
        density = {u.name: layer.get(u.name, layer.get(u.param_names[0], options.density)) for u in units}
    return {u.name: k_for_density(density[u.name], u.numel) for u in units}


def param_kinds(param_groups, names: dict, options) -> dict:
    """Per parameter, what must agree for parameters to share a bucket: param group, dtype,
    device, density and whether the ``dense_params`` policy sends it whole."""
    kinds = {}
    for index, group in enumerate(param_groups):
        for p in group["params"]:
            dense = sent_dense(options, names[p], p)
            kinds[p] = (index, p.dtype, p.device, 1.0 if dense else param_density(options, names[p]), dense)
    return kinds
