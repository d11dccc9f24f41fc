"""What a hostile pass tried in one process (P = 1): clear errors naming the cause, and the
patterns that must train as they do with torch or Horovod (closures, maximize, join)."""

import copy
import gc
import pickle
import weakref

import models
import pytest
import torch
from torch import nn

from lags_hvd.agreement import hyperparameter_digest


def wrap(hvd, model, base=None, **options):
    base = base or torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    options.setdefault("recipe", "paper")
    return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), **options)


def test_a_parameter_with_no_elements_is_refused_by_name(hvd):
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 0))
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"no elements cannot be exchanged: '1.bias' \(0,\), '1.weight' \(0, 3\)"):
        hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert type(base) is torch.optim.SGD  # left as it was


def test_a_bad_k_is_named_with_its_value(hvd):
    optimizer = wrap(hvd, models.make_model())
    k = dict(optimizer.lags_state.k, **{"fc.weight": 0})
    with pytest.raises(ValueError, match=r"out of range: fc.weight=0 \(numel 240\)"):
        optimizer.lags_state.set_k(k)
    with pytest.raises(ValueError, match="no k for fc.bias"):
        optimizer.lags_state.set_k({n: v for n, v in optimizer.lags_state.k.items() if n != "fc.bias"})


def test_a_distributed_optimizer_cannot_be_copied_or_pickled(hvd):
    optimizer = wrap(hvd, models.make_model())
    for attempt in (copy.deepcopy, copy.copy, pickle.dumps):
        with pytest.raises(TypeError, match="cannot be copied or pickled.*state_dict"):
            attempt(optimizer)


def test_maximize_turns_momentum_correction_off_and_an_explicit_one_is_refused(hvd):
    model = models.make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1, maximize=True)
    assert wrap(hvd, model, base, recipe="dgc").lags_state.velocities is None
    model = models.make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, maximize=True)
    with pytest.raises(ValueError, match="maximize=False; param group 0 has .* maximize True"):
        wrap(hvd, model, base, recipe="dgc", momentum_correction=True)


def test_lbfgs_is_refused(hvd):
    model = models.make_model()
    with pytest.raises(TypeError, match="LBFGS evaluates its closure several times"):
        wrap(hvd, model, torch.optim.LBFGS(model.parameters()))


def test_step_with_a_closure_exchanges_the_closures_gradients(hvd):
    """The closure runs before the exchange: the same training as backward then step()."""
    closure_model, plain_model = models.make_model(), models.make_model()
    closure_optimizer, plain_optimizer = wrap(hvd, closure_model, density=0.2), wrap(hvd, plain_model, density=0.2)
    for step in range(3):

        def closure():
            closure_optimizer.zero_grad()
            loss = models.loss_of(closure_model, 0, step)
            loss.backward()
            return loss

        loss = closure_optimizer.step(closure)
        plain_optimizer.zero_grad()
        plain_loss = models.loss_of(plain_model, 0, step)
        plain_loss.backward()
        plain_optimizer.step()
        assert torch.equal(loss, plain_loss)
    for (name, a), (_, b) in zip(closure_model.named_parameters(), plain_model.named_parameters()):
        assert torch.equal(a, b), name
    assert closure_optimizer.lags_state.iteration == 3


def test_a_closure_after_synchronize_is_refused(hvd):
    model = models.make_model()
    optimizer = wrap(hvd, model)
    models.loss_of(model, 0, 0).backward()
    optimizer.synchronize()
    with pytest.raises(RuntimeError, match=r"step\(closure\) after synchronize\(\)"):
        optimizer.step(lambda: models.loss_of(model, 0, 0))
    with optimizer.skip_synchronize():
        optimizer.step()  # still usable


def test_skip_synchronize_without_synchronize_is_refused_and_nothing_is_lost(hvd):
    model = models.make_model()
    optimizer = wrap(hvd, model)
    models.loss_of(model, 0, 0).backward()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"inside optimizer.skip_synchronize\(\) without optimizer.synchronize"):
        with optimizer.skip_synchronize():
            optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))  # no local step
    optimizer.synchronize()  # the pattern, done right, goes on
    with optimizer.skip_synchronize():
        optimizer.step()
    assert optimizer.lags_state.iteration == 1


def test_a_backward_pass_through_an_unfrozen_critic_is_named_at_its_zero_grad(hvd):
    """A DCGAN's generator loss reaches the discriminator's parameters: its optimizer's next
    zero_grad() says what happened and how to avoid it."""
    critic = nn.Linear(4, 1)
    critic_optimizer = wrap(hvd, critic)
    generator = nn.Linear(2, 4)
    critic(generator(torch.randn(3, 2))).mean().backward()  # the generator's step would follow
    with pytest.raises(RuntimeError, match=r"exchanges in flight \(2: bias, weight.*unfrozen discriminator"):
        critic_optimizer.zero_grad()
    critic_optimizer.step()  # what the message asks: the iteration completes


