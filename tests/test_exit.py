"""A job whose rank raises ends: under torchrun, a rank that raises ExchangeTimeoutError or
WorkerLostError exits on its own (the exception ends its program; no ``os._exit``), so torchrun
stops the stalled rank and the job ends non-zero within seconds of the error, far below the
stall (tests/workers/exit_worker.py). Before the group was abandoned on those errors, the rank
blocked at interpreter exit in Gloo's process-group destructor until the stalled peer came back.
These jobs exit exactly as outside the suite (``quick_exit=False``)."""

import json
import os
import signal
import subprocess
import time

import pytest
from launch import HERE, TORCH, start, worker_pids
from workers.exit_worker import STALL, TIMEOUT

BOUND = 45.0
"""Seconds from the error to the job's end (measured: a few; the stall lasts STALL)."""

LAUNCH = 180.0
"""Seconds the whole job may take, its start included (torch's import is slow on a busy machine)."""


def job(scenario: str, out, world: int = 2) -> tuple[int, str, float]:
    """torchrun of ``world`` workers: (its exit status, its output, the wall-clock time it ended)."""
    proc = start(world, TORCH, "exit_worker.py", "--out", str(out), "--scenario", scenario, quick_exit=False)
    try:
        output, _ = proc.communicate(timeout=LAUNCH)
    except subprocess.TimeoutExpired:  # torchrun's workers run in sessions of their own
        for pid in [*worker_pids(proc.pid, ["-u", str(HERE / "workers" / "exit_worker.py")]), proc.pid]:
            os.kill(pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"{scenario}: the job hung for {LAUNCH} s\n{output[-4000:]}") from None
    return proc.returncode, output, time.time()


@pytest.mark.parametrize(
    "scenario,errors",
    [
        ("stall-before", ("ExchangeTimeoutError",)),
        ("stall-backward", ("ExchangeTimeoutError",)),
        ("leaves", ("WorkerLostError", "ExchangeTimeoutError")),
        ("join-stall", ("ExchangeTimeoutError",)),
    ],
)
def test_the_rank_that_raises_exits_and_the_job_ends(scenario, errors, tmp_path):
    status, output, ended = job(scenario, tmp_path)
    record = json.loads((tmp_path / f"{scenario}.0.json").read_text())
    assert record["type"] in errors, record
    timed_out = f"waited {TIMEOUT:g} s" in record["message"] and "on rank 0" in record["message"]
    assert timed_out or "a worker died" in record["message"], record
    assert status != 0, output[-4000:]
    assert record["type"] in output  # the rank's own traceback, printed by its normal exit
    assert ended - record["at"] < min(BOUND, STALL / 10), output[-4000:]


def test_a_job_that_ends_normally_exits_zero(tmp_path):
    """Three workers (a job of three once ended in SIGABRT at exit; not reproduced since)."""
    status, output, _ = job("clean", tmp_path, world=3)
    assert status == 0, output[-4000:]
    assert "terminate called" not in output and "Signal" not in output, output[-4000:]
