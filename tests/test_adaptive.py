"""Adaptive density in one process, and the network profile file."""
import json

import pytest
import torch
from torch import nn

from lags_hvd.planner import CostModel, NetworkModel
from lags_hvd.profiling import BackwardTimer, fit_cost_model, load_network_profile, save_network_profile
from lags_hvd.report import load_plan


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 10))


def train(hvd, model, optimizer, steps, sent=None):
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(torch.randn(32, 64, generator=gen)),
                                    torch.randint(10, (32,), generator=gen)).backward()
        optimizer.step()


def test_adaptive_plans_after_warmup_and_replans(hvd, tmp_path):
    model = mlp()
    # a slow link: 10 ms latency, 10 MB/s, so densities stay well below 1
    slow = NetworkModel(1, CostModel(1e-2, 1e-7), CostModel(1e-2, 1e-7)).to_dict()
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
        density="adaptive", min_density=0.01, warmup_iterations=3, replan_every=2,
        network_profile=slow, plan_report_dir=str(tmp_path))
    k_min = dict(optimizer.lags_state.k)
    train(hvd, model, optimizer, 2)
    assert optimizer.plan is None and optimizer.lags_state.k == k_min  # still warming up
    train(hvd, model, optimizer, 1)
    plan = optimizer.plan
    assert plan is not None and {p.name: p.k for p in plan} == optimizer.lags_state.k
    assert all(p.k >= k_min[p.name] for p in plan)
    assert (tmp_path / "plan-3.json").exists() and (tmp_path / "plan-3.png").stat().st_size > 1000
    assert load_plan(tmp_path / "plan-3.json") == plan
    train(hvd, model, optimizer, 2)
    assert (tmp_path / "plan-5.json").exists()  # re-planned from fresh measurements


def test_free_network_makes_every_layer_dense(hvd):
    model = mlp()
    free = NetworkModel(1, CostModel(0.0, 0.0), CostModel(0.0, 0.0))
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters(),
        density="adaptive", warmup_iterations=2, network_profile=free)
    train(hvd, model, optimizer, 3)
    assert all(optimizer.lags_state.is_dense(u) for u in optimizer.lags_state.units)


def test_adaptive_checkpoint_restores_the_plan(hvd):
    model = mlp()
    slow = NetworkModel(1, CostModel(1e-2, 1e-7), CostModel(1e-2, 1e-7))
    make = lambda m: hvd.DistributedOptimizer(  # noqa: E731
        torch.optim.SGD(m.parameters(), lr=0.01), named_parameters=m.named_parameters(),
        density="adaptive", min_density=0.01, warmup_iterations=2, network_profile=slow)
    optimizer = make(model)
    train(hvd, model, optimizer, 3)
    state = optimizer.state_dict()
    resumed = make(mlp())
    resumed.load_state_dict(state)
    assert resumed.lags_state.k == optimizer.lags_state.k
    assert resumed.lags_state.iteration == 3


def test_network_profile_round_trip(tmp_path):
    model = NetworkModel(4, CostModel(1e-4, 2e-9), CostModel(2e-4, 1e-9))
    path = tmp_path / "net.json"
    save_network_profile(model, path, {"allgather": [[1, 2.0]]})
    assert load_network_profile(path, world_size=4) == model


@pytest.mark.parametrize("content,message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"world_size": 1, "allgather": {"alpha": 0.1}}), "lacks a field"),
    (json.dumps({"world_size": 1, "allreduce": {"alpha": 0.1, "beta": 0.0}}), "lacks a field"),
    (json.dumps({"world_size": 3, "allgather": {"alpha": 0, "beta": 0},
                 "allreduce": {"alpha": 0, "beta": 0}}), "measured with 3 workers, this job has 1"),
    (json.dumps({"world_size": 1, "allgather": {"alpha": -1, "beta": 0},
                 "allreduce": {"alpha": 0, "beta": 0}}), "alpha, beta >= 0"),
])
def test_bad_network_profile_is_refused(hvd, tmp_path, content, message):
    path = tmp_path / "net.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_network_profile(path, world_size=1)
    model = mlp()
    with pytest.raises(ValueError, match=message):  # at construction, before any training
        hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                 named_parameters=model.named_parameters(), density="adaptive",
                                 network_profile=str(path))


def test_missing_network_profile_file(hvd, tmp_path):
    with pytest.raises(ValueError, match="cannot read network profile"):
        load_network_profile(tmp_path / "absent.json")


def test_fit_cost_model_recovers_a_line():
    sizes = [1e3, 1e4, 1e5, 1e6]
    model = fit_cost_model(sizes, [2e-4 + 3e-9 * s for s in sizes])
    assert model.alpha == pytest.approx(2e-4) and model.beta == pytest.approx(3e-9)
    with pytest.raises(ValueError, match="two different sizes"):
        fit_cost_model([10, 10], [1.0, 2.0])


def test_backward_timer_profiles_relative_to_first_gradient():
    clock = iter([0.0]).__next__
    timer = BackwardTimer(window=2, clock=clock)
    for offset in (100.0, 200.0, 300.0):
        timer.unit_ready("b", offset + 1.0, 0.1)
        timer.unit_ready("a", offset + 3.0, 0.2)
        timer.end_iteration()

    class Unit:
        def __init__(self, name):
            self.name, self.numel, self.dtype = name, 10, torch.float32

    profiles = {p.name: p for p in timer.profile([Unit("a"), Unit("b"), Unit("unused")])}
    assert profiles["b"].ready == 0.0 and profiles["a"].ready == 2.0 and profiles["a"].select == 0.2
    assert profiles["unused"].ready == 2.0 and profiles["unused"].select == 0.0
    assert timer.iterations == 2
