"""ddp_worker.py's ``doors`` scenario, under torchrun: the same training through the torchrun
optimizer and through the DDP hook (``lags_hvd.ddp``), which must be one LAGS. ``record``
writes, per case, both doors' parameters and LAGS states after STEPS steps, and DDP's buckets
as the hook saw them.

Cases (every one under the default recipe, through the density warm-up, with the optimizer
door's ``buckets="layer"`` on both sides; TinyNet's ``aux`` unused on rank 1):
  sgd              SGD with momentum and weight decay: momentum correction
  adamw-local      AdamW: Adam correction with the local residual
  adamw            AdamW with ``local_residual=False``
  sgd-rs           SGD with momentum under ``aggregation="reduce_scatter"``
  sgd-unused       ``aux`` unused on every rank at every third step (DDP copies no merge into
                   its ``.grad`` there)
  sgd-kept-grads   the same, ``zero_grad(set_to_none=False)``
  sgd-bucket-view  the same under ``gradient_as_bucket_view=True``, ``fc.weight`` transposed
                   and ``conv`` channels_last (their gradients not row-major in DDP's bucket)
and ``ddp join``: DDP's own ``join()`` in two epochs with the hook at density 1 against plain DDP.
"""

import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models  # noqa: E402

import lags_hvd.distributed as lags  # noqa: E402
from lags_hvd.ddp import LAGSHookState, lags_hook  # noqa: E402

torch.set_num_threads(1)
STEPS = 7
JOIN_BATCHES = [3, 1, 2]  # batches per rank under DDP's join()
BUCKET_MB = 400 / 2**20  # about 100 float32 entries: several DDP buckets for TinyNet
OPTIONS = dict(density=0.1, buckets="layer", density_warmup=4, density_warmup_start=0.5, exchange_timeout=60.0)
CASES = {  # (optimizer, LAGS options, how DDP and the loop run)
    "sgd": ("sgd", {}, {}),
    "adamw-local": ("adamw", {}, {}),
    "adamw": ("adamw", {"local_residual": False}, {}),
    "sgd-rs": ("sgd", {"aggregation": "reduce_scatter"}, {}),
    "sgd-unused": ("sgd", {}, {"sometimes": True}),
    "sgd-kept-grads": ("sgd", {}, {"sometimes": True, "set_to_none": False}),
    "sgd-bucket-view": ("sgd", {}, {"sometimes": True, "gradient_as_bucket_view": True, "laid_out": True}),
}


def base(kind, model):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=models.LR, momentum=models.MOMENTUM, weight_decay=1e-3)
    return torch.optim.AdamW(model.parameters(), lr=0.01, eps=1e-3, weight_decay=0.1)


def snapshot(model, lags_state: dict) -> dict:
    return {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "residuals": {n: r.clone() for n, r in lags_state["residuals"].items()},
        "rule": lags_state["update"]["rule"],
    }


def make_model(laid_out: bool):
    """TinyNet; where ``laid_out``, its ``fc.weight`` transposed (strides (1, rows)) and its
    ``conv`` channels_last (one input channel: contiguous, but its size-1 dimension's stride
    is not row-major's)."""
    model = models.make_model()
    if laid_out:
        model.fc.weight = torch.nn.Parameter(model.fc.weight.detach().t().contiguous().t())
        model.conv.to(memory_format=torch.channels_last)
    return model


def case(name: str) -> dict:
    kind, options, run = CASES[name]
    rank, sometimes, set_to_none = dist.get_rank(), run.get("sometimes", False), run.get("set_to_none", True)
    model = make_model(run.get("laid_out", False))
    optimizer = lags.DistributedOptimizer(base(kind, model), model.named_parameters(), **OPTIONS, **options)
    hooked = make_model(run.get("laid_out", False))
    ddp = DDP(
        hooked,
        bucket_cap_mb=BUCKET_MB,
        find_unused_parameters=True,
        gradient_as_bucket_view=run.get("gradient_as_bucket_view", False),
    )
    hook_optimizer = base(kind, hooked)
    state = LAGSHookState(named_parameters=hooked.named_parameters(), optimizer=hook_optimizer, **OPTIONS, **options)
    buckets = []

    def recording(state, bucket):
        buckets.append(len(bucket.parameters()))
        return lags_hook(state, bucket)

    ddp.register_comm_hook(state, recording)
    for step in range(STEPS):
        for opt, module in ((optimizer, model), (hook_optimizer, ddp)):  # DDP passes use_aux on
            opt.zero_grad(set_to_none=set_to_none)
            x, y = models.batch(rank, step)
            use_aux = models.uses_aux(rank, step, sometimes)
            out = module(x, use_aux=use_aux) if module is model else ddp(x, use_aux)
            torch.nn.functional.mse_loss(out, y).backward()
            opt.step()
    return {
        "optimizer": snapshot(model, optimizer.state_dict()["lags"]),
        "ddp": snapshot(hooked, state.state_dict()),
        "ddp buckets": buckets,
    }


def ddp_join() -> dict:
    """DDP's own ``join()`` for uneven inputs (rank r trains JOIN_BATCHES[r] batches), in two
    epochs: the joined rank's hook gets zero buckets outside any backward and steps nothing,
    and at density 1 the hook's model must be plain DDP's (the joined rank once re-sent its
    last ``.grad``; once refused the next epoch's ``zero_grad()``)."""
    rank, results = dist.get_rank(), {}
    for hooked in (False, True):
        model = models.make_model()
        ddp = DDP(model, find_unused_parameters=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=models.LR)
        if hooked:
            state = LAGSHookState(
                named_parameters=model.named_parameters(), optimizer=optimizer, density=1.0, recipe="paper"
            )
            ddp.register_comm_hook(state, lags_hook)
        for epoch in range(2):
            with ddp.join():
                for step in range(JOIN_BATCHES[rank]):
                    optimizer.zero_grad()
                    x, y = models.batch(rank, 10 * epoch + step)
                    torch.nn.functional.mse_loss(ddp(x), y).backward()
                    optimizer.step()
        results["hook" if hooked else "ddp"] = {n: p.detach().clone() for n, p in model.named_parameters()}
    return results


def record(path: str) -> None:
    """Every case and ``ddp join`` on this rank, saved to ``path``."""
    results = {name: case(name) for name in CASES}
    results["ddp join"] = ddp_join()
    torch.save(results, path)
