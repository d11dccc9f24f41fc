"""``Aggregation``: the interface of the ways a bucket's P contributions combine;
``SparseAggregation``: what the sparse ones share (the traffic record, the merge)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .. import sparse
from ..exchange import ExchangeConfig, Pending
from ..layout import ExchangeUnit
from ..state import LAGSState

__all__ = ["Aggregation", "Contribution", "Packer", "SparseAggregation"]


@dataclass(eq=False)
class Contribution:
    """One bucket's part of one iteration on this rank: its exchange in flight and, for a
    sparse bucket, what this rank sent and how much of it the merge applied."""

    unit: ExchangeUnit
    aggregation: Aggregation
    pending: Pending
    indices: torch.Tensor | None = None  # this rank's entries (None: sent whole)
    values: torch.Tensor | None = None  # their values, the loss scale removed (the clip's give-back)
    applied: torch.Tensor | None = None  # which of ``indices`` the merge applied (None: every one)


class Packer(NamedTuple):
    """A bucket's message, written by device work alone: ``pack(values, indices)`` writes the
    k entries into a buffer made beforehand (no host read; temporaries at most); ``packed`` is
    what ``send`` launches."""

    pack: Callable[[torch.Tensor, torch.Tensor], None]
    packed: object


class Aggregation(ABC):
    """How one kind of bucket is exchanged and merged, over ``config``'s collectives.

    ``state`` is the bucketing's ``LAGSState`` (k, regions, the residual memories the
    commit clears); ``select`` the top-k selector the optimizer was given; ``options``
    the LAGS options (a variant reads its own)."""

    def __init__(self, config: ExchangeConfig, state: LAGSState, select: Callable, options):
        self.config, self.state, self.select, self.options = config, state, select, options

    def selector(self, unit: ExchangeUnit) -> Callable:
        """What ``unit``'s hook selects its k entries with, ``(acc, k) -> (values, indices)``."""
        return self.select

    def packer(self, unit: ExchangeUnit, k: int) -> Packer | None:
        """Where this aggregation packs ``unit``'s k entries when packing them is device work
        alone, fixed while k stays (a CUDA graph may capture it, ``lags_hvd.capture``); None
        where it packs otherwise (the default): its ``start`` packs and launches."""
        return None

    def send(self, unit: ExchangeUnit, packed) -> Pending:
        """Launch the bucket's first collective on the message a ``packer`` wrote."""
        raise NotImplementedError(f"{type(self).__name__} has no packer")

    def nothing(self, unit: ExchangeUnit, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A contribution of nothing, shaped as this aggregation expects one (a rank in
        ``lags_hvd.join()``): k zeros at distinct indices."""
        return (torch.zeros(k, dtype=unit.dtype, device=unit.device), torch.arange(k, device=unit.device))

    @abstractmethod
    def start(self, unit: ExchangeUnit, values: torch.Tensor, indices: torch.Tensor | None) -> Pending:
        """Launch the bucket's first collective (no waiting)."""

    def complete(self, contributions: list[Contribution], iteration: int) -> None:  # noqa: B027 (none by default)
        """Once every bucket has started: the collectives that follow the first (none by default)."""

    @abstractmethod
    def merge(
        self, key, dense: torch.Tensor, parts: list[tuple[int, object, Contribution]]
    ) -> tuple[list[torch.Tensor], list[Callable[[], None]]]:
        """Reduce every part's arrival ``(offset in dense, what arrived, contribution)`` into
        its range of ``dense``, the arena ``key``'s gradient buffer (zero there, or the
        bucket's own range for a dense one).
        Returns the merged values (what the finite check reads, one tensor or several) and
        what to do when the iteration commits (clear in the staged residuals what the merge
        applied, ...)."""

    @property
    def traffic(self) -> dict[str, tuple[int, int]]:
        """Per bucket, (bytes sent to, bytes received from) other ranks in its last exchange."""
        return {}

    def _clear(self, name: str, indices: torch.Tensor, where: torch.Tensor | None = None) -> Callable[[], None]:
        """Stage ``eps = acc - s`` for the entries applied, in the residual and (momentum-factor
        masking) the velocity."""

        def clear() -> None:
            for memory in self.state.masked_memories():
                memory.retain(name, indices, where)

        return clear


class SparseAggregation(Aggregation):
    """A sparse variant: it records each bucket's traffic and sums entries into an arena's
    buffer through column maps cached per merge target."""

    def __init__(self, config: ExchangeConfig, state: LAGSState, select: Callable, options):
        super().__init__(config, state, select, options)
        self._traffic: dict[str, tuple[int, int]] = {}  # bucket -> (bytes sent, received), last exchange
        # per merge target (an arena's buffer and a wire group): (arrangement, its column maps)
        self._columns: dict[tuple, tuple] = {}

    @property
    def traffic(self) -> dict[str, tuple[int, int]]:
        return dict(self._traffic)

    def _cached_columns(self, target: tuple, arrangement: tuple, build) -> tuple:
        """The column maps of ``arrangement`` merged into ``target``, built when it changed
        (k, the buckets): only the arrangement in force is kept, so maps of a density
        warm-up's earlier stages do not hold memory for the rest of the run."""
        cached = self._columns.get(target)
        if cached is None or cached[0] != arrangement:
            cached = self._columns[target] = (arrangement, build())
        return cached[1]

    def _sum_into(
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
