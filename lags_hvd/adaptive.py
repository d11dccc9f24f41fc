"""Adaptive density: warm up, measure, plan on one rank, broadcast, re-plan periodically.

Every rank must send the same k for a unit (the allgather's messages must agree),
so the plan is made on the process set's first rank from its measurements and
broadcast; every rank applies it at the same iteration of ``synchronize()``.
"""
from __future__ import annotations

import os

import horovod.torch as hvd

from .options import LAGSOptions
from .planner import NetworkModel, UnitPlan, plan_densities
from .profiling import BackwardTimer, load_network_profile, profile_network
from . import report

__all__ = ["AdaptiveDensity"]


class AdaptiveDensity:
    """Decides, at iterations ``warmup, warmup + N, warmup + 2N, ...``, every unit's k."""

    def __init__(self, options: LAGSOptions, process_set):
        self.options = options
        self.process_set = process_set
        self.network = self._network_from(options.network_profile, process_set.size())
        self.plan: list[UnitPlan] | None = None

    @staticmethod
    def _network_from(profile, world_size: int) -> NetworkModel | None:
        if profile is None:
            return None
        if isinstance(profile, NetworkModel):
            return NetworkModel.from_dict(profile.to_dict(), world_size)
        if isinstance(profile, dict):
            return NetworkModel.from_dict(profile, world_size)
        return load_network_profile(profile, world_size)

    def due(self, iteration: int) -> bool:
        """Whether the plan is made after ``iteration`` completed synchronizations."""
        warmup, every = self.options.warmup_iterations, self.options.replan_every
        return iteration >= warmup and (iteration - warmup) % every == 0

    def replan(self, units, timer: BackwardTimer, iteration: int) -> dict[str, int]:
        """Collective over the process set: returns ``{unit name: k}``, identical on every rank."""
        if self.network is None:
            self.network, _ = profile_network(process_set=self.process_set)
        plan = None
        is_planner = self.process_set.rank() == 0
        if is_planner:
            plan = plan_densities(timer.profile(units), self.network, self.options.min_density,
                                  self.options.max_density, self.options.plan_slack)
        root = self.process_set.ranks[0] if self.process_set.ranks else 0
        self.plan = hvd.broadcast_object(plan, root_rank=root, name=f"lags.plan.{iteration}",
                                         process_set=self.process_set)
        if is_planner:
            self._report(iteration)
        return {p.name: p.k for p in self.plan}

    def _report(self, iteration: int) -> None:
        if self.options.verbose:
            print(f"lags_hvd plan at iteration {iteration}:\n{report.format_plan(self.plan)}", flush=True)
        if self.options.plan_report_dir:
            os.makedirs(self.options.plan_report_dir, exist_ok=True)
            stem = os.path.join(self.options.plan_report_dir, f"plan-{iteration}")
            report.save_plan(self.plan, stem + ".json", self.network)
            report.plot_timeline(self.plan, stem + ".png", title=f"LAGS plan, iteration {iteration}")
