"""One benchmark run: a model and a method on P workers (started by scripts/benchmark.py).

    horovodrun -np 2 -H localhost:2 --gloo python scripts/bench_worker.py \
        --model vgg16 --method lags --density 0.001 --out result.json

Methods:
  dense           Horovod's own hvd.DistributedOptimizer (S-SGD with pipelining)
  topk            lags_hvd.TopKDistributedOptimizer (global top-k after backprop)
  lags            lags_hvd.DistributedOptimizer at a fixed density
  lags-adaptive   lags_hvd.DistributedOptimizer(density="adaptive", min_density=density)
  lags-serial     LAGS with its hooks removed: the same per-layer exchanges, all
                  started after backprop (no pipelining); gives t_c for S_max

Per measured iteration: forward, backward (hook work included), selection, waiting
for the network in synchronize(), merge, and the optimizer update. lags-adaptive is
measured once its loop has settled (a plan verified, or min density kept). Rank 0 writes the
medians, the bytes each worker contributes per iteration and the throughput.
"""
import argparse
import json
import statistics
import time

import horovod.torch as horovod
import torch

import lags_hvd as hvd
from lags_hvd import models, sparse
from lags_hvd.selection import k_for_density


def build_optimizer(method, model, density, network_profile, warmup, min_unit_numel=0):
    base = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    named = model.named_parameters()
    if method == "dense":
        return horovod.DistributedOptimizer(base, named_parameters=named)
    if method == "topk":
        return hvd.TopKDistributedOptimizer(base, named_parameters=named, density=density)
    if method == "lags-adaptive":
        return hvd.DistributedOptimizer(base, named_parameters=named, density="adaptive",
                                        min_density=density, warmup_iterations=4,
                                        replan_every=10_000, network_profile=network_profile)
    optimizer = hvd.DistributedOptimizer(base, named_parameters=named, density=density,
                                         min_unit_numel=min_unit_numel)
    if method == "lags-serial":
        for handle in optimizer._hook_handles:
            handle.remove()  # synchronize() now starts every exchange, after backprop
    elif method != "lags":
        raise SystemExit(f"unknown method {method}")
    return optimizer


def fixed_vs_plan(optimizer, run_iteration, density: float, iterations: int, rounds: int = 4) -> dict:
    """Side by side in the same processes: blocks at min density (the fixed-density
    configuration) alternate with blocks under the kept plan; median of per-round ratios."""
    state = optimizer.lags_state
    plan_k = dict(state.k)
    floor = {u.name: k_for_density(density, u.numel) for u in state.units}
    ratios, fixed_all, plan_all = [], [], []
    for _ in range(rounds):
        medians = []
        for k in (floor, plan_k):
            state.set_k(k)
            run_iteration()  # settle
            medians.append(statistics.median(run_iteration()["iteration"] for _ in range(iterations)))
        fixed_all.append(medians[0])
        plan_all.append(medians[1])
        ratios.append(medians[1] / medians[0])
    state.set_k(plan_k)
    return {"fixed_s": statistics.median(fixed_all), "plan_s": statistics.median(plan_all),
            "plan_over_fixed": statistics.median(ratios), "rounds": rounds,
            "plan_density": sum(plan_k.values()) / sum(u.numel for u in state.units),
            "fixed_density": sum(floor.values()) / sum(u.numel for u in state.units)}


def bytes_per_worker(optimizer, model) -> int:
    """Bytes one worker contributes to the collectives per iteration."""
    if not hasattr(optimizer, "lags_state"):
        return sum(p.numel() * p.element_size() for p in model.parameters())
    state = optimizer.lags_state
    total = 0
    for unit in state.units:
        k = state.k[unit.name]
        if k == unit.numel:
            total += unit.numel * unit.dtype.itemsize
        else:
            index = sparse.index_dtype_for(unit.numel).itemsize
            total += sparse.message_bytes(k, unit.dtype.itemsize, index)
    return total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted(models.MODELS))
    parser.add_argument("--method", required=True)
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=5)
    parser.add_argument("--network-profile", default=None)
    parser.add_argument("--min-unit-numel", type=int, default=0,
                        help="lags: merge consecutive small tensors into units of at least this size")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    model, batch, loss_fn = models.build(args.model, args.batch_size, seed=hvd.rank())
    torch.manual_seed(0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    optimizer = build_optimizer(args.method, model, args.density, args.network_profile, args.warmup,
                                args.min_unit_numel)
    lags = hasattr(optimizer, "lags_state")

    def run_iteration() -> dict:
        hvd.barrier()
        t0 = time.perf_counter()
        optimizer.zero_grad()
        loss = loss_fn(model, batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        optimizer.synchronize()
        t3 = time.perf_counter()
        with optimizer.skip_synchronize():
            optimizer.step()
        t4 = time.perf_counter()
        timing = optimizer.backward_timer.last_synchronize if lags else {"wait": t3 - t2, "merge": 0.0,
                                                                          "select": 0.0}
        return {"iteration": t4 - t0, "forward": t1 - t0, "backward": t2 - t1,
                "select": timing["select"], "wait": timing["wait"],
                "merge_update": timing["merge"] + (t4 - t3), "synchronize": t3 - t2}

    rows, iteration, measured_from = [], 0, args.warmup
    while iteration < measured_from + args.iterations:
        row = run_iteration()
        iteration += 1
        if lags and not optimizer.adaptive_settled and iteration < 60:
            measured_from = iteration + 1  # measure the adaptive loop only once it has settled
        if iteration > measured_from:
            rows.append(row)

    summary = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    ab = fixed_vs_plan(optimizer, run_iteration, args.density, args.iterations) if args.method == "lags-adaptive" else None
    result = {"model": args.model, "method": args.method, "workers": hvd.size(),
              "min_unit_numel": args.min_unit_numel,
              "batch_size": int(batch[0].shape[0]), "density": args.density,
              "iterations": args.iterations, "median_s": summary,
              "bytes_per_worker": bytes_per_worker(optimizer, model),
              "params": sum(p.numel() for p in model.parameters()),
              "throughput": hvd.size() * int(batch[0].shape[0]) / summary["iteration"]}
    if ab:
        result["side_by_side"] = ab
    if lags:
        result["adaptive_history"] = optimizer.adaptive_history
        state = optimizer.lags_state
        result["average_density"] = sum(state.k.values()) / sum(u.numel for u in state.units)
        if optimizer.plan is not None:
            result["plan"] = [[p.name, p.numel, p.ready, p.k, p.dense, p.start, p.end] for p in optimizer.plan]
    gathered = hvd.allgather_object(summary["iteration"])
    result["iteration_s_per_rank"] = gathered
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
