"""lags_hvd: LAGS-SGD (layer-wise adaptive gradient sparsification) on Horovod.

``import lags_hvd as hvd`` is a drop-in for ``import horovod.torch as hvd``: the
training-script API of ``horovod.torch`` is re-exported, and
``DistributedOptimizer`` exchanges sparsified gradients layer by layer while
backprop goes on.

Package layout, one concern per module:

* ``selection``  top-k by magnitude (pure tensor functions)
* ``residual``   error-feedback memory per exchange unit (and DGC's velocities)
* ``density``    density schedules: DGC's warm-up (pure)
* ``clipping``   local gradient clipping before selection (pure)
* ``sparse``     the wire message and the merge of P contributions (pure)
* ``exchange``   asynchronous allgather / allreduce over Horovod
* ``layout``     which parameters form an exchange unit
* ``planner``    per-unit densities from measured times (pure)
* ``profiling``  backprop timing, network cost models (alpha + beta * bytes)
* ``adaptive``   warm-up, plan on one rank, broadcast, re-plan
* ``report``     the plan as a table, JSON and timeline plot
* ``options``    the keyword-only LAGS options, validated
* ``agreement``  ranks agree on settings and on every step, or all fail loudly
* ``errors``     the errors raised when ranks cannot go on together
* ``optimizer``  the DistributedOptimizer that wires them together

``broadcast_optimizer_state`` is Horovod's, extended to share the LAGS plan and
iteration from the root rank (residuals stay per rank).
"""
from horovod.torch import (  # noqa: F401  (re-exported API)
    Adasum,
    Average,
    Compression,
    ProcessSet,
    Sum,
    add_process_set,
    allgather,
    allgather_async,
    allgather_object,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    broadcast_object,
    broadcast_parameters,
    cross_rank,
    cross_size,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    poll,
    rank,
    remove_process_set,
    shutdown,
    size,
    synchronize,
)

from .errors import ExchangeTimeoutError, OutOfStepError, RanksDisagreeError, WorkerLostError
from .optimizer import DistributedOptimizer, LAGSState, TopKDistributedOptimizer, broadcast_optimizer_state
from .options import LAGSOptions
from .planner import NetworkModel
from .profiling import load_network_profile, profile_network, save_network_profile
from .version import __version__

__all__ = [name for name in dir() if not name.startswith("_")]
