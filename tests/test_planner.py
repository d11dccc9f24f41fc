"""Density planner on synthetic profiles with known answers."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lags_hvd.density import k_for_density
from lags_hvd.planner import CostModel, NetworkModel, UnitProfile, plan_densities, simulate


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


profiles = st.lists(
    st.tuples(st.integers(1, 3_000_000), st.floats(0, 0.2), st.floats(0, 0.005)), min_size=1, max_size=12
)


def units_from(raw):
    return [UnitProfile(f"u{i}", n, ready, select) for i, (n, ready, select) in enumerate(raw)]


@settings(max_examples=300, deadline=None)
@given(profiles, st.floats(1e-6, 1e-2), st.floats(1e-10, 1e-6), st.sampled_from([0.001, 0.01, 0.1]), st.floats(0, 0.1))
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


# ---------------------------------------------------------------------- bucket planning
from lags_hvd.planner import EngineCosts, ParamProfile, plan_buckets, predict_iteration  # noqa: E402


def link(alpha: float, beta: float, world: int = 4) -> NetworkModel:
    return NetworkModel(world, CostModel(alpha, beta), CostModel(alpha, beta))


def test_pipelining_wins_per_layer_when_start_ups_are_free():
    """Gradients ready 1 ms apart, each exchange 1 ms, no start-up or hook cost: per-layer
    exchange hides all but the last; any merge delays an exchange that had the link free."""
    params = [ParamProfile(f"p{i}", 1000, 1e-3 * i, 0.01) for i in range(5)]
    per_entry_s = 1e-3 / (10 * 8)  # k = 10 entries of 8 bytes: 1 ms
    buckets, times = plan_buckets(params, link(0.0, per_entry_s / 1), EngineCosts(0.0, 0.0))
    assert buckets == [[f"p{i}"] for i in range(5)]
    assert times["chosen"] == pytest.approx(5e-3) and times["single"] > 5.9e-3


def test_a_plan_through_the_measured_samples_beats_one_from_their_fitted_line():
    """The token-bucket link profiled by make bench-quick: the least-squares line has no
    start-up, so an 80-byte message looks nearly free and several buckets look as good as
    one; through the samples every small message costs 4.5 ms. On that link the plan
    made from the samples is the faster one."""
    from lags_hvd.profiling import fit_cost_model

    samples = [(1024, 4.45e-3), (8192, 6.74e-3), (65536, 0.2148), (262144, 0.8460)]
    measured = fit_cost_model(*zip(*samples))
    line = CostModel(measured.alpha, measured.beta)
    params = [ParamProfile(f"p{i}", 1000, 1e-3 * i, 0.01) for i in range(20)]  # 80-byte messages
    costs, true_link = EngineCosts(2e-5, 1e-9), NetworkModel(2, measured, measured)
    from_line, _ = plan_buckets(params, NetworkModel(2, line, line), costs)
    from_samples, times = plan_buckets(params, true_link, costs)
    position = {p.name: i for i, p in enumerate(params)}
    on_the_link = [
        predict_iteration(params, [[position[n] for n in b] for b in plan], true_link, costs)
        for plan in (from_line, from_samples)
    ]
    assert len(from_samples) < len(from_line)
    assert on_the_link[1] == pytest.approx(times["chosen"])
    assert on_the_link[0] - on_the_link[1] > 3.5e-3  # the line's plan pays most of a start-up more
    assert times["layer"] > 20 * 4.45e-3


def test_one_bucket_wins_when_every_exchange_costs_a_large_start_up():
    """A 5 ms start-up per collective against 0.1 ms of backprop: one bucket pays it once."""
    params = [ParamProfile(f"p{i}", 1000, 1e-5 * i, 0.01) for i in range(20)]
    buckets, times = plan_buckets(params, link(5e-3, 1e-10), EngineCosts(2e-5, 1e-9))
    assert buckets == [[f"p{i}" for i in range(20)]]
    assert times["layer"] > 19 * 5e-3


def every_segment_plan(params: list[ParamProfile], most_kinds: int):
    """Every cut of the positions 0..n-1 into segments, each segment one bucket per kind
    it holds (at most ``most_kinds``), buckets in the order of their last members: the
    brute-force oracle of ``plan_buckets``' exact search (2**(n-1) cuts)."""
    n = len(params)
    for mask in range(2 ** (n - 1)):
        segments, current = [], [0]
        for i in range(1, n):
            if mask >> (i - 1) & 1:
                segments.append(current)
                current = [i]
            else:
                current.append(i)
        segments.append(current)
        plan = []
        for segment in segments:
            kinds = []
            for i in segment:
                if params[i].kind not in kinds:
                    kinds.append(params[i].kind)
            if len(kinds) > most_kinds:
                break
            buckets = [[i for i in segment if params[i].kind == kind] for kind in kinds]
            plan += sorted(buckets, key=max)
        else:
            yield plan


