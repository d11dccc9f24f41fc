"""lags_hvd.ddp's communication hook under DDP (torchrun, Gloo) against a numpy reference of
the math (tests/oracle.py), with DDP's own buckets as the hook received them, and against the
torchrun optimizer: one LAGS behind both doors (tests/workers/doors_worker.py)."""

from pathlib import Path

import models
import numpy as np
import oracle
import pytest
import torch
from launch import TORCH, TORCH_CUDA, SharedLaunches, horovodrun
from workers.ddp_worker import BUCKET_MB, DENSITY, DISAGREE, NAN_STEP, STALL_STEP, WARMUP, mlp, mlp_batch
from workers.doors_worker import CASES

from lags_hvd.checkpointing import FORMAT

DATA = Path(__file__).parent / "data"

STEPS = 6


SHARED = {2: ["oracle", "rebuild", "static", "dense1d", "mc", "nosync", "checkpoint", "gathered", "nonfinite"]}
SHARED[3] = [*SHARED[2][:5], "doors"]
SHARED[2] += ["disagree", "doors"]  # refused alike on every rank: the scenario after it runs in step
"""P -> the scenarios that end cleanly or are refused alike, run in order in one launch (a launch
costs seconds of start-up on two cores, a scenario a fraction of one)."""


def run(world: int, scenario: str, out, steps: int = STEPS, timeout: float = 240.0, controller=TORCH) -> list[dict]:
    """``scenario`` (or several, comma-separated) alone on ``world`` workers: each rank's record
    of the first."""
    args = ("--out", str(out), "--steps", str(steps), "--scenarios", scenario)
    horovodrun(world, controller, "ddp_worker.py", *args, timeout=timeout)
    return [torch.load(out / f"{scenario.split(',')[0]}.{r}.pt") for r in range(world)]


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """``shared(world, scenario)``: each rank's record of ``scenario`` from the one launch of
    ``SHARED[world]``, run on first use (a failed launch fails the tests of the scenarios it
    did not finish, with its output)."""
    launches = SharedLaunches(tmp_path_factory)

    def records(world: int, scenario: str) -> list[dict]:
        assert scenario in SHARED[world], f"{scenario} is not in SHARED[{world}]"
        steps = ("--steps", str(STEPS))
        folder, failure = launches.run(world, TORCH, "ddp_worker.py", SHARED[world], *steps, timeout=360.0)
        files = [folder / f"{scenario}.{r}.pt" for r in range(world)]
        if not all(f.exists() for f in files):
            raise AssertionError(f"{scenario} did not finish: {failure}")
        return [torch.load(f) for f in files]

    return records


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
        for n in params:
            whole, planned = dense_1d and params[n].ndim == 1, oracle.k_for(DENSITY, params[n].size)
            target = planned / params[n].size
            density = target if warmup is None else warmup_density(step, *warmup, target)
            k = params[n].size if whole else max(planned, oracle.k_for(density, params[n].size))
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


def warmup_density(step: int, iterations: int, start: float, target: float) -> float:
    """DGC's warm-up in 4 geometric stages from ``start`` to a parameter's planned k / d
    (lags_hvd.density.warmup_density, restated)."""
    if step >= iterations:
        return target
    return max(target, start * (target / start) ** (int(4 * step / iterations) / 4))


def assert_matches(result: dict, params: dict, eps: dict, label: str) -> None:
    """The parameters, and the residuals (a parameter always sent whole keeps none: the
    reference's is zero)."""
    for name, expected in params.items():
        np.testing.assert_allclose(
            result["params"][name].numpy(), expected, rtol=2e-5, atol=2e-6, err_msg=f"{label} parameter {name}"
        )
        if name not in result["residuals"]:
            assert not eps[name].any(), f"{label}: {name} keeps no residual where the reference has one"
            continue
        np.testing.assert_allclose(
            result["residuals"][name].numpy().ravel(),
            eps[name],
            rtol=2e-5,
            atol=2e-6,
            err_msg=f"{label} residual {name}",
        )


@pytest.mark.parametrize("world", [2, 3])
def test_the_hook_matches_the_oracle_with_an_unused_parameter(world, shared):
    results = shared(world, "oracle")
    buckets = results[0]["buckets"]
    assert all(r["buckets"] == buckets for r in results) and len(buckets) == STEPS
    assert all(len(step) > 1 for step in buckets), buckets  # several buckets per iteration
    params, eps = reference(world, STEPS, models.make_model, models.gradients)
    for rank, result in enumerate(results):
        assert_matches(result, params, eps[rank], f"rank {rank}")


