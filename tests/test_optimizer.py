"""The optimizer in one process (P = 1): API contract, clear errors, state handling."""

import copy
import warnings

import models
import oracle
import pytest
import torch
from torch import nn

from lags_hvd import selection
from lags_hvd.agreement import settings_to_agree
from lags_hvd.density import k_for_density
from lags_hvd.optimizer import Wiring
from lags_hvd.options import DEFAULT_DENSITY_WARMUP


def make(hvd, model=None, **options):
    model = model or models.make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    options.setdefault("recipe", "paper")  # the paper's update unless a test asks otherwise
    return model, hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), **options)


def step(model, optimizer, step_index=0):
    optimizer.zero_grad()
    models.loss_of(model, 0, step_index).backward()
    optimizer.step()


def test_drop_in_api(hvd):
    import horovod.torch

    for name in ["init", "rank", "size", "local_rank", "broadcast_parameters", "Compression", "Average", "Sum"]:
        assert getattr(hvd, name) is getattr(horovod.torch, name)
    assert hvd.broadcast_optimizer_state.__module__ == "lags_hvd.horovod_api"  # Horovod's, extended
    model, optimizer = make(hvd)
    assert isinstance(optimizer, torch.optim.SGD)
    assert type(optimizer).__name__ == "SGD"
    # schedulers and Horovod's broadcast work on the wrapped optimizer
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    step(model, optimizer)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_single_worker_matches_oracle(hvd):
    """With P = 1 the update is plain error-feedback top-k SGD; check it against numpy."""
    model, optimizer = make(hvd, density=0.05)
    reference = models.make_model()
    params = {n: p.detach().numpy().copy() for n, p in reference.named_parameters()}
    eps = {n: 0 * v.ravel() for n, v in params.items()}
    sgd = oracle.SGDMomentum(0.1, 0.9)
    for t in range(5):
        step(model, optimizer, t)
        with torch.no_grad():
            for n, p in reference.named_parameters():
                p.copy_(torch.from_numpy(params[n]))
        for n, g in models.gradients(reference, 0, t).items():
            avg, (eps[n],) = oracle.lags_round([eps[n] + g.numpy().ravel()], oracle.k_for(0.05, g.numel()))
            params[n] = sgd.step(n, params[n], avg.reshape(params[n].shape))
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), torch.from_numpy(params[n]), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("density", [0.0, -0.5, 1.5, float("nan"), "0.1", True])
def test_bad_density_is_refused(hvd, density):
    with pytest.raises(ValueError, match="density must be a number in \\(0, 1\\]"):
        make(hvd, density=density)


def test_bad_layer_densities(hvd):
    with pytest.raises(ValueError, match="names no exchange unit"):
        make(hvd, layer_densities={"nope": 0.5})
    with pytest.raises(ValueError, match="layer_densities\\['fc.bias'\\]"):
        make(hvd, layer_densities={"fc.bias": 2.0})


def test_named_parameters_must_be_tuples(hvd):
    model = models.make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="\\(name, parameter\\) tuples"):
        hvd.DistributedOptimizer(base, named_parameters=list(model.parameters()))
    with pytest.raises(ValueError, match="\\(name, parameter\\) tuples"):
        hvd.DistributedOptimizer(base, named_parameters=[["a", p] for p in model.parameters()])


def test_named_parameters_must_be_unique_and_complete(hvd):
    model = models.make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    named = list(model.named_parameters())
    with pytest.raises(ValueError, match="unique; duplicates: conv.weight"):
        hvd.DistributedOptimizer(base, named_parameters=named + [("conv.weight", named[1][1])])
    with pytest.raises(ValueError, match="does not name 1"):
        hvd.DistributedOptimizer(base, named_parameters=named[1:])


def test_zero_grad_between_backward_and_step_is_an_error(hvd):
    model, optimizer = make(hvd)
    models.loss_of(model, 0, 0).backward()
    with pytest.raises(RuntimeError, match="zero_grad\\(\\) was called after loss.backward\\(\\)"):
        optimizer.zero_grad()
    optimizer.step()  # the exchange in flight still completes
    optimizer.zero_grad()  # and afterwards zero_grad is fine


def test_too_many_backward_passes_is_an_error(hvd):
    model, optimizer = make(hvd)
    models.loss_of(model, 0, 0).backward()
    with pytest.raises(RuntimeError, match="more than backward_passes_per_step"):
        models.loss_of(model, 0, 1).backward()
    # the second pass accumulated into gradients that already held residuals: no way on
    with pytest.raises(RuntimeError, match="this optimizer failed"):
        optimizer.synchronize()


def test_backward_passes_per_step_accumulates_locally(hvd):
    """Two passes then one exchange == one pass on the summed gradient."""
    model, optimizer = make(hvd, backward_passes_per_step=2, density=0.1)
    ref_model, ref_optimizer = make(hvd, density=0.1)
    optimizer.zero_grad()
    ref_optimizer.zero_grad()
    for t in range(2):
        models.loss_of(model, 0, t).backward()
        assert optimizer.exchanges_in_flight == (0 if t == 0 else len(optimizer.lags_state.units))
    (models.loss_of(ref_model, 0, 0) + models.loss_of(ref_model, 0, 1)).backward()
    optimizer.step()
    ref_optimizer.step()
    for (n, a), (_, b) in zip(model.named_parameters(), ref_model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=n)
    optimizer.set_backward_passes_per_step(1)
    step(model, optimizer)
    with pytest.raises(ValueError, match=">= 1"):
        optimizer.set_backward_passes_per_step(0)


