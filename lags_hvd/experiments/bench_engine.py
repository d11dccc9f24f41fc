"""Engine cost in one process: the fixed cost per bucket and the passes over gradient memory.

    python scripts/bench_engine.py [--out docs/results/engine_cpu.json]
    python scripts/bench_engine.py --options [--out docs/results/options_cost_engine.json]
    python scripts/bench_engine.py --replayed

One worker (P = 1, so the network costs nothing and only the engine's own work
shows), one thread, measured interleaved with the same model trained by the plain
wrapped optimizer (no hooks, no exchange) so that a noisy machine's drift falls on
both alike. Reported from ``backward_timer.last_synchronize`` (time inside the
hooks plus the zeroing and the merge in ``synchronize()``, not counting the wait
for Horovod):

* fixed cost per bucket: the engine's time per unit on a model of many tiny units
  (Linear(8, 8) layers: 2 units of 64 and 8 entries each), where per-element work
  is negligible, and the part of it spent in the hook, on backprop's thread
  (``hook_per_bucket_us``: what ``scripts/simulate.py`` charges each bucket);
  beside it its floor, the bare operations one tiny bucket needs
  (``bare_bucket_seconds``: add, top-1, pack, Horovod's allgather and wait) timed
  with no engine around them, and the same without Horovod;
* the replayed hook (``replayed_hook_us``; ``--replayed`` alone): the host's part of a hook
  whose device work is one CUDA graph replay (``cuda_graphs=True``), a replay that does
  nothing standing in for the graph, beside a hook that only launches Horovod's allgather
  (the floor) and an empty one, per bucket: the bookkeeping a GPU's host pays;
* passes per element: the engine's time on one large unit (4M entries, density
  0.001) divided by the time of one copy pass over a tensor of its size, timed in
  the same round (the median of the rounds' ratios); the method needs about three
  (accumulate, selection, the zeroed merge target).

* peak memory: resident memory added by five LAGS iterations of a 10.5M-parameter
  model (42 MB of gradient), each measured in a fresh process, with
  ``zero_grad(set_to_none=True)`` (autograd allocates new gradients every
  iteration) and ``set_to_none=False`` (autograd adds into the gradient buffer).
* ``--options`` instead: the fidelity options' cost, ResNet-20 iterations with each
  option of ``methods.FIDELITY`` over plain LAGS's, taking turns in rotating order;
  the median over rounds of the per-round ratio (at P = 1 only the engine's own
  work differs).

The exit code does not depend on the numbers (timings are noisy; tests check
correctness).
"""

import argparse
import copy
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import horovod.torch as hvd
import numpy as np
import torch
from horovod.torch import mpi_ops
from torch import nn

import lags_hvd
from lags_hvd import capture
from lags_hvd.experiments.methods import FIDELITY
from lags_hvd.experiments.models import registry

FIXED_COST_TARGET_US = 60.0
PASSES_TARGET = 3.0
MODULE = "lags_hvd.experiments.bench_engine"  # run again in a fresh process per memory mode


def engine_seconds(model: nn.Module, batch: torch.Tensor, rounds: int) -> dict[str, float]:
    """Medians over rounds, interleaved: the engine's seconds per iteration (``engine``),
    of which in the hooks (``hook``), the LAGS and the plain iteration (``lags``,
    ``plain``) and their ratio (``lags_over_plain``: the median of each round's), the
    engine's time in copy passes over one gradient-sized tensor
    (``passes``: the median of each round's ratio, the copy timed in the same round),
    and so its parts: the hooks, the zeroing and the merge (``*_passes``)."""
    plain_model = copy.deepcopy(model)  # its own parameters: no LAGS hooks on them
    plain = torch.optim.SGD(plain_model.parameters(), lr=1e-3)
    lags = lags_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-3),
        named_parameters=model.named_parameters(),
        density=0.001,
        recipe="paper",
    )
    numel = sum(p.numel() for p in model.parameters())
    source, target = torch.randn(numel), torch.empty(numel)
    measured = {
        "engine": [],
        "hook": [],
        "lags": [],
        "plain": [],
        "lags_over_plain": [],
        "passes": [],
        "hook_passes": [],
        "zero_passes": [],
        "merge_passes": [],
    }
    for r in range(rounds + 2):
        times = {}
        for optimizer, net, name in ((lags, model, "lags"), (plain, plain_model, "plain")):
            start = time.perf_counter()
            optimizer.zero_grad()
            net(batch).square().mean().backward()
            optimizer.step()
            times[name] = time.perf_counter() - start
        start = time.perf_counter()
        target.copy_(source)
        copy_pass = time.perf_counter() - start
        if r >= 2:  # warm-up rounds: allocations, Horovod's response cache
            spent = lags.backward_timer.last_synchronize
            engine = spent["select"] + spent["merge"] + spent["zero"]
            for name, value in (
                ("engine", engine),
                ("hook", spent["select"]),
                ("lags", times["lags"]),
                ("plain", times["plain"]),
                ("lags_over_plain", times["lags"] / times["plain"]),
                ("passes", engine / copy_pass),
                ("hook_passes", spent["select"] / copy_pass),
                ("zero_passes", spent["zero"] / copy_pass),
                ("merge_passes", spent["merge"] / copy_pass),
            ):
                measured[name].append(value)
    return {name: statistics.median(values) for name, values in measured.items()}


