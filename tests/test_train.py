"""The training CLI on real data with 2 workers: metrics, checkpoints, exact resume after a kill."""

import csv
import os
import re
import shutil
import signal
import time

import pytest
import torch
from launch import TORCH, finish, horovodrun, start, worker_pids

from lags_hvd.experiments.checkpoint import CheckpointDir

ARGS = [
    "-m",
    "lags_hvd.experiments.train",
    "--dataset",
    "fashion-mnist",
    "--model",
    "cnn",
    "--method",
    "lags",
    "--density",
    "0.01",
    "--steps-per-epoch",
    "15",
    "--batch-size",
    "16",
    "--monitor-every",
    "5",
    "--test-images",
    "1000",
]
EPOCHS, STEPS_PER_EPOCH = 2, 15
FINAL = EPOCHS * STEPS_PER_EPOCH


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The Horovod job of ``EPOCHS`` epochs, run once: the reference of every resume below
    (its checkpoints of both epochs are kept, the lr schedule does not depend on the epoch count)."""
    out = tmp_path_factory.mktemp("straight")
    horovodrun(2, "gloo", None, *ARGS, "--epochs", str(EPOCHS), "--out", str(out))
    return out


def after_epoch_1(straight, out):
    """A folder holding ``straight``'s checkpoints of epoch 1 and nothing else: a job to resume."""
    out.mkdir()
    for rank in range(2):
        shutil.copy(CheckpointDir(straight, rank).path(STEPS_PER_EPOCH), out)
    return out


def assert_same_end(a_dir, b_dir, label):
    """Both jobs' ranks end with the same model and residuals, bit for bit."""
    for rank in range(2):
        a, b = CheckpointDir(a_dir, rank).load(FINAL), CheckpointDir(b_dir, rank).load(FINAL)
        assert a["step"] == b["step"] == FINAL
        for name, value in a["model"].items():
            assert torch.equal(value, b["model"][name]), (label, rank, name)
        residuals_a, residuals_b = a["optimizer"]["lags"]["residuals"], b["optimizer"]["lags"]["residuals"]
        assert residuals_a.keys() == residuals_b.keys()
        for name in residuals_a:
            assert torch.equal(residuals_a[name], residuals_b[name]), (label, rank, name)


