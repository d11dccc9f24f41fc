"""Adaptive density in one process, and the network profile file."""

import json
import math
import sys
import types

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from torch import nn

from lags_hvd.planner import CostModel, NetworkModel, UnitProfile
from lags_hvd.profiling import (
    BackwardTimer,
    DeviceStamps,
    fit_cost_model,
    load_network_profile,
    monotone,
    save_network_profile,
)
from lags_hvd.report import load_plan


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def train(hvd, model, optimizer, steps, sent=None):
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(
            model(torch.randn(32, 64, generator=gen)), torch.randint(10, (32,), generator=gen)
        ).backward()
        optimizer.step()


SLOW_LINK = NetworkModel(1, CostModel(1e-2, 1e-7), CostModel(1e-2, 1e-7))


def make_adaptive(hvd, model, **options):
    options = dict(dict(density="adaptive", min_density=0.01, network_profile=SLOW_LINK, recipe="paper"), **options)
    return hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(), **options
    )


def test_adaptive_plans_after_warmup_and_reports(hvd, tmp_path):
    model = mlp()
    optimizer = make_adaptive(
        hvd, model, warmup_iterations=3, plan_report_dir=str(tmp_path), max_slowdown=10.0
    )  # keep whatever is measured
    k_min = dict(optimizer.lags_state.k)
    train(hvd, model, optimizer, 2)
    assert optimizer.plan is None and optimizer.lags_state.k == k_min  # still warming up
    train(hvd, model, optimizer, 1)
    plan = optimizer.plan
    assert plan is not None and {p.name: p.k for p in plan} == optimizer.lags_state.k
    assert all(p.k >= k_min[p.name] for p in plan) and any(p.k > k_min[p.name] for p in plan)
    assert (tmp_path / "plan-3.json").exists() and (tmp_path / "plan-3.png").stat().st_size > 1000
    assert load_plan(tmp_path / "plan-3.json") == plan
    train(hvd, model, optimizer, 3)
    assert [e["event"] for e in optimizer.adaptive_history] == ["plan", "keep"]


class ScriptedTimer:
    """Stands in for BackwardTimer: iteration times are given, the profile is fixed."""

    def __init__(self, units):
        self.iteration_seconds = []
        self._units = units

    def profile(self, units):
        return [UnitProfile(u.name, u.numel, 0.001 * i, 0.0) for i, u in enumerate(units)]


