"""Train a model with dense S-SGD, TopK-SGD or LAGS-SGD on real data, on P workers.

    horovodrun -np 2 -H localhost:2 python -m lags_hvd.experiments.train --dataset fashion-mnist --model cnn
    horovodrun -np 4 -H localhost:4 python -m lags_hvd.experiments.train --dataset shakespeare --model char_lstm \\
        --method lags --density adaptive --clip 0.25
    torchrun --nproc-per-node 2 -m lags_hvd.experiments.train --backend torch --dataset fashion-mnist

``--backend`` picks the communication (``backend``: Horovod, or torch.distributed's Gloo
under torchrun); everything else is the same. Left out, it follows the launcher: torch under
torchrun (with a note), else Horovod; one that does not fit the launcher is refused on every
rank (Horovod under torchrun would see each worker as a job of its own).

Each rank trains on its own shard. Learning rate: linear warm-up over
``--warmup-epochs`` (the paper uses 5), then multiplied by ``--decay-factor`` at
each of ``--decay-epochs``. LAGS comes with the library's default recipe (``--recipe
dgc``: planned buckets, density warm-up, 1-D parameters dense, momentum correction);
``--recipe paper`` is the paper's Algorithm 1. ``--clip`` clips the gradient norm
the way the recipe does: with ``dgc``, each worker's gradient before selection
(DGC's local clip, ``local_clip``); with ``paper`` and for dense and TopK-SGD, the
merged gradient after ``synchronize()``, as in the paper's LSTM runs (``--merged-clip``
asks for that under ``dgc``; with ``--clip-feedback`` LAGS clips inside
``synchronize()`` and keeps what the clip removes in the residuals). Rank 0 shows a progress bar,
evaluates every epoch (test accuracy, or validation perplexity) and appends to
``<out>/metrics.csv`` (with ``--clip``, also the mean gradient norm before clipping and the
fraction of steps it clipped; and TensorBoard when installed). Every rank writes its
checkpoint (model, optimizer with its residuals, scheduler, epoch, RNG states)
atomically at the end of each epoch (``lags_hvd.experiments.checkpoint``, with its
checksum); ``--resume`` continues exactly from the newest epoch every rank saved and can
read, also after a crash, drops the metrics rows of later epochs, and checks that the
ranks' replicated parameters agree before it trains on.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import math
import os
import random
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..collectives import allgather_object
from ..density import ADAPTIVE, check_density
from ..updates import LocalAdamCorrection
from . import data, methods, models
from .adam_methods import MethodOptimizer, parse_method
from .backend import BACKENDS, Backend, LauncherMismatch, default_backend
from .checkpoint import CheckpointDir, checksum, load_newest
from .groups import Collective

__all__ = ["main"]


ADAM_METHOD_ARGS = {  # what --method adam-method reads; any other option given is refused
    *("dataset", "model", "optimizer", "backend", "method", "adam_method", "epochs", "steps_per_epoch"),
    *("batch_size", "lr", "warmup_epochs", "decay_epochs", "schedule", "decay_factor", "weight_decay"),
    *("seq_len", "hidden", "seed", "out", "threads"),
}


def build_parser() -> argparse.ArgumentParser:
    """The command line's arguments, in the groups ``--help`` shows."""
    parser = argparse.ArgumentParser(prog="python -m lags_hvd.experiments.train", description=__doc__.splitlines()[0])
    add_task_arguments(parser.add_argument_group("the task"))
    add_method_arguments(parser.add_argument_group("the method"))
    add_training_arguments(parser.add_argument_group("training"))
    add_clip_arguments(parser.add_argument_group("the gradient clip"))
    add_lags_update_arguments(parser.add_argument_group("lags: the update"))
    add_lags_exchange_arguments(parser.add_argument_group("lags: the exchange"))
    add_run_arguments(parser.add_argument_group("the run"))
    return parser


def add_task_arguments(group) -> None:
    """The data set, the model and its size."""
    group.add_argument("--dataset", choices=["fashion-mnist", "shakespeare", "synthetic"], default="fashion-mnist")
    group.add_argument(
        "--model",
        default="cnn",
        help=f"cnn or resnet20 (fashion-mnist), char_lstm or char_gpt (shakespeare), or any of "
        f"{sorted(models.MODELS)} (synthetic)",
    )
    group.add_argument("--seq-len", type=int, default=64, help="characters per step (shakespeare)")
    group.add_argument("--hidden", type=int, default=256, help="LSTM width (char_lstm), model width (char_gpt)")
    group.add_argument(
        "--test-images", type=int, default=0, help="fashion-mnist: the accuracy over the first N test images (0: all)"
    )


