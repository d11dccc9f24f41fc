"""lags_hvd.ddp's communication hook under DDP (torchrun, Gloo) against a numpy reference of
the math (tests/oracle.py), with DDP's own buckets as the hook received them."""

import warnings

import models
import numpy as np
import oracle
import pytest
import torch
from launch import TORCH, horovodrun
from workers.ddp_worker import BUCKET_MB, DENSITY, DISAGREE, NAN_STEP, STALL_STEP, WARMUP, mlp, mlp_batch

STEPS = 6


def run(world: int, scenario: str, out, steps: int = STEPS, timeout: float = 240.0) -> list[dict]:
    args = ("--out", str(out), "--steps", str(steps), "--scenario", scenario)
    horovodrun(world, TORCH, "ddp_worker.py", *args, timeout=timeout)
    return [torch.load(out / f"{scenario}.{r}.pt") for r in range(world)]


def mlp_gradients(model, rank: int, step: int, passes: int = 1) -> dict:
    model.zero_grad(set_to_none=True)
    for micro in range(passes):
        x, y = mlp_batch(rank, passes * step + micro)
        torch.nn.functional.mse_loss(model(x), y).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def reference(world: int, steps: int, make, gradients, dense_1d=False, warmup=None, momentum_correction=False):
    """The hook's math in numpy, per parameter whatever DDP's buckets: acc = eps + g, its top k
    (all of it for a 1-D parameter when ``dense_1d``), the average of the P workers' entries,
    then SGD with momentum and weight decay. ``momentum_correction``: DGC's (tests/oracle.py),
    the weight decay in the gradient, a plain SGD step. Returns the parameters and each rank's
    residuals (and velocities, with momentum correction)."""
    model = make()
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    eps = [{n: np.zeros(v.size, np.float32) for n, v in params.items()} for _ in range(world)]
    velocity = [{n: np.zeros(v.size, np.float32) for n, v in params.items()} for _ in range(world)]
    if momentum_correction:
        sgd = oracle.SGDMomentum(models.LR)
    else:
        sgd = oracle.SGDMomentum(models.LR, models.MOMENTUM, models.WEIGHT_DECAY)
    for step in range(steps):
        grads = []
        for rank in range(world):
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(torch.from_numpy(params[n]))
            got = gradients(model, rank, step)
            grads.append(
                {
                    n: (g.numpy().ravel() if g is not None else np.zeros(params[n].size, np.float32))
                    for n, g in got.items()
                }
            )
        density = DENSITY if warmup is None else warmup_density(step, *warmup)
        for n in params:
            whole = dense_1d and params[n].ndim == 1
            k = params[n].size if whole else oracle.k_for(density, params[n].size)
            if momentum_correction:
                decayed = [grads[r][n] + np.float32(models.WEIGHT_DECAY) * params[n].ravel() for r in range(world)]
                merged, new_u, new_eps = oracle.momentum_corrected_round(
                    [velocity[r][n] for r in range(world)],
                    [eps[r][n] for r in range(world)],
                    decayed,
                    models.MOMENTUM,
                    k,
                )
                for r in range(world):
                    velocity[r][n] = new_u[r]
            else:
                merged, new_eps = oracle.lags_round([eps[r][n] + grads[r][n] for r in range(world)], k)
            for r in range(world):
                eps[r][n] = new_eps[r]
            params[n] = sgd.step(n, params[n], merged.reshape(params[n].shape))
    return (params, eps, velocity) if momentum_correction else (params, eps)


def warmup_density(step: int, iterations: int, start: float) -> float:
    """DGC's warm-up in 4 geometric stages (lags_hvd.density.warmup_density, restated)."""
    if step >= iterations:
        return DENSITY
    return max(DENSITY, start * (DENSITY / start) ** (int(4 * step / iterations) / 4))


def assert_matches(result: dict, params: dict, eps: dict, label: str) -> None:
    for name, expected in params.items():
        np.testing.assert_allclose(
            result["params"][name].numpy(), expected, rtol=2e-5, atol=2e-6, err_msg=f"{label} parameter {name}"
        )
        np.testing.assert_allclose(
            result["residuals"][name].numpy().ravel(),
            eps[name],
            rtol=2e-5,
            atol=2e-6,
            err_msg=f"{label} residual {name}",
        )


@pytest.mark.parametrize("world", [2, 3])
def test_the_hook_matches_the_oracle_with_an_unused_parameter(world, tmp_path):
    results = run(world, "oracle", tmp_path)
    buckets = results[0]["buckets"]
    assert all(r["buckets"] == buckets for r in results) and len(buckets) == STEPS
    assert all(len(step) > 1 for step in buckets), buckets  # several buckets per iteration
    params, eps = reference(world, STEPS, models.make_model, models.gradients)
    for rank, result in enumerate(results):
        assert_matches(result, params, eps[rank], f"rank {rank}")


