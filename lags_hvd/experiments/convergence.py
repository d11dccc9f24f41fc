"""Convergence evidence: dense, TopK-SGD and LAGS-SGD on real data, several seeds.

    python scripts/convergence.py --suite quick     # make convergence-quick (about an hour)
    python scripts/convergence.py --suite full      # make convergence (hours; resumable)
    python scripts/convergence.py --suite aggregation   # make convergence-aggregation (allgather vs
                                                        # reduce_scatter, full budget)
    python scripts/convergence.py --suite aggregation-quick   # the same over 4 epochs, 2 seeds
    python scripts/convergence.py --suite clip      # Shakespeare with and without the gradient clip (30 min)

P = 4 workers (one thread each) train every method on
  * Fashion-MNIST with the small CNN (momentum SGD), for whole epochs;
  * Shakespeare with a 2-layer character LSTM (plain SGD, clip 0.25), for a number of steps.
Methods: dense (hvd.DistributedOptimizer), topk (TopK-SGD, density 0.001), lags (the
paper's Algorithm 1 at density 0.001, ``recipe="paper"``), lags-default (the library as
it comes, ``recipe="dgc"``, in the full suite), lags-dgc (the paper's with the fidelity options:
density warm-up, momentum correction where the optimizer has momentum, 1-D parameters
dense; not local clipping, which the quick suite measured harmful), and in the quick
suite lags-adaptive, each option alone (lags-warmup, lags-mc, lags-dense1d,
lags-localclip) where it applies, and lags-dgc-clip (lags-dgc with local clipping).

Each finished run's metrics land in docs/results/convergence/<suite>/ as
``<task>.<method>.seed<seed>.csv`` (and the delta log of the LAGS runs as ``.json``);
a run whose CSV is already there is skipped, so an interrupted suite continues where
it stopped, and a run that another suite made with the very same arguments is copied
from there rather than trained again. The report (docs/convergence-<suite>.md) and the figures are rebuilt
from whatever runs exist: mean and standard deviation over seeds.
"""

import argparse
import copy
import csv
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from lags_hvd.experiments import ROOT
from lags_hvd.figures import pyplot, save_figure

TASKS = ("fashion-mnist", "shakespeare", "shakespeare-gpt")
SUITES = (
    "quick",
    "full",
    "aggregation",
    "aggregation-quick",
    "clip",
    "ddp",
    "ddp-quick",
    "transformer",
    "transformer-quick",
    "transformer-long",
    "transformer-4800",
    "transformer-adam-methods",
)
METRIC = {
    "fashion-mnist": "test_accuracy",
    "shakespeare": "validation_perplexity",
    "shakespeare-gpt": "validation_perplexity",
}
HEADING = {
    "fashion-mnist": "Fashion-MNIST test accuracy",
    "shakespeare": "Shakespeare val. perplexity",
    "shakespeare-gpt": "Shakespeare GPT val. perplexity",
}
FM_STEPS_PER_EPOCH = 60000 // 4 // 32  # P = 4, batch 32 per worker
# lags-dgc-io: the character LSTM's input and output layers (10,240 entries each: 11 entries
# per step at density 0.001) sent at 0.01, 9% more traffic than lags-dgc
LM_IO_DENSITIES = "embedding.weight=0.01,decoder.weight=0.01"
ADAM_METHODS = {  # the Adam frontier's anchors in the suite's processes (--method adam-method)
    "adam-zero-one": "zero-one:variance_scaler=4",
    "adam-demo32": "demo:topk=32",
    "adam-diloco20": "diloco:every=20",
    "adam-sparseloco": "sparseloco:every=20,topk=64",
    "adam-powersgd4": "powersgd:rank=4",
}


CLIP_SUITE_RUNS = (
    " (none in the -noclip runs; in the -clipfb runs the optimizer clips inside synchronize() "
    "and gives what the clip removes back to the residuals, max_grad_norm)"
)


