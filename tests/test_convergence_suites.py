"""The convergence suites' bookkeeping: which runs two suites share, and the reports that their
committed results give (no training here)."""

import pytest

from lags_hvd.experiments import convergence
from lags_hvd.experiments.train import parse_args


def test_a_run_is_shared_only_when_its_arguments_are_identical():
    full, aggregation, quick = (convergence.suite_settings(s) for s in ("full", "aggregation", "aggregation-quick"))
    same = convergence.training_args("fashion-mnist", "lags", 43, full)
    assert convergence.training_args("fashion-mnist", "lags", 43, aggregation) == same
    assert convergence.training_args("fashion-mnist", "lags", 43, quick) != same  # 4 epochs, not 12
    assert convergence.training_args("fashion-mnist", "lags", 44, full) != same  # another seed


def test_every_method_of_a_suite_trains_with_the_suites_worker_count():
    """torchrun's DDP methods and horovodrun's others start the same number of workers (the
    transformer suite once ran its DDP row with 4 workers beside the others' 2)."""
    for suite in ("transformer", "full"):
        workers = convergence.world(convergence.suite_settings(suite))
        for method in ("ddp-lags", "lags-default"):
            command = convergence.launcher(method, workers)
            count = command[command.index("--nproc-per-node" if method.startswith("ddp") else "-np") + 1]
            assert int(count) == workers == (2 if suite == "transformer" else 4)


def test_a_run_is_not_shared_between_suites_of_different_worker_counts(monkeypatch):
    """The same training arguments at another P are another run."""
    real = convergence.suite_settings
    monkeypatch.setattr(convergence, "suite_settings", lambda s: {**real(s), "world": 2} if s == "full" else real(s))
    monkeypatch.setattr(convergence, "run_files", lambda *a: (type("F", (), {"exists": lambda self: True})(), None))
    aggregation = convergence.suite_settings("aggregation")
    assert convergence.same_run_elsewhere("fashion-mnist", "lags", 43, aggregation, "aggregation") is None
    monkeypatch.setattr(convergence, "suite_settings", real)
    assert convergence.same_run_elsewhere("fashion-mnist", "lags", 43, aggregation, "aggregation") is not None


def parsed(args: list[str]) -> tuple:
    """The training run these arguments make, as the train script reads them."""
    return tuple(sorted((k, repr(v)) for k, v in vars(parse_args([*args, "--out", "run"])).items()))


def test_every_suite_plans_runs_with_distinct_arguments():
    """Distinct as the train script parses them (a later --clip overrides an earlier one)."""
    for suite in convergence.SUITES:
        settings = convergence.suite_settings(suite)
        planned = [
            parsed(convergence.training_args(task, method, seed, settings))
            for task in convergence.TASKS
            for method in convergence.task_methods(settings, task)
            for seed in convergence.method_seeds(settings, method)
        ]
        assert planned and len(planned) == len(set(planned)), suite


def test_more_seeds_go_to_the_methods_named_only():
    settings = convergence.suite_settings("aggregation")
    assert convergence.method_seeds(settings, "lags-dgc-rs") == [42, 43, 44, 45, 46]
    assert convergence.method_seeds(settings, "lags-rs") == [42, 43, 44]
    assert convergence.method_seeds(convergence.suite_settings("full"), "lags-dgc") == [42, 43, 44]


def test_the_clip_suite_differs_from_its_clipped_runs_only_in_the_clip():
    settings = convergence.suite_settings("clip")
    for method, clipped in (("dense-noclip", "dense"), ("lags-noclip", "lags")):
        without = dict(parsed(convergence.training_args("shakespeare", method, 42, settings)))
        with_clip = dict(parsed(convergence.training_args("shakespeare", clipped, 42, settings)))
        assert without["clip"] == "0.0" and with_clip["clip"] == "0.25"
        assert {k for k in without if without[k] != with_clip[k]} == {"clip"}