def test_two_optimizers_of_one_process_keep_their_step_checks_apart(hvd):
    """A GAN's pattern: both backward passes, then both steps, so both optimizers' exchanges
    and step checks are in flight at once; each optimizer's collectives have their own names,
    and each model ends exactly where it ends trained alone, every step taken."""

    def critic_and_optimizer():
        torch.manual_seed(1)
        critic = torch.nn.Sequential(torch.nn.Linear(4, 3))
        return critic, hvd.DistributedOptimizer(
            torch.optim.SGD(critic.parameters(), lr=0.1), named_parameters=critic.named_parameters(), density=0.5
        )

    generator, g_optimizer = make(hvd, density=0.1)
    critic, c_optimizer = critic_and_optimizer()
    generator_alone, generator_alone_optimizer = make(hvd, density=0.1)
    critic_alone, critic_alone_optimizer = critic_and_optimizer()
    x = torch.randn(2, 4)
    for t in range(3):
        g_optimizer.zero_grad()
        c_optimizer.zero_grad()
        models.loss_of(generator, 0, t).backward()
        critic(x).square().sum().backward()
        g_optimizer.step()
        c_optimizer.step()
        step(generator_alone, generator_alone_optimizer, t)
        critic_alone_optimizer.zero_grad()
        critic_alone(x).square().sum().backward()
        critic_alone_optimizer.step()
    assert g_optimizer.skipped_steps == c_optimizer.skipped_steps == 0
    assert g_optimizer.lags_state.iteration == c_optimizer.lags_state.iteration == 3
    for together, alone in ((generator, generator_alone), (critic, critic_alone)):
        for (n, a), b in zip(together.named_parameters(), alone.parameters()):
            assert torch.equal(a, b), f"{n} differs by up to {(a - b).abs().max().item():g}"


def test_two_copies_of_one_model_exchange_under_their_own_names(hvd):
    """Two optimizers over parameters of the same names (a model and a copy of it, or two
    identical networks) with both backward passes in flight at once: Horovod refuses a
    second collective under a name still in flight, so each optimizer has its own names."""
    model, optimizer = make(hvd, density=0.1)
    copy, copy_optimizer = make(hvd, density=0.1)
    for t in range(3):
        optimizer.zero_grad()
        copy_optimizer.zero_grad()
        models.loss_of(model, 0, t).backward()
        models.loss_of(copy, 0, t).backward()  # the first's exchanges still pending
        optimizer.step()
        copy_optimizer.step()
    for (n, a), b in zip(model.named_parameters(), copy.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=n)  # same start, same data: same steps


def test_collective_names_are_one_per_optimizer_and_the_same_on_every_rank():
    from lags_hvd.agreement import wire_namespace

    names = ["layer.weight", "layer.bias", "head.weight"]
    first, second = wire_namespace(names), wire_namespace(names[::-1])  # a copy: the same names
    other = wire_namespace(["critic.weight"])
    assert len({first, second, other}) == 3
    assert first.rsplit(".", 1)[0] == second.rsplit(".", 1)[0]  # the digest ignores the order
    assert int(second.rsplit(".", 1)[1]) == int(first.rsplit(".", 1)[1]) + 1


def test_a_refused_optimizer_gives_its_collective_names_back():
    """A rank that refused its options never took a name; one whose settings were refused by
    the agreement did: it gives the name back, so both ranks' next optimizers match."""
    from lags_hvd.agreement import release_namespace, wire_namespace

    names = ["refused.weight"]
    kept, refused = wire_namespace(names), wire_namespace(names)
    release_namespace(refused)
    assert wire_namespace(names) == refused  # the retry gets the name the refused one had
    release_namespace(kept)  # taken before a later one: stays taken
    assert wire_namespace(names) != kept


def test_synchronize_then_skip_synchronize_for_clipping(hvd):
    model, optimizer = make(hvd)
    optimizer.zero_grad()
    models.loss_of(model, 0, 0).backward()
    optimizer.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with optimizer.skip_synchronize():
            optimizer.step()
    moved = sum((p.detach() - before[n]).norm() ** 2 for n, p in model.named_parameters()) ** 0.5
    assert 0 < moved <= 0.1 * 1e-3 * 1.0001  # lr * clipped norm (first momentum step)


def test_step_after_synchronize_warns_with_horovods_sentence_and_exchanges_once(hvd):
    model, optimizer = make(hvd)
    optimizer.zero_grad()
    models.loss_of(model, 0, 0).backward()
    optimizer.synchronize()
    merged = {n: p.grad.clone() for n, p in model.named_parameters()}
    with pytest.warns(UserWarning) as caught:
        optimizer.step()
    assert str(caught[0].message).startswith(
        "optimizer.step() called without optimizer.skip_synchronize() context after optimizer.synchronize()."
    )
    assert optimizer.lags_state.iteration == 1  # not exchanged a second time
    assert all(torch.equal(p.grad, merged[n]) for n, p in model.named_parameters())


def test_horovods_state_initialisation_steps_locally(hvd):
    """Horovod's broadcast_optimizer_state on an optimizer without state sets zero gradients
    and calls step(): only the wrapped optimizer's step runs (no exchange, no LAGS change)."""
    import horovod.torch

    model, optimizer = make(hvd)
    horovod.torch.broadcast_optimizer_state(optimizer, root_rank=0)
    assert len(optimizer.state) == len(list(model.parameters()))  # momentum buffers exist
    assert optimizer.lags_state.iteration == 0
    assert all(r.abs().sum() == 0 for r in optimizer.lags_state.residuals.state_dict().values())
    step(model, optimizer)  # training goes on normally
    assert optimizer.lags_state.iteration == 1


def test_step_without_backward_on_manual_gradients_still_exchanges(hvd):
    """Non-zero gradients set by hand are gradients: step() exchanges them even without state."""
    model = models.make_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), density=0.1
    )
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert optimizer.lags_state.iteration == 1
    assert sum(int(torch.count_nonzero(r)) for r in optimizer.lags_state.residuals.state_dict().values()) > 0


def test_lags_broadcast_optimizer_state_shares_the_plan_and_iteration(hvd):
    model, optimizer = make(hvd)
    step(model, optimizer)
    residuals = {n: r.clone() for n, r in optimizer.lags_state.residuals.state_dict().items()}
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    assert optimizer.lags_state.iteration == 1
    assert all(torch.equal(r, residuals[n]) for n, r in optimizer.lags_state.residuals.state_dict().items())


def test_lr_scaled_residual_rescales_on_lr_change(hvd):
    captured = {}

    def spy(acc, k):  # the public seam: a selector of our own, recording what it selects from
        if armed:
            captured.setdefault(acc.numel(), acc.clone())
        return selection.select_sampled(acc, k)

    armed = False
    model, optimizer = make(hvd, density=0.01, lr_scaled_residual=True, selector=spy, trust_selector=True)
    step(model, optimizer)
    residual = optimizer.lags_state.residuals.residual("fc.weight").clone()
    optimizer.param_groups[0]["lr"] = 0.025  # 0.1 -> 0.025: residual x4 before the next selection
    optimizer.zero_grad()
    armed = True
    models.loss_of(model, 0, 1).backward()
    optimizer.step()
    grad = models.gradients(models.make_model(), 0, 1)  # only for its shape
    acc = captured[grad["fc.weight"].numel()]
    fresh = acc - 4 * residual
    # what was added on top of 4 * residual is the new gradient: zero where nothing moved
    assert torch.count_nonzero(fresh) > 0
    torch.testing.assert_close(acc - fresh, 4 * residual)