MAIN_METHODS = ["dense", "topk", "lags", "lags-dgc"]
QUICK_BUDGET = {"seeds": [42], "fm_epochs": 4, "lm_epochs": 4, "lm_steps": 150}
FULL_BUDGET = {"seeds": [42, 43, 44], "fm_epochs": 12, "lm_epochs": 8, "lm_steps": 250}
AGGREGATION = {  # reduce_scatter beside allgather at the same density, budget and seeds (Fashion-MNIST)
    "baseline": "lags",
    "delta_methods": ("lags", "lags-rs"),
    "methods": {"fashion-mnist": ["lags", "lags-rs"], "shakespeare": []},
}
AGGREGATION_DGC = ["lags-dgc-rs", "lags-dgc-rs2", "lags-dgc-rsr", "lags-dgc-rs2r"]
DDP = {  # DDP's hooks under torchrun: dense, PowerSGD (rank 4), LAGS
    "baseline": "ddp",
    "delta_methods": (),
    "methods": {"fashion-mnist": ["ddp", "ddp-powersgd4", "ddp-lags"], "shakespeare": []},
}
GPT = {"world": 2, "gpt_steps": 200}  # a GPT with AdamW at P = 2, 200 steps an epoch
PLANNED = ["lags-auto", "lags-dgc-auto", "lags-default"]
SUITE_SETTINGS = {
    "quick": {
        **QUICK_BUDGET,
        "methods": {
            "fashion-mnist": MAIN_METHODS + ["lags-adaptive", "lags-warmup", "lags-mc", "lags-dense1d"],
            "shakespeare": MAIN_METHODS
            + ["lags-adaptive", "lags-warmup", "lags-dense1d", "lags-localclip", "lags-dgc-clip"],
        },
    },
    # The full suite's LSTM has 128 hidden, so that 3 seeds of every method fit the suite's hours,
    # and lags-dgc clips as DGC does, each worker before selection instead of the merged gradient.
    # On the LSTM, lags-dgc-io sends its input and output layers at ten times the density; the
    # paper's update and lags-dgc also run with the planned buckets (buckets="auto"), and the
    # library as it comes (lags-default: recipe "dgc").
    "full": {
        **FULL_BUDGET,
        "lm_hidden": 128,
        "dgc_clip": "local",
        "delta_methods": ("lags", "lags-dgc", "lags-default"),
        "methods": {"fashion-mnist": MAIN_METHODS + PLANNED, "shakespeare": MAIN_METHODS + ["lags-dgc-io"] + PLANNED},
    },
    "aggregation-quick": {**QUICK_BUDGET, "seeds": [42, 43], **AGGREGATION},
    # And the owners keeping 2k (owner_keep=2), both under the fidelity options and both with
    # regional selection, whose traffic per bucket is fixed; the fidelity options' pair sat at the
    # target's edge after three seeds: two more seeds of it.
    "aggregation": {
        **FULL_BUDGET,
        **AGGREGATION,
        "baselines": {method: "lags-dgc" for method in AGGREGATION_DGC},
        "more_seeds": {method: [45, 46] for method in ["lags-dgc", *AGGREGATION_DGC]},
        "methods": {
            "fashion-mnist": ["lags", "lags-rs", "lags-rs2", "lags-dgc", *AGGREGATION_DGC],
            "shakespeare": [],
        },
    },
    "ddp": {
        **FULL_BUDGET,
        **DDP,
        "notes": [
            "The ddp-lags row is the hook given the optimizer (the optimizer doors' LAGS, run three seeds",
            "after the DDP door became the optimizer driven by DDP). The former hook's runs of the same",
            "suite (its own per-parameter selection and the paper's update: ddp-lags 91.05% ± 0.38, -0.32 pp;",
            "ddp-lags-mc with its own momentum correction 91.22% ± 0.37, -0.15 pp) are kept in",
            "`docs/results/convergence/ddp/former-hook/`; the ddp and ddp-powersgd4 runs are those of before,",
            "reused (same seeds, same code path for those methods).",
        ],
    },
    "ddp-quick": {
        **QUICK_BUDGET,
        **DDP,
        "notes": [
            "The ddp-lags row is the hook given the optimizer (the optimizer doors' LAGS). The former hook's",
            "runs of the same suite (its own per-parameter selection and the paper's update; ddp-lags",
            "88.45%, ddp-lags-mc with its own momentum correction 89.73%) are kept in",
            "`docs/results/convergence/ddp-quick/former-hook/`; the ddp and ddp-powersgd4 runs are those of",
            "before, reused.",
        ],
    },
    # Adam correction against the paper's update (lags), the default without it
    # (lags-default-ef) and the baselines; ddp-lags: the DDP door, AdamW given to the hook (torchrun).
    **{
        suite: {
            **budget,
            **GPT,
            "delta_methods": ("lags", "lags-default"),
            "methods": {
                "shakespeare-gpt": [
                    *("dense", "topk", "lags", "lags-default"),
                    *("lags-default-consensus", "lags-default-ef", "ddp-lags"),
                ]
            },
        }
        for suite, budget in (
            ("transformer", {"seeds": [42, 43, 44], "gpt_epochs": 6}),
            ("transformer-quick", {"seeds": [42], "gpt_epochs": 2}),
        )
    },
    "transformer-long": {  # the default against dense at twice the budget
        "seeds": [42, 43, 44],
        "gpt_epochs": 6,
        "world": 2,
        "gpt_steps": 400,
        "delta_methods": ("lags-default",),
        "methods": {"shakespeare-gpt": ["dense", "lags-default"]},
    },
    # Four times the budget, each epoch 1,200 of a worker's 1,385 batches: the Adam study's
    # longest run (docs/convergence.md) with the optimizer itself, one seed.
    "transformer-4800": {
        "seeds": [42],
        "gpt_epochs": 4,
        "world": 2,
        "gpt_steps": 1200,
        "delta_methods": ("lags-default",),
        "methods": {"shakespeare-gpt": ["dense", "lags-default"]},
    },
    # The Adam frontier's anchors through the suite's processes: the one-process study's numbers
    # checked (docs/convergence-adam.md).
    "transformer-adam-methods": {
        "seeds": [42],
        "gpt_epochs": 6,
        **GPT,
        "delta_methods": (),
        "methods": {"shakespeare-gpt": ["dense", *ADAM_METHODS]},
    },
    # What clipping the merged gradient costs a sparse method, and the clip with feedback
    # (max_grad_norm) that gives it back (Shakespeare, 300 steps).
    "clip": {
        "seeds": [42],
        "fm_epochs": 0,
        "lm_epochs": 3,
        "lm_steps": 100,
        "delta_methods": ("lags", "lags-noclip"),
        "baselines": {"lags-noclip": "dense-noclip"},
        "methods": {
            "fashion-mnist": [],
            "shakespeare": [
                *("dense", "topk", "lags", "dense-noclip"),
                *("lags-noclip", "lags-clipfb", "lags-dgc", "lags-dgc-clipfb"),
            ],
        },
    },
}
"""Each suite's seeds, budget, workers and methods per task; ``baseline`` (default dense) or
``baselines`` per method is what the report compares with, ``delta_methods`` whose delta it plots,
``notes`` the lines that end its report (runs kept from before, under a former implementation)."""