def bare_bucket_seconds(units: int, numel: int, rounds: int, exchange: bool = True) -> float:
    """Median seconds per bucket of the bare work one tiny bucket needs, with no engine
    around it: ``acc = eps + g`` into a staging range, the top-1 by magnitude (numpy keys
    and argmax, as ``select_sampled`` takes it), its index and value written into a send
    buffer, and (``exchange``) Horovod's ``allgather_async`` of it, then every wait and
    one concatenation of the results. The floor under the fixed cost per bucket: what
    remains when the bookkeeping is gone (with ``exchange=False``: without Horovod)."""
    residual, staging = torch.zeros(units * numel), torch.zeros(units * numel)
    grads = [torch.randn(numel) for _ in range(units)]
    messages = [torch.zeros(16, dtype=torch.uint8) for _ in range(units)]
    index_out = [m[:4].view(torch.int32) for m in messages]
    value_out = [m[8:12].view(torch.float32) for m in messages]
    times = []
    for r in range(rounds + 5):
        start = time.perf_counter()
        handles = []
        for u in range(units):
            acc = staging[u * numel : (u + 1) * numel]
            torch.add(grads[u], residual[u * numel : (u + 1) * numel], out=acc)
            keys = acc.numpy().view(np.int32)
            top = (keys & np.int32(0x7FFFFFFF)).argmax(keepdims=True)
            index_out[u].copy_(torch.from_numpy(top))
            value_out[u].copy_(torch.from_numpy(keys[top].view(np.float32)))
            if exchange:
                handles.append(hvd.allgather_async(messages[u], name=f"bench.bare.{u}"))
        torch.cat([hvd.synchronize(handle) for handle in handles] if exchange else messages)
        if r >= 5:
            times.append(time.perf_counter() - start)
    return statistics.median(times) / units


def replayed_hook_seconds(layers: int, rounds: int) -> dict[str, float]:
    """The host's part of a hook whose device work is replayed from a CUDA graph
    (``cuda_graphs=True``), measured here by standing a replay that does nothing in for the
    graph: the bookkeeping a GPU's host pays per bucket beside the replay's launch. Medians of
    each round's seconds per bucket over a plain backward of the same model (``layers``
    Linear(16, 16), one bucket per parameter, the paper's recipe, P = 1), for

    * ``replayed``: LAGS, every hook one free replay and Horovod's allgather;
    * ``launch_only``: the floor, a hook that launches Horovod's allgather of its bucket's
      message into a receive buffer of its own (as LAGS's does) and does nothing else;
    * ``empty``: a hook that does nothing (what torch charges for calling one);
    * ``over_launch_only``: the median of each round's ``replayed`` over ``launch_only``;

    and the ``buckets``, of which ``whole_hook_replayed`` replayed their whole hook's device work."""

    def free_graph(run, inputs, device):  # a graph that was never captured: ``run`` once
        outputs = run(*inputs)
        return (lambda *_: outputs), outputs

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])
    batch = torch.randn(8, 16)
    copies = {name: copy.deepcopy(model) for name in ("plain", "launch_only", "empty")}
    handles = []

    def launch(message: torch.Tensor, name: str):
        inbox = torch.empty_like(message)  # P = 1
        return lambda p: handles.append(mpi_ops._allgather_async(message, inbox, name, hvd.global_process_set))

    for i, p in enumerate(copies["launch_only"].parameters()):
        p.register_post_accumulate_grad_hook(launch(torch.zeros(24, dtype=torch.uint8), f"bench.launch.{i}"))
    for p in copies["empty"].parameters():
        p.register_post_accumulate_grad_hook(lambda p: None)
    saved = capture.capturable, capture.cuda_graph
    capture.capturable, capture.cuda_graph = (lambda device: True), free_graph
    try:
        lags = lags_hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9),
            named_parameters=model.named_parameters(),
            density=0.001,
            recipe="paper",
            cuda_graphs=True,
        )
        nets = {"replayed": model, **copies}

        def backward_seconds(name: str) -> float:
            net = nets[name]
            net.zero_grad(set_to_none=False)
            loss = net(batch).square().mean()
            start = time.perf_counter()
            loss.backward()
            spent = time.perf_counter() - start
            if net is model:
                lags.step()
            for handle in handles:  # the launch-only hooks'
                hvd.synchronize(handle)
            handles.clear()
            return spent

        buckets = 2 * layers
        measured = {name: [] for name in ("replayed", "launch_only", "empty", "over_launch_only")}
        for r in range(rounds + 5):
            plain = backward_seconds("plain")
            spent = {name: (backward_seconds(name) - plain) / buckets for name in ("replayed", "launch_only", "empty")}
            if r >= 5:  # warm-up: the graphs' first runs, Horovod's response cache
                for name, value in spent.items():
                    measured[name].append(value)
                measured["over_launch_only"].append(spent["replayed"] / spent["launch_only"])
        medians = {name: statistics.median(values) for name, values in measured.items()}
        return {
            **medians,
            "buckets": buckets,
            "whole_hook_replayed": list(lags.cuda_graphs.values()).count("accumulate and select"),
        }
    finally:
        capture.capturable, capture.cuda_graph = saved


