"""``Collectives``: the interface every communication backend implements.

Asynchronous collectives return a handle at once; ``wait(handle)`` blocks, bounded:
after ``timeout`` seconds it raises ``ExchangeTimeoutError`` naming the collective,
and a backend error that means a peer died or left becomes ``WorkerLostError``,
whether it comes when the collective starts or while it is waited for. Before either
error the group is given up (``abandon``): collectives a stalled peer never joins stay
in flight, and the process must still be able to exit. Ranks are the group's own
(0 to size - 1) unless named ``global``.
"""

from __future__ import annotations

import pickle
import time
from abc import ABC, abstractmethod

import torch

from ..errors import ExchangeTimeoutError, WorkerLostError

__all__ = [
    "DEFAULT_TIMEOUT",
    "Collectives",
    "NoCompression",
    "allgather_object",
    "casts_only",
    "broadcast_object",
    "broadcast_tensors",
]

DEFAULT_TIMEOUT = 600.0
"""Seconds a rank waits for the others in one collective before it gives up (10 minutes:
far above any exchange, long enough for rank 0 alone to evaluate or save a checkpoint)."""

OPS = ("sum", "average", "max")


class NoCompression:
    """Values travel as they are (the interface of Horovod's ``Compression`` classes)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


def casts_only(compression) -> bool:
    """Whether ``compression`` depends on the values' dtype alone: none, or Horovod's none or
    fp16 (a cast, whose wire dtype and context are known before any value is seen, and which
    a CUDA graph may capture). A compression of any other kind may depend on the values."""
    if compression is NoCompression:
        return True
    return getattr(compression, "__module__", None) == "horovod.torch.compression" and getattr(
        compression, "__name__", None
    ) in ("NoneCompressor", "FP16Compressor")


class Collectives(ABC):
    """A group of workers and the collectives over it. Subclasses implement the
    underscored methods; the public ones add the bounded wait and the error for a lost peer.

    ``op`` of ``allreduce``: "sum", "average" (the sum divided by ``size``) or "max";
    ``prescale`` and ``postscale`` multiply before and after the reduction."""

    # ------------------------------------------------------------------ the group
    @property
    @abstractmethod
    def size(self) -> int:
        """Workers in the group."""

    @property
    @abstractmethod
    def rank(self) -> int:
        """This worker's rank in the group."""

    @property
    @abstractmethod
    def global_ranks(self) -> list[int]:
        """Every member's rank in the job, in group order."""

    @abstractmethod
    def global_rank(self) -> int | str:
        """This process's rank in the job ("?" once the backend has shut down)."""

    # ------------------------------------------------------------------ to implement
    @abstractmethod
    def _allgather(self, tensor: torch.Tensor, name: str, sizes: list[int] | None, out: torch.Tensor | None): ...

    @abstractmethod
    def _alltoall(self, tensor: torch.Tensor, splits: torch.Tensor, name: str, received: list[int] | None): ...

    @abstractmethod
    def _allreduce(self, tensor: torch.Tensor, name: str, op: str, prescale: float, postscale: float): ...

    @abstractmethod
    def _broadcast(self, tensor: torch.Tensor, root: int, name: str): ...

    @abstractmethod
    def _barrier(self) -> None: ...

    @abstractmethod
    def done(self, handle) -> bool:
        """Whether the collective has completed (never blocks)."""

    @abstractmethod
    def _result(self, handle):
        """The completed collective's result."""

    lost: tuple[type[BaseException], ...] = ()
    """The backend's errors that mean a peer died or left."""

    def is_lost(self, error: BaseException) -> bool:
        """Whether ``error`` means a peer died or left (by default: it is one of ``lost``)."""
        return isinstance(error, self.lost)

    def abandon(self) -> None:  # noqa: B027 (a hook: most backends have nothing to do)
        """Give the group up, before this rank raises ``ExchangeTimeoutError`` or ``WorkerLostError``:
        its collectives in flight may never end, and nothing will use the group again, but the
        process must be able to exit (so that a launcher ends the job). Nothing to do by default."""

    matched_by_order: bool = False
    """Whether the backend matches collectives by the order ranks issue them (torch.distributed)
    rather than by name (Horovod): then every rank must issue them in one order."""

    stall_hint: str = ""
    """How this backend names the ranks missing from a stalled collective, for the timeout's message."""

    # ------------------------------------------------------------------ the collectives
    def allgather(
        self,
        tensor: torch.Tensor,
        name: str,
        what: str | None = None,
        sizes: list[int] | None = None,
        out: torch.Tensor | None = None,
    ):
        """Every member's ``tensor`` concatenated along dim 0, in group order. ``sizes``: every
        member's dim 0 where they differ (None: all alike). ``out``: where the result may be
        written (the caller's buffer, kept from call to call: no allocation per call), of
        ``tensor``'s dtype and device; a backend that cannot use it allocates, and the
        result (the handle's, read after the wait) says where it lies."""
        with self.peer_loss(what, name):
            return self._allgather(tensor, name, sizes, out)

    def alltoall(
        self,
        tensor: torch.Tensor,
        splits: torch.Tensor,
        name: str,
        what: str | None = None,
        received: list[int] | None = None,
    ):
        """Rows ``splits[r]`` of ``tensor`` to member r; the result is ``(received, received_splits)``.
        ``received``: the rows every member sends this one, where the caller knows them."""
        with self.peer_loss(what, name):
            return self._alltoall(tensor, splits, name, received)

    def allreduce(
        self,
        tensor: torch.Tensor,
        name: str,
        op: str = "sum",
        prescale: float = 1.0,
        postscale: float = 1.0,
        what: str | None = None,
    ):
        """``tensor`` reduced in place over the group (the result is ``tensor``)."""
        if op not in OPS:
            raise ValueError(f"op must be one of {OPS}, got {op!r}")
        with self.peer_loss(what, name):
            return self._allreduce(tensor, name, op, prescale, postscale)

    def broadcast(self, tensor: torch.Tensor, root: int, name: str, what: str | None = None):
        """The tensor of global rank ``root``, on every member."""
        with self.peer_loss(what, name):
            return self._broadcast(tensor, root, name)

    def barrier(self, what: str = "the barrier") -> None:
        with self.peer_loss(what):
            self._barrier()

    def wait(self, handle, what: str, timeout: float | None):
        """The result of ``handle``, bounded: after ``timeout`` seconds (None: no bound) raise
        ``ExchangeTimeoutError``; a peer gone raises ``WorkerLostError``.

        Polls with a pause that doubles from 20 us up to 0.5 ms, so a result that is already
        there costs one poll and a late one is noticed within half a millisecond."""
        with self.peer_loss(what):
            if timeout is not None and not self.done(handle):
                deadline, pause = time.monotonic() + timeout, 2e-5
                while not self.done(handle):
                    left = deadline - time.monotonic()
                    if left <= 0:
                        self.abandon()
                        others = [r for r in self.global_ranks if r != self.global_rank()]
                        raise ExchangeTimeoutError(
                            f"lags_hvd: {what} waited {timeout:g} s on rank {self.global_rank()} for ranks that "
                            f"never joined it: one or more of ranks {others} stalled, is busy with other work, "
                            "or calls step() fewer times than this rank. Raise exchange_timeout if a rank "
                            f"legitimately works alone this long (evaluation, saving){self.stall_hint}."
                        )
                    time.sleep(min(pause, left))
                    pause = min(2 * pause, 5e-4)
            return self._result(handle)

    def peer_loss(self, what: str | None, name: str | None = None) -> _PeerLoss:
        """Context manager: the backend's error for a lost peer becomes ``WorkerLostError``
        naming ``what`` (None: the exchange ``name``, phrased only if it fails)."""
        return _PeerLoss(self, what, name)


