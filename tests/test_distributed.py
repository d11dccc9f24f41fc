"""Multi-process LAGS-SGD against the single-process numpy oracle (P = 2 and 3): on Horovod
(its Gloo and MPI controllers) and on torch.distributed (Gloo, under torchrun: "torch")."""

import json
import math
import shutil
from fractions import Fraction

import models
import numpy as np
import oracle
import pytest
import torch
from launch import CONTROLLERS, TORCH, TORCH_CUDA, SharedLaunches, horovodrun
from workers.lags_worker import (
    ADAM,
    ADAM_VARIANTS,
    AMP_OVERFLOW_STEP,
    AMP_SCALE,
    CLIP_NORM,
    FIDELITY,
    LOCAL,
    PROCESS_SET_MEMBERS,
    REDUCE_SCATTER,
    REDUCTION,
    hvd,
)

STEPS = 6
ORACLE_SCENARIOS = ("oracle", "dense", "checkpoint")
COMPOSE_STEPS = 7
FIDELITY_STEPS = 6
AUTO_STEPS, AUTO_WARMUP = 6, 3  # tests/workers/lags_worker.py: scenario_auto
ADAPTIVE_STEPS = 12  # planned after 3, then timed and decided again every 4
RS_STEPS = 18  # rebalancing at iterations 0 and 16; the traffic checked is the last (none)
LOCAL_STEPS = 8
REORDERED_STEPS = 4


def run_scenarios(world: int, controller: str, out, steps: int, scenarios: str) -> None:
    """One launch of tests/workers/lags_worker.py: ``scenarios`` (comma-separated), ``steps`` steps each."""
    horovodrun(world, controller, "lags_worker.py", "--out", str(out), "--steps", str(steps), "--scenarios", scenarios)


SHARED: dict[tuple[int, str], list[str]] = {}
"""(P, controller) -> the scenarios (``name:steps``) of the one launch that the tests below read
for that world and backend: a launch costs seconds of start-up on two cores, a scenario a fraction
of one, so every oracle scenario of one (P, controller) runs in the same workers, in order."""


def _shared(pairs, *scenarios: str) -> list[tuple[int, str]]:
    for pair in pairs:
        SHARED.setdefault(pair, []).extend(scenarios)
    return list(pairs)


ONE_GPU = [(2, TORCH_CUDA)] if torch.cuda.is_available() else []  # two ranks on the one GPU, Gloo
EVERY = _shared(
    [(p, c) for p in (2, 3) for c in (*CONTROLLERS, TORCH)] + ONE_GPU, *(f"{n}:{STEPS}" for n in ORACLE_SCENARIOS)
)
OVERLAP = _shared([(2, c) for c in (*CONTROLLERS, TORCH)], "overlap")
NONFINITE = _shared([(2, "gloo"), (3, "mpi"), (2, TORCH)], "nonfinite")
MISMATCH = _shared([(2, "gloo"), (2, TORCH)], "mismatch")  # refused alike: the launch goes on
COMPOSE = [
    ("accumulate", 2, "gloo"),
    ("process-set", 3, "mpi"),
    ("amp", 2, "mpi"),
    ("process-set-rs", 3, "gloo"),
    ("amp-rs", 2, "gloo"),
    ("accumulate", 2, TORCH),
    ("process-set-rs", 3, TORCH),
    ("amp", 2, TORCH),
]
for _variant, _world, _controller in COMPOSE:
    _shared([(_world, _controller)], f"compose-{_variant}:{COMPOSE_STEPS}")
AUTO = _shared([(2, "gloo"), (3, "mpi"), (3, TORCH)], f"auto:{AUTO_STEPS}")
FIDELITY_PAIRS = _shared([(2, "gloo"), (3, "mpi"), (2, TORCH)], *(f"fidelity-{v}:{FIDELITY_STEPS}" for v in FIDELITY))
FIDELITY_PAIRS += _shared(ONE_GPU, f"fidelity-graphs:{FIDELITY_STEPS}")  # real CUDA graphs, P = 2
REDUCTION_PAIRS = _shared(
    [(2, "gloo"), (3, "mpi"), (3, TORCH)],
    *(f"reduction-{v}:{FIDELITY_STEPS}" for v in REDUCTION),
    f"amp-recipe:{FIDELITY_STEPS}",
)
REORDERED = _shared([(2, "gloo"), (2, TORCH)], f"reordered:{REORDERED_STEPS}")
LOCAL_PAIRS = _shared([(2, "gloo"), (3, "mpi")], *(f"local-{v}:{LOCAL_STEPS}" for v in LOCAL))
ADAM_PAIRS = _shared([(2, "gloo"), (3, "mpi"), (2, TORCH)] + ONE_GPU, *(f"adam-{v}:{STEPS}" for v in ADAM_VARIANTS))
RS_SCENARIOS = [f"reduce-scatter-{v}:{RS_STEPS}" for v in REDUCE_SCATTER]
RS_PAIRS = _shared([(2, "gloo"), (3, "mpi"), (2, TORCH), (3, TORCH)] + ONE_GPU, *RS_SCENARIOS)
RS_ALONE = [(4, "gloo")]  # a world larger than a unit (conv.bias: 3 entries): a region of it is empty
CROSS = [("gloo", TORCH), (TORCH, "mpi")]  # (saved under, resumed under)
_shared([(2, saved) for saved, _ in CROSS], f"cross-save:{FIDELITY_STEPS}")
ADAPTIVE = [(2, "gloo", "measured"), (3, "mpi", "file"), (3, TORCH, "measured")]
for _world, _controller, _profile in ADAPTIVE:
    _shared([(_world, _controller)], f"adaptive-{_profile}:{ADAPTIVE_STEPS}")


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """``shared(P, controller)``: the output folder of ``SHARED[(P, controller)]``'s launch,
    run on first use (a failed launch fails every test that reads it, once launched)."""
    launches = SharedLaunches(tmp_path_factory)

    def out(world: int, controller: str):
        # last: a rank outside the process set builds fewer optimizers, so the collective
        # names of the optimizers built after it would differ between ranks
        ordered = sorted(SHARED[(world, controller)], key=lambda scenario: "process-set" in scenario)
        folder, failure = launches.run(world, controller, "lags_worker.py", ordered, timeout=420)
        if failure:
            pytest.fail(f"the shared launch of P={world} {controller} failed:\n{failure}")
        return folder

    return out