def suite_settings(suite: str) -> dict:
    """A copy of the suite's ``SUITE_SETTINGS`` (the caller may change it)."""
    return copy.deepcopy(SUITE_SETTINGS[suite])


def method_seeds(settings: dict, method: str) -> list[int]:
    """The seeds a suite runs ``method`` with: the suite's, and any more it names for it."""
    return settings["seeds"] + settings.get("more_seeds", {}).get(method, [])


def suite_tasks(settings: dict) -> list[str]:
    """The tasks a suite runs (its report's columns and figures' panels)."""
    return [task for task in TASKS if task_methods(settings, task)]


def task_methods(settings: dict, task: str) -> list[str]:
    """The methods a suite runs on ``task`` (none where it names none)."""
    return settings["methods"].get(task, [])


def method_args(task: str, method: str, settings: dict) -> list[str]:
    warmup = {
        "fashion-mnist": FM_STEPS_PER_EPOCH,
        "shakespeare": settings.get("lm_epochs", 0) * settings.get("lm_steps", 0) // 10,
    }.get(task, 0)  # (the GPT's runs use the default recipe's warm-up only)
    options = {
        "lags-warmup": ["--density-warmup", str(warmup)],
        "lags-mc": ["--momentum-correction"],
        "lags-dense1d": ["--dense-params", "1d"],
        "lags-localclip": ["--local-clip"],
    }
    # the combination: warm-up, 1-D parameters dense, and momentum correction where there is
    # momentum; on the LSTM, DGC's local clip in place of the merged one where the suite says so
    dgc = [*options["lags-warmup"], *options["lags-dense1d"], *(options["lags-mc"] if task == "fashion-mnist" else [])]
    if task == "shakespeare" and settings.get("dgc_clip") == "local":  # DGC's clip in place of the merged one
        dgc.append("--local-clip-only")
    # the library's recipe at the paper's density, every suite alike (under Adam correction the
    # library's own default density is 0.01: docs/convergence-adam.md)
    default = ["--method", "lags", "--density", "0.001", "--monitor-every", "50"]
    lags = default + ["--recipe", "paper"]
    auto = ["--buckets", "auto"]
    return {
        "dense": ["--method", "dense"],
        "topk": ["--method", "topk", "--density", "0.001"],
        "lags-default": default,
        "lags-default-ef": default + ["--no-adam-correction"],  # the recipe with plain error feedback
        "lags-default-consensus": default + ["--no-local-residual"],  # Adam correction, every rank the consensus
        "lags": lags,
        "lags-dgc": lags + dgc,
        "lags-dgc-clip": lags + dgc + options["lags-localclip"],
        "lags-dgc-io": lags + dgc + ["--layer-densities", LM_IO_DENSITIES],
        "lags-auto": lags + auto,
        "lags-dgc-auto": lags + dgc + auto,
        "lags-adaptive": ["--method", "lags", "--density", "adaptive", "--recipe", "paper"],
        "lags-rs": lags + ["--aggregation", "reduce_scatter"],
        "lags-rs2": lags + ["--aggregation", "reduce_scatter", "--owner-keep", "2"],
        "lags-dgc-rs": lags + dgc + ["--aggregation", "reduce_scatter"],
        "lags-dgc-rs2": lags + dgc + ["--aggregation", "reduce_scatter", "--owner-keep", "2"],
        "lags-dgc-rsr": lags + dgc + ["--aggregation", "reduce_scatter", "--regional-selection"],
        "lags-dgc-rs2r": lags + dgc + ["--aggregation", "reduce_scatter", "--owner-keep", "2", "--regional-selection"],
        "lags-clipfb": lags + ["--clip-feedback"],
        "lags-dgc-clipfb": lags + dgc + ["--clip-feedback"],
        "dense-noclip": ["--method", "dense", "--clip", "0"],
        # DDP (torchrun), its hooks warmed up over the same first epoch as the LAGS warm-up
        "ddp": ["--backend", "torch", "--method", "ddp"],
        "ddp-powersgd4": ["--backend", "torch", "--method", "ddp-powersgd4", "--powersgd-start", str(warmup)],
        # the GPT's: the recipe's own warm-up, as lags-default (AdamW through optimizer=)
        "ddp-lags": ["--backend", "torch", "--method", "ddp-lags", "--density", "0.001"]
        + (["--density-warmup", str(warmup)] if warmup else []),
        "lags-noclip": lags + ["--clip", "0"],
        **{name: lags + flags for name, flags in options.items()},
        **{name: ["--method", "adam-method", "--adam-method", spec] for name, spec in ADAM_METHODS.items()},
    }[method]


