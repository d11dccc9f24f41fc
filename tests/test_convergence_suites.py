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
