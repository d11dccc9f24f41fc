"""The benchmarks: same-run ratios per round, their median and quartiles; the engine benchmark's replayed hook."""

import math

import pytest

from lags_hvd import capture
from lags_hvd.experiments.bench_engine import replayed_hook_us
from lags_hvd.experiments.benchmark import paired_ratios, quartiles, summarize


def timing(forward, backward, sync, merge=0.001):
    return {
        "iteration": forward + backward + sync,
        "forward": forward,
        "backward": backward,
        "select": 0.0,
        "wait": sync - merge,
        "merge": merge,
        "merge_update": merge,
        "synchronize": sync,
    }


def method(rounds, **median):
    return {"median_s": timing(**median), "round_medians_s": rounds, "bytes_per_worker": 8, "throughput": 1.0}


RUN = {
    "model": "m",
    "workers": 2,
    "link_rate_mbit": 5.0,
    "comm_to_comp": 6.0,
    "paper_comm_to_comp": 6.0,
    "methods": {
        "local": method([1.0, 1.0, 2.0, 1.0, 1.0], forward=0.3, backward=0.7, sync=0.0),
        "topk": method([1.2, 1.4, 2.4, 1.3, 1.2], forward=0.3, backward=0.7, sync=0.3),
        "lags": method([1.1, 1.2, 2.0, 1.3, 1.0], forward=0.3, backward=0.7, sync=0.2),
        # serial: t_f 0.3, t_b 0.7, t_c 0.5 - 0.1 = 0.4: S_max = 1.4 / 1.0
        "lags-serial": method([1.32, 1.32, 2.2, 1.3, 1.2], forward=0.3, backward=0.7, sync=0.5, merge=0.1),
    },
}


def test_ratios_are_paired_round_by_round_and_reported_with_their_quartiles():
    assert paired_ratios(RUN["methods"]["topk"], RUN["methods"]["lags"]) == pytest.approx(
        [1.2 / 1.1, 1.4 / 1.2, 2.4 / 2.0, 1.0, 1.2]
    )
    assert quartiles([1.0, 2.0, 3.0, 4.0, 5.0]) == [2.0, 4.0]
    assert quartiles([1.5]) == [1.5, 1.5]
    rows = {row["method"]: row for row in summarize([RUN])}
    lags = rows["lags"]
    assert lags["speedup_vs_topk"] == pytest.approx(1.4 / 1.2)  # the median round's ratio
    assert lags["speedup_vs_topk_quartiles"] == pytest.approx([1.2 / 1.1, 1.2])
    assert lags["over_local"] == pytest.approx(1.1) and lags["over_local_quartiles"][1] == pytest.approx(1.2)
    assert rows["local"]["over_local"] == 1.0 and rows["local"]["over_local_quartiles"] == [1.0, 1.0]


def test_the_pipelining_benefit_is_a_fraction_per_round_of_the_serial_runs_maximum():
    lags = {row["method"]: row for row in summarize([RUN])}["lags"]
    assert lags["s_max"] == pytest.approx(1.4)
    fractions = [(s / floor - 1) / 0.4 for s, floor in zip([1.32, 1.32, 2.2, 1.3, 1.2], [1.1, 1.2, 2.0, 1.3, 1.0])]
    assert lags["fraction_of_max_benefit"] == pytest.approx(sorted(fractions)[2])
    assert lags["fraction_of_max_benefit_quartiles"] == pytest.approx(quartiles(fractions))


def test_a_launch_leaves_out_only_what_its_suite_says():
    from lags_hvd.experiments.benchmark import SUITES, launch_methods

    full = SUITES["full"]
    assert launch_methods(full, "inception_v4", 4) == [m for m in full["methods"] if m != "lags-default"]
    assert launch_methods(full, "inception_v4", 2) == full["methods"]
    assert launch_methods(full, "lstm_ptb", 4) == [
        m for m in full["methods"] if m not in ("dense", "lags-default", "lags-merged")
    ]
    assert launch_methods(SUITES["quick"], "resnet20", 2) == SUITES["quick"]["methods"]


def test_the_replayed_hook_is_timed_with_every_bucket_replayed_and_capture_left_as_it_was(hvd):
    """``bench_engine --replayed``: the LAGS hooks ran with their whole device work replayed
    (a free replay standing in for the graph) beside the floor and the empty hook, and the
    stand-in is gone afterwards."""
    before = capture.capturable, capture.cuda_graph
    measured = replayed_hook_us(rounds=2, layers=3)
    assert (capture.capturable, capture.cuda_graph) == before
    assert measured["buckets"] == measured["whole_hook_replayed"] == 6
    assert all(math.isfinite(measured[name]) for name in ("replayed", "launch_only", "empty", "over_launch_only"))