def kill_one_worker_after_first_checkpoint(out, *args):
    """Start a 2-worker run, SIGKILL one worker once both saved epoch 1, wait for the rest."""
    proc = start(2, "gloo", None, *args, "--out", str(out))
    first = [CheckpointDir(out, rank).path(STEPS_PER_EPOCH) for rank in range(2)]
    deadline = time.monotonic() + 240
    while not all(p.exists() for p in first):
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before epoch 1"
        time.sleep(0.01)
    victims = worker_pids(proc.pid, ["-m", "lags_hvd.experiments.train"])
    assert len(victims) == 2, victims
    os.kill(victims[-1], signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(AssertionError, match="workers failed"):
        finish(proc, timeout=120)
    return time.monotonic() - started


def test_resume_after_a_killed_worker_continues_exactly(straight, tmp_path):
    """The job straight == the job with a worker killed after epoch 1 and --resume
    (parameters and residuals bit for bit); the survivor stops in bounded time."""
    killed = tmp_path / "killed"
    stopped_in = kill_one_worker_after_first_checkpoint(killed, *ARGS, "--epochs", str(EPOCHS))
    assert stopped_in < 90
    survived = [CheckpointDir(killed, rank).steps() for rank in range(2)]
    assert all(FINAL not in steps for steps in survived), survived  # killed mid-run
    horovodrun(2, "gloo", None, *ARGS, "--epochs", str(EPOCHS), "--out", str(killed), "--resume")
    assert_same_end(straight, killed, "killed")
    rows = list(csv.DictReader(open(straight / "metrics.csv")))
    assert [int(r["epoch"]) for r in rows] == [1, 2]
    assert float(rows[-1]["test_accuracy"]) > 0.2  # chance is 0.1; 30 small sparse steps learn
    assert (straight / "assumption.json").exists()


def test_under_torchrun_the_job_trains_as_under_horovodrun_and_resumes_its_checkpoints(straight, tmp_path):
    """--backend torch under torchrun: the same metrics and, bit for bit, the same model and
    residuals as the Horovod job at the same settings and seeds; and a Horovod job's
    checkpoint of epoch 1 resumed under torchrun ends where the Horovod job ended."""
    torch_run, crossed = tmp_path / "torch", after_epoch_1(straight, tmp_path / "crossed")
    horovodrun(2, TORCH, None, *ARGS, "--backend", "torch", "--epochs", str(EPOCHS), "--out", str(torch_run))
    horovodrun(2, TORCH, None, *ARGS, "--backend", "torch", "--epochs", str(EPOCHS), "--out", str(crossed), "--resume")
    assert_same_end(straight, torch_run, "torch")
    assert_same_end(straight, crossed, "crossed")
    timing = ("epoch_seconds", "samples_per_s")
    rows = [
        [{k: v for k, v in r.items() if k not in timing} for r in csv.DictReader(open(d / "metrics.csv"))]
        for d in (straight, torch_run)
    ]
    assert rows[0] == rows[1] and len(rows[0]) == EPOCHS


@pytest.mark.parametrize("method", ["ddp-powersgd4", "ddp-lags"])
def test_ddp_and_its_hooks_train_under_torchrun_and_the_lags_hook_resumes(method, tmp_path):
    """--method ddp*: the model in DDP (its allreduce, PowerSGD from the second iteration, or
    lags_hvd.ddp's hook given the optimizer); metrics like every method's; the LAGS state in the
    optimizer's checkpoints (the hook's is the optimizer's), so a resumed run continues it."""
    args = [*ARGS[:6], "--method", method, "--density", "0.01", *ARGS[10:14], *ARGS[16:], "--backend", "torch"]
    args += ["--powersgd-start", "2"] if method == "ddp-powersgd4" else []
    resumed = method == "ddp-lags"  # the LAGS hook: epoch 1, then epoch 2 resumed from its checkpoints
    if resumed:
        horovodrun(2, TORCH, None, *args, "--epochs", "1", "--out", str(tmp_path))
    horovodrun(2, TORCH, None, *args, "--epochs", "2", "--out", str(tmp_path), *(["--resume"] if resumed else []))
    rows = list(csv.DictReader(open(tmp_path / "metrics.csv")))
    assert [int(r["epoch"]) for r in rows] == [1, 2] and float(rows[-1]["test_accuracy"]) > 0.2
    for rank in range(2):
        state = CheckpointDir(tmp_path, rank).load(2 * STEPS_PER_EPOCH)
        lags = state["optimizer"].get("lags")
        if method == "ddp-lags":  # the default recipe: momentum correction, the wrapped SGD keeps no state
            assert lags["iteration"] == 2 * STEPS_PER_EPOCH and lags["update"]["rule"] == "momentum_correction"
            assert any(r.any() for r in lags["residuals"].values()) and lags["velocities"]
            assert all(s.get("momentum_buffer") is None for s in state["optimizer"]["state"].values())
        else:
            assert lags is None
        assert "comm_hook" not in state


def test_resume_with_more_workers_resets_residuals_and_goes_on(straight, tmp_path):
    resumed = after_epoch_1(straight, tmp_path / "resumed")
    output = horovodrun(3, "gloo", None, *ARGS, "--epochs", "2", "--out", str(resumed), "--resume")
    assert "written by 2 workers, this job has 3: LAGS residuals restart from zero" in output
    for rank in range(3):
        state = CheckpointDir(resumed, rank).load(2 * STEPS_PER_EPOCH)
        assert state["world_size"] == 3 and state["optimizer"]["lags"]["world_size"] == 3
    rows = list(csv.DictReader(open(resumed / "metrics.csv")))
    assert [int(r["epoch"]) for r in rows] == [2]  # the resumed job's own epoch


def test_resume_without_checkpoint_is_a_clear_error_on_every_rank(tmp_path):
    with pytest.raises(AssertionError, match="--resume: no checkpoint step that all 2 workers can load"):
        horovodrun(2, "gloo", None, *ARGS, "--epochs", "1", "--out", str(tmp_path), "--resume", timeout=120)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--batch-size", "0"], "--batch-size must be >= 1"),
        (["--epochs", "0"], "--epochs must be >= 1"),
        (["--lr", "nan"], "--lr must be > 0"),
        (["--density", "0"], "--density must be a number in \\(0, 1\\]"),
        (["--density", "x"], "--density must be a number in \\(0, 1\\]"),
        (["--dataset", "synthetic", "--model", "char_lstm"], "--model for --dataset synthetic"),
        (["--dataset", "fashion-mnist", "--model", "lstm_small"], "--model for --dataset fashion-mnist"),
        (["--decay-epochs", "2,x"], "--decay-epochs must be comma-separated integers"),
        (["--clip-feedback"], "--clip-feedback is lags's clip of the merged gradient"),
        (["--clip-feedback", "--clip", "1", "--method", "topk"], "--clip-feedback is lags's clip"),
        (["--local-clip-only"], "--local-clip splits the --clip budget"),
        (["--local-clip-only", "--local-clip", "--clip", "1"], "--local-clip-only replaces the clip"),
        (["--local-clip-only", "--clip-feedback", "--clip", "1"], "--local-clip-only replaces the clip"),
        (["--local-clip-only", "--clip", "1", "--method", "dense"], "--local-clip-only is lags's local clip"),
        (["--layer-densities", "decoder.weight=0.01", "--method", "topk"], "lags's per-parameter density"),
        (["--layer-densities", "decoder.weight=0.01", "--density", "adaptive"], "not 'adaptive'"),
        (["--layer-densities", "decoder.weight=2"], "a density in \\(0, 1\\]; got 'decoder.weight=2'"),
        (["--layer-densities", "decoder.weight"], "each item is name=density"),
        (["--buckets", "big"], "--buckets must be 'layer', 'auto' or a number of entries"),
        (["--buckets", "auto", "--method", "dense"], "--buckets is a lags option"),
        (["--recipe", "paper", "--method", "dense"], "--recipe is a lags option"),
        (["--momentum-correction", "--method", "topk"], "--momentum-correction is a lags option"),
        (["--no-momentum-correction", "--method", "topk"], "--momentum-correction is a lags option"),
        (["--dense-params", "1d", "--method", "dense"], "--dense-params is a lags option"),
        (["--density-warmup", "5", "--method", "topk"], "--density-warmup is a lags option"),
        (["--merged-clip"], "--merged-clip says where the --clip applies"),
        (["--merged-clip", "--clip", "1", "--recipe", "paper"], "--merged-clip replaces --recipe dgc's local clip"),
        (["--merged-clip", "--clip", "1", "--method", "dense"], "--merged-clip is a lags option"),
        (["--method", "ddp-lags"], "--method ddp-lags runs DistributedDataParallel: give --backend torch"),
        (["--adam-correction"], "--adam-correction needs --optimizer adamw"),
        (["--optimizer", "adamw", "--momentum-correction"], "--momentum-correction needs --optimizer sgd"),
        (["--optimizer", "adamw", "--adam-correction", "--method", "topk"], "--adam-correction is a lags option"),
        (["--local-residual"], "--local-residual applies under Adam correction"),
        (["--optimizer", "adamw", "--no-adam-correction", "--local-residual"], "--local-residual applies under Adam"),
        (["--dataset", "shakespeare", "--model", "cnn"], "--model for --dataset shakespeare"),
        (["--test-images", "-1"], "--test-images must be >= 0"),
        (["--method", "adam-method"], "--method adam-method and --adam-method SPEC go together"),
        (["--adam-method", "demo"], "--method adam-method and --adam-method SPEC go together"),
        (["--method", "adam-method", "--adam-method", "adam"], "--adam-method: unknown method 'adam'"),
        (["--method", "adam-method", "--adam-method", "demo:k=3"], "--adam-method: demo has no option 'k'"),
        (["--method", "adam-method", "--adam-method", "demo"], "replaces AdamW on --dataset shakespeare"),
        (["--test-images", "10001"], "--test-images: fashion-mnist has 10,000 test images, got 10001"),
        (["--dataset", "shakespeare", "--model", "char_gpt", "--test-images", "5"], "give --dataset fashion-mnist"),
    ],
)
def test_invalid_arguments_get_a_clear_message(args, message, capsys):
    from lags_hvd.experiments.train import parse_args

    with pytest.raises(SystemExit):
        parse_args(args)
    assert re.search(message, capsys.readouterr().err)