def task_args(task: str, settings: dict) -> list[str]:
    if task == "shakespeare-gpt":  # a small GPT, AdamW with a linear warm-up and a cosine decay to 0
        return [
            *("--dataset", "shakespeare", "--model", "char_gpt", "--hidden", "128", "--seq-len", "128"),
            *("--epochs", str(settings["gpt_epochs"]), "--steps-per-epoch", str(settings["gpt_steps"])),
            *("--batch-size", "16", "--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.01"),
            *("--schedule", "cosine", "--warmup-epochs", "0.5"),
        ]
    if task == "fashion-mnist":
        return [
            "--dataset",
            "fashion-mnist",
            "--model",
            "cnn",
            "--epochs",
            str(settings["fm_epochs"]),
            "--batch-size",
            "32",
            "--lr",
            "0.05",
            "--warmup-epochs",
            "1",
        ]
    return [
        "--dataset",
        "shakespeare",
        "--model",
        "char_lstm",
        "--epochs",
        str(settings["lm_epochs"]),
        "--steps-per-epoch",
        str(settings["lm_steps"]),
        "--batch-size",
        "16",
        "--seq-len",
        "64",
        "--hidden",
        str(settings.get("lm_hidden", 256)),
        "--lr",
        "1.0",
        "--momentum",
        "0.0",
        "--weight-decay",
        "0",
        "--warmup-epochs",
        "0.2",
        "--clip",
        "0.25",
    ]


def training_args(task: str, method: str, seed: int, settings: dict) -> list[str]:
    """The arguments of ``lags_hvd.experiments.train`` for one run (they identify it)."""
    return [*task_args(task, settings), *method_args(task, method, settings), "--seed", str(seed)]


def world(settings: dict) -> int:
    """The number of workers a suite trains with (4 unless it says otherwise)."""
    return settings.get("world", 4)


def launcher(method: str, workers: int) -> list[str]:
    """The command that starts ``workers`` training processes: torchrun for the DDP methods,
    horovodrun (Gloo) for the rest; the same worker count through either."""
    if method.startswith("ddp"):
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(workers)]
    horovodrun = str(Path(sys.executable).with_name("horovodrun"))
    return [horovodrun, "-np", str(workers), "-H", f"localhost:{workers}", "--gloo", sys.executable]


def run_files(results: Path, task: str, method: str, seed: int) -> tuple[Path, Path]:
    """(metrics CSV, delta log) of one run in a suite's results."""
    return tuple(results / f"{task}.{method}.seed{seed}.{ext}" for ext in ("csv", "json"))


def same_run_elsewhere(task: str, method: str, seed: int, settings: dict, suite: str) -> Path | None:
    """The results folder of another suite that holds this very run (same arguments, same
    number of workers)."""
    wanted = training_args(task, method, seed, settings)
    for other in SUITES:
        elsewhere = suite_settings(other)
        if (
            other != suite
            and method in task_methods(elsewhere, task)
            and seed in method_seeds(elsewhere, method)
            and training_args(task, method, seed, elsewhere) == wanted
            and world(elsewhere) == world(settings)
            and run_files(results_dir(other), task, method, seed)[0].exists()
        ):
            return results_dir(other)
    return None


def results_dir(suite: str) -> Path:
    return ROOT / "docs" / "results" / "convergence" / suite


def copy_same_run(task: str, method: str, seed: int, settings: dict, suite: str) -> bool:
    """Whether the suite's results hold this run, copying it from another suite that made
    the very same run if need be."""
    results = results_dir(suite)
    csv_path, log_path = run_files(results, task, method, seed)
    if csv_path.exists():
        return True
    source = same_run_elsewhere(task, method, seed, settings, suite)
    if source is None:
        return False
    results.mkdir(parents=True, exist_ok=True)
    source_csv, source_log = run_files(source, task, method, seed)
    if source_log.exists():
        shutil.copy(source_log, log_path)
    shutil.copy(source_csv, csv_path)
    print(f"  {task:>13} {method:>13} seed {seed}: the same run from {source.name}", flush=True)
    return True


