"""The Adam frontier: validation perplexity against traffic, LAGS beside the methods built for Adam.

    python -m lags_hvd.experiments.adam_frontier [--steps 1200] [--seeds 42 43 44]
        [--methods SPEC ...] [--jobs 2] [--report-only]

Each (method, seed) of ``FRONTIER`` runs ``adam_study`` in its own process, ``--jobs`` at a
time, unless its JSON is already in ``docs/results/adam/frontier/<steps>/`` (move a file
aside to rerun it). Then the block between ``<!-- frontier <steps> -->`` and
``<!-- end frontier <steps> -->`` in docs/convergence-adam.md is rewritten from every JSON
there: a table (mean and standard deviation over the seeds present, against dense at the
same seeds) and the figure ``docs/img/adam-frontier-<steps>.png``.

The block between ``<!-- processes -->`` and ``<!-- end processes -->`` sets the 1,200-step
study beside the same methods trained by the suite's processes (``make
convergence-transformer-adam-methods``, seed 42, ``docs/results/convergence/
transformer-adam-methods/``).

A point is dominated when another reaches lower perplexity at no more traffic, by more than
the larger of the two standard deviations (a difference within one standard deviation counts
as level); the rest form the frontier.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..figures import pyplot, save_figure

__all__ = ["FRONTIER", "EPOCH", "Point", "points", "dominated", "main"]

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "docs" / "results" / "adam" / "frontier"
SUITE = ROOT / "docs" / "results" / "convergence" / "transformer-adam-methods"  # the anchors in processes
DOC = ROOT / "docs" / "convergence-adam.md"

FRONTIER = {  # spec: where its settings come from
    "dense": "AdamW on the mean gradient: the reference",
    "lags": "the first recipe: density 0.001 after DGC's 200-step warm-up from 0.25",
    "lags:density=0.004": "the first recipe at density 0.004",
    "lags:density=0.01": "the first recipe at density 0.01",
    "lags:density_warmup_start=0.05": "density 0.001, the warm-up from 0.05 (the recipe in between)",
    "lags:density=0.004,density_warmup_start=0.05": "density 0.004, the warm-up from 0.05",
    "lags:density=0.01,density_warmup_start=0.05": "**the default recipe now**: density 0.01, the warm-up from 0.05",
    "lags:density=0.004,density_warmup=0": "density 0.004, no warm-up",
    "lags:density_warmup=0": "density 0.001, no warm-up",
    "lags:density=0.01,density_warmup=0": "density 0.01, no warm-up",
    "zero-one:variance_scaler=4": "0/1 Adam's variance schedule (interval doubling after 4 updates; 16 in the paper)",
    "zero-one:variance_scaler=4,freeze=300,local_scaler=50": "0/1 Adam with the variance frozen at step 300, "
    "then local steps (interval doubling every 50 steps, at most 16)",
    "demo:topk=32": "DeMo's defaults: 64 x 64 DCT blocks, 32 coefficients each, decay 0.999",
    "demo:topk=8": "DeMo with 8 coefficients per block",
    "diloco:every=20": "DiLoCo's outer Nesterov (0.7, 0.9), 20 local steps",
    "diloco:every=50": "DiLoCo, 50 local steps",
    "sparseloco:every=20,topk=64": "SparseLoCo: 20 local steps, 64 of 4,096 per block (1.6%), EF decay 0.95",
    "sparseloco:every=10,topk=128": "SparseLoCo: 10 local steps, 128 per block (3.1%)",
    "powersgd:rank=1": "torch's PowerSGD hook at rank 1 (allreduce for the first 10 steps)",
    "powersgd:rank=4": "PowerSGD at rank 4",
}
DEFAULT = "lags:density=0.01,density_warmup_start=0.05"  # the library's default recipe with AdamW
EPOCH = {1200: 200, 4800: 1200}  # steps per epoch at each budget (as the suites)


def result_path(steps: int, spec: str, seed: int) -> Path:
    slug = spec.replace(":", "_").replace(",", "_").replace("=", "")
    return RESULTS / str(steps) / f"{slug}.seed{seed}.json"


def run_one(steps: int, spec: str, seed: int) -> None:
    path = result_path(steps, spec, seed)
    command = [sys.executable, "-m", "lags_hvd.experiments.adam_study", "--methods", spec, "--seeds", str(seed)]
    command += ["--steps", str(steps), "--steps-per-epoch", str(EPOCH[steps]), "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command + ["--out", str(path)], env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"{spec} seed {seed} FAILED (exit {done.returncode}):\n{done.stderr[-2000:]}", flush=True)
    else:
        print(done.stdout.strip(), flush=True)


class Point:
    """One method at one budget, over the seeds run."""

    def __init__(self, spec: str, runs: list[dict]):
        self.spec, self.seeds = spec, [r["settings"]["seed"] for r in runs]
        self.perplexities = [r["perplexity"] for r in runs]
        self.traffic = statistics.mean(r["words_vs_dense"] for r in runs)
        self.mean = statistics.mean(self.perplexities)
        self.std = statistics.stdev(self.perplexities) if len(runs) > 1 else 0.0


def points(steps: int, results: Path = RESULTS) -> dict[str, Point]:
    found: dict[str, list[dict]] = {}
    for path in sorted((results / str(steps)).glob("*.json")):
        for run in json.loads(path.read_text()):
            found.setdefault(run["settings"]["method"], []).append(run)
    return {spec: Point(spec, runs) for spec, runs in found.items()}


def dominated(point: Point, others: list[Point]) -> Point | None:
    """The first of ``others`` that reaches lower perplexity at no more traffic, beyond noise."""
    for other in others:
        if other is not point and other.traffic <= point.traffic:
            if point.mean - other.mean > max(point.std, other.std):
                return other
    return None


def report(steps: int, results: Path = RESULTS, doc: Path = DOC, suite: Path = SUITE) -> None:
    found = points(steps, results)
    if not found:
        return
    dense = found.get("dense")
    rows = sorted(found.values(), key=lambda p: p.traffic)
    lines = [
        f"Validation perplexity after {steps:,} steps ({EPOCH[steps]} per epoch), P = 2, mean ± std over the "
        "seeds listed; traffic: one worker's 4-byte words over the run against dense's.",
        "",
        "| method | settings | seeds | traffic | perplexity | vs dense | frontier |",
        "|---|---|---|---:|---:|---:|---|",
    ]
    for p in rows:
        versus = ""
        if dense and p is not dense:
            shared = set(dense.seeds) & set(p.seeds)  # vs dense at the same seeds
            if shared:
                mine = statistics.mean(x for s, x in zip(p.seeds, p.perplexities) if s in shared)
                theirs = statistics.mean(x for s, x in zip(dense.seeds, dense.perplexities) if s in shared)
                versus = f"{100 * (mine / theirs - 1):+.1f}%"
        beaten = dominated(p, rows)
        verdict = f"no: {beaten.spec}" if beaten else "**yes**"
        seeds = ",".join(str(s) for s in sorted(p.seeds))
        std = f" ± {p.std:.3f}" if len(p.seeds) > 1 else ""
        lines.append(
            f"| `{p.spec}` | {FRONTIER.get(p.spec, '')} | {seeds} | {p.traffic:.4f} | {p.mean:.3f}{std} "
            f"| {versus} | {verdict} |"
        )
    figure = f"img/adam-frontier-{steps}.png"
    lines += ["", f"![perplexity against traffic at {steps:,} steps]({figure})"]
    plot(rows, steps, doc.parent / figure)
    replace_block(doc, f"frontier {steps}", lines)
    if steps == 1200:
        processes_report(found, suite, doc)


def replace_block(doc: Path, name: str, lines: list[str]) -> None:
    """``doc``'s text between ``<!-- name -->`` and ``<!-- end name -->`` becomes ``lines``."""
    text = doc.read_text()
    start, end = f"<!-- {name} -->", f"<!-- end {name} -->"
    if start not in text or end not in text:
        raise ValueError(f"{doc} has no {start} ... {end} block")
    before, rest = text.split(start, 1)
    doc.write_text(before + start + "\n" + "\n".join(lines) + "\n" + end + rest.split(end, 1)[1])


