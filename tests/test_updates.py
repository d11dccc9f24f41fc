"""The update rules (lags_hvd.updates) in one process: the pure Adam step, density 1 against
torch's own AdamW, and Adam correction against the numpy oracle (tests/oracle.py)."""

import functools
import math

import models
import numpy as np
import oracle
import pytest
import torch

from lags_hvd.updates import AdamCorrection, ErrorFeedback, LocalAdamCorrection, MomentumCorrection
from lags_hvd.updates.adam_correction import adam_step_


def test_adam_step_is_torchs_adam_step():
    gen = torch.Generator().manual_seed(0)
    m, v = torch.randn(50, generator=gen), torch.rand(50, generator=gen)
    out = torch.empty(50)
    adam_step_(m, v, out, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, step=3)
    expected = 0.01 / (1 - 0.9**3) * m / (v.sqrt() / math.sqrt(1 - 0.99**3) + 1e-8)
    torch.testing.assert_close(out, expected)
    adam_step_(m, v, v, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, step=3)  # in place over its input
    torch.testing.assert_close(v, expected)


def test_each_rule_keeps_the_memories_it_names():
    assert ErrorFeedback().memories == () and not ErrorFeedback.steps_itself
    assert MomentumCorrection.masked == ("velocities",) and MomentumCorrection.steps_itself
    assert AdamCorrection.memories == ("exp_avg", "exp_avg_sq") and AdamCorrection.masked == ()
    assert LocalAdamCorrection.memories == AdamCorrection.memories and LocalAdamCorrection.local_models
    assert not AdamCorrection.local_models


def adamw(model, **kw):
    return torch.optim.AdamW(model.parameters(), lr=0.01, betas=(0.9, 0.99), weight_decay=0.1, **kw)


def train(model, optimizer, steps, step_index=0):
    for t in range(step_index, step_index + steps):
        optimizer.zero_grad()
        models.loss_of(model, 0, t).backward()
        optimizer.step()


@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("recipe", ["paper", "dgc"])
def test_at_density_1_adam_correction_is_torchs_adamw(hvd, recipe, local):
    """Every bucket sent whole: Adam on the merged gradient, torch's AdamW step for step, also
    across the re-bucketing of ``buckets="auto"`` (the step applies the iteration's merge before
    the new buckets take over) and with ``local_residual`` (nothing sparse, nothing kept)."""
    reference, model = models.make_model(), models.make_model()
    train(reference, adamw(reference), 8)
    optimizer = hvd.DistributedOptimizer(
        adamw(model),
        named_parameters=model.named_parameters(),
        density=1.0,
        adam_correction=None if local and recipe == "dgc" else True,  # local_residual=True asks for it
        local_residual=local,
        recipe=recipe,
        **({"density_warmup": 0, "bucket_warmup": 2} if recipe == "dgc" else {}),
    )
    assert optimizer.update_rule["rule"] == ("adam_correction_local" if local else "adam_correction")
    train(model, optimizer, 8)
    assert recipe == "paper" or optimizer.buckets_settled
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize("local", [False, True])
@pytest.mark.parametrize("decoupled", [True, False])
def test_adam_correction_matches_the_oracle_in_one_process(hvd, decoupled, local):
    assert_matches_the_adam_oracle(hvd.DistributedOptimizer, decoupled, local)


