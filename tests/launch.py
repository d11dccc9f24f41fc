"""Start P workers on this machine only: with horovodrun (its Gloo or MPI controller), or with
torchrun over torch.distributed's Gloo (the "torch" controller; the workers' ``backend``
module then gives them lags_hvd.distributed; "torch-cuda": the same on the one GPU)."""

import contextlib
import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
CONTROLLERS = ["gloo", "mpi"]  # Horovod's
TORCH = "torch"  # torchrun and torch.distributed (Gloo)
TORCH_CUDA = "torch-cuda"  # the same, every rank's model on the one GPU (CUDA tensors over Gloo)
QUICK_EXIT = HERE / "quick_exit"
"""On PYTHONPATH of every process the suite starts (tests/conftest.py): its sitecustomize skips the
final garbage collection at exit. ``start(..., quick_exit=False)`` leaves it out."""


@functools.cache
def _built(controller: str) -> bool:
    """Whether this Horovod was built with ``controller`` (gloo or mpi), asked once: the
    launches skip horovodrun's own probe (tests/horovodrun.py)."""
    import horovod.torch

    return bool(getattr(horovod.torch, f"{controller}_built")())


def start(np_: int, controller: str, script: str | None, *args: str, quick_exit: bool = True) -> subprocess.Popen:
    """Launch ``script`` (in tests/workers/; None: ``args`` start with python's own, e.g. -m) on
    ``np_`` local workers, in a session of its own; see ``finish``. ``quick_exit=False``: the
    workers exit exactly as outside the suite (``QUICK_EXIT`` left off their PYTHONPATH)."""
    program = [*([str(HERE / "workers" / script)] if script else []), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HOROVOD_GLOO_IFACE="lo")
    if not quick_exit:
        paths = env.get("PYTHONPATH", "").split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join(path for path in paths if path != str(QUICK_EXIT))
    env.pop("LAGS_TEST_BACKEND", None)
    env.pop("LAGS_TEST_DEVICE", None)
    if controller in (TORCH, TORCH_CUDA):  # --standalone: the rendezvous on a free port of localhost
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={np_}", *program]
        env.update(LAGS_TEST_BACKEND=TORCH, GLOO_SOCKET_IFNAME="lo")
        if controller == TORCH_CUDA:
            env.update(LAGS_TEST_DEVICE="cuda")
    else:
        if os.environ.get("LAGS_TESTS_WITHOUT_HOROVOD"):  # asked for, never inferred from a broken install
            pytest.skip("LAGS_TESTS_WITHOUT_HOROVOD is set: Horovod's launches are skipped")
        if not _built(controller):
            pytest.fail(
                f"Horovod was built without {controller}: reinstall it with HOROVOD_WITH_{controller.upper()}=1"
            )
        cmd = [
            sys.executable,
            str(HERE / "horovodrun.py"),
            "-np",
            str(np_),
            "-H",
            f"localhost:{np_}",
            f"--{controller}",
            sys.executable,
        ]
        cmd += program
    return spawn(cmd, env)


def spawn(cmd: list[str], env: dict | None = None, cwd=None) -> subprocess.Popen:
    """``cmd`` in a session of its own, its output captured (``finish`` reads it): also for a
    program that starts its own ranks (Lightning's launcher, an example)."""
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd, start_new_session=True
    )


def finish(proc: subprocess.Popen, timeout: float = 240.0) -> str:
    """Wait for ``proc``; raise with the output if it fails or hangs (then kill its session)."""
    command = " ".join(proc.args)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        for pid in descendants(proc.pid):  # torchrun starts its workers in sessions of their own
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        raise AssertionError(f"workers hung for {timeout}s: {command}\n{output[-4000:]}") from None
    if proc.returncode != 0:
        raise AssertionError(f"workers failed (exit {proc.returncode}): {command}\n{output[-6000:]}")
    return output


def horovodrun(np_: int, controller: str, script: str | None, *args: str, timeout: float = 240.0):
    """``start`` then ``finish``: the workers' output."""
    return finish(start(np_, controller, script, *args), timeout)


class SharedLaunches:
    """Launches run once and read by many tests: a launch costs seconds of start-up on two
    cores, a scenario a fraction of one, so the scenarios of one (P, controller, script) run in
    order in the same workers (the script takes ``--out`` and ``--scenarios a,b,c``)."""

    OUTPUT = "launch.log"

    def __init__(self, tmp_path_factory):
        self._factory = tmp_path_factory
        self._done: dict[tuple, tuple[Path, str | None]] = {}

    def run(self, world: int, controller: str, script: str, scenarios, *args: str, timeout: float):
        """``(output folder, failure)`` of ``script``'s launch of ``scenarios`` (and ``args``) on
        ``world`` workers, run on first use; ``failure`` is the launcher's message, None if the
        launch succeeded. The workers' output is kept in ``OUTPUT`` in that folder."""
        key = (world, controller, script, *args)
        if key not in self._done:
            folder = self._factory.mktemp(f"{Path(script).stem}-P{world}-{controller}{''.join(args)}")
            try:
                out = ("--out", str(folder), "--scenarios", ",".join(scenarios))
                output = horovodrun(world, controller, script, *out, *args, timeout=timeout)
                self._done[key] = folder, None
            except AssertionError as failure:
                output = str(failure)
                self._done[key] = folder, output
            (folder / self.OUTPUT).write_text(output)
        return self._done[key]


def _parent(pid: int) -> int:
    stat = (Path("/proc") / str(pid) / "stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def descendants(launcher: int) -> list[int]:
    """Every process below ``launcher``, whatever session it started."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            while pid > 1 and pid != launcher:
                pid = _parent(pid)
        except (OSError, ValueError, IndexError):
            continue
        if pid == launcher and int(entry.name) != launcher:
            found.append(int(entry.name))
    return sorted(found)


def worker_pids(launcher: int, program: list[str]) -> list[int]:
    """Descendants of ``launcher`` that run ``python <program...>``, e.g. ``["-m",
    "lags_hvd.experiments.train"]`` (horovodrun itself only carries it as arguments)."""
    found = []
    for pid in descendants(launcher):
        try:
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().decode().split("\0")
        except OSError:
            continue
        if argv[1 : 1 + len(program)] == program:
            found.append(pid)
    return found
