"""One side-by-side benchmark run: every method on one model, in the same P processes.

    horovodrun -np 2 -H localhost:2 --gloo python scripts/bench_worker.py \
        --model vgg16 --methods dense,topk,lags,lags-serial --out result.json

Methods:
  dense           Horovod's own hvd.DistributedOptimizer (S-SGD with pipelining)
  topk            lags_hvd.TopKDistributedOptimizer (global top-k after backprop)
  lags            lags_hvd.DistributedOptimizer(recipe="paper") at a fixed density: the
                  paper's LAGS, one exchange per layer (the lags-* below change one thing)
  lags-merged     lags with buckets=methods.MERGE_NUMEL: small tensors (biases, norms)
                  merged into units of at least that many elements
  lags-serial     the same optimizer with ``overlap = False``: the same per-layer
                  exchanges, all started after backprop (no pipelining); gives t_c for S_max
  lags-adaptive   lags_hvd.DistributedOptimizer(density="adaptive", min_density=density),
                  measured once its loop has settled
  lags-auto       lags with buckets="auto", measured once its buckets are planned
  lags-default    lags_hvd.DistributedOptimizer as it comes (recipe="dgc": planned buckets,
                  1-D parameters dense, momentum correction), measured once planned and
                  with the density warm-up skipped: its steady state
  lags-default-ef lags-default with plain error feedback: what momentum or Adam correction costs
  lags-default-consensus  lags-default with local_residual=False (Adam correction's consensus)
  local           the same model and plain SGD with no communication at all: the floor

With ``--emulate-tflops`` the model computes nothing: its layers wait for their time on an
accelerator of that rate (``emulation``), so the CPU is free for the exchanges as beside a GPU.
  lags-mc, lags-dense1d, lags-clip, lags-clipfb, lags-dgc
                  lags with one fidelity option (momentum_correction, dense_params="1d",
                  local_clip=1.0, max_grad_norm=1.0) or the first three: their cost per
                  iteration once the density warm-up, which only changes k early on, is over
  ddp, ddp-powersgd1, ddp-powersgd4, ddp-lags  (with @torch)
                  DistributedDataParallel with its allreduce, PyTorch's PowerSGD hook (rank 1
                  or 4, from the second iteration; one bucket at a time on Gloo, see
                  methods.one_bucket_at_a_time) or lags_hvd.ddp's hook (density warm-up over):
                  the model wrapped, the communication inside backward
  <method>@torch  the method over torch.distributed (Gloo) instead of Horovod, in the same
                  processes (``backend.TorchBackend``; its dense: the optimizer at density 1
                  over DDP's 25 MiB buckets), initialised beside Horovod on the same link

Each method trains its own copy of the model (lags and lags-serial share one). The
methods take turns in rounds, the order rotating every round, each turn one
settling iteration and ``--iterations`` measured ones, so slow drifts of this
machine hit every method alike; speed-ups are medians of per-round ratios.

Per measured iteration: forward, backward (hook work included), selection, waiting
for the network in synchronize(), merge, and the optimizer update. Rank 0 writes,
per method, the medians, the bytes each worker contributes per iteration and the
throughput, plus the per-layer profile the simulator uses (scripts/simulate.py):
when each gradient became ready in the dense run, and each layer's selection time.
"""

import argparse
import json
import statistics
import time

import torch

import lags_hvd as hvd
from lags_hvd.density import k_for_density
from lags_hvd.experiments import emulation, models
from lags_hvd.experiments.backend import HorovodBackend, TorchBackend
from lags_hvd.experiments.methods import DDP_METHODS, DEFAULT_METHODS, build_ddp, build_optimizer

DDP_SETTLE = 4
"""Iterations a DDP method runs before it is measured: DDP rebuilds its buckets after the
first (the second with a static graph), PowerSGD compresses from the second (``build_ddp``)."""
BACKENDS = {"": HorovodBackend(), "torch": TorchBackend()}
"""By a method's ``@`` suffix: Horovod for none, torch.distributed for ``@torch``."""


def bytes_per_worker(optimizer, model) -> int:
    """Bytes one worker contributes to the collectives per iteration."""
    if not hasattr(optimizer, "lags_state"):
        return sum(p.numel() * p.element_size() for p in model.parameters())
    return optimizer.lags_state.bytes_per_worker()


def hook_bytes_per_worker(kind: str, model, density: float) -> int:
    """The same for a DDP hook: PowerSGD's factors P and Q of every matrix it compresses
    ((rows + columns) * rank values; the rest whole, by its ``min_compression_rate`` of 2),
    or the LAGS hook's k (index, value) pairs per parameter (1-D ones whole)."""
    total = 0
    for p in model.parameters():
        size = p.element_size()
        if kind.startswith("ddp-powersgd"):
            rank, rows = int(kind.removeprefix("ddp-powersgd")), p.shape[0] if p.dim() > 1 else 0
            columns = p.numel() // rows if rows else 0
            compressed = p.dim() > 1 and (rows + columns) * rank * 2 < rows * columns
            total += (rows + columns) * rank * size if compressed else p.numel() * size
        elif kind.startswith("ddp-lags"):
            total += p.numel() * size if p.dim() == 1 else k_for_density(density, p.numel()) * (size + 4)
        else:
            total += p.numel() * size
    return total


