"""``TorchDistributedCollectives``: the collectives over a torch.distributed process group.

Any backend with the four collectives serves: Gloo for CPU tensors, NCCL for CUDA ones, or
both (``"cpu:gloo,cuda:nccl"``). A tensor travels on its own device where the group has a
backend for it; else (the small bookkeeping tensors the library keeps on the CPU, under
NCCL alone) it is copied to the group's device and its result copied back.

Streams, with NCCL: the hooks run on autograd's thread and enqueue selection and packing on
the current stream; an asynchronous collective's NCCL stream waits for the current stream
at launch (so it sends what the hook wrote), and ``work.wait()``, called once ``done`` sees
the collective's event complete, makes the current stream wait for the NCCL stream, so the
merge reads what arrived. Nothing blocks the host in between: ``done`` only queries the
event. A send buffer is rewritten only in the next iteration, after its ``wait``.

torch.distributed matches collectives by the order they are issued, not by name
(``matched_by_order``): every rank must issue the same collectives in the same order.
The engine launches a bucketing's exchanges in one fixed order for such a backend
(``Engine.launch_order``), and the collectives that follow a first one (the alltoall's
payload after its split sizes) start only inside ``wait``, which every rank calls in the
same order, never inside ``done``, which anyone may poll at any moment.

    allgather   ``all_gather_into_tensor``; members of unequal sizes (the caller says
                which) are padded to the largest and cut back on arrival
    alltoall    ``all_to_all_single``, its split sizes exchanged first unless the caller
                knows what it receives
    allreduce   ``all_reduce`` (sum or max) in place; prescale before, 1/P and postscale after
    broadcast   ``broadcast`` of a copy, so the caller's tensor stays as it was

After a timeout or a lost peer the group is aborted and never destroyed (``abandon``), so
that the process can exit with collectives still in flight.
"""

from __future__ import annotations

import ctypes
import functools
import time

import torch
import torch.distributed as dist

from .base import Collectives

__all__ = ["TorchDistributedCollectives", "all_gather_single"]

all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
"""``all_gather_into_tensor``, renamed in torch 2.13 (same arguments); older releases have only that name."""


_ABANDONED: list = []
"""The groups ``abandon`` gave up, each once."""


class _Handle:
    """A started collective: its work object and what turns the output into the result."""

    __slots__ = ("work", "result")

    def __init__(self, work, result):
        self.work, self.result = work, result


class _Chained:
    """A collective that needs a first one's result to start (the alltoall's payload after
    its split sizes); ``then`` starts it from that result, inside ``wait``."""

    __slots__ = ("first", "then", "second")

    def __init__(self, first: _Handle, then):
        self.first, self.then, self.second = first, then, None


