import os
import socket

import pytest
import torch
import torch.distributed as dist
from launch import QUICK_EXIT

# Open MPI busy-polls while a rank waits unless told to yield: with more ranks than cores (P = 3
# on two), a spinning rank holds the core its peer needs. Every launch of the suite inherits this.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")

# Every process the suite starts skips the final garbage collection at its exit
# (tests/quick_exit/sitecustomize.py): 1.5 CPU-s a process, a few hundred processes a run.
os.environ["PYTHONPATH"] = os.pathsep.join([str(QUICK_EXIT), *filter(None, [os.environ.get("PYTHONPATH")])])


LONGEST_FIRST = (
    *("test_ranks_agree", "test_train", "test_distributed", "test_examples", "test_train_trust"),
    *("test_exit", "test_ddp", "test_shared_state", "test_torch_backend", "test_frameworks", "test_adam_methods"),
    "test_soak",
)
"""The modules that launch workers, the most CPU first (measured on two cores). The suite runs
module by module on two workers (``--dist loadscope --no-loadscope-reorder``): these first, the
quick modules last, so both workers end within seconds of each other."""


def pytest_collection_modifyitems(config, items):
    """The ``LONGEST_FIRST`` modules first. With LAGS_TESTS_WITHOUT_HOROVOD=1 (asked for, never
    inferred from a broken install: an environment pip made without Horovod) the tests that need
    Horovod in this process, through the ``hvd`` fixture or marked ``horovod``, are skipped;
    tests/launch.py skips its launches."""
    rank = {module: at for at, module in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))  # stable: the rest as collected
    if not os.environ.get("LAGS_TESTS_WITHOUT_HOROVOD"):
        return
    skip = pytest.mark.skip(reason="LAGS_TESTS_WITHOUT_HOROVOD is set: the tests that need Horovod are skipped")
    for item in items:
        if "hvd" in item.fixturenames or item.get_closest_marker("horovod"):
            item.add_marker(skip)


@pytest.fixture(scope="session")
def hvd():
    """Horovod initialised in this process (one worker)."""
    import lags_hvd

    lags_hvd.init()
    yield lags_hvd


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def torch_group():
    """torch.distributed in this process, one rank: Gloo for CPU tensors, NCCL for CUDA ones."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield dist.group.WORLD
    dist.destroy_process_group()
