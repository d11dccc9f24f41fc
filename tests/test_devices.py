"""The torch.distributed front-end in one process (P = 1), on every device present: the CPU here,
CUDA too where a GPU is (``scripts/gpu_check.sh`` runs this file there). Against the numpy
oracle, and with no more tensor values read into Python than on the CPU."""

import os
import subprocess
import sys
from pathlib import Path

import models
import pytest
import torch
from test_distributed import assert_matches, reference_for
from test_engine import host_reads_by_depth
from workers.lags_worker import FIDELITY

import lags_hvd.distributed as lags
from lags_hvd.experiments import device_timing

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
STEPS = 6


def tiny_run(device: str, options: dict):
    """TinyNet on ``device`` under the front-end, rank 0's batches (aux sometimes unused)."""
    model = models.make_model().to(device)
    base = torch.optim.SGD(model.parameters(), lr=models.LR, momentum=models.MOMENTUM, weight_decay=models.WEIGHT_DECAY)
    options = {"density": models.DENSITY, "layer_densities": models.LAYER_DENSITIES, "recipe": "paper", **options}
    optimizer = lags.DistributedOptimizer(base, model.named_parameters(), **options)
    for step in range(STEPS):
        optimizer.zero_grad()
        x, y = models.batch(0, step)
        use_aux = models.uses_aux(0, step, sometimes=True)
        torch.nn.functional.mse_loss(model(x.to(device), use_aux=use_aux), y.to(device)).backward()
        optimizer.step()
    return {
        "params": {n: p.detach().cpu() for n, p in model.named_parameters()},
        "residuals": {n: r.cpu() for n, r in optimizer.lags_state.residuals.state_dict().items()},
    }


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "options",
    [{}, {"aggregation": "reduce_scatter"}, FIDELITY["recipe"]],
    ids=["paper", "reduce-scatter", "recipe"],
)
def test_one_rank_matches_the_oracle(torch_group, device, options):
    params, eps, _ = reference_for(1, STEPS, options)
    assert_matches(tiny_run(device, options), params, eps[0], device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    "options", [dict(density=0.05), dict(density=0.05, momentum_correction=True), dict(density=1.0)]
)
def test_hooks_read_nothing_to_the_host_and_synchronize_a_constant(torch_group, monkeypatch, device, options):
    """As tests/test_engine.py's test of the same name, through the torch front-end: nothing
    read in backward, and a count in synchronize() that does not grow with the layers."""
    reads = host_reads_by_depth(
        monkeypatch,
        lambda model: lags.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            model.named_parameters(),
            recipe="paper",
            **options,
        ),
        device,
    )
    assert reads[1][0] == reads[12][0] == 0
    assert reads[1][1] == reads[12][1] <= 4, reads


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the script runs the whole check")
def test_the_gpu_check_says_clearly_that_there_is_no_gpu_and_succeeds():
    root = Path(__file__).parent.parent
    done = subprocess.run(
        ["bash", str(root / "scripts" / "gpu_check.sh")],
        env=dict(os.environ, PYTHON=sys.executable),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "no CUDA GPU usable by torch" in done.stdout and "untested" in done.stdout


def test_the_device_timing_measures_every_phase(torch_group):
    """What the GPU check prints, here on the CPU: every phase timed, the ratio consistent."""
    result = device_timing.measure(torch.device("cpu"), rounds=1)
    for key in ("backward", "lags_backward", "lags_synchronize", "iteration", "lags_iteration"):
        assert result[key] > 0, key
    assert result["lags_over_plain"] == pytest.approx(result["lags_iteration"] / result["iteration"])
