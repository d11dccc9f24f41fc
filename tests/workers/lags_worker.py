"""Runs under horovodrun/mpirun: trains TinyNet with lags_hvd and writes what it saw.

Scenarios (one launch runs several, to pay the start-up once):
  oracle      STEPS steps with SGD+momentum; saves parameters, residuals, the raw
              gradients and every sparse message it sent (for the oracle and the
              mass-conservation check).
  dense       density 1 against hvd.DistributedOptimizer on a second copy: writes
              the largest parameter difference.
  checkpoint  N steps, save, M more; then a fresh model and optimizer load the
              checkpoint and run the same M steps: writes the largest differences.
  overlap     a slow model; records when each exchange starts and when backprop
              reaches the input.
  killed      rank 1 dies at step 5: the others must exit with an error in bounded time.
  mismatch    rank 1's model differs: construction must fail everywhere.
  nonfinite   a NaN gradient on one rank only: every rank must skip that step.
  adaptive-<profile>  density="adaptive" on a measured network profile or one read from
              a file: records the loop's decisions, the k in force at every step and
              the k actually sent.
  compose-accumulate   backward_passes_per_step=2, clipping between synchronize() and
              step(), a frozen parameter, zero_grad(set_to_none=False), a parameter
              used only on some iterations.
  compose-process-set  P=3: LAGS over the process set {0, 2}; rank 1 stays out.
  compose-amp a GradScaler; rank 1 overflows at step AMP_OVERFLOW_STEP.
  compose-<setting>-rs the same with aggregation="reduce_scatter".
  fidelity-<variant>  the options of FIDELITY[variant]; parameters, residuals, k.
  adam-<variant>  Adam correction (adamw, adam-l2: Adam's L2 decay, -amp: a GradScaler
              and an overflow on rank 1, -local: local_residual); parameters, residuals.
  local-<variant>  AdamW with local_residual under LOCAL[variant]; parameters, residuals.
  reduction-<variant> the op and gradient_predivide_factor of REDUCTION[variant];
              parameters, residuals.
  amp-recipe  FIDELITY["recipe"] with a GradScaler and without one; parameters,
              residuals and velocities of both.
  auto               buckets="auto" on a slow-start-up link; parameters, residuals, buckets.
  reordered   two branches whose gradients rank 1 produces in the other order (two
              backward passes per step, reversed there): parameters against the run
              where every rank uses one order.
  cross-save  the default recipe: saves its checkpoint after half the steps, then the
              parameters and residuals at the end (cross-final.<backend>.<rank>.pt).
  cross-resume  a fresh model and optimizer load cross-save's checkpoint, whichever backend
              wrote it, and train the other half (cross-resumed.<backend>.<rank>.pt).
"""

import argparse
import json
import math
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # backend, also when imported by a test
import graph_stand_in  # noqa: E402
import models  # noqa: E402
from backend import BACKEND, DEVICE, dense_reference, hvd  # noqa: E402

from lags_hvd import selection  # noqa: E402

torch.set_num_threads(1)

PROCESS_SET_MEMBERS = [0, 2]
CLIP_NORM = 0.05
AMP_OVERFLOW_STEP = 2
# The fidelity options, alone and together (scenario fidelity-<variant>).
FIDELITY = {
    "warmup": dict(density_warmup=4, density_warmup_start=0.5),
    "momentum": dict(momentum_correction=True),
    "dense1d": dict(dense_params="1d"),
    "clip": dict(local_clip=0.02),
    "clip-feedback": dict(max_grad_norm=CLIP_NORM),
    "all": dict(
        density_warmup=4,
        density_warmup_start=0.5,
        momentum_correction=True,
        dense_params="1d",
        local_clip=0.02,
        max_grad_norm=0.005,
    ),
    # the default recipe on this momentum SGD: momentum correction and 1-D parameters
    # dense by itself; its warm-up shortened so that the run outlasts it
    "recipe": dict(recipe="dgc", buckets="layer", density_warmup=4, density_warmup_start=0.5),
    # the same with each sparse bucket's hook replayed from a CUDA graph (off CUDA, the stand-in)
    "graphs": dict(recipe="dgc", buckets="layer", density_warmup=4, density_warmup_start=0.5, cuda_graphs=True),
}


