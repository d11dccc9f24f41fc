"""Residual memory: error feedback conserves mass; checkpoints are validated."""
import pytest
import torch

from lags_hvd.residual import ResidualMemory
from lags_hvd.selection import select_sampled


def test_mass_is_conserved_over_iterations():
    memory = ResidualMemory()
    memory.register("w", 100, torch.float64, torch.device("cpu"))
    gen = torch.Generator().manual_seed(0)
    grads_total = torch.zeros(100, dtype=torch.float64)
    sent_total = torch.zeros(100, dtype=torch.float64)
    for _ in range(20):
        grad = torch.randn(100, generator=gen, dtype=torch.float64)
        grads_total += grad
        acc = memory.accumulate("w", grad.clone())
        values, indices = select_sampled(acc, 5)
        memory.retain("w", acc, indices)
        memory.commit()
        sent_total.index_add_(0, indices, values)
        assert torch.all(memory.residual("w")[indices] == 0)
    torch.testing.assert_close(sent_total + memory.residual("w"), grads_total, rtol=0, atol=1e-12)


def staged_step(memory, name, grad, k):
    acc = memory.accumulate(name, grad)
    values, indices = select_sampled(acc, k)
    memory.retain(name, acc, indices)
    return values, indices


def test_drain_into_sends_everything():
    memory = ResidualMemory()
    memory.register("w", 4, torch.float32, torch.device("cpu"))
    staged_step(memory, "w", torch.tensor([1.0, 2.0, 3.0, 4.0]), 1)
    memory.commit()
    grad = torch.ones(2, 2)
    memory.drain_into("w", grad, scale=2.0)
    assert grad.flatten().tolist() == [3.0, 5.0, 7.0, 1.0]
    assert memory.residual("w").tolist() == [1.0, 2.0, 3.0, 0.0]   # zero only on commit
    memory.commit()
    assert memory.residual("w").abs().sum() == 0


def test_accumulate_stages_without_touching_the_residual_until_commit():
    memory = ResidualMemory()
    memory.register("w", 4, torch.float32, torch.device("cpu"))
    staged_step(memory, "w", torch.tensor([1.0, -5.0, 0.5, 2.0]), 1)
    memory.commit()
    committed = memory.residual("w").clone()
    assert committed.tolist() == [1.0, 0.0, 0.5, 2.0]
    grad = torch.tensor([[0.25, 1.0], [3.0, -1.0]])
    acc = memory.accumulate("w", grad, residual_scale=2.0, grad_scale=0.5)
    assert acc.data_ptr() == grad.data_ptr()                       # written over the gradient
    assert acc.tolist() == [2.125, 0.5, 2.5, 3.5]                   # 2 eps + g / 2
    memory.retain("w", acc, torch.tensor([3]))
    assert torch.equal(memory.residual("w"), committed)            # staged only
    memory.discard()                                               # a skipped step
    memory.commit()
    assert torch.equal(memory.residual("w"), committed)            # exactly as it was
    staged_step(memory, "w", torch.tensor([0.0, 0.0, 0.0, 1.0]), 1)
    memory.commit()
    assert memory.residual("w").tolist() == [1.0, 0.0, 0.5, 0.0]
    with pytest.raises(ValueError, match="does not fit"):
        memory.retain("w", torch.zeros(3), torch.tensor([0]))


def test_state_dict_roundtrip_and_validation():
    memory = ResidualMemory()
    memory.register("a", 3, torch.float32, torch.device("cpu"))
    staged_step(memory, "a", torch.tensor([1.0, 2.0, 3.0]), 1)
    memory.commit()
    saved = {k: v.clone() for k, v in memory.state_dict().items()}
    fresh = ResidualMemory()
    fresh.register("a", 3, torch.float32, torch.device("cpu"))
    fresh.load_state_dict(saved)
    assert torch.equal(fresh.residual("a"), saved["a"])
    with pytest.raises(ValueError, match="missing"):
        fresh.load_state_dict({})
    with pytest.raises(ValueError, match="expected shape"):
        fresh.load_state_dict({"a": torch.zeros(4)})
    with pytest.raises(ValueError, match="already registered"):
        fresh.register("a", 3, torch.float32, torch.device("cpu"))
    assert torch.equal(fresh.residual("a"), saved["a"])  # nothing lost by the refused loads