def run(task: str, method: str, seed: int, settings: dict, suite: str, runs: Path) -> None:
    """Train one (task, method, seed) unless the suite's results hold it (``copy_same_run``)."""
    if copy_same_run(task, method, seed, settings, suite):
        return
    csv_path, log_path = run_files(results_dir(suite), task, method, seed)
    out = runs / task / method / f"seed{seed}"
    shutil.rmtree(out, ignore_errors=True)
    command = [
        *launcher(method, world(settings)),
        "-m",
        "lags_hvd.experiments.train",
        *training_args(task, method, seed, settings),
        "--out",
        str(out),
    ]
    started = time.time()
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")  # torch.distributed's Gloo on loopback, as Horovod's
    proc = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{task}/{method}/seed{seed} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    csv_path.parent.mkdir(parents=True, exist_ok=True)
    if (out / "assumption.json").exists():
        shutil.copy(out / "assumption.json", log_path)
    shutil.copy(out / "metrics.csv", csv_path)  # last: marks the run complete
    print(f"  {task:>13} {method:>13} seed {seed}: {time.time() - started:.0f} s", flush=True)


def load(results: Path) -> dict:
    """{task: {method: {seed: [rows]}}} from the CSVs present."""
    found: dict = {}
    for path in sorted(results.glob("*.csv")):
        task, method, seed = path.stem.split(".")
        with open(path) as f:
            rows = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
        found.setdefault(task, {}).setdefault(method, {})[int(seed.removeprefix("seed"))] = rows
    return found


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def curves(per_seed: dict, metric: str) -> tuple[list, list, list]:
    """x (step), mean, std over the seeds that reached each evaluation."""
    length = min(len(rows) for rows in per_seed.values())
    xs = [next(iter(per_seed.values()))[i]["step"] for i in range(length)]
    stats = [mean_std([rows[i][metric] for rows in per_seed.values()]) for i in range(length)]
    return xs, [m for m, _ in stats], [s for _, s in stats]


def plot(data: dict, path: Path, tasks=TASKS) -> None:
    """Mean curves with a band of one standard deviation over the seeds."""
    fig, axes = pyplot().subplots(1, len(tasks), figsize=(6 * len(tasks), 4.2), squeeze=False)
    methods = sorted({method for task in tasks for method in data.get(task, {})})
    colour = {method: f"C{i % 10}" for i, method in enumerate(methods)}  # one colour per method in every panel
    for ax, task in zip(axes[0], tasks):
        for method, per_seed in sorted(data.get(task, {}).items()):
            xs, mean, std = curves(per_seed, METRIC[task])
            scale = 100 if task == "fashion-mnist" else 1
            ax.plot(
                xs,
                [scale * m for m in mean],
                marker="o",
                ms=3,
                color=colour[method],
                label=f"{method} (n={len(per_seed)})",
            )
            ax.fill_between(
                xs,
                [scale * (m - s) for m, s in zip(mean, std)],
                [scale * (m + s) for m, s in zip(mean, std)],
                color=colour[method],
                alpha=0.2,
            )
        ax.set(
            xlabel="step",
            title=task,
            ylabel="test accuracy (%)" if task == "fashion-mnist" else "validation perplexity",
        )
        if task != "fashion-mnist":
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
        if data.get(task):
            ax.legend(fontsize=7)
    save_figure(fig, path)


def plot_delta(results: Path, path: Path, methods=("lags", "lags-dgc"), tasks=TASKS) -> None:
    """delta_l per layer over training against the assumption's bound 1 (first seed's log)."""
    fig, axes = pyplot().subplots(
        len(tasks), len(methods), figsize=(6 * len(methods), 3.5 * len(tasks)), sharey="row", squeeze=False
    )
    for row, task in enumerate(tasks):
        for col, method in enumerate(methods):
            ax = axes[row][col]
            log_path = next(iter(sorted(results.glob(f"{task}.{method}.seed*.json"))), None)
            if log_path is not None:
                log = json.loads(log_path.read_text())
                for unit in sorted({u for entry in log for u in entry["delta"]}):
                    points = [
                        (e["iteration"], e["delta"][unit])
                        for e in log
                        if unit in e["delta"] and not math.isnan(e["delta"][unit])
                    ]
                    if points:
                        ax.plot(*zip(*points), lw=0.9, alpha=0.8, label=unit)
                ax.legend(fontsize=6, ncol=2)
            ax.axhline(1.0, color="red", lw=0.8, ls="--", zorder=0)  # behind: a delta just under 1 stays visible
            ax.set(
                title=f"{task}, {method}" + ("" if log_path else " (not run yet)"), xlabel="iteration", ylabel="delta_l"
            )
            ax.grid(alpha=0.3)
    save_figure(fig, path)


def baseline_of(method: str, settings: dict) -> str:
    """The method another is compared with: the suite's baseline unless it names one for it."""
    return settings.get("baselines", {}).get(method, settings.get("baseline", "dense"))


