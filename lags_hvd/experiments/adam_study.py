"""Sparse Adam rules on the Transformer suite's GPT, P workers simulated in one process.

    python -m lags_hvd.experiments.adam_study [--rules dense local consensus] [--steps 1200]
        [--steps-per-epoch 200] [--density 0.001] [--density-warmup 200] [--average-every 0]
        [--seeds 42] [--device cuda] [--out FILE]

The study behind docs/convergence.md's "where the remaining gap comes from": the rules'
mathematics on the suite's model, data, schedule and seeds, without processes or a network,
so that a variant costs one run (minutes on a GPU) rather than a multi-process suite. It is
not the optimizer: ``make convergence-transformer`` is the verdict. At its settings (1,200
steps, seed 42) this study gives dense 5.544 and the default (rule "local") 5.973, where the
suite's processes gave 5.543 and 5.968.

Each worker p holds a model x_p, Adam's moments m_p, v_p of its own gradients and a
residual eps_p. Per step t, each tensor with two or more dimensions (the recipe sends 1-D
ones whole) and each worker, selecting per tensor where the suite's default selects over
its planned buckets (several tensors each; the outcome above is as close anyway)::

    u_p   = lr_t * m_p / (1 - b1^t) / (sqrt(v_p / (1 - b2^t)) + eps)   Adam's step, g_p at x_p
    s_p   = TopK(eps_p + u_p, k_t),  k_t = ceil(density_t * n)          DGC's density warm-up
    eps_p = eps_p + u_p - s_p
    x     = x (1 - lr_t wd) - (1/P) sum_p s_p                            the consensus
    x_p   = x - c eps_p     (rule "local", c = --residual-scale: LocalAdamCorrection)
          = x               (rule "consensus": AdamCorrection)

A tensor sent whole takes Adam on the mean gradient with moments shared by every worker; rule
"dense" sends every tensor whole (AdamW on the mean gradient: dense data parallelism).
``--average-every N`` puts every worker on the mean model each N steps and zeroes the
residuals (``average_models()``, dense traffic each time). Reported: the validation
perplexity of the workers' mean model after every epoch (the training script averages the
models before its last evaluation), and the traffic: the 4-byte words each worker sent over
all steps against dense's (a sparse entry is a value and an index; the density warm-up and
the 1-D tensors count too).

``--echo`` (a variant of the study, not of the optimizer): each worker also sends its values,
without indices, at the positions the other workers chose in the step before, so that a
position one worker sent is flushed from every worker's residual one step later.
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

from ..density import k_for_density, warmup_density
from . import data
from .models import CharGPT

__all__ = ["Settings", "run", "main"]

RULES = ("dense", "local", "consensus")


class Settings(argparse.Namespace):
    """The Transformer suite's: width 128, 2 blocks, context 128, batch 16 per worker, AdamW
    (lr 0.003, betas 0.9/0.999, eps 1e-8, decay 0.01), half an epoch's linear warm-up, cosine
    decay to 0 at the last step; the default recipe's density warm-up (200 steps from 0.25)."""

    rule = "local"
    workers = 2
    steps = 1200
    steps_per_epoch = 200
    density = 0.001
    density_warmup = 200
    density_warmup_start = 0.25
    residual_scale = 1.0
    average_every = 0
    echo = False
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
    """P models of the GPT and the rule's state, one step at a time."""

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
        self.consensus = [p.detach().clone() for p in self.params[0]]
        zeros = lambda: [[torch.zeros_like(p) for p in self.consensus] for _ in self.models]  # noqa: E731
        self.exp_avg, self.exp_avg_sq, self.residual = zeros(), zeros(), zeros()
        self.t = 0
        self.words = 0  # 4-byte words each worker sent, over all steps: a value, or an index
        self.last_chosen: list[list[torch.Tensor] | None] = [None] * len(self.consensus)  # echo

    def step(self, step: int, lr: float) -> None:
        """One commit: every worker's gradient is in its parameters' ``.grad``."""
        s, self.t = self.s, self.t + 1
        correction1, correction2 = 1 - s.betas[0] ** self.t, 1 - s.betas[1] ** self.t
        density = warmup_density(step, s.density, s.density_warmup_start, s.density_warmup)
        for i, x in enumerate(self.consensus):
            grads = [params[i].grad for params in self.params]
            if s.rule == "dense" or x.dim() == 1:  # Adam on the mean gradient, moments shared
                self.words += x.numel()
                m, v = self.exp_avg[0][i], self.exp_avg_sq[0][i]
                denominator = _adam_moments_(m, v, torch.stack(grads).mean(0), s.betas, correction2, s.eps)
                x.mul_(1 - lr * s.weight_decay).addcdiv_(m, denominator, value=-lr / correction1)
                for params in self.params:
                    params[i].data.copy_(x)
                continue
            k = k_for_density(density, x.numel())
            last = self.last_chosen[i] if s.echo else None
            self.words += 2 * k  # (value, index) per entry, each worker
            if last is not None:  # and values at the others' last positions: everyone knows those
                self.words += sum(c.numel() for c in last[1:])
            merged, chosen_now = torch.zeros_like(x), []
            for p, g in enumerate(grads):
                m, v, eps = self.exp_avg[p][i], self.exp_avg_sq[p][i], self.residual[p][i]
                denominator = _adam_moments_(m, v, g, s.betas, correction2, s.eps)
                eps.addcdiv_(m, denominator, value=lr / correction1)  # eps + u
                chosen = torch.topk(eps.abs().flatten(), k, sorted=False).indices
                chosen_now.append(chosen)
                if last is not None:
                    chosen = torch.unique(torch.cat([chosen, *(c for q, c in enumerate(last) if q != p)]))
                sent = eps.flatten()[chosen]
                merged.view(-1).index_add_(0, chosen, sent / s.workers)
                eps.view(-1).index_fill_(0, chosen, 0.0)
            self.last_chosen[i] = chosen_now
            x.mul_(1 - lr * s.weight_decay).sub_(merged)
            local = s.residual_scale if s.rule == "local" else 0.0
            for p, params in enumerate(self.params):
                params[i].data.copy_(x - local * self.residual[p][i] if local else x)

    def average(self, counted: bool = True) -> None:
        """Every worker on the mean model, the residuals zeroed (``average_models()``); its
        traffic ``counted`` in ``words`` (the one after the last step is not). Only the local
        rule's workers differ: under the others every worker holds the consensus already."""
        if self.s.rule != "local":
            return
        for i, x in enumerate(self.consensus):
            self.words += x.numel() if counted else 0
            x.copy_(torch.stack([params[i].detach() for params in self.params]).mean(0))
            for p, params in enumerate(self.params):
                params[i].data.copy_(x)
                self.residual[p][i].zero_()

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