def test_lr_scaled_residual_needs_positive_lr(hvd):
    model, optimizer = make(hvd, lr_scaled_residual=True)
    optimizer.param_groups[0]["lr"] = 0.0
    with pytest.raises(ValueError, match="positive learning rate"):  # from the first hook
        models.loss_of(model, 0, 0).backward()


def test_checkpoint_with_wrong_residuals_is_refused_and_nothing_changes(hvd):
    model, optimizer = make(hvd)
    step(model, optimizer)
    state = optimizer.state_dict()
    assert set(state["lags"]["residuals"]) == {
        "aux.weight",
        "conv.bias",
        "conv.weight",
        "fc.bias",
        "fc.weight",
        "shift",
    }
    before = {n: r.clone() for n, r in optimizer.lags_state.residuals.state_dict().items()}
    momentum_before = {k: v["momentum_buffer"].clone() for k, v in optimizer.state.items()}
    broken = dict(state, lags=dict(state["lags"], residuals={"fc.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match="residual state does not match the model"):
        optimizer.load_state_dict(broken)
    for n, r in optimizer.lags_state.residuals.state_dict().items():
        assert torch.equal(r, before[n])
    for k, v in optimizer.state.items():
        assert torch.equal(v["momentum_buffer"], momentum_before[k])


@pytest.mark.parametrize("local_residual", [True, False])
def test_an_adam_checkpoint_resumed_with_a_unit_sent_whole_is_refused_and_nothing_changes(hvd, local_residual):
    """Under Adam correction a residual is Adam's step not yet sent: a unit now sent whole
    (density 1 here) has nowhere to keep it, and must not drain it into a gradient."""

    def adamw(density, **options):
        model = models.make_model()
        base = torch.optim.AdamW(model.parameters(), lr=0.01)
        return model, hvd.DistributedOptimizer(
            base, named_parameters=model.named_parameters(), density=density, local_residual=local_residual, **options
        )

    model, optimizer = adamw(0.1)
    step(model, optimizer)
    state = optimizer.state_dict()
    _, resumed = adamw(0.1, layer_densities={"fc.weight": 1.0})
    before = copy.deepcopy(resumed.state_dict())
    with pytest.raises(ValueError, match=r"residuals of \['fc.weight'\], which this optimizer sends whole"):
        resumed.load_state_dict(state)
    after = resumed.state_dict()
    assert torch.equal(after["lags"]["residuals"]["conv.weight"], before["lags"]["residuals"]["conv.weight"])
    assert after["lags"]["iteration"] == before["lags"]["iteration"] == 0


def test_checkpoint_from_other_world_size_resets_residuals_with_warning(hvd):
    model, optimizer = make(hvd)
    step(model, optimizer)
    state = optimizer.state_dict()
    state["lags"] = dict(state["lags"], world_size=4)
    with pytest.warns(UserWarning, match="saved with 4 workers"):
        optimizer.load_state_dict(state)
    assert all(r.abs().sum() == 0 for r in optimizer.lags_state.residuals.state_dict().values())


def test_groups_make_one_unit_topk_over_the_whole_model(hvd):
    model = models.make_model()
    _, optimizer = make(hvd, model=model, groups=[list(model.parameters())], density=0.01)
    (unit,) = optimizer.lags_state.units
    assert unit.numel == sum(p.numel() for p in model.parameters())
    assert optimizer.lags_state.k[unit.name] == 4
    step(model, optimizer)
    changed = sum(int(torch.count_nonzero(p.grad)) for p in model.parameters())
    assert changed == 4


def test_num_groups(hvd):
    _, optimizer = make(hvd, num_groups=2)
    assert len(optimizer.lags_state.units) == 2
    with pytest.raises(ValueError, match="only one of num_groups, groups and buckets"):
        make(hvd, num_groups=2, groups=[])


def test_integer_buckets_merge_small_consecutive_tensors(hvd):
    model = nn.Sequential(nn.Linear(20, 30), nn.LayerNorm(30), nn.Linear(30, 4))
    _, optimizer = make(hvd, model=model, buckets=64)
    units = {u.name: u.param_names for u in optimizer.lags_state.units}
    # backward order: 2.bias (4), 2.weight (120: alone), 1.bias + 1.weight + 0.bias (90), 0.weight
    assert units == {
        "2.bias": ["2.bias"],
        "2.weight": ["2.weight"],
        "0.bias+2": ["0.bias", "1.bias", "1.weight"],
        "0.weight": ["0.weight"],
    }
    optimizer.zero_grad()
    model(torch.randn(8, 20)).sum().backward()
    optimizer.step()  # one exchange for the merged unit, and a gradient for every member
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(min_density=0.5, max_density=0.1), "exceeds max_density"),
        (dict(density="adaptive", layer_densities={"fc.bias": 0.5}), "layer_densities applies"),
        (dict(warmup_iterations=0), "warmup_iterations must be an integer >= 1"),
        (dict(replan_every=1.5), "replan_every must be an integer >= 1"),
        (dict(buckets=-1), "buckets"),
        (dict(buckets="big"), "buckets"),
        (dict(bucket_warmup=0), "bucket_warmup"),
        (dict(plan_slack=-0.1), "plan_slack"),
        (dict(min_density=0), "min_density must be a number"),
    ],
)
def test_bad_options(hvd, options, message):
    with pytest.raises(ValueError, match=message):
        make(hvd, **options)


def test_unknown_option(hvd):
    with pytest.raises(TypeError, match="densty"):
        make(hvd, densty=0.1)


def test_unsupported_op_and_wrapping_twice(hvd):
    with pytest.raises(ValueError, match="Adasum"):
        make(hvd, op=hvd.Adasum)
    _, optimizer = make(hvd)
    with pytest.raises(TypeError, match="already a lags_hvd"):
        hvd.DistributedOptimizer(optimizer)
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        hvd.DistributedOptimizer(object())


