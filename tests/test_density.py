"""Density and k, the density warm-up schedule and local clipping: pure functions."""

import math

import pytest
import torch

from lags_hvd.clipping import clip_norm_, local_clip_norms
from lags_hvd.density import average_density, check_density, k_for_density, warmup_density


def test_k_for_density():
    """k = max(1, ceil(density * d)), at most d: a fraction of an entry rounds up."""
    assert k_for_density(0.0012, 1000) == 2  # 1.2 entries: floor and round give 1
    assert k_for_density(0.25, 10) == 3  # 2.5 entries: round half to even gives 2
    assert k_for_density(0.001, 10) == 1
    assert k_for_density(0.001, 10_000) == 10
    assert k_for_density(0.0011, 10_000) == 11
    assert k_for_density(1.0, 17) == 17
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="density"):
            k_for_density(bad, 10)


@pytest.mark.parametrize("bad", [0, -1, 1.01, float("nan"), "0.5", True, None])
def test_check_density_names_the_option(bad):
    with pytest.raises(ValueError, match="min_density must be a number in"):
        check_density(bad, "min_density")


def test_average_density():
    assert average_density([1, 10], [100, 900]) == pytest.approx(0.011)
    assert average_density([], []) == 0


def test_warmup_follows_dgcs_schedule():
    """DGC: 0.25, 0.063, 0.016, 0.004, then 0.001, here over 400 iterations in 4 stages."""
    densities = [warmup_density(t, 0.001, 0.25, 400) for t in (0, 99, 100, 200, 300, 399, 400, 10_000)]
    expected = [0.25, 0.25, 0.25 * 0.004**0.25, 0.25 * 0.004**0.5, 0.25 * 0.004**0.75, 0.25 * 0.004**0.75, 0.001, 0.001]
    assert densities == pytest.approx(expected)
    assert [round(expected[i], 3) for i in (0, 2, 3, 4)] == [0.25, 0.063, 0.016, 0.004]


def test_warmup_never_goes_below_the_target_and_is_off_at_zero():
    assert warmup_density(0, 0.5, 0.25, 100) == 0.5  # a denser unit keeps its own
    assert warmup_density(0, 0.001, 0.25, 0) == 0.001  # no warm-up


@pytest.mark.parametrize("averaged,worker_norm", [(True, 2.0 * 2), (False, 2.0 / 2)])
def test_local_clip_budget_is_the_workers_share_of_the_merged_norm(averaged, worker_norm):
    """P = 4 workers: an average of 4 independent gradients of norm C sqrt(P) has norm
    about C, and so has a sum of 4 of norm C / sqrt(P); split by size over the units."""
    norms = local_clip_norms({"a": 300, "b": 100}, max_norm=2.0, world=4, averaged=averaged)
    assert math.isclose(sum(n * n for n in norms.values()), worker_norm**2)
    assert norms["a"] == pytest.approx(math.sqrt(3) * norms["b"])


def test_local_clip_budget_matches_the_merged_norm_of_independent_gradients():
    """The rule's premise, checked: P independent equal-norm gradients clipped to the
    budget merge (averaged) to about the global norm C."""
    gen = torch.Generator().manual_seed(0)
    world, n, max_norm = 8, 20_000, 0.25
    budget = local_clip_norms({"u": n}, max_norm, world, averaged=True)["u"]
    grads = [torch.randn(n, generator=gen) for _ in range(world)]
    clipped = [g * (budget / g.norm()) for g in grads]
    assert torch.stack(clipped).mean(0).norm().item() == pytest.approx(max_norm, rel=0.02)


def test_clip_norm_matches_torchs_clip_grad_norm():
    gen = torch.Generator().manual_seed(0)
    ours = [torch.randn(10, generator=gen), torch.randn(3, 3, generator=gen)]
    theirs = [t.clone().requires_grad_() for t in ours]
    for t, g in zip(theirs, ours):
        t.grad = g.clone()
    clip_norm_(ours, 0.5)
    torch.nn.utils.clip_grad_norm_(theirs, 0.5)
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b.grad)
    small = [torch.full((4,), 0.01)]
    clip_norm_(small, 10.0)
    assert torch.equal(small[0], torch.full((4,), 0.01))  # under the bound: untouched
    poisoned = [torch.tensor([1.0, float("inf")])]
    clip_norm_(poisoned, 1.0)
    assert not torch.isfinite(poisoned[0]).all()  # stays detectable
