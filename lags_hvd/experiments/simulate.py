"""Predict dense S-SGD, TopK-SGD and LAGS-SGD iteration times at cluster scale.

    python scripts/simulate.py --bench docs/results/full.json        # make simulate
    python scripts/simulate.py --bench docs/results/emulated.json --validate-only   # make bench-emulated
        [--engine docs/results/engine_cpu.json]                      # the engine's cost per bucket

Inputs are what scripts/benchmark.py saved for each model: the per-layer profile
of the dense run (when each gradient became ready during backprop, forward,
backward and update times), each layer's LAGS selection time, the TopK-SGD
selection and merge times, and the alpha-beta fits of the shaped link.

The model (one iteration, times in seconds):

    cluster (P workers on a switch, B bytes/s each, alpha per step):
      ring allreduce of n bytes:                    2 (P-1) alpha + 2 (P-1)/P * n / B
      allgather of m bytes per worker (rec. doubling): ceil(log2 P) alpha + (P-1) * m / B
    emulation (one shaped loopback link shared by all workers, see SharedLink):
      allreduce: alpha_fit + 2 (P-1) n / B;   allgather: alpha_fit + P (P-1) m / B

    dense   every gradient ready while the link is busy is fused into the next
            allreduce, which starts when the link frees (Horovod takes every pending
            tensor each cycle; ``batched_pipeline``):
                start = max(first ready, link free),  end = start + AR(sum of n_j ready by start)
                T = t_f + max(t_b, end_last) + t_u
    topk    one selection over the whole gradient and one allgather after backprop:
                T = t_f + t_b + t_sel + AG(m(k)) + t_merge + t_u
    lags    layer i's hook selects (sel_i, on the backward thread, delaying the
            layers after it) and starts its allgather; the allgathers that become ready
            while the link is busy leave together as one message when it frees (Horovod
            takes every pending tensor each cycle; ``batched_pipeline``):
                ready'_i = ready_i + sum_{j<=i} sel_j
                message: every unit with ready'_i <= start = max(first ready', link free)
                end = start + AG(sum of their m_i(k_i))
                T = t_f + max(t_b + sum sel, end_last) + t_merge + t_u

Validation (P = 2 and 4): compute times as measured on this CPU, the shared
shaped link at its configured rate with the fixed costs fitted inside the
namespace; predictions are compared with the measured iteration times of the
same benchmark run.

Extrapolation (P = 2..256 at 1, 10 and 100 Gbit/s): compute times scaled to the
assumed GPU (``t_gpu / t_cpu`` from the benchmark's calibration, selection and
merge included), but no bucket's hook work below the bucket engine's host work per
bucket in the hook (``host_seconds_per_bucket``, measured by ``make bench-engine``;
host Python does not get faster with a GPU), alpha per communication step 50, 20
and 5 microseconds, weak scaling (a fixed batch per worker). ``lags-merged`` is
LAGS with small tensors merged into units of at least 16,384 entries
(``buckets=16384``); ``lags-auto`` is LAGS with the buckets ``plan_buckets``
chooses for each network (``auto_units``), each bucket's hook time the fitted
``fixed + per_element * n`` (``fixed`` no less than the floor above); ``lags-rs``
and ``lags-auto-rs`` the same with ``aggregation="reduce_scatter"``, and
``lags-auto-rs2`` with the owners keeping 2k as well (``owner_keep=2``). Plotted:
speed-up over one worker, ``P * T_1 / T_P``.
"""

import argparse
import json
import math
from pathlib import Path

import numpy as np

from lags_hvd.density import k_for_density
from lags_hvd.experiments import ROOT
from lags_hvd.experiments.methods import MERGE_NUMEL
from lags_hvd.figures import pyplot, save_figure
from lags_hvd.layout import merge_small_runs
from lags_hvd.planner import (
    CostModel,
    EngineCosts,
    NetworkModel,
    ParamProfile,
    fit_engine_costs,
    link_schedule,
    plan_buckets,
)
from lags_hvd.regions import REBALANCE_EVERY, SUMMARY_POINTS, global_k
from lags_hvd.sparse import unit_message_bytes