class _PeerLoss:
    """A class, not a generator-based context manager: it is entered twice per exchange,
    and the generator kind costs several times more."""

    __slots__ = ("collectives", "what", "name")

    def __init__(self, collectives: Collectives, what: str | None, name: str | None):
        self.collectives, self.what, self.name = collectives, what, name

    def __enter__(self):
        return self

    def __exit__(self, kind, lost, traceback):
        if kind is not None and not issubclass(kind, WorkerLostError) and self.collectives.is_lost(lost):
            self.collectives.abandon()
            what = self.what or f"the exchange {self.name!r}"
            raise WorkerLostError(
                f"lags_hvd: {what} failed on rank {self.collectives.global_rank()}: a worker died or left "
                f"the job; this rank stops too (restart from the last checkpoint). The backend said: "
                f"{str(lost)[:300]}"
            ) from lost
        return False


def allgather_object(collectives: Collectives, obj, name: str, timeout: float | None = DEFAULT_TIMEOUT) -> list:
    """Every member's ``obj`` in group order, with bounded waits."""
    payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
    sizes = collectives.wait(
        collectives.allgather(torch.tensor([payload.numel()]), f"{name}.sizes", name), name, timeout
    ).tolist()
    gathered = collectives.wait(collectives.allgather(payload, f"{name}.bytes", name, sizes), name, timeout)
    return [pickle.loads(chunk.numpy().tobytes()) for chunk in torch.split(gathered, sizes)]


def broadcast_object(collectives: Collectives, obj, root: int, name: str, timeout: float | None = DEFAULT_TIMEOUT):
    """``obj`` of global rank ``root`` on every member, with bounded waits."""
    payload = pickle.dumps(obj) if collectives.global_rank() == root else b""
    size = collectives.wait(
        collectives.broadcast(torch.tensor([len(payload)]), root, f"{name}.size", name), name, timeout
    )
    buffer = torch.zeros(int(size), dtype=torch.uint8)
    if payload:
        buffer.copy_(torch.frombuffer(bytearray(payload), dtype=torch.uint8))
    received = collectives.wait(collectives.broadcast(buffer, root, f"{name}.bytes", name), name, timeout)
    return pickle.loads(received.numpy().tobytes())


def broadcast_tensors(collectives: Collectives, named, root: int, timeout: float | None = DEFAULT_TIMEOUT) -> None:
    """Every tensor of ``named`` (``(name, tensor)`` pairs, as ``state_dict().items()``)
    overwritten in place with global rank ``root``'s, in name order, waits bounded."""
    for name, tensor in sorted(named, key=lambda item: item[0]):
        if not torch.is_tensor(tensor):
            raise TypeError(f"{name!r} is not a tensor ({type(tensor).__name__})")
        name = f"broadcast.{name}"
        received = collectives.wait(collectives.broadcast(tensor.detach(), root, name), name, timeout)
        with torch.no_grad():
            tensor.copy_(received)