def add_method_arguments(group) -> None:
    """How the workers combine their gradients, and the traffic."""
    group.add_argument(
        "--backend",
        choices=sorted(BACKENDS),
        default=None,
        help="horovod (horovodrun, mpirun) or torch (torch.distributed, under torchrun); default: "
        "the launcher's (torch under torchrun, else horovod)",
    )
    group.add_argument(
        "--method",
        choices=["dense", "topk", "lags", "adam-method", *methods.DDP_METHODS],
        default="lags",
        help="ddp, ddp-powersgd1|4, ddp-lags: DistributedDataParallel with its allreduce, PyTorch's "
        "PowerSGD hook or lags_hvd.ddp's hook given the optimizer (the default recipe; under torchrun); "
        "adam-method: --adam-method's method in place of AdamW",
    )
    group.add_argument(
        "--adam-method",
        help="with --method adam-method and --optimizer adamw: a method of the Adam frontier "
        "(lags_hvd.experiments.adam_methods, e.g. demo:topk=32 or zero-one:variance_scaler=4) over "
        "this rank's model, its traffic in the metrics (words_vs_dense)",
    )
    group.add_argument(
        "--powersgd-start",
        type=int,
        default=1000,
        help="ddp-powersgd*: plain allreduce for this many iterations first (PowerSGD's start_powerSGD_iter)",
    )
    group.add_argument(
        "--density",
        help="a number in (0, 1], or 'adaptive' (lags); default: the library's (0.001, 0.01 under Adam correction)",
    )


def add_training_arguments(group) -> None:
    """The optimizer, the schedule and the budget."""
    group.add_argument(
        "--optimizer",
        choices=["sgd", "adamw"],
        default="sgd",
        help="sgd (with --momentum) or adamw (betas 0.9, 0.999; --weight-decay decoupled)",
    )
    group.add_argument("--epochs", type=int, default=2)
    group.add_argument("--steps-per-epoch", type=int, default=0, help="cap per epoch (0: the whole shard)")
    group.add_argument("--batch-size", type=int, default=32, help="per worker")
    group.add_argument("--lr", type=float, default=0.05)
    group.add_argument("--warmup-epochs", type=float, default=1.0)
    group.add_argument("--decay-epochs", default="", help="comma-separated epochs of step decay")
    group.add_argument(
        "--schedule",
        choices=["step", "cosine"],
        default="step",
        help="after the warm-up: step decay (--decay-epochs) or a cosine decay to 0 at the last step",
    )
    group.add_argument("--decay-factor", type=float, default=0.1)
    group.add_argument("--momentum", type=float, default=0.9)
    group.add_argument("--weight-decay", type=float, default=1e-4)
    group.add_argument("--seed", type=int, default=42)
    group.add_argument("--threads", type=int, default=1, help="torch threads per worker")


def add_clip_arguments(group) -> None:
    """Where --clip applies."""
    group.add_argument(
        "--clip",
        type=float,
        default=0.0,
        help="gradient-norm clip: after synchronize(), or with lags --recipe dgc each "
        "worker's gradient before selection (see --merged-clip, --clip-feedback)",
    )
    group.add_argument(
        "--local-clip",
        action="store_true",
        help="lags: clip each worker's gradient before selection, to the --clip budget",
    )
    group.add_argument(
        "--local-clip-only",
        action="store_true",
        help="lags: DGC's clipping: each worker's gradient clipped before selection to the "
        "--clip budget, and no clip after synchronize()",
    )
    group.add_argument(
        "--merged-clip",
        action="store_true",
        help="lags --recipe dgc: clip the merged gradient after synchronize() instead of each worker's",
    )
    group.add_argument(
        "--clip-feedback",
        action="store_true",
        help="lags: the optimizer clips the merged gradient to --clip (max_grad_norm) and "
        "gives what the clip removes back to the residuals",
    )


