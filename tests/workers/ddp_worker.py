"""Runs under torchrun: DistributedDataParallel with lags_hvd.ddp's hook; writes what it saw.

Scenarios (``--scenarios``, run in order in the same workers; each writes
``<scenario>.<rank>.pt``: the parameters, the hook state's residuals and, per iteration,
DDP's buckets as the hook received them, by parameter name); the hook is given the
optimizer (SGD with momentum and weight decay) and runs one LAGS bucket per parameter:
  oracle      TinyNet (aux unused on rank 1: find_unused_parameters), tiny buckets, the paper's
              recipe (the optimizer's own momentum on the merged gradient)
  rebuild     an MLP whose buckets DDP rebuilds after the first iteration
  static      the MLP with static_graph=True and gradient_as_bucket_view=True
  dense1d     the MLP with dense_params="1d" and a density warm-up
  mc          the MLP under the default recipe: DGC's momentum correction of the optimizer's
              momentum and weight decay (1-D parameters whole), no density warm-up
  nosync      the MLP, two micro-batches per step, the first under no_sync()
  checkpoint  the MLP: N steps, state saved, M more; a fresh model, optimizer and hook state
              loaded from it run the same M steps (both runs' results saved)
  gathered    the same under mc's options, saved on rank 0 alone (gathered_state_dict), the
              file loaded by every rank
  nonfinite   the MLP, a NaN gradient on rank 1 at step NAN_STEP: the residuals before and after
  stall       the MLP with exchange_timeout=STALL_TIMEOUT; rank 1 sleeps STALL_SLEEP s before
              step STALL_STEP: each rank's error and its step, the residuals before that step
              and after the error, and the error of one more step (then exits, without the others)
  doors       the optimizer door and the DDP door trained alike (tests/workers/doors_worker.py)
  disagree    for each of DISAGREE's settings, a fresh MLP and hook state set differently on
              rank 1 than on rank 0: each rank's error per setting
"""

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # doors_worker, also when imported by a test
import doors_worker  # noqa: E402
import models  # noqa: E402

from lags_hvd.ddp import LAGSHookState, lags_hook  # noqa: E402

torch.set_num_threads(1)
DEVICE = torch.device(os.environ.get("LAGS_TEST_DEVICE", "cpu"))  # tests/launch.py's "torch-cuda": the one GPU
DENSITY = 0.1
BUCKET_MB = 400 / 2**20  # about 100 float32 entries: several buckets even for TinyNet
NAN_STEP = 2
WARMUP = dict(density_warmup=4, density_warmup_start=0.5)
STALL_TIMEOUT, STALL_SLEEP, STALL_STEP = 5, 10, 2  # after DDP's bucket rebuild (its own collectives)
DISAGREE = {  # setting -> rank 1's hook options (rank 0's: the defaults), or "names": another model's names
    "momentum": {"momentum": models.MOMENTUM},  # the optimizer's: momentum correction in force on rank 1 only
    "density": {"density": 2 * DENSITY},
    "dense_params": {"dense_params": "none"},  # the default recipe sends 1-D parameters whole
    "model": "names",
}
PAPER = {"recipe": "paper", "density": DENSITY}


def mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(12, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16), torch.nn.Linear(16, 4)
    )


def mlp_batch(rank: int, step: int):
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(6, 12, generator=gen), torch.randn(6, 4, generator=gen)


def mlp_loss(model, rank: int, step: int):
    x, y = (t.to(DEVICE) for t in mlp_batch(rank, step))
    return torch.nn.functional.mse_loss(model(x), y)


def tiny_loss(model, rank: int, step: int):
    return models.loss_of(model, rank, step)


class Recorder:
    """The hook, recording DDP's buckets (parameter names, in buffer order) per iteration."""

    def __init__(self, model):
        self.names = {p: n for n, p in model.named_parameters()}
        self.buckets: list[list[list[str]]] = [[]]

    def hook(self, state, bucket):
        self.buckets[-1].append([self.names[p] for p in bucket.parameters()])
        if bucket.is_last():
            self.buckets.append([])
        return lags_hook(state, bucket)


def build(scenario: str, seed: int = 0, group=None):
    model = (models.make_model(seed) if scenario == "oracle" else mlp(seed)).to(DEVICE)
    ddp = DDP(
        model,
        process_group=group,
        bucket_cap_mb=BUCKET_MB,
        find_unused_parameters=scenario == "oracle",
        static_graph=scenario == "static",
        gradient_as_bucket_view=scenario == "static",
    )
    options = {
        **PAPER,
        **{
            "dense1d": {**WARMUP, "dense_params": "1d"},
            "mc": {"recipe": "dgc", "buckets": "layer", "density_warmup": 0},
            "gathered": {"recipe": "dgc", "buckets": "layer", "density_warmup": 0},
            "stall": {"exchange_timeout": STALL_TIMEOUT},
        }.get(scenario, {}),
    }
    optimizer = torch.optim.SGD(
        model.parameters(), lr=models.LR, momentum=models.MOMENTUM, weight_decay=models.WEIGHT_DECAY
    )
    state = LAGSHookState(group, named_parameters=model.named_parameters(), optimizer=optimizer, **options)
    recorder = Recorder(model)
    ddp.register_comm_hook(state, recorder.hook)
    return model, ddp, state, recorder, optimizer


def train(scenario, ddp, optimizer, steps, first=0, poison=None):
    loss_of = tiny_loss if scenario == "oracle" else mlp_loss
    rank = dist.get_rank()
    for step in range(first, first + steps):
        optimizer.zero_grad()
        if poison is not None:
            poison["on"] = step == NAN_STEP and rank == 1
        if scenario == "nosync":
            with ddp.no_sync():
                loss_of(ddp, rank, 2 * step).backward()
            loss_of(ddp, rank, 2 * step + 1).backward()
        else:
            loss_of(ddp, rank, step).backward()
        optimizer.step()


