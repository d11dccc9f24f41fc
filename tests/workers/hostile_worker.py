"""Horovod's own usage patterns and hostile or careless ranks, under horovodrun (or torchrun:
tests/workers/backend.py).

``--scenarios`` run in order in the same workers (a launch costs seconds of start-up,
most scenarios a fraction of one). Each writes ``<scenario>.<rank>.json`` with what this
rank saw: ``error`` (the exception's type and message, or None) and scenario-specific
results. A rank that raised writes its file and exits with status 3 (the scenarios after
it do not run), so the test can read every rank's outcome even when the job fails (as it
must in several scenarios). The exception: a scenario of ``REFUSED_ALIKE`` that every rank
raised, which leaves the workers in step, so the launch goes on (the next scenario then
shows that the failed optimizer left nothing behind that disturbs a new one).

``--fork`` (horovodrun's Gloo controller, torchrun): each scenario runs in a child forked
from the worker, which never initialises. The child initialises for the scenario alone,
runs it and exits as that launch's worker would; the worker writes the child's exit status
to ``<scenario>.<rank>.exit`` and forks the next once every rank's child has ended. So the
scenarios that must fail, or leave the ranks out of step, share one launch too.

  resume-lags       rank 0 alone loads a checkpoint, then lags_hvd.broadcast_optimizer_state
  resume-horovod    the same with Horovod's own broadcast_optimizer_state
  resume-local      resume-lags under Adam correction with the residual in each rank's
                    parameters: what each rank holds after the broadcast and 3 steps later
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
  freeze-one-late   the same, rank 0 still in backward (LATE seconds in a hook) when rank 1
                    has read the step check, raised and left as a worker with an uncaught
                    error does (the interpreter's exit runs Horovod's shutdown, which tells
                    the peers)
  dies-early        rank 1 exits before building the optimizer
  lr-differs        rank 1 wraps an SGD with another learning rate; -broadcast: then aligned
  scaler-differs    rank 1's GradScaler starts from another scale
  empty-batch       rank 1 has no backward pass at step 2 (zero_grad, then step)
  dense-one-rank    rank 1 alone plans fc.weight dense at step 2
  bf16-dense        bfloat16 parameters at density 1.0
  sparse-embedding  nn.Embedding(sparse=True) against the same model with dense gradients
  join, join-rs     uneven inputs (delta monitored): rank r trains JOIN_BATCHES[r] batches, calls hvd.join(), then
                    the parameters and optimizer state come from the last rank to join
  join-stall        rank 0 joins after 2 batches, rank 1 stalls longer than exchange_timeout
  lr-one-rank       rank 1 alone halves its learning rate at step 2; -broadcast: after
                    broadcast_optimizer_state (which replaces the param groups)
  average-one-rank  rank 0 alone calls average_models() after step 2 (AdamW, local residual)
  two-optimizers-unused  one backward feeds two optimizers; a parameter of one unused on rank 1
  groups-differ     rank 1's param groups hold the parameters the other way round (same lr)
  broadcast-outside-group  torch only: broadcast_parameters over a group of rank 0, from root 1
  resume-gathered   every rank's state gathered on rank 0 and saved with its model; every rank
                    loads that one file and continues exactly (SGD; AdamW, local residual)
  usage             step(closure) against backward + step(); SGD(maximize=True, weight_decay)
                    under the default recipe against torch's SGD; SparseAdam with sparse_as_dense
  broadcast-object  broadcast_object of a value on rank 0 and None on the others, no name given
  resume-every      the default recipe (warm-up, planned buckets): the state saved before every
                    step, loaded into a fresh model and optimizer, continues exactly as the
                    run that was not interrupted; -broadcast: loaded then shared with
                    lags_hvd.broadcast_optimizer_state; -rank0: loaded on rank 0 only
"""

import argparse
import io
import json
import os
import signal
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # backend, also when imported by a test
import backend  # noqa: E402
import models  # noqa: E402
from backend import hvd  # noqa: E402