def assert_matches_the_adam_oracle(wrap, decoupled: bool, local: bool, device: str = "cpu") -> None:
    """Every layer per layer at density 0.1 (conv.weight whole, fc.bias one entry), AdamW or
    Adam with its L2 decay, the residual in the parameters or not, the model on ``device``
    and wrapped by ``wrap`` (a front-end's DistributedOptimizer): parameters and residuals
    against ``oracle.AdamCorrected`` / ``LocalAdamCorrected``, then ``average_models()``. eps
    is 1e-3: with a tiny eps Adam's first step is lr * sign(g) on every entry, all ties for top-k."""
    model = models.make_model().to(device)
    base = torch.optim.AdamW if decoupled else torch.optim.Adam
    optimizer = wrap(
        base(model.parameters(), lr=0.01, betas=(0.9, 0.99), eps=1e-3, weight_decay=0.1),
        named_parameters=model.named_parameters(),
        density=models.DENSITY,
        layer_densities=models.LAYER_DENSITIES,
        recipe="paper",
        adam_correction=True,
        local_residual=local,
    )
    assert optimizer.update_rule["rule"] == ("adam_correction_local" if local else "adam_correction")
    reference = (oracle.LocalAdamCorrected if local else oracle.AdamCorrected)(
        1, 0.01, (0.9, 0.99), 1e-3, 0.1, decoupled
    )
    params = {n: p.detach().cpu().numpy().ravel().copy() for n, p in model.named_parameters()}
    k = dict(optimizer.lags_state.k)
    twin = models.make_model()  # the oracle's gradients, at the oracle's parameters
    for t in range(6):
        with torch.no_grad():
            for n, p in twin.named_parameters():
                p.copy_(torch.from_numpy(params[n]).view_as(p))
        grads = [{n: g.numpy().ravel() for n, g in models.gradients(twin, 0, t).items()}]
        params = reference.step_workers([params], grads, k)[0] if local else reference.step(params, grads, k)
        train(model, optimizer, 1, step_index=t)
    for n, p in model.named_parameters():
        np.testing.assert_allclose(p.detach().cpu().numpy().ravel(), params[n], rtol=2e-5, atol=2e-6, err_msg=n)
    for n, r in optimizer.lags_state.residuals.state_dict().items():
        np.testing.assert_allclose(r.cpu().numpy(), reference.residuals[0][n], rtol=2e-5, atol=2e-6, err_msg=n)
    if local:  # one worker: the average is its own model, and the residuals start again from zero
        optimizer.average_models()
        for n, p in model.named_parameters():
            np.testing.assert_allclose(p.detach().cpu().numpy().ravel(), params[n], rtol=2e-5, atol=2e-6, err_msg=n)
        assert all(not r.any() for r in optimizer.lags_state.residuals.state_dict().values())


def adam_corrected(hvd, model, **options):
    return hvd.DistributedOptimizer(
        adamw(model, eps=1e-3),
        named_parameters=model.named_parameters(),
        density=models.DENSITY,
        layer_densities=models.LAYER_DENSITIES,
        **options,
    )


def test_adam_correction_resumes_bit_exact_and_refuses_another_rules_checkpoint(hvd):
    """The moments and the step count travel in state_dict(): a fresh optimizer resumes the
    run bit for bit; a checkpoint of plain error feedback does not load into Adam correction."""
    model = models.make_model()
    optimizer = adam_corrected(hvd, model)  # the default recipe picks Adam correction for AdamW
    assert optimizer.update_rule["rule"] == "adam_correction_local"
    train(model, optimizer, 3)
    saved, weights = optimizer.state_dict(), {n: p.detach().clone() for n, p in model.named_parameters()}
    assert set(saved["lags"]) >= {"exp_avg", "exp_avg_sq", "updates"} and saved["lags"]["updates"] == 3
    train(model, optimizer, 3, step_index=3)
    resumed = models.make_model()
    with torch.no_grad():
        for n, p in resumed.named_parameters():
            p.copy_(weights[n])
    again = adam_corrected(hvd, resumed)
    again.load_state_dict(saved)
    train(resumed, again, 3, step_index=3)
    for (n, p), q in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(p, q), n
    plain = adam_corrected(hvd, models.make_model(), adam_correction=False)
    with pytest.raises(ValueError, match="rule='adam_correction_local' there, 'error_feedback' here"):
        plain.load_state_dict(saved)
    consensus = adam_corrected(hvd, models.make_model(), local_residual=False)  # its parameters mean another thing
    with pytest.raises(
        ValueError, match="rule='adam_correction_local' there, 'adam_correction' here.*local_residual=True"
    ):
        consensus.load_state_dict(saved)


