"""Residual memory: error feedback conserves mass; staging is transactional; checkpoints are validated."""

import pytest
import torch

from lags_hvd.arena import ArenaLayout, zero_
from lags_hvd.layout import build_units
from lags_hvd.residual import ResidualMemory
from lags_hvd.selection import select_sampled


def memory_for(*shapes, dtype=torch.float32):
    """A ResidualMemory over parameters of ``shapes`` named p0, p1, ... (one unit each),
    every unit registered."""
    params = [torch.zeros(shape, dtype=dtype, requires_grad=True) for shape in shapes]
    names = {p: f"p{i}" for i, p in enumerate(params)}
    units = build_units([{"params": params}], names)
    memory = ResidualMemory(ArenaLayout(units, list(reversed(params))))
    for unit in units:
        memory.register(unit.name)
    return memory, params


def staged_step(memory, name, grad, k):
    acc = memory.accumulate(name, [grad])
    values, indices = select_sampled(acc, k)
    memory.retain(name, indices)
    return values, indices


def test_mass_is_conserved_over_iterations():
    memory, _ = memory_for(100, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    grads_total = torch.zeros(100, dtype=torch.float64)
    sent_total = torch.zeros(100, dtype=torch.float64)
    for _ in range(20):
        grad = torch.randn(100, generator=gen, dtype=torch.float64)
        grads_total += grad
        values, indices = staged_step(memory, "p0", grad, 5)
        memory.commit()
        sent_total.index_add_(0, indices, values)
        assert torch.all(memory.residual("p0")[indices] == 0)
    torch.testing.assert_close(sent_total + memory.residual("p0"), grads_total, rtol=0, atol=1e-12)


def test_retaining_arena_positions_equals_retaining_per_unit():
    """Zeroing the sent entries of several units by their arena offsets at once stages the
    same residuals as zeroing each unit's own indices."""
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(shape, generator=gen) for shape in ((3, 4), (7,), (2, 5))]
    per_unit, _ = memory_for((3, 4), 7, (2, 5))
    at_once, _ = memory_for((3, 4), 7, (2, 5))
    layout, positions = at_once._layout, []
    for i, grad in enumerate(grads):
        _, indices = staged_step(per_unit, f"p{i}", grad, 2)
        at_once.accumulate(f"p{i}", [grad])
        positions.append(indices + layout.unit_slots[f"p{i}"].start)
    (key,) = layout.sizes
    at_once.retain_positions(key, torch.cat(positions))
    per_unit.commit()
    at_once.commit()
    for i in range(3):
        assert torch.equal(per_unit.residual(f"p{i}"), at_once.residual(f"p{i}"))
        assert int((at_once.residual(f"p{i}") == 0).sum()) == 2


def test_drain_into_sends_everything():
    memory, _ = memory_for(4)
    staged_step(memory, "p0", torch.tensor([1.0, 2.0, 3.0, 4.0]), 1)
    memory.commit()
    grad = torch.ones(2, 2)
    memory.drain_into("p0", grad, scale=2.0)
    assert grad.flatten().tolist() == [3.0, 5.0, 7.0, 1.0]
    assert memory.residual("p0").tolist() == [1.0, 2.0, 3.0, 0.0]  # zero only on commit
    memory.commit()
    assert memory.residual("p0").abs().sum() == 0


def test_accumulate_stages_without_touching_the_residual_or_the_gradient():
    memory, _ = memory_for(4)
    staged_step(memory, "p0", torch.tensor([1.0, -5.0, 0.5, 2.0]), 1)
    memory.commit()
    committed = memory.residual("p0").clone()
    assert committed.tolist() == [1.0, 0.0, 0.5, 2.0]
    grad = torch.tensor([[0.25, 1.0], [3.0, -1.0]])
    acc = memory.accumulate("p0", [grad], residual_scale=2.0, grad_scale=0.5)
    assert grad.tolist() == [[0.25, 1.0], [3.0, -1.0]]  # only read
    assert acc.tolist() == [2.125, 0.5, 2.5, 3.5]  # 2 eps + g / 2
    memory.retain("p0", torch.tensor([3]))
    assert torch.equal(memory.residual("p0"), committed)  # staged only
    memory.discard()  # a skipped step
    memory.commit()
    assert torch.equal(memory.residual("p0"), committed)  # exactly as it was
    staged_step(memory, "p0", torch.tensor([0.0, 0.0, 0.0, 1.0]), 1)
    memory.commit()
    assert memory.residual("p0").tolist() == [1.0, 0.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="3 entries for a range of 4"):
        memory.accumulate("p0", [torch.zeros(3)])


