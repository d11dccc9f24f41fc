"""Sparse gradients on the wire: pack, unpack and merge. Pure tensor functions.

One worker's contribution for one exchange unit is ``(values, indices)`` with
``k`` entries. It travels as a single byte message so that one allgather carries
both::

    [ indices as int32 (int64 when the unit has >= 2**31 entries) | pad to 8 ]
    [ values in the wire dtype                                    | pad to 8 ]

Every rank uses the same ``k`` for a unit, so the allgathered result is P
messages of identical length, one per rank in rank order. ``merge`` sums them
into a dense vector, rank 0 first:

    dense = sum_{p=0}^{P-1} scatter(values_p, indices_p)

Each rank's indices are distinct, so the summation order is fixed and the
result is bit-for-bit reproducible on every device.
"""
from __future__ import annotations

import torch

__all__ = ["index_dtype_for", "message_bytes", "pack", "unpack", "merge"]

_ALIGN = 8


def index_dtype_for(numel: int) -> torch.dtype:
    """int32 indices when they fit (half the bytes), else int64."""
    return torch.int32 if numel < 2**31 else torch.int64


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _sections(k: int, value_size: int, index_size: int) -> tuple[int, int, int]:
    """Byte offsets: (index bytes, start of values, message length)."""
    index_bytes = k * index_size
    values_start = _padded(index_bytes)
    return index_bytes, values_start, values_start + _padded(k * value_size)


def message_bytes(k: int, value_size: int, index_size: int) -> int:
    """Length in bytes of one worker's message for ``k`` entries of the given item sizes."""
    return _sections(k, value_size, index_size)[2]


def pack(values: torch.Tensor, indices: torch.Tensor, index_dtype: torch.dtype) -> torch.Tensor:
    """One uint8 message holding ``indices`` (cast to ``index_dtype``) and ``values``."""
    if values.dim() != 1 or values.shape != indices.shape:
        raise ValueError(f"values and indices must be 1-D of equal length, "
                         f"got {tuple(values.shape)} and {tuple(indices.shape)}")
    k = values.numel()
    index_bytes, values_start, total = _sections(k, values.dtype.itemsize, index_dtype.itemsize)
    message = torch.zeros(total, dtype=torch.uint8, device=values.device)
    message[:index_bytes] = indices.to(index_dtype).view(torch.uint8)
    message[values_start:values_start + k * values.dtype.itemsize] = values.contiguous().view(torch.uint8)
    return message


def unpack(gathered: torch.Tensor, k: int, value_dtype: torch.dtype,
           index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an allgathered byte tensor into ``values`` (P, k) and int64 ``indices`` (P, k)."""
    index_bytes, values_start, total = _sections(k, value_dtype.itemsize, index_dtype.itemsize)
    if gathered.dtype != torch.uint8 or gathered.dim() != 1 or gathered.numel() % total:
        raise ValueError(f"gathered message of {gathered.numel()} bytes ({gathered.dtype}) is not a "
                         f"whole number of {total}-byte messages for k={k}: ranks disagree on k "
                         f"or on the value dtype")
    rows = gathered.view(-1, total)
    indices = rows[:, :index_bytes].contiguous().view(index_dtype).to(torch.int64)
    values = rows[:, values_start:values_start + k * value_dtype.itemsize].contiguous().view(value_dtype)
    return values, indices


def merge(values: torch.Tensor, indices: torch.Tensor, numel: int,
          dtype: torch.dtype | None = None) -> torch.Tensor:
    """Dense sum of the P sparse contributions ``values[p]`` at ``indices[p]``, rank order."""
    if values.shape != indices.shape or values.dim() != 2:
        raise ValueError(f"expected (P, k) values and indices, got {tuple(values.shape)} "
                         f"and {tuple(indices.shape)}")
    if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= numel):
        raise ValueError(f"an index lies outside [0, {numel}): corrupted or mismatched message")
    dense = torch.zeros(numel, dtype=dtype or values.dtype, device=values.device)
    for rank_values, rank_indices in zip(values, indices):
        dense.index_add_(0, rank_indices, rank_values.to(dense.dtype))
    return dense