def reference_run(
    ranks,
    steps: int,
    passes: int = 1,
    clip: float | None = None,
    frozen: tuple = (),
    sometimes: bool = False,
    skip: tuple = (),
    warmup: tuple | None = None,
    momentum_correction: bool = False,
    dense_1d: bool = False,
    local_clip: float | None = None,
    buckets: tuple[int, list[list[str]]] | None = None,
    aggregation: str = "allgather",
    owner_keep: float = 1.0,
    regional: bool = False,
    record: dict | None = None,
    max_grad_norm: float | None = None,
    reduction: oracle.Reduction = oracle.AVERAGE,
):
    """LAGS-SGD on simulated workers ``ranks``: numpy math, torch only for the gradients.
    Returns the parameters, each rank's residuals of the parameters sent sparse (one sent
    whole keeps none) and k per parameter.

    passes: micro-batches summed per step; clip: clip the merged gradients to this global
    norm; frozen: parameters never trained; skip: steps dropped entirely (an overflow).
    The fidelity options: warmup = (iterations, start density) of DGC's density warm-up;
    momentum_correction: DGC's, with the SGD's momentum and weight decay applied locally;
    dense_1d: 1-D parameters not in LAYER_DENSITIES sent whole; local_clip: each worker's
    gradient of layer l clipped to local_clip * sqrt(d_l / d) * sqrt(P) before accumulation
    when the merge averages, / sqrt(P) when it sums (``record`` then counts in
    "local_clips" the layers it shortened).
    buckets = (from_step, groups): from that step on, each group of parameters is one
    vector for top-k (their density: the first member's), residuals kept per parameter.
    aggregation="reduce_scatter": sparse units combine by oracle.reduce_scatter_round, from
    equal regions, the owners keeping ceil(owner_keep k) entries between them (at most
    the unit's size); ``record`` then receives the final "regions" and the last step's
    "traffic" (entries sent, received) per rank and unit. regional: each worker selects
    by region (oracle.reduce_scatter_round's ``regional``).
    max_grad_norm: clip the merged gradients to this global norm, and give (1 - c) of what
    each worker's sparse units applied (acc - its new residual) back to its residual;
    ``record`` then receives the last step's "grad_norm" (not with ``buckets``).
    reduction: how every unit's contributions combine (Horovod's op and
    gradient_predivide_factor; oracle.Reduction).
    """
    assert not (max_grad_norm and buckets), "the give-back here is per parameter, not per bucket"
    model = models.make_model()
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    names = [n for n in params if n not in frozen]
    k = {n: oracle.k_for(models.LAYER_DENSITIES.get(n, models.DENSITY), params[n].size) for n in names}
    if dense_1d:
        k.update({n: params[n].size for n in names if params[n].ndim == 1 and n not in models.LAYER_DENSITIES})
    eps = [{n: np.zeros(params[n].size, np.float32) for n in names} for _ in ranks]
    velocity = [{n: np.zeros(params[n].size, np.float32) for n in names} for _ in ranks]
    total_size = sum(params[n].size for n in names)
    if momentum_correction:
        sgd = oracle.SGDMomentum(models.LR)
    else:
        sgd = oracle.SGDMomentum(models.LR, models.MOMENTUM, models.WEIGHT_DECAY)
    iteration = 0
    regions = {}  # reduce_scatter: boundaries per unit, from equal regions over min(P, k) owners
    traffic = {}
    for step in range(steps):
        if step in skip:
            continue
        grads = []
        for rank in ranks:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(torch.from_numpy(params[n]))
            total = {n: np.zeros(params[n].size, np.float32) for n in names}
            for micro in range(passes):
                for n, g in models.gradients(model, rank, step * passes + micro, sometimes).items():
                    if n in total and g is not None:
                        total[n] = total[n] + g.numpy().ravel()
            if local_clip is not None:
                spread = np.sqrt(len(ranks)) if reduction.average else 1 / np.sqrt(len(ranks))
                budget = {n: local_clip * np.sqrt(g.size / total_size) * spread for n, g in total.items()}
                if record is not None:
                    record["local_clips"] = record.get("local_clips", 0) + sum(
                        float(np.linalg.norm(g)) > budget[n] for n, g in total.items()
                    )
                total = {n: oracle.clipped(g, budget[n]) for n, g in total.items()}
            if momentum_correction:
                total = {n: g + np.float32(models.WEIGHT_DECAY) * params[n].ravel() for n, g in total.items()}
            grads.append(total)
        merged = {}
        accumulated = [{} for _ in ranks]  # acc per rank and sparse unit, for max_grad_norm
        for n in names:
            k_now = oracle.warmup_k(k[n], params[n].size, iteration, warmup[1], warmup[0]) if warmup else k[n]
            split = aggregation == "reduce_scatter" and k_now < params[n].size
            if k_now < params[n].size:
                for i in range(len(ranks)):
                    u = grads[i][n] + np.float32(models.MOMENTUM) * velocity[i][n] * momentum_correction
                    accumulated[i][n] = eps[i][n] + u
            if momentum_correction and not split:
                merged[n], new_u, new_eps = oracle.momentum_corrected_round(
                    [velocity[i][n] for i in range(len(ranks))],
                    [eps[i][n] for i in range(len(ranks))],
                    [grads[i][n] for i in range(len(ranks))],
                    models.MOMENTUM,
                    k_now,
                    reduction,
                )
                for i in range(len(ranks)):
                    velocity[i][n], eps[i][n] = new_u[i], new_eps[i]
            elif split:
                d = params[n].size
                kept = min(d, math.ceil(Fraction(str(owner_keep)) * k_now))
                owners = min(len(ranks), kept)
                start = regions.get(n)
                if start is None or any(b != d for b in start[owners:]) or start[owners - 1] >= d:
                    start = [min(r, owners) * d // owners for r in range(len(ranks) + 1)]  # made for another R
                accs = [eps[i][n] + grads[i][n] for i in range(len(ranks))]
                if momentum_correction:  # u = m u + g; acc = eps + u; u restarts where applied
                    new_u = [np.float32(models.MOMENTUM) * velocity[i][n] + grads[i][n] for i in range(len(ranks))]
                    accs = [eps[i][n] + new_u[i] for i in range(len(ranks))]
                merged[n], new_eps, regions[n], traffic[n], applied = oracle.reduce_scatter_round(
                    accs,
                    k_now,
                    start,
                    rebalance=iteration % oracle.REBALANCE_EVERY == 0,
                    kept=kept,
                    regional=regional,
                    reduction=reduction,
                )
                for i in range(len(ranks)):
                    eps[i][n] = new_eps[i]
                    if momentum_correction:
                        velocity[i][n] = new_u[i].copy()
                        velocity[i][n][applied[i]] = 0
            elif not (buckets and step >= buckets[0]):
                merged[n], new_eps = oracle.lags_round(
                    [eps[i][n] + grads[i][n] for i in range(len(ranks))], k_now, reduction
                )
                for i in range(len(ranks)):
                    eps[i][n] = new_eps[i]
        for group in buckets[1] if buckets and step >= buckets[0] else []:
            sizes = [params[n].size for n in group]
            bucket_k = oracle.k_for(models.LAYER_DENSITIES.get(group[0], models.DENSITY), sum(sizes))
            total, new_eps = oracle.lags_round(
                [np.concatenate([eps[i][n] + grads[i][n] for n in group]) for i in range(len(ranks))],
                bucket_k,
                reduction,
            )
            bounds = np.cumsum([0] + sizes)
            for j, n in enumerate(group):
                merged[n] = total[bounds[j] : bounds[j + 1]]
                for i in range(len(ranks)):
                    eps[i][n] = new_eps[i][bounds[j] : bounds[j + 1]]
        iteration += 1
        if clip is not None:
            merged = clip_merged(merged, clip)
        if max_grad_norm is not None:
            norm = np.sqrt(sum(float(np.square(m, dtype=np.float64).sum()) for m in merged.values()))
            unapplied = np.float32(1) - np.float32(min(1.0, max_grad_norm / (norm + 1e-6)))
            merged = clip_merged(merged, max_grad_norm)
            if record is not None:
                record["grad_norm"] = norm
            for i in range(len(ranks)):
                for n, acc in accumulated[i].items():  # what this worker's merge applied: acc - eps
                    eps[i][n] = eps[i][n] + unapplied * (acc - eps[i][n])
        for n in names:
            params[n] = sgd.step(n, params[n], merged[n].reshape(params[n].shape))
    if record is not None:
        record.update(regions=regions, traffic=traffic)
    sparse = [n for n in names if k[n] < params[n].size]
    return params, [{n: residuals[n] for n in sparse} for residuals in eps], k


def reference_for(world: int, steps: int, options: dict, record: dict | None = None):
    """reference_run of a worker's DistributedOptimizer ``options`` (tests/workers/lags_worker.py:
    the default recipe resolved as for its momentum SGD) on ``world`` workers."""
    if options.get("recipe") == "dgc":  # what the default recipe turns on for a momentum SGD
        options = {"momentum_correction": True, "dense_params": "1d", **options}
    return reference_run(
        range(world),
        steps,
        sometimes=True,
        record=record,
        warmup=(options["density_warmup"], options["density_warmup_start"]) if "density_warmup" in options else None,
        momentum_correction=options.get("momentum_correction", False),
        dense_1d=options.get("dense_params") == "1d",
        local_clip=options.get("local_clip"),
        max_grad_norm=options.get("max_grad_norm"),
        aggregation=options.get("aggregation", "allgather"),
        owner_keep=options.get("owner_keep", 1.0),
        regional=options.get("regional_selection", False),
        reduction=oracle.Reduction(
            average=options.get("op", hvd.Average) == hvd.Average,
            predivide=options.get("gradient_predivide_factor", 1.0),
        ),
    )


def clip_merged(merged: dict, max_norm: float) -> dict:
    """torch.nn.utils.clip_grad_norm_ over every merged gradient at once."""
    norm = np.sqrt(sum(float(np.square(m, dtype=np.float64).sum()) for m in merged.values()))
    return {n: m * np.float32(min(1.0, max_norm / (norm + 1e-6))) for n, m in merged.items()}


@pytest.fixture(scope="module", params=EVERY, ids=lambda pc: f"P{pc[0]}-{pc[1]}")
def run(request, shared):
    world, controller = request.param
    out = shared(world, controller)
    return (
        world,
        [torch.load(out / f"oracle.{r}.pt") for r in range(world)],
        [json.loads((out / f"differences.{r}.json").read_text()) for r in range(world)],
    )


def assert_matches(result: dict, params: dict, eps: dict, label: str) -> None:
    """One rank's saved parameters and residuals against the reference run's: the same
    names (a residual for every parameter sent sparse, none for one sent whole), then the
    values."""
    assert sorted(result["params"]) == sorted(params), label
    assert sorted(result["residuals"]) == sorted(eps), f"{label}: residuals"
    for name, expected in params.items():
        np.testing.assert_allclose(
            result["params"][name].numpy(), expected, rtol=2e-5, atol=2e-6, err_msg=f"{label} parameter {name}"
        )
    for name, expected in eps.items():
        np.testing.assert_allclose(
            result["residuals"][name].numpy(), expected, rtol=2e-5, atol=2e-6, err_msg=f"{label} residual {name}"
        )


def test_parameters_match_the_oracle_on_every_rank(run):
    world, results, _ = run
    params, eps, k = reference_run(range(world), STEPS)
    assert results[0]["k"] == {n: v for n, v in k.items()}
    assert k["conv.weight"] == 27 and k["fc.bias"] == 1  # the dense and the k=1 cases are covered
    for rank, result in enumerate(results):
        assert_matches(result, params, eps[rank], f"rank {rank}")


def test_all_ranks_hold_identical_parameters(run):
    _, results, _ = run
    for result in results[1:]:
        for name, value in results[0]["params"].items():
            assert torch.equal(result["params"][name], value), name


def test_mass_is_conserved_per_worker(run):
    """sum of what a worker sent + its final residual == sum of its gradients."""
    _, results, _ = run
    for rank, result in enumerate(results):
        for name, residual in result["residuals"].items():
            sent = torch.zeros_like(residual)
            for unit, values, indices in result["sent"]:
                if unit == name:
                    sent.index_add_(0, indices, values)
            grads = sum((g.reshape(-1) for g in result["raw"][name]), torch.zeros_like(residual))
            torch.testing.assert_close(sent + residual, grads, rtol=1e-5, atol=1e-5, msg=f"rank {rank} unit {name}")


def test_unused_parameter_is_exchanged_without_deadlock(run):
    """`aux` is unused on rank 1: no hook fires there, yet rank 1 takes part in every one of
    its exchanges (sending zeros: it has no gradient and nothing in its residual) and steps
    it with the merged gradient exactly as rank 0 does."""
    _, results, _ = run
    unused = results[models.UNUSED_ON_RANK]
    assert len(unused["raw"]["aux.weight"]) == 0 and len(results[0]["raw"]["aux.weight"]) == STEPS
    sent = [values for name, values, _ in unused["sent"] if name == "aux.weight"]
    assert len(sent) == STEPS and not any(values.any() for values in sent)
    assert not unused["residuals"]["aux.weight"].any()
    stepped = unused["params"]["aux.weight"]
    assert not torch.equal(stepped, models.make_model().aux.weight.detach()), "rank 1 never stepped aux.weight"
    assert torch.equal(stepped, results[0]["params"]["aux.weight"])


def test_density_one_equals_the_backends_own_dense_optimizer(run):
    """Against ``hvd.DistributedOptimizer`` on Horovod, DDP on torch.distributed: bit for bit
    with two workers. With three, Horovod's ring allreduce adds in an order that depends on
    how its tensor fusion packed the buffer, which differs between any two runs, and DDP
    divides by P before the sum where the optimizer divides after it, so only rounding-level
    agreement is meaningful."""
    world, _, differences = run
    tolerance = 0.0 if world == 2 else 1e-6
    for rank_differences in differences:
        assert len(rank_differences["dense"]) == 6
        assert max(rank_differences["dense"].values()) <= tolerance, rank_differences["dense"]


def test_checkpoint_resume_is_bit_exact(run):
    """N steps, save, M steps == load into a fresh model and optimizer, M steps (residuals too)."""
    _, _, differences = run
    for rank_differences in differences:
        assert any(name.startswith("residual") for name in rank_differences["checkpoint"])
        assert rank_differences["checkpoint"] == {name: 0.0 for name in rank_differences["checkpoint"]}


@pytest.mark.parametrize("world,controller", OVERLAP)
def test_exchanges_start_while_backward_runs(world, controller, shared):
    """The backward order is the expected one here, so on torch.distributed, which starts
    the buckets in that order, they start as early as on Horovod."""
    out = shared(world, controller)
    for rank in range(world):
        record = json.loads((out / f"overlap.{rank}.json").read_text())
        launched_early = [n for n, t in record["launches"] if t < record["backward_end"]]
        assert len(record["launches"]) == 12
        # The last layer's exchange starts first, long before backprop reaches the input.
        assert record["launches"][0][0].startswith("5.")
        assert len(launched_early) >= 10, record


@pytest.mark.parametrize("world,controller,profile", ADAPTIVE)
def test_adaptive_decisions_are_identical_on_every_rank_and_k_is_what_is_sent(world, controller, profile, shared):
    """Measured or read from a file, the network profile plans the same densities on every
    rank (decided on rank 0), and k in force is what each exchange sends."""
    out = shared(world, controller)
    records = [json.loads((out / f"adaptive-{profile}.{r}.json").read_text()) for r in range(world)]
    history = records[0]["history"]
    assert history[0] == [3, "plan"]  # after the 3 warm-up iterations
    assert history[1][0] == 6 and history[1][1] in ("keep", "back off")  # 1 settling + 2 timed
    for record in records[1:]:  # decided on rank 0, applied everywhere
        assert record["history"] == history
        assert record["in_force"] == records[0]["in_force"]
        assert record["final_plan"] == records[0]["final_plan"]
    for record in records:
        assert record["in_force"][3] != record["in_force"][0]  # the plan took effect
        for step, (sent, in_force) in enumerate(zip(record["sent"], record["in_force"])):
            assert sent == in_force, step
        assert record["sent"][0]["0.weight"] == 128 * 512 // 100 + 1  # min_density 0.01 (ceil)


@pytest.mark.parametrize("world,controller", NONFINITE)
def test_nan_on_one_rank_skips_the_step_on_every_rank(world, controller, shared):
    out = shared(world, controller)
    results = [torch.load(out / f"nonfinite.{r}.pt") for r in range(world)]
    for result in results:
        assert result["skipped"] == 1
        before, poisoned, after = (result["snapshots"][i]["params"] for i in (1, 2, 3))
        assert all(torch.equal(before[n], poisoned[n]) for n in before)  # step 2 did nothing
        assert any(not torch.equal(poisoned[n], after[n]) for n in before)  # step 3 trained
        assert all(s["residuals_finite"] for s in result["snapshots"])
        for name, value in after.items():  # ranks still agree
            assert torch.equal(value, results[0]["snapshots"][3]["params"][name])


@pytest.mark.parametrize("world,controller", MISMATCH)
def test_models_that_differ_across_ranks_are_refused_on_every_rank(world, controller, shared):
    out = shared(world, controller)
    errors = [json.loads((out / f"mismatch.{r}.json").read_text())["error"] for r in range(world)]
    assert errors[0] == errors[1]
    assert "the model differs across ranks" in errors[0] and "fc.bias" in errors[0]
    assert "(5,)" in errors[0] and "(6,)" in errors[0]


@pytest.mark.parametrize("controller,bound", [("gloo", 90), ("mpi", 120), (TORCH, 60)])
def test_a_killed_worker_stops_the_others_in_bounded_time(controller, bound, tmp_path):
    """Measured: Gloo about 30 s, MPI about 60 s (mpirun aborts the job), torchrun a few
    seconds (it stops the other workers as soon as one fails)."""
    import time

    started = time.monotonic()
    with pytest.raises(AssertionError, match="workers failed") as failure:
        horovodrun(2, controller, "lags_worker.py", "--out", str(tmp_path), "--scenarios", "killed", timeout=bound)
    assert time.monotonic() - started < bound
    if controller == "gloo":  # the survivor raises; mpirun kills it before it can
        assert "WorkerLostError" in str(failure.value) and "a worker died or left the job" in str(failure.value)


@pytest.mark.parametrize("variant,world,controller", COMPOSE)
def test_composed_settings_match_the_oracle(variant, world, controller, shared):
    """Each setting of tests/workers/lags_worker.py's compose scenario against reference_run
    (-rs: with reduce_scatter; in a process set its regions follow the rank within the set)."""
    out = shared(world, controller)
    setting = variant.removesuffix("-rs")
    members = PROCESS_SET_MEMBERS if setting == "process-set" else list(range(world))
    results = {r: torch.load(out / f"compose-{variant}.{r}.pt") for r in members}
    if setting == "process-set":
        assert not (out / f"compose-{variant}.1.pt").exists()
    options = {
        "accumulate": dict(passes=2, clip=CLIP_NORM, frozen=("shift",)),
        "process-set": {},
        "amp": dict(skip=(AMP_OVERFLOW_STEP,)),
    }[setting]
    if variant.endswith("-rs"):
        options["aggregation"] = "reduce_scatter"
    params, eps, _ = reference_run(members, COMPOSE_STEPS, sometimes=True, **options)
    for i, rank in enumerate(members):
        assert_matches(results[rank], params, eps[i], f"rank {rank}")
    if setting == "accumulate":  # the frozen parameter has no residual and never moved
        assert torch.equal(results[0]["params"]["shift"], models.make_model().shift.detach())
    if setting == "amp":  # every rank skipped the overflow and halved its scale alike
        assert [r["skipped"] for r in results.values()] == [1] * world
        assert len({r["scale"] for r in results.values()}) == 1


@pytest.mark.parametrize("world,controller", AUTO)
def test_auto_buckets_are_rank_0s_plan_everywhere_and_match_the_oracle(world, controller, shared):
    """buckets="auto": every rank applies rank 0's plan in the same iteration (parameters of
    different densities never share a bucket, but a bucket may hold parameters that others
    separate in backward order), and training equals the numpy reference run with those
    buckets from that iteration on."""
    out = shared(world, controller)
    results = [torch.load(out / f"auto.{r}.pt") for r in range(world)]
    buckets = results[0]["buckets"]
    assert all(r["buckets"] == buckets for r in results)
    densities = [{models.LAYER_DENSITIES.get(n, models.DENSITY) for n in group} for group in buckets]
    assert all(len(d) == 1 for d in densities)
    # the 50 ms start-up makes one bucket per density: merged across the parameters of
    # other densities between them in backward order (fc.bias between fc.weight and aux)
    assert len(buckets) == len(set.union(*densities)) == 3
    params, eps, _ = reference_run(range(world), AUTO_STEPS, sometimes=True, buckets=(AUTO_WARMUP, buckets))
    for rank in range(world):
        assert_matches(results[rank], params, eps[rank], f"rank {rank}")


@pytest.mark.parametrize("world,controller", FIDELITY_PAIRS)
def test_fidelity_options_match_the_oracle(world, controller, shared):
    """density_warmup, momentum_correction, dense_params='1d', local_clip and max_grad_norm, each
    alone and all together, and the default recipe, also with every sparse bucket's hook
    replayed from a graph (``cuda_graphs``: off CUDA, tests/graph_stand_in.py), against the
    numpy reference (tests/oracle.py), on every rank."""
    out = shared(world, controller)
    for variant, options in FIDELITY.items():
        if f"fidelity-{variant}:{FIDELITY_STEPS}" not in SHARED[world, controller]:
            continue  # on the one GPU: the graphs alone
        results = {r: torch.load(out / f"fidelity-{variant}.{r}.pt") for r in range(world)}
        record = {}
        params, eps, k = reference_for(world, FIDELITY_STEPS, options, record)
        for rank in range(world):
            assert_matches(results[rank], params, eps[rank], f"{variant}: rank {rank}")
            assert results[rank]["k"] == k, variant  # the warm-up is over; dense_params in force
            if "local_clip" in options:  # the local clip shortened gradients, so it was tested
                assert record["local_clips"] > 0, variant
            sparse = [name for name, value in k.items() if 0 < value < results[rank]["params"][name].numel()]
            assert sorted(results[rank]["graphs"]) == (sorted(sparse) if "cuda_graphs" in options else []), variant
            if "max_grad_norm" in options:  # the norm before the clip; it bit, so the give-back ran
                assert results[rank]["grad_norm"].item() == pytest.approx(record["grad_norm"], rel=1e-5)
                assert record["grad_norm"] > options["max_grad_norm"], variant


@pytest.mark.parametrize("world,controller", REDUCTION_PAIRS)
def test_op_sum_the_predivision_and_the_recipe_under_a_grad_scaler_match_the_oracle(world, controller, shared):
    """op=hvd.Sum (the merge is the workers' sum, the local clip's budget C / sqrt(P)) and
    gradient_predivide_factor f ((f / P) sum_p (x_p / f)), with allgather, reduce_scatter
    and a dense unit (conv.weight), against the numpy reference on every rank. And the
    default recipe with weight decay under a GradScaler (power-of-two scales): the same as
    the reference, and at P = 2 bit for bit the run without a scaler (at P = 3 Horovod's
    ring allreduce of the dense units adds in an order that depends on its tensor fusion)."""
    out = shared(world, controller)
    for variant, options in REDUCTION.items():
        record = {}
        params, eps, _ = reference_for(world, FIDELITY_STEPS, options, record)
        for rank in range(world):
            assert_matches(
                torch.load(out / f"reduction-{variant}.{rank}.pt"), params, eps[rank], f"{variant}: rank {rank}"
            )
        if "local_clip" in options:  # the local clip shortened gradients, so its budget was tested
            assert record["local_clips"] > 0, variant
    params, eps, _ = reference_for(world, FIDELITY_STEPS, FIDELITY["recipe"])
    for rank in range(world):
        runs = torch.load(out / f"amp-recipe.{rank}.pt")
        scaled, plain = runs["scaled"], runs["plain"]
        assert scaled["skipped"] == 0 and scaled["scale"] == AMP_SCALE * 2 ** (FIDELITY_STEPS // 2)
        assert_matches(scaled, params, eps[rank], f"amp-recipe: rank {rank}")
        if world == 2:
            for part in ("params", "residuals", "velocities"):
                assert sorted(scaled[part]) == sorted(plain[part]), part
                for name, value in plain[part].items():
                    difference = (scaled[part][name] - value).abs().max().item()
                    assert torch.equal(scaled[part][name], value), f"rank {rank} {part} {name}: {difference:g}"


ROW_BYTES = 8  # an entry on the wire: int32 index + float32 value


@pytest.mark.parametrize("world,controller", RS_PAIRS + RS_ALONE)
def test_reduce_scatter_matches_the_oracle(world, controller, shared, tmp_path):
    """aggregation="reduce_scatter" against oracle.reduce_scatter_round on every rank: the
    parameters, the residuals (what the second selection dropped went back to the worker
    that sent it), the balanced regions, and the bytes each worker sent and received.
    The tiny model covers a dense unit (conv.weight), k=1 units (one owner, the other
    regions empty) and regions of different sizes; P = 4, more ranks than a unit's entries. "hostile"
    adds momentum correction (velocities restart only where the global selection kept
    an entry), a density warm-up (k, and so the number of region owners, changes), a
    user's selector returning its indices in descending order and owners keeping
    ceil(2.5 k) entries (``owner_keep``). "regional" selects by region
    (``regional_selection``) under momentum correction, the warm-up and that selector,
    owners keeping 2k: the regions stay equal, nobody sends summaries."""
    if (world, controller) in RS_ALONE:
        out = tmp_path
        run_scenarios(world, controller, out, RS_STEPS, ",".join(RS_SCENARIOS))
    else:
        out = shared(world, controller)
    for variant, options in REDUCE_SCATTER.items():
        results = [torch.load(out / f"reduce-scatter-{variant}.{r}.pt") for r in range(world)]
        record = {}
        params, eps, _ = reference_for(world, RS_STEPS, {"aggregation": "reduce_scatter", **options}, record)
        for rank, result in enumerate(results):
            assert_matches(result, params, eps[rank], f"{variant}: rank {rank}")
            if "max_grad_norm" in options:  # the clip's norm (it bites: the give-back ran)
                assert result["grad_norm"].item() == pytest.approx(record["grad_norm"], rel=1e-5)
                assert record["grad_norm"] > options["max_grad_norm"]
            assert set(result["traffic"]) == set(record["traffic"])  # every sparse unit, no dense one
            if options.get("regional_selection"):  # equal regions throughout, never stored
                assert result["regions"] == {}, (variant, rank)
            else:
                assert result["regions"] == record["regions"], (variant, rank)
            for name in record["traffic"]:
                sent, received = record["traffic"][name][rank]
                assert result["traffic"][name] == {"sent": sent * ROW_BYTES, "received": received * ROW_BYTES}, (
                    variant,
                    rank,
                    name,
                )
        if variant == "plain":  # k = 1 units: one owner, the other regions empty
            assert any(b[i] == b[i + 1] for b in record["regions"].values() for i in range(world))


@pytest.mark.parametrize("world,controller", REORDERED)
def test_buckets_ready_in_another_order_on_one_rank_are_exchanged_correctly(world, controller, shared):
    """Rank 1's buckets become ready in the reverse of rank 0's order. Horovod matches the
    exchanges by name; torch.distributed matches them by order, so the optimizer starts them
    in one fixed order there: the run equals the one where both ranks use the same order
    (without it, same-sized messages of different buckets would be summed together)."""
    out = shared(world, controller)
    for rank in range(world):
        runs = torch.load(out / f"reordered.{rank}.pt")
        for name, value in runs["same"].items():
            assert torch.equal(runs["reversed"][name], value), f"rank {rank} {name}"


@pytest.mark.parametrize("saved,resumed", CROSS)
def test_a_checkpoint_resumes_bit_exact_on_the_other_backend(saved, resumed, shared, tmp_path):
    """The default recipe's checkpoint (residuals, velocities, warm-up) written under one
    backend (in its shared launch, after its other scenarios) and loaded into a fresh model
    and optimizer under the other, in a launch of its own, continues exactly as the run that
    wrote it, on every rank."""
    for name in [f"cross.{rank}.pt" for rank in range(2)] + [
        f"cross-final.{backend_of(saved)}.{r}.pt" for r in range(2)
    ]:
        shutil.copy(shared(2, saved) / name, tmp_path)
    run_scenarios(2, resumed, tmp_path, FIDELITY_STEPS, "cross-resume")
    for rank in range(2):
        final = torch.load(tmp_path / f"cross-final.{backend_of(saved)}.{rank}.pt")
        resumed_run = torch.load(tmp_path / f"cross-resumed.{backend_of(resumed)}.{rank}.pt")
        for part in ("params", "residuals", "velocities"):
            assert final[part] and sorted(final[part]) == sorted(resumed_run[part]), part
            for name, value in final[part].items():
                assert torch.equal(resumed_run[part][name], value), f"rank {rank} {part} {name}"


@pytest.mark.parametrize("world,controller", LOCAL_PAIRS)
def test_local_residual_keeps_one_consensus_on_every_rank(world, controller, shared):
    """Under local_residual each rank's parameters are the consensus minus its residual: after
    the density warm-up and the re-bucketing of buckets="auto", a clip of the merge that gives
    part back to the residuals under reduce_scatter, accumulated backward passes, and a
    synchronize() no step() followed, ``x_p + eps_p`` is the same on every rank while the
    ranks' parameters differ."""
    out = shared(world, controller)
    for variant in LOCAL:
        ranks = [torch.load(out / f"local-{variant}.{rank}.pt") for rank in range(world)]
        assert all(r["rule"] == "adam_correction_local" for r in ranks), variant
        assert variant != "auto" or all(r["replanned"] and r["buckets"] < len(r["params"]) for r in ranks)
        consensus = [
            {n: p + r["residuals"][n].view_as(p) if n in r["residuals"] else p for n, p in r["params"].items()}
            for r in ranks
        ]
        for rank in range(1, world):
            assert any(not torch.equal(ranks[rank]["params"][n], ranks[0]["params"][n]) for n in ranks[0]["params"])
            for n, x in consensus[0].items():
                assert torch.isfinite(x).all(), f"{variant} {n}"
                torch.testing.assert_close(
                    consensus[rank][n], x, rtol=1e-5, atol=1e-6, msg=f"{variant} {n} rank {rank}"
                )


def backend_of(controller: str) -> str:
    return "torch" if controller == TORCH else "horovod"


@pytest.mark.parametrize("world,controller", ADAM_PAIRS)
def test_adam_correction_matches_the_oracle(world, controller, shared):
    """Adam correction (AdamW, Adam with its L2 decay, AdamW under a GradScaler whose step
    one rank's overflow skips everywhere; with the residual in each rank's parameters or
    not) against the numpy reference (tests/oracle.py: ``AdamCorrected``,
    ``LocalAdamCorrected``), with a dense unit (conv.weight) and a parameter unused on some
    iterations, on every rank; ``average_models()`` against the mean of the oracle's models."""
    out = shared(world, controller)
    for variant in ADAM_VARIANTS:
        decoupled, skip = not variant.startswith("adam-l2"), AMP_OVERFLOW_STEP if variant.endswith("-amp") else -1
        local = "-local" in variant
        rule = oracle.LocalAdamCorrected if local else oracle.AdamCorrected
        reference = rule(world, ADAM["lr"], ADAM["betas"], ADAM["eps"], ADAM["weight_decay"], decoupled)
        model = models.make_model()
        start = {n: p.detach().numpy().ravel().copy() for n, p in model.named_parameters()}
        params = [dict(start) for _ in range(world)]  # each rank's (all alike unless local)
        k = {n: oracle.k_for(models.LAYER_DENSITIES.get(n, models.DENSITY), x.size) for n, x in start.items()}
        for step in range(STEPS):
            if step == skip:
                continue
            grads = []
            for rank in range(world):
                with torch.no_grad():
                    for n, p in model.named_parameters():
                        p.copy_(torch.from_numpy(params[rank][n]).view_as(p))
                raw = models.gradients(model, rank, step, sometimes=True)
                grads.append(
                    {n: (g.numpy().ravel() if g is not None else np.zeros_like(start[n])) for n, g in raw.items()}
                )
            params = (
                reference.step_workers(params, grads, k) if local else [reference.step(params[0], grads, k)] * world
            )
        for rank in range(world):
            result = torch.load(out / f"adam-{variant}.{rank}.pt")
            assert result["skipped"] == (1 if skip >= 0 else 0), variant
            for n, x in params[rank].items():
                np.testing.assert_allclose(
                    result["params"][n].numpy().ravel(), x, rtol=2e-5, atol=2e-6, err_msg=f"{variant} {n} rank {rank}"
                )
            for n, r in result["residuals"].items():
                np.testing.assert_allclose(
                    r.numpy(),
                    reference.residuals[rank][n],
                    rtol=2e-5,
                    atol=2e-6,
                    err_msg=f"{variant} eps {n} rank {rank}",
                )
            if local:
                assert any(not np.allclose(params[0][n], params[1][n]) for n in start), "the ranks' models differ"
                for n, x in oracle.LocalAdamCorrected.average(params).items():
                    np.testing.assert_allclose(
                        result["averaged"][n].numpy().ravel(), x, rtol=2e-5, atol=2e-6, err_msg=f"{variant} mean {n}"
                    )
                assert all(not r.any() for r in result["residuals_after"].values()), variant