def run_adam(hvd, steps=6, passes=1, seed=0, **options):
    """TinyNet under Adam correction (AdamW), per layer at density 0.1 unless ``options`` say
    otherwise, ``passes`` backward passes per step on halves of the loss: its parameters."""
    model = models.make_model(seed)
    optimizer = adam_corrected(
        hvd, model, backward_passes_per_step=passes, **{"recipe": "paper", "adam_correction": True, **options}
    )
    for t in range(steps):
        optimizer.zero_grad()
        for _ in range(passes):
            (models.loss_of(model, 0, t) / passes).backward()
        optimizer.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}, optimizer


@pytest.mark.parametrize("local", [False, True])
def test_adam_correction_composes_with_accumulation_aggregations_clips_and_planned_buckets(hvd, local):
    """Accumulating two half-losses is one whole loss; reduce_scatter on one worker is the
    allgather; the local clip and the merged clip take effect (under Adam correction the merge
    is the step, so max_grad_norm bounds the step's norm); planned buckets carry the moments;
    with the residual in the parameters or not."""
    run = functools.partial(run_adam, local_residual=local)
    plain, _ = run(hvd)
    accumulated, _ = run(hvd, passes=2)
    split, _ = run(hvd, aggregation="reduce_scatter")
    for n in plain:
        torch.testing.assert_close(accumulated[n], plain[n], rtol=1e-5, atol=1e-6, msg=n)
        torch.testing.assert_close(split[n], plain[n], rtol=1e-5, atol=1e-6, msg=n)
    start = {n: p.detach() for n, p in models.make_model(0).named_parameters()}
    moved = lambda params: sum(float((params[n] - start[n]).norm() ** 2) for n in params) ** 0.5  # noqa: E731
    clipped, optimizer = run(hvd, steps=1, max_grad_norm=1e-4)
    assert float(optimizer.grad_norm) > 1e-4 and moved(clipped) < moved(run(hvd, steps=1)[0])
    clipped_locally, _ = run(hvd, local_clip=1e-6)
    assert all(torch.isfinite(p).all() for p in clipped_locally.values())
    assert moved(clipped_locally) != pytest.approx(moved(plain))
    planned, optimizer = run(hvd, steps=14, recipe="dgc", density_warmup=2, bucket_warmup=2)
    assert optimizer.buckets_settled and optimizer.update_rule["rule"] == (
        LocalAdamCorrection.name if local else "adam_correction"
    )
    memories = optimizer.lags_state.rule_memories
    assert set(memories) == {"exp_avg", "exp_avg_sq"} and all(
        memory.registered == {u.name for u in optimizer.lags_state.units} for memory in memories.values()
    )
    assert all(torch.isfinite(p).all() for p in planned.values())


def test_average_models_refuses_inside_an_iteration_and_zeroes_the_residuals_after_it(hvd):
    """Between synchronize() and step() the residuals are this iteration's and the parameters
    not yet stepped: refused, nothing changed. After step() (one process: the average is the
    model itself) the residuals are zero and the parameters hold what they held."""
    model = models.make_model()
    optimizer = adam_corrected(hvd, model, recipe="paper", adam_correction=True, local_residual=True)
    train(model, optimizer, 2)
    optimizer.zero_grad()
    models.loss_of(model, 0, 2).backward()
    optimizer.synchronize()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(RuntimeError, match="inside an iteration"):
        optimizer.average_models()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    with optimizer.skip_synchronize():
        optimizer.step()
    stepped = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert any(
        optimizer.lags_state.residuals.state_dict()[n].any() for n in optimizer.lags_state.residuals.state_dict()
    )
    optimizer.average_models()
    assert not any(r.any() for r in optimizer.lags_state.residuals.state_dict().values())
    assert all(torch.equal(p, stepped[n]) for n, p in model.named_parameters())
