"""Checkpoint files: atomic saves, rotation, and the step every rank can resume from."""
import pytest
import torch

import os
import pickle

from lags_hvd.experiments.checkpoint import (CheckpointDir, UnsafeCheckpointError, load_safely, resume_step,
                                             save_atomically)


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
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]   # no temporary left


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


def test_resume_step_is_the_newest_step_every_rank_has():
    assert resume_step([[10, 20], [10, 20]]) == 20
    assert resume_step([[20, 30], [10, 20]]) == 20   # killed between the two ranks' saves
    assert resume_step([[30], [20]]) is None
    assert resume_step([[], []]) is None


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
    planted = CheckpointDir(tmp_path, rank=0).path(999)   # the newest step: --resume's first choice
    with open(planted, "wb") as f:
        pickle.dump({"model": {}, "optimizer": Payload(marker)}, f)
    with pytest.raises(UnsafeCheckpointError, match="would run code, so it is refused"):
        CheckpointDir(tmp_path, rank=0).load(999)
    with pytest.raises(UnsafeCheckpointError):
        load_safely(planted)
    assert not marker.exists()


def test_a_real_checkpoint_loads_with_weights_only(tmp_path):
    """What the training CLI saves (model, optimizer with residuals, scheduler, RNG states)."""
    from lags_hvd.experiments.train import rng_state, set_rng_state
    import numpy as np
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    np.random.seed(5)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "rng": rng_state(), "epoch": 1, "step": 10}
    CheckpointDir(tmp_path, rank=0).save(state, 10)
    expected = np.random.rand(3)
    loaded = CheckpointDir(tmp_path, rank=0).load(10)
    set_rng_state(loaded["rng"])
    assert np.array_equal(np.random.rand(3), expected)
    assert torch.equal(loaded["model"]["weight"], model.weight.detach())
