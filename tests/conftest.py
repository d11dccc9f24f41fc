import os
import socket

import pytest
import torch
import torch.distributed as dist

# Open MPI busy-polls while a rank waits unless told to yield: with more ranks than cores (P = 3
# on two), a spinning rank holds the core its peer needs. Every launch of the suite inherits this.
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")


LONGEST_FIRST = (
    "test_ranks_agree.py",
    "test_distributed.py",
    "test_train.py",
    "test_examples.py",
    "test_train_trust.py",
    "test_ddp.py",
    "test_shared_state.py",
    "test_exit.py",
    "test_torch_backend.py",
    "test_frameworks.py",
)
"""The modules whose launches take most of the suite's time, longest first (measured on two
cores). ``make test`` hands whole modules to its workers in collection order (``--dist
loadscope --no-loadscope-reorder``), each worker taking the next module when it runs dry: with
the long ones first, the short ones fill the end and the workers finish together."""


def pytest_collection_modifyitems(config, items):
    """The modules of ``LONGEST_FIRST`` first, in its order, then the rest as collected."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a module's order kept
    _skip_without_horovod(items)


def _skip_without_horovod(items):
    """With LAGS_TESTS_WITHOUT_HOROVOD=1 (asked for, never inferred from a broken install: an
    environment pip made without Horovod) the tests that need Horovod in this process, through
    the ``hvd`` fixture or marked ``horovod``, are skipped; tests/launch.py skips its launches."""
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
