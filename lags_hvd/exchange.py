"""Exchange: start a unit's collective now, collect its dense result later.

The collectives are asynchronous (``start`` returns at once; ``Pending.wait``
blocks):

* ``SparseAllgather``: every worker contributes its k selected ``(values, indices)``
  as one packed byte message (``sparse.pack``, into a send buffer kept per unit); the
  P messages are allgathered, and ``merge_into`` unpacks and sums the entries of
  every unit of an arena into its gradient buffer at once (``sparse.unpack_many``,
  ``sparse.merge_into``).
* ``SparseReduceScatter`` (``aggregation="reduce_scatter"``): Ok-Topk's split and
  reduce (an alltoall of each worker's entries to their region's owner) and an
  allgather of every owner's reduced selection (``regions``).
* ``DenseAllreduce``: the in-place allreduce of the whole tensor, exactly what
  ``hvd.DistributedOptimizer`` does; used where a unit's density is 1.

The collectives come from ``ExchangeConfig.collectives`` (``lags_hvd.collectives``:
one interface, one module per backend). Every wait is bounded
(``ExchangeConfig.timeout``, the ``exchange_timeout`` option): a rank that waits
longer raises ``ExchangeTimeoutError`` naming the exchange, and a peer that died
raises ``WorkerLostError``.

Both reduce as ``average`` says (Horovod's ``op``):

    average:  result = (f / P) * sum_p (x_p / f)     f = gradient_predivide_factor
    sum:      result = sum_p x_p

(for the sparse path with f == 1 the division by P is a plain division, so the
result matches a straightforward reference bit for bit). Horovod's ``compression``
applies to the values on the wire (e.g. ``Compression.fp16`` halves them); with
reduce_scatter twice, to each worker's entries and to the owners' sums, so a sum
is rounded once more and overflows fp16 at up to P times smaller entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from . import regions, sparse
from .collectives import DEFAULT_TIMEOUT, Collectives, NoCompression

__all__ = [
    "ExchangeConfig",
    "SparseAllgather",
    "SparseReduceScatter",
    "DenseAllreduce",
    "Pending",
    "ExchangeStarted",
    "Gathered",
    "all_finite",
    "finite_flag",
    "DEFAULT_TIMEOUT",
]

# Dtypes not every backend can reduce: they go over the wire as float32.
_WIRE_DTYPE = {torch.bfloat16: torch.float32}


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every entry is finite, exactly (one host read; for the rare path where
    ``finite_flag`` said no: its sum may have overflowed on finite entries)."""
    return bool(torch.isfinite(tensor).all())


def finite_flag(tensor: torch.Tensor) -> torch.Tensor:
    """A 0-dim bool tensor, on the tensor's device: True when the sum of the entries is
    finite, which holds whenever every entry is (a NaN or Inf entry makes the sum
    non-finite; a finite tensor whose sum overflows gives a false alarm that
    ``all_finite`` settles). One reduction, no host read."""
    return torch.isfinite(tensor.sum(dtype=torch.float64 if tensor.dtype == torch.float64 else torch.float32))


@dataclass(frozen=True)
class ExchangeConfig:
    """What every exchange of one optimizer shares."""

    collectives: Collectives
    average: bool = True  # Horovod's op=Average; False: op=Sum
    gradient_predivide_factor: float = 1.0
    compression: Any = NoCompression
    timeout: float | None = DEFAULT_TIMEOUT
    # the prefix of every collective's name, one per optimizer (``agreement.wire_namespace``):
    # collectives are matched by name, so two optimizers' exchanges must never share one
    namespace: str = "lags"

    def __post_init__(self):
        if self.gradient_predivide_factor != 1.0 and not self.average:
            raise ValueError("gradient_predivide_factor is only supported with op=hvd.Average")
        if not self.gradient_predivide_factor > 0:
            raise ValueError(f"gradient_predivide_factor must be > 0, got {self.gradient_predivide_factor}")

    @property
    def world(self) -> int:
        """Workers in the group."""
        return self.collectives.size

    @property
    def rank(self) -> int:
        """This worker's rank in the group (what alltoall and allgather order by); asked only
        of a member (a rank outside a process set has none)."""
        return self.collectives.rank

    def prescale(self) -> float:
        return 1.0 / self.gradient_predivide_factor if self.average else 1.0

    def postscale(self) -> float:
        return self.gradient_predivide_factor if self.average else 1.0