def test_stage_hands_out_the_pair_for_a_callers_own_accumulate():
    """``stage``: the committed residual and the staging range; what the caller writes there
    becomes the residual on commit and is dropped on discard, as ``accumulate``'s would."""
    memory, _ = memory_for(4)
    staged_step(memory, "p0", torch.tensor([1.0, -5.0, 0.5, 2.0]), 1)
    memory.commit()
    eps, acc = memory.stage("p0")
    assert torch.equal(eps, memory.residual("p0"))
    torch.add(eps, torch.tensor([1.0, 1.0, 1.0, 1.0]), out=acc)
    memory.discard()
    memory.commit()
    assert memory.residual("p0").tolist() == [1.0, 0.0, 0.5, 2.0]  # dropped
    eps, acc = memory.stage("p0")
    torch.add(eps, torch.tensor([1.0, 1.0, 1.0, 1.0]), out=acc)
    memory.retain("p0", torch.tensor([3]))
    memory.commit()
    assert memory.residual("p0").tolist() == [2.0, 1.0, 1.5, 0.0]  # acc less what was sent
    with pytest.raises(ValueError, match="no exchange unit"):
        memory.stage("nope")


def test_members_are_accumulated_in_place_of_a_concatenation():
    """A unit of several members: each member's gradient (any strides, or None) lands in its
    own range of acc, exactly as torch.cat of the flattened gradients would."""
    params = [torch.zeros(s, requires_grad=True) for s in ((2, 3), 4, 5)]
    names = {p: f"p{i}" for i, p in enumerate(params)}
    units = build_units([{"params": params}], names, [params])
    memory = ResidualMemory(ArenaLayout(units, params))
    memory.register(units[0].name)
    transposed = torch.arange(6.0).reshape(3, 2).t()  # non-contiguous
    grads = [transposed, None, torch.full((5,), 2.0)]
    acc = memory.accumulate(units[0].name, grads)
    expected = torch.cat([transposed.reshape(-1), torch.zeros(4), torch.full((5,), 2.0)])
    assert torch.equal(acc, expected)


def test_commit_keeps_registered_units_that_were_not_staged():
    memory, _ = memory_for(3, 2)
    staged_step(memory, "p0", torch.tensor([1.0, 2.0, 3.0]), 1)
    staged_step(memory, "p1", torch.tensor([4.0, 5.0]), 1)
    memory.commit()
    staged_step(memory, "p0", torch.tensor([1.0, 0.0, 0.0]), 1)  # p1 not staged this time
    memory.commit()
    assert memory.residual("p0").tolist() == [0.0, 2.0, 0.0]
    assert memory.residual("p1").tolist() == [4.0, 0.0]


def test_state_dict_roundtrip_and_validation():
    memory, _ = memory_for(3)
    staged_step(memory, "p0", torch.tensor([1.0, 2.0, 3.0]), 1)
    memory.commit()
    saved = memory.state_dict()
    assert saved["p0"].untyped_storage().nbytes() == 3 * 4  # a copy, not the whole arena
    fresh, _ = memory_for(3)
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.residual("p0"), saved["p0"])
    with pytest.raises(ValueError, match="missing"):
        fresh.load_state_dict({})
    with pytest.raises(ValueError, match="expected shape"):
        fresh.load_state_dict({"p0": torch.zeros(4)})
    with pytest.raises(ValueError, match="already registered"):
        fresh.register("p0")
    with pytest.raises(ValueError, match="no exchange unit"):
        fresh.register("nope")
    assert torch.equal(fresh.residual("p0"), saved["p0"])  # nothing lost by the refused loads


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_zero_clears_exactly_the_range_at_any_size_and_alignment(dtype):
    """``arena.zero_``: every entry of the range 0 and nothing outside it touched, below
    and above the 1 MiB from which the stores bypass the caches, from every start within
    a cache line; the version counter moves as with ``zero_()``; a strided range too."""
    for numel in (0, 1, 37, (1 << 20) // torch.tensor([], dtype=dtype).element_size() + 333):
        for start in range(0, 17, 3):
            buffer = torch.arange(1, numel + 40, dtype=torch.float64).to(dtype)
            before = buffer.clone()
            target = buffer[start : start + numel]
            version = target._version
            zero_(target)
            assert not target.any() and target.numel() == min(numel, buffer.numel() - start)
            assert torch.equal(buffer[:start], before[:start]) and torch.equal(
                buffer[start + numel :], before[start + numel :]
            )
            assert target._version > version
    strided = torch.ones(20)
    zero_(strided[::2])
    assert torch.equal(strided, torch.tensor([0.0, 1.0] * 10))


def test_zero_leaves_everything_but_a_plain_range_to_torch():
    """Tensors outside the kernel's case behave as under ``zero_()``: zeroing a leaf that
    requires grad, or an inference tensor outside inference mode, is refused; a 0-d or a
    2-D tensor is zeroed."""
    with pytest.raises(RuntimeError, match="in-place"):
        zero_(torch.ones(10, requires_grad=True))
    with torch.inference_mode():
        made_for_inference = torch.ones(5)
    with pytest.raises(RuntimeError, match="[Ii]nference"):
        zero_(made_for_inference)
    scalar = torch.tensor(3.0)
    zero_(scalar)
    assert scalar.item() == 0.0
    square = torch.ones(3, 3)
    zero_(square)
    assert not square.any()
