"""The training CLI where a user could be misled without a word: the wrong launcher, a damaged
checkpoint, ranks that disagree after a resume, a resume into another worker count under the
local residual. Each case runs the CLI as a user would, P = 2 (3 where the worker count changes)."""

import csv
import json
import re
import shutil

import pytest
import torch
from launch import TORCH, horovodrun

from lags_hvd.experiments.checkpoint import CHECKSUM, CheckpointDir, DamagedCheckpointError, load_safely

ARGS = [
    *("-m", "lags_hvd.experiments.train", "--dataset", "fashion-mnist", "--model", "cnn"),
    *("--method", "lags", "--density", "0.01", "--steps-per-epoch", "3", "--batch-size", "16"),
    *("--test-images", "1000"),
]
STEPS = 3  # per epoch


def epochs_in(out) -> list[int]:
    return [int(row["epoch"]) for row in csv.DictReader(open(out / "metrics.csv"))]


def flip_a_byte(path, tensor: torch.Tensor) -> None:
    """Flip one byte in the middle of ``tensor``'s data inside the file at ``path``: torch.load
    reads it back without complaint, one value slightly changed."""
    raw = bytearray(path.read_bytes())
    data = tensor.contiguous().numpy().tobytes()
    at = raw.find(data)
    assert at > 0 and raw.find(data, at + 1) < 0
    raw[at + len(data) // 2] ^= 0xFF
    path.write_bytes(raw)


def largest(model: dict) -> str:
    return max(model, key=lambda name: model[name].numel())


def test_a_flipped_byte_is_named_and_a_file_saved_before_checksums_still_loads(tmp_path):
    folder = CheckpointDir(tmp_path, rank=0)
    state = {"model": {"w": torch.randn(1000)}, "step": 3}
    folder.save(state, 3)
    loaded = folder.load(3)
    assert loaded.keys() == state.keys() and torch.equal(loaded["model"]["w"], state["model"]["w"])
    flip_a_byte(folder.path(3), state["model"]["w"])
    assert torch.load(folder.path(3), weights_only=True)["model"]["w"].ne(state["model"]["w"]).sum() == 1
    with pytest.raises(DamagedCheckpointError, match=f"{folder.path(3)} cannot be read.*no longer matches"):
        load_safely(folder.path(3))
    torch.save(state, folder.path(6))  # as saved before checksums
    with pytest.warns(UserWarning, match="carries no checksum"):
        loaded = folder.load(6)
    assert CHECKSUM not in loaded and torch.equal(loaded["model"]["w"], state["model"]["w"])


@pytest.fixture(scope="module")
def two_epochs(tmp_path_factory):
    """A 2-epoch job, run once; each test below damages a copy of it."""
    out = tmp_path_factory.mktemp("two-epochs")
    horovodrun(2, "gloo", None, *ARGS, "--epochs", "2", "--out", str(out))
    return out


def test_a_flipped_byte_in_one_ranks_checkpoint_is_named_and_the_resume_falls_back(two_epochs, tmp_path):
    """A byte flipped in a weight of rank 1's newest checkpoint: the resume names the file,
    falls back to the previous step on both ranks, drops the metrics row of the epoch it runs
    again, and the ranks end with the same weights."""
    tmp_path = shutil.copytree(two_epochs, tmp_path / "job")
    damaged = CheckpointDir(tmp_path, 1).path(2 * STEPS)
    model = CheckpointDir(tmp_path, 1).load(2 * STEPS)["model"]
    flip_a_byte(damaged, model[largest(model)])
    output = horovodrun(2, "gloo", None, *ARGS, "--epochs", "3", "--out", str(tmp_path), "--resume")
    assert f"step {2 * STEPS} cannot be resumed ({damaged} cannot be read" in output
    assert "no longer matches the checksum" in output
    assert "metrics rows after epoch 1 dropped" in output
    assert epochs_in(tmp_path) == [1, 2, 3]
    final = [CheckpointDir(tmp_path, rank).load(3 * STEPS)["model"] for rank in range(2)]
    for name, value in final[0].items():
        assert torch.equal(value, final[1][name]), name


def test_ranks_whose_weights_differ_after_a_resume_stop_with_a_clear_error(two_epochs, tmp_path):
    """A changed weight in a checkpoint saved before checksums (nothing to tell at load): the
    ranks compare their weights after loading and every rank stops, naming the weight."""
    for rank in range(2):  # the job as it stood after epoch 1
        shutil.copy(CheckpointDir(two_epochs, rank).path(STEPS), tmp_path)
    with open(two_epochs / "metrics.csv") as f, open(tmp_path / "metrics.csv", "w") as g:
        g.writelines(f.readlines()[:2])
    path = CheckpointDir(tmp_path, 1).path(STEPS)
    state = CheckpointDir(tmp_path, 1).load(STEPS)
    name = largest(state["model"])
    state["model"][name].view(-1)[7] += 1e-6
    torch.save(state, path)  # no checksum: as saved before checksums
    with pytest.raises(AssertionError, match="workers failed") as failed:
        horovodrun(2, "gloo", None, *ARGS, "--epochs", "2", "--out", str(tmp_path), "--resume", timeout=120)
    output = str(failed.value)
    assert "carries no checksum" in output
    assert f"after loading step {STEPS}, parameters that every rank holds alike differ from rank 0's" in output
    assert f"rank 1: {name}" in output and f"Remove the step-{STEPS} checkpoints" in output
    assert CheckpointDir(tmp_path, 0).steps() == [STEPS] and epochs_in(tmp_path) == [1]


def test_under_torchrun_without_backend_the_cli_runs_one_torch_job(tmp_path):
    """torchrun with no --backend: one 2-worker job on torch.distributed, with a note; one
    metrics row per epoch, one checkpoint per rank (not two 1-worker Horovod jobs writing
    the same files)."""
    output = horovodrun(2, TORCH, None, *ARGS, "--epochs", "1", "--out", str(tmp_path))
    assert epochs_in(tmp_path) == [1]
    for rank in range(2):
        assert CheckpointDir(tmp_path, rank).steps() == [STEPS]
        assert CheckpointDir(tmp_path, rank).load(STEPS)["world_size"] == 2
    assert output.count("under torchrun: --backend torch") == 1
    assert json.loads((tmp_path / "args.json").read_text())["backend"] == "torch"


@pytest.mark.parametrize(
    "controller,backend,message",
    [
        (TORCH, "horovod", "the Horovod backend under torchrun, which started 2 workers: Horovod sees 1"),
        ("gloo", "torch", "the torch backend joins the workers torchrun starts.*horovodrun or mpirun started"),
    ],
    ids=["horovod-under-torchrun", "torch-under-horovodrun"],
)
def test_a_backend_that_does_not_fit_the_launcher_is_refused(controller, backend, message, tmp_path):
    """--backend given against the launcher: a clear error and a non-zero exit, before any file."""
    with pytest.raises(AssertionError, match="workers failed") as failed:
        horovodrun(2, controller, None, *ARGS, "--backend", backend, "--out", str(tmp_path / "out"), timeout=120)
    assert re.search(message, str(failed.value))
    assert not (tmp_path / "out").exists()


def test_resume_into_another_world_size_under_the_local_residual_averages_the_models(tmp_path):
    """AdamW's default recipe (each rank's parameters hold its own residual): a 3-worker
    checkpoint resumed by 2 workers resets the residuals, so the CLI averages the models; the
    ranks then hold one consensus (parameters plus residual) at the next checkpoint. A resume
    at the same worker count compares only the parameters without a residual and continues
    bit for bit."""
    adam = [*ARGS, "--optimizer", "adamw", "--lr", "0.003"]
    horovodrun(3, "gloo", None, *adam, "--epochs", "2", "--out", str(tmp_path))
    for rank in range(3):  # the last epoch ends on the average: resume from the one before
        CheckpointDir(tmp_path, rank).path(2 * STEPS).unlink()
    output = horovodrun(2, "gloo", None, *adam, "--epochs", "3", "--out", str(tmp_path), "--resume")
    assert "the ranks' models averaged" in output
    states = [CheckpointDir(tmp_path, rank).load(2 * STEPS) for rank in range(2)]
    assert states[0]["optimizer"]["lags"]["update"]["rule"] == "adam_correction_local"
    residuals = [s["optimizer"]["lags"]["residuals"] for s in states]
    assert residuals[0] and all(r.any() for r in residuals[0].values())
    for name in residuals[0]:
        consensus = [s["model"][name].reshape(-1) + r[name] for s, r in zip(states, residuals)]
        assert torch.allclose(consensus[0], consensus[1], rtol=0, atol=1e-6), name
    ended = [CheckpointDir(tmp_path, rank).load(3 * STEPS)["model"] for rank in range(2)]
    for rank in range(2):
        CheckpointDir(tmp_path, rank).path(3 * STEPS).unlink()
    output = horovodrun(2, "gloo", None, *adam, "--epochs", "3", "--out", str(tmp_path), "--resume")
    assert "averaged" not in output and epochs_in(tmp_path) == [1, 2, 3]
    for rank in range(2):
        again = CheckpointDir(tmp_path, rank).load(3 * STEPS)["model"]
        for name, value in ended[rank].items():
            assert torch.equal(value, again[name]), (rank, name)
