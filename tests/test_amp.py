"""Composition with torch.amp (P = 1): GradScaler and bfloat16 autocast on CPU."""

import warnings

import models
import oracle
import pytest
import torch
from torch import nn


def make(hvd, scaler=None, density=0.05, weight_decay=0.0, **options):
    model = models.make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=weight_decay)
    options.setdefault("recipe", "paper")  # the paper's update unless a test asks otherwise
    return model, hvd.DistributedOptimizer(
        base, named_parameters=model.named_parameters(), density=density, grad_scaler=scaler, **options
    )


def loss_of(model, step, autocast):
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        return models.loss_of(model, 0, step)


def scaled_step(model, optimizer, scaler, step, autocast=False):
    """The documented pattern: synchronize, unscale (clipping would go here), step, update."""
    optimizer.zero_grad()
    scaler.scale(loss_of(model, step, autocast)).backward()
    optimizer.synchronize()
    scaler.unscale_(optimizer)
    with optimizer.skip_synchronize():
        scaler.step(optimizer)
    scaler.update()


def plain_step(model, optimizer, step, autocast=False):
    optimizer.zero_grad()
    loss_of(model, step, autocast).backward()
    optimizer.step()


def snapshot(model, optimizer):
    """Parameters, residuals, the SGD's momentum buffers and (momentum correction) the velocities."""
    velocities = optimizer.lags_state.velocities
    return (
        {n: p.detach().clone() for n, p in model.named_parameters()},
        {n: r.clone() for n, r in optimizer.lags_state.residuals.state_dict().items()},
        {
            i: s["momentum_buffer"].clone()
            for i, s in enumerate(optimizer.state.values())
            if s.get("momentum_buffer") is not None
        },
        {n: v.clone() for n, v in velocities.state_dict().items()} if velocities is not None else {},
    )


def assert_same(a, b):
    for part_a, part_b in zip(a, b):
        assert part_a.keys() == part_b.keys()
        for name in part_a:
            assert torch.equal(part_a[name], part_b[name]), (
                f"{name}: differs by up to {(part_a[name] - part_b[name]).abs().max().item():g}"
            )


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_grad_scaler_gives_the_unscaled_run_bit_for_bit(hvd, autocast):
    """Residuals live on unscaled gradients: with power-of-two scales (growing every 2
    steps here) every parameter and residual equals the run without a scaler."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    scaled_model, scaled_opt = make(hvd, scaler)
    plain_model, plain_opt = make(hvd)
    for t in range(6):
        scaled_step(scaled_model, scaled_opt, scaler, t, autocast)
        plain_step(plain_model, plain_opt, t, autocast)
    assert scaler.get_scale() == 2.0**11 and scaled_opt.skipped_steps == 0
    assert_same(snapshot(scaled_model, scaled_opt), snapshot(plain_model, plain_opt))


def test_grad_scaler_under_the_default_recipe_gives_the_unscaled_run_bit_for_bit(hvd):
    """The default recipe with weight decay: momentum correction adds the decay to each
    worker's velocity, so under a GradScaler it joins the gradient times S. With the
    density warm-up ending within the run, per-layer buckets (sparse units and dense 1-D
    ones) and power-of-two scales, every parameter, residual and velocity equals the run
    without a scaler."""
    options = dict(
        recipe="dgc", weight_decay=models.WEIGHT_DECAY, buckets="layer", density_warmup=4, density_warmup_start=0.5
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    scaled_model, scaled_opt = make(hvd, scaler, **options)
    plain_model, plain_opt = make(hvd, **options)
    for t in range(8):
        scaled_step(scaled_model, scaled_opt, scaler, t)
        plain_step(plain_model, plain_opt, t)
    assert scaler.get_scale() == 2.0**12 and scaled_opt.skipped_steps == 0
    assert scaled_opt.lags_state.velocities is not None  # the recipe corrects momentum
    state = scaled_opt.lags_state
    assert {state.k[unit.name] == unit.numel for unit in state.units} == {True, False}  # dense and sparse
    assert_same(snapshot(scaled_model, scaled_opt), snapshot(plain_model, plain_opt))


def test_bf16_autocast_matches_the_oracle(hvd):
    """Parameters stay float32 under autocast; the LAGS math is unchanged (numpy reference)."""
    model, optimizer = make(hvd)
    reference = models.make_model()
    params = {n: p.detach().numpy().copy() for n, p in reference.named_parameters()}
    eps = {n: 0 * v.ravel() for n, v in params.items()}
    sgd = oracle.SGDMomentum(0.1, 0.9)
    for t in range(4):
        plain_step(model, optimizer, t, autocast=True)
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p.copy_(torch.from_numpy(params[n]))
        reference.zero_grad(set_to_none=True)
        loss_of(reference, t, autocast=True).backward()
        for n, p in reference.named_parameters():
            g = p.grad.numpy().ravel()
            avg, (eps[n],) = oracle.lags_round([eps[n] + g], oracle.k_for(0.05, g.size))
            params[n] = sgd.step(n, params[n], avg.reshape(params[n].shape))
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32
        torch.testing.assert_close(p.detach(), torch.from_numpy(params[n]), rtol=1e-6, atol=1e-7)


def test_overflowing_scale_skips_steps_and_touches_nothing(hvd):
    """Scale 2**127 with a loss of order 16 overflows float32: the GradScaler halves the
    scale until the gradients are finite. Those steps change no weight, momentum or
    residual, and raise no warning (overflows are routine with a GradScaler)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)
    model, optimizer = make(hvd, scaler)
    initial = snapshot(model, optimizer)
    overflows = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(20):
            scale = scaler.get_scale()
            optimizer.zero_grad()
            scaler.scale(16 * loss_of(model, 0, False)).backward()
            optimizer.synchronize()
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
            if scaler.get_scale() == scale:
                break
            overflows += 1
            assert_same(snapshot(model, optimizer), initial)
    assert 1 <= overflows == optimizer.skipped_steps
    assert any(not torch.equal(p, initial[0][n]) for n, p in model.named_parameters())