def train_synthetic_lstm(out_dir, *flags, recipe="paper") -> dict:
    """The paper's LSTM on a synthetic batch, one worker, two steps, clip 1e-3, LAGS with
    ``recipe`` and ``flags``: the first row of its metrics."""
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lags_hvd.experiments.train",
            "--dataset",
            "synthetic",
            "--model",
            "lstm_small",
            "--batch-size",
            "4",
            "--epochs",
            "1",
            "--steps-per-epoch",
            "2",
            "--clip",
            "1e-3",
            "--recipe",
            recipe,
            *flags,
            "--out",
            str(out_dir),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return list(csv.DictReader(open(out_dir / "metrics.csv")))[0]


@pytest.mark.parametrize("clip", [[], ["--clip-feedback"]], ids=["after-synchronize", "feedback"])
def test_synthetic_language_models_train(tmp_path, clip):
    """The paper's LSTM on a synthetic batch: one worker, two steps, accuracy per token, and
    the clip's record (a fresh model's gradient is far above a 1e-3 clip: every step clipped),
    whether the script clips after synchronize() or the optimizer clips with feedback."""
    row = train_synthetic_lstm(tmp_path, *clip)
    assert 0 <= float(row["test_accuracy"]) <= 1
    assert float(row["grad_norm"]) > 1e-3 and float(row["clipped_fraction"]) == 1.0