def controller(hvd, **options):
    from lags_hvd.adaptive import AdaptiveDensity
    from lags_hvd.collectives.horovod import HorovodCollectives
    from lags_hvd.layout import build_units, name_parameters
    from lags_hvd.options import LAGSOptions

    model = mlp()
    groups = [{"params": list(model.parameters())}]
    units = build_units(groups, name_parameters(groups, model.named_parameters()))
    opts = LAGSOptions(
        **dict(
            dict(density="adaptive", min_density=0.01, warmup_iterations=3, replan_every=20, network_profile=SLOW_LINK),
            **options,
        )
    )
    adaptive = AdaptiveDensity(opts, HorovodCollectives(), units)
    floor = {u.name: max(1, -(-u.numel // 100)) for u in units}
    adaptive.set_floor(floor)
    return adaptive, ScriptedTimer(units), floor


def drive(adaptive, timer, seconds, start):
    """One iteration of `seconds` ends at iteration `start`; returns the decision."""
    timer.iteration_seconds.append(seconds)
    return adaptive.after_synchronize(start, timer)


def test_loop_keeps_a_plan_that_is_not_slower(hvd):
    adaptive, timer, floor = controller(hvd)
    decisions = [drive(adaptive, timer, 1.0, i) for i in range(1, 4)]
    assert decisions[:2] == [None, None] and decisions[2] is not None  # plan after 3 iterations
    plan_k = decisions[2]
    assert all(plan_k[n] >= floor[n] for n in floor) and plan_k != floor
    assert [drive(adaptive, timer, 1.01, i) for i in range(4, 7)] == [None, None, None]
    assert adaptive.history[-1]["event"] == "keep" and adaptive.plan is not None
    assert all(drive(adaptive, timer, 1.0, i) is None for i in range(7, 20))
    assert drive(adaptive, timer, 1.0, 20) == floor  # re-plan: fresh baseline


def test_loop_backs_off_then_gives_up(hvd):
    adaptive, timer, floor = controller(hvd)
    for i in range(1, 4):
        plan_k = drive(adaptive, timer, 1.0, i)
    iteration, previous = 4, plan_k
    for _ in range(3):  # three halvings
        decisions = [drive(adaptive, timer, 2.0, iteration + j) for j in range(3)]
        iteration += 3
        halved = decisions[-1]
        assert adaptive.history[-1]["event"] == "back off"
        assert all(halved[n] == floor[n] + (previous[n] - floor[n]) // 2 for n in floor)
        previous = halved
    decisions = [drive(adaptive, timer, 2.0, iteration + j) for j in range(3)]
    assert decisions[-1] == floor and adaptive.plan is None  # back to min density


def test_free_network_makes_every_layer_dense(hvd):
    model = mlp()
    free = NetworkModel(1, CostModel(0.0, 0.0), CostModel(0.0, 0.0))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
        density="adaptive",
        warmup_iterations=2,
        network_profile=free,
        recipe="paper",
    )
    train(hvd, model, optimizer, 3)
    assert all(optimizer.lags_state.is_dense(u) for u in optimizer.lags_state.units)


def test_adaptive_checkpoint_restores_the_k_in_force(hvd):
    model = mlp()
    optimizer = make_adaptive(hvd, model, warmup_iterations=2, max_slowdown=10.0)
    train(hvd, model, optimizer, 3)
    assert optimizer.plan is not None
    resumed = make_adaptive(hvd, mlp(), warmup_iterations=2)
    resumed.load_state_dict(optimizer.state_dict())
    assert resumed.lags_state.k == optimizer.lags_state.k
    assert resumed.lags_state.iteration == 3


def test_network_profile_round_trip(tmp_path):
    model = NetworkModel(4, CostModel(1e-4, 2e-9), CostModel(2e-4, 1e-9, ((1024, 3e-3), (8192, 4e-3))))
    path = tmp_path / "net.json"
    save_network_profile(model, path, {"allgather": [[1, 2.0]]})
    assert load_network_profile(path, world_size=4) == model
    assert load_network_profile(path).allreduce(4608) == pytest.approx(3.5e-3)  # through the points


def test_a_profile_without_points_still_loads(tmp_path):
    """Profiles written before the cost models kept their samples: the line alone."""
    path = tmp_path / "net.json"
    path.write_text(
        json.dumps(
            {"world_size": 2, "allgather": {"alpha": 1e-3, "beta": 1e-6}, "allreduce": {"alpha": 2e-3, "beta": 1e-6}}
        )
    )
    model = load_network_profile(path, world_size=2)
    assert model.allgather.points == () and model.allgather(1000) == pytest.approx(2e-3)


@pytest.mark.parametrize(
    "content,message",
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        (json.dumps({"world_size": 1, "allgather": {"alpha": 0.1}}), "lacks a field"),
        (json.dumps({"world_size": 1, "allreduce": {"alpha": 0.1, "beta": 0.0}}), "lacks a field"),
        (
            json.dumps({"world_size": 3, "allgather": {"alpha": 0, "beta": 0}, "allreduce": {"alpha": 0, "beta": 0}}),
            "measured with 3 workers, this job has 1",
        ),
        (
            json.dumps({"world_size": 1, "allgather": {"alpha": -1, "beta": 0}, "allreduce": {"alpha": 0, "beta": 0}}),
            "alpha, beta >= 0",
        ),
        (
            json.dumps(
                {
                    "world_size": 1,
                    "allgather": {"alpha": 0, "beta": 0, "points": [[8, 2.0], [4, 3.0]]},
                    "allreduce": {"alpha": 0, "beta": 0},
                }
            ),
            "points need",
        ),
        (
            json.dumps(
                {
                    "world_size": 1,
                    "allgather": {"alpha": 0, "beta": 0, "points": [[4, 2.0], [8, 1.0]]},
                    "allreduce": {"alpha": 0, "beta": 0},
                }
            ),
            "non-decreasing",
        ),
        (
            json.dumps(
                {
                    "world_size": 1,
                    "allgather": {"alpha": 0, "beta": 0, "points": [[4, "fast"]]},
                    "allreduce": {"alpha": 0, "beta": 0},
                }
            ),
            "could not convert",
        ),
    ],
)
def test_bad_network_profile_is_refused(hvd, tmp_path, content, message):
    path = tmp_path / "net.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_network_profile(path, world_size=1)
    model = mlp()
    with pytest.raises(ValueError, match=message):  # at construction, before any training
        hvd.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            named_parameters=model.named_parameters(),
            density="adaptive",
            network_profile=str(path),
        )


def test_missing_network_profile_file(hvd, tmp_path):
    with pytest.raises(ValueError, match="cannot read network profile"):
        load_network_profile(tmp_path / "absent.json")


def test_fit_cost_model_recovers_a_line():
    sizes = [1e3, 1e4, 1e5, 1e6]
    model = fit_cost_model(sizes, [2e-4 + 3e-9 * s for s in sizes])
    assert model.alpha == pytest.approx(2e-4) and model.beta == pytest.approx(3e-9)
    for nbytes in (0, 500, 5e3, 5e5, 1e6, 4e6):  # the points lie on the line, and so does the model
        assert model(nbytes) == pytest.approx(2e-4 + 3e-9 * max(nbytes, 1e3))
    with pytest.raises(ValueError, match="two different sizes"):
        fit_cost_model([10, 10], [1.0, 2.0])


# A token-bucket link as make bench-quick profiled it (2 workers, 5 Mbit/s): messages within the
# burst pass at loopback speed, larger ones at the rate. No line follows both.
SHAPED_ALLGATHER = [(1024, 4.45e-3), (8192, 6.74e-3), (65536, 0.2148), (262144, 0.8460)]


def test_fit_cost_model_follows_a_knee_the_line_misses():
    model = fit_cost_model(*zip(*SHAPED_ALLGATHER))
    assert model.alpha == 0.0  # the least-squares line has no latency at all ...
    assert model.alpha + model.beta * 8192 > 3 * 6.74e-3  # ... and prices 8 KB at four times its cost
    for nbytes, seconds in SHAPED_ALLGATHER:  # the model goes through every sample
        assert model(nbytes) == pytest.approx(seconds)
    assert model(100) == pytest.approx(4.45e-3)  # below the first: its latency
    assert model(2 * 262144) == pytest.approx(0.8460 + model.beta * 262144)  # beyond: the line's slope


def test_fit_cost_model_averages_repeats_and_never_lets_a_larger_message_cost_less():
    model = fit_cost_model([1024, 1024, 8192, 65536], [2e-3, 4e-3, 2e-3, 9e-3])  # 1 KB: 3 ms on average
    assert [t for _, t in model.points] == pytest.approx([2.5e-3, 2.5e-3, 9e-3])  # 3 and 2 pooled
    assert monotone([1.0, 3.0, 2.0, 4.0]) == [1.0, 2.5, 2.5, 4.0]
    assert monotone([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]
    assert monotone([1.0, 2.0]) == [1.0, 2.0]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(1e-6, 1.0), min_size=2, max_size=6), st.floats(0, 2.0), st.floats(0, 1e-6))