def test_overflow_after_training_leaves_residuals_exactly_as_they_were(hvd):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    model, optimizer = make(hvd, scaler)
    for t in range(3):
        scaled_step(model, optimizer, scaler, t)
    before = snapshot(model, optimizer)
    assert any(r.abs().sum() > 0 for r in before[1].values())
    handle = model.fc.weight.register_hook(lambda g: g * float("inf"))  # one layer overflows
    scaled_step(model, optimizer, scaler, 3)
    handle.remove()
    assert optimizer.skipped_steps == 1 and scaler.get_scale() == 2.0**7
    assert_same(snapshot(model, optimizer), before)
    scaled_step(model, optimizer, scaler, 3)
    assert any(not torch.equal(p, before[0][n]) for n, p in model.named_parameters())


def test_step_without_synchronize_is_refused_with_a_grad_scaler(hvd):
    """scaler.step() would unscale the local, unexchanged gradients: refused, with the fix."""
    scaler = torch.amp.GradScaler("cpu")
    model, optimizer = make(hvd, scaler)
    scaler.scale(loss_of(model, 0, False)).backward()
    with pytest.raises(RuntimeError, match=r"optimizer.synchronize\(\)"):
        scaler.step(optimizer)


@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "fused-sgd"])
@pytest.mark.parametrize("pattern", ["documented", "no-unscale_", "no-synchronize"])
def test_a_grad_scaler_that_was_not_passed_is_refused_before_any_step(hvd, pattern, fused):
    """Without ``grad_scaler=`` the residuals keep the loss scale of the iteration that made
    them and a scale that changes misweighs them (about a quarter of the update over 8 steps,
    silently, before). The optimizer tells GradScaler that its step unscales, so a GradScaler
    stepping it hands ``step()`` its ``found_inf``: refused in every pattern, the model
    untouched and GradScaler's two attributes gone, so a plain ``step()`` still works."""
    model = models.make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
    optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), density=0.05)
    assert optimizer._step_supports_amp_scaling
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    scaler.scale(loss_of(model, 0, False)).backward()
    with pytest.raises(RuntimeError, match="GradScaler is stepping this lags_hvd optimizer, but was not passed"):
        if pattern == "no-synchronize":
            scaler.step(optimizer)
        else:
            optimizer.synchronize()
            if pattern == "documented":
                scaler.unscale_(optimizer)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not {"grad_scale", "found_inf"} & set(vars(optimizer))
    if pattern != "no-synchronize":
        with optimizer.skip_synchronize():
            optimizer.step()
        assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_only_a_fused_optimizer_unscales_in_its_step_once_the_grad_scaler_is_passed(hvd):
    for fused in (False, True):
        model = models.make_model()
        base = torch.optim.SGD(model.parameters(), lr=0.1, fused=fused)
        scaler = torch.amp.GradScaler("cpu")
        optimizer = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), grad_scaler=scaler)
        assert optimizer._step_supports_amp_scaling is fused


