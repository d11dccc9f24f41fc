"""The bucket engine in one process (P = 1): flat gradient buffers, their aliasing with
``p.grad``, and no host reads from the backward hooks."""
import pytest
import torch
from torch import nn

import models
import oracle

HOST_READS = ("item", "tolist", "__float__", "__bool__", "__int__")


def deep_model(layers: int = 12) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(16, 16) for _ in range(layers)])


def wrap(hvd, model, **options):
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), **options)


class HostReads:
    """Counts reads of tensor values into Python (the calls that stall a GPU stream)."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in HOST_READS:
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original):
                self.count += 1
                return _original(tensor, *args)
            monkeypatch.setattr(torch.Tensor, name, counted)

    def during(self, fn) -> int:
        before = self.count
        fn()
        return self.count - before


def loss(model, step):
    gen = torch.Generator().manual_seed(step)
    if isinstance(model, nn.Sequential):
        return model(torch.randn(8, 16, generator=gen)).square().mean()
    return models.loss_of(model, 0, step)


@pytest.mark.parametrize("options", [dict(density=0.05), dict(density=0.05, selector="torch"),
                                     dict(density=0.05, momentum_correction=True),
                                     dict(density=0.05, local_clip=1.0, dense_params="1d"),
                                     dict(density=1.0)], ids=["sampled", "torch", "mc", "clip-1d", "dense"])
def test_hooks_read_nothing_to_the_host_and_synchronize_a_constant(hvd, monkeypatch, options):
    """backward() with LAGS hooks reads no tensor value into Python, and synchronize()
    reads a fixed number, whatever the number of units (2 layers or 24)."""
    reads = {}
    for layers in (1, 12):
        model = deep_model(layers)
        optimizer = wrap(hvd, model, **options)
        counter = HostReads(monkeypatch)
        for t in range(3):
            optimizer.zero_grad()
            backward = counter.during(lambda: loss(model, t).backward())
            synchronize = counter.during(optimizer.synchronize)
            with optimizer.skip_synchronize():
                optimizer.step()
        reads[layers] = (backward, synchronize)
        monkeypatch.undo()
    assert reads[1][0] == reads[12][0] == 0
    assert reads[1][1] == reads[12][1] <= 4, reads


def oracle_run(model, steps, density, zero_grad):
    """Error-feedback top-k SGD with momentum at P = 1, in numpy, on ``model``'s gradients:
    what every aliasing variant below must produce."""
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    eps = {n: 0 * v.ravel() for n, v in params.items()}
    sgd = oracle.SGDMomentum(0.1, 0.9)
    for t in range(steps):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(torch.from_numpy(params[n]))
        model.zero_grad(set_to_none=True)
        loss(model, t).backward()
        for n, p in model.named_parameters():
            g = p.grad.numpy().ravel()
            avg, (eps[n],) = oracle.lags_round([eps[n] + g], oracle.k_for(density, g.size))
            params[n] = sgd.step(n, params[n], avg.reshape(params[n].shape))
    return params


@pytest.mark.parametrize("variant", ["set_to_none", "zero_in_place", "replaced", "no_zero_grad_call"])
def test_gradients_are_views_of_one_buffer_whatever_the_user_does_with_grad(hvd, variant):
    """zero_grad(set_to_none=True/False), a user replacing p.grad with a tensor of their own, or
    a first iteration without zero_grad: the same training as the oracle, and after every
    step each p.grad is a view of the optimizer's one gradient buffer."""
    model = models.make_model()
    optimizer = wrap(hvd, model, density=0.1)
    for t in range(4):
        if variant == "set_to_none" or (variant == "no_zero_grad_call" and t > 0):
            optimizer.zero_grad(set_to_none=True)
        elif variant == "zero_in_place":
            optimizer.zero_grad(set_to_none=False)
        elif variant == "replaced":
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        loss(model, t).backward()
        optimizer.step()
        storages = {p.grad.untyped_storage().data_ptr() for p in model.parameters()}
        assert len(storages) == 1
    expected = oracle_run(models.make_model(), 4, 0.1, None)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), torch.from_numpy(expected[n]), rtol=1e-6, atol=1e-7)


def test_frozen_parameters_stay_outside_the_buffer(hvd):
    """A parameter frozen before wrapping is not exchanged: its .grad stays None and the
    parameter unchanged, while the others train as the oracle says."""
    model = models.make_model()
    model.shift.requires_grad_(False)
    optimizer = wrap(hvd, model, density=0.1)
    shift = model.shift.detach().clone()
    for t in range(3):
        optimizer.zero_grad()
        loss(model, t).backward()
        optimizer.step()
    assert model.shift.grad is None and torch.equal(model.shift.detach(), shift)
    assert "shift" not in optimizer.lags_state.k


class Tied(nn.Module):
    """An embedding whose weight is also the output projection (tied weights)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(11, 6)
        self.mix = nn.Linear(6, 6)

    def forward(self, tokens):
        return self.mix(self.embed(tokens)) @ self.embed.weight.t()


def test_tied_weights_are_one_unit_with_both_uses_summed(hvd):
    model = Tied()
    optimizer = wrap(hvd, model, density=0.2)
    assert sorted(optimizer.lags_state.k) == ["embed.weight", "mix.bias", "mix.weight"]
    reference = Tied()
    params = {n: p.detach().numpy().copy() for n, p in reference.named_parameters()}
    eps = {n: 0 * v.ravel() for n, v in params.items()}
    sgd = oracle.SGDMomentum(0.1, 0.9)
    for t in range(3):
        tokens = torch.randint(0, 11, (5,), generator=torch.Generator().manual_seed(t))
        optimizer.zero_grad()
        model(tokens).square().mean().backward()
        optimizer.step()
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p.copy_(torch.from_numpy(params[n]))
        reference.zero_grad(set_to_none=True)
        reference(tokens).square().mean().backward()
        for n, p in reference.named_parameters():
            g = p.grad.numpy().ravel()
            avg, (eps[n],) = oracle.lags_round([eps[n] + g], oracle.k_for(0.2, g.size))
            params[n] = sgd.step(n, params[n], avg.reshape(params[n].shape))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), torch.from_numpy(params[n]), rtol=1e-6, atol=1e-7)


def test_a_nonfinite_gradient_skips_the_step_without_reading_it_in_the_hook(hvd):
    """A NaN far from the top-k magnitudes still reaches the merge (selection puts NaN
    first): the step is skipped and the residuals stay as they were."""
    model = deep_model(2)
    optimizer = wrap(hvd, model, density=0.05)
    optimizer.zero_grad()
    loss(model, 0).backward()
    optimizer.step()
    before = {n: r.clone() for n, r in optimizer.lags_state.residuals.state_dict().items()}
    weights = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()

    def poisoned(grad):
        grad = grad.clone()
        grad[3, 5] = float("nan")
        return grad
    handle = model[0].weight.register_hook(poisoned)   # runs before the gradient is accumulated
    loss(model, 1).backward()
    handle.remove()
    with pytest.warns(RuntimeWarning, match="non-finite"):
        optimizer.step()
    for n, r in optimizer.lags_state.residuals.state_dict().items():
        assert torch.equal(r, before[n]), n
    assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights))
