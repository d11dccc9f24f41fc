"""Sparse gradients on the wire: pack, unpack and merge. Pure tensor functions.

One worker's contribution for one exchange unit is ``(values, indices)`` with
``k`` entries. It travels as a single byte message so that one allgather carries
both::

    [ indices as int32 (int64 when the unit has >= 2**31 entries) | pad to 8 ]
    [ values in the wire dtype                                    | pad to 8 ]

Every rank uses the same ``k`` for a unit, so the allgathered result is P
messages of identical length, one per rank in rank order. ``merge_into`` sums
them into the unit's range of a flat gradient buffer, rank 0 first, for all units
of the buffer at once:

    dense = sum_{p=0}^{P-1} scatter(values_p, indices_p)

Each rank's indices are distinct, so the summation order is fixed and the
result is bit-for-bit reproducible on every device.
"""
from __future__ import annotations

import torch

__all__ = ["index_dtype_for", "message_bytes", "unit_message_bytes", "pack", "sections", "unpack", "merge_into"]

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


def unit_message_bytes(k: int, numel: int, value_size: int) -> int:
    """Bytes one worker contributes per iteration for a unit of ``numel`` entries sending
    ``k``: the whole gradient when ``k == numel`` (a dense allreduce), else one message."""
    if k == numel:
        return numel * value_size
    return message_bytes(k, value_size, index_dtype_for(numel).itemsize)


def pack(values: torch.Tensor, indices: torch.Tensor, index_dtype: torch.dtype) -> torch.Tensor:
    """One uint8 message holding ``indices`` (cast to ``index_dtype``) and ``values``."""
    if values.dim() != 1 or values.shape != indices.shape:
        raise ValueError(f"values and indices must be 1-D of equal length, "
                         f"got {tuple(values.shape)} and {tuple(indices.shape)}")
    k = values.numel()
    message = torch.zeros(message_bytes(k, values.dtype.itemsize, index_dtype.itemsize), dtype=torch.uint8,
                          device=values.device)
    index_section, value_section = sections(message, k, values.dtype, index_dtype)
    index_section.copy_(indices)
    value_section.copy_(values)
    return message


def sections(message: torch.Tensor, k: int, value_dtype: torch.dtype,
             index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Typed views of a message's index and value sections: writing into them packs it
    again (a send buffer reused every iteration)."""
    index_bytes, values_start, total = _sections(k, value_dtype.itemsize, index_dtype.itemsize)
    if message.dtype != torch.uint8 or message.shape != (total,):
        raise ValueError(f"a message for k={k} must be {total} bytes (uint8), got {tuple(message.shape)} "
                         f"{message.dtype}")
    return (message[:index_bytes].view(index_dtype),
            message[values_start:values_start + k * value_dtype.itemsize].view(value_dtype))


def unpack(gathered: torch.Tensor, k: int, value_dtype: torch.dtype,
           index_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an allgathered byte tensor into ``values`` (P, k) and ``indices`` (P, k, of
    ``index_dtype``): views of ``gathered``, nothing copied."""
    index_bytes, values_start, total = _sections(k, value_dtype.itemsize, index_dtype.itemsize)
    if gathered.dtype != torch.uint8 or gathered.dim() != 1 or gathered.numel() % total:
        raise ValueError(f"gathered message of {gathered.numel()} bytes ({gathered.dtype}) is not a "
                         f"whole number of {total}-byte messages for k={k}: ranks disagree on k "
                         f"or on the value dtype")
    rows = gathered.view(-1, total)
    indices = rows[:, :index_bytes].view(index_dtype)
    values = rows[:, values_start:values_start + k * value_dtype.itemsize].view(value_dtype)
    return values, indices


def merge_into(dense: torch.Tensor, parts, divide_by: int = 1, multiply_by: float = 1.0) -> torch.Tensor:
    """Sum the P contributions of several units into one flat buffer, in rank order::

        dense[o + i] = (sum_p values_p[i at indices_p]) / divide_by * multiply_by

    ``parts``: ``(offset, values (P, k), indices (P, k), numel)`` per unit, whose range
    ``[offset, offset + numel)`` of ``dense`` must be zero where it is touched. One
    ``index_add_`` per rank over all units (each rank's indices are distinct, so the sum
    is deterministic on every device), then one scaling of the touched entries. Raises
    ValueError for an index outside its unit (one host read). Returns the merged values
    at the touched positions (with repeats), for a finiteness check.
    """
    if not parts:
        return dense.new_empty(0)
    for _, values, indices, _ in parts:
        if values.shape != indices.shape or values.dim() != 2:
            raise ValueError(f"expected (P, k) values and indices, got {tuple(values.shape)} "
                             f"and {tuple(indices.shape)}")
    ranks, total = parts[0][1].shape[0], sum(values.shape[1] for _, values, _, _ in parts)
    positions = torch.empty(ranks, total, dtype=torch.int64, device=dense.device)
    gathered = torch.empty(ranks, total, dtype=dense.dtype, device=dense.device)
    column = 0
    for offset, values, indices, _ in parts:
        k = values.shape[1]
        torch.add(indices, offset, out=positions[:, column:column + k])
        gathered[:, column:column + k].copy_(values)
        column += k
    def per_column(numbers):   # one value per part, repeated over its k columns
        return torch.tensor(numbers, device=dense.device).repeat_interleave(ks, output_size=total)
    ks = torch.tensor([values.shape[1] for _, values, _, _ in parts], device=dense.device)
    lower = per_column([offset for offset, _, _, _ in parts])
    upper = lower + per_column([numel for _, _, _, numel in parts])
    if bool(((positions < lower) | (positions >= upper)).any()):
        raise ValueError("an index lies outside its unit: corrupted or mismatched message")
    for rank_positions, rank_values in zip(positions, gathered):
        dense.index_add_(0, rank_positions, rank_values)
    positions = positions.reshape(-1)
    merged = dense.index_select(0, positions)
    if divide_by != 1 or multiply_by != 1.0:
        if divide_by != 1:
            merged.div_(divide_by)
        if multiply_by != 1.0:
            merged.mul_(multiply_by)
        dense.index_copy_(0, positions, merged)
    return merged