@pytest.mark.parametrize("scenario", ["rebuild", "static", "dense1d"])
@pytest.mark.parametrize("world", [2, 3])
def test_the_hook_matches_the_oracle_across_ddps_bucket_rebuild(scenario, world, tmp_path):
    """DDP rebuilds its buckets from the observed gradient order (here from one bucket into
    several): the residuals follow their parameters, and the
    update, per parameter, is the reference's whatever the buckets."""
    results = run(world, scenario, tmp_path)
    buckets = results[0]["buckets"]
    assert all(r["buckets"] == buckets for r in results)
    layouts = [b for i, b in enumerate(buckets) if i == 0 or b != buckets[i - 1]]
    # DDP's first bucket (1 MiB) holds the MLP whole; rebuilt once (after the first
    # iteration, or the second with static_graph) into buckets of BUCKET_MB
    assert len(layouts) == 2 and len(layouts[0]) == 1 and len(layouts[1]) > 1, buckets
    params, eps = reference(
        world,
        STEPS,
        mlp,
        mlp_gradients,
        dense_1d=scenario == "dense1d",
        warmup=(WARMUP["density_warmup"], WARMUP["density_warmup_start"]) if scenario == "dense1d" else None,
    )
    for rank, result in enumerate(results):
        assert_matches(result, params, eps[rank], f"{scenario} rank {rank}")


def test_accumulation_with_no_sync_exchanges_the_sum_once(tmp_path):
    results = run(2, "nosync", tmp_path)
    buckets = results[0]["buckets"]
    assert len(buckets) == STEPS  # one exchange per step, not per micro-batch
    params, eps = reference(2, STEPS, mlp, lambda m, r, s: mlp_gradients(m, r, s, passes=2))
    for rank, result in enumerate(results):
        assert_matches(result, params, eps[rank], f"rank {rank}")


def test_a_checkpoint_of_the_hook_state_resumes_bit_exact(tmp_path):
    for rank, result in enumerate(run(2, "checkpoint", tmp_path)):
        straight, resumed = result["straight"], result["resumed"]
        for part in ("params", "residuals"):
            assert sorted(straight[part]) == sorted(resumed[part])
            for name, value in straight[part].items():
                assert torch.equal(resumed[part][name], value), (rank, part, name)
        assert straight["iteration"] == resumed["iteration"] == STEPS


def test_nan_on_one_rank_leaves_every_ranks_residuals_as_they_were(tmp_path):
    for rank, result in enumerate(run(2, "nonfinite", tmp_path)):
        history = result["history"]
        assert [h["grads_finite"] for h in history] == [step != NAN_STEP for step in range(STEPS)], rank
        for name, value in history[NAN_STEP].items():
            if name != "grads_finite":  # the NaN iteration changed no residual
                assert torch.equal(history[NAN_STEP + 1][name], value), (rank, name)
        assert all(torch.isfinite(r).all() for r in result["final"]["residuals"].values())


def test_bucket_cap_is_small_enough_for_several_buckets():
    assert BUCKET_MB * 2**20 < sum(p.numel() for p in mlp().parameters()) * 4


def test_a_hook_state_refuses_another_models_residuals_and_resets_another_worlds(torch_group):
    from lags_hvd.ddp import LAGSHookState

    model = mlp()
    state = LAGSHookState(density=DENSITY, named_parameters=model.named_parameters())
    saved = {
        "iteration": 5,
        "world_size": 1,
        "rank": 0,
        "density": DENSITY,
        "residuals": {n: torch.ones_like(p) for n, p in model.named_parameters()},
    }
    with pytest.raises(ValueError, match="parameters this model does not have"):
        state.load_state_dict({**saved, "residuals": {"other.weight": torch.ones(3)}})
    with pytest.raises(ValueError, match="other shapes"):
        state.load_state_dict({**saved, "residuals": {"0.weight": torch.ones(3)}})
    assert state.iteration == 0  # nothing changed
    with pytest.warns(RuntimeWarning, match="restart from zero"):
        state.load_state_dict({**saved, "world_size": 4})
    assert state.iteration == 5 and not state.state_dict()["residuals"]
    state.load_state_dict(saved)
    assert all(torch.equal(r, torch.ones_like(r)) for r in state.state_dict()["residuals"].values())
    with pytest.warns(UserWarning, match="momentum 0"):
        corrected = LAGSHookState(density=DENSITY, named_parameters=model.named_parameters(), momentum=0.9)
    with pytest.raises(ValueError, match="momentum 0.0 in the hook, this state has 0.9"):
        corrected.load_state_dict(saved)
    with pytest.raises(TypeError, match="state_dict"):
        import pickle

        pickle.dumps(state)


def test_the_hook_state_refuses_bad_options(torch_group):
    from lags_hvd.ddp import LAGSHookState

    with pytest.raises(ValueError, match="density"):
        LAGSHookState(density=0.0)
    with pytest.raises(ValueError, match="dense_params"):
        LAGSHookState(dense_params="all")
    with pytest.raises(ValueError, match="local_clip needs named_parameters"):
        LAGSHookState(local_clip=1.0)
    with pytest.raises(ValueError, match="state_dict"):
        LAGSHookState().state_dict()
    with pytest.raises(ValueError, match="weight_decay is momentum correction's"):
        LAGSHookState(weight_decay=1e-4)
    with pytest.raises(ValueError, match="momentum"):
        LAGSHookState(momentum=1.0)


