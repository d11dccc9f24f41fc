"""The soak test's short version (make soak runs 2,000 iterations): 2 workers, 300 iterations."""

import json

from launch import HERE, horovodrun

ITERATIONS = 300


def test_short_soak_leaves_nothing_behind_and_memory_flat(tmp_path):
    horovodrun(
        2,
        "gloo",
        None,
        str(HERE.parent / "scripts" / "soak.py"),
        "--iterations",
        str(ITERATIONS),
        "--out",
        str(tmp_path),
    )
    for rank in range(2):
        summary = json.loads((tmp_path / f"soak.{rank}.json").read_text())
        assert summary["iterations"] == ITERATIONS and summary["violations"] == []
        assert summary["skipped_steps"] == ITERATIONS // 97  # the poisoned steps, on every rank
        assert summary["tensors_end"] == summary["tensors_warmup"]
        assert summary["rss_growth_mib"] <= 8.0