# Horovod's reductions besides the plain average (scenario reduction-<variant>), with each
# aggregation: the sum (under it, the local clip's budget is C / sqrt(P)) and the average
# with a pre-division; conv.weight (density 1) is a dense unit in every one
PREDIVIDE = 3.0
REDUCTION = {
    "sum": dict(op=hvd.Sum),
    "sum-rs": dict(op=hvd.Sum, aggregation="reduce_scatter"),
    "sum-clip": dict(op=hvd.Sum, local_clip=0.02),
    "predivide": dict(gradient_predivide_factor=PREDIVIDE),
    "predivide-rs": dict(gradient_predivide_factor=PREDIVIDE, aggregation="reduce_scatter"),
}
ADAM = dict(lr=0.01, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.1)  # scenario adam-*: eps wide of ties
ADAM_VARIANTS = ("adamw", "adam-l2", "adamw-amp", "adamw-local", "adam-l2-local-amp")
LOCAL = {  # scenario local-*: local_residual on the paths where the consensus could slip
    "auto": dict(recipe="dgc", density_warmup=2, bucket_warmup=2),  # warm-up, then one bucket (below)
    "clip-rs": dict(max_grad_norm=0.05, aggregation="reduce_scatter"),  # a clip that gives back
    "passes2": dict(backward_passes_per_step=2),
    "skip": dict(),  # at LOCAL_SKIP_STEP every rank synchronizes and does not step
}
LOCAL_SKIP_STEP = 3
AMP_SCALE = 2.0**10  # scenario amp-recipe: the GradScaler's first scale, doubled every 2 steps


def make_model(seed: int = 0):
    """``models.make_model`` on the workers' device (``backend.DEVICE``)."""
    return models.make_model(seed).to(DEVICE)


def save(result, path) -> None:
    """``torch.save``; off the CPU, the result's tensors moved to the CPU first (in dicts, lists
    and tuples), where the test's references are."""

    def on_cpu(value):
        if isinstance(value, torch.Tensor):
            return value.cpu()
        if isinstance(value, dict):
            return {key: on_cpu(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(on_cpu(item) for item in value)
        return value

    torch.save(result if DEVICE.type == "cpu" else on_cpu(result), path)


def lags_optimizer(model, **options):
    if options.get("cuda_graphs") and DEVICE.type != "cuda":
        graph_stand_in.install()
    base = torch.optim.SGD(model.parameters(), lr=models.LR, momentum=models.MOMENTUM, weight_decay=models.WEIGHT_DECAY)
    options.setdefault("density", models.DENSITY)
    options.setdefault("layer_densities", models.LAYER_DENSITIES)
    options.setdefault("recipe", "paper")  # the oracle's update, per layer, unless asked otherwise
    return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), **options)


def train_step(model, optimizer, step):
    optimizer.zero_grad()
    models.loss_of(model, hvd.rank(), step).backward()
    optimizer.step()


def scenario_oracle(out, steps):
    model = make_model()
    raw = {n: [] for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():  # registered first: sees the raw gradient
        p.register_post_accumulate_grad_hook(lambda p, n=n: raw[n].append(p.grad.detach().clone()))
    optimizer = lags_optimizer(model)
    sent = []
    optimizer.exchange_observers.append(
        lambda e: sent.append((e.name, e.values.clone(), e.indices.clone())) if e.sparse else None
    )
    for step in range(steps):
        train_step(model, optimizer, step)
    save(
        {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "residuals": {n: r.clone() for n, r in optimizer.lags_state.residuals.state_dict().items()},
            "k": dict(optimizer.lags_state.k),
            "raw": raw,
            "sent": sent,
        },
        os.path.join(out, f"oracle.{hvd.rank()}.pt"),
    )


def scenario_dense(steps):
    """Density 1 against the backend's own dense data parallelism on a second copy."""
    lags_model, dense_model = make_model(), make_model()
    lags_opt = lags_optimizer(lags_model, density=1.0, layer_densities={})
    dense_base = torch.optim.SGD(
        dense_model.parameters(), lr=models.LR, momentum=models.MOMENTUM, weight_decay=models.WEIGHT_DECAY
    )
    module, dense_opt = dense_reference(dense_model, dense_base, dense_model.named_parameters())
    for step in range(steps):
        train_step(lags_model, lags_opt, step)
        train_step(module, dense_opt, step)
    return max_differences(lags_model, dense_model)


def scenario_checkpoint(out, first, second):
    model = make_model()
    optimizer = lags_optimizer(model)
    for step in range(first):
        train_step(model, optimizer, step)
    path = os.path.join(out, f"ckpt.{hvd.rank()}.pt")
    save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)
    for step in range(first, first + second):
        train_step(model, optimizer, step)

    resumed = make_model(seed=123)  # different init: everything must come from the file
    resumed_opt = lags_optimizer(resumed)
    checkpoint = torch.load(path)
    resumed.load_state_dict(checkpoint["model"])
    resumed_opt.load_state_dict(checkpoint["optimizer"])
    for step in range(first, first + second):
        train_step(resumed, resumed_opt, step)
    differences = max_differences(model, resumed)
    for name, r in optimizer.lags_state.residuals.state_dict().items():
        differences[f"residual {name}"] = (r - resumed_opt.lags_state.residuals.residual(name)).abs().max().item()
    return differences


