"""Data-parallel methods for Adam on the Transformer suite's GPT, P workers simulated in one process.

    python -m lags_hvd.experiments.adam_study [--methods dense lags lags:density=0.004 ...]
        [--steps 1200] [--steps-per-epoch 200] [--seeds 42] [--device cuda] [--out FILE]

The study behind docs/convergence.md's "where the remaining gap comes from" and
docs/convergence-adam.md's frontier: a method's mathematics on the suite's model, data,
schedule and seeds, without processes or a network, so that a variant costs one run (minutes
on a GPU) rather than a multi-process suite. It is not the optimizer: ``make
convergence-transformer`` is the verdict. At its settings (1,200 steps, seed 42) this study
gives dense 5.544 and the default (``lags``) 5.973, where the suite's processes gave 5.543
and 5.968.

A method is named ``name`` or ``name:key=value,...``; ``adam_methods`` has the methods, their
equations and their options (``lags:density=0.004,residual_scale=0.5``,
``zero-one:variance_scaler=4,freeze=400``, ``demo:topk=8``, ``diloco:every=50``,
``sparseloco:every=20,topk=64``, ``powersgd:rank=4``). Each worker reads its own half of the
text (as the suite's ranks do). Reported: the validation perplexity of the workers' mean
model after every epoch, and the traffic: the 4-byte words one worker sent over all steps
against dense's (warm-ups and the tensors sent whole count too).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import time
from pathlib import Path

import torch
from torch import nn

from . import data
from .adam_methods import Method, parse_method
from .models import CharGPT

__all__ = ["Settings", "Workers", "method_for", "run", "main"]


class Settings(argparse.Namespace):
    """The Transformer suite's: width 128, 2 blocks, context 128, batch 16 per worker, AdamW
    (lr 0.003, betas 0.9/0.999, eps 1e-8, decay 0.01), half an epoch's linear warm-up, cosine
    decay to 0 at the last step; ``method`` as in the module docstring."""

    method = "lags"
    workers = 2
    steps = 1200
    steps_per_epoch = 200
    lr = 0.003
    betas = (0.9, 0.999)
    eps = 1e-8
    weight_decay = 0.01
    batch_size = 16
    seq_len = 128
    width = 128
    seed = 42
    device = "cpu"


def lr_at(settings: Settings, step: int) -> float:
    """train.py's schedule: linear warm-up over half an epoch, then a cosine decay to 0."""
    warmup = max(1, round(0.5 * settings.steps_per_epoch))
    progress = min(1.0, max(0, step - warmup) / max(1, settings.steps - warmup))
    return settings.lr * min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * progress))


class Workers:
    """P copies of the GPT (the same initial model) and the mean model's validation perplexity."""

    def __init__(self, settings: Settings, vocab: int):
        self.s = settings
        torch.manual_seed(settings.seed)
        first = CharGPT(vocab, settings.width, layers=2, heads=4, context=settings.seq_len)
        self.models = [first] + [
            CharGPT(vocab, settings.width, 2, 4, settings.seq_len) for _ in range(1, settings.workers)
        ]
        for model in self.models:
            model.load_state_dict(first.state_dict())
            model.to(settings.device)
        self.params = [list(model.parameters()) for model in self.models]  # [worker][tensor]

    @torch.no_grad()
    def mean_model_perplexity(self, tokens: torch.Tensor) -> float:
        model = CharGPT(self.models[0].token.num_embeddings, self.s.width, 2, 4, self.s.seq_len).to(self.s.device)
        for target, *copies in zip(model.parameters(), *self.params):
            target.copy_(torch.stack([c.detach() for c in copies]).mean(0))
        model.eval()
        total, count = 0.0, 0
        for x, y in data.char_batches(tokens, 16, self.s.seq_len, 0, 1):
            logits, _ = model(x.to(self.s.device))
            total += float(
                nn.functional.cross_entropy(logits.flatten(0, 1), y.to(self.s.device).flatten(), reduction="sum")
            )
            count += y.numel()
        return math.exp(total / count)


def method_for(settings: Settings, workers: Workers) -> Method:
    cls, options = parse_method(settings.method)
    return cls(workers.params, settings, options)


def run(settings: Settings, text: tuple[str, str] | None = None) -> dict:
    """Train ``settings.steps`` steps; the curve of the mean model's validation perplexity."""
    train_text, val_text = text or data.shakespeare()
    vocab = data.CharVocab(train_text)
    train_tokens, val_tokens = vocab.encode(train_text), vocab.encode(val_text)
    available = (len(train_tokens) // settings.workers - 1) // (settings.batch_size * settings.seq_len)
    if settings.steps_per_epoch > available:
        raise ValueError(
            f"{settings.steps_per_epoch} steps per epoch, but each of {settings.workers} workers' share of "
            f"the text holds {available} batches: lower --steps-per-epoch"
        )
    workers = Workers(settings, len(vocab))
    method = method_for(settings, workers)
    curve, started, step = [], time.perf_counter(), 0
    for _ in range(math.ceil(settings.steps / settings.steps_per_epoch)):  # each epoch from its slice's start
        shards = [
            data.char_batches(train_tokens, settings.batch_size, settings.seq_len, p, settings.workers)
            for p in range(settings.workers)
        ]
        for batches in itertools.islice(zip(*shards), min(settings.steps_per_epoch, settings.steps - step)):
            for model, (x, y) in zip(workers.models, batches):
                model.zero_grad(set_to_none=False)
                logits, _ = model(x.to(settings.device))
                nn.functional.cross_entropy(logits.flatten(0, 1), y.to(settings.device).flatten()).backward()
            method.step(step, lr_at(settings, step))
            step += 1
        curve.append((step, workers.mean_model_perplexity(val_tokens)))
    numel = sum(x.numel() for x in workers.params[0])
    return {
        "settings": {k: getattr(settings, k) for k in vars(Settings) if not k.startswith("_")},
        "curve": curve,
        "perplexity": curve[-1][1],
        "words_vs_dense": method.words / (numel * settings.steps),
        "seconds": time.perf_counter() - started,
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--methods", nargs="+", default=["dense", "lags"], help="name or name:key=value,...")
    parser.add_argument("--seeds", nargs="+", type=int, default=[Settings.seed])
    for name in ("workers", "steps", "steps_per_epoch"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(Settings, name))
    parser.add_argument("--lr", type=float, default=Settings.lr)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="JSON of every run")
    args = parser.parse_args(argv)
    for spec in args.methods:
        parse_method(spec)  # a misspelt option fails before the first run, not after an hour
    text, results = data.shakespeare(), []
    for seed in args.seeds:
        for spec in args.methods:
            settings = Settings(**{k: v for k, v in vars(args).items() if k != "methods"}, method=spec, seed=seed)
            result = run(settings, text)
            results.append(result)
            if args.out:  # first: a run whose output pipe is gone keeps its result
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=1))
            curve = " ".join(f"{p:.2f}" for _, p in result["curve"])
            print(
                f"seed {seed} {spec}: perplexity {result['perplexity']:.3f}  traffic "
                f"{result['words_vs_dense']:.4f} of dense  ({result['seconds']:.0f} s; per epoch {curve})",
                flush=True,
            )
    return results


if __name__ == "__main__":
    main()