METHODS = ("dense", "topk", "lags", "lags-merged", "lags-auto", "lags-rs", "lags-auto-rs", "lags-auto-rs2")
ROW_BYTES = 8  # reduce_scatter's wire entry: int32 index + float32 value
RATES_GBIT = {1: 50e-6, 10: 20e-6, 100: 5e-6}  # link rate -> alpha per ring step
WORKERS = [2, 4, 8, 16, 32, 64, 128, 256]
TIE = 0.01  # predicted times closer than 1% are a tie, not a crossover


class Switched:
    """A cluster: P workers, each with its own full-duplex link of ``bandwidth`` bytes/s to a
    switch and ``alpha`` s of latency per communication step. Ring allreduce; allgather by
    recursive doubling (what MPI and NCCL pick for small messages)."""

    def __init__(self, workers: int, bandwidth: float, alpha: float):
        self.p, self.bandwidth, self.alpha = workers, bandwidth, alpha

    def allreduce(self, nbytes: float) -> float:
        return 2 * (self.p - 1) * self.alpha + 2 * (self.p - 1) / self.p * nbytes / self.bandwidth

    def allgather(self, nbytes_per_worker: float) -> float:
        return math.ceil(math.log2(self.p)) * self.alpha + (self.p - 1) * nbytes_per_worker / self.bandwidth

    def alltoall(self, nbytes_per_worker: float) -> float:
        """Each worker spreads ``nbytes_per_worker`` over all ranks: pairwise exchange, (P-1)
        steps of 1/P of it, or Bruck's ceil(log2 P) steps of half of it, whichever is faster
        (MPI picks Bruck for small messages)."""
        pairwise = (self.p - 1) * self.alpha + (self.p - 1) / self.p * nbytes_per_worker / self.bandwidth
        steps = math.ceil(math.log2(self.p))
        return min(pairwise, steps * (self.alpha + nbytes_per_worker / 2 / self.bandwidth))


class SharedLink:
    """The benchmark's emulation: every byte of every worker crosses one shaped loopback link.
    A ring allreduce moves 2 (P-1) n bytes over it, an allgather P (P-1) m; the fixed costs
    (alpha) are the ones fitted inside the namespace by ``python -m lags_hvd.experiments.netprofile``."""

    def __init__(self, network: dict, rate_bits: float):
        self.p, self.bandwidth = network["world_size"], rate_bits / 8
        self.alpha_ar, self.alpha_ag = network["allreduce"]["alpha"], network["allgather"]["alpha"]

    def allreduce(self, nbytes: float) -> float:
        return self.alpha_ar + 2 * (self.p - 1) * nbytes / self.bandwidth

    def allgather(self, nbytes_per_worker: float) -> float:
        return self.alpha_ag + self.p * (self.p - 1) * nbytes_per_worker / self.bandwidth

    def alltoall(self, nbytes_per_worker: float) -> float:
        """(P-1)/P of every worker's bytes leave it, all over the one link (the fixed cost
        taken as the allgather's, which the profile measured)."""
        return self.alpha_ag + (self.p - 1) * nbytes_per_worker / self.bandwidth


def host_seconds_per_bucket(engine: dict) -> float:
    """The bucket engine's host work per bucket on backprop's thread, from ``make
    bench-engine``'s record (``docs/results/engine_cpu.json``, ``hook_per_bucket_us``: the
    hook's accumulate, selection, packing and queueing of the exchange for a tiny bucket).
    The merge after backprop is charged apart (``lags_merge_s``)."""
    try:
        hook = float(engine["hook_per_bucket_us"])
    except (KeyError, TypeError, ValueError) as missing:
        raise ValueError(
            f"engine record lacks a number for {missing}: expected hook_per_bucket_us (make bench-engine)"
        ) from None
    if not (math.isfinite(hook) and hook > 0):
        raise ValueError(f"engine record's hook_per_bucket_us must be finite and > 0, got {hook}")
    return 1e-6 * hook