def final_cell(task: str, mean: float, std: float, n: int) -> str:
    """A method's final metric over its n seeds, as the report prints it."""
    return f"{100 * mean:.2f}% ± {100 * std:.2f} ({n})" if task == "fashion-mnist" else f"{mean:.3f} ± {std:.3f} ({n})"


def gpt_methods_note(suite: str, settings: dict) -> str:
    """What the Shakespeare GPT's methods are: the Adam methods' specs in their suite, the
    library's recipe and its variants in the others."""
    if suite == "transformer-adam-methods":
        specs = [f"{n} `{ADAM_METHODS[n]}`" for n in task_methods(settings, "shakespeare-gpt") if n in ADAM_METHODS]
        return (
            "The adam-* methods train with a method of `lags_hvd/experiments/adam_methods.py` in place of "
            f"AdamW (`--method adam-method`): {', '.join(specs)}; the ranks' models are averaged before the "
            "last evaluation (docs/convergence-adam.md sets each beside the one-process study)."
        )
    return (
        "lags-default is the library's recipe, which picks Adam correction for AdamW with each worker's "
        "residual in its own parameters (`lags_hvd/updates/local_adam_correction.py`; the ranks' models are "
        "averaged before the last evaluation, each earlier one is every rank's own model on its share of the "
        "text); lags-default-consensus keeps the consensus on every rank (`local_residual=False`, "
        "`lags_hvd/updates/adam_correction.py`); lags-default-ef is the same recipe with plain error "
        "feedback (`adam_correction=False`), the recipe's update before Adam correction."
    )


def report_title(suite: str) -> str:
    """What the suite compares, for the report's heading."""
    if suite.startswith("aggregation"):
        return "reduce_scatter beside allgather"
    if suite == "clip":
        return "the gradient clip and sparse updates"
    if suite.startswith("ddp"):
        return "DistributedDataParallel's communication hooks: dense, PowerSGD and LAGS"
    if suite == "transformer-adam-methods":
        return "the methods built for Adam, in processes"
    return "LAGS-SGD against dense S-SGD and TopK-SGD"


def suite_note(suite: str, settings: dict) -> list[str]:
    """The paragraph that says what the aggregation and clip suites' methods are (else nothing)."""
    if suite.startswith("aggregation"):
        note = (
            'lags-rs is LAGS with aggregation="reduce_scatter" (lags-rs2: the owners keeping 2k, '
            "owner_keep=2), beside the allgather at the same density, budget and seeds (docs/scaling.md)."
        )
        if "lags-dgc-rs" in settings["methods"]["fashion-mnist"]:
            note += (
                " lags-dgc-rs is lags-dgc (the fidelity options) with reduce_scatter, against lags-dgc"
                " (lags-dgc-rs2: the same with owner_keep=2; lags-dgc-rsr and lags-dgc-rs2r: lags-dgc-rs"
                " and lags-dgc-rs2 with regional_selection)."
            )
        return [note, ""]
    if suite == "clip":
        return [
            "The same Shakespeare runs with the clip of the merged gradient at 0.25 (dense, topk, lags, "
            "lags-dgc), without it (-noclip), and with the optimizer's clip that gives what it removes "
            "back to the residuals (-clipfb, max_grad_norm); grad_norm in the CSVs is the merged "
            "gradient's mean norm before clipping, clipped_fraction how often the clip bit "
            "(docs/convergence.md).",
            "",
        ]
    return []


def report_intro(suite: str, settings: dict, results: Path) -> list[str]:
    """The heading, the suite's note, how it was run and its curves."""
    more_seeds = "".join(f", and {seeds} for {method}" for method, seeds in settings.get("more_seeds", {}).items())
    return [
        f"# Convergence ({suite} suite): {report_title(suite)}",
        "",
        *suite_note(suite, settings),
        f"`make {'convergence' if suite == 'full' else 'convergence-' + suite}` (`scripts/convergence.py "
        f"--suite {suite}`): P = {world(settings)} workers on one machine (one thread each); each seed "
        f"sets the initial weights and the data order, the same for every method. Seeds planned: "
        f"{settings['seeds']}{more_seeds}; n below is how many finished. Raw per-run CSVs: "
        f"`{results.relative_to(ROOT)}/`.",
        "",
        f"![curves](img/convergence-{suite}.png)",
        "",
    ]


def gap_cell(task: str, mine: dict, theirs: dict, other: str, baseline: str) -> str:
    """A method's mean gap to ``other`` over the seeds both finished (``mine``, ``theirs``:
    seed -> final metric): points of accuracy, or percent of perplexity."""
    paired = sorted(mine.keys() & theirs.keys())
    against = "" if other == baseline else f" vs {other}"
    if not paired:
        return f"no {other} run on the same seeds"
    if task == "fashion-mnist":
        gap = statistics.fmean(100 * (mine[i] - theirs[i]) for i in paired)
        return f"{gap:+.2f} pp ({len(paired)}){against}"
    gap = statistics.fmean(100 * (mine[i] / theirs[i] - 1) for i in paired)
    return f"{gap:+.2f}% ({len(paired)}){against}"


