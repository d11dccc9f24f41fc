"""The training CLI on real data with 2 workers: metrics, checkpoints, exact resume."""
import csv

import torch

from launch import horovodrun

ARGS = ["-m", "lags_hvd.train", "--dataset", "fashion-mnist", "--model", "cnn", "--method", "lags",
        "--density", "0.01", "--steps-per-epoch", "15", "--batch-size", "16", "--monitor-every", "5"]


def test_resume_continues_exactly(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    horovodrun(2, "gloo", None, *ARGS, "--epochs", "2", "--out", str(straight))
    horovodrun(2, "gloo", None, *ARGS, "--epochs", "1", "--out", str(resumed))
    horovodrun(2, "gloo", None, *ARGS, "--epochs", "2", "--out", str(resumed), "--resume")
    for rank in range(2):
        a = torch.load(straight / f"checkpoint.rank{rank}.pt", weights_only=False)
        b = torch.load(resumed / f"checkpoint.rank{rank}.pt", weights_only=False)
        assert a["step"] == b["step"] == 30
        for name, value in a["model"].items():
            assert torch.equal(value, b["model"][name]), name
        residuals_a, residuals_b = a["optimizer"]["lags"]["residuals"], b["optimizer"]["lags"]["residuals"]
        assert residuals_a.keys() == residuals_b.keys()
        for name in residuals_a:
            assert torch.equal(residuals_a[name], residuals_b[name]), name
    rows = list(csv.DictReader(open(straight / "metrics.csv")))
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    assert float(rows[-1]["test_accuracy"]) > 0.2   # chance is 0.1; 30 small sparse steps learn
    assert (straight / "assumption.json").exists()


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    try:
        horovodrun(2, "gloo", None, *ARGS, "--epochs", "1", "--out", str(tmp_path), "--resume")
    except AssertionError as failure:
        assert "--resume: no checkpoint" in str(failure)
    else:
        raise AssertionError("resuming from nothing did not fail")
