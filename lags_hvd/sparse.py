"""Sparse gradients on the wire: pack, unpack and merge. Pure tensor functions.

One worker's contribution for one exchange unit is ``(values, indices)`` with
``k`` entries. It travels as a single byte message so that one allgather carries
both::

    [ indices as int32 (int64 when the unit has >= 2**31 entries) | pad to 8 ]
    [ values in the wire dtype                                    | pad to 8 ]

Every rank uses the same ``k`` for a unit, so the allgathered result is P
messages of identical length, one per rank in rank order. The units of one flat
gradient buffer are unpacked together (``unpack_many``: one concatenation and two
gathers) and ``merge_into`` sums them into their ranges of the buffer, rank 0
first, all units at once; where each entry sits and where it goes are computed
once per arrangement of units (``MessageColumns``, ``MergeColumns``), so an
iteration costs the same handful of operations however many units there are:

    dense = sum_{p=0}^{P-1} scatter(values_p, indices_p)

Each rank's indices are distinct, so the summation order is fixed and the
result is bit-for-bit reproducible on every device.
"""

from __future__ import annotations

import torch

__all__ = [
    "index_dtype_for",
    "message_bytes",
    "unit_message_bytes",
    "pack",
    "sections",
    "unpack",
    "unpack_many",
    "MessageColumns",
    "MergeColumns",
    "merge_into",
]

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
        raise ValueError(
            f"values and indices must be 1-D of equal length, got {tuple(values.shape)} and {tuple(indices.shape)}"
        )
    k = values.numel()
    message = torch.zeros(
        message_bytes(k, values.dtype.itemsize, index_dtype.itemsize), dtype=torch.uint8, device=values.device
    )
    index_section, value_section = sections(message, k, values.dtype, index_dtype)
    index_section.copy_(indices)
    value_section.copy_(values)
    return message


