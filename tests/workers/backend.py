"""The API a test worker trains through, as ``hvd``: Horovod's (``import lags_hvd as hvd``,
under horovodrun or mpirun) or, with LAGS_TEST_BACKEND=torch (tests/launch.py's "torch"
controller), the same names over torch.distributed (``lags_hvd.distributed``, Gloo). With
LAGS_TESTS_WITHOUT_HOROVOD=1 (an environment without Horovod) the test process uses the
latter too, and tests/launch.py skips Horovod's launches.

Only what the workers use is mapped: a Horovod process set becomes a process group made
at ``init``; ``dense_reference`` is the framework's own dense data parallelism
(``horovod.torch.DistributedOptimizer``, or DDP), the baseline density 1 must equal.
"""

import os
import types

import torch

__all__ = ["BACKEND", "DEVICE", "dense_reference", "hvd", "init_in_fork", "launched"]

BACKEND = os.environ.get("LAGS_TEST_BACKEND") or (
    "torch" if os.environ.get("LAGS_TESTS_WITHOUT_HOROVOD") else "horovod"
)
DEVICE = torch.device(os.environ.get("LAGS_TEST_DEVICE", "cpu"))
"""Where the workers' models live: ``cuda`` (tests/launch.py's "torch-cuda") puts every rank on
the one GPU, its CUDA tensors exchanged over Gloo (NCCL refuses two ranks on one device)."""

if BACKEND == "torch":
    import torch.distributed as dist

    import lags_hvd.distributed as lags

    class ProcessSet:
        """A Horovod process set's ranks; ``init`` makes its process group."""

        def __init__(self, ranks):
            self.ranks, self.group = list(ranks), None

    def init(process_sets=None, store=None):
        """``store``: where the ranks meet, instead of torchrun's (``init_in_fork``)."""
        if DEVICE.type == "cuda":
            torch.cuda.set_device(0)
        backend = "cpu:gloo,cuda:gloo" if DEVICE.type == "cuda" else "gloo"
        if store is None:
            dist.init_process_group(backend)
        else:
            rank, size = launched()
            dist.init_process_group(backend, store=store, rank=rank, world_size=size)
        for process_set in process_sets or []:
            process_set.group = dist.new_group(process_set.ranks)

    def DistributedOptimizer(optimizer, named_parameters=None, process_set=None, **options):
        group = process_set.group if process_set is not None else None
        return lags.DistributedOptimizer(optimizer, named_parameters, process_group=group, **options)

    def dense_reference(model, optimizer, named_parameters):
        """DDP over the default group: (the module to call, the optimizer)."""
        return torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True), optimizer

    def allgather_object(obj):
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, obj)
        return gathered

    hvd = types.SimpleNamespace(
        init=init,
        allgather_object=allgather_object,
        rank=dist.get_rank,
        size=dist.get_world_size,
        barrier=dist.barrier,
        shutdown=dist.destroy_process_group,
        ProcessSet=ProcessSet,
        global_process_set=None,
        Sum="sum",
        Average="average",
        DistributedOptimizer=DistributedOptimizer,
        TopKDistributedOptimizer=lags.TopKDistributedOptimizer,
        broadcast_parameters=lags.broadcast_parameters,
        broadcast_optimizer_state=lags.broadcast_optimizer_state,
        join=lags.join,
    )
else:
    import horovod.torch

    import lags_hvd as hvd

    def dense_reference(model, optimizer, named_parameters):
        """Horovod's own DistributedOptimizer: (the module to call, the optimizer)."""
        return model, horovod.torch.DistributedOptimizer(optimizer, named_parameters=named_parameters)


def launched() -> tuple[int, int]:
    """(rank, size) as the launcher set them, before any initialisation: horovodrun's Gloo
    controller or torchrun (mpirun's workers learn theirs from MPI_Init)."""
    env = os.environ
    rank, size = env.get("HOROVOD_RANK", env.get("RANK")), env.get("HOROVOD_SIZE", env.get("WORLD_SIZE"))
    if rank is None or size is None:
        raise SystemExit("no rank in the environment: launch with horovodrun's Gloo controller or torchrun")
    return int(rank), int(size)


def init_in_fork(process_sets, name: str) -> None:
    """``hvd.init`` in a child forked from a worker that never initialised, once per child.
    Horovod's rendezvous forgets its keys once every rank has met, so its own init serves
    again. torch.distributed's ranks would read the addresses of an earlier child under
    torchrun's keys: they meet under ``name``, unique to the child, in torchrun's store."""
    if BACKEND != "torch":
        hvd.init(process_sets=process_sets)
        return
    size = launched()[1]
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), size, is_master=False)
    hvd.init(process_sets, store=dist.PrefixStore(name, store))