def snapshot(model, state, recorder) -> dict:
    saved = state.state_dict()
    return {  # on the CPU, where the test's references are
        "params": {n: p.detach().cpu().clone() for n, p in model.named_parameters()},
        "residuals": {n: r.cpu().clone() for n, r in saved["residuals"].items()},
        "velocities": {n: v.cpu().clone() for n, v in saved.get("velocities", {}).items()},
        "buckets": [b for b in recorder.buckets if b],
        "iteration": state.iteration,
    }


def error_of(error: BaseException) -> dict:
    return {"type": type(error).__name__, "message": str(error)}


def stall(path: str, steps: int) -> None:
    """Rank 1 stalls past exchange_timeout: each rank's first error, written as soon as it comes
    (the other rank may be waiting, gone or still asleep)."""
    model, ddp, state, _, optimizer = build("stall")
    rank = dist.get_rank()
    result = {"error": None}
    for step in range(steps):
        if rank == 1 and step == STALL_STEP:
            time.sleep(STALL_SLEEP)
        before = {n: r.clone() for n, r in state.state_dict()["residuals"].items()}
        optimizer.zero_grad()
        try:
            mlp_loss(ddp, rank, step).backward()
        except Exception as error:
            result = {"error": error_of(error), "step": step}
            result.update(before=before, after=state.state_dict()["residuals"])
            try:  # the next step: refused, the optimizer having failed
                optimizer.zero_grad()
            except Exception as again:
                result["again"] = error_of(again)
            break
        optimizer.step()
    torch.save(result, path)


def disagree(path: str) -> None:
    """Per setting of DISAGREE, a fresh MLP whose hook state (or optimizer) differs on rank 1."""
    rank, errors = dist.get_rank(), {}
    for setting, options in DISAGREE.items():
        model = mlp()
        named = model.named_parameters()
        if rank == 1 and options == "names":  # the same shapes, in the same order, other names
            named = [(f"renamed.{n}", p) for n, p in model.named_parameters()]
        mine = options if rank == 1 and options != "names" else {}
        momentum = mine.pop("momentum", 0.0) if mine else 0.0
        optimizer = torch.optim.SGD(model.parameters(), lr=models.LR, momentum=momentum)
        try:
            LAGSHookState(named_parameters=named, optimizer=optimizer, **{**PAPER, "recipe": "dgc", **mine})
            errors[setting] = None
        except Exception as error:
            errors[setting] = error_of(error)
    torch.save(errors, path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--scenarios", required=True, help="comma-separated, run in order in these workers")
    args = parser.parse_args()
    scenarios = args.scenarios.split(",")
    if len(scenarios) > 1 and "stall" in scenarios:
        raise SystemExit("stall ends with the workers out of step: it runs alone")
    if DEVICE.type == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group("cpu:gloo,cuda:gloo" if DEVICE.type == "cuda" else "gloo")
    for scenario in scenarios:
        path = os.path.join(args.out, f"{scenario}.{dist.get_rank()}.pt")
        if scenario == "stall":  # no barrier: the other rank is stalled or gone
            stall(path, args.steps)
            sys.stdout.flush()
            os._exit(0)
        if scenario == "disagree":
            disagree(path)
        elif scenario == "doors":
            doors_worker.record(path)
        else:
            run_scenario(scenario, args.steps, path)
        dist.barrier()
    # no teardown: destroying the process group, or exiting normally, while DDP's reducer
    # and its Gloo futures live sometimes ends in std::terminate on this torch (2.13)
    sys.stdout.flush()
    os._exit(0)


def run_scenario(scenario: str, steps: int, path: str) -> None:
    model, ddp, state, recorder, optimizer = build(scenario)
    if scenario in ("checkpoint", "gathered"):
        half = steps // 2
        train(scenario, ddp, optimizer, half)
        if scenario == "checkpoint":  # a file per rank
            hook, file = state.state_dict(), f"{path}.saved"
        else:  # every rank's hook state in rank 0's file, which every rank loads
            hook, file = state.gathered_state_dict(root_rank=0), os.path.join(os.path.dirname(path), "gathered.saved")
        if scenario == "checkpoint" or dist.get_rank() == 0:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "hook": hook}, file)
        dist.barrier()
        saved = torch.load(file)
        train(scenario, ddp, optimizer, steps - half, first=half)
        resumed, ddp2, state2, recorder2, optimizer2 = build(scenario, seed=7)
        resumed.load_state_dict(saved["model"])
        optimizer2.load_state_dict(saved["optimizer"])
        state2.load_state_dict(saved["hook"])
        train(scenario, ddp2, optimizer2, steps - half, first=half)
        torch.save(
            {"straight": snapshot(model, state, recorder), "resumed": snapshot(resumed, state2, recorder2)}, path
        )
    elif scenario == "nonfinite":
        poison = {"on": False}
        model[2].weight.register_hook(lambda g: torch.full_like(g, float("nan")) if poison["on"] else g)
        before = []
        for step in range(steps):
            before.append({n: r.clone() for n, r in state.state_dict()["residuals"].items()})
            optimizer.zero_grad()
            poison["on"] = step == NAN_STEP and dist.get_rank() == 1
            mlp_loss(ddp, dist.get_rank(), step).backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            if all(torch.isfinite(g).all() for g in grads.values()):
                optimizer.step()
            before[-1]["grads_finite"] = all(bool(torch.isfinite(g).all()) for g in grads.values())
        torch.save({"history": before, "final": snapshot(model, state, recorder)}, path)
    else:
        train(scenario, ddp, optimizer, steps)
        torch.save(snapshot(model, state, recorder), path)


if __name__ == "__main__":
    main()