def add_lags_update_arguments(group) -> None:
    """Lags's update rule, its density schedule and what it monitors."""
    group.add_argument(
        "--recipe",
        choices=["dgc", "paper"],
        default=None,
        help="lags: the defaults of the options below: 'dgc' (the library's default) or "
        "'paper' (the paper's Algorithm 1: per-layer buckets, no fidelity option)",
    )
    group.add_argument(
        "--density-warmup",
        type=int,
        default=None,
        help="lags: DGC density warm-up over this many steps (0: off; default: the "
        "recipe's, lags_hvd.options.DEFAULT_DENSITY_WARMUP or 0)",
    )
    group.add_argument(
        "--density-warmup-start", type=float, help="lags: the warm-up's first density (default: the update rule's)"
    )
    group.add_argument(
        "--momentum-correction",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="lags: DGC momentum correction (needs --momentum > 0; default: the "
        "recipe's, on with --momentum > 0 under dgc)",
    )
    group.add_argument(
        "--adam-correction",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="lags: error feedback on AdamW's step (needs --optimizer adamw; default: the recipe's, "
        "on with --optimizer adamw under dgc)",
    )
    group.add_argument(
        "--local-residual",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="lags: under Adam correction, each worker's parameters hold its own residual, averaged "
        "before the last evaluation (default: the recipe's, on under Adam correction with dgc)",
    )
    group.add_argument(
        "--dense-params",
        choices=["none", "1d"],
        default=None,
        help="lags: '1d' sends biases and norm parameters dense (default: the recipe's, '1d' under dgc)",
    )
    group.add_argument(
        "--layer-densities",
        default="",
        help="lags: comma-separated name=density pairs overriding --density for those "
        "parameters (e.g. embedding.weight=0.01)",
    )
    group.add_argument("--monitor-every", type=int, default=0, help="measure delta_l every N steps (lags)")


def add_lags_exchange_arguments(group) -> None:
    """Lags's buckets and aggregation."""
    group.add_argument(
        "--buckets",
        default=None,
        help="lags: 'layer' (one exchange per parameter, the paper's), 'auto' (planned from "
        "measured costs) or a number of entries (small parameters merged up to it); "
        "default: the recipe's ('auto'; 'layer' with --recipe paper)",
    )
    group.add_argument(
        "--aggregation",
        choices=["allgather", "reduce_scatter"],
        default="allgather",
        help="lags: how the workers' selections combine (lags_hvd.regions)",
    )
    group.add_argument(
        "--owner-keep",
        type=float,
        default=1.0,
        help="lags with reduce_scatter: the region owners keep this many times k entries",
    )
    group.add_argument(
        "--regional-selection",
        action="store_true",
        help="lags with reduce_scatter: each worker selects its share of k in every region",
    )


def add_run_arguments(group) -> None:
    """Where the run's files go."""
    group.add_argument("--out", default="runs/train", help="metrics, checkpoints, logs")
    group.add_argument("--resume", action="store_true", help="continue from the checkpoints in --out")


def parse_args(argv=None):
    """The command line parsed and checked: what does not fit together is a clear error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    given = [k for k, v in vars(args).items() if v != parser.get_default(k)]  # before any conversion
    check_numbers(parser, args)
    check_method(parser, args, given)
    check_clip(parser, args)
    check_optimizer_and_task(parser, args)
    return args


def check_numbers(parser, args) -> None:
    """Numbers in range, and the options given as text converted: ``--density``, ``--decay-epochs``,
    ``--layer-densities``, ``--buckets``."""
    if args.density == ADAPTIVE:
        if args.method != "lags":
            parser.error("--density adaptive needs --method lags")
    elif args.density is not None:  # None: the library's
        try:
            args.density = check_density(float(args.density), "--density")
        except ValueError:
            parser.error("--density must be a number in (0, 1] or 'adaptive'")
    for name, low in [
        ("epochs", 1),
        ("batch_size", 1),
        ("seq_len", 1),
        ("hidden", 1),
        ("threads", 1),
        ("steps_per_epoch", 0),
        ("test_images", 0),
        ("monitor_every", 0),
        ("density_warmup", 0),
    ]:
        if getattr(args, name) is not None and getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}")
    for name, ok, rule in [
        ("lr", args.lr > 0, "> 0"),
        ("clip", args.clip >= 0, ">= 0"),
        ("warmup_epochs", args.warmup_epochs >= 0, ">= 0"),
        ("momentum", 0 <= args.momentum < 1, "in [0, 1)"),
        ("weight_decay", args.weight_decay >= 0, ">= 0"),
        ("decay_factor", 0 < args.decay_factor <= 1, "in (0, 1]"),
    ]:
        if not ok:  # NaN fails every rule too
            parser.error(f"--{name.replace('_', '-')} must be {rule}, got {getattr(args, name)}")
    try:
        args.decay_epochs = sorted(int(e) for e in args.decay_epochs.split(",") if e.strip())
    except ValueError:
        parser.error(f"--decay-epochs must be comma-separated integers, got {args.decay_epochs!r}")
    args.layer_densities = parse_layer_densities(parser, args)
    if args.buckets not in (None, "layer", "auto"):
        try:
            args.buckets = int(args.buckets)
        except ValueError:
            parser.error(f"--buckets must be 'layer', 'auto' or a number of entries, got {args.buckets!r}")


def check_method(parser, args, given: list[str]) -> None:
    """The method's options fit the method (``given``: the options not left at their defaults);
    lags's recipe defaults to dgc."""
    if (args.method == "adam-method") != (args.adam_method is not None):
        parser.error("--method adam-method and --adam-method SPEC go together")
    if args.adam_method is not None:
        try:
            parse_method(args.adam_method)
        except ValueError as wrong:
            parser.error(f"--adam-method: {wrong}")
        if args.optimizer != "adamw" or args.clip or args.resume or args.density or args.dataset != "shakespeare":
            parser.error(
                "--method adam-method replaces AdamW on --dataset shakespeare: give --optimizer adamw, "
                "no --clip, no --density (the method's options set its traffic) and no --resume "
                "(its state is not checkpointed)"
            )
        ignored = [k for k in given if k not in ADAM_METHOD_ARGS]
        if ignored:
            parser.error(
                f"--{ignored[0].replace('_', '-')} does not apply to --method adam-method: "
                "the method's options go in --adam-method's spec"
            )
    if args.method in methods.DDP_METHODS and (args.backend or default_backend()) != "torch":
        parser.error(f"--method {args.method} runs DistributedDataParallel: give --backend torch (under torchrun)")
    if args.method != "lags":
        for flag, value in [
            ("--buckets", args.buckets),
            ("--recipe", args.recipe),
            ("--merged-clip", args.merged_clip or None),
            ("--density-warmup", args.density_warmup if not args.method.startswith("ddp-lags") else None),
            ("--momentum-correction", args.momentum_correction),
            ("--adam-correction", args.adam_correction),
            ("--local-residual", args.local_residual),
            ("--dense-params", args.dense_params),
        ]:
            if value is not None:
                parser.error(f"{flag} is a lags option: give --method lags")
    args.recipe = args.recipe or "dgc"


