import pytest
import torch


@pytest.fixture(scope="session")
def hvd():
    """Horovod initialised in this process (one worker)."""
    import lags_hvd

    lags_hvd.init()
    yield lags_hvd


@pytest.fixture(autouse=True)
def _one_thread():
    torch.set_num_threads(1)
