"""Density planner on synthetic profiles with known answers."""
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lags_hvd.planner import CostModel, NetworkModel, UnitProfile, plan_densities, simulate
from lags_hvd.density import k_for_density


def network(alpha=1e-4, beta=1e-8, world=4):
    return NetworkModel(world, CostModel(alpha, beta), CostModel(2 * alpha, 2 * beta))


def backprop(sizes, gap=0.01, select=0.0):
    """Units ready one after another, `gap` seconds apart (last layer first)."""
    return [UnitProfile(f"u{i}", n, i * gap, select) for i, n in enumerate(sizes)]


SIZES = [1_000_000, 50_000, 2_000_000, 300, 500_000, 10]


def test_free_communication_sends_everything_dense():
    plans = plan_densities(backprop(SIZES), network(0.0, 0.0))
    assert all(p.dense and p.density == 1.0 and p.k == p.numel for p in plans)


def test_zero_compute_leaves_min_density():
    units = [UnitProfile(f"u{i}", n, 0.0, 0.0) for i, n in enumerate(SIZES)]
    plans = plan_densities(units, network(), min_density=0.001)
    for p in plans:
        assert p.k == k_for_density(0.001, p.numel) and not p.dense or p.numel <= 10


def test_max_density_below_one_is_never_dense():
    plans = plan_densities(backprop(SIZES), network(0.0, 0.0), max_density=0.5)
    for p in plans:
        assert not p.dense or p.numel == 1
        assert p.k <= k_for_density(0.5, p.numel)


def test_hand_computed_two_layers():
    # link: 1 ms + 1 us per byte. Unit a ready at 0, unit b at 10 ms; budget from b.
    net = NetworkModel(2, CostModel(1e-3, 1e-6), CostModel(1e-3, 1e-6))
    a = UnitProfile("a", 100_000, 0.0, 0.0)
    b = UnitProfile("b", 100_000, 0.010, 0.0)
    plan_a, plan_b = plan_densities([b, a], net, min_density=0.001, slack=0.0)
    # a's window is 10 ms: 1 ms latency + 9000 bytes. 1125 entries would need 2 x 4504
    # bytes (each section padded to 8); 1124 need 2 x 4496 = 8992.
    assert plan_a.name == "a" and plan_a.k == 1124 and plan_a.end == pytest.approx(0.001 + 8992e-6)
    # b: the budget is its own min-density exchange (100 entries = 800 bytes)
    assert plan_b.k == 100 and plan_b.end == pytest.approx(0.010 + 1e-3 + 800e-6)


def test_dense_when_allreduce_is_no_dearer_than_sparse():
    net = NetworkModel(2, CostModel(5e-3, 1e-9), CostModel(1e-3, 1e-9))  # allgather latency is high
    plans = plan_densities(backprop([1000, 1000], gap=0.0001), net, min_density=0.01)
    assert all(p.dense for p in plans)


def test_bad_arguments():
    with pytest.raises(ValueError, match="min_density <= max_density"):
        plan_densities(backprop(SIZES), network(), min_density=0.5, max_density=0.1)
    with pytest.raises(ValueError, match="slack"):
        plan_densities(backprop(SIZES), network(), slack=-1)
    with pytest.raises(ValueError, match="alpha, beta >= 0"):
        CostModel(-1.0, 0.0)
    assert plan_densities([], network()) == []


profiles = st.lists(st.tuples(st.integers(1, 3_000_000), st.floats(0, 0.2), st.floats(0, 0.005)),
                    min_size=1, max_size=12)


def units_from(raw):
    return [UnitProfile(f"u{i}", n, ready, select) for i, (n, ready, select) in enumerate(raw)]


@settings(max_examples=300, deadline=None)
@given(profiles, st.floats(1e-6, 1e-2), st.floats(1e-10, 1e-6), st.sampled_from([0.001, 0.01, 0.1]),
       st.floats(0, 0.1))
def test_schedule_ends_within_budget(raw, alpha, beta, min_density, slack):
    units = units_from(raw)
    net = network(alpha, beta)
    plans = plan_densities(units, net, min_density=min_density, slack=slack)
    ks = {p.name: p.k for p in plans}
    ordered = sorted(units, key=lambda u: (u.ready + u.select, u.name))
    floor = {u.name: k_for_density(min_density, u.numel) for u in units}
    end_min = simulate(ordered, floor, net)[-1][1]
    backprop_end = max(u.ready + u.select for u in units)
    budget = max(backprop_end, end_min) + slack * (backprop_end - min(u.ready for u in units))
    end = simulate(ordered, ks, net)[-1][1]
    assert end <= budget * (1 + 1e-9) + 1e-12
    predicted = [t for p in plans for t in (p.start, p.end)]
    assert predicted == pytest.approx([t for pair in simulate(ordered, ks, net) for t in pair])
    for p in plans:
        assert floor[p.name] <= p.k <= p.numel


@settings(max_examples=300, deadline=None)
@given(profiles, st.floats(1e-6, 1e-2), st.floats(1e-10, 1e-6))
def test_densities_never_decrease_when_bandwidth_grows(raw, alpha, beta):
    units = units_from(raw)
    previous = None
    for scale in (1.0, 0.5, 0.1, 0.01):
        plans = {p.name: p.density for p in plan_densities(units, network(alpha, beta * scale))}
        if previous is not None:
            for name, density in plans.items():
                assert density >= previous[name] - 1e-12, (name, scale)
        previous = plans