def test_frozen_parameters_are_not_exchanged(hvd):
    model = models.make_model()
    model.conv.requires_grad_(False)
    _, optimizer = make(hvd, model=model)
    assert {u.name for u in optimizer.lags_state.units} == {"aux.weight", "fc.bias", "fc.weight", "shift"}
    step(model, optimizer)
    assert model.conv.weight.grad is None


def test_sparse_gradients_densified_with_a_warning_and_handed_back_sparse(hvd):
    embedding = nn.Embedding(10, 3, sparse=True)
    base = torch.optim.SparseAdam(embedding.parameters(), lr=0.1)  # needs sparse gradients
    optimizer = hvd.DistributedOptimizer(base, named_parameters=embedding.named_parameters(), density=0.2)
    with pytest.warns(UserWarning, match="sparse gradient; it is densified"):
        embedding(torch.tensor([1, 2])).sum().backward()
    optimizer.step()
    grad = embedding.weight.grad  # rows as nn.Embedding gives them, holding k = ceil(0.2 * 30) entries
    assert grad.is_sparse and grad.sparse_dim() == 1 and int(grad.to_dense().count_nonzero()) == 6
    embedding = nn.Embedding(10, 3, sparse=True)  # Horovod's test_sparse_embeddings: sparse_as_dense
    base = torch.optim.SparseAdam(embedding.parameters(), lr=0.1)
    optimizer = hvd.DistributedOptimizer(
        base, named_parameters=embedding.named_parameters(), sparse_as_dense=True, density=0.2
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # silent with sparse_as_dense
        embedding(torch.tensor([1, 2])).sum().backward()
    optimizer.step()  # SparseAdam refuses a dense gradient: it was handed back sparse
    grad = embedding.weight.grad
    assert grad.is_sparse and grad.sparse_dim() == 1 and int(grad.to_dense().count_nonzero()) == 6


def test_topk_distributed_optimizer_is_one_global_unit(hvd):
    model = models.make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1)
    optimizer = hvd.TopKDistributedOptimizer(base, named_parameters=model.named_parameters(), density=0.01)
    (unit,) = optimizer.lags_state.units
    assert unit.numel == sum(p.numel() for p in model.parameters())
    step(model, optimizer)
    assert optimizer.backward_timer.last_synchronize["select"] > 0
    with pytest.raises(ValueError, match="fixed density"):
        hvd.TopKDistributedOptimizer(torch.optim.SGD(models.make_model().parameters(), lr=0.1), density="adaptive")


def test_assumption_monitor_matches_the_definition(hvd):
    """P = 1: xbar = acc and shat = TopK(acc), so delta = ||acc - TopK(acc)||^2 / ((1-k/d)||acc||^2)."""
    captured = {}

    def spy(acc, k):  # the public seam: a selector of our own, recording what it selects from
        captured[acc.numel()] = acc.clone()
        return selection.select_sampled(acc, k)

    model, optimizer = make(hvd, density=0.1, monitor_every=2, selector=spy, trust_selector=True)
    for t in range(3):
        step(model, optimizer, t)
        if t == 0:
            first = {n: a.clone() for n, a in captured.items()}
    assert [e["iteration"] for e in optimizer.assumption_log] == [0, 2]
    unit = next(u for u in optimizer.lags_state.units if u.name == "fc.weight")
    acc = first[unit.numel].double()
    k = optimizer.lags_state.k["fc.weight"]
    kept = torch.zeros_like(acc)
    top = acc.abs().argsort(descending=True, stable=True)[:k]
    kept[top] = acc[top]
    expected = (acc - kept).square().sum() / ((1 - k / unit.numel) * acc.square().sum())
    assert optimizer.assumption_log[0]["delta"]["fc.weight"] == pytest.approx(float(expected), rel=1e-6)
    assert 0 < optimizer.assumption_log[0]["delta"]["fc.weight"] < 1


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nonfinite_gradient_skips_the_step_and_keeps_residuals_clean(hvd, poison):
    model, optimizer = make(hvd, density=0.1)
    step(model, optimizer, 0)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    residuals = {n: r.clone() for n, r in optimizer.lags_state.residuals.state_dict().items()}
    handle = model.fc.weight.register_hook(lambda g: torch.full_like(g, poison))
    optimizer.zero_grad()
    models.loss_of(model, 0, 1).backward()
    with pytest.warns(RuntimeWarning, match="non-finite gradient in fc.weight.*skipped on every rank"):
        optimizer.step()
    handle.remove()
    assert optimizer.skipped_steps == 1
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n  # no update anywhere
    for n, r in optimizer.lags_state.residuals.state_dict().items():
        assert torch.equal(r, residuals[n]), n  # exactly as before the step
    step(model, optimizer, 2)  # and training goes on
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(p, params[n]) for n, p in model.named_parameters())


def test_add_param_group_after_wrapping_is_refused(hvd):
    model, optimizer = make(hvd)
    extra = nn.Parameter(torch.zeros(3))
    with pytest.raises(RuntimeError, match="add every parameter group to the optimizer before wrapping"):
        optimizer.add_param_group({"params": [extra]})
    assert len(optimizer.param_groups) == 1


def test_wrapping_is_in_place_and_a_failed_wrap_leaves_the_optimizer_as_it_was(hvd):
    model = models.make_model()
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before = dict(vars(base))
    with pytest.raises(ValueError, match="layer_densities names no exchange unit"):
        hvd.DistributedOptimizer(base, named_parameters=model.named_parameters(), layer_densities={"nope": 0.5})
    assert type(base) is torch.optim.SGD and vars(base).keys() == before.keys()
    wrapped = hvd.DistributedOptimizer(base, named_parameters=model.named_parameters())
    assert wrapped is base and isinstance(base, torch.optim.SGD)
    step(model, wrapped)
    assert wrapped.lags_state.iteration == 1


def test_non_floating_parameters_are_refused(hvd):
    p = nn.Parameter(torch.zeros(4, dtype=torch.complex64))
    with pytest.raises(TypeError, match="only floating point parameters"):
        hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.1), named_parameters=[("c", p)])


