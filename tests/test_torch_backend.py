"""The torch.distributed backend on its own: the collectives against their plain meaning, a lost
or stalled peer, and the package without Horovod (tests/workers/collectives_worker.py; plain
processes, not torchrun, so that the survivors' own errors are seen)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from workers.collectives_worker import SLEEP, TIMEOUT

WORKER = Path(__file__).parent / "workers" / "collectives_worker.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, scenario: str, out: Path, timeout: float = 60.0) -> list[dict]:
    """``world`` ranks of the worker on loopback; each rank's record (None if it wrote none;
    rank 0 always writes one)."""
    env = dict(
        os.environ,
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        WORLD_SIZE=str(world),
        GLOO_SOCKET_IFNAME="lo",
        OMP_NUM_THREADS="1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(out), scenario],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outputs = []
    for proc in procs:
        try:
            outputs.append(proc.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise AssertionError(f"{scenario}: a rank hung for {timeout} s") from None
    records = []
    for r in range(world):
        path = out / f"{scenario}.{r}.json"
        records.append(json.loads(path.read_text()) if path.exists() else None)
    assert records[0] is not None, outputs[0][-3000:]
    return records


@pytest.mark.parametrize("world", [2, 3])
def test_every_collective_means_what_it_says(world, tmp_path):
    ranks = launch(world, "collectives", tmp_path)
    for rank, record in enumerate(ranks):
        assert record is not None and "error" not in record, record
        assert record["allgather"] == [float(10 * r + i) for r in range(world) for i in range(3)]
        assert record["allgather_sizes"] == [[float(r)] * 2 for r in range(world) for _ in range(r + 1)]
        assert record["allgather_into"] == [  # into the caller's buffer where it fits, twice
            [[float(10 * r + i + turn) for r in range(world) for i in range(3)], turn < 2] for turn in range(3)
        ]
        # rank r sent rank `rank` (rank + r) rows of 100 r + rank
        expected = [100.0 * r + rank for r in range(world) for _ in range(rank + r)]
        splits = [rank + r for r in range(world)]
        assert record["alltoall"] == record["alltoall_known"] == [expected, splits]
        assert record["sum"] == [sum(1.0 + r for r in range(world)), 2.0 * world]
        average = 3.0 * sum(0.5 * 4.0 * (r + 1) for r in range(world)) / world
        assert record["average"] == record["average_in_place"] == [pytest.approx(average)]
        assert record["max"] == [float(world - 1)]
        assert record["broadcast"] == [8.0] and record["broadcast_source_kept"] == [7.0 + rank]
        assert record["objects"] == [{"rank": r, "pad": "x" * (50 * r)} for r in range(world)]
        assert record["object"] == {"from": 0}


def test_a_peer_that_leaves_raises_worker_lost(tmp_path):
    waiting, _ = launch(2, "die", tmp_path)
    assert waiting["error"]["type"] == "WorkerLostError", waiting
    assert "the exchange 'lags.doomed' failed on rank 0" in waiting["error"]["message"]
    assert waiting["seconds"] < 30


def test_a_stalled_peer_ends_the_wait_after_the_timeout(tmp_path):
    waiting, sleeper = launch(2, "stall", tmp_path)
    assert waiting["error"]["type"] == "ExchangeTimeoutError", waiting
    assert f"waited {TIMEOUT:g} s on rank 0" in waiting["error"]["message"]
    assert "'lags.late'" in waiting["error"]["message"] and "ranks [1]" in waiting["error"]["message"]
    assert waiting["seconds"] < SLEEP
    assert sleeper is None or sleeper["error"]["type"] in ("WorkerLostError", "ExchangeTimeoutError")


def test_the_package_imports_and_trains_without_horovod(tmp_path):
    """Horovod's import refused: ``lags_hvd`` and ``lags_hvd.distributed`` import, one LAGS
    step runs at P = 1, and Horovod's names say what is missing."""
    (record,) = launch(1, "no-horovod", tmp_path)
    assert "error" not in record, record
    assert record["horovod_loaded"] is False
    assert "Horovod is not installed" in record["horovod_api"] and "lags_hvd.distributed" in record["horovod_api"]
    assert record["k"] == {"weight": 8, "bias": 1}
    assert record["moved"] > 0


def test_the_gathered_checkpoints_cost_is_measured_against_a_ranks_own(tmp_path):
    """``lags_hvd.experiments.gather_checkpoint`` at a small size: rank 0's record of the file
    (the wrapped optimizer's state once, every rank's LAGS state) and of the three timings."""
    from launch import TORCH, horovodrun

    args = ("-m", "lags_hvd.experiments.gather_checkpoint", "--params", "40000", "--width", "100")
    horovodrun(2, TORCH, None, *args, "--repeats", "1", "--out", str(tmp_path), timeout=120)
    record = json.loads((tmp_path / "gather.json").read_text())
    assert record["world"] == 2 and record["params"] == 4 * (100 * 100 + 100)
    weights = 4 * 4 * 100 * 100  # bytes of the weights, whose residuals and velocities each rank keeps
    assert record["own_file_bytes"] + 2 * weights <= record["file_bytes"] < 2 * record["own_file_bytes"]
    assert all(record[key] > 0 for key in ("state_dict_s", "gathered_state_dict_s", "load_gathered_s"))
