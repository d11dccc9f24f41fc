"""Selection and merge timed on one device, in one process (P = 1, torch.distributed).

    python -m lags_hvd.experiments.device_timing [--device cuda] [--rounds 20]
        [--model resnet20 vgg16 ...] [--recipe paper default] [--out FILE]
    python -m lags_hvd.experiments.device_timing --report FILE  # docs/gpu.md's table from FILE

Each model (ResNet-20 unless told; the paper's per-worker batch) trained by the plain
optimizer (SGD with momentum) and, on a second copy, by
``lags_hvd.distributed.DistributedOptimizer`` at density 0.001 under each recipe (``paper``:
one bucket per layer, the paper's update; ``default``: the recipe's buckets, planned once
``bucket_warmup`` iterations are measured, and momentum correction, without the density
warm-up so every timed round is at 0.001; ``paper-graphs`` and ``default-graphs``: the same
with each bucket's accumulate and selection replayed from a CUDA graph, ``cuda_graphs=True``:
``graphs`` counts the buckets whose graphs hold both and those that hold the selection alone,
their gradients having moved), taking turns
each round so a noisy machine's drift falls on both alike; every phase ends with a device
synchronisation. Printed and written, per model and recipe, the medians in ms:

* ``backward``: the plain backward pass, and the same under LAGS, whose hooks add each
  layer's residual and select its top-k (the difference is the selection's cost);
* ``synchronize``: zeroing the merge target, the step check and the merge of every bucket
  (at P = 1 the collectives cost almost nothing, so this is the merge);
* ``iteration``: forward, backward and step, plain and under LAGS, and their ratio.

The exit code does not depend on the numbers (timings are noisy; tests check correctness).
``--report`` rewrites the table between ``<!-- device timing -->`` and ``<!-- end device
timing -->`` in docs/gpu.md from a file this wrote (its raw output, kept in docs/results/gpu/).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lags_hvd import distributed as lags
from lags_hvd.experiments import models

__all__ = ["measure", "report", "main"]

DOC = Path(__file__).resolve().parents[2] / "docs" / "gpu.md"
MODEL_NAMES = {"resnet20": "ResNet-20", "vgg16": "VGG-16", "resnet50": "ResNet-50", "lstm_ptb": "LSTM-PTB"}


def _fence(device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


RECIPES = {"paper": dict(recipe="paper"), "default": dict(density_warmup=0, bucket_warmup=3)}
RECIPES.update({f"{name}-graphs": dict(options, cuda_graphs=True) for name, options in RECIPES.items()})
WARMUP_ROUNDS = 5  # the default recipe plans its buckets after 3 iterations


def measure(
    device: torch.device, rounds: int, model_name: str = "resnet20", batch_size: int | None = None, recipe="paper"
) -> dict:
    """The medians (ms) of backward, synchronize and iteration, plain and under LAGS."""
    (plain_model, batch, loss_fn), (lags_model, _, _) = (models.build(model_name, batch_size, seed=0) for _ in "ab")
    plain_model.to(device), lags_model.to(device)
    batch = tuple(t.to(device) for t in batch)
    plain = torch.optim.SGD(plain_model.parameters(), lr=0.01, momentum=0.9)
    sparse = lags.DistributedOptimizer(
        torch.optim.SGD(lags_model.parameters(), lr=0.01, momentum=0.9),
        lags_model.named_parameters(),
        density=0.001,
        **RECIPES[recipe],
    )
    times = {key: [] for key in ("backward", "lags_backward", "lags_synchronize", "iteration", "lags_iteration")}
    for turn in range(rounds + WARMUP_ROUNDS):
        for model, optimizer, prefix in ((plain_model, plain, ""), (lags_model, sparse, "lags_")):
            start = _fence(device)
            optimizer.zero_grad()
            loss = loss_fn(model, batch)
            begun = _fence(device)
            loss.backward()
            backward = _fence(device)
            if prefix:
                optimizer.synchronize()
                synchronized = _fence(device)
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()
            end = _fence(device)
            if turn >= WARMUP_ROUNDS:
                times[f"{prefix}backward"].append(backward - begun)
                times[f"{prefix}iteration"].append(end - start)
                if prefix:
                    times["lags_synchronize"].append(synchronized - backward)
    medians = {key: 1e3 * statistics.median(values) for key, values in times.items()}
    medians["selection_in_hooks"] = medians["lags_backward"] - medians["backward"]
    medians["lags_over_plain"] = medians["lags_iteration"] / medians["iteration"]
    graphs = collections.Counter(sparse.cuda_graphs.values())
    return {
        "model": model_name,
        "batch": len(batch[0]),
        "recipe": recipe,
        "buckets": len(sparse.lags_state.units),
        **medians,
        **({"graphs": dict(graphs)} if graphs else {}),
    }


def report(path: Path, doc: Path = DOC) -> str:
    """The table of ``path`` (a file ``main`` wrote), written into ``doc`` between its markers."""
    result = json.loads(Path(path).read_text())
    lines = [
        f"`{Path(path).name}`: {result['name']}, torch {result.get('torch', '(not recorded)')}, medians of "
        f"{result['rounds']} rounds (ms); hooks: LAGS's backward less the plain one; under a "
        "`-graphs` recipe, the buckets replayed whole and those whose selection alone is.",
        "",
        "| model (batch) | recipe | buckets | hooks (per bucket) | plain iteration | LAGS iteration | ratio |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    last = None
    for run in result["runs"]:
        model = "" if run["model"] == last else f"{MODEL_NAMES.get(run['model'], run['model'])} ({run['batch']})"
        last = run["model"]
        hooks = run["selection_in_hooks"]
        graphs = run.get("graphs", {})
        whole = f" ({graphs.get('accumulate and select', 0)} whole, {graphs.get('select', 0)} selection)"
        lines.append(
            f"| {model} | {run['recipe']}{whole if graphs else ''} | {run['buckets']} "
            f"| {hooks:.1f} ({hooks / run['buckets']:.2f}) "
            f"| {run['iteration']:.1f} | {run['lags_iteration']:.1f} | **{run['lags_over_plain']:.2f}x** |"
        )
    table = "\n".join(lines)
    text = doc.read_text()
    begin, end = "<!-- device timing -->\n", "<!-- end device timing -->"
    if begin not in text or end not in text:
        raise ValueError(f"{doc} has no {begin.strip()} ... {end} block")
    head, rest = text.split(begin, 1)
    doc.write_text(head + begin + table + "\n" + end + rest.split(end, 1)[1])
    return table


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--model", nargs="+", default=["resnet20"], choices=sorted(models.MODELS))
    parser.add_argument("--recipe", nargs="+", default=["paper"], choices=sorted(RECIPES))
    parser.add_argument("--out", type=Path)
    parser.add_argument("--report", type=Path, help="only rewrite docs/gpu.md's table from this file")
    args = parser.parse_args(argv)
    if args.report:
        print(report(args.report))
        return {}
    device = torch.device(args.device)
    if not dist.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    result = {"device": str(device), "name": _device_name(device), "torch": torch.__version__, "rounds": args.rounds}
    result["runs"] = []
    print(f"{result['name']}, medians of {args.rounds} rounds (ms)")
    for model_name in args.model:
        for recipe in args.recipe:
            run = measure(device, args.rounds, model_name, recipe=recipe)
            result["runs"].append(run)
            print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in run.items()), flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return result


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


if __name__ == "__main__":
    main()
