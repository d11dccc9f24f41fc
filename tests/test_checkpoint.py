"""Checkpoint files: atomic saves, rotation, and the step every rank can resume from."""

import os
import pickle

import pytest
import torch

from lags_hvd.experiments.checkpoint import (
    CheckpointDir,
    UnreadableCheckpointError,
    UnsafeCheckpointError,
    load_newest,
    load_safely,
    save_atomically,
)


class Unpicklable:
    def __reduce__(self):
        raise RuntimeError("crash while saving")


def test_a_crash_while_saving_leaves_the_last_checkpoint_intact(tmp_path):
    path = tmp_path / "checkpoint.pt"
    save_atomically({"step": 1, "weights": torch.arange(1000.0)}, path)
    with pytest.raises(RuntimeError, match="crash while saving"):
        save_atomically({"step": 2, "weights": torch.zeros(1000), "bad": Unpicklable()}, path)
    saved = torch.load(path)
    assert saved["step"] == 1 and torch.equal(saved["weights"], torch.arange(1000.0))
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]  # no temporary left


def test_each_rank_keeps_its_newest_checkpoints(tmp_path):
    rank1 = CheckpointDir(tmp_path, rank=1)
    for step in (10, 20, 30):
        rank1.save({"step": step}, step)
    CheckpointDir(tmp_path, rank=0).save({"step": 30}, 30)
    (tmp_path / ".checkpoint.rank1.step40.pt.tmp-123").write_bytes(b"half a file")  # a killed save
    assert rank1.steps() == [20, 30] and rank1.steps(0) == [30]
    assert rank1.load(20) == {"step": 20}
    with pytest.raises(ValueError, match="keep at least 2"):
        CheckpointDir(tmp_path, rank=0, keep=1)


def gather_with(other_rank: list):
    """``load_newest``'s collective in one process: rank 0 is this one, rank 1 answers
    from ``other_rank`` in turn (first its steps, then whether it could read each step)."""
    answers = iter(other_rank)
    return lambda mine: [mine, next(answers)]


def test_resume_takes_the_newest_step_every_rank_has(tmp_path):
    folder = CheckpointDir(tmp_path, rank=0, keep=3)
    for step in (10, 20, 30):
        folder.save({"step": step}, step)
    assert load_newest(folder, gather_with([[10, 20, 30], None])) == (30, {"step": 30})
    assert load_newest(folder, gather_with([[10, 20], None])) == (20, {"step": 20})  # killed between saves
    with pytest.raises(
        FileNotFoundError, match=r"no checkpoint step that all 2 workers can load.*\[\[10, 20, 30\], \[5"
    ):
        load_newest(folder, gather_with([[5]]))


def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous_on_every_rank(tmp_path):
    """A truncated newest file: its rank names it, every rank warns and takes the previous
    step every rank has; one that only the other rank cannot read is passed over alike."""
    folder = CheckpointDir(tmp_path, rank=0)
    for step in (10, 20):
        folder.save({"step": step}, step)
    newest = folder.path(20)
    newest.write_bytes(newest.read_bytes()[:40])
    with pytest.raises(UnreadableCheckpointError, match=f"{newest}.*cannot be read"):
        folder.load(20)
    with pytest.warns(UserWarning, match=f"step 20 cannot be resumed.*{newest}"):
        assert load_newest(folder, gather_with([[10, 20], None, None])) == (10, {"step": 10})
    folder.save({"step": 20}, 20)
    with pytest.warns(UserWarning, match="step 20 cannot be resumed.*rank 1's file"):
        assert load_newest(folder, gather_with([[10, 20], "rank 1's file", None])) == (10, {"step": 10})
    newest.write_bytes(b"")
    with pytest.warns(UserWarning, match="step 20 cannot be resumed"), pytest.raises(FileNotFoundError):
        load_newest(folder, gather_with([[20], None]))  # no step left


def test_a_new_rank_reads_rank_0s_checkpoint(tmp_path):
    CheckpointDir(tmp_path, rank=0).save({"from": 0}, 15)
    newcomer = CheckpointDir(tmp_path, rank=2)
    assert newcomer.steps() == [] and newcomer.available() == [15]
    assert newcomer.load(15) == {"from": 0}


class Payload:
    """A pickle that runs code when loaded: here, it would create a marker file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_a_crafted_pickle_is_refused_and_runs_nothing(tmp_path):
    marker = tmp_path / "payload-ran"
    planted = CheckpointDir(tmp_path, rank=0).path(999)  # the newest step: --resume's first choice
    with open(planted, "wb") as f:
        pickle.dump({"model": {}, "optimizer": Payload(marker)}, f)
    with pytest.raises(UnsafeCheckpointError, match="would run code, so it is refused"):
        CheckpointDir(tmp_path, rank=0).load(999)
    with pytest.raises(UnsafeCheckpointError):
        load_safely(planted)
    assert not marker.exists()


def test_a_real_checkpoint_loads_with_weights_only(tmp_path):
    """What the training CLI saves (model, optimizer with residuals, scheduler, RNG states)."""
    import numpy as np

    from lags_hvd.experiments.train import rng_state, set_rng_state

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    np.random.seed(5)
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
        "epoch": 1,
        "step": 10,
    }
    CheckpointDir(tmp_path, rank=0).save(state, 10)
    expected = np.random.rand(3)
    loaded = CheckpointDir(tmp_path, rank=0).load(10)
    set_rng_state(loaded["rng"])
    assert np.array_equal(np.random.rand(3), expected)
    assert torch.equal(loaded["model"]["weight"], model.weight.detach())