def test_the_local_clip_clips_each_workers_bucket_to_its_share_of_the_budget(torch_group):
    """One rank, one bucket (DDP's first holds the MLP), density 1: the gradient DDP hands the
    optimizer is the raw gradient clipped to local_clip (sqrt(P) sqrt(d_b / d) = 1 here)."""
    from torch.nn.parallel import DistributedDataParallel

    from lags_hvd.ddp import LAGSHookState, lags_hook

    model, raw = mlp(), mlp()
    x, y = mlp_batch(0, 0)
    torch.nn.functional.mse_loss(raw(x), y).backward()
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in raw.parameters()]))
    budget = float(norm) / 4
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(
        LAGSHookState(density=1.0, named_parameters=model.named_parameters(), local_clip=budget), lags_hook
    )
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    for p, q in zip(model.parameters(), raw.parameters()):
        torch.testing.assert_close(p.grad, q.grad * (budget / (float(norm) + 1e-6)))


@pytest.mark.parametrize("world", [2, 3])
def test_momentum_correction_in_the_hook_matches_the_oracle(world, tmp_path):
    """momentum and weight_decay given to the hook (DGC's momentum correction, momentum-factor
    masking; 1-D parameters whole keep their velocity), a plain SGD step: the reference's
    parameters, residuals and velocities on every rank, across DDP's bucket rebuild."""
    results = run(world, "mc", tmp_path)
    params, eps, velocity = reference(world, STEPS, mlp, mlp_gradients, dense_1d=True, momentum_correction=True)
    for rank, result in enumerate(results):
        assert_matches(result, params, eps[rank], f"rank {rank}")
        for name, expected in velocity[rank].items():
            np.testing.assert_allclose(
                result["velocities"][name].numpy().ravel(), expected, rtol=2e-5, atol=2e-6, err_msg=f"velocity {name}"
            )


def test_a_stalled_peer_raises_the_named_timeout_and_commits_nothing(tmp_path):
    """Rank 1 sleeps past the process group's timeout: rank 0's allgather fails, and DDP's
    backward raises the hook's ExchangeTimeoutError naming the bucket and the iteration (not a
    corrupted message from the buffer that never arrived), kept typed as the state's failure
    and raised as it is by the hook's next call; no residual of that iteration changed. Rank 1,
    waking to a peer gone, raises a named error too."""
    stalled = run(2, "stall", tmp_path, timeout=120.0)
    waiting = stalled[0]
    assert waiting["step"] == STALL_STEP, waiting["error"]
    message = waiting["error"]["message"]
    assert "ExchangeTimeoutError: lags_hvd.ddp: the allgather of DDP bucket" in message, message
    assert f"at iteration {STALL_STEP}" in message and "corrupted" not in message, message
    assert waiting["failure"]["type"] == waiting["again"]["type"] == "ExchangeTimeoutError", waiting["failure"]
    assert sorted(waiting["after"]) == sorted(waiting["before"]) and waiting["before"]
    for name, value in waiting["before"].items():
        assert torch.equal(waiting["after"][name], value), name
    woken = stalled[1]["failure"]
    assert woken is not None and woken["type"] in ("ExchangeTimeoutError", "WorkerLostError"), stalled[1]["error"]


def test_ranks_with_different_hook_settings_all_raise_ranks_disagree(tmp_path):
    """A different momentum (which would run unnoticed), density or dense_params (a Gloo size
    abort on one rank, a corrupted message on the other) or parameter names on rank 1: every
    rank raises RanksDisagreeError naming the setting at the first step, before any exchange."""
    for rank, errors in enumerate(run(2, "disagree", tmp_path, timeout=120.0)):
        assert sorted(errors) == sorted(DISAGREE)
        for setting, error in errors.items():
            assert error is not None and error["type"] == "RanksDisagreeError", (rank, setting, error)
            named = "the model differs" if setting == "model" else f"ranks disagree on {setting}:"
            assert named in error["message"], (rank, setting, error["message"])


def test_momentum_in_both_the_hook_and_the_optimizer_is_refused():
    """The hook's momentum correction with an optimizer that has momentum (or, under the hook's
    weight decay, weight decay) of its own would apply it twice: refused; without the optimizer
    to check, a warning."""
    from lags_hvd.ddp import LAGSHookState

    model = mlp()
    heavy = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    decaying = torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=1e-4)
    plain = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="param group 0 has momentum 0.9.*momentum 0"):
        LAGSHookState(momentum=0.9, optimizer=heavy)
    with pytest.raises(ValueError, match="param group 0 has weight_decay 0.0001.*weight_decay 0"):
        LAGSHookState(momentum=0.9, weight_decay=1e-4, optimizer=decaying)
    with pytest.warns(UserWarning, match="momentum 0"):
        LAGSHookState(momentum=0.9)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        LAGSHookState(momentum=0.9, weight_decay=1e-4, optimizer=plain)
        LAGSHookState(momentum=0.9, optimizer=decaying)  # the optimizer's weight decay alone applies once
        LAGSHookState(optimizer=heavy)  # no momentum correction: the optimizer's momentum is the only one