torch.set_num_threads(1)
STEPS = 5
TIMEOUT = 4.0  # exchange_timeout of the stall scenario, seconds
OUT = "."  # the --out folder (main sets it): the scenarios' files
STALL = 14.0  # how long rank 1 sleeps there
LATE = 3.0  # how long rank 0 stays in backward in freeze-one-late
JOIN_BATCHES = [3, 5, 4]  # batches per rank before hvd.join() (uneven inputs)
REFUSED_ALIKE = {
    *("density-mismatch", "clip-mismatch", "bad-option", "groups-differ"),  # at construction
    *("lr-differs", "scaler-differs", "lr-one-rank", "lr-one-rank-broadcast", "unfreeze", "freeze-one"),
}
"""Refused on every rank at a point where the ranks' collectives are in step: while the
optimizer is built, once the settings' collective has completed, or by the step check, once
every rank has started the iteration's exchanges and the check has completed. The launch
goes on with the next scenario when every rank raised (one allgather of the flags says so;
else the launch ends)."""


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


def resumed_on_rank_0(build, broadcast):
    """Horovod's resume pattern: 3 steps with ``build(model)``'s optimizer, saved; a fresh
    model and optimizer, rank 0 alone loads, the parameters and ``broadcast`` (the optimizer
    state) from rank 0. Returns the fresh model and optimizer."""
    model = models.make_model()
    optimizer = build(model)
    train(model, optimizer, 3)
    buffer = io.BytesIO()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
    model, optimizer = models.make_model(seed=7), None
    optimizer = build(model)
    if hvd.rank() == 0:
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    broadcast(optimizer, root_rank=0)
    return model, optimizer


def resume(broadcast):
    model, optimizer = resumed_on_rank_0(optimizer_for, broadcast)
    train(model, optimizer, 3, first=3)
    return {
        "params": params_of(model),
        "iteration": optimizer.lags_state.iteration,
        "momentum": sorted(len(s) for s in optimizer.state.values()),
    }


def fresh_horovod():
    model = models.make_model()
    optimizer = optimizer_for(model)
    import horovod.torch as horovod  # Horovod's own function, not lags_hvd's

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
            if scenario in ("freeze-one", "freeze-one-late") and hvd.rank() == 1:
                model.shift.requires_grad_(False)
            if scenario == "freeze-one-late" and hvd.rank() == 0:  # conv's gradient comes last
                model.conv.weight.register_hook(lambda grad: time.sleep(LATE))
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


def uneven(aggregation):
    """Horovod's pattern for uneven inputs: hvd.join() when out of batches, then share the
    result of the last rank to join; one more step together shows the ranks in step."""
    model = models.make_model()
    optimizer = optimizer_for(model, aggregation=aggregation, exchange_timeout=60.0, monitor_every=2)
    train(model, optimizer, JOIN_BATCHES[hvd.rank()])
    at_join = {
        "params_at_join": params_of(model),
        "iteration_at_join": optimizer.lags_state.iteration,
        "residuals": {n: r.double().tolist() for n, r in optimizer.lags_state.residuals.state_dict().items()},
    }
    last = hvd.join()
    hvd.broadcast_parameters(model.state_dict(), root_rank=last)
    hvd.broadcast_optimizer_state(optimizer, root_rank=last)
    train(model, optimizer, 1, first=max(JOIN_BATCHES))
    return {**at_join, "last": last, "params": params_of(model), "iteration": optimizer.lags_state.iteration}


def join_stall():
    model = models.make_model()
    optimizer = optimizer_for(model, exchange_timeout=TIMEOUT)
    train(model, optimizer, 2)
    if hvd.rank() == 1:
        time.sleep(STALL)
    hvd.join()
    return {}


def lr_one_rank(broadcast: bool):
    model = models.make_model()
    optimizer = optimizer_for(model, exchange_timeout=60.0)
    if broadcast:  # the step check reads the groups the broadcast put in place, not the first ones
        hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    for step in range(STEPS):
        if step == 2 and hvd.rank() == 1:
            optimizer.param_groups[0]["lr"] /= 2
        train(model, optimizer, 1, first=step)
    return {"finished": True}