def test_grad_scaler_must_be_a_grad_scaler(hvd):
    with pytest.raises(TypeError, match="grad_scaler must be a torch.amp.GradScaler"):
        make(hvd, scaler=object())


@pytest.mark.parametrize("unscale", [False, True], ids=["scaler-unscales-in-step", "unscale_-first"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_a_fused_optimizer_under_a_grad_scaler_gives_the_unfused_run_bit_for_bit(hvd, kind, unscale):
    """``fused=True`` declares that its step unscales: ``GradScaler.step`` then leaves the
    gradients scaled and hands the step ``grad_scale`` and ``found_inf``. The rules that step
    themselves (Adam correction with the local residual, momentum correction) apply them:
    every parameter, residual and rule memory equals the unfused run's, through the density
    warm-up and an overflow that skips a step (once the AdamW ran off to norm 2375)."""
    options = dict(recipe="dgc", buckets="layer", density_warmup=4, density_warmup_start=0.5, density=0.05)

    def build(fused):
        model = models.make_model()
        if kind == "adamw":
            base = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1, fused=fused)
        else:
            base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
        optimizer = hvd.DistributedOptimizer(
            base, named_parameters=model.named_parameters(), grad_scaler=scaler, **options
        )
        overflow = {"on": False}
        model.fc.weight.register_hook(lambda g: g * float("inf") if overflow["on"] else g)
        return model, optimizer, scaler, overflow

    runs = [build(fused) for fused in (True, False)]
    for t in range(8):
        for fused, (model, optimizer, scaler, overflow) in zip((True, False), runs):
            overflow["on"] = t == 5
            optimizer.zero_grad()
            scaler.scale(loss_of(model, t, False)).backward()
            optimizer.synchronize()
            if unscale or not fused:
                scaler.unscale_(optimizer)
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
    (fused_model, fused_opt, fused_scaler, _), (plain_model, plain_opt, plain_scaler, _) = runs
    assert fused_opt.update_rule["rule"] == ("adam_correction_local" if kind == "adamw" else "momentum_correction")
    assert fused_opt.skipped_steps == plain_opt.skipped_steps == 1
    assert fused_scaler.get_scale() == plain_scaler.get_scale()
    for name, p in fused_model.named_parameters():
        assert torch.equal(p, dict(plain_model.named_parameters())[name]), name
    fused_lags, plain_lags = fused_opt.state_dict()["lags"], plain_opt.state_dict()["lags"]
    for memory in ("residuals", *(("exp_avg", "exp_avg_sq") if kind == "adamw" else ("velocities",))):
        for name, tensor in fused_lags[memory].items():
            assert torch.equal(tensor, plain_lags[memory][name]), f"{memory} {name}"


def test_a_rule_steps_on_what_was_done_to_grad_after_synchronize(hvd):
    """The rules that step themselves read the merged gradients from their buckets: a
    ``torch.sparse`` gradient (handed back as a copy, which the GradScaler unscales in place) and
    a ``.grad`` replaced between ``synchronize()`` and ``step()`` count as they do for the wrapped
    optimizer's own step (once the sparse embedding stepped on the scaled gradient, 2674 off)."""

    def run(sparse, replace=False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(20, 6, sparse=sparse), nn.Flatten(), nn.Linear(18, 2))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        optimizer = hvd.DistributedOptimizer(
            base,
            named_parameters=model.named_parameters(),
            density=0.5,
            grad_scaler=scaler,
            momentum_correction=True,
            recipe="paper",
            sparse_as_dense=True,
        )
        for step in range(3):
            generator = torch.Generator().manual_seed(step)
            x, y = torch.randint(0, 20, (4, 3), generator=generator), torch.randn(4, 2, generator=generator)
            optimizer.zero_grad()
            scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
            optimizer.synchronize()
            if replace:  # out of place: the merge buffer no longer holds .grad
                for p in model.parameters():
                    p.grad = p.grad * 0.0
            with optimizer.skip_synchronize():
                scaler.step(optimizer)
            scaler.update()
        return [p.detach().clone() for p in model.parameters()], model

    dense, _ = run(False)
    sparse, _ = run(True)
    for a, b in zip(dense, sparse):
        assert torch.equal(a, b)
    torch.manual_seed(0)
    start = [
        p.detach().clone() for p in nn.Sequential(nn.Embedding(20, 6), nn.Flatten(), nn.Linear(18, 2)).parameters()
    ]
    replaced, _ = run(False, replace=True)
    for a, b in zip(replaced, start):
        assert torch.equal(a, b)  # zero gradients, momentum correction from zero velocity: nothing moves
