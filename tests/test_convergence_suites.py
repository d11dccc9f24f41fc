"""The convergence suites' bookkeeping: which runs two suites share (no training here)."""
from lags_hvd.experiments import convergence


def test_a_run_is_shared_only_when_its_arguments_are_identical():
    full, aggregation, quick = (convergence.suite_settings(s) for s in ("full", "aggregation", "aggregation-quick"))
    same = convergence.training_args("fashion-mnist", "lags", 43, full)
    assert convergence.training_args("fashion-mnist", "lags", 43, aggregation) == same
    assert convergence.training_args("fashion-mnist", "lags", 43, quick) != same        # 4 epochs, not 12
    assert convergence.training_args("fashion-mnist", "lags", 44, full) != same         # another seed


def test_every_suite_plans_runs_with_distinct_arguments():
    for suite in convergence.SUITES:
        settings = convergence.suite_settings(suite)
        planned = [tuple(convergence.training_args(task, method, seed, settings))
                   for task in convergence.TASKS for method in settings["methods"][task] for seed in settings["seeds"]]
        assert planned and len(planned) == len(set(planned)), suite


def test_the_report_compares_a_method_with_its_baseline_on_the_seeds_both_finished(tmp_path, monkeypatch):
    """lags on seeds 42 and 43, lags-rs2 on 42 only: the gap is seed 42's, not a difference
    of means over different seeds; lags-dgc-rs is compared with lags-dgc, not lags."""
    monkeypatch.setattr(convergence, "ROOT", tmp_path)
    (tmp_path / "results").mkdir()
    final = {"lags": {42: 0.9047, 43: 0.9027}, "lags-rs2": {42: 0.8965},
             "lags-dgc": {42: 0.9149}, "lags-dgc-rs": {42: 0.9100, 43: 0.9000}}
    data = {"fashion-mnist": {method: {seed: [{"test_accuracy": accuracy, "step": 1.0}]
                                       for seed, accuracy in seeds.items()} for method, seeds in final.items()}}
    report = tmp_path / "report.md"
    settings = convergence.suite_settings("aggregation")
    convergence.write_report(data, "aggregation", settings, tmp_path / "results", report)
    rows = {line.split("|")[1].strip(): line for line in report.read_text().splitlines() if line.startswith("| lags")}
    assert "90.37% ± 0.14 (2) | +0.00 pp (2)" in rows["lags"]
    assert "89.65% ± 0.00 (1) | -0.82 pp (1)" in rows["lags-rs2"]
    assert "not run yet" in rows["lags-rs"]
    assert "90.50% ± 0.71 (2) | -0.49 pp (1) vs lags-dgc" in rows["lags-dgc-rs"]   # its own baseline
