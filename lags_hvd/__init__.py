"""lags_hvd: LAGS-SGD (layer-wise adaptive gradient sparsification) on Horovod or torch.distributed.

``import lags_hvd as hvd`` is a drop-in for ``import horovod.torch as hvd``: the
training-script API of ``horovod.torch`` is re-exported, and
``DistributedOptimizer`` exchanges sparsified gradients layer by layer while
backprop goes on. ``lags_hvd.distributed`` is the same optimizer over torch.distributed
(``torchrun``; Gloo or NCCL); the package imports without Horovod, and then only
Horovod's names are missing.

Package layout, one concern per module (the library imports nothing from ``experiments``):

* ``options``    the keyword-only LAGS options, validated and frozen
* ``checks``     the validations repeated across the library, one helper each (pure)
* ``density``    density and k, the adaptive sentinel, DGC's warm-up, the dense_params policy (pure)
* ``selection``  top-k by magnitude (pure tensor functions)
* ``capture``    a bucket's accumulate and selection replayed from a CUDA graph per k (``cuda_graphs=True``)
* ``clipping``   local gradient clipping before selection (pure)
* ``arena``      flat buffers: every bucket a contiguous range, every p.grad a view
* ``residual``   error-feedback memory, two flat buffers per arena (and an update rule's memories)
* ``sparse``     the wire message, its size, and the merge of every bucket's P contributions (pure)
* ``regions``    reduce_scatter aggregation: regions, balancing, the owners' reduction (pure)
* ``collectives`` the one interface to communication (``base``), one module per backend
                 (``horovod``, ``torch_distributed``)
* ``exchange``   asynchronous allgather, split-and-reduce or allreduce of one bucket, over the collectives
* ``layout``     which parameters form an exchange unit (a bucket)
* ``engine``     one bucketing's buffers and one iteration's transaction (``Iteration``): order,
                 merge, commit
* ``bucket``     Bucket.start: the per-bucket step of LAGS (transforms, update rule, accumulate, select)
* ``transforms`` what a gradient goes through before selection (densify, local clip, weight decay)
* ``aggregation`` how a bucket's P contributions combine: allgather, reduce_scatter, dense
* ``updates``    what a worker accumulates and how the merge steps: error feedback, momentum or
                 Adam correction
* ``uneven``     uneven inputs: join() keeps a rank out of batches in the others' exchanges
* ``state``      LAGSState: units, k, residuals, iteration; the checkpoint format
* ``planner``    per-unit densities and the buckets from measured times (pure)
* ``profiling``  backprop timing, network cost models (alpha + beta * bytes)
* ``adaptive``   the loops: buckets="auto" and density="adaptive" (decisions only, no I/O)
* ``report``     the plan as a table, JSON and timeline plot; ``PlanReporter`` observes the loop
* ``figures``    matplotlib without a display (every figure of the project)
* ``assumption`` the convergence assumption's delta (pure)
* ``agreement``  ranks agree on settings and on every step, or all fail loudly
* ``errors``     the errors raised when ranks cannot go on together; the latch of a failed optimizer
* ``optimizer``  the DistributedOptimizer around the engine (any backend): hooks, synchronize, step, join
* ``checkpointing`` the optimizer's state_dict / load_state_dict and the state shared by broadcast
* ``consensus``  average_models(): the ranks' models made their average (the local residual's reset)
* ``introspection`` what the optimizer tells about itself (read-only properties)
* ``horovod_api`` Horovod's API: DistributedOptimizer over a process set, broadcast_optimizer_state, join,
  broadcast_object
* ``distributed`` torch.distributed's front-end: DistributedOptimizer over a process group, broadcasts
* ``ddp``        LAGS as a DistributedDataParallel communication hook (LAGSHookState, lags_hook)
* ``lightning``  LAGSStrategy: the hook as PyTorch Lightning's DDP strategy (needs Lightning)
* ``version``    the package version
* ``_kernels``   compiled passes over memory (C): the candidate search, the streamed zeroing
* ``experiments`` the experiment app (training CLI, models, data, benchmarks, simulator)

``broadcast_optimizer_state`` is Horovod's, extended to share the LAGS plan and
iteration from the root rank (residuals stay per rank); ``join`` is Horovod's for
uneven inputs, carried out by the optimizers' own exchanges.
"""

from importlib.util import find_spec as _find_spec

try:
    from . import _kernels  # noqa: F401  (built from _kernels.c by the install; used by selection and arena)
except ImportError as error:  # a source tree whose C file was never built
    raise ImportError(
        "lags_hvd's compiled kernels (lags_hvd/_kernels.c) are not built: run "
        "`make install` or `pip install -e .` in the source tree"
    ) from error
from .errors import ExchangeTimeoutError, OutOfStepError, RanksDisagreeError, WorkerLostError
from .options import LAGSOptions
from .planner import NetworkModel
from .profiling import load_network_profile, profile_network, save_network_profile
from .state import LAGSState
from .version import __version__

try:
    from horovod.torch import (  # noqa: F401  (re-exported API: horovod.torch's, less what lags_hvd replaces)
        Adasum,
        Average,
        Compression,
        HorovodInternalError,
        Max,
        Min,
        ProcessSet,
        Product,
        Sum,
        SyncBatchNorm,
        add_process_set,
        allgather,
        allgather_async,
        allgather_object,
        allreduce,
        allreduce_,
        allreduce_async,
        allreduce_async_,
        alltoall,
        alltoall_async,
        barrier,
        broadcast,
        broadcast_,
        broadcast_async,
        broadcast_async_,
        broadcast_parameters,
        ccl_built,
        cross_rank,
        cross_size,
        cuda_built,
        ddl_built,
        global_process_set,
        gloo_built,
        gloo_enabled,
        grouped_allgather,
        grouped_allgather_async,
        grouped_allreduce,
        grouped_allreduce_,
        grouped_allreduce_async,
        grouped_allreduce_async_,
        grouped_reducescatter,
        grouped_reducescatter_async,
        init,
        is_initialized,
        local_rank,
        local_size,
        mpi_built,
        mpi_enabled,
        mpi_threads_supported,
        nccl_built,
        poll,
        rank,
        reducescatter,
        reducescatter_async,
        remove_process_set,
        rocm_built,
        shutdown,
        size,
        sparse_allreduce_async,
        start_timeline,
        stop_timeline,
        synchronize,
    )
except ImportError as missing:  # Horovod is optional: ``lags_hvd.distributed`` needs none
    _HOROVOD_MISSING = missing
else:
    _HOROVOD_MISSING = None
    from .horovod_api import (
        DistributedOptimizer,
        TopKDistributedOptimizer,
        broadcast_object,
        broadcast_optimizer_state,
        join,
    )

__all__ = [name for name in dir() if not name.startswith("_")]


def __getattr__(name: str):
    """Without Horovod, its API's names raise an ImportError that says what to do (a submodule
    not yet imported is not one of them: the import system asks for it here first)."""
    if _HOROVOD_MISSING is not None and not name.startswith("_") and _find_spec(f"{__name__}.{name}") is None:
        raise ImportError(
            f"lags_hvd.{name} is Horovod's API and Horovod is not installed ({_HOROVOD_MISSING}): "
            "install it (`make install` builds it), or use lags_hvd.distributed over torch.distributed"
        ) from _HOROVOD_MISSING
    raise AttributeError(f"module 'lags_hvd' has no attribute {name!r}")