def check_clip(parser, args) -> None:
    """One place for the clip: after synchronize(), each worker's (DGC's), or the optimizer's with
    feedback; the dgc recipe's ``--clip`` is each worker's unless told otherwise."""
    if args.merged_clip and not args.clip:
        parser.error("--merged-clip says where the --clip applies: give --clip too")
    if args.merged_clip and (args.recipe != "dgc" or args.local_clip or args.local_clip_only or args.clip_feedback):
        parser.error(
            "--merged-clip replaces --recipe dgc's local clip: not with --recipe paper, --local-clip, "
            "--local-clip-only or --clip-feedback"
        )
    if (
        args.method == "lags"
        and args.recipe == "dgc"
        and args.clip
        and not (args.merged_clip or args.local_clip or args.clip_feedback)
    ):
        args.local_clip_only = True  # the recipe's clip: DGC's, each worker's gradient
    if args.local_clip_only and args.method != "lags":  # else no clip at all would apply
        parser.error("--local-clip-only is lags's local clip: give --method lags")
    if args.local_clip_only and (args.local_clip or args.clip_feedback):
        parser.error(
            "--local-clip-only replaces the clip after synchronize(): not with --local-clip or --clip-feedback"
        )
    if args.local_clip_only:
        args.local_clip = True
    if args.local_clip and not args.clip:
        parser.error("--local-clip splits the --clip budget: give --clip too")
    if args.clip_feedback and not (args.clip and args.method == "lags"):
        parser.error("--clip-feedback is lags's clip of the merged gradient: give --method lags and --clip")


def check_optimizer_and_task(parser, args) -> None:
    """The update's corrections fit the optimizer, the model and ``--test-images`` the data set."""
    if args.momentum_correction and not (args.momentum > 0 and args.optimizer == "sgd"):
        parser.error("--momentum-correction needs --optimizer sgd and --momentum > 0")
    if args.adam_correction and args.optimizer != "adamw":
        parser.error("--adam-correction needs --optimizer adamw")
    if args.local_residual and (args.optimizer != "adamw" or args.adam_correction is False):
        parser.error("--local-residual applies under Adam correction: give --optimizer adamw")
    valid_models = {
        "fashion-mnist": ["cnn", "resnet20"],
        "shakespeare": ["char_lstm", "char_gpt"],
        "synthetic": sorted(models.MODELS),
    }[args.dataset]
    if args.model not in valid_models:
        parser.error(f"--model for --dataset {args.dataset}: one of {', '.join(valid_models)}; got {args.model!r}")
    if args.test_images and args.dataset != "fashion-mnist":
        parser.error("--test-images counts fashion-mnist's test images: give --dataset fashion-mnist")
    if args.test_images > data.FASHION_MNIST_TEST_IMAGES:
        parser.error(
            f"--test-images: fashion-mnist has {data.FASHION_MNIST_TEST_IMAGES:,} test images, got {args.test_images}"
        )