def results_table(data: dict, settings: dict) -> list[str]:
    """One row per method: each task's final metric over the seeds and its gap to the baseline."""
    baseline, tasks = settings.get("baseline", "dense"), suite_tasks(settings)
    lines = [
        "| method | " + " | ".join(f"{HEADING[task]} (n) | vs {baseline}, same seeds" for task in tasks) + " |",
        "|---|" + "---:|---:|" * len(tasks),
    ]
    finals = {
        task: {
            method: {seed: rows[-1][METRIC[task]] for seed, rows in per_seed.items()}
            for method, per_seed in data.get(task, {}).items()
        }
        for task in TASKS
    }
    for method in dict.fromkeys(m for task in tasks for m in task_methods(settings, task)):
        cells = []
        for task in tasks:
            if method not in finals[task]:
                cells += ["not run yet" if method in task_methods(settings, task) else "n/a", ""]
                continue
            other = baseline_of(method, settings)
            mine = finals[task][method]
            (m, s), n = mean_std(list(mine.values())), len(mine)
            cells += [final_cell(task, m, s, n), gap_cell(task, mine, finals[task].get(other, {}), other, baseline)]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def assumption_section(suite: str, settings: dict, results: Path) -> list[str]:
    """The delta figure (where the suite measures delta) and each delta log's summary."""
    lines = []
    if settings.get("delta_methods", True):  # the DDP suites measure no delta
        lines += [
            "",
            "## The convergence assumption",
            "",
            "LAGS runs measured delta_l = ||xbar - shat||^2 / ((1 - k/d) ||xbar||^2) for every layer every 50 "
            "iterations (`monitor_every`; `lags_hvd/assumption.py`), shown per layer against the bound 1 "
            "(first seed; a layer sent dense has delta 0 and is not plotted):",
            "",
            f"![delta](img/convergence-{suite}-delta.png)",
            "",
        ]
    for log_path in sorted(results.glob("*.json")):
        log = json.loads(log_path.read_text())
        values = [d for e in log for d in e["delta"].values() if not math.isnan(d)]
        above = sum(d > 1 for d in values)
        lines.append(
            f"* {log_path.stem}: {above} of {len(values)} measurements above 1, largest "
            f"{max(values, default=math.nan):.3f}."
        )
    return lines


def task_setups(suite: str, settings: dict) -> list[str]:
    """One line per task of the suite: its model, budget and optimizer (lags-dgc's options
    where the task runs lags-dgc)."""
    lstm_dgc_clip = (
        "and DGC's local clip (each worker's gradient before selection, local_clip=0.25) in place "
        "of the clip after synchronize()."
        if settings.get("dgc_clip") == "local"
        else "clipped after synchronize() like the others (local clipping left out: the quick suite "
        "measured it harmful, with the budget then P times too tight; see docs/convergence.md)."
    )
    lstm_io = (
        " lags-dgc-io: lags-dgc with the embedding and the decoder weight (the input and output "
        "layers, 10,240 entries each) at density 0.01 (`layer_densities`)."
        if "lags-dgc-io" in task_methods(settings, "shakespeare")
        else ""
    )
    setups = {
        "fashion-mnist": f"* Fashion-MNIST: small CNN (two conv blocks, two linear layers), "
        f"{settings.get('fm_epochs')} epochs, batch 32 per worker, lr 0.05 with 1 epoch of linear warm-up, "
        "momentum 0.9, weight decay 1e-4. "
        f"lags-dgc: density warm-up over {FM_STEPS_PER_EPOCH} steps (one epoch) from 0.25, momentum "
        "correction, 1-D parameters dense.",
        "shakespeare": f"* Shakespeare: 2-layer LSTM, {settings.get('lm_hidden', 256)} hidden, characters, "
        f"sequence 64, batch 16 per worker, {settings.get('lm_epochs')} x {settings.get('lm_steps')} steps, "
        "plain SGD lr 1.0, gradient clipping 0.25 "
        f"after synchronize(){CLIP_SUITE_RUNS if suite == 'clip' else ''}, validation on "
        "every 8th of the works. lags-dgc: density warm-up over the first "
        f"10% of the steps, 1-D parameters dense (no momentum to correct), {lstm_dgc_clip}{lstm_io}",
        "shakespeare-gpt": "* Shakespeare GPT: a GPT-style decoder (2 pre-norm blocks, width 128, 4 heads, "
        "context 128; `models.CharGPT`), characters, batch 16 x 128 per worker on "
        f"{world(settings)} workers, {settings.get('gpt_epochs')} x {settings.get('gpt_steps')} "
        "steps, AdamW (betas 0.9, 0.999, weight decay 0.01) at lr 0.003, linear warm-up over half an epoch "
        f"({settings.get('gpt_steps', 0) // 2} steps), "
        "cosine decay to 0, no clip; validation on every 8th of the works. " + gpt_methods_note(suite, settings),
    }
    return [
        setups[task] if "lags-dgc" in task_methods(settings, task) else setups[task].split(" lags-dgc:")[0]
        for task in suite_tasks(settings)
    ]