def max_differences(model_a, model_b) -> dict:
    return {
        name: (a - b).abs().max().item()
        for (name, a), (_, b) in zip(model_a.named_parameters(), model_b.named_parameters())
    }


class _Marker(torch.autograd.Function):
    """Identity whose backward records the time backprop reaches it."""

    times = []

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        _Marker.times.append(time.perf_counter())
        return grad


def scenario_overlap(out):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(512, 512) for _ in range(6)]
    model = torch.nn.Sequential(*layers)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(), density=0.01
    )
    launches = []
    optimizer.exchange_observers.append(lambda e: launches.append((e.name, time.perf_counter(), e.pending)))
    x = torch.randn(256, 512)
    for _ in range(3):
        launches.clear()
        _Marker.times.clear()
        optimizer.zero_grad()
        model(_Marker.apply(x.requires_grad_())).square().mean().backward()
        backward_end = _Marker.times[-1]
        done_before_end = [p.done() for _, _, p in launches]
        optimizer.step()
    record = {
        "backward_end": backward_end,
        "launches": [(n, t) for n, t, _ in launches],
        "done_before_end": done_before_end,
    }
    with open(os.path.join(out, f"overlap.{hvd.rank()}.json"), "w") as f:
        json.dump(record, f)


def scenario_adaptive(out, steps, profile):
    """Adaptive density: records the decisions, the k in force and the k actually sent.
    ``profile``: "measured" (the optimizer times the network itself) or "file" (a network
    profile in a JSON file, of 2 ms per message)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)
    )
    options = dict(density="adaptive", min_density=0.01, warmup_iterations=3, replan_every=4, recipe="paper")
    if profile == "file":
        cost = {"alpha": 2e-3, "beta": 1e-8}
        path = os.path.join(out, f"network.{hvd.rank()}.json")
        with open(path, "w") as f:
            json.dump({"world_size": hvd.size(), "allgather": cost, "allreduce": cost}, f)
        options["network_profile"] = path
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(), **options
    )
    sent = {}
    optimizer.exchange_observers.append(lambda e: sent.__setitem__(e.name, e.values.numel()))
    gen = torch.Generator().manual_seed(hvd.rank())
    record = {"sent": [], "in_force": []}
    for _ in range(steps):
        sent.clear()
        record["in_force"].append(dict(optimizer.lags_state.k))
        optimizer.zero_grad()
        x, y = torch.randn(64, 128, generator=gen), torch.randint(10, (64,), generator=gen)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        record["sent"].append(dict(sent))
    record["history"] = [[e["iteration"], e["event"]] for e in optimizer.adaptive_history]
    record["final_plan"] = [[p.name, p.k, p.dense, p.start, p.end] for p in optimizer.plan or []]
    with open(os.path.join(out, f"adaptive-{profile}.{hvd.rank()}.json"), "w") as f:
        json.dump(record, f)


def scenario_nonfinite(out):
    """Rank 1 alone gets a NaN gradient in fc.weight at step 2: every rank must skip it."""
    model = make_model()
    optimizer = lags_optimizer(model)
    poison = {"on": False}
    model.fc.weight.register_hook(lambda g: torch.full_like(g, float("nan")) if poison["on"] else g)
    snapshots = []
    for step in range(4):
        poison["on"] = step == 2 and hvd.rank() == 1
        train_step(model, optimizer, step)
        snapshots.append(
            {
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "residuals_finite": all(
                    bool(torch.isfinite(r).all()) for r in optimizer.lags_state.residuals.state_dict().values()
                ),
            }
        )
    save({"snapshots": snapshots, "skipped": optimizer.skipped_steps}, os.path.join(out, f"nonfinite.{hvd.rank()}.pt"))


def scenario_mismatch(out):
    """Rank 1 builds fc with another width: construction must fail on every rank, clearly."""
    model = make_model()
    if hvd.rank() == 1:
        model.fc = torch.nn.Linear(3 * 4 * 4, 6)
    try:
        lags_optimizer(model)
        message = None
    except ValueError as error:
        message = str(error)
    with open(os.path.join(out, f"mismatch.{hvd.rank()}.json"), "w") as f:
        json.dump({"error": message}, f)


def scenario_compose(out, steps, variant, process_set):
    """Train TinyNet in one of the composed settings (a "-rs" suffix: with aggregation=
    "reduce_scatter"); save parameters and residuals."""
    label, aggregation = variant, "reduce_scatter" if variant.endswith("-rs") else "allgather"
    variant = variant.removesuffix("-rs")
    if variant == "process-set" and hvd.rank() not in PROCESS_SET_MEMBERS:
        return
    model = make_model()
    if variant == "accumulate":
        model.shift.requires_grad_(False)
    passes = 2 if variant == "accumulate" else 1
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=2.0**10, growth_interval=2) if variant == "amp" else None
    optimizer = lags_optimizer(
        model,
        backward_passes_per_step=passes,
        grad_scaler=scaler,
        aggregation=aggregation,
        process_set=process_set if variant == "process-set" else hvd.global_process_set,
    )
    overflow = {"on": False}
    model.fc.weight.register_hook(lambda g: g * math.inf if overflow["on"] else g)
    for step in range(steps):
        optimizer.zero_grad(set_to_none=variant != "accumulate")
        overflow["on"] = variant == "amp" and step == AMP_OVERFLOW_STEP and hvd.rank() == 1
        for micro in range(passes):
            loss = models.loss_of(model, hvd.rank(), step * passes + micro, sometimes=True)
            (scaler.scale(loss) if scaler else loss).backward()
        optimizer.synchronize()
        if scaler:
            scaler.unscale_(optimizer)
        if variant == "accumulate":
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP_NORM)
        with optimizer.skip_synchronize():
            scaler.step(optimizer) if scaler else optimizer.step()
        if scaler:
            scaler.update()
    save(
        {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "residuals": {n: r.clone() for n, r in optimizer.lags_state.residuals.state_dict().items()},
            "skipped": optimizer.skipped_steps,
            "scale": scaler.get_scale() if scaler else None,
        },
        os.path.join(out, f"compose-{label}.{hvd.rank()}.pt"),
    )


def train_and_save(model, optimizer, steps: int, path: str, extra=dict) -> None:
    """``steps`` steps on this rank's batches (aux sometimes unused); save the parameters,
    the residuals and what ``extra()`` returns after training."""
    for step in range(steps):
        optimizer.zero_grad()
        models.loss_of(model, hvd.rank(), step, sometimes=True).backward()
        optimizer.step()
    save(
        {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "residuals": {n: r.clone() for n, r in optimizer.lags_state.residuals.state_dict().items()},
            **extra(),
        },
        path,
    )


def scenario_fidelity(out, steps, variant):
    model = make_model()
    optimizer = lags_optimizer(model, **FIDELITY[variant])
    train_and_save(
        model,
        optimizer,
        steps,
        os.path.join(out, f"fidelity-{variant}.{hvd.rank()}.pt"),
        extra=lambda: {
            "k": dict(optimizer.lags_state.k),
            "grad_norm": optimizer.grad_norm,
            "graphs": optimizer.cuda_graphs,
        },
    )


def scenario_adam(out, steps, variant):
    """ADAM[variant] (Adam correction): parameters and residuals; ``-amp`` with a GradScaler
    (power-of-two scales) whose step rank 1 overflows at AMP_OVERFLOW_STEP; ``-local`` with
    the residual in the parameters, and the parameters after ``average_models()``."""
    model = make_model()
    decoupled, amp, local = not variant.startswith("adam-l2"), variant.endswith("-amp"), "-local" in variant
    base = (torch.optim.AdamW if decoupled else torch.optim.Adam)(model.parameters(), **ADAM)
    scaler = torch.amp.GradScaler(DEVICE.type, init_scale=AMP_SCALE, growth_interval=2) if amp else None
    optimizer = hvd.DistributedOptimizer(
        base,
        named_parameters=model.named_parameters(),
        density=models.DENSITY,
        layer_densities=models.LAYER_DENSITIES,
        recipe="paper",
        adam_correction=True,
        local_residual=local,
        grad_scaler=scaler,
    )
    overflow = {"on": False}
    model.fc.weight.register_hook(lambda g: g * math.inf if overflow["on"] else g)
    for step in range(steps):
        optimizer.zero_grad()
        overflow["on"] = amp and step == AMP_OVERFLOW_STEP and hvd.rank() == 1
        loss = models.loss_of(model, hvd.rank(), step, sometimes=True)
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            optimizer.synchronize()
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    result = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "residuals": {n: r.clone() for n, r in optimizer.lags_state.residuals.state_dict().items()},
        "skipped": optimizer.skipped_steps,
    }
    if local:
        optimizer.average_models()
        result["averaged"] = {n: p.detach().clone() for n, p in model.named_parameters()}
        result["residuals_after"] = optimizer.lags_state.residuals.state_dict()
    save(result, os.path.join(out, f"adam-{variant}.{hvd.rank()}.pt"))


def scenario_local(out, steps, variant):
    """LOCAL[variant] under AdamW with local_residual: parameters and residuals (every rank's
    ``x_p + eps_p`` must be the same consensus)."""
    model = make_model()
    options = {"recipe": "paper", "adam_correction": True, **LOCAL[variant]}
    if variant == "auto":  # 50 ms per collective: the plan merges every sparse parameter into one bucket
        cost = {"alpha": 0.05, "beta": 1e-9}
        options["network_profile"] = {"world_size": hvd.size(), "allgather": cost, "allreduce": cost}
    optimizer = hvd.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), **ADAM),
        named_parameters=model.named_parameters(),
        density=models.DENSITY,
        local_residual=True,
        **options,
    )
    passes = options.get("backward_passes_per_step", 1)
    for step in range(steps):
        optimizer.zero_grad()
        for _ in range(passes):
            (models.loss_of(model, hvd.rank(), step, sometimes=True) / passes).backward()
        if variant == "skip":  # a loss-spike guard: synchronize, look, step or not
            optimizer.synchronize()
            if step == LOCAL_SKIP_STEP:
                continue
            with optimizer.skip_synchronize():
                optimizer.step()
        else:
            optimizer.step()
    save(
        {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "residuals": {n: r.clone() for n, r in optimizer.lags_state.residuals.state_dict().items()},
            "rule": optimizer.update_rule["rule"],
            "replanned": optimizer.buckets_settled,
            "buckets": len(optimizer.lags_state.units),
        },
        os.path.join(out, f"local-{variant}.{hvd.rank()}.pt"),
    )


def scenario_reduction(out, steps, variant):
    """REDUCTION[variant]: parameters and residuals."""
    model = make_model()
    optimizer = lags_optimizer(model, **REDUCTION[variant])
    train_and_save(model, optimizer, steps, os.path.join(out, f"reduction-{variant}.{hvd.rank()}.pt"))


def scenario_amp_recipe(out, steps):
    """FIDELITY["recipe"] (the default recipe: momentum correction, so the weight decay joins
    the velocity) under a GradScaler whose power-of-two scale grows and never overflows,
    then without one; saves both runs."""
    saved = {}
    for label in ("scaled", "plain"):
        model = make_model()
        scaled = label == "scaled"
        scaler = torch.amp.GradScaler(DEVICE.type, init_scale=AMP_SCALE, growth_interval=2) if scaled else None
        optimizer = lags_optimizer(model, grad_scaler=scaler, **FIDELITY["recipe"])
        for step in range(steps):
            optimizer.zero_grad()
            loss = models.loss_of(model, hvd.rank(), step, sometimes=True)
            if scaler is None:
                loss.backward()
                optimizer.step()
                continue
            scaler.scale(loss).backward()
            optimizer.synchronize()
            scaler.unscale_(optimizer)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
        state = optimizer.lags_state
        saved[label] = {
            "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "residuals": {n: r.clone() for n, r in state.residuals.state_dict().items()},
            "velocities": {n: v.clone() for n, v in state.velocities.state_dict().items()},
            "skipped": optimizer.skipped_steps,
            "scale": scaler.get_scale() if scaler else None,
        }
    save(saved, os.path.join(out, f"amp-recipe.{hvd.rank()}.pt"))


def descending_selector(x, k):
    """The exact top-k, handed back in descending index order (a user's selector may)."""
    values, indices = selection.select_torch(x, k)
    return values.flip(0), indices.flip(0)


# aggregation="reduce_scatter" alone, and with momentum correction, a density warm-up (k, so
# the number of region owners, changes), a user's selector returning unsorted indices and
# owners keeping ceil(2.5 k) entries between them, under a clip of the merged gradient
REDUCE_SCATTER = {
    "plain": {},
    "hostile": dict(
        momentum_correction=True,
        density_warmup=4,
        density_warmup_start=0.5,
        selector=descending_selector,
        owner_keep=2.5,
        max_grad_norm=CLIP_NORM,
    ),
    "regional": dict(
        regional_selection=True,
        owner_keep=2,
        momentum_correction=True,
        density_warmup=4,
        density_warmup_start=0.5,
        selector=descending_selector,
    ),
}


def scenario_reduce_scatter(out, steps, variant):
    """aggregation="reduce_scatter": parameters, residuals, regions and the last step's traffic."""
    model = make_model()
    optimizer = lags_optimizer(model, aggregation="reduce_scatter", **REDUCE_SCATTER[variant])
    train_and_save(
        model,
        optimizer,
        steps,
        os.path.join(out, f"reduce-scatter-{variant}.{hvd.rank()}.pt"),
        extra=lambda: {
            "regions": dict(optimizer.lags_state.regions),
            "traffic": optimizer.traffic,
            "grad_norm": optimizer.grad_norm,
        },
    )


AUTO_WARMUP = 3


def scenario_auto(out, steps):
    """buckets="auto" on a link whose start-up cost (50 ms) makes the planner merge: the
    buckets come from rank 0's plan after AUTO_WARMUP iterations."""
    model = make_model()
    slow = {"alpha": 0.05, "beta": 1e-9}
    optimizer = lags_optimizer(
        model,
        buckets="auto",
        bucket_warmup=AUTO_WARMUP,
        network_profile={"world_size": hvd.size(), "allgather": slow, "allreduce": slow},
    )
    train_and_save(
        model,
        optimizer,
        steps,
        os.path.join(out, f"auto.{hvd.rank()}.pt"),
        extra=lambda: {"buckets": optimizer.lags_state.buckets()},
    )


def snapshot(model, optimizer) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "residuals": {n: r.clone() for n, r in optimizer.lags_state.residuals.state_dict().items()},
        "velocities": {n: v.clone() for n, v in optimizer.lags_state.velocities.state_dict().items()},
    }