def test_without_overlap_exchanges_start_in_synchronize_with_the_same_result(hvd):
    overlapped, serial = make(hvd, density=0.05), make(hvd, density=0.05)
    serial[1].overlap = False
    for t in range(3):
        for model, optimizer in (overlapped, serial):
            optimizer.zero_grad()
            models.loss_of(model, 0, t).backward()
            in_flight = optimizer.exchanges_in_flight
            optimizer.step()
            assert in_flight == (0 if optimizer is serial[1] else len(optimizer.lags_state.units))
    for (name, a), (_, b) in zip(overlapped[0].named_parameters(), serial[0].named_parameters()):
        assert torch.equal(a, b), name


def _duplicating(x, k):
    index = x.abs().argmax().repeat(k)
    return x[index], index


def _out_of_range(x, k):
    index = torch.arange(k) + x.numel() - k + 1
    return torch.zeros(k), index


def _short(x, k):
    values, index = torch.topk(x.abs(), max(k - 1, 1))
    return x[index], index


def _wrong_values(x, k):
    index = torch.topk(x.abs(), k).indices
    return x[index] * 2, index


@pytest.mark.parametrize(
    "selector,message",
    [
        (_duplicating, "repeated indices"),
        (_out_of_range, "out of"),
        (_wrong_values, "not x\\[indices\\]"),
        (_short, "must return k="),
    ],
)
def test_a_callable_selector_that_breaks_the_contract_is_refused(hvd, selector, message):
    model, optimizer = make(hvd, density=0.1, layer_densities={"fc.bias": 0.5}, selector=selector)
    with pytest.raises(ValueError, match=message):  # from the hook, before anything is sent
        models.loss_of(model, 0, 0).backward()


def test_trust_selector_skips_the_check(hvd):
    calls = []

    def doubled(x, k):  # breaks the contract (values != x[indices]): only a check notices
        calls.append(k)
        index = torch.topk(x.abs(), k).indices
        return 2 * x[index], index

    model, optimizer = make(hvd, density=0.1, selector=doubled, trust_selector=True)
    step(model, optimizer)
    assert calls
    model, optimizer = make(hvd, density=0.1, selector=doubled)
    with pytest.raises(ValueError, match="exact entries"):
        step(model, optimizer)


def test_state_saved_by_another_rank_keeps_k_and_iteration_but_resets_residuals(hvd):
    model, optimizer = make(hvd)
    step(model, optimizer)
    state = optimizer.state_dict()
    assert state["lags"]["rank"] == 0 and state["lags"]["iteration"] == 1
    state["lags"] = dict(state["lags"], rank=1)
    fresh_model, fresh = make(hvd)
    with pytest.warns(UserWarning, match="holds rank 1's residuals, this is rank 0"):
        fresh.load_state_dict(state)
    assert fresh.lags_state.iteration == 1
    assert all(r.abs().sum() == 0 for r in fresh.lags_state.residuals.state_dict().values())
    assert all(
        torch.equal(fresh.state[p]["momentum_buffer"], optimizer.state[q]["momentum_buffer"])
        for p, q in zip(fresh_model.parameters(), model.parameters())
    )


@pytest.mark.parametrize("breakage", ["residual shape", "k", "iteration", "wrapped groups"])
def test_a_failed_load_leaves_every_part_of_the_state_as_it_was(hvd, breakage):
    model = models.make_model()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
        density="adaptive",
        recipe="paper",
        min_density=0.1,
        warmup_iterations=2,
        max_slowdown=10.0,
        network_profile={
            "world_size": 1,
            "allgather": {"alpha": 1e-3, "beta": 1e-9},
            "allreduce": {"alpha": 1e-3, "beta": 1e-9},
        },
    )
    for t in range(2):
        step(model, optimizer, t)
    state = optimizer.state_dict()
    ones = {n: 1 for n in state["lags"]["k"]}
    lags = dict(state["lags"], k=ones, planned_k=ones)  # a valid, different plan
    if breakage == "residual shape":
        lags["residuals"] = dict(lags["residuals"], **{"fc.weight": torch.zeros(3)})
    elif breakage == "k":
        lags["planned_k"] = dict(ones, **{"fc.weight": 10**9})
    elif breakage == "iteration":
        lags["iteration"] = -4
    broken = dict(state, lags=lags)
    if breakage == "wrapped groups":
        broken["param_groups"] = state["param_groups"] + state["param_groups"]
    before = (
        dict(optimizer.lags_state.k),
        optimizer.lags_state.iteration,
        {n: r.clone() for n, r in optimizer.lags_state.residuals.state_dict().items()},
        {p: s["momentum_buffer"].clone() for p, s in optimizer.state.items()},
    )
    with pytest.raises(ValueError):
        optimizer.load_state_dict(broken)
    assert optimizer.lags_state.k == before[0] and optimizer.lags_state.iteration == before[1]
    assert all(torch.equal(r, before[2][n]) for n, r in optimizer.lags_state.residuals.state_dict().items())
    assert all(torch.equal(s["momentum_buffer"], before[3][p]) for p, s in optimizer.state.items())


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan"), "60", True])
def test_bad_exchange_timeout_is_refused(hvd, timeout):
    with pytest.raises(ValueError, match="exchange_timeout"):
        make(hvd, exchange_timeout=timeout)