def processes_report(study: dict[str, Point], suite: Path = SUITE, doc: Path = DOC, seed: int = 42) -> None:
    """The suite's runs of the anchors (``--method adam-method``) beside the study's at ``seed``."""
    from .convergence import ADAM_METHODS

    lines = [
        f"Seed {seed}, 1,200 steps, P = 2: the study's one process against the suite's two "
        "(Horovod over Gloo); traffic as above, counted by rank 0.",
        "",
        "| method | study: traffic | study: perplexity | processes: traffic | processes: perplexity | difference |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, spec in {"dense": "dense", **ADAM_METHODS}.items():
        path, point = suite / f"shakespeare-gpt.{name}.seed{seed}.csv", study.get(spec)
        if not path.exists() or point is None or seed not in point.seeds:
            continue
        last = list(csv.DictReader(open(path)))[-1]
        mine = point.perplexities[point.seeds.index(seed)]
        theirs = float(last["validation_perplexity"])
        traffic = 1.0 if name == "dense" else float(last["words_vs_dense"])
        lines.append(
            f"| `{spec}` | {point.traffic:.4f} | {mine:.3f} | {traffic:.4f} | {theirs:.3f} "
            f"| {100 * (theirs / mine - 1):+.2f}% |"
        )
    replace_block(doc, "processes", lines)


def plot(rows: list[Point], steps: int, path: Path) -> None:
    """Each family's points; the frontier as a line, its points named; points far above dense
    drawn at the top edge with their value."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5.5))
    dense = next((p for p in rows if p.spec == "dense"), None)
    top = 1.35 * (dense.mean if dense else max(p.mean for p in rows))
    families: dict[str, list[Point]] = {}
    for p in rows:
        families.setdefault(p.spec.split(":")[0], []).append(p)
    for family, members in families.items():
        if family == "dense":
            ax.axhline(members[0].mean, color="black", linestyle="--", label="dense")
            continue
        shown = [p for p in members if p.mean <= top]
        ax.errorbar(
            [p.traffic for p in shown],
            [p.mean for p in shown],
            yerr=[p.std for p in shown],
            marker="o",
            linestyle="none",
            capsize=3,
            label=family,
        )
        for p in members:
            if p.mean > top:  # a triangle at the top edge, the value beside it
                ax.plot([p.traffic], [top], marker="^", color="grey", clip_on=False)
                spread = f" ± {p.std:.1f}" if len(p.seeds) > 1 else ""
                ax.annotate(
                    f"{p.spec}: {p.mean:.1f}{spread}",
                    (p.traffic, top),
                    fontsize=7,
                    xytext=(6, -12),
                    textcoords="offset points",
                )
    frontier = [p for p in rows if p.spec != "dense" and dominated(p, rows) is None]
    ax.plot([p.traffic for p in frontier], [min(p.mean, top) for p in frontier], color="grey", linewidth=1, zorder=0)
    named = [p for p in frontier if p.mean <= top] + [p for p in rows if p.spec == DEFAULT and p not in frontier]
    for i, p in enumerate(named):  # below and above the point in turn, so that neighbours do not overlap
        label = "the default" if p.spec == DEFAULT else p.spec
        label = label.replace("density_warmup_start", "start").replace("density_warmup", "warmup")
        offset = (4, -10) if i % 2 == 0 else (4, 6)
        ax.annotate(label, (p.traffic, p.mean), fontsize=7, xytext=offset, textcoords="offset points")
    ax.set_xscale("log")
    ax.set_ylim(top=top)
    ax.set_xlabel("traffic (one worker's words against dense's)")
    ax.set_ylabel("validation perplexity")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save_figure(fig, path, title=f"AdamW on the GPT at P = 2, {steps:,} steps (grey: the frontier)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1200, choices=sorted(EPOCH))
    parser.add_argument("--seeds", type=int, nargs="+", default=[42])
    parser.add_argument("--methods", nargs="+", default=list(FRONTIER))
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args(argv)
    if not args.report_only:
        todo = [
            (spec, seed)
            for seed in args.seeds
            for spec in args.methods
            if not result_path(args.steps, spec, seed).exists()
        ]
        with ThreadPoolExecutor(args.jobs) as pool:
            list(pool.map(lambda job: run_one(args.steps, *job), todo))
    report(args.steps)


if __name__ == "__main__":
    main()