@dataclass(frozen=True)
class ExchangeStarted:
    """What an exchange observer is told when a unit's exchange starts (instrumentation:
    ``DistributedOptimizer.exchange_observers``). ``values`` and ``indices`` are this
    rank's contribution as handed to the collective (``indices`` None for a dense
    allreduce, whose ``values`` is the whole tensor); copy them to keep them."""

    name: str
    numel: int
    values: torch.Tensor
    indices: torch.Tensor | None
    pending: Pending

    @property
    def sparse(self) -> bool:
        return self.indices is not None


class Pending:
    """A started exchange: ``collect()`` waits for the network (bounded, ``Collectives.wait``),
    ``finish()`` turns what arrived into the result (``SparseAllgather``: a ``Gathered``,
    every rank's message; ``SparseReduceScatter``: see there; ``DenseAllreduce``: the
    reduced tensor); ``wait()`` does both."""

    def __init__(self, handle, finish, name: str, config: ExchangeConfig):
        self._handle = handle
        self._finish = finish
        self._name, self._config = name, config

    def finish(self, arrived):
        return self._finish(arrived)

    def done(self) -> bool:
        return self._config.collectives.done(self._handle)

    def collect(self):
        return self._config.collectives.wait(self._handle, f"the exchange {self._name!r}", self._config.timeout)

    def wait(self):
        return self.finish(self.collect())


class Gathered(NamedTuple):
    """One unit's allgather as it arrived (``SparseAllgather``'s ``Pending`` result): the P
    messages in ``sparse.pack``'s layout, not yet unpacked, so that ``merge_into`` unpacks
    all units of an arena at once (``sparse.unpack(message, k, wire_dtype, index_dtype)``
    gives one unit's entries as they travelled)."""

    message: torch.Tensor
    k: int
    wire_dtype: torch.dtype
    index_dtype: torch.dtype
    ctx: object
    dense_dtype: torch.dtype


def _context_key(ctx):
    """Compression contexts equal by value (Horovod's: None or a dtype) share a merge;
    any other context is its unit's own."""
    try:
        hash(ctx)
    except TypeError:
        return ("object", id(ctx))
    return ctx


