"""Bytes per worker of the sparse aggregations, measured at P = 2, 3, 4 and 8.

    python scripts/traffic.py [--workers 2,3,4,8] [--out docs/results/traffic.json]   # make bench-traffic
    python scripts/traffic.py --workers 8 --merge-numel 131072 --out ...   # larger buckets: larger k
    python scripts/traffic.py --data shared ...     # every rank the same batch plus a little noise

Every P runs one job (``horovodrun``, loopback, oversubscribed beyond the cores:
this measures bytes, not time) of ``--worker`` processes. Each trains ResNet-20 on
synthetic batches (by default each rank and iteration its own batch, as data
parallelism gives each worker its own samples) with small tensors merged into
buckets of at least ``--merge-numel`` entries (default ``methods.MERGE_NUMEL``, so
that every bucket sends k >= P entries; larger buckets send larger k), in turn with
each of ``CONFIGS`` (the allgather, reduce_scatter, reduce_scatter with the owners
keeping 2k, ``owner_keep=2``, and both with ``regional_selection``), and records ``optimizer.traffic`` (the bytes each
exchange moved to and from the other ranks) per bucket at every iteration but the
first (which splits at equal regions), by default two windows of
``regions.REBALANCE_EVERY`` iterations: the regions drift from their balance between
two rebalancings, so one iteration is not a measurement. The report gives, per P and
configuration, the bytes each worker received in units of k entries (8 bytes each):
per iteration (every bucket, balancing summaries included) the mean and the worst
rank; per bucket with k >= P, and without the summaries, which come once per window,
the worst bucket of each iteration, averaged over the iterations and at its
largest; beside the allgather's P-1 and the 2(P-1)/P and 6(P-1)/P of Ok-Topk's lower
and upper bounds (owner_keep c moves the lower bound to (1 + c)(P-1)/P).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

from lags_hvd import regions
from lags_hvd.experiments import ROOT, models
from lags_hvd.experiments.benchmark import horovodrun
from lags_hvd.experiments.methods import MERGE_NUMEL
from lags_hvd.figures import pyplot, save_figure

CONFIGS = {
    "allgather": dict(aggregation="allgather"),
    "reduce_scatter": dict(aggregation="reduce_scatter"),
    "reduce_scatter c=2": dict(aggregation="reduce_scatter", owner_keep=2),
    "regional": dict(aggregation="reduce_scatter", regional_selection=True),
    "regional c=2": dict(aggregation="reduce_scatter", owner_keep=2, regional_selection=True),
}
ENTRY_BYTES = 8  # an int32 index and a float32 value
MODULE = "lags_hvd.experiments.traffic"


def worker(out: Path, iterations: int, density: float, merge_numel: int, data: str) -> None:
    """One process of the job: every configuration, each iteration's traffic per bucket."""
    import lags_hvd as hvd

    hvd.init()
    torch.set_num_threads(1)
    record = {}
    for config, options in CONFIGS.items():
        model, batch, loss_fn = models.build("resnet20", 8, seed=0)
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            named_parameters=model.named_parameters(),
            density=density,
            buckets=merge_numel,
            recipe="paper",
            **options,
        )
        steps = []
        for step in range(iterations):
            generator = torch.Generator().manual_seed(1000 * step + hvd.rank())
            if data == "shared":
                inputs = batch[0] + 0.1 * torch.randn(batch[0].shape, generator=generator)
                targets = batch[1]
            else:
                inputs = torch.randn(batch[0].shape, generator=generator)
                targets = torch.randint(10, batch[1].shape, generator=generator)
            optimizer.zero_grad()
            loss_fn(model, (inputs, targets)).backward()
            optimizer.step()
            state = optimizer.lags_state
            steps.append({name: {**traffic, "k": state.k[name]} for name, traffic in optimizer.traffic.items()})
        record[config] = steps
    everyone = hvd.allgather_object(record)
    if hvd.rank() == 0:
        out.write_text(json.dumps({"workers": hvd.size(), "density": density, "ranks": everyone}))
    hvd.barrier()


def summary_rows(config: str, iteration: int, world: int) -> int:
    """Rows of balancing summaries a worker receives per bucket at ``iteration``."""
    options = CONFIGS[config]
    if (
        options.get("aggregation") != "reduce_scatter"
        or options.get("regional_selection")
        or not regions.rebalancing(iteration)
    ):
        return 0
    return (world - 1) * (regions.SUMMARY_POINTS + 1)


def summarise(run: dict) -> dict:
    """Bytes received in units of k entries, over every iteration but the first: per
    worker and iteration (all buckets, summaries included: the mean and the worst rank),
    and the worst bucket of k >= P per iteration without its summaries (mean and largest)."""
    world, ranks = run["workers"], run["ranks"]
    summary = {
        "workers": world,
        "allgather_bound": world - 1,
        "lower_bound": 2 * (world - 1) / world,
        "okt_bound": 6 * (world - 1) / world,
    }
    for config in CONFIGS:
        iterations = range(1, len(ranks[0][config]))
        per_rank = [
            statistics.mean(
                sum(u["received"] for u in rank[config][t].values())
                / (ENTRY_BYTES * sum(u["k"] for u in rank[config][t].values()))
                for t in iterations
            )
            for rank in ranks
        ]
        worst_bucket = []
        for t in iterations:
            extra = summary_rows(config, t, world) * ENTRY_BYTES
            worst_bucket.append(
                max(
                    (rank[config][t][name]["received"] - extra) / (ENTRY_BYTES * u["k"])
                    for rank in ranks
                    for name, u in rank[config][t].items()
                    if u["k"] >= world
                )
            )
        summary[config] = {
            "mean_received_k": statistics.mean(per_rank),
            "max_received_k": max(per_rank),
            "worst_bucket_mean_k": statistics.mean(worst_bucket),
            "worst_bucket_max_k": max(worst_bucket),
            "worst_bucket_per_iteration_k": worst_bucket,
            "buckets": len(ranks[0][config][0]),
        }
    return summary


