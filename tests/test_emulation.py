"""The emulated accelerator (lags_hvd.experiments.emulation): layer times from FLOPs, backward
hooks in the real order on pooled gradients, and the CPU left free while it "computes"."""

import time

import pytest
import torch

from lags_hvd.experiments import emulation, models


@pytest.mark.parametrize("name", ["resnet20", "lstm_small"])
def test_every_parameter_belongs_to_one_layer_whose_time_follows_its_flops(name):
    layers = emulation.layer_times(name, 32, 5.0)
    owned = [n for layer in layers for n in layer.params]
    real, _, _ = models.build(name, 2)
    assert owned == [n for n, _ in real.named_parameters()]  # each once, in registration order
    assert all(
        layer.backward_s - emulation.LAUNCH_S == pytest.approx(2 * (layer.forward_s - emulation.LAUNCH_S))
        for layer in layers
    )
    doubled = emulation.layer_times(name, 64, 5.0)
    faster = emulation.layer_times(name, 32, 50.0)
    for a, b, c in zip(layers, doubled, faster):
        compute = a.forward_s - emulation.LAUNCH_S
        assert b.forward_s - emulation.LAUNCH_S == pytest.approx(2 * compute)
        assert c.forward_s - emulation.LAUNCH_S == pytest.approx(compute / 10)
    assert sum(layer.forward_s for layer in layers) > 10 * emulation.LAUNCH_S  # FLOPs were counted


def test_backward_fires_every_hook_in_reverse_order_on_the_pooled_gradients():
    model, batch, loss_fn = emulation.emulate("resnet20", 8, 5.0)
    real, _, _ = models.build("resnet20", 2)
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in real.named_parameters()]
    assert model.state_dict().keys() == real.state_dict().keys()
    fired = []
    for name, p in model.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: fired.append(name))
    expected = [n for layer in reversed(model.layers) for n in reversed(layer.params)]
    for turn in range(3):
        fired.clear()
        model.zero_grad(set_to_none=True)
        loss_fn(model, batch).backward()
        assert sorted(fired) == sorted(expected)
        assert [n for n in fired] == [n for layer in reversed(model.layers) for n in _hook_order(layer, fired)]
        pooled = model.pool.recorded[turn % emulation.POOL]
        for name, p in model.named_parameters():
            assert torch.equal(p.grad, pooled[name]), name
            assert p.grad.data_ptr() != pooled[name].data_ptr()  # a copy: the pool stays as recorded


def _hook_order(layer, fired):
    """A layer's parameters in the order their hooks fired (autograd's order within a layer)."""
    return sorted(layer.params, key=fired.index)


def test_the_emulated_pass_takes_its_time_without_the_cpu():
    model, batch, loss_fn = emulation.emulate("vgg16", 16, 0.2)
    expected = sum(layer.forward_s + layer.backward_s for layer in model.layers)
    assert expected > 0.1
    wall, cpu = time.perf_counter(), time.process_time()
    loss_fn(model, batch).backward()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    assert wall >= expected * 0.99  # every deadline met or passed, never early
    assert cpu < 0.5 * expected  # the waits left the core free (the pooled copies cost the rest)