class TorchDistributedCollectives(Collectives):
    """The collectives over ``group`` (the default process group when None)."""

    lost = (dist.DistError,)
    # what Gloo's transport raises, as a plain RuntimeError, when a peer's connection goes
    _GONE = ("closed by peer", "reset by peer", "broken pipe", "connection refused", "remote worker")
    stall_hint = "; TORCH_DISTRIBUTED_DEBUG=DETAIL makes torch.distributed report the collectives each rank issued"
    matched_by_order = True

    def __init__(self, group=None):
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: call torch.distributed.init_process_group() "
                "first (torchrun sets the environment it reads)"
            )
        self.group = group if group is not None else dist.group.WORLD
        self.backends = _backends_by_device(dist.get_backend(self.group) if self.member else dist.get_backend())
        self.device = (
            torch.device("cpu") if "cpu" in self.backends else torch.device("cuda", torch.cuda.current_device())
        )

    def is_lost(self, error: BaseException) -> bool:
        """torch.distributed's errors, and Gloo's for a connection a peer dropped."""
        return isinstance(error, self.lost) or (
            isinstance(error, RuntimeError) and any(gone in str(error).lower() for gone in self._GONE)
        )

    def abandon(self) -> None:
        """Abort the group, then keep it alive until the process ends. Gloo's destructor waits
        for every collective in flight, each bounded only by the group's own timeout (30 minutes
        by default), and its ``abort()``, ``shutdown()`` and ``destroy_process_group`` end none
        of them (torch 2.13): destroyed at interpreter exit, the group would hold a rank whose
        peer stalled until that peer came back, and torchrun, which stops the other workers once
        one has ended, would never end the job. A reference never released keeps the destructor
        from running; the process's end closes the connections (the peers then see them closed)."""
        if any(group is self.group for group in _ABANDONED):
            return
        self.group.abort()  # NCCL's collectives in flight end here; Gloo's do not
        _ABANDONED.append(self.group)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(self.group))

    @property
    def member(self) -> bool:
        """Whether this process belongs to the group."""
        return dist.get_rank(self.group) >= 0

    @functools.cached_property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    @functools.cached_property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    @functools.cached_property
    def global_ranks(self) -> list[int]:
        return list(dist.get_process_group_ranks(self.group))

    def global_rank(self) -> int | str:
        return dist.get_rank() if dist.is_initialized() else "?"

    # ------------------------------------------------------------------ the collectives
    def _allgather(self, tensor: torch.Tensor, name: str, sizes: list[int] | None, out: torch.Tensor | None):
        home, tensor = tensor.device, self._here(tensor).contiguous()
        rows = max(sizes) if sizes is not None else tensor.shape[0]
        if rows != tensor.shape[0]:
            padded = tensor.new_zeros((rows, *tensor.shape[1:]))
            padded[: tensor.shape[0]] = tensor
            tensor = padded
        shape = (self.size * rows, *tensor.shape[1:])
        if out is None or out.shape != shape or out.dtype != tensor.dtype or out.device != tensor.device:
            out = tensor.new_empty(shape)
        work = all_gather_single(out, tensor, group=self.group, async_op=True)
        if sizes is None or all(size == rows for size in sizes):
            return _Handle(work, lambda: out.to(home))
        return _Handle(work, lambda: torch.cat([out[r * rows : r * rows + n] for r, n in enumerate(sizes)]).to(home))

    def _alltoall(self, tensor: torch.Tensor, splits: torch.Tensor, name: str, received: list[int] | None):
        home, tensor = tensor.device, self._here(tensor).contiguous()
        sent = [int(n) for n in splits.tolist()]

        def payload(counts: list[int]) -> _Handle:
            out = tensor.new_empty((sum(counts), *tensor.shape[1:]))
            work = dist.all_to_all_single(out, tensor, counts, sent, group=self.group, async_op=True)
            arrived = torch.tensor(counts, dtype=torch.int32)
            return _Handle(work, lambda: (out.to(home), arrived))

        if received is not None:
            return payload(list(received))
        counts = torch.empty(self.size, dtype=torch.int64, device=tensor.device)
        work = dist.all_to_all_single(
            counts, torch.tensor(sent, dtype=torch.int64, device=tensor.device), group=self.group, async_op=True
        )
        return _Chained(_Handle(work, lambda: counts), lambda arrived: payload(arrived.tolist()))

    def _allreduce(self, tensor: torch.Tensor, name: str, op: str, prescale: float, postscale: float):
        home, wire = tensor, self._here(tensor)
        if prescale != 1.0:
            wire.mul_(prescale)
        reduce_op = dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM
        work = dist.all_reduce(wire, op=reduce_op, group=self.group, async_op=True)
        scale = postscale / self.size if op == "average" else postscale

        def result():
            if scale != 1.0:
                wire.mul_(scale)
            if wire is not home:
                home.copy_(wire)
            return home

        return _Handle(work, result)

    def _broadcast(self, tensor: torch.Tensor, root: int, name: str):
        home, copy = tensor.device, self._here(tensor).clone()
        work = dist.broadcast(copy, src=root, group=self.group, async_op=True)
        return _Handle(work, lambda: copy.to(home))

    def _barrier(self) -> None:
        dist.barrier(group=self.group)

    def done(self, handle) -> bool:
        if isinstance(handle, _Chained):
            return handle.second is not None and handle.second.work.is_completed()
        return handle.work.is_completed()

    def _result(self, handle):
        handle.work.wait()  # completed: raises the backend's error, if any
        return handle.result()

    def wait(self, handle, what: str, timeout: float | None):
        """``Collectives.wait``; a chained collective's second part starts here, once the
        first's result is in, within the same bound."""
        if not isinstance(handle, _Chained):
            return super().wait(handle, what, timeout)
        if handle.second is None:
            started = time.monotonic()
            first = super().wait(handle.first, what, timeout)
            if timeout is not None:
                timeout = max(0.0, timeout - (time.monotonic() - started))
            with self.peer_loss(what):
                handle.second = handle.then(first)
        return super().wait(handle.second, what, timeout)

    def _here(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` where the group can send it: itself, or a copy on the group's device. From
        the CPU to a GPU through pinned memory, without blocking: a blocking copy waits for all
        the work queued on the stream, which in a hook (the step check's rows) is backward's."""
        if tensor.device.type in self.backends:
            return tensor
        if tensor.device.type == "cpu" and self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor.to(self.device)


def _backends_by_device(backend: str) -> dict[str, str]:
    """``"gloo"`` -> {"cpu": "gloo"}, ``"nccl"`` -> {"cuda": "nccl"}, ``"cpu:gloo,cuda:nccl"`` -> both."""
    if ":" in backend:
        return dict(part.split(":", 1) for part in backend.split(","))
    return {"cuda": backend} if backend == "nccl" else {"cpu": backend}