@pytest.mark.parametrize("scenario", ["rebuild", "static", "dense1d"])
@pytest.mark.parametrize("world", [2, 3])
def test_the_hook_matches_the_oracle_across_ddps_bucket_rebuild(scenario, world, shared):
    """DDP rebuilds its buckets from the observed gradient order (here from one bucket into
    several): the residuals follow their parameters, and the
    update, per parameter, is the reference's whatever the buckets."""
    results = shared(world, scenario)
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


def test_accumulation_with_no_sync_exchanges_the_sum_once(shared):
    results = shared(2, "nosync")
    buckets = results[0]["buckets"]
    assert len(buckets) == STEPS  # one exchange per step, not per micro-batch
    params, eps = reference(2, STEPS, mlp, lambda m, r, s: mlp_gradients(m, r, s, passes=2))
    for rank, result in enumerate(results):
        assert_matches(result, params, eps[rank], f"rank {rank}")


@pytest.mark.parametrize("scenario", ["checkpoint", "gathered"])
def test_a_checkpoint_of_the_hook_state_resumes_bit_exact(scenario, shared):
    """A file per rank, or rank 0's file holding every rank's state (gathered_state_dict)
    loaded by every rank: the parameters, residuals and velocities of the run that went on."""
    for rank, result in enumerate(shared(2, scenario)):
        straight, resumed = result["straight"], result["resumed"]
        for part in ("params", "residuals", "velocities"):
            assert sorted(straight[part]) == sorted(resumed[part])
            for name, value in straight[part].items():
                assert torch.equal(resumed[part][name], value), (rank, part, name)
        assert any(r.any() for r in straight["residuals"].values())
        assert straight["iteration"] == resumed["iteration"] == STEPS
    assert scenario == "checkpoint" or straight["velocities"]


def test_nan_on_one_rank_leaves_every_ranks_residuals_as_they_were(shared):
    for rank, result in enumerate(shared(2, "nonfinite")):
        history = result["history"]
        assert [h["grads_finite"] for h in history] == [step != NAN_STEP for step in range(STEPS)], rank
        for name, value in history[NAN_STEP].items():
            if name != "grads_finite":  # the NaN iteration changed no residual
                assert torch.equal(history[NAN_STEP + 1][name], value), (rank, name)
        assert all(torch.isfinite(r).all() for r in result["final"]["residuals"].values())


def test_bucket_cap_is_small_enough_for_several_buckets():
    assert BUCKET_MB * 2**20 < sum(p.numel() for p in mlp().parameters()) * 4


def hook_state(model, **options):
    from lags_hvd.ddp import LAGSHookState

    optimizer = torch.optim.SGD(model.parameters(), lr=models.LR, momentum=models.MOMENTUM)
    return LAGSHookState(named_parameters=model.named_parameters(), optimizer=optimizer, **options), optimizer


def test_a_hook_state_refuses_another_models_residuals_and_resets_another_worlds(torch_group):
    model = mlp()
    state, _ = hook_state(model, density=DENSITY, recipe="paper")
    saved = state.state_dict()
    assert saved["format"] == FORMAT and sorted(saved["residuals"]) == sorted(n for n, _ in model.named_parameters())
    with pytest.raises(ValueError, match="residual state does not match the model"):
        state.load_state_dict({**saved, "residuals": {"other.weight": torch.ones(3)}})
    with pytest.raises(ValueError, match="expected shape"):
        state.load_state_dict({**saved, "residuals": {**saved["residuals"], "0.weight": torch.ones(3)}})
    assert state.iteration == 0  # nothing changed
    ones = {n: torch.ones_like(r) for n, r in saved["residuals"].items()}
    with pytest.warns(UserWarning, match="residuals start from zero"):
        state.load_state_dict({**saved, "iteration": 5, "world_size": 4, "residuals": ones})
    assert state.iteration == 5 and not any(r.any() for r in state.state_dict()["residuals"].values())
    state.load_state_dict({**saved, "residuals": ones})
    assert all(torch.equal(r, torch.ones_like(r)) for r in state.state_dict()["residuals"].values())
    corrected, _ = hook_state(mlp(), density=DENSITY)  # the default recipe: momentum correction
    with pytest.raises(ValueError, match="another update rule"):
        corrected.load_state_dict(saved)
    with pytest.raises(ValueError, match=f"format {FORMAT + 1}"):
        state.load_state_dict({**saved, "format": FORMAT + 1})
    with pytest.raises(TypeError, match="state_dict"):
        import pickle

        pickle.dumps(state)