def average_one_rank():
    """Rank 0 alone calls average_models() after step 2 (AdamW, the local residual)."""
    model = models.make_model()
    base = torch.optim.AdamW(model.parameters(), lr=0.01)
    optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), exchange_timeout=60.0)
    for step in range(STEPS):
        train(model, optimizer, 1, first=step)
        if step == 2 and hvd.rank() == 0:
            optimizer.average_models()
    return {"finished": True}


def two_optimizers_unused():
    """One backward pass feeds two optimizers, one per layer of the same shape; the second
    layer is unused on rank 1, so there its optimizer's check and exchange start after the
    first's, where rank 0 starts them before: on the torch backend the checks cross."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict(
        {"first": torch.nn.Linear(5, 5, bias=False), "second": torch.nn.Linear(5, 5, bias=False)}
    )
    optimizers = [
        hvd.DistributedOptimizer(
            torch.optim.SGD(layer.parameters(), lr=0.1),
            named_parameters=[(f"{name}.weight", layer.weight)],
            density=0.2,
            recipe="paper",
            exchange_timeout=30.0,
        )
        for name, layer in model.items()
    ]
    for step in range(STEPS):
        for optimizer in optimizers:
            optimizer.zero_grad()
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
        h = model["first"](x)
        (h if hvd.rank() == 1 else model["second"](h)).square().mean().backward()
        for optimizer in optimizers:
            optimizer.step()
    return {"finished": True}


def groups_differ():
    """The same hyper-parameters, the parameters split into the two groups the other way round on rank 1."""
    model = models.make_model()
    first = [model.conv.weight, model.conv.bias]
    rest = [p for p in model.parameters() if all(p is not q for q in first)]
    groups = [first, rest] if hvd.rank() == 0 else [rest, first]
    base = torch.optim.SGD([{"params": g} for g in groups], lr=0.1)
    hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), exchange_timeout=30.0)
    return {}


def broadcast_outside_group():
    """A group of rank 0 only: rank 1, outside it, broadcasts over it; rank 0 from root 1."""
    import torch.distributed as dist

    import lags_hvd.distributed as lags

    group = dist.new_group([0])
    model = models.make_model()
    lags.broadcast_parameters(model.state_dict(), root_rank=1, process_group=group)
    return {}


def usage():
    """Three patterns at once: step(closure), maximize, sparse_as_dense with SparseAdam."""
    closure_model, plain_model = models.make_model(), models.make_model()
    closure_optimizer, plain_optimizer = optimizer_for(closure_model), optimizer_for(plain_model)
    losses = []
    for step in range(3):

        def closure(step=step):
            closure_optimizer.zero_grad()
            loss = models.loss_of(closure_model, hvd.rank(), step)
            loss.backward()
            return loss

        losses.append(closure_optimizer.step(closure).item())
        train(plain_model, plain_optimizer, 1, first=step)
    # maximize with weight decay: the bias (1-D: dense under the default recipe) gets the same
    # gradient on every rank, so it must follow torch's own SGD bit for bit
    torch.manual_seed(0)
    weight, bias = torch.nn.Parameter(torch.randn(8, 8)), torch.nn.Parameter(torch.randn(8))
    reference = bias.detach().clone().requires_grad_()
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=0.1, maximize=True)
    maximizing = hvd.DistributedOptimizer(
        torch.optim.SGD([weight, bias], **hyper), density=0.05, named_parameters=[("weight", weight), ("bias", bias)]
    )
    plain = torch.optim.SGD([reference], **hyper)
    for step in range(10):
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(10 * step + hvd.rank()))
        y = torch.randn(8, generator=torch.Generator().manual_seed(step))
        maximizing.zero_grad()
        ((weight * x).sum() + (bias * y).sum()).backward()
        maximizing.step()
        plain.zero_grad()
        (reference * y).sum().backward()
        plain.step()
    embedding = torch.nn.Embedding(20, 4, sparse=True)
    adam = hvd.DistributedOptimizer(
        torch.optim.SparseAdam(embedding.parameters(), lr=0.1),
        density=0.2,
        named_parameters=embedding.named_parameters(),
        sparse_as_dense=True,
    )
    for step in range(3):
        adam.zero_grad()
        embedding(torch.tensor([step, 2 * step + hvd.rank()])).sum().backward()
        adam.step()
    return {
        "closure": params_of(closure_model),
        "plain": params_of(plain_model),
        "losses": losses,
        "maximize": bias.tolist(),
        "torch_maximize": reference.tolist(),
        "momentum_correction": maximizing.lags_state.velocities is not None,
        "sparse_adam": embedding.weight.detach().flatten().tolist(),
        "sparse_grad": embedding.weight.grad.is_sparse,
    }


RESUME_STEPS, RESUME_OPTIONS = (
    8,
    dict(
        recipe="dgc",
        buckets="auto",
        density_warmup=3,
        bucket_warmup=2,
        exchange_timeout=60.0,
        network_profile={
            "world_size": 2,
            "allgather": {"alpha": 0.05, "beta": 1e-9},  # start-ups dominate:
            "allreduce": {"alpha": 0.05, "beta": 1e-9},
        },
    ),
)  # one plan, every time


def resume_every(how):
    """The state before every step of an uninterrupted run, resumed in a fresh model and
    optimizer (``how``: "load" on every rank, "broadcast" after loading on every rank, or
    "rank0": loaded on rank 0 only, then broadcast): what differs from the uninterrupted run."""
    model = models.make_model()
    optimizer = optimizer_for(model, **RESUME_OPTIONS)
    saved = []
    for step in range(RESUME_STEPS):
        buffer = io.BytesIO()
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, buffer)
        saved.append(buffer)
        train(model, optimizer, 1, first=step)
    final = {
        "params": params_of(model),
        "buckets": optimizer.lags_state.buckets(),
        "residuals": optimizer.lags_state.residuals.state_dict(),
    }
    differences = {}
    for start in range(1, RESUME_STEPS):
        resumed = models.make_model(seed=7)
        resumed_optimizer = optimizer_for(resumed, **RESUME_OPTIONS)
        if how != "rank0" or hvd.rank() == 0:
            saved[start].seek(0)
            state = torch.load(saved[start], weights_only=True)
            resumed.load_state_dict(state["model"])
            resumed_optimizer.load_state_dict(state["optimizer"])
        if how != "load":
            hvd.broadcast_parameters(resumed.state_dict(), root_rank=0)
            hvd.broadcast_optimizer_state(resumed_optimizer, root_rank=0)
        planned = resumed_optimizer.buckets_settled
        train(resumed, resumed_optimizer, RESUME_STEPS - start, first=start)
        outcome = {
            "planned at load": planned,
            "buckets": resumed_optimizer.lags_state.buckets() == final["buckets"],
            "params": params_of(resumed) == final["params"],
        }
        if how == "rank0":  # rank 1's residuals start from zero: in step with rank 0, not exact
            outcome["params"] = params_of(resumed)
        else:
            residuals = resumed_optimizer.lags_state.residuals.state_dict()
            outcome["residuals"] = residuals.keys() == final["residuals"].keys() and all(
                torch.equal(residuals[name], final["residuals"][name]) for name in residuals
            )
        differences[start] = outcome
    return {"resumed": differences, "plan_iteration": optimizer.bucket_history[0]["iteration"]}


def adamw_local_optimizer(model):
    base = torch.optim.AdamW(model.parameters(), lr=0.01, eps=1e-3, weight_decay=0.1)
    options = dict(density=models.DENSITY, recipe="paper", adam_correction=True, local_residual=True)
    return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), **options)


def resume_gathered():
    """Save on rank 0, load everywhere: after 3 steps every rank's state gathered on rank 0
    (``gathered_state_dict``) and written with rank 0's model to one file, which every rank
    loads into a fresh model and optimizer; 3 steps more of it against the run that went on.
    Under the default recipe with SGD (momentum correction) and under AdamW with the local
    residual (each rank's parameters hold its residual)."""
    builds = {"sgd": lambda model: optimizer_for(model, **RESUME_OPTIONS), "adamw-local": adamw_local_optimizer}
    path = os.path.join(OUT, f"gathered.{hvd.size()}.pt")
    results = {}
    for label, build in builds.items():
        model = models.make_model()
        optimizer = build(model)
        train(model, optimizer, 3)
        gathered = optimizer.gathered_state_dict(root_rank=0)
        if hvd.rank() == 0:
            torch.save({"model": model.state_dict(), "optimizer": gathered}, path)
        else:
            assert gathered is None
        hvd.barrier()
        resumed = models.make_model(seed=7)
        resumed_optimizer = build(resumed)
        state = torch.load(path, weights_only=True)
        resumed.load_state_dict(state["model"])
        resumed_optimizer.load_state_dict(state["optimizer"])
        hvd.barrier()  # every rank read the file before the next build writes it
        for run in ((model, optimizer), (resumed, resumed_optimizer)):
            train(*run, 3, first=3)
        residuals = optimizer.lags_state.residuals.state_dict()
        resumed_residuals = resumed_optimizer.lags_state.residuals.state_dict()
        results[label] = {
            "params": params_of(resumed) == params_of(model),
            "own params": params_of(model),
            "residuals": residuals.keys() == resumed_residuals.keys()
            and all(torch.equal(resumed_residuals[n], r) for n, r in residuals.items()),
            "residuals nonzero": any(r.any() for r in residuals.values()),
            "iteration": resumed_optimizer.lags_state.iteration,
        }
    return results


def resume_local():
    """Horovod's resume pattern under ``local_residual``: each rank's parameters and residual
    after ``broadcast_optimizer_state`` and after 3 steps more, and the consensus each rank
    then holds (parameters plus residual)."""

    model, optimizer = resumed_on_rank_0(adamw_local_optimizer, hvd.broadcast_optimizer_state)
    residuals = optimizer.lags_state.residuals
    after_broadcast = {
        "params": params_of(model),
        "residuals zero": all(not r.any() for r in residuals.state_dict().values()),
    }
    train(model, optimizer, 3, first=3)
    eps = residuals.state_dict()
    consensus = {
        n: (p.detach().flatten() + eps[n]).double().tolist() if n in eps else p.detach().double().flatten().tolist()
        for n, p in model.named_parameters()
    }
    return {
        "after broadcast": after_broadcast,
        "params": params_of(model),
        "consensus": consensus,
        "iteration": optimizer.lags_state.iteration,
    }


def run(scenario, sets):
    if scenario == "resume-lags":
        return resume(hvd.broadcast_optimizer_state)
    if scenario == "resume-local":
        return resume_local()
    if scenario == "resume-horovod":
        import horovod.torch as horovod  # Horovod's own function, not lags_hvd's

        return resume(horovod.broadcast_optimizer_state)
    if scenario == "fresh-horovod":
        return fresh_horovod()
    if scenario.startswith("process-set"):
        return process_set(sets)
    if scenario == "density-mismatch":
        optimizer_for(models.make_model(), density=0.0016 if hvd.rank() == 0 else 0.003)
        return {}
    if scenario == "clip-mismatch":  # one rank would clip the merged gradient, the other not
        optimizer_for(models.make_model(), max_grad_norm=0.25 if hvd.rank() == 0 else None)
        return {}
    if scenario.startswith("lr-differs"):  # -broadcast: aligned by broadcast_optimizer_state, as Horovod's
        model = models.make_model()  # test_broadcast_state_options does
        optimizer = optimizer_for(model, lr=0.2 if hvd.rank() == 1 else 0.1, exchange_timeout=60.0)
        if scenario.endswith("-broadcast"):
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
        train(model, optimizer, STEPS)
        return {"params": params_of(model), "lr": optimizer.param_groups[0]["lr"]}
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
    if scenario == "join-stall":
        return join_stall()
    if scenario.startswith("join"):
        return uneven("reduce_scatter" if scenario.endswith("-rs") else "allgather")
    if scenario.startswith("lr-one-rank"):
        return lr_one_rank(broadcast=scenario.endswith("-broadcast"))
    if scenario == "average-one-rank":
        return average_one_rank()
    if scenario == "two-optimizers-unused":
        return two_optimizers_unused()
    if scenario == "groups-differ":
        return groups_differ()
    if scenario == "broadcast-outside-group":
        return broadcast_outside_group()
    if scenario == "usage":
        return usage()
    if scenario == "resume-gathered":
        return resume_gathered()
    if scenario == "broadcast-object":  # Horovod's default name was the object's type: None vs str
        return {"received": hvd.broadcast_object("from rank 0" if hvd.rank() == 0 else None, root_rank=0)}
    if scenario.startswith("resume-every"):
        return resume_every(scenario.removeprefix("resume-every").removeprefix("-") or "load")
    return stepping(scenario)


LEAVES_AT_EXIT = {"freeze-one-late"}
"""Scenarios whose failing ranks leave as a worker with an uncaught error does: the exit
handlers run, Horovod's shutdown among them (torch.distributed registers none). The others'
children end by ``os._exit``, like a process that dies."""

SETS = {"process-set-two": [[0], [1]], "process-set-one": [[0]]}
"""The process sets a scenario defines at ``hvd.init`` (so it runs forked)."""


def recorded(scenario, sets) -> bool:
    """Run ``scenario``, write this rank's record; whether it raised."""
    started = time.monotonic()
    try:
        result, error = run(scenario, sets), None
    except Exception as raised:  # recorded for the test, then the rank fails
        result, error = {}, {"type": type(raised).__name__, "message": str(raised)}
    result.update(error=error, seconds=time.monotonic() - started)
    with open(os.path.join(OUT, f"{scenario}.{hvd.rank()}.json"), "w") as f:
        json.dump(result, f)
    return error is not None


def in_turn(scenarios):
    """The scenarios in order in this process, Horovod initialised once."""
    if SETS.keys() & set(scenarios):
        raise SystemExit("a process-set scenario defines the process sets at init: run it with --fork")
    hvd.init()
    for scenario in scenarios:
        stop = recorded(scenario, None)  # the scenarios after it do not run: the workers may be out of step
        if scenario in REFUSED_ALIKE:
            refused = hvd.allgather_object(stop)
            stop = any(refused) and not all(refused)
        if stop:
            time.sleep(2)  # let the other ranks write their records before the launcher ends the job
            os._exit(3)
    hvd.barrier()
    hvd.shutdown()


def alone(scenario: str, name: str) -> int:
    """A forked child's life: initialise, run ``scenario`` as a launch of it alone would, the
    exit status that launch's worker would end with."""
    sets = [hvd.ProcessSet(ranks) for ranks in SETS.get(scenario, [])] or None
    backend.init_in_fork(sets, name)
    if recorded(scenario, sets):
        if scenario in LEAVES_AT_EXIT and backend.BACKEND != "torch":
            hvd.shutdown()  # what the interpreter's exit runs (Horovod registers it with atexit)
        return 3
    hvd.barrier()
    hvd.shutdown()
    return 0


def forked(scenarios, bound: float = 120.0):
    """Each scenario in a child forked from this process, which never initialises: scenarios
    that leave the ranks out of step, or end a rank, share one launch. This process writes the
    child's exit status to ``<scenario>.<rank>.exit`` (-9: killed after ``bound`` seconds) and
    starts the next scenario once every rank's child of this one has ended."""
    rank, size = backend.launched()
    for index, scenario in enumerate(scenarios):
        child = os.fork()
        if child == 0:  # never returns to this loop
            try:
                status = alone(scenario, f"{index}-{scenario}")
            except BaseException:
                traceback.print_exc()
                status = 4
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        deadline = time.monotonic() + bound
        while (ended := os.waitpid(child, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if ended[0] == 0:
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        status = os.waitstatus_to_exitcode(ended[1]) if ended[0] else -9
        with open(os.path.join(OUT, f"{scenario}.{rank}.exit"), "w") as f:
            f.write(str(status))
        while not all(os.path.exists(os.path.join(OUT, f"{scenario}.{r}.exit")) for r in range(size)):
            if time.monotonic() > deadline + bound:
                raise SystemExit(f"rank {rank}: the other ranks' children of {scenario} did not end")
            time.sleep(0.05)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenarios", required=True, help="comma-separated, run in order in these workers")
    parser.add_argument("--fork", action="store_true", help="each scenario in a forked child (Gloo, torchrun)")
    args = parser.parse_args()
    global OUT
    OUT = args.out
    (forked if args.fork else in_turn)(args.scenarios.split(","))


if __name__ == "__main__":
    main()