class _SparseExchange:
    """What both sparse aggregations share: the merge and the traffic record."""

    def __init__(self, config: ExchangeConfig):
        self.config = config
        self.traffic: dict[str, tuple[int, int]] = {}  # unit -> (bytes sent, received), last exchange
        # per merge target (an arena's buffer and a wire group): (arrangement, its column maps)
        self._columns: dict[tuple, tuple] = {}

    def _cached_columns(self, target: tuple, arrangement: tuple, build) -> tuple:
        """The column maps of ``arrangement`` merged into ``target``, built when it changed
        (k, the buckets): only the arrangement in force is kept, so maps of a density
        warm-up's earlier stages do not hold memory for the rest of the run."""
        cached = self._columns.get(target)
        if cached is None or cached[0] != arrangement:
            cached = self._columns[target] = (arrangement, build())
        return cached[1]

    def _merge(
        self, dense: torch.Tensor, values: torch.Tensor, indices: torch.Tensor, merge_columns: sparse.MergeColumns
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``sparse.merge_into`` with ``op``: Average divides by P and applies f."""
        config = self.config
        return sparse.merge_into(
            dense,
            values,
            indices,
            merge_columns,
            divide_by=config.world if config.average else 1,
            multiply_by=config.postscale(),
        )


class SparseAllgather(_SparseExchange):
    """Allgather of every worker's k selected entries of a unit; ``merge_into`` sums them.
    Each worker's message reaches the P-1 others: (P-1) messages sent and received."""

    def __init__(self, config: ExchangeConfig):
        super().__init__(config)
        self._outboxes: dict[str, _Outbox] = {}  # send buffers per unit, reused while k stays

    def start(self, name: str, values: torch.Tensor, indices: torch.Tensor, numel: int) -> Pending:
        """Launch the allgather of this worker's ``k`` entries of a ``numel``-element unit.
        The result (``Pending.wait()``) is a ``Gathered``: every rank's message (values
        pre-scaled by 1/f under Average, in the wire dtype), unpacked by ``merge_into``."""
        config = self.config
        dense_dtype = values.dtype
        if config.prescale() != 1.0:
            values = values * config.prescale()
        wire_values, ctx = config.compression.compress(values)
        k, wire_dtype = values.numel(), wire_values.dtype
        outbox = self._outboxes.get(name)
        if outbox is None or outbox.shape != (k, wire_dtype, values.device):
            outbox = self._outboxes[name] = _Outbox(
                f"{config.namespace}.sparse.{name}", k, wire_dtype, sparse.index_dtype_for(numel), values.device
            )
        outbox.indices.copy_(indices)
        outbox.values.copy_(wire_values)
        message_bytes = outbox.message.numel() * (config.world - 1)
        self.traffic[name] = (message_bytes, message_bytes)
        handle = config.collectives.allgather(outbox.message, outbox.wire_name)

        def finish(gathered: torch.Tensor):
            return Gathered(gathered, k, wire_dtype, outbox.index_dtype, ctx, dense_dtype)

        return Pending(handle, finish, outbox.wire_name, config)

    def merge_into(self, dense: torch.Tensor, parts) -> tuple[torch.Tensor, torch.Tensor]:
        """Reduce the arrivals of several units of one arena into ``dense`` (their ranges
        must be zero): ``parts`` is ``(offset, Gathered, numel)`` per unit. Units alike on
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
            merged.append(self._merge(dense, values.to(first.dense_dtype), indices, merge_columns))
        if len(merged) == 1:
            return merged[0][0], merged[0][1][self.config.rank]
        return (
            torch.cat([values for values, _ in merged]),
            torch.cat([positions[self.config.rank] for _, positions in merged]),
        )


class SparseReduceScatter(_SparseExchange):
    """Split and reduce, then gather the reduced selection (``regions`` has the math).

    ``start`` (from the hook) sends this worker's entries of region r to rank r with
    one alltoall; ``reduce_and_gather`` (in ``synchronize()``, once they arrived) sums
    this rank's region, keeps its top ``k'``, and starts the allgather of those and of
    its balancing summary, whose result (``Pending.wait()``) is every owner's entries,
    ``(1, m)`` values and indices with distinct indices (``merge_into`` applies them
    like one rank's contribution), and every owner's summary (``regions.summary``).
    ``traffic[name]``: (bytes sent, bytes received) of the unit's last exchange.
    """

    def __init__(self, config: ExchangeConfig, select):
        super().__init__(config)
        self._select = select
        self._rows: dict[str, torch.Tensor] = {}  # send rows per unit, reused while k stays

    def start(
        self,
        name: str,
        values: torch.Tensor,
        indices: torch.Tensor,
        numel: int,
        boundaries: list[int],
        counts: list[int] | None = None,
    ) -> Pending:
        """Launch the alltoall; its result is ``(values, indices, sent counts, received
        counts)``: the entries of this rank's region from every rank, in rank order.
        ``counts``: how many of ``indices`` fall in each region where the caller knows it
        (regional selection), else counted from them (one host read on an accelerator)."""
        config = self.config
        dense_dtype, index_dtype = values.dtype, sparse.index_dtype_for(numel)
        if config.prescale() != 1.0:
            values = values * config.prescale()
        wire_values, ctx = config.compression.compress(values)
        rows = self._rows[name] = regions.pack_rows(wire_values, indices, index_dtype, self._rows.get(name))
        # regional selection: every rank sends owner r its counts[r] entries, so each knows what it receives
        received = None if counts is None else [counts[config.rank]] * config.world
        counts = regions.splits(indices, boundaries) if counts is None else torch.tensor(counts, dtype=torch.int32)
        wire_name = f"{config.namespace}.split.{name}"
        handle = config.collectives.alltoall(rows, counts, wire_name, received=received)

        def finish(arrived):
            received, received_counts = arrived
            got_values, got_indices = regions.unpack_rows(received, wire_values.dtype, index_dtype)
            got_values = config.compression.decompress(got_values, ctx)
            return got_values.to(dense_dtype), got_indices, counts.tolist(), received_counts.tolist()

        return Pending(handle, finish, wire_name, config)

    def reduce_and_gather(
        self, name: str, split: tuple, boundaries: list[int], shares: list[int], numel: int, summarise: bool
    ) -> Pending:
        """Sum this rank's region of what ``start``'s alltoall brought (``split``), keep
        its top ``k'`` (``shares[rank]``; ``shares``: what every owner keeps) and launch the
        allgather of every owner's kept entries (and, when ``summarise``, of its balancing
        summary; else the summaries come back as None)."""
        config = self.config
        values, indices, sent_counts, received_counts = split
        rank, index_dtype = config.rank, sparse.index_dtype_for(numel)
        start, end = boundaries[rank], boundaries[rank + 1]
        region = regions.reduce_region(values, indices, received_counts, start, end - start, values.dtype)
        if shares[rank]:
            chosen, chosen_indices = self._select(region, shares[rank])
            chosen_indices = chosen_indices + start
        else:
            chosen, chosen_indices = region[:0], torch.zeros(0, dtype=torch.int64, device=region.device)
        summary = regions.summary(indices, start) if summarise else chosen_indices[:0]
        wire_values, ctx = config.compression.compress(torch.cat([chosen, chosen.new_zeros(summary.numel())]))
        rows = regions.pack_rows(wire_values, torch.cat([chosen_indices, summary]), index_dtype)
        self.traffic[name] = regions.traffic(sent_counts, received_counts, shares, rank, rows.shape[1], summary.numel())
        wire_name = f"{config.namespace}.gather.{name}"
        handle = config.collectives.allgather(rows, wire_name, sizes=[share + summary.numel() for share in shares])

        def finish(gathered: torch.Tensor):
            all_values, all_indices = regions.unpack_rows(gathered, wire_values.dtype, index_dtype)
            all_values = config.compression.decompress(all_values, ctx).to(values.dtype)
            if not summarise:
                return all_values.view(1, -1), all_indices.view(1, -1), None
            entries, summaries, row, rows = [], [], 0, summary.numel()
            for count in shares:  # each owner: its kept entries, then its summary
                entries.append(torch.arange(row, row + count))
                summaries.append(all_indices[row + count : row + count + rows])
                row += count + rows
            chosen_rows = torch.cat(entries).to(all_indices.device)
            return (
                all_values[chosen_rows].view(1, -1),
                all_indices[chosen_rows].view(1, -1),
                torch.stack(summaries).tolist(),
            )

        return Pending(handle, finish, wire_name, config)

    def merge_into(self, dense: torch.Tensor, parts) -> tuple[torch.Tensor, None]:
        """Reduce the global selections of several units of one arena into ``dense`` (their
        ranges must be zero) at once: ``parts`` is ``(offset, (values, indices), numel)``
        per unit, (1, m) each as ``Pending.wait()`` gave them. Returns the merged values
        (and None: what this rank sent stays staged until ``keep_dropped`` knows G)."""
        placed = tuple((offset, values.shape[1], numel) for offset, (values, _), numel in parts)
        (merge_columns,) = self._cached_columns(
            (dense.data_ptr(),), placed, lambda: (sparse.MergeColumns(placed, dense.device),)
        )
        values = torch.cat([values for _, (values, _), _ in parts], dim=1)
        indices = torch.cat([indices for _, (_, indices), _ in parts], dim=1)
        return self._merge(dense, values, indices, merge_columns)[0], None


class _Outbox:
    """A unit's send buffer (``sparse.pack``'s layout) with typed views of its two sections."""

    def __init__(self, wire_name: str, k: int, value_dtype: torch.dtype, index_dtype: torch.dtype, device):
        self.wire_name = wire_name
        self.shape = (k, value_dtype, device)
        self.index_dtype = index_dtype
        self.message = sparse.pack(
            torch.zeros(k, dtype=value_dtype, device=device),
            torch.zeros(k, dtype=torch.int64, device=device),
            index_dtype,
        )
        self.indices, self.values = sparse.sections(self.message, k, value_dtype, index_dtype)


class DenseAllreduce:
    def __init__(self, config: ExchangeConfig):
        self.config = config

    def start(self, name: str, tensor: torch.Tensor) -> Pending:
        """Launch the in-place allreduce of ``tensor`` (compressed as configured; a dtype not
        every backend can reduce, bfloat16, travels as float32 and comes back as it was). The
        result is ``tensor`` itself when no conversion was needed, else a new tensor."""
        config = self.config
        dtype = tensor.dtype
        compressed, ctx = config.compression.compress(tensor.to(_WIRE_DTYPE.get(dtype, dtype)))
        wire_name = f"{config.namespace}.dense.{name}"
        handle = config.collectives.allreduce(
            compressed, wire_name, "average" if config.average else "sum", config.prescale(), config.postscale()
        )

        def finish(reduced: torch.Tensor):
            return config.compression.decompress(reduced, ctx).to(dtype)

        return Pending(handle, finish, wire_name, config)