def sparse_bytes(numel: int, density: float) -> int:
    return unit_message_bytes(k_for_density(density, numel), numel, 4)


def pipeline(events) -> float:
    """When the last of ``events`` (ready time, duration) ends, taken in ready order on one
    link that is free from time 0 (``planner.link_schedule``)."""
    schedule = link_schedule(sorted(events), link_free=0.0)
    return schedule[-1][1] if schedule else 0.0


def batched_pipeline(events, cost) -> float:
    """When the last of ``events`` (ready time, bytes) has crossed the link, where every
    message that became ready while the link was busy leaves with the others as one
    (Horovod's background thread takes every pending allgather in its next cycle, so a
    burst of small buckets pays one fixed cost): ``cost(bytes)`` per message."""
    events, free, i = sorted(events), 0.0, 0
    while i < len(events):
        start, nbytes = max(free, events[i][0]), 0
        while i < len(events) and events[i][0] <= start:
            nbytes, i = nbytes + events[i][1], i + 1
        free = start + cost(nbytes)
    return free


def merged_units(layers: list[dict], min_numel: int) -> list[dict]:
    """Layers (in ready order) grouped as an integer ``buckets`` groups them
    (``lags_hvd.layout.merge_small_runs``): a unit is ready with its last member and
    selects once for all of them."""
    units = []
    for run in merge_small_runs([layer["numel"] for layer in layers], min_numel):
        members = [layers[i] for i in run]
        units.append(
            {
                "numel": sum(m["numel"] for m in members),
                "ready_s": members[-1]["ready_s"],
                "select_s": sum(m["select_s"] for m in members),
            }
        )
    return units


def auto_units(
    layers: list[dict],
    net,
    density: float,
    scale: float,
    min_hook: float,
    aggregation: str = "allgather",
    owner_keep: float = 1.0,
) -> list[dict]:
    """Layers (in ready order) grouped as ``buckets="auto"`` plans them for this network
    (``lags_hvd.planner.plan_buckets``): the engine's cost per bucket fitted to the
    measured per-layer hook times (``fixed + per_element * n``, never below
    ``min_hook``), the link's allgather and allreduce as alpha + beta * bytes."""
    costs = fit_engine_costs([(layer["numel"], layer["select_s"]) for layer in layers], 0.0)
    engine = EngineCosts(max(scale * costs.fixed, min_hook), scale * costs.per_element)
    affine = {
        name: CostModel(getattr(net, name)(0), getattr(net, name)(1) - getattr(net, name)(0))
        for name in ("allgather", "allreduce")
    }
    network = NetworkModel(net.p, affine["allgather"], affine["allreduce"], aggregation, owner_keep)
    params = [ParamProfile(layer["name"], layer["numel"], scale * layer["ready_s"], density) for layer in layers]
    buckets, _ = plan_buckets(params, network, engine)
    by_name = {layer["name"]: layer for layer in layers}
    units = []
    for bucket in buckets:
        numel = sum(by_name[name]["numel"] for name in bucket)
        units.append(
            {
                "numel": numel,
                "ready_s": max(by_name[name]["ready_s"] for name in bucket),
                "select_s": costs.fixed + costs.per_element * numel,
            }
        )
    return units


def lags_time(t_f, t_b, t_u, merge, units, net, density, scale, min_hook) -> float:
    delay, events = 0.0, []
    for unit in units:
        delay += max(scale * unit["select_s"], min_hook)
        events.append((scale * unit["ready_s"] + delay, sparse_bytes(unit["numel"], density)))
    return t_f + max(t_b + delay, batched_pipeline(events, net.allgather)) + scale * merge + t_u


