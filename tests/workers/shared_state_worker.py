"""What every rank must hold alike after Horovod's documented patterns, under the default recipe
(AdamW: Adam correction with the local residual; SGD with momentum: momentum correction).

Every scenario runs in this one launch and writes its record into ``shared_state.<rank>.json``:

  join-<rule>     uneven inputs: rank r trains JOIN_BATCHES[r] batches, ``hvd.join()``, the
                  parameters and optimizer state of the last rank to join are broadcast, 3 steps
                  together, then ``average_models()``
  resume-<rule>   Horovod's resume pattern: rank 0 alone loads a checkpoint, parameters and
                  optimizer state broadcast from it, 4 steps together, then ``average_models()``
  groups-<rule>   the param groups the hooks read are the optimizer's live ones: the same run
                  three times (as built; after ``broadcast_optimizer_state``; after a
                  ``load_state_dict`` round trip) under a StepLR to lr 0 (0.1 lr under SGD) at step 3 and momentum,
                  betas and weight decay changed by hand at step 2
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import models  # noqa: E402
from backend import hvd  # noqa: E402
from hostile_worker import resumed_on_rank_0  # noqa: E402

torch.set_num_threads(1)
JOIN_BATCHES = [3, 5, 4]
RULES = ("adamw", "sgd", "sgd-lr-scaled")


def build(rule, model):
    """The default recipe's optimizer for ``rule`` (``sgd-lr-scaled``: the paper's update with
    ``lr_scaled_residual``, whose residual reads the lr)."""
    if rule == "adamw":
        base = torch.optim.AdamW(model.parameters(), lr=0.01, eps=1e-3, weight_decay=0.1)
    else:
        # no weight decay until step 2: Horovod's broadcast_optimizer_state initialises a fresh
        # optimizer with a step on zero gradients, which weight decay would turn into a move
        base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    options = {"recipe": "paper", "lr_scaled_residual": True} if rule == "sgd-lr-scaled" else {}
    return hvd.DistributedOptimizer(
        base, named_parameters=model.named_parameters(), density=0.1, exchange_timeout=60.0, **options
    )


def train(model, optimizer, steps, first=0, scheduler=None, change=None):
    for step in range(first, first + steps):
        if change is not None and step == 2:
            change(optimizer.param_groups[0])
        optimizer.zero_grad()
        models.loss_of(model, hvd.rank(), step).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def record(model, optimizer):
    """Parameters, the consensus each rank holds (parameters plus residual: the model itself
    where no residual lives in the parameters) and the Adam moments of the units sent whole."""
    eps = optimizer.lags_state.residuals.state_dict() if optimizer.lags_state.residuals.registered else {}
    local = optimizer.update_rule["rule"] == "adam_correction_local"
    params = {n: p.detach().double().flatten().tolist() for n, p in model.named_parameters()}
    consensus = {
        n: (p.detach().flatten() + eps[n]).double().tolist() if local and n in eps else params[n]
        for n, p in model.named_parameters()
    }
    moments = {n: t.double().tolist() for n, t in optimizer.lags_state.replicated_memories()}
    return {"params": params, "consensus": consensus, "moments": moments}


def finished(model, optimizer):
    together = record(model, optimizer)
    optimizer.average_models()
    return {"together": together, "averaged": record(model, optimizer)}


def join(rule):
    model = models.make_model()
    optimizer = build(rule, model)
    train(model, optimizer, JOIN_BATCHES[hvd.rank()])
    last = hvd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    hvd.broadcast_optimizer_state(optimizer, root_rank=last)
    train(model, optimizer, 3, first=max(JOIN_BATCHES[: hvd.size()]))
    return finished(model, optimizer)


def resume(rule):
    model, optimizer = resumed_on_rank_0(lambda model: build(rule, model), hvd.broadcast_optimizer_state)
    train(model, optimizer, 4, first=3)
    return finished(model, optimizer)


def change_hyperparameters(group):
    if "betas" in group:
        group["betas"] = (0.5, 0.9)
    else:
        group["momentum"] = 0.5
    group["weight_decay"] = 0.05


def groups(rule):
    """The three runs' parameters after 6 steps, by how the optimizer was prepared."""
    runs = {}
    for prepared in ("as-built", "broadcast", "reloaded"):
        model = models.make_model()
        optimizer = build(rule, model)
        if prepared == "broadcast":
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        elif prepared == "reloaded":
            optimizer.load_state_dict(optimizer.state_dict())
        gamma = 0.0 if rule == "adamw" else 0.1  # lr_scaled_residual refuses lr 0
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=gamma)
        train(model, optimizer, 6, scheduler=scheduler, change=change_hyperparameters)
        runs[prepared] = record(model, optimizer)["params"]
    return runs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    hvd.init()
    results = {}
    for rule in RULES:
        results[f"groups-{rule}"] = groups(rule)
    for rule in RULES[:2]:
        results[f"join-{rule}"] = join(rule)
        results[f"resume-{rule}"] = resume(rule)
    with open(os.path.join(args.out, f"shared_state.{hvd.rank()}.json"), "w") as f:
        json.dump(results, f)
    hvd.barrier()
    hvd.shutdown()


if __name__ == "__main__":
    main()
