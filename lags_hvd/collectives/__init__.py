"""The collectives seam: every collective lags_hvd uses, behind one interface.

``Collectives`` (``base``) is a group of workers and the asynchronous allgather,
alltoall, allreduce and broadcast over it, with bounded waits and one error for a
lost peer; ``allgather_object`` and ``broadcast_object`` are built on it. The
library (exchange, agreement, adaptive, profiling) uses nothing else. One module
per backend implements it: ``horovod`` (a Horovod process set) and ``torch_distributed``
(a torch.distributed process group). Only the first and the Horovod-facing API import Horovod.
"""

from .base import (
    DEFAULT_TIMEOUT,
    Collectives,
    NoCompression,
    allgather_object,
    broadcast_object,
    broadcast_tensors,
    casts_only,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "Collectives",
    "NoCompression",
    "casts_only",
    "allgather_object",
    "broadcast_object",
    "broadcast_tensors",
]