def lags_rs_time(
    t_f, t_b, t_u, merge, units, net, density, scale, min_hook, owner_keep: float = 1.0, host_extra: float = 0.0
) -> float:
    """aggregation="reduce_scatter": each unit's split (an alltoall of its k rows) starts
    from its hook and the splits are pipelined on the link, as the allgathers are above;
    in synchronize() the owners' selections, about K / P rows per worker and unit
    (K = ceil(owner_keep k)), go out as one allgather (Horovod fuses them), with the
    balancing summaries' Q + 1 rows per owner every REBALANCE_EVERY iterations, spread
    over those iterations. ``host_extra``: each bucket's host work beyond what it costs at
    P = 8, on the host whatever the accelerator (``host_growth``)."""
    delay, events, gathered = 0.0, [], 0.0
    for unit in units:
        delay += max(scale * unit["select_s"], min_hook) + host_extra
        k = k_for_density(density, unit["numel"])
        events.append((scale * unit["ready_s"] + delay, net.alltoall(k * ROW_BYTES)))
        kept = global_k(k, unit["numel"], owner_keep)
        gathered += (kept / net.p + (SUMMARY_POINTS + 1) / REBALANCE_EVERY) * ROW_BYTES
    return t_f + max(t_b + delay, pipeline(events)) + net.allgather(gathered) + scale * merge + t_u


def lags_bound_time(t_f, t_b, t_u, merge, layers, net, density, scale, min_hook) -> float:
    """No bucketing of LAGS is faster than this, in the model above (every bucket sparse):
    the bucket holding the last gradient launches after backprop and a hook, and its
    exchange costs at least the last layer's alone; and every byte goes over the one link,
    in messages that cost at least one message of the whole model, the first of them
    launched no earlier than the first gradient and a hook::

        T >= t_f + max(t_b + h + AG(m(last)), ready_first + h + AG(m(all))) + merge + t_u
    """
    last = max(layers, key=lambda layer: layer["ready_s"])
    first = scale * min(layer["ready_s"] for layer in layers)
    total = sum(layer["numel"] for layer in layers)
    tail = t_b + min_hook + net.allgather(sparse_bytes(last["numel"], density))
    link = first + min_hook + net.allgather(sparse_bytes(total, density))
    return t_f + max(tail, link) + scale * merge + t_u


def predict(
    profile: dict, costs: dict, net, density: float, scale: float = 1.0, min_hook: float = 0.0, rs_host: float = 0.0
) -> dict:
    """Iteration time of each method for one model. ``scale`` multiplies every compute time;
    ``min_hook``: the least one bucket's hook work (or TopK-SGD's selection) can cost;
    ``rs_host``: a reduce_scatter bucket's host work beyond its cost at P = 8 (``host_growth``)."""
    t_f, t_b, t_u = (scale * profile[k] for k in ("forward_s", "backward_s", "update_s"))
    layers = profile["layers"]
    # dense: every gradient ready while the link is busy is fused into the next allreduce
    dense_end = batched_pipeline([(scale * layer["ready_s"], 4 * layer["numel"]) for layer in layers], net.allreduce)
    # topk: after backprop, one selection and one allgather
    total = sum(layer["numel"] for layer in layers)
    topk_select, topk_exchange = (
        max(scale * costs["topk_select_s"], min_hook),
        net.allgather(sparse_bytes(total, density)),
    )
    # lags: per-unit selection delays backprop; exchanges pipelined on the link
    step = (t_f, t_b, t_u, costs["lags_merge_s"])
    link = (net, density, scale, min_hook)

    def allgather(units: list[dict]) -> float:
        return lags_time(*step, units, *link)

    def reduce_scatter(units: list[dict], owner_keep: float = 1.0) -> float:
        return lags_rs_time(*step, units, *link, owner_keep=owner_keep, host_extra=rs_host)

    merged = merged_units(layers, MERGE_NUMEL)
    return {
        "dense": t_f + max(t_b, dense_end) + t_u,
        "topk": t_f + t_b + topk_select + topk_exchange + scale * costs["topk_merge_s"] + t_u,
        "lags": allgather(layers),
        "lags-merged": allgather(merged),
        "lags-auto": allgather(auto_units(layers, *link)),
        "lags-bound": lags_bound_time(*step, layers, *link),
        "lags-rs": reduce_scatter(merged),
        "lags-auto-rs": reduce_scatter(auto_units(layers, *link, "reduce_scatter")),
        "lags-auto-rs2": reduce_scatter(auto_units(layers, *link, "reduce_scatter", 2.0), owner_keep=2.0),
        "single": t_f + t_b + t_u,
    }