def brute_force_best(params, network, costs) -> float:
    from lags_hvd.planner import MAX_SEGMENT_KINDS

    ordered = sorted(params, key=lambda p: (p.ready, p.name))
    return min(
        predict_iteration(ordered, plan, network, costs) for plan in every_segment_plan(ordered, MAX_SEGMENT_KINDS)
    )


def test_small_parameters_merge_between_large_ones():
    """Large layers 2 ms apart, each followed within microseconds by three biases: the
    plan is neither per-layer nor one bucket, and no cut of the 16 parameters is
    predicted faster (brute force over all 32,768)."""
    params = []
    for layer in range(4):
        t = 2e-3 * layer
        params.append(ParamProfile(f"w{layer}", 1_000_000, t, 0.001))
        params += [ParamProfile(f"b{layer}.{j}", 100, t + 1e-6 * (j + 1), 0.001) for j in range(3)]
    network = link(3e-4, 1.5e-3 / (1000 * 8))  # a 1000-entry exchange: 0.3 + 1.5 ms
    costs = EngineCosts(3e-5, 1e-9, 1e-5)
    buckets, times = plan_buckets(params, network, costs)
    assert times["chosen"] < min(times["layer"], times["single"])
    assert 1 < len(buckets) < len(params)
    assert times["chosen"] == pytest.approx(brute_force_best(params, network, costs), rel=1e-12)
    # the biases' own rule (each layer with the biases just after it) is a good plan, not the best
    with_biases = [[4 * layer + j for j in range(4)] for layer in range(4)]
    assert times["chosen"] < predict_iteration(params, with_biases, network, costs)


plannable = st.lists(
    st.tuples(st.integers(1, 2_000_000), st.floats(0.0, 5e-3), st.sampled_from([0.001, 0.01, 1.0]), st.integers(0, 1)),
    min_size=1,
    max_size=9,
)


@settings(max_examples=200, deadline=None)
@given(
    plannable,
    st.floats(0.0, 2e-3),
    st.floats(0.0, 1e-8),
    st.floats(0.0, 1e-4),
    st.floats(0.0, 1e-9),
    st.floats(0.0, 1e-4),
    st.sampled_from(["allgather", "reduce_scatter"]),
)
def test_the_plan_is_the_best_cut_into_segments(raw, alpha, beta, fixed, per_element, merge, aggregation):
    """The exact search finds the best of every cut into segments (each one bucket per
    kind), ``plan_buckets`` predicts no worse, and what it returns is a plan of that
    prediction (kinds: density and a group)."""
    from dataclasses import replace

    params = [
        ParamProfile(f"p{i}", numel, ready, density, kind=(group, density))
        for i, (numel, ready, density, group) in enumerate(raw)
    ]
    network = replace(link(alpha, beta), aggregation=aggregation)
    costs = EngineCosts(fixed, per_element, merge)
    buckets, times = plan_buckets(params, network, costs)
    best = brute_force_best(params, network, costs)
    assert times["optimal"] == pytest.approx(best, rel=1e-9, abs=1e-15)
    assert times["chosen"] <= times["optimal"]
    ordered = sorted(params, key=lambda p: (p.ready, p.name))
    position = {p.name: i for i, p in enumerate(ordered)}
    plan = [[position[name] for name in bucket] for bucket in buckets]
    assert sorted(i for bucket in plan for i in bucket) == list(range(len(params)))
    assert predict_iteration(ordered, plan, network, costs) == pytest.approx(times["chosen"], rel=1e-12)
    assert all(len({ordered[i].kind for i in bucket}) == 1 for bucket in plan)


def test_a_model_beyond_the_exact_search_gets_a_valid_plan_no_worse_than_the_rules():
    """More than MAX_ATOMS parameters: the search runs over merged runs and still returns
    every parameter once, in ready order, predicted no slower than per-layer or one bucket."""
    from lags_hvd.planner import MAX_ATOMS

    n = MAX_ATOMS + 100
    params = [ParamProfile(f"p{i}", 64 if i % 3 else 50_000, 2e-5 * i, 0.001) for i in range(n)]
    network, costs = link(2e-4, 1e-8), EngineCosts(3e-5, 1e-9, 1e-6)
    buckets, times = plan_buckets(params, network, costs)
    assert [name for bucket in buckets for name in bucket] == [p.name for p in params]
    assert times["chosen"] <= min(times["layer"], times["single"])
    assert 1 < len(buckets) < n