def parse_layer_densities(parser, args) -> dict[str, float]:
    """``--layer-densities name=d,...`` as a dict (names are checked by the optimizer)."""
    pairs = [item.strip() for item in args.layer_densities.split(",") if item.strip()]
    if pairs and args.method != "lags":
        parser.error("--layer-densities is lags's per-parameter density: give --method lags")
    if pairs and args.density == ADAPTIVE:
        parser.error("--layer-densities overrides a fixed --density, not 'adaptive'")
    densities = {}
    for item in pairs:
        name, _, value = item.partition("=")
        try:
            densities[name.strip()] = check_density(float(value), f"--layer-densities {name.strip()}")
        except ValueError:
            parser.error(f"--layer-densities: each item is name=density with a density in (0, 1]; got {item!r}")
    return densities


# ---------------------------------------------------------------------- tasks
class ClassificationTask:
    def __init__(self, args, backend: Backend):
        self.backend = backend
        if args.dataset == "fashion-mnist":
            self.train_x, self.train_y, self.test_x, self.test_y = data.fashion_mnist()
            if args.test_images:
                self.test_x, self.test_y = self.test_x[: args.test_images], self.test_y[: args.test_images]
            factory = {"cnn": models.FashionCNN, "resnet20": lambda: models.resnet20(in_channels=1)}
            self.model = factory[args.model]()
        else:  # the paper's models on a synthetic batch of their shapes (image or language)
            self.model, (x, y), _ = models.build(args.model, args.batch_size, seed=args.seed)
            self.train_x, self.train_y = x.repeat(8, *[1] * (x.dim() - 1)), y.repeat(8, *[1] * (y.dim() - 1))
            self.test_x, self.test_y = self.train_x[: len(x)], self.train_y[: len(x)]
        self.args = args

    def logits(self, x):
        out = self.model(x)
        return out[0] if isinstance(out, tuple) else out  # language models return (logits, state)

    def steps_per_epoch(self) -> int:
        return len(self.train_x) // self.backend.size // self.args.batch_size

    def batches(self, epoch: int):
        mine = data.shard(len(self.train_x), self.backend.rank, self.backend.size, epoch, self.args.seed)
        for i in range(0, len(mine) - self.args.batch_size + 1, self.args.batch_size):
            idx = mine[i : i + self.args.batch_size]
            yield self.train_x[idx], self.train_y[idx]

    def loss(self, batch):
        return nn.functional.cross_entropy(self.logits(batch[0]).flatten(0, -2), batch[1].flatten())

    @torch.no_grad()
    def evaluate(self) -> dict:
        """Accuracy over the test set (per token for language models)."""
        self.model.eval()
        n = len(self.test_x)
        mine = torch.arange(self.backend.rank, n, self.backend.size)
        correct = sum(
            int((self.logits(self.test_x[mine[i : i + 500]]).argmax(-1) == self.test_y[mine[i : i + 500]]).sum())
            for i in range(0, len(mine), 500)
        )
        self.model.train()
        totals = self.backend.allreduce(
            torch.tensor([correct, self.test_y[mine].numel()], dtype=torch.float64), "eval.accuracy"
        )
        return {"test_accuracy": float(totals[0] / totals[1])}


class CharLMTask:
    def __init__(self, args, backend: Backend):
        self.backend = backend
        train_text, val_text = data.shakespeare()
        self.vocab = data.CharVocab(train_text)
        self.train_tokens, self.val_tokens = self.vocab.encode(train_text), self.vocab.encode(val_text)
        if args.model == "char_gpt":
            self.model = models.CharGPT(len(self.vocab), args.hidden, layers=2, heads=4, context=args.seq_len)
        else:
            self.model = models.LSTMLanguageModel(len(self.vocab), args.hidden, 2)
        self.args = args
        self.state = None

    def steps_per_epoch(self) -> int:
        per_rank = len(self.train_tokens) // self.backend.size
        return (per_rank - 1) // (self.args.batch_size * self.args.seq_len)

    def batches(self, epoch: int):
        self.state = None
        yield from data.char_batches(
            self.train_tokens, self.args.batch_size, self.args.seq_len, self.backend.rank, self.backend.size
        )

    def loss(self, batch):
        if self.state is not None:
            self.state = tuple(s.detach() for s in self.state)  # truncated BPTT
        logits, self.state = self.model(batch[0], self.state)
        return nn.functional.cross_entropy(logits.flatten(0, 1), batch[1].flatten())

    @torch.no_grad()
    def evaluate(self) -> dict:
        self.model.eval()
        total, count, state = 0.0, 0, None
        for x, y in data.char_batches(self.val_tokens, 16, self.args.seq_len, self.backend.rank, self.backend.size):
            logits, state = self.model(x, state)
            total += float(nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="sum"))
            count += y.numel()
        self.model.train()
        totals = self.backend.allreduce(torch.tensor([total, count], dtype=torch.float64), "eval.perplexity")
        return {"validation_perplexity": math.exp(float(totals[0] / totals[1]))}


