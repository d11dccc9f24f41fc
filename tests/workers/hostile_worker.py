"""Runs under horovodrun: Horovod's own usage patterns and hostile or careless ranks.

Each scenario writes ``<scenario>.<rank>.json`` with what this rank saw: ``error``
(the exception's type and message, or None) and scenario-specific results. A rank
that raised writes its file before it exits with status 3, so the test can read
every rank's outcome even when the job fails (as it must in several scenarios).

  resume-lags       rank 0 alone loads a checkpoint, then lags_hvd.broadcast_optimizer_state
  resume-horovod    the same with Horovod's own broadcast_optimizer_state
  fresh-horovod     a fresh start with Horovod's own broadcast_optimizer_state
  process-set-two   process sets {0} and {1}; the optimizer uses {0}: rank 1 steps locally
  process-set-one   only {0} is defined; the optimizer uses it
  density-mismatch  density 0.0016 on rank 0, 0.003 on rank 1
  clip-mismatch     max_grad_norm 0.25 on rank 0, none on rank 1
  bad-option        rank 1 passes density=1.5
  step-twice        rank 0 calls step() twice at step 2
  skip-iteration    rank 1 skips step 2 entirely (so rank 0 waits at its last step)
  stall             rank 1 sleeps at step 2 longer than exchange_timeout
  unfreeze          a parameter frozen at construction is unfrozen at step 2 on every rank
  freeze-one        rank 1 alone freezes a parameter at step 2
  dies-early        rank 1 exits before building the optimizer
  lr-differs        rank 1 wraps an SGD with another learning rate
  scaler-differs    rank 1's GradScaler starts from another scale
  empty-batch       rank 1 has no backward pass at step 2 (zero_grad, then step)
  dense-one-rank    rank 1 alone plans fc.weight dense at step 2
  bf16-dense        bfloat16 parameters at density 1.0
  sparse-embedding  nn.Embedding(sparse=True) against the same model with dense gradients
"""
import argparse
import io
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import horovod.torch as horovod  # noqa: E402
import lags_hvd as hvd  # noqa: E402
import models  # noqa: E402

torch.set_num_threads(1)
STEPS = 5
TIMEOUT = 4.0        # exchange_timeout of the stall scenario, seconds
STALL = 14.0         # how long rank 1 sleeps there


def optimizer_for(model, lr=models.LR, **options):
    base = torch.optim.SGD(model.parameters(), lr=lr, momentum=models.MOMENTUM)
    options.setdefault("density", models.DENSITY)
    options.setdefault("recipe", "paper")
    return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), **options)


def train(model, optimizer, steps, first=0, rank=None):
    rank = hvd.rank() if rank is None else rank
    for step in range(first, first + steps):
        optimizer.zero_grad()
        models.loss_of(model, rank, step).backward()
        optimizer.step()


def params_of(model):
    return {n: p.detach().double().flatten().tolist() for n, p in model.named_parameters()}


def resume(broadcast):
    model = models.make_model()
    optimizer = optimizer_for(model)
    train(model, optimizer, 3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    model, optimizer = models.make_model(seed=7), None
    optimizer = optimizer_for(model)
    if hvd.rank() == 0:
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    broadcast(optimizer, root_rank=0)
    train(model, optimizer, 3, first=3)
    return {"params": params_of(model), "iteration": optimizer.lags_state.iteration,
            "momentum": sorted(len(s) for s in optimizer.state.values())}


def fresh_horovod():
    model = models.make_model()
    optimizer = optimizer_for(model)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    horovod.broadcast_optimizer_state(optimizer, root_rank=0)
    train(model, optimizer, 3)
    return {"params": params_of(model), "iteration": optimizer.lags_state.iteration}


def process_set(sets):
    model, local = models.make_model(), models.make_model()
    optimizer = optimizer_for(model, process_set=sets[0])
    plain = torch.optim.SGD(local.parameters(), lr=models.LR, momentum=models.MOMENTUM)
    for step in range(STEPS):
        for m, opt in ((model, optimizer), (local, plain)):
            opt.zero_grad()
            models.loss_of(m, hvd.rank(), step).backward()
            opt.step()
    return {"params": params_of(model), "local": params_of(local)}


def stepping(scenario):
    model = models.make_model()
    if scenario == "unfreeze":
        model.shift.requires_grad_(False)
    optimizer = optimizer_for(model, exchange_timeout=TIMEOUT if scenario in ("stall", "skip-iteration") else 60.0)
    for step in range(STEPS):
        if step == 2:
            if scenario == "skip-iteration" and hvd.rank() == 1:
                continue
            if scenario == "empty-batch" and hvd.rank() == 1:
                optimizer.zero_grad()
                optimizer.step()
                continue
            if scenario == "dense-one-rank" and hvd.rank() == 1:
                plan = dict(optimizer.lags_state.planned_k, **{"fc.weight": model.fc.weight.numel()})
                optimizer.lags_state.set_plan(plan)
            if scenario == "stall" and hvd.rank() == 1:
                time.sleep(STALL)
            if scenario == "unfreeze":
                model.shift.requires_grad_(True)
            if scenario == "freeze-one" and hvd.rank() == 1:
                model.shift.requires_grad_(False)
        optimizer.zero_grad()
        models.loss_of(model, hvd.rank(), step).backward()
        optimizer.step()
        if step == 2 and scenario == "step-twice" and hvd.rank() == 0:
            optimizer.step()
    return {"finished": True, "params": params_of(model)}


def scaled():
    """Each rank's GradScaler from its own init_scale (rank 1's differs)."""
    model = models.make_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** (10 if hvd.rank() == 0 else 16))
    optimizer = optimizer_for(model, grad_scaler=scaler, exchange_timeout=60.0)
    for step in range(STEPS):
        optimizer.zero_grad()
        scaler.scale(models.loss_of(model, hvd.rank(), step)).backward()
        optimizer.synchronize()
        with optimizer.skip_synchronize():
            scaler.step(optimizer)
        scaler.update()
    return {}