def test_a_gathered_state_gives_each_rank_its_own_part_and_refuses_a_malformed_one(torch_group):
    """The gathered form holds each rank's state by global rank: this rank's part loads as its
    own; a file without this rank's part resets the residuals with a warning; a malformed or
    newer one is refused and changes nothing."""
    model = mlp()
    state, _ = hook_state(model, density=DENSITY, recipe="paper")
    own = state.state_dict()
    gathered = state.gathered_state_dict(root_rank=0)
    assert gathered["format"] == FORMAT and list(gathered["ranks"]) == [0]
    ones = {n: torch.ones_like(r) for n, r in own["residuals"].items()}
    state.load_state_dict({"format": FORMAT, "ranks": {0: {**own, "residuals": ones}}})
    assert all(torch.equal(r, ones[n]) for n, r in state.state_dict()["residuals"].items())
    with pytest.warns(UserWarning, match="holds rank 5's residuals"):
        state.load_state_dict({"format": FORMAT, "ranks": {5: {**own, "rank": 5, "residuals": ones}}})
    assert not any(r.any() for r in state.state_dict()["residuals"].values())
    for bad, message in [
        ({"format": FORMAT, "ranks": []}, "'ranks' must map"),
        ({**gathered, "format": 9}, "format 9"),
    ]:
        with pytest.raises(ValueError, match=message):
            state.load_state_dict(bad)