def test_bfloat16_parameters_at_density_one(hvd):
    model = models.make_model().to(torch.bfloat16)
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters(), density=1.0
    )
    x, y = models.batch(0, 0)
    torch.nn.functional.mse_loss(model(x.bfloat16()), y.bfloat16()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    optimizer.step()
    for n, p in model.named_parameters():  # P = 1: the average is the gradient itself, dtype kept
        assert p.grad.dtype == torch.bfloat16 and torch.equal(p.grad, grads[n])


def test_a_process_set_that_is_not_registered_is_refused(hvd):
    with pytest.raises(ValueError, match="not registered"):
        make(hvd, process_set=hvd.ProcessSet([0]))


FIDELITY_ALL = dict(
    density_warmup=4,
    density_warmup_start=0.5,
    momentum_correction=True,
    dense_params="1d",
    local_clip=0.05,
    max_grad_norm=0.05,
)


@pytest.mark.parametrize(
    "options,message",
    [
        (dict(density_warmup=-1), "density_warmup must be an integer >= 0"),
        (dict(density_warmup_start=0), "density_warmup_start must be a number in"),
        (dict(momentum_correction=1), "momentum_correction must be True, False or None"),
        (dict(dense_params="2d"), "dense_params must be '1d', 'none' or None"),
        (dict(recipe="exact"), "recipe must be one of 'dgc', 'paper'"),
        (dict(local_clip=0), "local_clip must be a number > 0"),
        (dict(max_grad_norm=float("nan")), "max_grad_norm must be a number > 0"),
        (dict(max_grad_norm=True), "max_grad_norm must be a number > 0"),
        (dict(momentum_correction=True, lr_scaled_residual=True), "cannot be combined with lr_scaled_residual"),
    ],
)
def test_bad_fidelity_options(hvd, options, message):
    with pytest.raises(ValueError, match=message):
        make(hvd, **options)


@pytest.mark.parametrize(
    "base",
    [
        lambda ps: torch.optim.Adam(ps, lr=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1),
        lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    ],
)
def test_momentum_correction_refuses_optimizers_it_cannot_apply_to(hvd, base):
    model = models.make_model()
    with pytest.raises(ValueError, match="momentum_correction"):
        hvd.DistributedOptimizer(
            base(model.parameters()), named_parameters=model.named_parameters(), momentum_correction=True
        )


@pytest.mark.parametrize(
    "base,extra,message",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {}, "Adam and torch.optim.AdamW themselves"),
        (lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True), {}, "amsgrad=False"),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), dict(momentum_correction=True), "exclude each other"),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), dict(lr_scaled_residual=True), "lr_scaled_residual"),
    ],
)
def test_adam_correction_refuses_what_it_cannot_apply_to(hvd, base, extra, message):
    model = models.make_model()
    with pytest.raises(ValueError, match=message):
        hvd.DistributedOptimizer(
            base(model.parameters()), named_parameters=model.named_parameters(), adam_correction=True, **extra
        )


def resolved(optimizer) -> tuple:
    options = optimizer.options
    return options.buckets, options.density_warmup, options.dense_params, optimizer.update_rule["rule"]


MC, AC, EF = "momentum_correction", "adam_correction_local", "error_feedback"


def agreed_settings(optimizer) -> dict:
    """What the ranks of ``optimizer`` compare at construction."""
    return settings_to_agree(
        optimizer.lags_state.units,
        optimizer.lags_state.k,
        optimizer._options,
        optimizer._context,
        Wiring(optimizer._context.config.collectives, member=True),
        optimizer._wrapped_class,
        optimizer.param_groups,
    )


@pytest.mark.parametrize(
    "base,density,extra,rule",
    [
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-4), 0.01, {}, MC),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "adaptive", {}, MC),
        (lambda ps: torch.optim.SGD(ps, lr=0.1), 0.01, {}, EF),  # no momentum
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True), 0.01, {}, EF),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.5), 0.01, {}, EF),
        (lambda ps: torch.optim.Adam(ps, lr=0.1), 0.01, {}, AC),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), "adaptive", {}, AC),
        (lambda ps: torch.optim.Adam(ps, lr=0.1, amsgrad=True), 0.01, {}, EF),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1, maximize=True), 0.01, {}, EF),
        (lambda ps: torch.optim.Adagrad(ps, lr=0.1), 0.01, {}, EF),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), 1.0, {}, EF),  # nothing sparse
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), 0.01, dict(adam_correction=False), EF),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), 0.01, dict(local_residual=False), "adam_correction"),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), 0.01, dict(lr_scaled_residual=True), EF),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 1.0, {}, EF),  # nothing sparse
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 0.01, dict(lr_scaled_residual=True), EF),
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), 0.01, dict(momentum_correction=False), EF),
    ],
)
def test_the_default_recipe_is_dgcs_wherever_it_applies(hvd, base, density, extra, rule):
    """recipe="dgc" (the default): planned buckets, the density warm-up, 1-D parameters dense,
    and the correction that fits the optimizer exactly where it applies (momentum correction for
    SGD with momentum, no dampening, no Nesterov; Adam correction for Adam and AdamW without
    amsgrad or maximize, each worker's residual in its own parameters; something sparse, the
    residual in its own space) or unless it is declined; an optimizer no correction applies to
    is wrapped with plain error feedback."""
    model = models.make_model()
    optimizer = hvd.DistributedOptimizer(
        base(model.parameters()), named_parameters=model.named_parameters(), density=density, **extra
    )
    assert resolved(optimizer) == ("auto", DEFAULT_DENSITY_WARMUP, "1d", rule)
    # the warm-up starts at 0.05 under Adam correction (docs/convergence-adam.md), else at DGC's 0.25
    assert optimizer.options.density_warmup_start == (0.05 if rule.startswith("adam_correction") else 0.25)
    settings = agreed_settings(optimizer)
    assert settings["update rule in force"] == rule
    assert settings["options"]["density_warmup_start"] == optimizer.options.density_warmup_start


@pytest.mark.parametrize(
    "base, options, density",
    [
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), {}, 0.01),  # Adam correction's (docs/convergence-adam.md)
        (lambda ps: torch.optim.Adam(ps, lr=0.1), dict(local_residual=False), 0.01),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), dict(adam_correction=False), 0.001),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), dict(recipe="paper"), 0.001),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), dict(density=0.004), 0.004),  # an explicit one wins
        (lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), {}, 0.001),
        (lambda ps: torch.optim.SGD(ps, lr=0.1), {}, 0.001),
    ],
)
def test_the_density_left_unset_is_the_update_rules(hvd, base, options, density):
    """density=None (the default) resolves with the update rule: k, the options every rank
    compares and the options the optimizer reports all hold the resolved number."""
    model = models.make_model()
    optimizer = hvd.DistributedOptimizer(base(model.parameters()), named_parameters=model.named_parameters(), **options)
    assert optimizer.options.density == density
    planned = optimizer.lags_state.planned_k
    sparse = [u for u in optimizer.lags_state.units if planned[u.name] < u.numel]  # the rest sent whole
    assert sparse and all(planned[u.name] == k_for_density(density, u.numel) for u in sparse)
    settings = agreed_settings(optimizer)
    assert settings["options"]["density"] == density