def scenario_cross_save(out, steps):
    model = make_model()
    optimizer = lags_optimizer(model, **FIDELITY["recipe"])
    for step in range(steps):
        if step == steps // 2:
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            save(state, os.path.join(out, f"cross.{hvd.rank()}.pt"))
        train_step(model, optimizer, step)
    save(snapshot(model, optimizer), os.path.join(out, f"cross-final.{BACKEND}.{hvd.rank()}.pt"))


def scenario_cross_resume(out, steps):
    model = make_model(seed=123)  # everything must come from the file
    optimizer = lags_optimizer(model, **FIDELITY["recipe"])
    checkpoint = torch.load(os.path.join(out, f"cross.{hvd.rank()}.pt"))
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    for step in range(steps // 2, steps):
        train_step(model, optimizer, step)
    save(snapshot(model, optimizer), os.path.join(out, f"cross-resumed.{BACKEND}.{hvd.rank()}.pt"))


def scenario_reordered(out, steps):
    """Two branches of one shape, each with its own loss: every rank backpropagates both, rank 1
    in the other order, so its buckets become ready in the other order."""
    results = {}
    for label in ("same", "reversed"):
        torch.manual_seed(0)
        model = torch.nn.ModuleDict({"a": torch.nn.Linear(16, 16), "b": torch.nn.Linear(16, 16)})
        optimizer = hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), density=0.1
        )
        order = ["b", "a"] if label == "reversed" and hvd.rank() == 1 else ["a", "b"]
        gen = torch.Generator().manual_seed(hvd.rank())
        for _ in range(steps):
            optimizer.zero_grad()
            x = torch.randn(8, 16, generator=gen)
            for branch in order:
                model[branch](x).square().mean().backward()
            optimizer.step()
        results[label] = {n: p.detach().clone() for n, p in model.named_parameters()}
    save(results, os.path.join(out, f"reordered.{hvd.rank()}.pt"))


