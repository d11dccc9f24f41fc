"""The Adam study's simulated workers (lags_hvd.experiments.adam_study) against torch's AdamW."""

import copy

import pytest
import torch

from lags_hvd.experiments import adam_study

SMALL = dict(width=16, seq_len=8, batch_size=2, steps=5, steps_per_epoch=5, density_warmup=0)


def train(settings, vocab=11, steps=5):
    """``settings``' workers, and a plain copy of their first model trained by AdamW on the
    mean of the workers' losses (dense data parallelism, independently)."""
    workers = adam_study.Workers(settings, vocab)
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
        workers.step(step, lr)
        adamw.zero_grad()
        for group in adamw.param_groups:
            group["lr"] = lr
        (sum(losses) / len(losses)).backward()
        adamw.step()
    return workers, reference


@pytest.mark.parametrize(
    "rule,workers,density",
    [("dense", 2, 0.001), ("local", 1, 1.0), ("consensus", 1, 1.0)],
)
def test_whole_tensors_are_adamw_on_the_mean_gradient(rule, workers, density):
    """dense at P = 2; every rule at P = 1 with nothing sparse (moments of the one worker). The
    mean of two gradients rounds apart from the gradient of the mean loss, and Adam divides a
    near-zero gradient by its own size: 2e-5 is under 1% of one step (lr 0.003)."""
    simulated, reference = train(adam_study.Settings(rule=rule, workers=workers, density=density, **SMALL))
    for p, q in zip(simulated.models[0].parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=2e-5)


def test_the_local_rule_keeps_each_worker_at_the_consensus_less_its_residual():
    """x_p + eps_p is the consensus on every worker, and the workers differ (they are sparse)."""
    simulated, _ = train(adam_study.Settings(rule="local", workers=2, density=0.05, **SMALL))
    for i, x in enumerate(simulated.consensus):
        for p, params in enumerate(simulated.params):
            torch.testing.assert_close(params[i].detach() + simulated.residual[p][i], x)
    assert any(not torch.equal(a, b) for a, b in zip(*simulated.params))