def test_every_rules_density_leaves_the_same_units_sparse():
    """engine_context decides the rule with the paper's density when the density is the rule's:
    right only while every rule's density is at most 0.5 (then k < d exactly where d >= 2)."""
    from lags_hvd.updates import AdamCorrection, ErrorFeedback, LocalAdamCorrection, MomentumCorrection

    for rule in (ErrorFeedback, MomentumCorrection, AdamCorrection, LocalAdamCorrection):
        assert 0 < rule.density <= 0.5
        assert all((k_for_density(rule.density, d) < d) == (d >= 2) for d in range(1, 5000))


def test_an_explicit_warmup_start_wins_over_the_rules(hvd):
    model = models.make_model()
    adamw = hvd.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.1),
        named_parameters=model.named_parameters(),
        density=0.01,
        density_warmup_start=0.25,
    )
    assert adamw.options.density_warmup_start == adamw.lags_state.warmup_start == 0.25


def test_the_paper_recipe_is_algorithm_1_and_explicit_options_win(hvd):
    model = models.make_model()
    _, paper = make(hvd, model, recipe="paper")
    assert resolved(paper) == ("layer", 0, "none", EF)
    _, mixed = make(
        hvd, models.make_model(), recipe="paper", momentum_correction=True, buckets="auto", density_warmup=7
    )
    assert resolved(mixed) == ("auto", 7, "none", MC)
    _, declined = make(hvd, models.make_model(), recipe="dgc", dense_params="none", density_warmup=0)
    assert resolved(declined) == ("auto", 0, "none", MC)
    # TopK-SGD is the paper's baseline unless asked otherwise
    topk = hvd.TopKDistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
        density=0.01,
    )
    assert resolved(topk)[1:] == (0, "none", EF)
    model = models.make_model()
    topk_dgc = hvd.TopKDistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        named_parameters=model.named_parameters(),
        density=0.01,
        recipe="dgc",
    )
    assert resolved(topk_dgc)[1:] == (DEFAULT_DENSITY_WARMUP, "1d", MC)


def test_a_checkpoint_of_another_update_rule_is_refused_by_name(hvd):
    """A state saved under one recipe does not load into an optimizer of another update rule:
    the error names the options (a checkpoint older than the record gets a note saying how
    to resume it), and the optimizer is left as it was."""
    model, paper = make(hvd, recipe="paper")
    for t in range(3):
        step(model, paper, t)
    saved = paper.state_dict()
    assert saved["lags"]["update"] == {
        "recipe": "paper",
        "rule": "error_feedback",
        "momentum_correction": False,
        "dense_params": "none",
    }
    _, dgc = make(hvd, models.make_model(), recipe="dgc")
    before = dgc.state_dict()
    with pytest.raises(
        ValueError,
        match=r"rule='error_feedback' there, 'momentum_correction' here.*dense_params='none' "
        r"there, '1d' here.*recipe 'paper' there, 'dgc' here",
    ):
        dgc.load_state_dict(saved)
    older = {**saved, "lags": {k: v for k, v in saved["lags"].items() if k != "update"}}
    with pytest.raises(ValueError) as refused:
        dgc.load_state_dict(older)
    assert any("recipe='paper'" in note for note in refused.value.__notes__)
    assert dgc.state_dict()["lags"].keys() == before["lags"].keys() and dgc.lags_state.iteration == 0
    _, again = make(hvd, models.make_model(), recipe="paper")
    again.load_state_dict(older)  # the same rule: it resumes
    assert again.lags_state.iteration == 3


def test_density_warmup_schedule_and_dense_params_policy(hvd):
    model, optimizer = make(
        hvd, density=0.01, density_warmup=8, density_warmup_start=0.25, dense_params="1d", buckets="layer"
    )
    sent = []
    for t in range(10):
        sent.append(optimizer.lags_state.k["fc.weight"])
        step(model, optimizer, t)
    # 240 entries, k = 3 (density 3/240 = 0.0125): 0.25 * 0.05 ** (s/4) for stages s = 0..3 of
    # 2 iterations each (60, 28.4, 13.4, 6.3 entries, rounded up), then the plan
    assert sent == [60, 60, 29, 29, 14, 14, 7, 7, 3, 3]
    k = optimizer.lags_state.k
    assert k["conv.bias"] == 3 and k["shift"] == 5 and k["fc.bias"] == 5  # 1-D units whole
    assert "shift" not in optimizer.lags_state.residuals


def test_fidelity_state_resumes_bit_for_bit_and_survives_a_skipped_step(hvd):
    model, optimizer = make(hvd, density=0.05, **FIDELITY_ALL)
    for t in range(3):
        step(model, optimizer, t)
    state = {"model": {n: v.clone() for n, v in model.state_dict().items()}, "optimizer": optimizer.state_dict()}
    assert set(state["optimizer"]["lags"]["velocities"]) == {u.name for u in optimizer.lags_state.units}
    velocities = {n: v.clone() for n, v in optimizer.lags_state.velocities.state_dict().items()}
    optimizer.zero_grad()
    model.fc.weight.register_hook(lambda g: g * float("nan"))
    with pytest.warns(RuntimeWarning, match="non-finite"):
        models.loss_of(model, 0, 3).backward()
        optimizer.step()
    assert all(torch.equal(v, velocities[n]) for n, v in optimizer.lags_state.velocities.state_dict().items())
    resumed_model, resumed = make(hvd, density=0.05, **FIDELITY_ALL)
    resumed_model.load_state_dict(state["model"])
    resumed.load_state_dict(state["optimizer"])
    straight_model, straight = make(hvd, density=0.05, **FIDELITY_ALL)
    for t in range(6):
        step(straight_model, straight, t)
    for t in range(3, 6):
        step(resumed_model, resumed, t)
    for (n, a), (_, b) in zip(straight_model.named_parameters(), resumed_model.named_parameters()):
        assert torch.equal(a, b), n