@example(times=[1.0, 0.5], seconds=1.0, beta=5e-324)  # a subnormal slope: the room overflows to inf
def test_max_bytes_inverts_the_cost_model(times, seconds, beta):
    """The largest message within ``seconds`` fits, and nothing much larger does."""
    sizes = [1024 * 4**i for i in range(len(times))]
    model = CostModel(0.0, beta, tuple(zip(sizes, monotone(times))))
    room = model.max_bytes(seconds)
    if room < 0:
        assert seconds < model(0)
    elif math.isinf(room):  # any message fits: no slope, or one so small that the room overflows
        assert seconds >= model.points[-1][1] and model(sys.float_info.max / 2) <= seconds
    else:
        assert model(room) <= seconds + 1e-12
        assert model(room * 1.001 + 1) > seconds or model(room * 1.001 + 1) == pytest.approx(seconds)


def test_backward_timer_profiles_relative_to_first_gradient():
    clock = iter([10.0, 10.5, 12.0]).__next__  # read once per end_iteration
    timer = BackwardTimer(window=2, clock=clock)
    for offset in (100.0, 200.0, 300.0):
        timer.unit_ready("b", offset + 1.0, offset + 1.1)  # stamps: ready, selection done
        timer.unit_ready("a", offset + 3.0, offset + 3.2)
        timer.end_iteration()

    class Unit:
        def __init__(self, name):
            self.name, self.numel, self.dtype = name, 10, torch.float32

    profiles = {p.name: p for p in timer.profile([Unit("a"), Unit("b"), Unit("unused")])}
    assert profiles["b"].ready == 0.0 and profiles["a"].ready == 2.0
    assert profiles["a"].select == pytest.approx(0.2) and profiles["b"].select == pytest.approx(0.1)
    assert profiles["unused"].ready == 2.0 and profiles["unused"].select == 0.0
    assert timer.iterations == 2
    assert list(timer.iteration_seconds) == [0.5, 1.5]
    assert timer.last_synchronize["select"] == pytest.approx(0.3)