def method_setups(suite: str, settings: dict) -> list[str]:
    """What the suite's methods are, where the names do not say it."""
    lines = []
    if suite.startswith("ddp"):
        lines.append(
            "* Under torchrun (torch.distributed, Gloo), DistributedDataParallel with its allreduce "
            "(ddp), PyTorch's PowerSGD hook at rank 4 (ddp-powersgd4: error feedback, warm start, plain "
            f"allreduce for the first {FM_STEPS_PER_EPOCH} steps, one epoch; a bucket at a time on Gloo) or "
            "lags_hvd.ddp's hook given the optimizer (ddp-lags: the optimizer doors' LAGS under the "
            "default recipe, density 0.001, the density warm-up over the same epoch from 0.25, 1-D "
            "parameters whole, DGC's momentum correction of the optimizer's momentum and weight decay)."
        )
    elif suite != "transformer-adam-methods":
        lines.append(
            "* Density 0.001 for TopK-SGD and LAGS. lags and every lags-* but lags-default start from the "
            'paper\'s Algorithm 1 (`recipe="paper"`) and exchange per layer (`buckets="layer"`) except in '
            'the -auto runs: `buckets="auto"`, per layer for 10 iterations, then the buckets rank 0 plans '
            "from the measured costs (they depend on the machine's timing, so a rerun may plan other "
            "buckets; the delta logs name them)."
        )
    if any("lags-default" in task_methods(settings, task) for task in suite_tasks(settings)):
        lines.append(
            '* lags-default: `lags_hvd.DistributedOptimizer(density=0.001)` as it comes (`recipe="dgc"`: '
            "planned buckets, density warm-up over the first 200 iterations from 0.25, 1-D parameters "
            "dense, momentum correction where the optimizer is SGD with momentum, Adam correction where "
            "it is Adam or AdamW), and `--clip` given to it as "
            "DGC's local clip (`local_clip`), the recipe's way to clip."
        )
    if "ddp-lags" in task_methods(settings, "shakespeare-gpt"):
        lines.append(
            "* ddp-lags (the GPT): the DDP door, `lags_hvd.ddp`'s hook given the AdamW optimizer (the same "
            "default recipe: Adam correction with the local residual, `average_models()` before the last "
            'evaluation), under torchrun with as many workers as the others. With `buckets="layer"` the '
            "two doors train bit for bit the same model (`tests/test_ddp.py`); under the planned buckets "
            "the plan comes from measured times (DDP reports every gradient at the end of backward), "
            "so the doors' runs of one seed may differ by their plans."
        )
    return lines


def write_report(data: dict, suite: str, settings: dict, results: Path, path: Path) -> None:
    """docs/convergence-<suite>.md from the suite's results: what was run, the final metrics
    against the baseline on the same seeds, the convergence assumption's logs and the setup."""
    lines = [
        *report_intro(suite, settings, results),
        *results_table(data, settings),
        *assumption_section(suite, settings, results),
        "",
        "## Setup",
        "",
        *task_setups(suite, settings),
        *method_setups(suite, settings),
        "* CPU runs: absolute numbers are below the state of the art; the comparison between methods "
        "at the same budget and seeds is the point.",
        *(["", *settings["notes"]] if "notes" in settings else []),
    ]
    path.write_text("\n".join(lines) + "\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", choices=SUITES, default="quick")
    parser.add_argument("--runs", type=Path, default=ROOT / "runs" / "convergence")
    parser.add_argument("--report-only", action="store_true", help="rebuild report and figure from the CSVs")
    args = parser.parse_args()
    settings = suite_settings(args.suite)
    results = results_dir(args.suite)
    report = ROOT / "docs" / f"convergence-{args.suite}.md"

    def refresh():
        data = load(results)
        tasks = suite_tasks(settings)
        plot(data, ROOT / "docs" / "img" / f"convergence-{args.suite}.png", tasks)
        delta_methods = settings.get("delta_methods", ("lags", "lags-dgc"))
        if delta_methods:  # (the DDP suites log no delta: the hook does not measure it)
            plot_delta(results, ROOT / "docs" / "img" / f"convergence-{args.suite}-delta.png", delta_methods, tasks)
        write_report(data, args.suite, settings, results, report)

    planned = [
        (seed, task, method)
        for task in TASKS
        for method in task_methods(settings, task)
        for seed in method_seeds(settings, method)
    ]
    for seed, task, method in sorted(planned, key=lambda run: run[0]):  # seed by seed, as before
        if args.report_only:
            copy_same_run(task, method, seed, settings, args.suite)
        else:
            run(task, method, seed, settings, args.suite, args.runs / args.suite)
            refresh()  # after every run: an interrupted suite leaves a current report
    refresh()
    print(report.read_text())


if __name__ == "__main__":
    main()
