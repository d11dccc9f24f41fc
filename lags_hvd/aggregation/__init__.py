"""How a bucket's P contributions become its merged gradient: one interface, one class per variant.

``Aggregation`` (``base``): per iteration and bucket, ``selector`` (what the hook selects
with), ``start`` (the first collective, from the hook), ``complete`` (the collectives
after it, once every bucket has started), ``merge`` (every bucket of an arena at once,
with what to clear in the residuals when the iteration commits). The variants:

* ``allgather``       every worker's k entries to every worker (the paper's)
* ``reduce_scatter``  Ok-Topk's split to the region owners, their reduction and selection
* ``dense``           the in-place allreduce of a bucket sent whole (k = numel)

A new aggregation is a new module here and a name in ``AGGREGATIONS``.
"""

from .allgather import Allgather
from .base import Aggregation, Contribution
from .dense import Dense
from .reduce_scatter import ReduceScatter

__all__ = ["AGGREGATIONS", "Aggregation", "Allgather", "Contribution", "Dense", "ReduceScatter"]

AGGREGATIONS = {"allgather": Allgather, "reduce_scatter": ReduceScatter}
"""The ``aggregation`` option's values: how sparse buckets combine (dense ones always allreduce)."""