# ---------------------------------------------------------------------- pieces
def build_optimizer(args, model, backend: Backend):
    if args.method == "adam-method":
        group = Collective(backend.collectives)
        return MethodOptimizer(model.parameters(), args.adam_method, group, args.lr, args.weight_decay)
    if args.optimizer == "adamw":
        base = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    else:
        base = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay)
    options = (
        {}
        if args.method != "lags"
        else dict(
            recipe=args.recipe,
            monitor_every=args.monitor_every,
            layer_densities=args.layer_densities,
            buckets=args.buckets,
            density_warmup=args.density_warmup,
            density_warmup_start=args.density_warmup_start,
            momentum_correction=args.momentum_correction,
            adam_correction=args.adam_correction,
            local_residual=args.local_residual,
            dense_params=args.dense_params,
            local_clip=args.clip if args.local_clip else None,
            aggregation=args.aggregation,
            max_grad_norm=args.clip if args.clip_feedback else None,
            owner_keep=args.owner_keep,
            regional_selection=args.regional_selection,
        )
    )
    method = "local" if args.method in methods.DDP_METHODS else args.method  # DDP's hook communicates
    return methods.build_optimizer(
        method, base, model.named_parameters(), density=args.density, backend=backend, **options
    )


def lr_multiplier(args, steps_per_epoch: int):
    warmup = max(1, round(args.warmup_epochs * steps_per_epoch))
    total = args.epochs * steps_per_epoch

    def multiplier(step: int) -> float:
        if args.schedule == "cosine":
            decay = 0.5 * (1 + math.cos(math.pi * min(1.0, max(0, step - warmup) / max(1, total - warmup))))
        else:
            decay = args.decay_factor ** sum(step >= e * steps_per_epoch for e in args.decay_epochs)
        return min(1.0, (step + 1) / warmup) * decay

    return multiplier


def resume(checkpoints: CheckpointDir, backend: Backend) -> dict:
    """Load the newest checkpoint every rank has (collective: all ranks agree or all fail)."""
    rounds = itertools.count()  # every collective of the search under a name of its own
    try:
        _, state = load_newest(
            checkpoints, lambda mine: allgather_object(backend.collectives, mine, f"resume.{next(rounds)}")
        )
    except FileNotFoundError as missing:
        raise SystemExit(f"--resume: {missing}") from None
    if state.get("world_size", backend.size) != backend.size and backend.rank == 0:
        print(
            f"--resume: the checkpoint was written by {state['world_size']} workers, this job has "
            f"{backend.size}: LAGS residuals restart from zero",
            flush=True,
        )
    return state


def agree_after_resume(model, optimizer, state: dict, backend: Backend) -> None:
    """Collective, after loading: stop every rank if parameters that all ranks hold alike
    differ (a damage no checksum guarded, or ranks' files from different runs: the ranks would
    train apart for good). Under the local residual a parameter with a residual holds
    ``x - eps_p``, its rank's own, so only the others are compared; and when some rank's
    residuals were reset (another worker count, or rank 0's file read), the ranks' models
    are averaged, else they would differ by residuals that no longer exist, for good."""
    lags = state["optimizer"].get("lags") or {}
    local = getattr(optimizer, "update_rule", {}).get("rule") == LocalAdamCorrection.name
    mine = {
        "reset": bool(lags) and (lags.get("world_size") != backend.size or lags.get("rank") != backend.rank),
        "held": set(lags.get("residuals", ())) if local else set(),
        "params": {name: checksum(p) for name, p in model.named_parameters()},
    }
    ranks = allgather_object(backend.collectives, mine, "resume.agree")
    held = set().union(*(r["held"] for r in ranks))
    differ = {
        rank: [n for n, digest in r["params"].items() if n not in held and digest != ranks[0]["params"].get(n)]
        for rank, r in enumerate(ranks)
    }
    if any(differ.values()):
        shown = "; ".join(f"rank {rank}: {', '.join(names[:5])}" for rank, names in differ.items() if names)
        raise SystemExit(
            f"--resume: after loading step {state['step']}, parameters that every rank holds alike differ "
            f"from rank 0's ({shown}): a checkpoint changed where no checksum guarded it (saved before "
            f"checksums), or the ranks' files come from different runs. Remove the step-{state['step']} "
            "checkpoints to resume from the one before"
        )
    if local and any(r["reset"] for r in ranks):
        optimizer.average_models()
        if backend.rank == 0:
            print("--resume: residuals reset under the local residual: the ranks' models averaged", flush=True)


