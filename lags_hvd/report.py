"""The density plan for people: a table, a JSON file and a timeline plot.

The adaptive loop (``adaptive.AdaptiveDensity``) does no I/O; ``PlanReporter`` is
the observer that prints its decisions (``verbose``) and writes each plan as JSON
and PNG (``plan_report_dir``) on the rank that planned.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path

from . import density
from .figures import pyplot, save_figure
from .planner import NetworkModel, UnitPlan

__all__ = ["PlanReporter", "format_plan", "save_plan", "load_plan", "plot_timeline", "average_density"]


def average_density(plan: list[UnitPlan]) -> float:
    """Entries sent over entries in the model (per worker and iteration)."""
    return density.average_density([p.k for p in plan], [p.numel for p in plan])


def format_plan(plan: list[UnitPlan]) -> str:
    """One line per unit in ready order: name, size, ready time, density, k, mode, exchange window."""
    lines = [f"{'unit':<40} {'numel':>11} {'ready ms':>9} {'density':>8} {'k':>10} {'mode':>6} {'exchange ms':>17}"]
    for p in plan:
        lines.append(
            f"{p.name[:40]:<40} {p.numel:>11,d} {1e3 * p.ready:>9.2f} {p.density:>8.4f} "
            f"{p.k:>10,d} {'dense' if p.dense else 'sparse':>6} "
            f"{1e3 * p.start:>8.2f}-{1e3 * p.end:<8.2f}"
        )
    lines.append(
        f"average density {average_density(plan):.4f}; predicted last exchange ends at "
        f"{1e3 * max(p.end for p in plan):.2f} ms after the first gradient"
    )
    return "\n".join(lines)


def save_plan(plan: list[UnitPlan], path, network: NetworkModel | None = None) -> None:
    data = {
        "units": [asdict(p) for p in plan],
        "average_density": average_density(plan),
        "network": network.to_dict() if network else None,
    }
    Path(path).write_text(json.dumps(data, indent=1))


def load_plan(path) -> list[UnitPlan]:
    return [UnitPlan(**unit) for unit in json.loads(Path(path).read_text())["units"]]


def plot_timeline(plan: list[UnitPlan], path, title: str = "LAGS plan") -> None:
    """Backprop (gradient ready times) on one lane, the link's exchanges on another."""
    fig, ax = pyplot().subplots(figsize=(11, 3.2))
    ms = 1e3
    backprop_end = max(p.ready for p in plan)
    ax.broken_barh([(0, ms * backprop_end)], (1.6, 0.8), color="#bbbbbb")
    ax.plot([ms * p.ready for p in plan], [2.0] * len(plan), "|", color="black", markersize=14)
    for p in plan:
        ax.broken_barh(
            [(ms * p.start, ms * (p.end - p.start))],
            (0.4, 0.8),
            color="#d62728" if p.dense else "#1f77b4",
            edgecolor="white",
            linewidth=0.5,
        )
    ax.set_yticks([0.8, 2.0], ["exchanges", "backprop\n(gradient ready)"])
    ax.set_xlabel("ms after the first gradient is ready")
    ax.set_title(f"{title}: average density {average_density(plan):.4f} (blue: sparse allgather, red: dense allreduce)")
    ax.set_xlim(left=0)
    ax.grid(axis="x", alpha=0.3)
    save_figure(fig, path)


class PlanReporter:
    """Observer of the adaptive loop's decisions (``adaptive.Decision``): on the planning
    rank, prints each (``verbose``) and writes each new plan to ``folder`` as
    ``plan-<iteration>.json`` and ``.png`` (``folder`` None: no files)."""

    def __init__(self, verbose: bool, folder: str | None):
        self.verbose, self.folder = verbose, folder

    def __call__(self, decision) -> None:
        if not decision.planner:
            return
        entry, plan = decision.entry, decision.plan
        iteration, event = entry["iteration"], entry["event"]
        if self.verbose:
            print(
                f"lags_hvd adaptive, iteration {iteration}: {event} (median "
                f"{1e3 * entry['median_iteration_s']:.1f} ms, baseline {1e3 * entry['baseline_s']:.1f} ms)",
                flush=True,
            )
            if event == "plan":
                print(format_plan(plan), flush=True)
        if self.folder and event == "plan":
            os.makedirs(self.folder, exist_ok=True)
            stem = os.path.join(self.folder, f"plan-{iteration}")
            save_plan(plan, stem + ".json", decision.network)
            plot_timeline(plan, stem + ".png", title=f"LAGS plan, iteration {iteration}")