def option_cost_ratios(rounds: int) -> dict[str, dict[str, float]]:
    """Per option variant: median iteration (ms) and the median per-round ratio to plain lags."""
    variants = {"lags": {}, **FIDELITY}
    runs = {}
    for name, options in variants.items():
        model, batch, loss_fn = registry.build("resnet20")
        base = torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)
        optimizer = lags_hvd.DistributedOptimizer(
            base, named_parameters=model.named_parameters(), density=0.001, recipe="paper", **options
        )
        runs[name] = (model, batch, loss_fn, optimizer)
    times = {name: [] for name in variants}
    order = list(variants)
    for r in range(rounds + 2):
        for name in order[r % len(order) :] + order[: r % len(order)]:
            model, batch, loss_fn, optimizer = runs[name]
            start = time.perf_counter()
            optimizer.zero_grad()
            loss_fn(model, batch).backward()
            optimizer.step()
            if r >= 2:  # warm-up rounds
                times[name].append(time.perf_counter() - start)
    return {
        name: {
            "iteration_ms": 1e3 * statistics.median(spent),
            "vs_lags": statistics.median(a / b for a, b in zip(spent, times["lags"])),
        }
        for name, spent in times.items()
    }


def memory_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2048, 2048), nn.Linear(2048, 2048), nn.Linear(2048, 1024))


