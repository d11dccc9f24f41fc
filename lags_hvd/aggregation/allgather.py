"""``Allgather``: every worker's k selected entries to every worker (the paper's aggregation).

Each worker packs its k ``(values, indices)`` into one byte message (``sparse.pack``,
into a send buffer kept per bucket while k stays) and the P messages are allgathered (into
a receive buffer kept beside it):
it sends its k entries once and receives the other P-1 workers' ((P-1) k entries). The
merge unpacks and sums the entries of every bucket of an arena at once
(``sparse.unpack_many``, ``sparse.merge_into``), ``(1/P) sum_p s_p`` under Average, and
reads back from this rank's own message where its entries went, so the residuals clear
them by position. Where the compression is a cast alone, the packing is device work alone
(``packer``), which a bucket's CUDA graph captures (``lags_hvd.capture``): the hook then
only launches the allgather (``send``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .. import sparse
from ..collectives import casts_only
from ..exchange import Pending
from .base import Packer, SparseAggregation

__all__ = ["Allgather", "Gathered"]


class Gathered(NamedTuple):
    """One bucket's allgather as it arrived (``Allgather.start``'s ``Pending`` result): the P
    messages in ``sparse.pack``'s layout, not yet unpacked, so that the merge unpacks all
    buckets of an arena at once (``sparse.unpack(message, k, wire_dtype, index_dtype)``
    gives one bucket's entries as they travelled). ``message`` may be the bucket's receive
    buffer (``_Outbox.inbox``), which its next allgather writes over: only this iteration's
    merge reads it."""

    message: torch.Tensor
    k: int
    wire_dtype: torch.dtype
    index_dtype: torch.dtype
    ctx: object
    dense_dtype: torch.dtype


class Allgather(SparseAggregation):
    def __init__(self, config, state, select, options):
        super().__init__(config, state, select, options)
        self._outboxes: dict[str, _Outbox] = {}  # send and receive buffers per bucket, kept while k stays

    def start(self, unit, values, indices):
        """Launch the allgather of this worker's ``k`` entries of ``unit``. The result
        (``Pending.wait()``) is a ``Gathered``: every rank's message (values pre-scaled by
        1/f under Average, in the wire dtype), unpacked by the merge."""
        wire_values, ctx = self._wire(values)
        outbox = self._outbox(unit, values.numel(), wire_values.dtype, values.device)
        outbox.write(wire_values, indices)
        return self.send(unit, Packed(outbox, ctx, values.dtype))

    def packer(self, unit, k):
        """``start``'s packing as a ``Packer`` where the compression is a cast alone
        (``casts_only``): the outbox made now, the context known before any value."""
        if not casts_only(self.config.compression):
            return None
        wire, ctx = self._wire(torch.empty(0, dtype=unit.dtype, device=unit.device))
        outbox = self._outbox(unit, k, wire.dtype, unit.device)

        def pack(values: torch.Tensor, indices: torch.Tensor) -> None:
            outbox.write(self._wire(values)[0], indices)

        return Packer(pack, Packed(outbox, ctx, unit.dtype))

    def send(self, unit, packed: Packed):
        """Launch the allgather of the message ``packed`` names."""
        config, outbox = self.config, packed.outbox
        k, wire_dtype = outbox.values.numel(), outbox.values.dtype
        message_bytes = outbox.message.numel() * (config.world - 1)
        self._traffic[unit.name] = (message_bytes, message_bytes)
        handle = config.collectives.allgather(outbox.message, outbox.wire_name, out=outbox.inbox)

        def finish(gathered: torch.Tensor):
            return Gathered(gathered, k, wire_dtype, outbox.index_dtype, packed.ctx, packed.dense_dtype)

        return Pending(handle, finish, outbox.wire_name, config)

    def _wire(self, values: torch.Tensor):
        """``values`` as they travel, and the compression's context: pre-scaled by 1/f under
        Average, compressed."""
        prescale = self.config.prescale()
        return self.config.compression.compress(values * prescale if prescale != 1.0 else values)

    def _outbox(self, unit, k: int, wire_dtype: torch.dtype, device) -> _Outbox:
        """``unit``'s buffers for k entries in ``wire_dtype``: kept while they stay."""
        outbox = self._outboxes.get(unit.name)
        if outbox is None or outbox.shape != (k, wire_dtype, device):
            outbox = self._outboxes[unit.name] = _Outbox(
                f"{self.config.namespace}.sparse.{unit.name}",
                k,
                wire_dtype,
                sparse.index_dtype_for(unit.numel),
                device,
                self.config.world,
                unit.numel * unit.dtype.itemsize,
            )
        return outbox

    def merge(self, key, dense, parts):
        merged, positions = self.merge_into(
            dense, [(offset, arrival, part.unit.numel) for offset, arrival, part in parts]
        )

        def clear() -> None:  # eps = acc - s for every bucket of the arena at once
            for memory in self.state.masked_memories():
                memory.retain_positions(key, positions)

        return [merged], [clear]

    def merge_into(self, dense: torch.Tensor, parts) -> tuple[torch.Tensor, torch.Tensor]:
        """Reduce the arrivals of several buckets of one arena into ``dense`` (their ranges
        must be zero): ``parts`` is ``(offset, Gathered, numel)`` per bucket. Buckets alike on
        the wire (almost always all of them) are unpacked together and merged at once.
        Returns the merged values at the touched positions, and this rank's own entries'
        positions in ``dense`` (what it sent, read back from its own message)."""
        groups: dict[tuple, list] = {}
        rows = self.config.world
        for part in parts:
            gathered = part[1]
            expected = rows * sparse.message_bytes(
                gathered.k, gathered.wire_dtype.itemsize, gathered.index_dtype.itemsize
            )
            if gathered.message.numel() != expected:
                raise ValueError(
                    f"an allgathered message of {gathered.message.numel()} bytes where {rows} "
                    f"ranks' k={gathered.k} entries make {expected}: ranks disagree on k or on "
                    f"the value dtype"
                )
            groups.setdefault(
                (gathered.wire_dtype, gathered.index_dtype, gathered.dense_dtype, _context_key(gathered.ctx)), []
            ).append(part)
        merged = []
        for number, group in enumerate(groups.values()):  # the target: not keyed on a context
            first = group[0][1]  # that may be new every iteration
            placed = tuple((offset, gathered.k, numel) for offset, gathered, numel in group)
            message_columns, merge_columns = self._cached_columns(
                (dense.data_ptr(), number),
                (placed, first.wire_dtype, first.index_dtype),
                lambda: (
                    sparse.MessageColumns(
                        tuple(k for _, k, _ in placed), rows, first.wire_dtype, first.index_dtype, dense.device
                    ),
                    sparse.MergeColumns(placed, dense.device),
                ),
            )
            values, indices = sparse.unpack_many([gathered.message for _, gathered, _ in group], message_columns)
            values = self.config.compression.decompress(values, first.ctx)
            merged.append(self._sum_into(dense, values.to(first.dense_dtype), indices, merge_columns))
        if len(merged) == 1:
            return merged[0][0], merged[0][1][self.config.rank]
        return (
            torch.cat([values for values, _ in merged]),
            torch.cat([positions[self.config.rank] for _, positions in merged]),
        )