def measured_costs(run: dict) -> dict:
    """TopK-SGD's selection and merge and LAGS's merge as measured (TopK-SGD's as 0 where the
    run has none: its prediction is then not compared)."""
    methods = run["methods"]
    topk = methods.get("topk", {"median_s": {"select": 0.0, "merge": 0.0}})["median_s"]
    return {
        "topk_select_s": topk["select"],
        "topk_merge_s": topk["merge"],
        "lags_merge_s": methods["lags"]["median_s"]["merge"],
    }


def validate(runs: list[dict]) -> list[dict]:
    rows = []
    for run in (r for r in runs if r["link_rate_mbit"]):  # unshaped runs have no known rate
        link = SharedLink(run["network"], run["link_rate_mbit"] * 1e6)
        predicted = predict(run["profile"], measured_costs(run), link, run["density"])
        for method in (m for m in METHODS if m in run["methods"]):
            measured = run["methods"][method]["median_s"]["iteration"]
            rows.append(
                {
                    "model": run["model"],
                    "workers": run["workers"],
                    "method": method,
                    "measured_ms": 1e3 * measured,
                    "predicted_ms": 1e3 * predicted[method],
                    "error": predicted[method] / measured - 1,
                    # what no bucketing of LAGS can beat on this link (lags_bound_time)
                    **({"lags_bound_ms": 1e3 * predicted["lags-bound"]} if method == "lags" else {}),
                }
            )
    return rows


def host_growth(host_work: dict | None, path: str, workers: int) -> float:
    """Seconds of host work per bucket of ``path`` at ``workers`` beyond its cost at P = 8
    (never below 0), from ``host_work``'s record (``lags_hvd.experiments.host_work``: the
    mean over ResNet-50's buckets), linear in log P between the measured world sizes and
    flat beyond them; 0 without a record."""
    if host_work is None or workers <= 8:
        return 0.0
    measured = sorted((int(p), values[path]["mean_us"]) for p, values in host_work["worlds"].items())
    base = dict(measured).get(8)
    if base is None:
        raise ValueError("the host work record lacks P = 8 (lags_hvd.experiments.host_work)")
    logs = [math.log2(p) for p, _ in measured]
    at = float(np.interp(math.log2(workers), logs, [us for _, us in measured]))
    return max(0.0, at - base) * 1e-6


def extrapolate(runs: list[dict], host_per_bucket: float, host_work: dict | None = None) -> list[dict]:
    """Per model (its P=2 profile), rate and P: predicted times and speed-ups, no bucket's
    hook work below ``host_per_bucket`` seconds, and a reduce_scatter bucket's host work
    growing with P as ``host_work`` measured it (``host_growth``)."""
    rows = []
    for run in (r for r in runs if r["workers"] == 2):
        scale = run["calibration"]["gpu_compute_s"] / run["calibration"]["cpu_compute_s"]
        for rate, alpha in RATES_GBIT.items():
            for workers in WORKERS:
                t = predict(
                    run["profile"],
                    measured_costs(run),
                    Switched(workers, rate * 1e9 / 8, alpha),
                    run["density"],
                    scale,
                    host_per_bucket,
                    host_growth(host_work, "reduce_scatter", workers),
                )
                rows.append(
                    {
                        "model": run["model"],
                        "rate_gbit": rate,
                        "workers": workers,
                        **{f"{m}_ms": 1e3 * t[m] for m in ("single", "lags-bound") + METHODS},
                        **{f"scaling_{m}": workers * t["single"] / t[m] for m in METHODS},
                        "lags_vs_dense": t["dense"] / t["lags"],
                        "lags_vs_topk": t["topk"] / t["lags"],
                        "merged_vs_dense": t["dense"] / t["lags-merged"],
                        "merged_vs_topk": t["topk"] / t["lags-merged"],
                        "auto_vs_dense": t["dense"] / t["lags-auto"],
                        "auto_vs_topk": t["topk"] / t["lags-auto"],
                        "bound_vs_topk": t["topk"] / t["lags-bound"],
                        "rs_vs_dense": t["dense"] / t["lags-rs"],
                        "auto_rs_vs_dense": t["dense"] / t["lags-auto-rs"],
                        "auto_rs_vs_auto": t["lags-auto"] / t["lags-auto-rs"],
                        "auto_rs2_vs_dense": t["dense"] / t["lags-auto-rs2"],
                        "auto_rs2_vs_auto": t["lags-auto"] / t["lags-auto-rs2"],
                    }
                )
    return rows


