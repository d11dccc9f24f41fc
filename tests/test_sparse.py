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
    contributions = [
        (torch.randn(k, generator=gen).to(value_dtype), torch.randperm(numel, generator=gen)[:k]) for _ in range(3)
    ]
    index_dtype = sparse.index_dtype_for(numel)
    messages = [sparse.pack(v, i, index_dtype) for v, i in contributions]
    assert all(m.numel() == sparse.message_bytes(k, value_dtype.itemsize, index_dtype.itemsize) for m in messages)
    values, indices = sparse.unpack(torch.cat(messages), k, value_dtype, index_dtype)
    for rank, (v, i) in enumerate(contributions):
        assert torch.equal(values[rank], v)
        assert torch.equal(indices[rank], i)


@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float16, torch.float64])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_several_units_unpack_together(value_dtype, index_dtype):
    """Units of k = 1, 3 and 8 (messages of 8, 16 and 40+ bytes), each allgathered from
    three ranks, unpacked in one go: side by side, every rank's entries where its own
    pack put them."""
    gen = torch.Generator().manual_seed(5)
    ks, ranks = (1, 3, 8), 3
    contributions = [
        [(torch.randn(k, generator=gen).to(value_dtype), torch.randperm(50, generator=gen)[:k]) for _ in range(ranks)]
        for k in ks
    ]
    messages = [torch.cat([sparse.pack(v, i, index_dtype) for v, i in unit]) for unit in contributions]
    values, indices = sparse.unpack_many(messages, sparse.MessageColumns(ks, ranks, value_dtype, index_dtype))
    assert values.shape == indices.shape == (ranks, sum(ks)) and indices.dtype == index_dtype
    for rank in range(ranks):
        assert torch.equal(values[rank], torch.cat([unit[rank][0] for unit in contributions]))
        assert torch.equal(indices[rank], torch.cat([unit[rank][1] for unit in contributions]).to(index_dtype))
    with pytest.raises(ValueError, match="disagree on k"):
        sparse.unpack_many(messages[:2], sparse.MessageColumns(ks, ranks, value_dtype, index_dtype))


def test_index_dtype():
    assert sparse.index_dtype_for(2**31 - 1) == torch.int32
    assert sparse.index_dtype_for(2**31) == torch.int64


def test_merge_is_rank_ordered_sum():
    values = torch.tensor([[1.0, 2.0], [10.0, 20.0], [100.0, 200.0]])
    indices = torch.tensor([[0, 3], [3, 4], [0, 1]])
    dense = torch.zeros(5)
    touched, positions = sparse.merge_into(dense, values, indices, sparse.MergeColumns(((0, 2, 5),), None))
    assert torch.equal(positions, indices)
    expected = np.zeros(5, np.float32)
    for v, i in zip(values.numpy(), indices.numpy()):
        expected[i] += v
    np.testing.assert_array_equal(dense.numpy(), expected)
    assert sorted(touched.tolist()) == sorted(expected[indices.numpy().reshape(-1)].tolist())


def test_merge_of_several_units_into_one_buffer_with_scaling():
    """Units at their offsets of one flat buffer: each unit's sum lands in its own range,
    divided by P and multiplied by f exactly as a per-unit reference does; untouched
    entries keep what they held (a dense unit's result)."""
    gen = torch.Generator().manual_seed(3)
    buffer = torch.zeros(20, dtype=torch.float64)
    buffer[8:12] = 7.0  # a dense unit's range: not touched
    parts, expected = [], buffer.clone().numpy()
    for offset, numel, k in ((0, 8, 3), (12, 8, 2)):
        indices = torch.stack([torch.randperm(numel, generator=gen)[:k] for _ in range(3)])
        values = torch.randn(3, k, generator=gen, dtype=torch.float64)
        parts.append((offset, values, indices, numel))
        unit = np.zeros(numel)
        for v, i in zip(values.numpy(), indices.numpy()):
            unit[i] += v
        expected[offset : offset + numel] = unit / 3 * 0.5
    columns = sparse.MergeColumns(tuple((offset, values.shape[1], numel) for offset, values, _, numel in parts), None)
    sparse.merge_into(
        buffer,
        torch.cat([values for _, values, _, _ in parts], dim=1),
        torch.cat([indices for _, _, indices, _ in parts], dim=1),
        columns,
        divide_by=3,
        multiply_by=0.5,
    )
    np.testing.assert_array_equal(buffer.numpy(), expected)