class FakeEvent:
    """``torch.cuda.Event``'s timing API over a fake device clock (milliseconds)."""

    device_ms = 0.0
    waits = 0

    def record(self):
        self.at = FakeEvent.device_ms

    def synchronize(self):
        FakeEvent.waits += 1

    def elapsed_time(self, other):
        return other.at - self.at


def test_device_stamps_time_the_device_with_one_wait_per_iteration_and_reused_events():
    """On a GPU the hooks' stamps are CUDA events: the profile is the device's times (here a fake
    device clock that has nothing to do with the host's), read with one wait per iteration."""
    made = []
    stamps = DeviceStamps(event=lambda: made.append(FakeEvent()) or made[-1])
    timer = BackwardTimer(window=2, stamps=stamps)
    FakeEvent.waits = 0
    for _ in range(3):
        for name, ready_ms, select_ms in (("b", 4.0, 1.0), ("a", 10.0, 3.0)):
            FakeEvent.device_ms += ready_ms
            ready = timer.stamp()
            FakeEvent.device_ms += select_ms
            timer.unit_ready(name, ready, timer.stamp())
        timer.end_iteration()
    profiles = {
        p.name: p for p in timer.profile([types.SimpleNamespace(name=n, numel=10, dtype=torch.float32) for n in "ab"])
    }
    assert profiles["b"].ready == 0.0 and profiles["a"].ready == pytest.approx(0.011)  # 1 + 10 ms after b
    assert profiles["b"].select == pytest.approx(0.001) and profiles["a"].select == pytest.approx(0.003)
    assert FakeEvent.waits == 3 and len(made) == 4  # one wait per iteration; the 4 events reused


def test_under_adam_correction_a_sparse_unit_is_never_planned_whole(monkeypatch):
    """Adam correction keeps each rank's own moments for a sparse unit and the ranks' shared ones
    for a unit sent whole: a plan that sent a once-sparse unit whole would step it with this
    rank's moments on the merged gradient, and the ranks' models would part without a word.
    Such a unit gets all its entries but one; one dense from the floor stays whole."""
    from types import SimpleNamespace

    import lags_hvd.adaptive as adaptive_module
    from lags_hvd.planner import UnitPlan

    def whole(name, numel):
        return UnitPlan(name, numel, ready=0.0, density=1.0, k=numel, dense=True, start=0.0, end=0.0)

    monkeypatch.setattr(adaptive_module, "plan_densities", lambda *args: [whole("sparse", 100), whole("bias", 4)])
    timer = SimpleNamespace(profile=lambda units: None)
    for whole_after_sparse, expected in [(True, {"sparse": 100, "bias": 4}), (False, {"sparse": 99, "bias": 4})]:
        adaptive = object.__new__(adaptive_module.AdaptiveDensity)  # the planning step alone
        adaptive.options = SimpleNamespace(min_density=0.01, max_density=1.0, plan_slack=0.0)
        adaptive.network, adaptive.units, adaptive.whole_after_sparse = None, [], whole_after_sparse
        adaptive.set_floor({"sparse": 1, "bias": 4})
        plan = adaptive._make_plan(timer)
        assert {p.name: p.k for p in plan} == expected
        assert [p.dense for p in plan] == [whole_after_sparse, True]