def _adam_moments_(m, v, g, betas, correction2: float, eps: float) -> torch.Tensor:
    """Adam's moments of ``g`` updated in place; the step's denominator ``sqrt(v / (1 - b2^t)) + eps``."""
    beta1, beta2 = betas
    m.mul_(beta1).add_(g, alpha=1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    return (v / correction2).sqrt_().add_(eps)


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
            workers.step(step, lr_at(settings, step))
            step += 1
            if settings.average_every and step % settings.average_every == 0:
                workers.average()
        if step == settings.steps:
            workers.average(counted=False)
        curve.append((step, workers.mean_model_perplexity(val_tokens)))
    numel = sum(x.numel() for x in workers.consensus)
    return {
        "settings": {k: getattr(settings, k) for k in vars(Settings) if not k.startswith("_")},
        "curve": curve,
        "perplexity": curve[-1][1],
        "words_vs_dense": workers.words / (numel * settings.steps),
        "seconds": time.perf_counter() - started,
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rules", nargs="+", default=["dense", "local"], choices=RULES)
    parser.add_argument("--seeds", nargs="+", type=int, default=[Settings.seed])
    for name in ("workers", "steps", "steps_per_epoch", "density_warmup", "average_every"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(Settings, name))
    for name in ("density", "residual_scale", "lr"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=float, default=getattr(Settings, name))
    parser.add_argument("--echo", action="store_true", help="also send the values at the others' last positions")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--out", type=Path, help="JSON of every run")
    args = parser.parse_args(argv)
    text, results = data.shakespeare(), []
    for seed in args.seeds:
        for rule in args.rules:
            settings = Settings(**{**vars(args), "rule": rule, "seed": seed})
            result = run(settings, text)
            results.append(result)
            curve = " ".join(f"{p:.2f}" for _, p in result["curve"])
            print(
                f"seed {seed} {rule:>9}: perplexity {result['perplexity']:.3f}  traffic "
                f"{result['words_vs_dense']:.4f} of dense  ({result['seconds']:.0f} s; per epoch {curve})",
                flush=True,
            )
            if args.out:
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