def drop_later_rows(metrics_path: Path, epoch: int) -> None:
    """Rank 0, on resume: drop the metrics rows of epochs after ``epoch`` (1-based), written
    before a crash or a damaged checkpoint sent the resume further back, so that each
    epoch keeps one row."""
    try:
        with open(metrics_path, newline="") as f:
            header, *rows = csv.reader(f)
    except (FileNotFoundError, ValueError):  # no rows yet
        return
    kept = [row for row in rows if int(row[header.index("epoch")]) <= epoch]
    if len(kept) < len(rows):
        tmp = metrics_path.with_name(f".{metrics_path.name}.tmp-{os.getpid()}")
        with open(tmp, "w", newline="") as f:
            csv.writer(f).writerows([header, *kept])
        os.replace(tmp, metrics_path)
        print(f"--resume: metrics rows after epoch {epoch} dropped (their epochs run again)", flush=True)


def rng_state() -> dict:
    """Every generator's state in plain types (a numpy array as a tensor), so the
    checkpoint loads with ``weights_only=True``."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": (kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss),
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    kind, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    random.setstate(state["python"])


# ---------------------------------------------------------------------- main
def start_job(args) -> Backend:
    """The backend started (the launcher's unless ``--backend`` names one), the seeds set and
    ``args.json`` written by rank 0."""
    backend = BACKENDS[args.backend or default_backend()]()
    try:
        backend.init()
    except LauncherMismatch as wrong:
        raise SystemExit(str(wrong)) from None
    if args.backend is None and backend.name == "torch" and backend.rank == 0:
        print("under torchrun: --backend torch (torch.distributed over Gloo)", flush=True)
    args.backend = backend.name  # args.json records the backend the job ran on
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    np.random.seed(args.seed)
    if backend.rank == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "args.json").write_text(json.dumps(vars(args), indent=1))
    backend.barrier()
    return backend


def steps_per_epoch(args, task, backend: Backend) -> int:
    """The task's full batches per worker and epoch, at most ``--steps-per-epoch``."""
    steps = task.steps_per_epoch()
    if args.steps_per_epoch:
        steps = min(steps, args.steps_per_epoch)
    if steps < 1:
        raise SystemExit(
            f"rank {backend.rank}: --batch-size {args.batch_size} leaves no full batch per worker "
            f"and epoch on {backend.size} workers: lower --batch-size (or --seq-len)"
        )
    return steps


def restore(args, checkpoints: CheckpointDir, model, optimizer, scheduler, backend: Backend) -> tuple[int, int]:
    """(first epoch, global step): from the newest checkpoint the ranks share under
    ``--resume`` (later metrics rows dropped), else (0, 0) with rank 0's parameters broadcast."""
    if not args.resume:
        backend.broadcast_parameters(model.state_dict(), root_rank=0)
        return 0, 0
    state = resume(checkpoints, backend)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    agree_after_resume(model, optimizer, state, backend)
    if backend.rank == 0:
        drop_later_rows(Path(args.out) / "metrics.csv", state["epoch"] + 1)
    return state["epoch"] + 1, state["step"]


def train_step(args, task, batch, model, optimizer) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One iteration: backward, exchange, clip as asked, step. Returns the loss and the merged
    gradient's norm before clipping where the job clips (None else, or at a skipped step)."""
    optimizer.zero_grad()
    loss = task.loss(batch)
    loss.backward()
    if args.clip_feedback:  # the optimizer clips inside synchronize()
        optimizer.step()
        return loss, optimizer.grad_norm  # None: a skipped (non-finite) step
    if args.clip and not args.local_clip_only:
        if args.method not in methods.DDP_METHODS:  # (DDP averaged the gradients in backward)
            optimizer.synchronize()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)  # read once per epoch
        with optimizer.skip_synchronize() if hasattr(optimizer, "skip_synchronize") else nullcontext():
            optimizer.step()
        return loss, norm
    optimizer.step()
    return loss, None