def peak_rss_mib(set_to_none: bool) -> float:
    """Peak resident memory added by wrapping and training (this process: call it in a fresh one)."""
    model = memory_model()
    batch = torch.randn(8, 2048)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    optimizer = lags_hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=1e-3),
        named_parameters=model.named_parameters(),
        density=0.001,
        recipe="paper",
    )
    for _ in range(5):
        optimizer.zero_grad(set_to_none=set_to_none)
        model(batch).square().mean().backward()
        optimizer.step()
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--memory", choices=["none", "in-place"], help=argparse.SUPPRESS)  # the child process
    parser.add_argument("--options", action="store_true", help="measure the fidelity options' cost instead")
    parser.add_argument("--replayed", action="store_true", help="measure the replayed hook's host time alone")
    args = parser.parse_args()
    torch.set_num_threads(1)
    hvd.init()
    if args.memory:
        print(peak_rss_mib(args.memory == "none"))
        return
    if args.replayed:
        print_replayed(replayed_hook_us(args.rounds))
        return
    if args.options:
        costs = option_cost_ratios(args.rounds)
        for name, cost in costs.items():
            print(
                f"ResNet-20 {name:<13}: {cost['iteration_ms']:7.1f} ms per iteration, {cost['vs_lags']:.3f}x plain lags"
            )
        write(
            {
                "model": "resnet20",
                "workers": 1,
                "threads": 1,
                "density": 0.001,
                "rounds": args.rounds,
                "options": {name: FIDELITY.get(name, {}) for name in costs},
                "costs": costs,
            },
            args.out,
        )
        return
    torch.manual_seed(0)
    tiny = nn.Sequential(*[nn.Linear(8, 8) for _ in range(64)])
    small = engine_seconds(tiny, torch.randn(4, 8), args.rounds)
    units = 2 * len(tiny)
    fixed_us, hook_us = 1e6 * small["engine"] / units, 1e6 * small["hook"] / units
    floor_us = {
        "with_horovod": 1e6 * bare_bucket_seconds(units, 64, args.rounds),
        "without_horovod": 1e6 * bare_bucket_seconds(units, 64, args.rounds, exchange=False),
    }
    replayed = replayed_hook_us(args.rounds)
    large = nn.Sequential(nn.Linear(2048, 2048, bias=False))
    big = engine_seconds(large, torch.randn(4, 2048), args.rounds)
    passes = big["passes"]
    gradient_mib = sum(p.numel() for p in memory_model().parameters()) * 4 / 2**20
    memory = {
        mode: float(
            subprocess.run(
                [sys.executable, "-m", MODULE, "--memory", mode], check=True, capture_output=True, text=True
            ).stdout.split()[-1]
        )
        for mode in ("none", "in-place")
    }
    results = {
        "fixed_cost_per_bucket_us": fixed_us,
        "hook_per_bucket_us": hook_us,
        "units": units,
        "bare_bucket_us": floor_us,
        "replayed_hook_us": replayed,
        "peak_rss_mib": {"set_to_none": memory["none"], "in_place": memory["in-place"], "gradient_mib": gradient_mib},
        "tiny_model": {
            "lags_ms": 1e3 * small["lags"],
            "plain_ms": 1e3 * small["plain"],
            "lags_over_plain": small["lags_over_plain"],
        },
        "passes_per_element": passes,
        "passes_by_phase": {phase: big[f"{phase}_passes"] for phase in ("hook", "zero", "merge")},
        "large_unit": {
            "numel": 2048 * 2048,
            "engine_ms": 1e3 * big["engine"],
            "lags_ms": 1e3 * big["lags"],
            "plain_ms": 1e3 * big["plain"],
            "lags_over_plain": big["lags_over_plain"],
        },
        "threads": 1,
        "cpu_count": os.cpu_count(),
    }
    print(
        f"fixed cost per bucket : {fixed_us:7.1f} us  (target <= {FIXED_COST_TARGET_US:g}; "
        f"{units} units; iteration {1e3 * small['lags']:.2f} ms vs {1e3 * small['plain']:.2f} ms without exchange)"
    )
    print(f"  of which in the hook: {hook_us:7.1f} us  (on backprop's thread: accumulate, select, pack, queue)")
    print(
        f"bare bucket (floor)   : {floor_us['with_horovod']:7.1f} us  (add, top-1, pack, allgather and wait, no "
        f"engine; {floor_us['without_horovod']:.1f} us without Horovod)"
    )
    print_replayed(replayed)
    print(
        f"passes per element    : {passes:7.2f}     (target <= {PASSES_TARGET:g}; one 4M-entry unit, "
        f"engine {1e3 * big['engine']:.1f} ms; iteration {big['lags_over_plain']:.2f}x without exchange)"
    )
    print(f"  hooks / zero / merge: {big['hook_passes']:.2f} / {big['zero_passes']:.2f} / {big['merge_passes']:.2f}")
    print(
        f"peak memory added    : {memory['none']:7.0f} MiB with zero_grad(set_to_none=True), "
        f"{memory['in-place']:.0f} MiB with set_to_none=False (gradient: {gradient_mib:.0f} MiB)"
    )
    write(results, args.out)


def replayed_hook_us(rounds: int, layers: int = 64) -> dict[str, float]:
    """``replayed_hook_seconds``, its times in microseconds per bucket."""
    measured = replayed_hook_seconds(layers, rounds)
    return {
        name: 1e6 * value if name in ("replayed", "launch_only", "empty") else value for name, value in measured.items()
    }


def print_replayed(replayed: dict) -> None:
    print(
        f"replayed hook         : {replayed['replayed']:7.1f} us  (the host's part per bucket with cuda_graphs, "
        f"{replayed['over_launch_only']:.2f}x a hook that only launches Horovod's allgather, "
        f"{replayed['launch_only']:.1f} us; an empty hook {replayed['empty']:.1f} us)"
    )


def write(results: dict, out: Path | None) -> None:
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
