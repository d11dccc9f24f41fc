"""The Adam study's simulated workers (lags_hvd.experiments.adam_study): dense and LAGS against
torch's AdamW and a numpy step (the anchors' oracles are in test_adam_methods.py)."""

import argparse
import copy
import math

import numpy as np
import pytest
import torch

from lags_hvd.experiments import adam_study
from lags_hvd.experiments import train as training_script

SMALL = dict(width=16, seq_len=8, batch_size=2, steps=5, steps_per_epoch=5)


def train(settings, vocab=11, steps=5):
    """``settings``' workers, and a plain copy of their first model trained by AdamW on the
    mean of the workers' losses (dense data parallelism, independently)."""
    workers = adam_study.Workers(settings, vocab)
    method = adam_study.method_for(settings, workers)
    reference = copy.deepcopy(workers.models[0])
    adamw = torch.optim.AdamW(
        reference.parameters(),
        lr=settings.lr,
        betas=settings.betas,
        eps=settings.eps,
        weight_decay=settings.weight_decay,
    )
    gen = torch.Generator().manual_seed(0)
    for step in range(steps):
        batches = [
            torch.randint(0, vocab, (2, settings.batch_size, settings.seq_len), generator=gen) for _ in workers.models
        ]
        losses = []
        for model, (x, y) in zip(workers.models, batches):
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(x)[0].flatten(0, 1), y.flatten()).backward()
            losses.append(torch.nn.functional.cross_entropy(reference(x)[0].flatten(0, 1), y.flatten()))
        lr = adam_study.lr_at(settings, step)
        method.step(step, lr)
        adamw.zero_grad()
        for group in adamw.param_groups:
            group["lr"] = lr
        (sum(losses) / len(losses)).backward()
        adamw.step()
    return workers, method, reference


def lags(rule: str, density: float, **options) -> str:
    return f"lags:rule={rule},density={density},density_warmup=0" + "".join(f",{k}={v}" for k, v in options.items())


@pytest.mark.parametrize("method,workers", [("dense", 2), (lags("local", 1.0), 1), (lags("consensus", 1.0), 1)])
def test_whole_tensors_are_adamw_on_the_mean_gradient(method, workers):
    """dense at P = 2; every rule at P = 1 with nothing sparse (moments of the one worker). The
    mean of two gradients rounds apart from the gradient of the mean loss, and Adam divides a
    near-zero gradient by its own size: 2e-5 is under 1% of one step (lr 0.003)."""
    simulated, _, reference = train(adam_study.Settings(method=method, workers=workers, **SMALL))
    for p, q in zip(simulated.models[0].parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=2e-5)


def test_the_local_rule_keeps_each_worker_at_the_consensus_less_its_residual():
    """x_p + eps_p is the consensus on every worker, and the workers differ (they are sparse)."""
    simulated, method, _ = train(adam_study.Settings(method=lags("local", 0.05), workers=2, **SMALL))
    for i, x in enumerate(method.consensus):
        for p, params in enumerate(simulated.params):
            torch.testing.assert_close(params[i].detach() + method.residual[p][i], x)
    assert any(not torch.equal(a, b) for a, b in zip(*simulated.params))


def test_the_schedule_is_the_training_scripts():
    settings = adam_study.Settings(steps=1200, steps_per_epoch=200)
    script = training_script.lr_multiplier(argparse.Namespace(warmup_epochs=0.5, epochs=6, schedule="cosine"), 200)
    for step in (0, 50, 99, 100, 101, 600, 1199):
        assert adam_study.lr_at(settings, step) == pytest.approx(settings.lr * script(step), rel=1e-12)


def test_one_sparse_step_at_two_workers_is_the_docstrings_equations():
    """The first step at P = 2, density 0.05, recomputed in numpy from the workers' gradients:
    the consensus, each residual, each worker's model, and the words sent. eps 1e-3 keeps
    Adam's first step from being lr * sign(g) everywhere (all ties for top-k)."""
    settings = adam_study.Settings(method=lags("local", 0.05), workers=2, eps=1e-3, **SMALL)
    workers = adam_study.Workers(settings, 11)
    method = adam_study.method_for(settings, workers)
    start = [x.numpy().copy() for x in method.consensus]
    gen = torch.Generator().manual_seed(1)
    for model in workers.models:
        x, y = torch.randint(0, 11, (2, settings.batch_size, settings.seq_len), generator=gen)
        torch.nn.functional.cross_entropy(model(x)[0].flatten(0, 1), y.flatten()).backward()
    grads = [[p.grad.numpy().copy() for p in params] for params in workers.params]
    lr, wd = 0.01, settings.weight_decay
    method.step(0, lr)
    words = 0
    for i, x0 in enumerate(start):
        decayed = x0 * (1 - lr * wd)
        if x0.ndim == 1:  # Adam's first step on the mean gradient: lr g / (|g| + eps)
            g = (grads[0][i] + grads[1][i]) / 2
            expected, residuals, words = decayed - lr * g / (np.abs(g) + settings.eps), [0, 0], words + x0.size
        else:
            k = math.ceil(0.05 * x0.size)
            steps = [(lr * g[i] / (np.abs(g[i]) + settings.eps)).ravel() for g in grads]
            sent = [np.zeros_like(u) for u in steps]
            for u, s in zip(steps, sent):
                top = np.argsort(-np.abs(u), kind="stable")[:k]
                s[top] = u[top]
            expected = decayed - ((sent[0] + sent[1]) / 2).reshape(x0.shape)
            residuals = [(u - s).reshape(x0.shape) for u, s in zip(steps, sent)]
            words += 2 * k
        np.testing.assert_allclose(method.consensus[i].numpy(), expected, rtol=1e-5, atol=1e-7)
        for p in range(2):
            np.testing.assert_allclose(method.residual[p][i].numpy(), residuals[p], rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(
                workers.params[p][i].detach().numpy(), expected - residuals[p], rtol=1e-5, atol=1e-7
            )
    assert method.words == words


def test_too_many_steps_per_epoch_for_the_text_is_refused():
    settings = adam_study.Settings(method="dense", workers=2, **{**SMALL, "steps_per_epoch": 50})
    with pytest.raises(ValueError, match="holds 2 batches: lower --steps-per-epoch"):
        adam_study.run(settings, ("abcdefghij" * 8, "abcdefghij" * 4))