def _context_key(ctx):
    """Compression contexts equal by value (Horovod's: None or a dtype) share a merge;
    any other context is its bucket's own."""
    try:
        hash(ctx)
    except TypeError:
        return ("object", id(ctx))
    return ctx


class _Outbox:
    """A bucket's send buffer (``sparse.pack``'s layout) with typed views of its two sections,
    and its receive buffer: room for the ``world`` messages of an allgather, kept between
    iterations where it is no larger than the bucket's gradient (``bound`` bytes), else None
    (the collective allocates the output per call: at the density warm-up's first stages,
    P k entries may outweigh the gradient, and held through the forward pass they would add
    to its peak memory)."""

    def __init__(
        self,
        wire_name: str,
        k: int,
        value_dtype: torch.dtype,
        index_dtype: torch.dtype,
        device,
        world: int,
        bound: int,
    ):
        self.wire_name = wire_name
        self.shape = (k, value_dtype, device)
        self.index_dtype = index_dtype
        self.message = sparse.pack(
            torch.zeros(k, dtype=value_dtype, device=device),
            torch.zeros(k, dtype=torch.int64, device=device),
            index_dtype,
        )
        self.indices, self.values = sparse.sections(self.message, k, value_dtype, index_dtype)
        received = world * self.message.numel()
        self.inbox = self.message.new_empty(received) if received <= bound else None

    def write(self, wire_values: torch.Tensor, indices: torch.Tensor) -> None:
        """The k entries into their sections (the indices narrowed to the index dtype)."""
        self.indices.copy_(indices)
        self.values.copy_(wire_values)


class Packed(NamedTuple):
    """A message written into a bucket's outbox, and what its merge needs to read it."""

    outbox: _Outbox
    ctx: object
    dense_dtype: torch.dtype
