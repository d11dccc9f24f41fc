"""Start P workers with horovodrun (Gloo or MPI controller) on this machine only."""
import os
import signal
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
CONTROLLERS = ["gloo", "mpi"]


def horovodrun(np_: int, controller: str, script: str | None, *args: str, timeout: float = 240.0):
    """Run ``script`` (in tests/workers/; None: ``args`` start with python's own, e.g. -m) on
    ``np_`` local workers; raise with the output if it fails or hangs."""
    horovodrun_bin = Path(sys.executable).with_name("horovodrun")
    cmd = [str(horovodrun_bin), "-np", str(np_), "-H", f"localhost:{np_}", f"--{controller}"]
    cmd += [sys.executable, *([str(HERE / "workers" / script)] if script else []), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               HOROVOD_GLOO_IFACE="lo")
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"workers hung for {timeout}s: {' '.join(cmd)}\n{output[-4000:]}")
    if proc.returncode != 0:
        raise AssertionError(f"workers failed (exit {proc.returncode}): {' '.join(cmd)}\n{output[-6000:]}")
    return output