def test_the_report_compares_a_method_with_its_baseline_on_the_seeds_both_finished(tmp_path, monkeypatch):
    """lags on seeds 42 and 43, lags-rs2 on 42 only: the gap is seed 42's, not a difference
    of means over different seeds; lags-dgc-rs is compared with lags-dgc, not lags."""
    monkeypatch.setattr(convergence, "ROOT", tmp_path)
    (tmp_path / "results").mkdir()
    final = {
        "lags": {42: 0.9047, 43: 0.9027},
        "lags-rs2": {42: 0.8965},
        "lags-dgc": {42: 0.9149},
        "lags-dgc-rs": {42: 0.9100, 43: 0.9000},
    }
    data = {
        "fashion-mnist": {
            method: {seed: [{"test_accuracy": accuracy, "step": 1.0}] for seed, accuracy in seeds.items()}
            for method, seeds in final.items()
        }
    }
    report = tmp_path / "report.md"
    settings = convergence.suite_settings("aggregation")
    convergence.write_report(data, "aggregation", settings, tmp_path / "results", report)
    rows = {line.split("|")[1].strip(): line for line in report.read_text().splitlines() if line.startswith("| lags")}
    assert "90.37% ± 0.14 (2) | +0.00 pp (2)" in rows["lags"]
    assert "89.65% ± 0.00 (1) | -0.82 pp (1)" in rows["lags-rs2"]
    assert "not run yet" in rows["lags-rs"]
    assert "90.50% ± 0.71 (2) | -0.49 pp (1) vs lags-dgc" in rows["lags-dgc-rs"]  # its own baseline


def test_a_shakespeare_only_report_names_each_gap_and_a_missing_baseline(tmp_path, monkeypatch):
    """The clip suite: lags-noclip against dense-noclip, not dense; with no dense-noclip run
    the cell says so (no nan); the setup lists Shakespeare only, without the options it
    does not run."""
    monkeypatch.setattr(convergence, "ROOT", tmp_path)
    (tmp_path / "results").mkdir()
    settings = convergence.suite_settings("clip")

    def report(final):
        data = {
            "shakespeare": {
                method: {42: [{"validation_perplexity": ppl, "step": 300.0}]} for method, ppl in final.items()
            }
        }
        convergence.write_report(data, "clip", settings, tmp_path / "results", tmp_path / "report.md")
        text = (tmp_path / "report.md").read_text()
        return text, {line.split("|")[1].strip(): line for line in text.splitlines() if line.startswith("| ")}

    text, rows = report({"dense": 13.0, "lags": 17.0, "lags-noclip": 12.6})
    assert "no dense-noclip run on the same seeds" in rows["lags-noclip"] and "nan" not in text
    assert "+30.77% (1)" in rows["lags"]
    text, rows = report({"dense": 13.0, "dense-noclip": 10.5, "lags-noclip": 12.6})
    assert "+20.00% (1) vs dense-noclip" in rows["lags-noclip"]
    setup = text.split("## Setup")[1]
    assert "Shakespeare" in setup and "Fashion-MNIST" not in setup and "momentum correction" not in setup
    assert "(none in the -noclip runs; in the -clipfb runs the optimizer clips" in setup


@pytest.mark.parametrize("suite", [s for s in convergence.SUITES if convergence.results_dir(s).exists()])
def test_each_committed_report_is_what_its_committed_results_give(suite, tmp_path):
    """docs/convergence-<suite>.md is written from the suite's committed CSVs and logs, never
    edited by hand: a change to the report's text or to a suite's settings regenerates it
    (``scripts/convergence.py --suite <suite> --report-only``)."""
    settings, results = convergence.suite_settings(suite), convergence.results_dir(suite)
    written = tmp_path / "report.md"
    convergence.write_report(convergence.load(results), suite, settings, results, written)
    committed = convergence.ROOT / "docs" / f"convergence-{suite}.md"
    assert written.read_text() == committed.read_text(), f"{committed.name} is out of date: regenerate it"
