"""Wire format and merge, against plain numpy."""
import numpy as np
import pytest
import torch

from lags_hvd import sparse


@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_pack_unpack_roundtrip_across_ranks(value_dtype, k):
    numel = 50
    gen = torch.Generator().manual_seed(k)
    contributions = [(torch.randn(k, generator=gen).to(value_dtype),
                      torch.randperm(numel, generator=gen)[:k]) for _ in range(3)]
    index_dtype = sparse.index_dtype_for(numel)
    messages = [sparse.pack(v, i, index_dtype) for v, i in contributions]
    assert all(m.numel() == sparse.message_bytes(k, value_dtype.itemsize, index_dtype.itemsize)
               for m in messages)
    values, indices = sparse.unpack(torch.cat(messages), k, value_dtype, index_dtype)
    for rank, (v, i) in enumerate(contributions):
        assert torch.equal(values[rank], v)
        assert torch.equal(indices[rank], i)


def test_index_dtype():
    assert sparse.index_dtype_for(2**31 - 1) == torch.int32
    assert sparse.index_dtype_for(2**31) == torch.int64


def test_merge_is_rank_ordered_sum():
    values = torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]])
    indices = torch.tensor([[0, 3], [3, 4], [0, 1]])
    dense = sparse.merge(values, indices, 5)
    expected = np.zeros(5, np.float32)
    for v, i in zip(values.numpy(), indices.numpy()):
        expected[i] += v
    np.testing.assert_array_equal(dense.numpy(), expected)


def test_merge_upcasts_to_requested_dtype():
    values = torch.tensor([[1.5, 2.5]], dtype=torch.float16)
    dense = sparse.merge(values, torch.tensor([[0, 1]]), 2, dtype=torch.float32)
    assert dense.dtype == torch.float32 and dense.tolist() == [1.5, 2.5]


def test_mismatched_messages_are_refused():
    message = sparse.pack(torch.ones(3), torch.arange(3), torch.int32)
    with pytest.raises(ValueError, match="disagree on k"):
        sparse.unpack(message[:-1], 3, torch.float32, torch.int32)
    with pytest.raises(ValueError, match="outside"):
        sparse.merge(torch.ones(1, 2), torch.tensor([[0, 9]]), 5)
    with pytest.raises(ValueError, match="equal length"):
        sparse.pack(torch.ones(3), torch.arange(2), torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_is_exact(dtype):
    from lags_hvd.exchange import all_finite
    big = torch.finfo(dtype).max
    assert all_finite(torch.tensor([1.0, -2.0, 3.0], dtype=dtype))
    assert all_finite(torch.tensor([big, big, big], dtype=dtype))       # the sum overflows; entries are finite
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert not all_finite(torch.tensor([1.0, bad, 3.0], dtype=dtype))
    assert not all_finite(torch.tensor([float("inf"), -float("inf")], dtype=dtype))