def test_the_hyperparameter_digest_follows_every_value_but_tensors_off_the_cpu():
    groups = [{"params": [], "lr": 0.1, "momentum": 0.9, "betas": (0.9, 0.999)}]
    digest = hyperparameter_digest(groups)
    assert hyperparameter_digest([dict(groups[0])]) == digest
    for key, value in (("lr", 0.05), ("momentum", 0.0), ("betas", (0.9, 0.99))):
        assert hyperparameter_digest([dict(groups[0], **{key: value})]) != digest, key
    cpu = hyperparameter_digest([dict(groups[0], lr=torch.tensor(0.1))])
    assert hyperparameter_digest([dict(groups[0], lr=torch.tensor(0.2))]) != cpu
    off_cpu = [dict(groups[0], lr=torch.tensor(0.2, device="meta"))]
    assert hyperparameter_digest(off_cpu) == hyperparameter_digest(
        [{"params": [], "momentum": 0.9, "betas": (0.9, 0.999)}]
    )


def test_join_with_one_rank_returns_at_once(hvd, monkeypatch):
    monkeypatch.setattr("lags_hvd.uneven._LIVE", [])  # this test's optimizer only, not the session's
    model = models.make_model()
    optimizer = wrap(hvd, model)
    models.loss_of(model, 0, 0).backward()
    with pytest.raises(RuntimeError, match="join.. after a backward pass that no step.. followed"):
        hvd.join()
    optimizer.step()
    assert hvd.join() == 0 and optimizer.lags_state.iteration == 1


def test_a_dropped_optimizer_is_collected_and_its_hooks_go_with_it(hvd):
    """The hooks hold the optimizer weakly: a model re-wrapped by a new optimizer (as after
    changing which parameters train) trains with the new one alone."""
    model = models.make_model()
    dropped = weakref.ref(wrap(hvd, model))
    gc.collect()
    assert dropped() is None
    optimizer = wrap(hvd, model)
    for step in range(2):  # the old hooks would count a second backward pass and refuse it
        optimizer.zero_grad()
        models.loss_of(model, 0, step).backward()
        optimizer.step()
    assert optimizer.lags_state.iteration == 2


def test_param_groups_are_never_changed_during_a_step(hvd):
    """Momentum correction steps on the merged update without touching the user's groups
    (a scheduler or logger reading them mid-step sees the user's values): groups that
    record every write see none during training."""
    writes = []

    class RecordingGroup(dict):
        def __setitem__(self, key, value):
            writes.append(key)
            super().__setitem__(key, value)

    model = models.make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    base.param_groups = [RecordingGroup(group) for group in base.param_groups]
    optimizer = wrap(hvd, model, base, recipe="dgc", density=0.1, buckets="layer", density_warmup=0)
    assert optimizer.update_rule["momentum_correction"]
    for step in range(3):
        optimizer.zero_grad()
        models.loss_of(model, 0, step).backward()
        optimizer.step()
    assert writes == [] and optimizer.lags_state.iteration == 3


def test_momentum_correction_is_for_torchs_own_sgd(hvd):
    """It replaces the SGD step by x -= lr * update: a subclass's own step would be skipped,
    so a subclass gets plain error feedback under the recipe and a clear refusal if asked."""

    class MySGD(torch.optim.SGD):
        pass

    model = models.make_model()
    optimizer = wrap(hvd, model, MySGD(model.parameters(), lr=0.1, momentum=0.9), recipe="dgc", density=0.1)
    assert not optimizer.update_rule["momentum_correction"]
    model = models.make_model()
    with pytest.raises(ValueError, match="torch.optim.SGD itself.*MySGD"):
        wrap(hvd, model, MySGD(model.parameters(), lr=0.1, momentum=0.9), momentum_correction=True)


def test_an_iteration_leaves_nothing_behind(hvd):
    """After a step, a skipped (non-finite) step and an error in a hook, no iteration is under way."""
    model = models.make_model()
    optimizer = wrap(hvd, model, density=0.1)
    optimizer.zero_grad()
    models.loss_of(model, 0, 0).backward()
    assert optimizer.iteration_under_way
    optimizer.step()
    assert not optimizer.iteration_under_way and optimizer.exchanges_in_flight == 0
    optimizer.zero_grad()
    (models.loss_of(model, 0, 1) * float("nan")).backward()
    with pytest.warns(RuntimeWarning, match="non-finite gradient"):
        optimizer.step()
    assert optimizer.skipped_steps == 1 and not optimizer.iteration_under_way

    def broken(x, k):
        raise RuntimeError("selector failed")

    model = models.make_model()
    optimizer = wrap(hvd, model, density=0.1, selector=broken)
    with pytest.raises(RuntimeError, match="selector failed"):
        models.loss_of(model, 0, 0).backward()
    assert not optimizer.iteration_under_way and optimizer.exchanges_in_flight == 0


def test_an_lr_scheduler_built_before_wrapping_is_refused_with_the_order_to_use(hvd):
    """The scheduler patches ``step`` on the optimizer object, so the wrapped optimizer's own
    step would run (a local first step, then an error that blamed GANs); refused at wrapping,
    the optimizer left as it was, and the same scheduler built after wrapping works."""
    model = models.make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    torch.optim.lr_scheduler.StepLR(base, step_size=2)
    with pytest.raises(TypeError, match="an LR scheduler built before wrapping.*Wrap the optimizer first"):
        wrap(hvd, model, base)
    assert type(base) is torch.optim.SGD
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    optimizer = wrap(hvd, model, base)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    for step in range(3):
        optimizer.zero_grad()
        models.loss_of(model, 0, step).backward()
        optimizer.step()
        scheduler.step()
    assert optimizer.lags_state.iteration == 3 and optimizer.param_groups[0]["lr"] == 0.05