def train_epoch(args, task, model, optimizer, scheduler, epoch: int, steps: int, backend: Backend):
    """``steps`` iterations of ``epoch`` (a progress bar on rank 0): each step's loss, the
    clip's norms and the samples all ranks saw. The losses stay on the device until the epoch
    ends (on a GPU each read waits for the stream); the bar reads one per refresh."""
    losses, norms, seen, started = [], [], 0, time.perf_counter()
    shown = started  # when the bar last showed a loss
    progress = None
    if backend.rank == 0:
        from tqdm import tqdm

        progress = tqdm(
            total=steps,
            desc=f"epoch {epoch + 1}/{args.epochs}",
            unit="step",
            leave=False,
            mininterval=0.1 if sys.stderr.isatty() else 10.0,
        )
    for batch in itertools.islice(task.batches(epoch), steps):
        loss, norm = train_step(args, task, batch, model, optimizer)
        if norm is not None:
            norms.append(norm)
        scheduler.step()
        losses.append(loss.detach())
        seen += len(batch[0]) * backend.size
        if progress is not None:
            progress.update(1)
            if (now := time.perf_counter()) - shown >= progress.mininterval:
                shown = now
                progress.set_postfix(loss=f"{losses[-1].item():.3f}", samples_s=f"{seen / (now - started):.0f}")
    if progress is not None:
        progress.close()
    return torch.stack(losses).tolist() if losses else [], norms, seen


def optimizer_columns(args, optimizer, norms: list) -> dict:
    """The clip's mean norm and how often it bit, and what the optimizer sent."""
    row = {}
    if norms:  # the merged gradient's norm before clipping, and how often the clip bit
        norms = torch.stack(norms)
        row["grad_norm"] = float(norms.mean())
        row["clipped_fraction"] = float((norms > args.clip).double().mean())
    if hasattr(optimizer, "lags_state"):
        row["average_density"] = optimizer.lags_state.average_density()
    if isinstance(optimizer, MethodOptimizer):
        row["words_vs_dense"] = optimizer.words_vs_dense()
    return row


def write_metrics(out: Path, row: dict, step: int, writer) -> None:
    """Rank 0: ``row`` appended to metrics.csv (a resumed run keeps the file's columns), to
    TensorBoard where it is installed, and printed."""
    metrics_path = out / "metrics.csv"
    new = not metrics_path.exists() or metrics_path.stat().st_size == 0
    columns = list(row)
    if not new:  # a resumed run keeps the columns its file began with
        with open(metrics_path, newline="") as f:
            columns = next(csv.reader(f))
    with open(metrics_path, "a", newline="") as f:
        csv_writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        if new:
            csv_writer.writeheader()
        csv_writer.writerow(row)
    if writer is not None:
        for key, value in row.items():
            writer.add_scalar(key, value, step)
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def tensorboard_writer(out: Path):
    """A TensorBoard writer into ``out``/tensorboard, None where TensorBoard is not installed."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(str(out / "tensorboard"))


def main(argv=None):
    args = parse_args(argv)
    backend = start_job(args)
    out = Path(args.out)
    try:
        task = CharLMTask(args, backend) if args.dataset == "shakespeare" else ClassificationTask(args, backend)
    except data.DataMissing as missing:
        raise SystemExit(f"rank {backend.rank}: {missing}") from None
    model = task.model  # the module itself (its state is checkpointed; the LAGS hook's is the optimizer's)
    optimizer = build_optimizer(args, model, backend)
    if args.method in methods.DDP_METHODS:  # the task trains through DDP
        task.model, _ = methods.build_ddp(
            args.method,
            model,
            optimizer,
            density=args.density,
            powersgd_start=args.powersgd_start,
            density_warmup=args.density_warmup,
        )
    steps = steps_per_epoch(args, task, backend)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_multiplier(args, steps))
    checkpoints = CheckpointDir(out, backend.rank)
    start_epoch, global_step = restore(args, checkpoints, model, optimizer, scheduler, backend)
    writer = tensorboard_writer(out) if backend.rank == 0 else None
    for epoch in range(start_epoch, args.epochs):
        started = time.perf_counter()
        losses, norms, seen = train_epoch(args, task, model, optimizer, scheduler, epoch, steps, backend)
        global_step += len(losses)
        if epoch == args.epochs - 1 and hasattr(optimizer, "average_models"):
            optimizer.average_models()  # under local_residual: the final model is the ranks' average
        train_loss = float(backend.allreduce(torch.tensor(np.mean(losses)), "train.loss", "average"))
        elapsed = time.perf_counter() - started
        row = {
            "epoch": epoch + 1,
            "step": global_step,
            "train_loss": train_loss,
            **task.evaluate(),
            "lr": scheduler.get_last_lr()[0],
            "epoch_seconds": elapsed,
            "samples_per_s": seen / elapsed,
            **optimizer_columns(args, optimizer, norms),
        }
        state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
        state.update(epoch=epoch, step=global_step, rng=rng_state(), world_size=backend.size)
        checkpoints.save(state, global_step)
        if backend.rank == 0:
            write_metrics(out, row, global_step, writer)
            if getattr(optimizer, "assumption_log", None):
                (out / "assumption.json").write_text(json.dumps(optimizer.assumption_log))
    backend.shutdown()


if __name__ == "__main__":
    main()
