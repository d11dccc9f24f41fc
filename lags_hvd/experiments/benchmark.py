"""Side-by-side benchmarks of LAGS-SGD and its baselines on an emulated slow network.

    python scripts/benchmark.py --suite adaptive      # fixed vs adaptive density (make bench-adaptive)
    python scripts/benchmark.py --suite quick         # ResNet-20 + small LSTM, P=2 (make bench-quick)
    python scripts/benchmark.py --suite full          # the paper's models, P=2 and 4 (make bench)
    python scripts/benchmark.py --suite aggregation   # allgather vs reduce_scatter, P=2 and 4 (make bench-aggregation)

For each model the shaped link rate reproduces the paper's communication-to-
computation ratio on these CPUs:

    rate = 1 Gbit/s * t_gpu / t_cpu,   t_gpu = FLOPs(forward + backward) / GPU_FLOPS

t_cpu is measured here (one thread, the benchmark's batch); FLOPs are counted by
torch; GPU_FLOPS (--gpu-tflops, default 5) is the effective fp32 training
throughput assumed for the paper's GPUs. Where that ratio would make one dense
iteration take more than --max-ratio (6) times the compute (VGG-16, ResNet-50,
Inception-v4 and the LSTM need minutes per dense iteration at the paper's ratio),
the rate is raised to that ratio instead; every result prints both ratios, and
scripts/simulate.py extrapolates to the paper's. All methods of one model and P
run in the same processes, taking turns (``bench_worker``), inside one
network namespace (scripts/netns_run.sh, root), after a network profile of the
shaped link. Results: docs/results/<suite>.json and .csv, plots in docs/img/; each
(model, P) launch is also kept under runs/bench/<suite>/ as it completes, and
``--resume`` takes those instead of measuring them again (``make bench`` takes hours).
"""

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from lags_hvd.experiments import ROOT, emulation, models
from lags_hvd.figures import pyplot, save_figure

PAPER_LINK_BITS = 1e9
SUITES = {
    "adaptive": dict(
        models={"vgg16": 16, "resnet20": 32},
        methods=["lags", "lags-adaptive"],
        workers=[2, 4],
        rounds=4,
        iterations=4,
        max_ratio=None,
    ),
    "quick": dict(
        models={"resnet20": 32, "lstm_small": 20},
        methods=[
            *["local", "dense", "topk", "lags", "lags-auto", "lags-default", "lags-merged", "lags-serial"],
            *["dense@torch", "lags@torch", "lags-default@torch"],  # the same over torch.distributed
        ],
        workers=[2],
        rounds=6,
        iterations=2,
        max_ratio=6.0,
    ),
    "ddp": dict(  # DDP's hooks beside the optimizer, all over torch.distributed but `dense` and `lags-default`
        models={"resnet20": 32, "lstm_small": 20},
        methods=[
            *["local", "dense", "lags-default", "ddp@torch", "ddp-powersgd1@torch", "ddp-powersgd4@torch"],
            *["ddp-lags@torch", "lags-default@torch"],
        ],
        workers=[2],
        rounds=6,
        iterations=2,
        max_ratio=6.0,
    ),
    "aggregation": dict(
        models={"resnet20": 32, "lstm_small": 20},
        methods=["local", "dense", "topk", "lags", "lags-merged", "lags-rs"],
        workers=[2, 4],
        rounds=3,
        iterations=2,
        max_ratio=6.0,
    ),
    # the paper's models and batches on an emulated accelerator (lags_hvd.experiments.emulation):
    # computation as timed waits at 5 TFLOP/s, the CPU free for the real exchanges; per-node
    # link rates of 1 and 10 Gbit/s (make bench-emulated)
    "emulated": dict(
        models={"resnet20": 32, "vgg16": 128, "resnet50": 32, "inception_v4": 64, "lstm_ptb": 20},
        methods=["local", "dense", "topk", "lags", "lags-default", "lags-serial"],
        workers=[2, 4, 8],
        rounds=4,
        iterations=2,
        max_ratio=None,
        emulate_tflops=5.0,
        node_rates_mbit=[1000, 10000],
        # P = 8 processes of every method's model copy exceed this machine's 24 GiB for the
        # two largest models, and ResNet-50's (the PTB LSTM's at P = 4) with more than three copies
        left_out={
            ("inception_v4", 8): "all",
            ("lstm_ptb", 8): "all",
            ("resnet50", 8): ["topk", "lags-default"],
            ("lstm_ptb", 4): ["topk", "lags-default"],  # 66M parameters: three copies fit
        },
    ),
    "full": dict(
        models={"resnet20": 32, "vgg16": 16, "resnet50": 4, "inception_v4": 2, "lstm_ptb": 10},
        methods=["local", "dense", "topk", "lags", "lags-auto", "lags-default", "lags-merged", "lags-serial"],
        workers=[2, 4],
        rounds=4,
        iterations=2,
        max_ratio=6.0,
        # every method trains its own copy of the model in each process: at P = 4 the two
        # largest models fit this machine's 24 GiB only with copies left out (Inception-v4,
        # 43M parameters: one; the PTB LSTM, 66M: three, its launches with one and two
        # less were killed; its dense time there is the link's, 99 s per iteration)
        left_out={("inception_v4", 4): ["lags-default"], ("lstm_ptb", 4): ["dense", "lags-default", "lags-merged"]},
    ),
}