def test_layer_densities_reach_the_optimizer(tmp_path):
    """--layer-densities: the named parameters are sent at their own density (the run's
    average density rises by what the decoder's 0.5 adds), and a name that is no
    parameter of the model fails with the optimizer's message."""
    from lags_hvd.experiments.train import parse_args

    assert parse_args(["--layer-densities", " decoder.weight=0.5, embedding.weight=0.01 "]).layer_densities == {
        "decoder.weight": 0.5,
        "embedding.weight": 0.01,
    }
    plain = float(train_synthetic_lstm(tmp_path / "plain")["average_density"])
    boosted = float(
        train_synthetic_lstm(tmp_path / "boosted", "--layer-densities", "decoder.weight=0.5")["average_density"]
    )
    assert boosted - plain == pytest.approx(0.5 * 2_000_000 / 4_654_000 - 0.001 * 2_000_000 / 4_654_000, rel=0.05)
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "lags_hvd.experiments.train",
            "--dataset",
            "synthetic",
            "--model",
            "lstm_small",
            "--epochs",
            "1",
            "--steps-per-epoch",
            "1",
            "--layer-densities",
            "nope=0.1",
            "--out",
            str(tmp_path / "bad"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode != 0 and "nope" in out.stderr


def test_local_clip_only_leaves_the_merged_gradient_unclipped(tmp_path):
    """--local-clip-only: DGC's clip before selection, and no clip after synchronize() (the
    CSV has no merged norm, which only that clip records); the default recipe clips so by
    itself, and --merged-clip moves its clip after synchronize()."""
    row = train_synthetic_lstm(tmp_path, "--local-clip-only")
    assert "grad_norm" not in row and 0 <= float(row["test_accuracy"]) <= 1
    from lags_hvd.experiments.train import parse_args

    assert parse_args(["--clip", "1"]).local_clip_only and not parse_args(["--clip", "1", "--merged-clip"]).local_clip
    assert "grad_norm" not in train_synthetic_lstm(tmp_path / "dgc", recipe="dgc")
    assert float(train_synthetic_lstm(tmp_path / "merged", "--merged-clip", recipe="dgc")["clipped_fraction"]) == 1.0


def test_a_gpt_with_adamw_trains_under_adam_correction(tmp_path):
    """The Shakespeare GPT with AdamW, one worker, three steps, the default recipe: the
    perplexity is recorded and the checkpoint says the recipe picked Adam correction with the
    residual in the parameters."""
    import subprocess
    import sys

    out = subprocess.run(
        [
            *(sys.executable, "-m", "lags_hvd.experiments.train", "--dataset", "shakespeare", "--model", "char_gpt"),
            *("--optimizer", "adamw", "--lr", "0.003", "--hidden", "32", "--seq-len", "32", "--batch-size", "4"),
            *("--epochs", "1", "--steps-per-epoch", "3", "--schedule", "cosine", "--density", "0.01"),
            *("--out", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    row = list(csv.DictReader(open(tmp_path / "metrics.csv")))[0]
    assert 1 < float(row["validation_perplexity"]) < 200
    state = torch.load(CheckpointDir(tmp_path, 0).path(3), weights_only=True)
    assert state["optimizer"]["lags"]["update"]["rule"] == "adam_correction_local"


def test_an_adam_method_of_the_frontier_trains_in_processes_as_in_the_study(tmp_path):
    """--method adam-method: DiLoCo (its ranks' models apart between outer steps, so the end
    of training averages them) by 2 Horovod workers ends at the one-process study's perplexity
    for the same settings and seed, and reports the study's traffic."""
    from lags_hvd.experiments import adam_study

    spec, gpt = "diloco:every=4", ("--hidden", "32", "--seq-len", "32", "--batch-size", "4")
    horovodrun(
        2,
        "gloo",
        None,
        *("-m", "lags_hvd.experiments.train", "--dataset", "shakespeare", "--model", "char_gpt", *gpt),
        *("--optimizer", "adamw", "--lr", "0.003", "--weight-decay", "0.01", "--schedule", "cosine"),
        *("--warmup-epochs", "0.5", "--epochs", "1", "--steps-per-epoch", "6", "--out", str(tmp_path)),
        *("--method", "adam-method", "--adam-method", spec),
    )
    row = list(csv.DictReader(open(tmp_path / "metrics.csv")))[-1]
    settings = adam_study.Settings(method=spec, steps=6, steps_per_epoch=6, width=32, seq_len=32, batch_size=4)
    study = adam_study.run(settings)
    assert float(row["validation_perplexity"]) == pytest.approx(study["perplexity"], rel=1e-4)
    assert float(row["words_vs_dense"]) == study["words_vs_dense"] > 0
    settings.method = "dense"  # a tolerance that tells the methods apart
    assert abs(adam_study.run(settings)["perplexity"] / study["perplexity"] - 1) > 1e-2