def test_merge_casts_to_the_buffer_dtype():
    values = torch.tensor([[1.5, 2.5]], dtype=torch.float16)
    dense = torch.zeros(2)
    sparse.merge_into(dense, values, torch.tensor([[0, 1]]), sparse.MergeColumns(((0, 2, 2),), None))
    assert dense.tolist() == [1.5, 2.5]


def test_a_message_is_packed_again_through_its_sections():
    message = sparse.pack(torch.ones(3), torch.arange(3), torch.int32)
    index_section, value_section = sparse.sections(message, 3, torch.float32, torch.int32)
    index_section.copy_(torch.tensor([4, 0, 2]))
    value_section.copy_(torch.tensor([0.5, -1.0, 2.0]))
    values, indices = sparse.unpack(message, 3, torch.float32, torch.int32)
    assert values.tolist() == [[0.5, -1.0, 2.0]] and indices.tolist() == [[4, 0, 2]]
    with pytest.raises(ValueError, match="must be"):
        sparse.sections(message, 2, torch.float32, torch.int32)


def test_mismatched_messages_are_refused():
    message = sparse.pack(torch.ones(3), torch.arange(3), torch.int32)
    with pytest.raises(ValueError, match="disagree on k"):
        sparse.unpack(message[:-1], 3, torch.float32, torch.int32)
    with pytest.raises(ValueError, match="outside"):
        sparse.merge_into(
            torch.zeros(10), torch.ones(1, 2), torch.tensor([[0, 6]]), sparse.MergeColumns(((0, 2, 5),), None)
        )
    with pytest.raises(ValueError, match="outside"):  # below its unit: into the unit before it
        sparse.merge_into(
            torch.zeros(10),
            torch.ones(1, 2),
            torch.tensor([[0, -1]]),
            sparse.MergeColumns(((0, 1, 5), (5, 1, 5)), None),
        )
    with pytest.raises(ValueError, match="expected"):
        sparse.merge_into(
            torch.zeros(10), torch.ones(1, 3), torch.tensor([[0, 1, 2]]), sparse.MergeColumns(((0, 2, 5),), None)
        )
    with pytest.raises(ValueError, match="equal length"):
        sparse.pack(torch.ones(3), torch.arange(2), torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_all_finite_is_exact(dtype):
    from lags_hvd.exchange import all_finite

    big = torch.finfo(dtype).max
    assert all_finite(torch.tensor([1.0, -2.0, 3.0], dtype=dtype))
    assert all_finite(torch.tensor([big, big, big], dtype=dtype))  # the sum overflows; entries are finite
    for bad in (float("nan"), float("inf"), -float("inf")):
        assert not all_finite(torch.tensor([1.0, bad, 3.0], dtype=dtype))
    assert not all_finite(torch.tensor([float("inf"), -float("inf")], dtype=dtype))


@pytest.mark.horovod
def test_a_lost_peer_becomes_a_worker_lost_error():
    from horovod.common.exceptions import HorovodInternalError

    from lags_hvd.collectives.horovod import HorovodCollectives
    from lags_hvd.errors import WorkerLostError

    collectives = HorovodCollectives()
    with pytest.raises(WorkerLostError, match="the exchange 'x' failed .* a worker died") as lost:
        with collectives.peer_loss("the exchange 'x'"):
            raise HorovodInternalError("peer gone")
    assert isinstance(lost.value.__cause__, HorovodInternalError)
    with pytest.raises(KeyError):  # anything else passes through unchanged
        with collectives.peer_loss("the exchange 'x'"):
            raise KeyError("unrelated")


@pytest.mark.horovod
def test_horovods_allgather_writes_into_the_callers_buffer(hvd):
    """``out``: Horovod's allgather fills the caller's receive buffer, call after call, where
    it fits (P = 1 here: the multi-rank oracles exchange every bucket through it)."""
    from lags_hvd.collectives.horovod import HorovodCollectives

    collectives, inbox = HorovodCollectives(), torch.empty(3)
    for turn in range(2):
        got = collectives.wait(collectives.allgather(torch.arange(3.0) + turn, f"into.{turn}", out=inbox), "x", 10.0)
        assert got.data_ptr() == inbox.data_ptr() and got.tolist() == [turn, 1.0 + turn, 2.0 + turn]


def test_a_receive_buffer_is_kept_only_where_it_is_no_larger_than_the_bucket():
    """The P messages' buffer is held between iterations only where it is no larger than the
    bucket's gradient (not at the density warm-up's first stages: the forward pass's peak)."""
    from lags_hvd.aggregation.allgather import _Outbox

    message = sparse.message_bytes(10, 4, 4)  # k = 10 float32 entries, int32 indices
    kept = _Outbox("x", 10, torch.float32, torch.int32, "cpu", 4, 4 * message)
    assert kept.inbox is not None and kept.inbox.numel() == 4 * kept.message.numel() == 4 * message
    assert _Outbox("x", 10, torch.float32, torch.int32, "cpu", 4, 4 * message - 1).inbox is None


@pytest.mark.horovod
def test_an_arena_whose_ranks_disagree_on_one_units_k_is_refused():
    """Two units whose k differ between the ranks in opposite directions leave the total
    length right; the per-unit length check still refuses them."""
    from types import SimpleNamespace

    from horovod.torch import Average

    from lags_hvd.aggregation.allgather import Allgather, Gathered

    config = SimpleNamespace(world=2, rank=0, op=Average, compression=None, postscale=lambda: 1.0)
    exchange = Allgather(config, state=None, select=None, options=None)

    def arrival(ks):  # rank r sent ks[r] entries
        message = torch.cat([sparse.pack(torch.ones(k), torch.arange(k), torch.int32) for k in ks])
        return Gathered(message, 2, torch.float32, torch.int32, None, torch.float32)

    with pytest.raises(ValueError, match="disagree on k"):
        exchange.merge_into(torch.zeros(20), [(0, arrival((2, 3)), 10), (10, arrival((2, 1)), 10)])


@pytest.mark.parametrize("aggregation", ["allgather", "reduce_scatter"])
@pytest.mark.parametrize("op,factor", [("average", 1.0), ("average", 3.0), ("sum", 1.0)])
def test_the_exchanges_merge_p_workers_entries_as_horovods_op_says(aggregation, op, factor):
    """Three workers' entries of a unit, as they travel (divided by f = gradient_predivide_factor
    under Average), merged by each aggregation for rank 1 of the three: the workers' average
    (f / P) sum_p (x_p / f), or their sum under op=Sum. reduce_scatter applies the owners'
    sums of every entry sent; the allgather tells rank 1 where its own entries went."""
    from types import SimpleNamespace

    from lags_hvd.aggregation.allgather import Allgather, Gathered
    from lags_hvd.aggregation.reduce_scatter import ReduceScatter
    from lags_hvd.exchange import ExchangeConfig

    world, d, k = 3, 12, 4
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(world, k, generator=gen)
    indices = torch.stack([torch.randperm(d, generator=gen)[:k] for _ in range(world)])
    travelled = x / factor if op == "average" else x
    config = ExchangeConfig(
        SimpleNamespace(size=world, rank=1), average=op == "average", gradient_predivide_factor=factor
    )
    dense = torch.zeros(d)
    if aggregation == "allgather":
        message = torch.cat([sparse.pack(v, i, torch.int32) for v, i in zip(travelled, indices)])
        _, own = Allgather(config, state=None, select=None, options=None).merge_into(
            dense, [(0, Gathered(message, k, torch.float32, torch.int32, None, torch.float32), d)]
        )
        assert torch.equal(own, indices[1])
    else:  # the global selection: every entry sent, summed over the workers by its owner
        owners_sums = torch.zeros(d).index_add_(0, indices.reshape(-1), travelled.reshape(-1))
        chosen = torch.unique(indices)
        ReduceScatter(config, state=None, select=None, options=SimpleNamespace(regional_selection=False)).merge_into(
            dense, [(0, (owners_sums[chosen].view(1, -1), chosen.view(1, -1)), d)]
        )
    total = np.zeros(d)
    for v, i in zip(x.numpy(), indices.numpy()):
        total[i] += v
    np.testing.assert_allclose(dense.numpy(), total / world if op == "average" else total, rtol=1e-6, atol=1e-7)