def print_table(rows: list[dict], what: str, cell, tail=lambda model, rate: "") -> None:
    """One line per model and rate, one ``cell`` per P in 4, 16, 64, 256."""
    sizes = (4, 16, 64, 256)
    print(f"\n{'model':>12} {'Gbit/s':>6} " + " ".join(f"{'P=' + str(p):>12}" for p in sizes) + f"   ({what})")
    for model in sorted({r["model"] for r in rows}):
        for rate in RATES_GBIT:
            cells = [
                next(r for r in rows if r["model"] == model and r["rate_gbit"] == rate and r["workers"] == p)
                for p in sizes
            ]
            print(f"{model:>12} {rate:>6} " + " ".join(cell(c) for c in cells) + tail(model, rate))


def crossovers(rows: list[dict]) -> dict:
    """Per model and rate: the least P from which reduce_scatter (auto buckets) is faster
    than the allgather (auto buckets) by more than ``TIE`` at every larger P simulated;
    None if never (a compute-bound model, where both finish with backprop, ties)."""
    result = {}
    for model in sorted({r["model"] for r in rows}):
        result[model] = {}
        for rate in RATES_GBIT:
            series = sorted(
                (r["workers"], r["auto_rs_vs_auto"]) for r in rows if r["model"] == model and r["rate_gbit"] == rate
            )
            wins = [p for i, (p, _) in enumerate(series) if all(ratio > 1 + TIE for _, ratio in series[i:])]
            result[model][str(rate)] = wins[0] if wins else None
    return result


