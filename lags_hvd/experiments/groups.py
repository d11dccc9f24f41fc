"""The workers of ``adam_methods``' methods: the few cross-worker operations they use, over
the workers one process holds.

A method sees its workers' tensors as lists with one entry per worker held here (``local``):
all P of them in the one-process study (``Simulated``), this rank's alone in a job of P
processes (``Collective``, over ``lags_hvd.collectives``). Each operation is over all P
workers, in worker order:

* ``mean(xs) = (1 / P) sum_p x_p`` and ``sum(xs) = sum_p x_p`` (dense allreduce);
* ``gather(xs) = [x_0, ..., x_{P-1}]`` (allgather of tensors of one shape on every worker).

So one implementation of each method runs in the study and in the suite's processes, and the
study is the processes' oracle (``tests/test_adam_methods.py``). A method keeps what every
worker shares (the consensus model, shared moments, PowerSGD's ``Q``) as a copy per process
and never re-synchronises it: that holds because every rank receives the same bits from an
allreduce (as Gloo's, MPI's and NCCL's do) and computes the same from them.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ..collectives import DEFAULT_TIMEOUT, Collectives

__all__ = ["Group", "Simulated", "Collective"]


class Group(ABC):
    """P workers, ``local`` of them held here (their global indices ``ranks``)."""

    size: int
    ranks: list[int]

    @property
    def local(self) -> int:
        return len(self.ranks)

    @abstractmethod
    def sum(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """``sum_p x_p`` over all P workers, given the local workers' ``xs``."""

    def mean(self, xs: list[torch.Tensor]) -> torch.Tensor:
        """``(1 / P) sum_p x_p``."""
        return self.sum(xs) / self.size

    @abstractmethod
    def gather(self, xs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Every worker's tensor, in worker order; every worker's has the same shape."""


class Simulated(Group):
    """All P workers in this process: the one-process study."""

    def __init__(self, size: int):
        self.size, self.ranks = size, list(range(size))

    def sum(self, xs):
        return sum(xs[1:], xs[0].clone())

    def mean(self, xs):
        return torch.stack(xs).mean(0)

    def gather(self, xs):
        return list(xs)


class Collective(Group):
    """This rank's worker in a job of P processes; every wait bounded by ``timeout``. Ranks
    call the operations in one order, so the collectives' names (a running count) match."""

    def __init__(self, collectives: Collectives, timeout: float = DEFAULT_TIMEOUT):
        self.collectives, self.timeout, self.calls = collectives, timeout, 0
        self.size, self.ranks = collectives.size, [collectives.rank]

    def _name(self, what: str) -> str:
        self.calls += 1
        return f"anchor.{what}.{self.calls}"

    def _wait(self, handle, name: str):
        return self.collectives.wait(handle, name, self.timeout)

    def sum(self, xs):
        (x,) = xs
        name = self._name("sum")
        return self._wait(self.collectives.allreduce(x.clone(), name, "sum"), name)

    def gather(self, xs):
        (x,) = xs
        name = self._name("gather")
        return list(self._wait(self.collectives.allgather(x.contiguous(), name), name).chunk(self.size))