def test_the_hook_state_takes_the_optimizers_options_and_refuses_misuse_clearly(torch_group):
    """The same options and errors as the optimizer doors; the old hook's positional density,
    its momentum arguments and another model's parameters are refused with what to do."""
    from lags_hvd.ddp import LAGSHookState

    model = mlp()
    with pytest.raises(ValueError, match="density"):
        hook_state(model, density=0.0)
    with pytest.raises(ValueError, match="dense_params"):
        hook_state(model, dense_params="all")
    with pytest.raises(TypeError, match="first argument is the process group.*float 0.001"):
        LAGSHookState(0.001, named_parameters=model.named_parameters())
    with pytest.raises(TypeError, match="takes no momentum, weight_decay: momentum correction is the update rule"):
        LAGSHookState(named_parameters=model.named_parameters(), momentum=0.9, weight_decay=1e-4)
    with pytest.raises(ValueError, match="named_parameters does not name 6 of the optimizer's parameters"):
        LAGSHookState(named_parameters=mlp().named_parameters(), optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(TypeError, match="unexpected keyword argument 'densty'"):
        hook_state(model, densty=0.1)
    with pytest.warns(UserWarning, match="without optimizer= sends the gradient itself"):
        state = LAGSHookState(named_parameters=model.named_parameters())
    assert state.optimizer.update_rule["rule"] == "error_feedback"
    corrected, optimizer = hook_state(mlp())
    assert corrected.optimizer is optimizer and optimizer.update_rule["rule"] == "momentum_correction"


def test_checkpoints_written_before_the_format_version_load_through_the_migration(torch_group):
    """Files written by the code of before (tests/data): the optimizer's unversioned state loads
    as it is; the former DDP hook's (residuals in the parameters' shapes, no k) becomes this
    format, its residuals each parameter's, in both doors."""
    import lags_hvd.distributed as lags
    from lags_hvd.ddp import LAGSHookState

    saved = torch.load(DATA / "optimizer-unversioned.pt", weights_only=True)
    assert "format" not in saved["optimizer"]["lags"]
    model = models.make_model()
    model.load_state_dict(saved["model"])
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    options = dict(density=0.1, density_warmup=4, density_warmup_start=0.5, buckets="layer")
    optimizer = lags.DistributedOptimizer(base, model.named_parameters(), **options)
    optimizer.load_state_dict(saved["optimizer"])
    state = optimizer.state_dict()["lags"]
    assert state["format"] == FORMAT and state["iteration"] == 3
    for name, residual in saved["optimizer"]["lags"]["residuals"].items():
        assert torch.equal(state["residuals"][name], residual), name

    hooked = torch.load(DATA / "ddp-hook-unversioned.pt", weights_only=True)
    assert "format" not in hooked["hook"] and "k" not in hooked["hook"]
    model = models.make_model()
    model.load_state_dict(hooked["model"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    optimizer.load_state_dict(hooked["optimizer"])
    state = LAGSHookState(named_parameters=model.named_parameters(), optimizer=optimizer, density=0.1, recipe="paper")
    state.load_state_dict(hooked["hook"])
    assert state.iteration == 3
    for name, residual in hooked["hook"]["residuals"].items():
        assert torch.equal(state.state_dict()["residuals"][name], residual.reshape(-1)), name
    default, _ = hook_state(models.make_model(), density=0.1)  # momentum correction: the file has no velocities
    with pytest.raises(ValueError, match="no velocities"):
        default.load_state_dict(hooked["hook"])


@pytest.mark.parametrize("world", [2, 3])
def test_momentum_correction_in_the_hook_matches_the_oracle(world, shared):
    """momentum and weight_decay given to the hook (DGC's momentum correction, momentum-factor
    masking; 1-D parameters whole keep their velocity), a plain SGD step: the reference's
    parameters, residuals and velocities on every rank, across DDP's bucket rebuild."""
    results = shared(world, "mc")
    params, eps, velocity = reference(world, STEPS, mlp, mlp_gradients, dense_1d=True, momentum_correction=True)
    for rank, result in enumerate(results):
        assert_matches(result, params, eps[rank], f"rank {rank}")
        for name, expected in velocity[rank].items():
            np.testing.assert_allclose(
                result["velocities"][name].numpy().ravel(), expected, rtol=2e-5, atol=2e-6, err_msg=f"velocity {name}"
            )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_hook_on_two_ranks_of_one_gpu_matches_the_oracle(tmp_path):
    """The hook's scenarios "oracle" (an unused parameter, several buckets) and "mc" (momentum
    correction) with both ranks' models on the one GPU, their CUDA tensors exchanged over
    Gloo: the CPU references' parameters, residuals and velocities."""
    oracle = run(2, "oracle,mc", tmp_path, controller=TORCH_CUDA)
    params, eps = reference(2, STEPS, models.make_model, models.gradients)
    for rank, result in enumerate(oracle):
        assert_matches(result, params, eps[rank], f"oracle: rank {rank}")
    params, eps, velocity = reference(2, STEPS, mlp, mlp_gradients, dense_1d=True, momentum_correction=True)
    for rank in range(2):
        result = torch.load(tmp_path / f"mc.{rank}.pt")
        assert_matches(result, params, eps[rank], f"mc: rank {rank}")
        for name, expected in velocity[rank].items():
            np.testing.assert_allclose(result["velocities"][name].numpy().ravel(), expected, rtol=2e-5, atol=2e-6)


def test_a_stalled_peer_raises_the_named_timeout_and_commits_nothing(tmp_path):
    """Rank 1 sleeps past exchange_timeout: rank 0's backward raises ExchangeTimeoutError naming
    the collective and the iteration (not a corrupted message from a buffer that never
    arrived), no residual of that iteration changed, and the optimizer refuses to go on;
    rank 1, waking to a peer gone, raises a named error too."""
    stalled = run(2, "stall", tmp_path, timeout=120.0)
    waiting = stalled[0]
    assert waiting["step"] == STALL_STEP, waiting["error"]
    error = waiting["error"]
    assert error["type"] == "ExchangeTimeoutError", error
    assert f"of iteration {STALL_STEP}" in error["message"] and "corrupted" not in error["message"], error
    assert "this optimizer failed" in waiting["again"]["message"]
    assert sorted(waiting["after"]) == sorted(waiting["before"]) and waiting["before"]
    for name, value in waiting["before"].items():
        assert torch.equal(waiting["after"][name], value), name
    woken = stalled[1]["error"]
    assert woken is not None and woken["type"] in ("ExchangeTimeoutError", "WorkerLostError"), woken


def test_ranks_with_different_hook_settings_all_raise_ranks_disagree(shared):
    """A momentum on one rank's optimizer (momentum correction in force there only), a different
    density or dense_params, or other parameter names on rank 1: every rank raises
    RanksDisagreeError naming the setting when the hook state is built, before any exchange
    (once a Gloo size abort on one rank and a corrupted message on the other)."""
    named = {"momentum": ("update rule in force",), "density": ("k[", "options"), "dense_params": ("k[", "options")}
    for rank, errors in enumerate(shared(2, "disagree")):
        assert sorted(errors) == sorted(DISAGREE)
        for setting, error in errors.items():
            assert error is not None and error["type"] == "RanksDisagreeError", (rank, setting, error)
            expected = (
                ["the model differs"] if setting == "model" else [f"ranks disagree on {n}" for n in named[setting]]
            )
            assert any(e in error["message"] for e in expected), (rank, setting, error["message"])


@pytest.mark.parametrize("world", [2, 3])
def test_the_ddp_door_and_the_optimizer_door_are_one_lags(world, shared):
    """The same model and per-rank batches through the torchrun optimizer (buckets="layer") and
    through DDP's hook with the same options: the same parameters and residuals bit for bit,
    for SGD with momentum and weight decay (momentum correction), AdamW with and without the
    local residual, and reduce_scatter, through the density warm-up, with a parameter unused on
    one rank, over several DDP buckets; with that parameter unused on every rank at some steps
    (DDP copies no merge into its ``.grad`` there: once its residual went unapplied), with
    ``zero_grad(set_to_none=False)``, and under ``gradient_as_bucket_view`` with a transposed
    weight (once applied scrambled) and the parameter unused on one rank (once an error). DDP's
    ``join()`` in two epochs (once refused the second's ``zero_grad()``) is plain DDP's."""
    for rank, results in enumerate(shared(world, "doors")):
        joined = results.pop("ddp join")  # DDP's join(): the joined ranks contribute zeros (once 0.03 off)
        for name, value in joined["ddp"].items():  # summed in another order than DDP's buckets at P = 3
            torch.testing.assert_close(joined["hook"][name], value, rtol=1e-6, atol=1e-7, msg=f"join {rank} {name}")
        assert sorted(results) == sorted(CASES)
        for case, result in results.items():
            door, hooked = result["optimizer"], result["ddp"]
            assert door["rule"] == hooked["rule"] and len(set(result["ddp buckets"][-3:])) > 1, case
            for part in ("params", "residuals"):
                assert sorted(door[part]) == sorted(hooked[part]) and door[part], (case, part)
                for name, value in door[part].items():
                    assert torch.equal(hooked[part][name], value), (case, rank, part, name)


class Layouts(torch.nn.Module):
    """Parameters whose gradients DDP lays out other than row-major in its bucket (channels_last
    convolutions, 1x1 and depthwise, whose size-1 dimensions' strides are not row-major's; a
    one-row weight laid out transposed), and one that is not dense (row-major there)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pointwise = torch.nn.Conv2d(4, 6, 1)
        self.depthwise = torch.nn.Conv2d(6, 6, 3, padding=1, groups=6)
        self.head = torch.nn.Linear(6, 1)
        self.head.weight = torch.nn.Parameter(self.head.weight.detach().t().contiguous().t())
        self.strided = torch.nn.Parameter(torch.randn(6, 8)[:, ::2])
        self.to(memory_format=torch.channels_last)

    def forward(self, x):
        h = self.depthwise(self.pointwise(x)).mean((2, 3))
        return self.head(h) + (h[:, :4] * self.strided[0]).sum(1, keepdim=True)


def test_the_hooks_views_of_a_bucket_are_ddps_own(torch_group):
    """``ddp.bucket_views`` lays out each gradient in DDP's bucket as DDP does: under
    ``gradient_as_bucket_view`` ``.grad`` is DDP's view, and the hook's view of it has the same
    address, strides and values, before and after DDP rebuilds its buckets (a channels_last
    1x1 convolution once read its size-1 dimension's stride as row-major and failed DDP's check
    of ``.grad``; ``GradBucket.gradients()`` views every one row-major)."""
    from torch.nn.parallel import DistributedDataParallel

    from lags_hvd.ddp import bucket_views, dense_strides

    model = Layouts()
    assert not model.strided.is_contiguous() and not dense_strides(model.strided)
    assert model.pointwise.weight.is_contiguous() and model.pointwise.weight.stride() != (4, 1, 1, 1)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=1e-4)
    seen = []

    def hook(_, bucket):
        for p, view in zip(bucket.parameters(), bucket_views(bucket.buffer(), bucket.parameters())):
            seen.append((p.grad.data_ptr(), p.grad.stride(), view.data_ptr(), view.stride(), torch.equal(p.grad, view)))
        future = torch.futures.Future()
        future.set_result(bucket.buffer())
        return future

    ddp.register_comm_hook(None, hook)
    x = torch.randn(2, 4, 5, 5).to(memory_format=torch.channels_last)
    for _ in range(2):
        model.zero_grad(set_to_none=False)
        ddp(x).sum().backward()
    assert len(seen) == 2 * len(list(model.parameters()))
    for grad_at, grad_strides, view_at, view_strides, equal in seen:
        assert (grad_at, grad_strides, equal) == (view_at, view_strides, True)


def test_the_optimizer_doors_patterns_under_ddp_neither_exchange_twice_nor_drop_a_merge(torch_group):
    """Under DDP the hook merges inside backward: the optimizer door's GradScaler recipe
    (``synchronize()``, then ``step()`` inside ``skip_synchronize()``) exchanges nothing more
    (once it ran a second LAGS iteration on the merge); ``zero_grad()`` between backward and
    ``step()`` is refused (it would drop a committed merge), as is ``step()`` with no backward."""
    from torch.nn.parallel import DistributedDataParallel

    from lags_hvd.ddp import lags_hook

    def run(explicit):
        model = mlp()
        ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        state, optimizer = hook_state(model, density=DENSITY)
        ddp.register_comm_hook(state, lags_hook)
        for step in range(4):
            optimizer.zero_grad()
            x, y = mlp_batch(0, step)
            torch.nn.functional.mse_loss(ddp(x), y).backward()
            if explicit:
                optimizer.synchronize()
                with optimizer.skip_synchronize():
                    optimizer.step()
            else:
                optimizer.step()
        return model, state, optimizer, ddp

    plain, plain_state, _, _ = run(False)
    model, state, optimizer, ddp = run(True)
    assert state.iteration == plain_state.iteration == 4
    for a, b in zip(model.parameters(), plain.parameters()):
        assert torch.equal(a, b)
    x, y = mlp_batch(0, 9)
    torch.nn.functional.mse_loss(ddp(x), y).backward()
    with pytest.raises(RuntimeError, match="zero_grad.. between the backward pass through the DDP model"):
        optimizer.zero_grad()
    optimizer.step()
    with pytest.raises(RuntimeError, match="without a backward pass through the DDP model"):
        optimizer.step()


def test_a_grad_scaler_under_ddp_trains_as_without_it_and_one_not_passed_is_refused(torch_group):
    """The DDP door keeps the residuals (and the default recipe's velocities) unscaled when the
    GradScaler is passed: with a scale that doubles every 2 steps, the model is the unscaled
    run's bit for bit; an overflow skips the step and leaves the model and the residuals as
    they were. A GradScaler stepping the optimizer without having been passed is refused
    before anything is stepped (before, the residuals kept each iteration's scale, silently)."""
    from torch.nn.parallel import DistributedDataParallel

    from lags_hvd.ddp import lags_hook

    def run(scaled, passed=True, overflow_at=None):
        model = mlp()
        ddp = DistributedDataParallel(model, bucket_cap_mb=BUCKET_MB)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2) if scaled else None
        state, optimizer = hook_state(model, density=DENSITY, grad_scaler=scaler if passed else None)
        ddp.register_comm_hook(state, lags_hook)
        model[0].weight.register_hook(lambda g: g * float("inf") if state.iteration == overflow_at else g)
        for step in range(6):
            optimizer.zero_grad()
            x, y = mlp_batch(0, step)
            loss = torch.nn.functional.mse_loss(ddp(x), y)
            if scaler is None:
                loss.backward()
                optimizer.step()
                continue
            scaler.scale(loss).backward()
            before = ([p.detach().clone() for p in model.parameters()], state.state_dict()["residuals"])
            scaler.unscale_(optimizer)
            scaler.step(optimizer)
            scaler.update()
            if step == overflow_at:
                assert optimizer.skipped_steps == 1 and scaler.get_scale() == 2.0**8  # halved from 2**9
                assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before[0]))
                saved = state.state_dict()["residuals"]
                assert all(torch.equal(saved[name], r) for name, r in before[1].items())
        return model, scaler

    plain, _ = run(False)
    scaled, scaler = run(True)
    assert scaler.get_scale() == 2.0**11
    assert all(torch.equal(a, b) for a, b in zip(scaled.parameters(), plain.parameters()))
    run(True, overflow_at=3)
    with pytest.raises(RuntimeError, match="GradScaler is stepping this lags_hvd optimizer, but was not passed"):
        run(True, passed=False)