def launch_methods(suite: dict, model_name: str, workers: int) -> list[str]:
    """The suite's methods for one launch, less those it leaves out there (``left_out``)."""
    dropped = suite.get("left_out", {}).get((model_name, workers), [])
    return [method for method in suite["methods"] if method not in dropped and dropped != "all"]


def calibrate(model_name: str, batch: int, gpu_tflops: float) -> dict:
    """CPU seconds and FLOPs of forward + backward, one thread, no communication."""
    torch.set_num_threads(1)
    model, data, loss_fn = models.build(model_name, batch)
    times = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        loss_fn(model, data).backward()
        times.append(time.perf_counter() - start)
    with FlopCounterMode(display=False) as counter:
        loss_fn(model, data).backward()
    flops = counter.get_total_flops()
    cpu, gpu = statistics.median(times[1:]), flops / (gpu_tflops * 1e12)
    params = sum(p.numel() for p in model.parameters())
    return {
        "cpu_compute_s": cpu,
        "flops": flops,
        "gpu_compute_s": gpu,
        "params": params,
        "rate_mbit": PAPER_LINK_BITS * gpu / cpu / 1e6,
    }


def emulated_calibration(model_name: str, batch: int, tflops: float) -> dict:
    """``calibrate``'s record for an emulated accelerator: the compute is the emulation's
    layer times (``emulation.layer_times``), on this CPU and on the "GPU" alike; the paper's
    rate is its 1 Gbit/s."""
    layers = emulation.layer_times(model_name, batch, tflops)
    compute = sum(layer.forward_s + layer.backward_s for layer in layers)
    with torch.device("meta"):
        params = sum(p.numel() for p in models.MODELS[model_name].factory().parameters())
    return {
        "cpu_compute_s": compute,
        "gpu_compute_s": compute,
        "flops": compute * tflops * 1e12,
        "params": params,
        "rate_mbit": PAPER_LINK_BITS / 1e6,
        "tflops": tflops,
        "layers": len(layers),
    }


def comm_to_comp(params: int, workers: int, rate_bits: float, compute_s: float) -> float:
    """Dense ring-allreduce time over compute time at a link rate."""
    return 2 * (workers - 1) / workers * params * 4 * 8 / rate_bits / compute_s


def emulated_rate_mbit(cal: dict, max_ratio: float) -> float:
    """The paper's rate, raised where the dense ratio (at P=2) would exceed ``max_ratio``."""
    capped = cal["params"] * 4 * 8 / (max_ratio * cal["cpu_compute_s"]) / 1e6
    return max(cal["rate_mbit"], capped)