def sections(
    message: torch.Tensor, k: int, value_dtype: torch.dtype, index_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Typed views of a message's index and value sections: writing into them packs it
    again (a send buffer reused every iteration)."""
    index_bytes, values_start, total = _sections(k, value_dtype.itemsize, index_dtype.itemsize)
    if message.dtype != torch.uint8 or message.shape != (total,):
        raise ValueError(
            f"a message for k={k} must be {total} bytes (uint8), got {tuple(message.shape)} {message.dtype}"
        )
    return (
        message[:index_bytes].view(index_dtype),
        message[values_start : values_start + k * value_dtype.itemsize].view(value_dtype),
    )


class MessageColumns:
    """Where every entry of several units' allgathered messages sits once they are
    concatenated (``unpack_many``), built once for one arrangement and reused while it
    stays: unit u contributes ``rows`` messages of ``k_u`` entries (``ks``), rank order
    within the unit, units in the given order.

    Attributes:
        index_words: (rows, sum k) positions of the indices in the concatenation viewed as
            ``index_dtype``.
        value_words: the same for the values, viewed as ``value_dtype``.
        nbytes: the concatenation's length in bytes.
    """

    def __init__(self, ks: tuple[int, ...], rows: int, value_dtype: torch.dtype, index_dtype: torch.dtype, device=None):
        index_size, value_size = index_dtype.itemsize, value_dtype.itemsize
        ranks = torch.arange(rows).unsqueeze(1)
        index_words, value_words, start = [], [], 0
        for k in ks:  # every section starts 8-byte aligned: byte offsets divide into words
            _, values_start, total = _sections(k, value_size, index_size)
            message_start = start + ranks * total
            column = torch.arange(k)
            index_words.append(message_start // index_size + column)
            value_words.append((message_start + values_start) // value_size + column)
            start += rows * total
        self.index_words = torch.cat(index_words, dim=1).to(device)
        self.value_words = torch.cat(value_words, dim=1).to(device)
        self.value_dtype, self.index_dtype, self.nbytes = value_dtype, index_dtype, start


def unpack_many(messages: list[torch.Tensor], columns: MessageColumns) -> tuple[torch.Tensor, torch.Tensor]:
    """Several units' allgathered byte tensors (each ``rows`` messages in rank order) as
    ``values`` (rows, sum k) and ``indices`` (rows, sum k, of the index dtype), units side
    by side: one concatenation and two gathers, whatever the number of units."""
    data = torch.cat(messages) if len(messages) > 1 else messages[0]
    if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != columns.nbytes:
        raise ValueError(
            f"gathered messages of {data.numel()} bytes ({data.dtype}) where {columns.nbytes} "
            f"were expected: ranks disagree on k or on the value dtype"
        )
    return data.view(columns.value_dtype)[columns.value_words], data.view(columns.index_dtype)[columns.index_words]


def unpack(
    gathered: torch.Tensor, k: int, value_dtype: torch.dtype, index_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One unit's allgathered byte tensor as ``values`` (P, k) and ``indices`` (P, k, of
    ``index_dtype``)."""
    total = message_bytes(k, value_dtype.itemsize, index_dtype.itemsize)
    if gathered.dtype != torch.uint8 or gathered.dim() != 1 or gathered.numel() % total:
        raise ValueError(
            f"gathered message of {gathered.numel()} bytes ({gathered.dtype}) is not a "
            f"whole number of {total}-byte messages for k={k}: ranks disagree on k "
            f"or on the value dtype"
        )
    return unpack_many(
        [gathered], MessageColumns((k,), gathered.numel() // total, value_dtype, index_dtype, gathered.device)
    )


class MergeColumns:
    """Where each column of an arena's concatenated parts belongs, built once for one
    arrangement of units ``((offset, k, numel), ...)`` and reused while it stays:
    ``offsets`` and ``sizes`` hold each part's offset and unit size repeated over its k
    columns (int64, shape ``(sum k,)``)."""

    def __init__(self, arrangement: tuple, device):
        ks = torch.tensor([k for _, k, _ in arrangement], device=device)
        total = sum(k for _, k, _ in arrangement)

        def per_column(numbers):
            return torch.tensor(numbers, dtype=torch.int64, device=device).repeat_interleave(ks, output_size=total)

        self.offsets = per_column([offset for offset, _, _ in arrangement])
        self.sizes = per_column([numel for _, _, numel in arrangement])


def merge_into(
    dense: torch.Tensor,
    values: torch.Tensor,
    indices: torch.Tensor,
    columns: MergeColumns,
    divide_by: int = 1,
    multiply_by: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum the R contributions of several units into one flat buffer, in row (rank) order::

        dense[o + i] = (sum_r values_r[i at indices_r]) / divide_by * multiply_by

    ``values`` and ``indices`` (R, n): the units' entries side by side, unit-local
    indices, placed by ``columns`` (``MergeColumns``: each column's unit offset and size),
    whose ranges of ``dense`` must be zero where they are touched. One ``index_add_``
    per row (each row's indices are distinct, so the sum is deterministic on every
    device), then one scaling of the touched entries. Raises ValueError for an index
    outside its unit (one host read). Returns the merged values at the touched positions
    (with repeats, for a finiteness check) and those positions in ``dense``, (R, n).
    """
    if values.shape != indices.shape or values.dim() != 2 or values.shape[1] != columns.offsets.numel():
        raise ValueError(
            f"expected (R, {columns.offsets.numel()}) values and indices, got "
            f"{tuple(values.shape)} and {tuple(indices.shape)}"
        )
    if bool(((indices < 0) | (indices >= columns.sizes)).any()):
        raise ValueError("an index lies outside its unit: corrupted or mismatched message")
    positions = indices + columns.offsets
    values = values.to(dense.dtype)
    for row_positions, row_values in zip(positions, values):
        dense.index_add_(0, row_positions, row_values)
    touched = positions.reshape(-1)
    merged = dense.index_select(0, touched)
    if divide_by != 1 or multiply_by != 1.0:
        if divide_by != 1:
            merged.div_(divide_by)
        if multiply_by != 1.0:
            merged.mul_(multiply_by)
        dense.index_copy_(0, touched, merged)
    return merged, positions