def plot(rows: list[dict], path: Path, merge_numel: int) -> None:
    """Left: bytes received per worker against P; right: at the largest P, the worst
    bucket of every iteration (the regions drift between two rebalancings)."""
    fig, (ax, drift) = pyplot().subplots(1, 2, figsize=(11, 3.8))
    ps = [r["workers"] for r in rows]
    ax.plot(ps, [r["allgather_bound"] for r in rows], "k:", label="allgather: P-1")
    ax.plot(ps, [r["okt_bound"] for r in rows], "k--", lw=1, label="Ok-Topk bound 6(P-1)/P")
    ax.plot(ps, [r["lower_bound"] for r in rows], "k-.", lw=1, label="lower bound 2(P-1)/P")
    largest = rows[-1]
    for config, style, color in zip(CONFIGS, ("s-", "o-", "^-", "D-", "v-"), ("C0", "C1", "C2", "C3", "C4")):
        ax.plot(ps, [r[config]["mean_received_k"] for r in rows], style, color=color, label=f"{config}: mean")
        ax.plot(
            ps,
            [r[config]["worst_bucket_mean_k"] for r in rows],
            style[0] + ":",
            color=color,
            alpha=0.6,
            label=f"{config}: worst bucket (k >= P), mean over iterations",
        )
        series = largest[config]["worst_bucket_per_iteration_k"]
        drift.plot(range(1, len(series) + 1), series, style[0] + "-", color=color, ms=3, label=config)
    for t in range(1, len(largest["allgather"]["worst_bucket_per_iteration_k"]) + 1):
        if regions.rebalancing(t):
            drift.axvline(t, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("workers P")
    ax.set_ylabel("received (units of k entries)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    drift.set_xlabel(f"iteration (dashed: rebalancing), P = {largest['workers']}")
    drift.set_ylabel("worst bucket received (units of k)")
    drift.grid(alpha=0.3)
    drift.legend(fontsize=7)
    save_figure(fig, path, f"measured bytes per worker (ResNet-20, buckets >= {merge_numel:,} entries)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,3,4,8")
    parser.add_argument(
        "--iterations",
        type=int,
        default=2 * regions.REBALANCE_EVERY + 1,
        help="iterations per configuration, every one but the first measured (default: two "
        "windows between rebalancings)",
    )
    parser.add_argument(
        "--data",
        choices=("own", "shared"),
        default="own",
        help="each rank its own batch (default), or every rank the same batch plus noise",
    )
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument(
        "--merge-numel",
        type=int,
        default=MERGE_NUMEL,
        help="buckets of at least this many entries (default %(default)s)",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "results" / "traffic.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "img" / "traffic.png")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # inside horovodrun
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker, args.iterations, args.density, args.merge_numel, args.data)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for workers in (int(p) for p in args.workers.split(",")):
            out = Path(tmp) / f"traffic-{workers}.json"
            subprocess.run(
                horovodrun(
                    workers,
                    "-m",
                    MODULE,
                    "--worker",
                    str(out),
                    "--iterations",
                    str(args.iterations),
                    "--density",
                    str(args.density),
                    "--merge-numel",
                    str(args.merge_numel),
                    "--data",
                    args.data,
                ),
                check=True,
                timeout=1800,
            )
            rows.append(summarise(json.loads(out.read_text())))
    print(
        f"{'P':>3} " + " ".join(f"{config:>28}" for config in CONFIGS) + f" {'2(P-1)/P':>9} {'6(P-1)/P':>9}\n"
        f"{'':>3} "
        + " ".join(f"{'mean / worst / bucket mean, max':>28}" for _ in CONFIGS)
        + "   (received, units of k entries: per worker, worst rank, worst bucket with k >= P)"
    )
    for r in rows:
        cells = [
            f"{r[c]['mean_received_k']:.2f} / {r[c]['max_received_k']:.2f} / "
            f"{r[c]['worst_bucket_mean_k']:.2f}, {r[c]['worst_bucket_max_k']:.2f}"
            for c in CONFIGS
        ]
        print(
            f"{r['workers']:>3} "
            + " ".join(f"{cell:>25}" for cell in cells)
            + f" {r['lower_bound']:>9.2f} {r['okt_bound']:>9.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "density": args.density,
                "merge_numel": args.merge_numel,
                "data": args.data,
                "iterations": args.iterations,
                "rows": rows,
            },
            indent=1,
        )
    )
    plot(rows, args.plot, args.merge_numel)


if __name__ == "__main__":
    main()