class Contender:
    """One method: its model copy, optimizer and measurements."""

    def __init__(
        self,
        method,
        model_name,
        batch_size,
        density,
        network_profile,
        shared=None,
        emulate=None,
        optimizer="sgd",
        buckets=None,
    ):
        self.method = method  # its label; ``kind``: the method without its backend suffix
        self.kind, _, backend = method.partition("@")
        if shared is not None:  # lags-serial: the lags optimizer with overlap off
            self.model, self.batch, self.loss_fn, self.optimizer, self.trained = (
                shared.model,
                shared.batch,
                shared.loss_fn,
                shared.optimizer,
                shared.trained,
            )
        else:
            self.model, self.batch, self.loss_fn = (
                models.build(model_name, batch_size, seed=hvd.rank())
                if emulate is None  # else an accelerator of that many TFLOP/s, emulated
                else emulation.emulate(model_name, batch_size, emulate, seed=hvd.rank())
            )
            torch.manual_seed(0)
            hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
            self.trained = self.model  # the module backprop runs through (DDP's wrapper for ddp*)
            base = (
                torch.optim.AdamW(self.model.parameters(), lr=1e-3)
                if optimizer == "adamw"
                else torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
            )
            if self.kind in DDP_METHODS:  # the LAGS hook wraps ``base`` in place
                self.trained, _ = build_ddp(
                    self.kind, self.model, base, density=density, powersgd_start=2, density_warmup=0
                )
            self.optimizer = build_optimizer(
                "local" if self.kind in DDP_METHODS else self.kind,
                base,
                self.model.named_parameters(),
                density=density,
                backend=BACKENDS[backend],
                network_profile=network_profile,
                **({"buckets": buckets} if buckets is not None and self.kind.startswith("lags") else {}),
            )
        self.lags = hasattr(self.optimizer, "lags_state")
        self.rows, self.round_medians = [], []
        self.ready: dict[str, list[float]] = {}  # dense only: gradient ready times per parameter
        self._backward_start = 0.0
        if method == "dense":  # Horovod's: the simulator's per-layer profile
            for name, p in self.model.named_parameters():
                p.register_post_accumulate_grad_hook(
                    lambda p, name=name: self.ready.setdefault(name, []).append(
                        time.perf_counter() - self._backward_start
                    )
                )

    def iteration(self) -> dict:
        if self.lags:
            self.optimizer.overlap = self.kind != "lags-serial"
        hvd.barrier()
        t0, cpu0 = time.perf_counter(), time.process_time()
        self.optimizer.zero_grad()
        loss = self.loss_fn(self.trained, self.batch)
        t1 = self._backward_start = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if self.kind == "local" or self.kind in DDP_METHODS:  # no exchange at all, or DDP's in backward
            t3 = time.perf_counter()
            self.optimizer.step()
        else:
            self.optimizer.synchronize()
            t3 = time.perf_counter()
            with self.optimizer.skip_synchronize():
                self.optimizer.step()
        t4, cpu = time.perf_counter(), time.process_time() - cpu0
        timing = (
            self.optimizer.backward_timer.last_synchronize
            if self.lags
            else {"wait": t3 - t2, "merge": 0.0, "zero": 0.0, "select": 0.0}
        )
        merge = timing["merge"] + timing["zero"]  # the merge targets' zeroing counts as merging
        return {
            "iteration": t4 - t0,
            "forward": t1 - t0,
            "backward": t2 - t1,
            "select": timing["select"],
            "wait": timing["wait"],
            "merge": merge,
            "update": t4 - t3,
            "merge_update": merge + (t4 - t3),
            "synchronize": t3 - t2,
            "host_cpu": cpu,  # this process's CPU seconds, its threads (Horovod's, Gloo's) included
        }

    def block(self, iterations: int) -> None:
        self.iteration()  # settle after the other methods' turn
        for ready in self.ready.values():
            ready.clear()
        rows = [self.iteration() for _ in range(iterations)]
        self.rows += rows
        self.round_medians.append(statistics.median(r["iteration"] for r in rows))

    def settle(self, limit: int = 60) -> None:
        """Iterate until the adaptive loop and the bucket plan have settled."""
        for _ in range(limit):
            if self.optimizer.adaptive_settled and self.optimizer.buckets_settled:
                return
            self.iteration()

    def bytes_per_worker(self, density: float) -> int:
        if self.kind == "local":
            return 0
        if self.kind in DDP_METHODS:
            return hook_bytes_per_worker(self.kind, self.model, density)
        return bytes_per_worker(self.optimizer, self.model)

    def result(self, density: float) -> dict:
        summary = {key: statistics.median(r[key] for r in self.rows) for key in self.rows[0]}
        out = {
            "method": self.method,
            "median_s": summary,
            "round_medians_s": self.round_medians,
            "bytes_per_worker": self.bytes_per_worker(density),
            "throughput": hvd.size() * int(self.batch[0].shape[0]) / summary["iteration"],
            "density": density,
        }
        if self.lags:
            out["average_density"] = self.optimizer.lags_state.average_density()
            traffic = self.optimizer.traffic.values()  # sparse buckets, as the aggregation moves them
            out["sparse_traffic"] = {
                "sent": sum(t["sent"] for t in traffic),
                "received": sum(t["received"] for t in traffic),
            }
            out["adaptive_history"] = self.optimizer.adaptive_history
            out["bucket_history"] = self.optimizer.bucket_history
            out["buckets"] = len(self.optimizer.lags_state.units)
            if self.optimizer.plan is not None:
                out["plan"] = [[p.name, p.numel, p.ready, p.k, p.dense, p.start, p.end] for p in self.optimizer.plan]
        return out