def run_in_namespace(rate: str, command: list[str], timeout: float) -> None:
    """``command`` in a namespace of its own whose loopback is shaped to ``rate`` (tc's form,
    or "none"). The token bucket holds 4 ms at the rate (256 KB at least): a smaller bucket
    caps a multi-Gbit/s link below its rate, since tbf refills it once per timer tick."""
    burst = max(256 * 1024, int(float(rate.removesuffix("mbit")) * 1e6 / 8 * 4e-3)) if rate.endswith("mbit") else 0
    wrapped = [
        str(ROOT / "scripts" / "netns_run.sh"),
        "--rate",
        rate,
        *(["--burst", str(burst)] if burst else []),
        "--",
    ]
    wrapped += command
    proc = subprocess.run(wrapped, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(
            f"failed ({proc.returncode}): {' '.join(command)}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )


def horovodrun(workers: int, *args: str) -> list[str]:
    """The command that runs ``python *args`` on ``workers`` local Gloo workers over loopback."""
    bindir = Path(sys.executable).parent
    return [
        str(bindir / "horovodrun"),
        "-np",
        str(workers),
        "-H",
        f"localhost:{workers}",
        "--gloo",
        "--network-interface",
        "lo",
        sys.executable,
        *args,
    ]


def run_side_by_side(model_name, batch, workers, rate, suite, tmp) -> dict:
    """Profile the shaped link, then run every method of the suite in one launch."""
    profile = Path(tmp) / f"net-{model_name}-{workers}.json"
    out = Path(tmp) / f"{model_name}-{workers}.json"
    run_in_namespace(
        rate,
        horovodrun(
            workers,
            "-m",
            "lags_hvd.experiments.netprofile",
            "--out",
            str(profile),
            "--sizes",
            "1024,8192,65536,262144",
            "--repeats",
            "3",
        ),
        timeout=900,
    )
    args = [
        "-m",
        "lags_hvd.experiments.bench_worker",
        "--model",
        model_name,
        "--methods",
        ",".join(launch_methods(suite, model_name, workers)),
        "--batch-size",
        str(batch),
        "--rounds",
        str(suite["rounds"]),
        "--iterations",
        str(suite["iterations"]),
        "--network-profile",
        str(profile),
        "--out",
        str(out),
        *(["--emulate-tflops", str(suite["emulate_tflops"])] if "emulate_tflops" in suite else []),
    ]
    run_in_namespace(rate, horovodrun(workers, *args), timeout=7200)
    result = json.loads(out.read_text())
    result["network"] = json.loads(profile.read_text())
    return result


def paired_ratios(base: dict, method: dict) -> list[float]:
    """Per round, base time / method time: the two measured back to back, so the slow
    drifts of a shared machine cancel within a round."""
    return [b / m for b, m in zip(base["round_medians_s"], method["round_medians_s"])]


def quartiles(values: list[float]) -> list[float]:
    """[first, third] quartile: the spread a ratio is reported with (one value: itself twice)."""
    if len(values) < 2:
        return [values[0], values[0]]
    q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return [q1, q3]


def median_and_quartiles(ratios: list[float]) -> tuple[float, list[float]]:
    """A same-run ratio as reported: the median round's, and the quartiles over rounds."""
    return statistics.median(ratios), quartiles(ratios)


def summarize(runs: list[dict]) -> list[dict]:
    """One row per model, P and method: breakdown, speed-ups against the baselines of the
    same run, and for LAGS the pipelining benefit against lags-serial."""
    rows = []
    for run in runs:
        same = run["methods"]
        for method, r in same.items():
            t = r["median_s"]
            row = {
                "model": run["model"],
                "workers": run["workers"],
                "method": method,
                "iteration_ms": 1e3 * t["iteration"],
                "forward_ms": 1e3 * t["forward"],
                "backward_ms": 1e3 * (t["backward"] - t["select"]),
                "select_ms": 1e3 * t["select"],
                "comm_not_hidden_ms": 1e3 * t["wait"],
                "merge_update_ms": 1e3 * t["merge_update"],
                "merge_ms": 1e3 * t["merge"],
                "bytes_per_worker": r["bytes_per_worker"],
                "throughput": r["throughput"],
                "average_density": r.get("average_density", 1.0 if method == "dense" else None),
                "link_rate_mbit": run["link_rate_mbit"],
                "comm_to_comp": run["comm_to_comp"],
                "paper_comm_to_comp": run["paper_comm_to_comp"],
                "node_rate_mbit": run.get("node_rate_mbit"),
                "host_cpu_ms": 1e3 * t["host_cpu"] if "host_cpu" in t else None,
            }
            for base in ("dense", "topk", "lags"):
                if base in same and base != method:
                    row[f"speedup_vs_{base}"], row[f"speedup_vs_{base}_quartiles"] = median_and_quartiles(
                        paired_ratios(same[base], r)
                    )
            if "local" in same:  # the floor: the same model with no communication at all
                row["over_local"], row["over_local_quartiles"] = median_and_quartiles(paired_ratios(r, same["local"]))
                if "host_cpu" in t:  # CPU time beyond the floor's: the engine's and the exchanges' host work
                    row["host_cpu_over_local_ms"] = 1e3 * (t["host_cpu"] - same["local"]["median_s"]["host_cpu"])
            if "buckets" in r:
                row["buckets"] = r["buckets"]
            if method in ("lags", "lags-adaptive", "lags-auto", "lags-default") and t["backward"] > 0:
                row["overhead_of_backward"] = (t["select"] + t["merge"]) / (t["backward"] - t["select"])
            if method == "lags" and "lags-serial" in same:
                serial = same["lags-serial"]["median_s"]
                t_f, t_b = serial["forward"], serial["backward"]
                t_c = serial["synchronize"] - serial["merge"]
                s_max = (t_f + t_b + t_c) / (t_f + max(t_b, t_c))
                achieved = paired_ratios(same["lags-serial"], r)
                fraction, spread = (
                    median_and_quartiles([(a - 1) / (s_max - 1) for a in achieved]) if s_max > 1 else (None, None)
                )
                row.update(
                    s_max=s_max,
                    pipelining_speedup=statistics.median(achieved),
                    fraction_of_max_benefit=fraction,
                    fraction_of_max_benefit_quartiles=spread,
                )
            rows.append(row)
    return rows


def print_table(rows):
    """The rows as a table; each same-run ratio with its quartiles over rounds."""
    header = (
        f"{'model':>12} {'P':>2} {'method':>14} {'iter ms':>9} {'fwd':>7} {'bwd':>7} {'select':>7} "
        f"{'comm':>8} {'merge+upd':>9} {'density':>8} {'KB/worker':>10} {'x local':>16} {'vs dense':>8} "
        f"{'vs topk':>16} "
        f"{'S_max':>6} {'of max':>17} {'ovh/bwd':>7} {'cpu ms':>7} {'+local':>7}  ratio emulated (paper)"
    )
    print(header)
    for r in rows:
        fmt = lambda key, spec: format(r[key], spec) if r.get(key) is not None else "-"  # noqa: E731

        def spread(key, spec):  # "median (q1-q3)"
            if r.get(key) is None:
                return "-"
            q1, q3 = r[f"{key}_quartiles"]
            return f"{r[key]:{spec}} ({q1:{spec}}-{q3:{spec}})"

        print(
            f"{r['model']:>12} {r['workers']:>2} {r['method']:>14} {r['iteration_ms']:>9.1f} "
            f"{r['forward_ms']:>7.1f} {r['backward_ms']:>7.1f} {r['select_ms']:>7.1f} "
            f"{r['comm_not_hidden_ms']:>8.1f} {r['merge_update_ms']:>9.1f} "
            f"{fmt('average_density', '.4f'):>8} {r['bytes_per_worker'] / 1024:>10.1f} "
            f"{spread('over_local', '.2f'):>16} {fmt('speedup_vs_dense', '.2f'):>8} "
            f"{spread('speedup_vs_topk', '.2f'):>16} "
            f"{fmt('s_max', '.2f'):>6} {spread('fraction_of_max_benefit', '.0%'):>17} "
            f"{fmt('overhead_of_backward', '.1%'):>7} {fmt('host_cpu_ms', '.1f'):>7} "
            f"{fmt('host_cpu_over_local_ms', '+.1f'):>7}  "
            + (
                f"{r['comm_to_comp']:.2f} ({r['paper_comm_to_comp']:.1f}) @ {r['link_rate_mbit']:.1f} Mbit/s"
                if r["link_rate_mbit"]
                else f"- ({r['paper_comm_to_comp']:.1f}) unshaped loopback"
            )
        )
        if r["method"] == "lags-adaptive" and r.get("speedup_vs_lags") is not None:
            print(
                f"{'':>31}side by side: adaptive (density {r['average_density']:.4f}) is "
                f"{r['speedup_vs_lags']:.3f}x as fast as fixed density"
            )


def plot_breakdowns(rows, path: Path, title: str):
    """Stacked time per iteration for every method, one panel per (model, P) in a grid of
    at most five columns. Dense, whose bar is the link's and several times any other, is
    cut at twice the tallest of the rest and labelled with its total, so that the sparse
    methods' breakdowns stay readable beside it."""
    parts = ["forward_ms", "backward_ms", "select_ms", "comm_not_hidden_ms", "merge_update_ms"]
    groups = sorted({(r["model"], r["workers"]) for r in rows})
    columns = min(5, len(groups))
    lines = -(-len(groups) // columns)
    fig, axes = pyplot().subplots(lines, columns, figsize=(3.6 * columns, 3.4 * lines), squeeze=False)
    for ax in axes.flat[len(groups) :]:
        ax.set_visible(False)
    for ax, (model_name, workers) in zip(axes.flat, groups):
        sub = [r for r in rows if r["model"] == model_name and r["workers"] == workers]
        methods = [r["method"] for r in sub]
        bottom = [0.0] * len(sub)
        for part in parts:
            values = [r[part] for r in sub]
            ax.bar(methods, values, bottom=bottom, label=part.replace("_ms", ""))
            bottom = [b + v for b, v in zip(bottom, values)]
        rest = [r["iteration_ms"] for r in sub if r["method"] != "dense"]
        if rest and "dense" in methods:
            top = 2.0 * max(rest)
            ax.set_ylim(0, top)
            ax.text(
                methods.index("dense"),
                0.97 * top,
                f"{sub[methods.index('dense')]['iteration_ms']:.0f}",
                ha="center",
                va="top",
                fontsize=7,
                color="white",
            )
        rate = sub[0]["link_rate_mbit"]
        ax.set_title(f"{model_name}, P={workers}, " + (f"{rate:.0f} Mbit/s" if rate else "loopback"), fontsize=9)
        ax.set_ylabel("ms per iteration")
        ax.tick_params(axis="x", rotation=45, labelsize=7)
    axes[0][0].legend(fontsize=7, loc="upper right")  # above the sparse bars, clear of dense
    save_figure(fig, path, title)
    print(f"wrote {path}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=sorted(SUITES), default="quick")
    parser.add_argument(
        "--rate",
        default="auto",
        help="link rate in Mbit/s (e.g. 100), 'auto' (derived, see above) or 'none' "
        "(plain loopback, still in a namespace of its own)",
    )
    parser.add_argument("--gpu-tflops", type=float, default=5.0)
    parser.add_argument(
        "--max-ratio",
        type=float,
        default=None,
        help="cap on the emulated dense communication-to-computation ratio at P=2 "
        "(default: 6 for suites with dense, none for the adaptive suite)",
    )
    parser.add_argument("--models", default=None, help="comma-separated subset of the suite's models")
    parser.add_argument("--workers", default=None, help="comma-separated subset of the suite's P")
    parser.add_argument(
        "--node-rates", default=None, help="emulated suite: comma-separated subset of its per-node rates (Mbit/s)"
    )
    parser.add_argument("--out-dir", type=Path, default=ROOT / "docs" / "results")
    parser.add_argument("--plot-dir", type=Path, default=ROOT / "docs" / "img")
    parser.add_argument(
        "--runs",
        type=Path,
        default=ROOT / "runs" / "bench",
        help="each (model, P) launch is kept here as it completes (<suite>/<model>-P<P>.json)",
    )
    parser.add_argument(
        "--resume",
        action="store_true",
        help="take the launches already kept under --runs instead of measuring them again",
    )
    parser.add_argument(
        "--kept-only", action="store_true", help="the report of the launches kept under --runs only, measuring none"
    )
    args = parser.parse_args()
    if os.geteuid() != 0 and not args.kept_only:
        raise SystemExit("benchmark.py creates network namespaces and needs root")
    suite = dict(SUITES[args.suite])
    for key, given in (("workers", args.workers), ("node_rates_mbit", args.node_rates)):
        if given:
            suite[key] = [int(value) for value in given.split(",")]
    max_ratio = args.max_ratio or suite["max_ratio"]
    chosen = args.models.split(",") if args.models else list(suite["models"])
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for model_name in chosen:
            batch = suite["models"][model_name]
            if "emulate_tflops" in suite:  # one shaped loopback carries every worker's traffic: P x a node's rate
                cal = emulated_calibration(model_name, batch, suite["emulate_tflops"])
                settings = [(p, node, p * node) for p in suite["workers"] for node in suite["node_rates_mbit"]]
            elif args.kept_only:  # the kept launches hold their own calibration
                cal = next(
                    (
                        json.loads(k.read_text())["calibration"]
                        for k in (args.runs / args.suite).glob(f"{model_name}-P*")
                    ),
                    None,
                )
                if cal is None:
                    continue
                settings = [(p, None, None) for p in suite["workers"]]
            else:
                cal = calibrate(model_name, batch, args.gpu_tflops)
                rate_mbit = (
                    None
                    if args.rate == "none"
                    else float(args.rate)
                    if args.rate != "auto"
                    else emulated_rate_mbit(cal, max_ratio)
                    if max_ratio
                    else cal["rate_mbit"]
                )
                settings = [(p, None, rate_mbit) for p in suite["workers"]]
            print(
                f"{model_name}: batch {batch}, {cal['params'] / 1e6:.2f}M params, CPU fwd+bwd "
                f"{1e3 * cal['cpu_compute_s']:.0f} ms, {cal['flops'] / 1e9:.1f} GFLOP -> GPU "
                f"{1e3 * cal['gpu_compute_s']:.1f} ms at {cal.get('tflops', args.gpu_tflops)} TFLOP/s"
                + ("" if "emulate_tflops" in suite else f"; paper-like rate {cal['rate_mbit']:.1f} Mbit/s"),
                flush=True,
            )
            for workers, node_mbit, rate_mbit in settings:
                if not launch_methods(suite, model_name, workers):
                    continue
                name = f"{model_name}-P{workers}" + (f"-{node_mbit:.0f}mbit" if node_mbit else "")
                kept = args.runs / args.suite / f"{name}.json"
                if (args.resume or args.kept_only) and kept.exists():
                    runs.append(json.loads(kept.read_text()))
                    print(f"  {name}: kept from {kept}", flush=True)
                    continue
                if args.kept_only:
                    continue
                started = time.perf_counter()
                run = run_side_by_side(
                    model_name, batch, workers, f"{rate_mbit:.3f}mbit" if rate_mbit else "none", suite, tmp
                )
                # the ratios: dense's ring allreduce at a node's rate (the emulated one's) over the compute
                ratio_rate, compute = (node_mbit or rate_mbit), cal["cpu_compute_s"]
                run.update(
                    link_rate_mbit=rate_mbit,
                    node_rate_mbit=node_mbit,
                    calibration=cal,
                    comm_to_comp=comm_to_comp(cal["params"], workers, ratio_rate * 1e6, compute) if rate_mbit else None,
                    paper_comm_to_comp=comm_to_comp(cal["params"], workers, cal["rate_mbit"] * 1e6, compute),
                )
                runs.append(run)
                kept.parent.mkdir(parents=True, exist_ok=True)
                kept.write_text(json.dumps(run, indent=1))  # an interrupted suite resumes from here
                times = ", ".join(f"{m} {1e3 * r['median_s']['iteration']:.0f}" for m, r in run["methods"].items())
                print(f"  {name}: {times} ms/iter ({time.perf_counter() - started:.0f} s)", flush=True)
    rows = summarize(runs)
    print_table(rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / f"{args.suite}.json").write_text(json.dumps({"rows": rows, "runs": runs}, indent=1))
    with open(args.out_dir / f"{args.suite}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=sorted({k for r in rows for k in r}))
        writer.writeheader()
        writer.writerows(rows)
    plot_breakdowns(rows, args.plot_dir / f"bench_{args.suite}.png", f"suite '{args.suite}'")


if __name__ == "__main__":
    main()
