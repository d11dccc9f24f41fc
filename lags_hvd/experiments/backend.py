"""The experiment app's backends: Horovod (``horovodrun``, ``mpirun``) and torch.distributed
(``torchrun``), one small class each behind ``Backend``.

A backend starts and ends the job, says which rank this is, gives the job's collectives
(``lags_hvd.collectives``) and the front-end's optimizers; the app uses nothing else, so
``--backend`` changes nothing but the communication. Each imports its framework only when
chosen: the torch backend runs where Horovod is not installed. A backend that does not fit
the launcher is refused at ``init`` (``LauncherMismatch``): under torchrun, Horovod would
see each worker as a job of its own, all writing the same files.
"""

from __future__ import annotations

import functools
import os
from abc import ABC, abstractmethod

import torch

from ..collectives import DEFAULT_TIMEOUT, Collectives, broadcast_tensors

__all__ = [
    "Backend",
    "HorovodBackend",
    "TorchBackend",
    "BACKENDS",
    "DDP_BUCKET_NUMEL",
    "LauncherMismatch",
    "launcher",
    "default_backend",
]

DDP_BUCKET_NUMEL = 25 * 2**20 // 4
"""The torch backend's dense baseline merges parameters into buckets of this many float32
entries: DDP's default bucket (25 MiB)."""


class LauncherMismatch(RuntimeError):
    """The backend does not fit the launcher that started this process: its workers would not
    form one job."""


def launcher() -> str | None:
    """What started this process, by the environment it gives its workers: "torchrun" (or another
    launch for torch.distributed's env:// rendezvous), "horovodrun" (or mpirun), or None (one
    plain process)."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if any(name in env for name in ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")):
        return "horovodrun"
    if {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= env.keys():
        return "torchrun"
    return None


def default_backend() -> str:
    """The backend the launcher implies: "torch" under torchrun, else "horovod"."""
    return "torch" if launcher() == "torchrun" else "horovod"


class Backend(ABC):
    """A job's communication, as the experiment app uses it."""

    name: str

    @abstractmethod
    def init(self) -> None:
        """Join the job (every rank, first)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Leave it (every rank, last)."""

    @property
    @abstractmethod
    def collectives(self) -> Collectives:
        """The collectives over every rank of the job."""

    @property
    @abstractmethod
    def front_end(self):
        """The module with ``DistributedOptimizer`` and ``TopKDistributedOptimizer``."""

    @abstractmethod
    def dense(self, base: torch.optim.Optimizer, named: list) -> torch.optim.Optimizer:
        """Dense S-SGD: the framework's own dense data parallelism around ``base``."""

    @property
    def rank(self) -> int:
        return self.collectives.rank

    @property
    def size(self) -> int:
        return self.collectives.size

    def allreduce(self, tensor: torch.Tensor, name: str, op: str = "sum") -> torch.Tensor:
        """``tensor`` reduced over the job (``op``: "sum" or "average"), waits bounded."""
        collectives = self.collectives
        return collectives.wait(collectives.allreduce(tensor.clone(), name, op), name, DEFAULT_TIMEOUT)

    def barrier(self) -> None:
        self.allreduce(torch.zeros(1), "barrier")

    def broadcast_parameters(self, state: dict, root_rank: int = 0) -> None:
        """Every tensor of ``state`` overwritten with ``root_rank``'s, in place."""
        broadcast_tensors(self.collectives, state.items(), root_rank)


class HorovodBackend(Backend):
    """Horovod's global process set; dense S-SGD is ``horovod.torch.DistributedOptimizer``."""

    name = "horovod"

    def init(self) -> None:
        """Also refuses to run under torchrun, where Horovod sees one worker in each process."""
        import horovod.torch as hvd

        hvd.init()
        started = os.environ.get("WORLD_SIZE") if launcher() == "torchrun" else None
        if started is not None and int(started) != hvd.size():
            raise LauncherMismatch(
                f"rank {os.environ.get('RANK')}: the Horovod backend under torchrun, which started {started} "
                f"workers: Horovod sees {hvd.size()}, so each would train alone and write the same files. "
                "Under torchrun use the torch backend (--backend torch, the default there), or launch with horovodrun"
            )

    def shutdown(self) -> None:
        import horovod.torch as hvd

        hvd.shutdown()

    @functools.cached_property
    def collectives(self) -> Collectives:
        from ..collectives.horovod import HorovodCollectives

        return HorovodCollectives()

    @property
    def front_end(self):
        import lags_hvd

        return lags_hvd

    def dense(self, base, named):
        import horovod.torch as hvd

        return hvd.DistributedOptimizer(base, named_parameters=named)


class TorchBackend(Backend):
    """torch.distributed's default group over Gloo (the app trains on the CPU), as ``torchrun``
    sets it up; dense S-SGD is the optimizer at density 1, its parameters merged into DDP's
    25 MiB buckets (one in-place allreduce each, DDP's own exchange)."""

    name = "torch"

    def init(self) -> None:
        """Refuses, clearly, a process that torchrun did not start (it has no rendezvous to join)."""
        import torch.distributed as dist

        started = launcher()
        if started != "torchrun":
            raise LauncherMismatch(
                "the torch backend joins the workers torchrun starts (its RANK, WORLD_SIZE, MASTER_ADDR): "
                + (
                    "this process belongs to a job horovodrun or mpirun started: use the Horovod backend "
                    "(--backend horovod, the default there)"
                    if started
                    else "this process was not started by torchrun: launch it with torchrun --nproc-per-node P"
                )
            )
        dist.init_process_group("gloo")

    def shutdown(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()

    @functools.cached_property
    def collectives(self) -> Collectives:
        from ..collectives.torch_distributed import TorchDistributedCollectives

        return TorchDistributedCollectives()

    @property
    def front_end(self):
        import lags_hvd.distributed

        return lags_hvd.distributed

    def dense(self, base, named):
        return self.front_end.DistributedOptimizer(base, named, density=1.0, recipe="paper", buckets=DDP_BUCKET_NUMEL)


BACKENDS = {backend.name: backend for backend in (HorovodBackend, TorchBackend)}
"""The backends by ``--backend`` name (classes: instantiate one per job)."""