def layer_profile(dense: Contender, lags: Contender | None) -> list[dict]:
    """Per parameter, in backward order: size, median ready time since backward started
    (dense run: no selection inside), and the lags run's median selection time."""
    select = {}
    if lags is not None and lags.optimizer.backward_timer.iterations:
        units = lags.optimizer.lags_state.units
        select = {p.name: p.select for p in lags.optimizer.backward_timer.profile(units)}
    numel = dict((n, p.numel()) for n, p in dense.model.named_parameters())
    layers = [
        {"name": n, "numel": numel[n], "ready_s": statistics.median(times), "select_s": select.get(n, 0.0)}
        for n, times in dense.ready.items()
        if times
    ]
    return sorted(layers, key=lambda layer: layer["ready_s"])


def init_torch_distributed() -> None:
    """torch.distributed beside Horovod in these processes: the same ranks, Gloo over
    loopback (the shaped link inside the benchmark's namespace), rank 0's free port."""
    import os
    import socket

    import torch.distributed as dist

    port = None
    if hvd.rank() == 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    port = hvd.broadcast_object(port, root_rank=0, name="bench.torch_port")
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=hvd.rank(), world_size=hvd.size())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted(models.MODELS))
    parser.add_argument("--methods", default="dense,topk,lags,lags-serial")
    parser.add_argument("--density", type=float, default=0.001)
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=3, help="measured iterations per turn")
    parser.add_argument("--network-profile", default=None)
    parser.add_argument(
        "--emulate-tflops",
        type=float,
        default=None,
        help="the model's computation as timed waits on an accelerator of this many TFLOP/s "
        "(lags_hvd.experiments.emulation); default: computed on this CPU",
    )
    parser.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd", help="the optimizer every method wraps")
    parser.add_argument(
        "--buckets",
        type=int,
        default=None,
        help="every LAGS method on buckets of at least this many entries (default: each its own; "
        "the default methods plan theirs): the same buckets, to compare update rules",
    )
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    hvd.init()
    torch.set_num_threads(1)
    methods = args.methods.split(",")
    if any(method.endswith("@torch") for method in methods):
        init_torch_distributed()
    contenders = {}
    for method in methods:
        shared = contenders.get("lags") if method == "lags-serial" else None
        if method == "lags-serial" and shared is None:
            shared = contenders["lags"] = Contender(
                "lags", args.model, args.batch_size, args.density, None, None, args.emulate_tflops, args.optimizer
            )
        contenders[method] = Contender(
            method,
            args.model,
            args.batch_size,
            args.density,
            args.network_profile,
            shared,
            args.emulate_tflops,
            args.optimizer,
            args.buckets,
        )
    for contender in contenders.values():
        if contender.kind in ("lags-adaptive", "lags-auto", *DEFAULT_METHODS):
            contender.settle()
        elif contender.kind in DDP_METHODS:  # past DDP's bucket rebuild and PowerSGD's start
            for _ in range(DDP_SETTLE):
                contender.iteration()
    for r in range(args.rounds):
        for method in methods[r % len(methods) :] + methods[: r % len(methods)]:
            contenders[method].block(args.iterations)

    first = contenders[methods[0]]
    result = {
        "model": args.model,
        "workers": hvd.size(),
        "batch_size": int(first.batch[0].shape[0]),
        "emulate_tflops": args.emulate_tflops,
        "fixed_buckets": args.buckets,
        "density": args.density,
        "rounds": args.rounds,
        "iterations": args.iterations,
        "params": sum(p.numel() for p in first.model.parameters()),
        "methods": {m: contenders[m].result(args.density) for m in methods},
    }
    if "dense" in contenders:
        dense = contenders["dense"].rows
        result["profile"] = {
            "forward_s": statistics.median(r["forward"] for r in dense),
            "backward_s": statistics.median(r["backward"] for r in dense),
            "update_s": statistics.median(r["update"] for r in dense),
            "layers": layer_profile(contenders["dense"], contenders.get("lags")),
        }
    if hvd.rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    hvd.shutdown()


if __name__ == "__main__":
    main()