def plot(rows: list[dict], path: Path) -> None:
    models = sorted({r["model"] for r in rows})
    fig, axes = pyplot().subplots(
        len(models), len(RATES_GBIT), figsize=(3.4 * len(RATES_GBIT), 2.6 * len(models)), squeeze=False, sharex=True
    )
    for i, model in enumerate(models):
        for j, rate in enumerate(RATES_GBIT):
            ax = axes[i][j]
            sub = sorted(
                (r for r in rows if r["model"] == model and r["rate_gbit"] == rate), key=lambda r: r["workers"]
            )
            ps = [r["workers"] for r in sub]
            ax.plot(ps, ps, "k:", lw=1, label="ideal")
            for method, style in (
                ("dense", "s-"),
                ("topk", "^-"),
                ("lags", "o-"),
                ("lags-merged", "x--"),
                ("lags-auto", "d-"),
                ("lags-auto-rs", "*-"),
            ):
                ax.plot(ps, [r[f"scaling_{method}"] for r in sub], style, ms=3, label=method)
            ax.set_xscale("log", base=2)
            ax.set_yscale("log", base=2)
            ax.set_title(f"{model}, {rate} Gbit/s", fontsize=9)
            if j == 0:
                ax.set_ylabel("speed-up over 1 worker")
            if i == len(models) - 1:
                ax.set_xlabel("workers P")
    axes[0][0].legend(fontsize=7)
    save_figure(fig, path, "simulated weak scaling (compute scaled to the assumed GPU)")
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", type=Path, default=ROOT / "docs" / "results" / "full.json")
    parser.add_argument(
        "--engine",
        type=Path,
        default=ROOT / "docs" / "results" / "engine_cpu.json",
        help="make bench-engine's record: the engine's cost per bucket",
    )
    parser.add_argument(
        "--host-work",
        type=Path,
        default=ROOT / "docs" / "results" / "host_work.json",
        help="make bench-engine's host work per bucket by P (lags_hvd.experiments.host_work)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "simulate.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "simulate_scaling.png")
    parser.add_argument(
        "--validate-only",
        action="store_true",
        help="only the predictions of the measured runs (e.g. the emulated accelerator's), written to --out",
    )
    args = parser.parse_args()
    runs = [r for r in json.loads(args.bench.read_text())["runs"] if "profile" in r]
    if not runs:
        raise SystemExit(f"{args.bench} holds no run with a dense per-layer profile")
    try:
        host_per_bucket = host_seconds_per_bucket(json.loads(args.engine.read_text()))
    except (OSError, json.JSONDecodeError, ValueError) as error:
        raise SystemExit(f"{args.engine}: {error}") from None
    checks = validate(runs)
    print(f"{'model':>12} {'P':>2} {'method':>6} {'measured ms':>12} {'predicted ms':>13} {'error':>7}")
    for r in checks:
        print(
            f"{r['model']:>12} {r['workers']:>2} {r['method']:>6} {r['measured_ms']:>12.1f} "
            f"{r['predicted_ms']:>13.1f} {r['error']:>+7.0%}"
        )
    errors = sorted(abs(r["error"]) for r in checks)
    if errors:
        print(
            f"absolute error: median {errors[len(errors) // 2]:.0%}, max {errors[-1]:.0%} "
            f"over {len(errors)} predictions"
        )
    else:
        print("no shaped run to validate against (unshaped runs have no known link rate)")
    if args.validate_only:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"validation": checks}, indent=1))
        return
    print(f"host work per bucket: {1e6 * host_per_bucket:.0f} us ({args.engine.name})")
    host_work = json.loads(args.host_work.read_text()) if args.host_work.exists() else None
    growth = {p: 1e6 * host_growth(host_work, "reduce_scatter", p) for p in WORKERS}
    print(f"reduce_scatter's host work per bucket beyond P = 8 ({args.host_work.name}): {growth} us")
    scaled = extrapolate(runs, host_per_bucket, host_work)
    print_table(
        scaled,
        "LAGS speed-up vs dense / vs TopK; auto buckets in brackets",
        lambda c: (
            f"{c['lags_vs_dense']:>5.2f}/{c['lags_vs_topk']:<4.2f}({c['auto_vs_dense']:.2f}/{c['auto_vs_topk']:.2f})"
        ),
    )
    print_table(
        scaled,
        "LAGS auto vs TopK / the most any bucketing can reach (lags_bound_time)",
        lambda c: f"{c['auto_vs_topk']:>5.2f}/{c['bound_vs_topk']:<6.2f}",
    )
    crossover = crossovers(scaled)
    print_table(
        scaled,
        "auto buckets, reduce_scatter: speed-up vs dense / vs allgather; crossover P",
        lambda c: f"{c['auto_rs_vs_dense']:>6.2f}/{c['auto_rs_vs_auto']:<5.2f}",
        lambda model, rate: f"   {crossover[model][str(rate)]}",
    )
    print_table(
        scaled,
        "the same with owner_keep=2: speed-up vs dense / vs allgather",
        lambda c: f"{c['auto_rs2_vs_dense']:>6.2f}/{c['auto_rs2_vs_auto']:<5.2f}",
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "validation": checks,
                "extrapolation": scaled,
                "crossover_p": crossover,
                "assumptions": {
                    "alpha_per_step_s": RATES_GBIT,
                    "host_seconds_per_bucket": host_per_bucket,
                    "reduce_scatter_host_growth_us": growth,
                    "merge_numel": MERGE_NUMEL,
                },
            },
            indent=1,
        )
    )
    plot(scaled, args.plot)


if __name__ == "__main__":
    main()