def scenario_killed():
    """Rank 1 dies abruptly at step 5; the others must stop with an error, not hang."""
    model = make_model()
    optimizer = lags_optimizer(model)
    for step in range(10_000):
        if step == 5 and hvd.rank() == 1:
            os._exit(9)
        train_step(model, optimizer, step)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--scenarios", default="oracle,dense,checkpoint", help="name or name:steps, comma-separated")
    args = parser.parse_args()
    process_set = hvd.ProcessSet(PROCESS_SET_MEMBERS) if "compose-process-set" in args.scenarios else None
    hvd.init(process_sets=[process_set] if process_set else None)
    differences, default_steps = {}, args.steps
    for entry in args.scenarios.split(","):
        name, _, own_steps = entry.partition(":")  # one launch may run scenarios of several lengths
        args.steps = int(own_steps) if own_steps else default_steps
        if name == "oracle":
            scenario_oracle(args.out, args.steps)
        elif name == "dense":
            differences["dense"] = scenario_dense(args.steps)
        elif name == "checkpoint":
            differences["checkpoint"] = scenario_checkpoint(args.out, args.steps // 2, args.steps - args.steps // 2)
        elif name == "overlap":
            scenario_overlap(args.out)
        elif name == "killed":
            scenario_killed()
        elif name == "mismatch":
            scenario_mismatch(args.out)
        elif name == "nonfinite":
            scenario_nonfinite(args.out)
        elif name.startswith("fidelity-"):
            scenario_fidelity(args.out, args.steps, name.removeprefix("fidelity-"))
        elif name.startswith("adam-"):
            scenario_adam(args.out, args.steps, name.removeprefix("adam-"))
        elif name.startswith("local-"):
            scenario_local(args.out, args.steps, name.removeprefix("local-"))
        elif name.startswith("reduction-"):
            scenario_reduction(args.out, args.steps, name.removeprefix("reduction-"))
        elif name == "amp-recipe":
            scenario_amp_recipe(args.out, args.steps)
        elif name.startswith("compose-"):
            scenario_compose(args.out, args.steps, name.removeprefix("compose-"), process_set)
        elif name == "auto":
            scenario_auto(args.out, args.steps)
        elif name == "reordered":
            scenario_reordered(args.out, args.steps)
        elif name == "cross-save":
            scenario_cross_save(args.out, args.steps)
        elif name == "cross-resume":
            scenario_cross_resume(args.out, args.steps)
        elif name.startswith("reduce-scatter-"):
            scenario_reduce_scatter(args.out, args.steps, name.removeprefix("reduce-scatter-"))
        elif name.startswith("adaptive-"):
            scenario_adaptive(args.out, args.steps, name.removeprefix("adaptive-"))
        else:
            raise SystemExit(f"unknown scenario {name}")
    with open(os.path.join(args.out, f"differences.{hvd.rank()}.json"), "w") as f:
        json.dump(differences, f)
    hvd.barrier()  # one rank's shutdown ends Horovod for all: wait for the process set's members
    hvd.shutdown()


if __name__ == "__main__":
    main()