def test_kinds_are_never_merged_and_prediction_follows_the_formula():
    params = [ParamProfile("a", 10, 0.0, 0.1, kind=(0,)), ParamProfile("b", 10, 0.0, 0.1, kind=(1,))]
    buckets, _ = plan_buckets(params, link(1.0, 0.0), EngineCosts(0.0, 0.0))
    assert buckets == [["a"], ["b"]]
    # launch = 1 ms + hooks (2 us + 10 * 1 ns); one start-up of 1 ms; merge 3 us
    one = [ParamProfile("a", 10, 1e-3, 0.1), ParamProfile("b", 10, 1e-3, 0.1)]
    t = predict_iteration(one, [[0, 1]], link(1e-3, 0.0), EngineCosts(2e-6, 1e-9, 3e-6))
    assert t == pytest.approx(1e-3 + 2e-6 + 20e-9 + 1e-3 + 3e-6)
    with pytest.raises(ValueError, match="engine costs"):
        EngineCosts(-1.0, 0.0)


def test_the_cost_model_knows_the_aggregation():
    """reduce_scatter: the split costs an allgather of k rows / P, the gather one of each
    owner's share; allgather: one message of k entries (indices and values, padded to 8)."""
    from dataclasses import replace

    from lags_hvd.adaptive import network_from
    from lags_hvd.options import LAGSOptions
    from lags_hvd.planner import exchange_cost

    gather = CostModel(1e-3, 1e-8)
    network = NetworkModel(4, gather, CostModel(2e-3, 1e-8))
    unit = UnitProfile("u", 100_000, 0.0, 0.0)
    assert exchange_cost(unit, 100, network) == pytest.approx(1e-3 + 1e-8 * 800)
    rs = replace(network, aggregation="reduce_scatter")
    assert exchange_cost(unit, 100, rs) == pytest.approx(2e-3 + 1e-8 * (800 / 4 + 25 * 8))
    assert exchange_cost(unit, 2, rs) == pytest.approx(2e-3 + 1e-8 * (16 / 4 + 8))  # k < P: two owners
    assert exchange_cost(unit, 100_000, rs) == exchange_cost(unit, 100_000, network)  # dense: an allreduce
    keep = replace(rs, owner_keep=2.5)  # the owners keep ceil(2.5 k) = 250 entries, 63 for the busiest
    assert exchange_cost(unit, 100, keep) == pytest.approx(2e-3 + 1e-8 * (800 / 4 + 63 * 8))
    from_options = network_from(network.to_dict(), 4, LAGSOptions(aggregation="reduce_scatter", owner_keep=2))
    assert (from_options.aggregation, from_options.owner_keep) == ("reduce_scatter", 2)


def test_dense_biases_between_sparse_weights_do_not_split_the_plan():
    """Each sparse weight followed by two dense biases, a 5 ms start-up per collective
    against 0.2 ms of backprop: one bucket of weights and one of biases, not the twenty
    runs that cuts of the ready order into one kind each would need."""
    params = []
    for layer in range(10):
        params.append(ParamProfile(f"w{layer}", 100_000, 2e-5 * layer, 0.001, kind=("sparse",)))
        params += [
            ParamProfile(f"b{layer}.{j}", 64, 2e-5 * layer + 1e-6 * (j + 1), 1.0, kind=("dense",)) for j in range(2)
        ]
    network, costs = link(5e-3, 1e-10), EngineCosts(2e-5, 1e-9)
    buckets, times = plan_buckets(params, network, costs)
    assert buckets == [[f"w{layer}" for layer in range(10)], [f"b{layer}.{j}" for layer in range(10) for j in range(2)]]
    runs_of_one_kind = [[3 * layer] for layer in range(10)] + [[3 * layer + 1, 3 * layer + 2] for layer in range(10)]
    assert times["chosen"] < predict_iteration(params, runs_of_one_kind, network, costs) - 15 * 5e-3


def test_the_exact_search_is_quick_on_a_large_model_of_two_kinds():
    """Inception-v4's size (449 parameters, a third of them dense 1-D): planned in seconds."""
    import time

    params = [
        ParamProfile(f"p{i:03d}", 64 if i % 3 else 50_000, 2e-5 * i, 1.0 if i % 3 else 0.001, kind=(i % 3 == 0,))
        for i in range(449)
    ]
    began = time.perf_counter()
    buckets, times = plan_buckets(params, link(2e-4, 1e-8), EngineCosts(3e-5, 1e-9, 1e-6))
    assert time.perf_counter() - began < 20
    assert sorted(name for bucket in buckets for name in bucket) == [p.name for p in params]
    assert times["chosen"] <= min(times["layer"], times["single"])