def test_an_error_in_a_hook_makes_the_optimizer_refuse_to_go_on(hvd):
    """The gradient already holds the residual when selection fails: another step() would add
    it twice. The optimizer refuses every further step; residuals stay the last committed."""
    calls = []

    def failing(x, k):
        calls.append(k)
        if len(calls) == 8:
            raise MemoryError("simulated out of memory")
        index = torch.topk(x.abs(), k).indices
        return x[index], index

    model, optimizer = make(hvd, density=0.1, selector=failing)
    step(model, optimizer, 0)
    residuals = {n: r.clone() for n, r in optimizer.lags_state.residuals.state_dict().items()}
    optimizer.zero_grad()
    with pytest.raises(MemoryError):
        models.loss_of(model, 0, 1).backward()
    for action in (optimizer.step, optimizer.synchronize, optimizer.zero_grad):
        with pytest.raises(RuntimeError, match="this optimizer failed at iteration 1 \\(MemoryError"):
            action()
    assert all(torch.equal(r, residuals[n]) for n, r in optimizer.lags_state.residuals.state_dict().items())


def test_a_checkpoint_without_a_rank_tag_resets_the_residuals(hvd):
    model, optimizer = make(hvd)
    step(model, optimizer)
    state = optimizer.state_dict()
    del state["lags"]["rank"]
    with pytest.warns(UserWarning, match="does not say which rank's residuals it holds"):
        optimizer.load_state_dict(state)
    assert all(r.abs().sum() == 0 for r in optimizer.lags_state.residuals.state_dict().values())


@pytest.mark.parametrize("passes", [0, True, 2.5])
def test_set_backward_passes_per_step_validates(hvd, passes):
    model, optimizer = make(hvd)
    with pytest.raises(ValueError, match="backward_passes_per_step"):
        optimizer.set_backward_passes_per_step(passes)


def test_every_option_is_compared_across_ranks_or_known_to_be_local():
    """A new option must be classified: either every rank must set it alike (it changes the
    math or the collectives, ``shared_settings``), or it is one of these, which do not
    (k itself, from ``layer_densities``, is compared by the step check's digest)."""
    from dataclasses import fields

    from lags_hvd.options import LAGSOptions

    local = {
        "cuda_graphs",
        "exchange_timeout",
        "layer_densities",
        "network_profile",
        "plan_report_dir",
        "trust_selector",
        "verbose",
    }
    options = LAGSOptions(density="adaptive", buckets="auto", aggregation="reduce_scatter", owner_keep=2)
    assert {f.name for f in fields(LAGSOptions)} - set(options.shared_settings()) == local


@pytest.mark.parametrize(
    "base,extra,message",
    [
        (
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
            {},
            "Adam and torch.optim.AdamW themselves.*local_residual=True asks for",
        ),
        (
            lambda ps: torch.optim.Adagrad(ps, lr=0.1),
            {},
            "Adam and torch.optim.AdamW themselves.*local_residual=True asks for",
        ),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), dict(adam_correction=False), "applies under adam_correction"),
        (lambda ps: torch.optim.AdamW(ps, lr=0.1), dict(recipe="paper"), "applies under adam_correction"),
    ],
)
def test_local_residual_refuses_a_rule_whose_residual_is_not_a_step(hvd, base, extra, message):
    model = models.make_model()
    with pytest.raises(ValueError, match=message):
        hvd.DistributedOptimizer(
            base(model.parameters()), named_parameters=model.named_parameters(), local_residual=True, **extra
        )


@pytest.mark.parametrize("kind", ["sgd-paper", "sgd-dgc", "adamw-dgc"])
def test_torchs_step_hooks_run_around_the_update_on_the_merged_gradients(hvd, kind):
    """``register_step_pre_hook`` and ``register_step_post_hook`` (an EMA, a clip, a profiler) run
    once a step around the update, on the merged gradients: under the wrapped optimizer's own
    update (the paper's recipe) and under the corrections that step themselves (momentum and
    Adam correction), after ``load_state_dict`` (where torch would wrap the step again), and not
    on a skipped step. What a pre-hook does to ``.grad`` reaches the update: zeroed, SGD's
    parameters stay as they were (before, AdamW's correction ran hooks only after a load, the
    paper's recipe twice)."""

    def run(zero_at):
        model = models.make_model()
        if kind.startswith("adamw"):
            base = torch.optim.AdamW(model.parameters(), lr=0.01)
        else:
            base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        optimizer = hvd.DistributedOptimizer(
            base, named_parameters=model.named_parameters(), density=0.05, recipe=kind.split("-")[1]
        )
        calls, unchanged = [], []

        def pre(o, args, kwargs):
            calls.append(("pre", o.lags_state.iteration))
            if o.lags_state.iteration == zero_at:
                for p in model.parameters():
                    p.grad.zero_()

        optimizer.register_step_pre_hook(pre)
        optimizer.register_step_post_hook(lambda o, args, kwargs: calls.append(("post", o.lags_state.iteration)))
        nan = model.fc.weight.register_hook(lambda g: g * float("nan"))
        with pytest.warns(RuntimeWarning, match="non-finite gradient"):
            step(model, optimizer, 0)
        nan.remove()
        for t in range(1, 4):
            if t == 2:
                optimizer.load_state_dict(optimizer.state_dict())
            before = [p.detach().clone() for p in model.parameters()]
            step(model, optimizer, t)
            unchanged.append(all(torch.equal(p, b) for p, b in zip(model.parameters(), before)))
        assert optimizer.skipped_steps == 1
        assert calls == [call for t in range(2, 5) for call in (("pre", t), ("post", t))]  # t: exchanges so far
        return [p.detach().clone() for p in model.parameters()], unchanged

    plain, unchanged = run(zero_at=None)
    zeroed, unchanged_zeroed = run(zero_at=2)
    assert not any(unchanged)
    assert any(not torch.equal(a, b) for a, b in zip(plain, zeroed))
    if kind.startswith("sgd"):
        assert unchanged_zeroed == [True, False, False]


def test_the_wrapped_optimizers_own_step_is_refused_around_lags(hvd):
    """``torch.optim.SGD.step(optimizer)``, which code holding the step from before wrapping calls
    (Accelerate's under a GradScaler), would apply gradients no exchange merged: refused before it
    changes anything, and lags_hvd's ``step()`` then goes on as if it had not been tried."""
    model, optimizer = make(hvd, density=0.05)
    reference_model, reference = make(hvd, density=0.05)
    step(reference_model, reference)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.zero_grad()
    models.loss_of(model, 0, 0).backward()
    with pytest.raises(RuntimeError, match=r"SGD.step\(\) was called on a lags_hvd optimizer without lags_hvd's"):
        torch.optim.SGD.step(optimizer)
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    optimizer.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), reference_model.parameters()))