def bf16_dense():
    model = models.make_model().to(torch.bfloat16)
    before = params_of(model)
    optimizer = optimizer_for(model, density=1.0)
    for step in range(3):
        optimizer.zero_grad()
        x, y = models.batch(hvd.rank(), step)
        torch.nn.functional.mse_loss(model(x.bfloat16()), y.bfloat16()).backward()
        optimizer.step()
    return {"params": params_of(model), "moved": params_of(model) != before}


class Bag(torch.nn.Module):
    def __init__(self, sparse):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = torch.nn.Embedding(50, 8, sparse=sparse)
        self.head = torch.nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.embedding(tokens).mean(1))


def sparse_embedding():
    results = {}
    for sparse in (True, False):
        model = Bag(sparse)
        optimizer = optimizer_for(model, density=0.05)
        gen = torch.Generator().manual_seed(hvd.rank())
        for _ in range(4):
            optimizer.zero_grad()
            tokens, target = torch.randint(50, (6, 5), generator=gen), torch.randint(3, (6,), generator=gen)
            torch.nn.functional.cross_entropy(model(tokens), target).backward()
            optimizer.step()
        results["sparse" if sparse else "dense"] = params_of(model)
        if sparse:
            results["grad_is_sparse"] = model.embedding.weight.grad.is_sparse
    return results


def run(scenario, sets):
    if scenario == "resume-lags":
        return resume(hvd.broadcast_optimizer_state)
    if scenario == "resume-horovod":
        return resume(horovod.broadcast_optimizer_state)
    if scenario == "fresh-horovod":
        return fresh_horovod()
    if scenario.startswith("process-set"):
        return process_set(sets)
    if scenario == "density-mismatch":
        optimizer_for(models.make_model(), density=0.0016 if hvd.rank() == 0 else 0.003)
        return {}
    if scenario == "clip-mismatch":   # one rank would clip the merged gradient, the other not
        optimizer_for(models.make_model(), max_grad_norm=0.25 if hvd.rank() == 0 else None)
        return {}
    if scenario == "lr-differs":
        optimizer_for(models.make_model(), lr=0.2 if hvd.rank() == 1 else 0.1)
        return {}
    if scenario == "scaler-differs":
        return scaled()
    if scenario == "bad-option":
        optimizer_for(models.make_model(), density=1.5 if hvd.rank() == 1 else 0.1)
        return {}
    if scenario == "dies-early":
        if hvd.rank() == 1:
            os._exit(0)
        optimizer_for(models.make_model())
        return {}
    if scenario == "bf16-dense":
        return bf16_dense()
    if scenario == "sparse-embedding":
        return sparse_embedding()
    return stepping(scenario)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenario", required=True)
    args = parser.parse_args()
    sets = {"process-set-two": [hvd.ProcessSet([0]), hvd.ProcessSet([1])],
            "process-set-one": [hvd.ProcessSet([0])]}.get(args.scenario)
    hvd.init(process_sets=sets)
    started = time.monotonic()
    try:
        result, error = run(args.scenario, sets), None
    except Exception as raised:   # recorded for the test, then the rank fails
        result, error = {}, {"type": type(raised).__name__, "message": str(raised)}
    result.update(error=error, seconds=time.monotonic() - started)
    with open(os.path.join(args.out, f"{args.scenario}.{hvd.rank()}.json"), "w") as f:
        json.dump(result, f)
    if error:
        time.sleep(2)   # let the other ranks write their records before the launcher ends the job
        os._exit(3)
    hvd.barrier()
    hvd.shutdown()


if __name__ == "__main__":
    main()
