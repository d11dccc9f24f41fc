"""The frameworks users train with: PyTorch Lightning's ``LAGSStrategy`` under Lightning's own
CPU DDP launcher (one launch, every fit of tests/workers/lightning_worker.py in it), and the
DDP hook under Hugging Face Accelerate with gradient accumulation (tests/workers/accelerate_worker.py)."""

import sys

import pytest
import torch
from launch import HERE, TORCH, finish, horovodrun, spawn

RUNS = ["dense", "lags-1", "sgd", "sgd-resumed", "adamw", "adamw-resumed", "amp", "clipped"]


@pytest.fixture(scope="module")
def lightning_runs(tmp_path_factory):
    """``{run: (rank 0's record, rank 1's record)}`` of the worker's fits."""
    out = tmp_path_factory.mktemp("lightning")
    worker = HERE / "workers" / "lightning_worker.py"
    finish(spawn([sys.executable, str(worker), "--out", str(out)]), timeout=180)
    return {run: tuple(torch.load(out / f"{run}.{rank}.pt") for rank in (0, 1)) for run in RUNS}


def _params(record) -> list[torch.Tensor]:
    return list(record["params"].values())


@pytest.mark.parametrize("run", RUNS)
def test_lightning_ranks_end_with_the_same_model_and_every_step_exchanged(lightning_runs, run):
    rank0, rank1 = lightning_runs[run]
    assert all(torch.equal(a, b) for a, b in zip(_params(rank0), _params(rank1)))
    assert rank0["steps"] == (6 if run == "clipped" else 12)  # 12 batches, accumulate_grad_batches=2 halves them
    if run != "dense":  # on the CPU too: the hook was registered and every optimizer step went through it
        assert rank0["iterations"] == rank1["iterations"] == rank0["steps"]


def test_lightning_at_density_one_trains_as_lightnings_own_ddp_strategy(lightning_runs):
    dense, lags = lightning_runs["dense"][0], lightning_runs["lags-1"][0]
    for a, b in zip(_params(dense), _params(lags)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_lightning_sparse_training_is_not_dense(lightning_runs):
    dense, sparse = lightning_runs["dense"][0], lightning_runs["sgd"][0]
    assert max((a - b).abs().max().item() for a, b in zip(_params(dense), _params(sparse))) > 1e-3


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_lightning_resume_from_its_own_checkpoint_is_bit_exact(lightning_runs, optimizer):
    """Lightning writes rank 0's checkpoint only; the strategy puts every rank's residuals (and,
    under AdamW's local residual, its own parameters) in it, so fit(ckpt_path=...) resumes each
    rank exactly: the same model as the run that never stopped."""
    for rank in (0, 1):
        straight, resumed = lightning_runs[optimizer][rank], lightning_runs[f"{optimizer}-resumed"][rank]
        assert all(torch.equal(a, b) for a, b in zip(_params(straight), _params(resumed)))


def test_lightning_16_mixed_passes_its_grad_scaler_and_trains_as_without_it(lightning_runs):
    """Under ``precision="16-mixed"`` the strategy hands Lightning's GradScaler to LAGS, so the
    residuals are kept unscaled: with float32 compute and a scale that doubled 6 times, the
    model is the unscaled run's bit for bit (before, the residuals kept each iteration's scale
    and nothing said so)."""
    for rank in (0, 1):
        amp, plain = lightning_runs["amp"][rank], lightning_runs["sgd"][rank]
        assert amp["scale"] == 2.0**14
        assert all(torch.equal(a, b) for a, b in zip(_params(amp), _params(plain)))


def test_lightning_strategy_refuses_a_hook_of_its_own_and_unknown_options():
    from lags_hvd.lightning import LAGSStrategy

    with pytest.raises(TypeError, match="registers lags_hook itself"):
        LAGSStrategy(ddp_comm_hook=lambda state, bucket: None)
    with pytest.raises(TypeError, match="did you mean 'density'"):
        LAGSStrategy(densty=0.01)
    with pytest.raises(ValueError, match="density"):
        LAGSStrategy(density=2.0)
    with pytest.raises(TypeError, match="passes the GradScaler of Lightning's precision plugin"):
        LAGSStrategy(grad_scaler=torch.amp.GradScaler("cpu"))
    LAGSStrategy(density=0.01, bucket_cap_mb=1, static_graph=True)  # LAGS, DDP and DDPStrategy options together


@pytest.fixture(scope="module")
def accelerate_runs(tmp_path_factory):
    """``{run: (rank 0's record, rank 1's record)}`` of the Accelerate worker's runs."""
    out = tmp_path_factory.mktemp("accelerate")
    horovodrun(2, TORCH, "accelerate_worker.py", "--out", str(out), timeout=180)
    runs = ["whole", "accumulate", "dense-accumulate", "lags1-accumulate", "scaled", "scaled-prepared-first"]
    return {run: tuple(torch.load(out / f"{run}.{rank}.pt") for rank in (0, 1)) for run in runs}


def test_accelerate_accumulation_exchanges_once_per_step_what_the_whole_batch_would(accelerate_runs):
    """Under ``accelerator.accumulate`` DDP keeps the micro-batches' gradients local (no_sync) and
    the last one's backward reports their mean to the hook: one LAGS iteration per optimizer
    step, the same update as the whole batch at once (up to the sum's rounding)."""
    whole, accumulated = accelerate_runs["whole"], accelerate_runs["accumulate"]
    for rank in (0, 1):
        assert whole[rank]["iterations"] == accumulated[rank]["iterations"] == 6
        for a, b in zip(whole[rank]["params"], accumulated[rank]["params"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert all(torch.equal(a, b) for a, b in zip(accumulated[0]["params"], accumulated[1]["params"]))


def test_accelerate_at_density_one_is_accelerates_own_ddp(accelerate_runs):
    dense, lags = accelerate_runs["dense-accumulate"][0], accelerate_runs["lags1-accumulate"][0]
    for a, b in zip(dense["params"], lags["params"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_accelerate_under_a_grad_scaler_trains_as_without_it_or_is_refused(accelerate_runs):
    """Under fp16 Accelerate steps through its GradScaler, and keeps the optimizer's step as it
    was when ``prepare`` saw it. Wrapped before that (the README's order), with Accelerate's
    scaler passed, the model is the unscaled run's bit for bit; wrapped after, that kept step
    is the wrapped optimizer's own, which would step around LAGS: refused at the first step on
    both ranks, before it changes anything (before, the first step went around LAGS and the
    second failed on an unrelated zero_grad() error)."""
    for rank in (0, 1):
        scaled, whole = accelerate_runs["scaled"][rank], accelerate_runs["whole"][rank]
        assert scaled["refused"] is None and scaled["iterations"] == 6 and scaled["scale"] == 2.0**11
        assert all(torch.equal(a, b) for a, b in zip(scaled["params"], whole["params"]))
        first = accelerate_runs["scaled-prepared-first"][rank]
        assert "before accelerator.prepare(optimizer)" in first["refused"] and first["iterations"] == 1
        torch.manual_seed(0)
        initial = torch.nn.Sequential(torch.nn.Linear(10, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))
        assert all(torch.equal(a, b) for a, b in zip(first["params"], initial.parameters()))
