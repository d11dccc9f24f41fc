"""Horovod's own usage patterns, and ranks that disagree, stall or go out of step (P = 2).

Every case ends in the correct result or in a clear error on every rank that can
still tell, well within a bound far below a hang (tests/workers/hostile_worker.py)."""

import contextlib
import json

import models
import numpy as np
import oracle
import pytest
import torch
from launch import TORCH, SharedLaunches, horovodrun
from workers.hostile_worker import JOIN_BATCHES, RESUME_STEPS, STALL, TIMEOUT

BOUND = 120  # seconds; every scenario here ends in under 30


SHARED: dict[tuple[int, str], list[str]] = {
    (2, "gloo"): [
        *("density-mismatch", "clip-mismatch", "bad-option", "groups-differ"),  # refused alike: goes on
        *("lr-differs", "scaler-differs", "lr-one-rank", "lr-one-rank-broadcast", "unfreeze", "freeze-one"),
        *("resume-lags", "resume-local", "fresh-horovod", "bf16-dense", "sparse-embedding"),
        *("lr-differs-broadcast", "empty-batch", "join", "usage"),
        *("resume-every", "resume-every-broadcast", "resume-every-rank0", "resume-gathered"),
    ],
    (2, "mpi"): ["broadcast-object", "resume-lags"],
    (2, TORCH): [
        *("density-mismatch", "bad-option", "groups-differ", "lr-one-rank", "lr-one-rank-broadcast"),
        *("resume-lags", "resume-local", "resume-every-rank0", "resume-gathered"),
    ],
    (3, "gloo"): ["join-rs"],
    (3, "mpi"): ["join"],
    (3, TORCH): ["join"],
}
"""(P, controller) -> the scenarios that end cleanly or are refused alike on every rank (the
worker's ``REFUSED_ALIKE``), run in order in one launch: a launch costs seconds of start-up
on two cores, most scenarios a fraction of one. The others are ``FORKED``."""


def _records(folder, scenario, world):
    return [
        json.loads((folder / f"{scenario}.{r}.json").read_text())
        if (folder / f"{scenario}.{r}.json").exists()
        else None
        for r in range(world)
    ]


FORKED: dict[str, list[str]] = {
    "gloo": [
        *("resume-horovod", "process-set-two", "process-set-one", "step-twice", "skip-iteration", "stall"),
        *("dies-early", "dense-one-rank", "join-stall", "average-one-rank", "freeze-one-late"),
    ],
    TORCH: [
        *("process-set-one", "step-twice", "stall", "dies-early", "average-one-rank", "two-optimizers-unused"),
        *("broadcast-outside-group", "freeze-one-late"),
    ],
}
"""controller -> the scenarios at P = 2 that end a rank, leave the ranks out of step or define
their own process sets: each runs in a child forked for it alone, all in one launch (the
worker's ``--fork``). mpirun's workers cannot start MPI again: there each has a launch of its own."""


@pytest.fixture(scope="module")
def alone(tmp_path_factory):
    """``alone(scenario, controller, fails)``: each rank's record of ``scenario`` run as a launch
    of it alone: forked in the one launch of ``FORKED[controller]``, else in a launch of its
    own. ``fails``: that launch must fail (a rank exits non-zero), else every rank exits 0. A
    rank that failed without its record (a child that raises writes one) fails the test with
    the workers' output."""
    launches = SharedLaunches(tmp_path_factory)

    def records(scenario: str, controller: str = "gloo", fails: bool = False):
        if controller not in FORKED:
            folder = tmp_path_factory.mktemp(scenario)
            with pytest.raises(AssertionError, match="workers failed") if fails else contextlib.nullcontext():
                horovodrun(
                    2, controller, "hostile_worker.py", "--out", str(folder), "--scenarios", scenario, timeout=BOUND
                )
            return _records(folder, scenario, 2)
        scenarios = FORKED[controller]
        assert scenario in scenarios, f"{scenario} is not in FORKED[{controller!r}]"
        timeout = 60 + 30 * len(scenarios)
        folder, failure = launches.run(2, controller, "hostile_worker.py", scenarios, "--fork", timeout=timeout)
        assert failure is None, failure
        statuses = [int((folder / f"{scenario}.{rank}.exit").read_text()) for rank in range(2)]
        assert any(statuses) if fails else not any(statuses), f"{scenario}: exit statuses {statuses}"
        ranks = _records(folder, scenario, 2)
        if unrecorded := [r for r, (rank, status) in enumerate(zip(ranks, statuses)) if rank is None and status]:
            output = (folder / SharedLaunches.OUTPUT).read_text()  # killed at its bound (-9), a signal, ...
            raise AssertionError(f"{scenario}: ranks {unrecorded} failed with no record: {statuses}\n{output[-6000:]}")
        return ranks

    return records


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    """``shared(scenario, controller, world)``: each rank's record of ``scenario`` from the one
    launch of ``SHARED[(world, controller)]``, run on first use. A launch that failed fails
    the tests of the scenarios it did not finish cleanly, with its output."""
    launches = SharedLaunches(tmp_path_factory)

    def records(scenario: str, controller: str = "gloo", world: int = 2):
        scenarios = SHARED[(world, controller)]
        assert scenario in scenarios, f"{scenario} is not in SHARED[{(world, controller)}]"
        timeout = 2 * BOUND + 60 * len(scenarios)
        folder, failure = launches.run(world, controller, "hostile_worker.py", scenarios, timeout=timeout)
        ranks = _records(folder, scenario, world)
        if failure and any(rank is None or rank["error"] for rank in ranks):
            raise AssertionError(f"{scenario}: {ranks}\n{failure}")
        return ranks

    return records


@pytest.mark.parametrize("controller", ["gloo", "mpi", TORCH])
def test_resume_on_rank_0_then_lags_broadcast_trains_in_step(controller, shared):
    """Horovod's pattern: rank 0 loads, parameters and optimizer state are broadcast. The
    other ranks initialise their state without exchanging and adopt rank 0's iteration."""
    ranks = shared("resume-lags", controller)
    for rank in ranks:
        assert rank["error"] is None
        assert rank["iteration"] == 6  # rank 0's 3 loaded steps + 3 together
        assert rank["params"] == ranks[0]["params"]
        assert rank["momentum"] and all(n == 1 for n in rank["momentum"])  # SGD momentum buffers


@pytest.mark.parametrize("controller", ["gloo", TORCH])
def test_resume_on_rank_0_then_lags_broadcast_puts_local_residual_models_in_step(controller, shared):
    """Under local_residual each rank's parameters hold its own residual; after Horovod's
    resume pattern the broadcast parameters hold rank 0's, so broadcast_optimizer_state
    averages the models: every rank the same parameters and no residual, and 3 steps later
    the ranks' parameters differ again while the consensus they hold (parameters plus
    residual) is one and the same."""
    ranks = shared("resume-local", controller)
    assert all(rank["error"] is None and rank["iteration"] == 6 for rank in ranks), ranks
    assert all(rank["after broadcast"]["residuals zero"] for rank in ranks)
    assert ranks[0]["after broadcast"]["params"] == ranks[1]["after broadcast"]["params"]
    assert ranks[0]["params"] != ranks[1]["params"]
    for name, value in ranks[0]["consensus"].items():
        np.testing.assert_allclose(ranks[1]["consensus"][name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_resume_on_rank_0_with_horovods_broadcast_fails_clearly_on_every_rank(alone):
    """Horovod's own function cannot share the LAGS iteration: no hang, the step check names it."""
    ranks = alone("resume-horovod", fails=True)
    for rank in ranks:
        assert rank["error"]["type"] == "OutOfStepError", rank
        assert "rank 0 is at iteration 3, rank 1 at iteration 0" in rank["error"]["message"]
        assert "lags_hvd.broadcast_optimizer_state" in rank["error"]["message"]


def test_fresh_start_with_horovods_broadcast_optimizer_state(shared):
    ranks = shared("fresh-horovod")
    assert ranks[0]["error"] is None and ranks[1]["error"] is None
    assert ranks[0]["iteration"] == ranks[1]["iteration"] == 3
    assert ranks[0]["params"] == ranks[1]["params"]


@pytest.mark.parametrize(
    "scenario,controller", [("process-set-two", "gloo"), ("process-set-one", "gloo"), ("process-set-one", TORCH)]
)
def test_a_rank_outside_the_process_set_steps_locally(scenario, controller, alone):
    """As with Horovod: the non-member's optimizer is its wrapped optimizer on local gradients
    (on torch.distributed: a rank outside the optimizer's process group)."""
    member, outsider = alone(scenario, controller)
    assert member["error"] is None and outsider["error"] is None
    assert outsider["params"] == outsider["local"]  # bit for bit a plain local SGD
    assert member["params"] != member["local"]  # the member's went through LAGS


@pytest.mark.parametrize("controller", ["gloo", TORCH])
def test_different_densities_are_refused_on_every_rank(controller, shared):
    ranks = shared("density-mismatch", controller)
    assert ranks[0]["error"] == ranks[1]["error"]
    assert ranks[0]["error"]["type"] == "RanksDisagreeError"
    assert "ranks disagree on options['density']: 0.0016 vs 0.003" in ranks[0]["error"]["message"]
    assert "before any exchange" in ranks[0]["error"]["message"]


def test_a_clip_on_one_rank_only_is_refused_on_every_rank(shared):
    """max_grad_norm changes the update: a rank that clips beside one that does not would
    train different models from the same merged gradient."""
    ranks = shared("clip-mismatch")
    assert ranks[0]["error"] == ranks[1]["error"]
    assert ranks[0]["error"]["type"] == "RanksDisagreeError"
    assert "ranks disagree on options['max_grad_norm']: 0.25 vs None" in ranks[0]["error"]["message"]


@pytest.mark.parametrize("controller", ["gloo", TORCH])
def test_a_bad_option_on_one_rank_gives_every_rank_a_clear_error(controller, shared):
    bad_free, bad = shared("bad-option", controller)
    assert bad["error"]["type"] == "ValueError" and "density must be a number in (0, 1]" in bad["error"]["message"]
    assert bad_free["error"]["type"] == "RanksDisagreeError"
    assert "rank 1 refused" in bad_free["error"]["message"] and "density must be" in bad_free["error"]["message"]


@pytest.mark.parametrize("controller", ["gloo", "mpi", TORCH])
def test_a_rank_that_steps_twice_is_named_on_every_rank(controller, alone):
    ranks = alone("step-twice", controller, fails=True)
    for rank in ranks:
        assert rank is not None, "a rank ended without its record"
        assert rank["error"]["type"] == "OutOfStepError", rank
        assert "rank 0 reached step() or synchronize() with no backward pass" in rank["error"]["message"]
        assert "non-zero gradients" in rank["error"]["message"]
        assert "rank 1 after one" in rank["error"]["message"]
        assert rank["seconds"] < 60


def test_a_rank_that_skips_an_iteration_leaves_the_other_waiting_with_a_bounded_error(alone):
    """The step counts stay aligned until rank 1 runs out of steps; rank 0's last exchange
    then ends after exchange_timeout instead of waiting forever."""
    ranks = alone("skip-iteration", fails=True)
    assert ranks[0]["error"]["type"] == "ExchangeTimeoutError"
    assert ranks[0]["seconds"] < 60


@pytest.mark.parametrize("controller", ["gloo", TORCH])
def test_a_stalled_peer_ends_the_wait_with_a_named_exchange(controller, alone):
    """Rank 1 sleeps longer than exchange_timeout: rank 0 stops after the timeout, naming the
    exchange and the ranks that may be missing; rank 1, waking, finds rank 0 gone and says so
    (forked, no launcher ends it first)."""
    ranks = alone("stall", controller, fails=True)
    waiting = ranks[0]["error"]
    assert waiting["type"] == "ExchangeTimeoutError"
    assert f"waited {TIMEOUT:g} s on rank 0" in waiting["message"] and "lags." in waiting["message"]
    assert "one or more of ranks [1]" in waiting["message"]
    assert ranks[0]["seconds"] < STALL
    assert ranks[1] is not None and ranks[1]["error"]["type"] in ("WorkerLostError", "ExchangeTimeoutError"), ranks


@pytest.mark.parametrize("scenario,who", [("unfreeze", 0), ("freeze-one", 1)])
def test_changing_requires_grad_after_wrapping_is_an_error_on_every_rank(scenario, who, shared):
    ranks = shared(scenario)
    for rank in ranks:
        assert rank["error"]["type"] == "OutOfStepError"
        assert f"rank {who}: parameter 'shift' changed requires_grad" in rank["error"]["message"]


@pytest.mark.parametrize("controller", ["gloo", TORCH])
def test_a_rank_that_lost_its_peer_after_the_step_check_names_the_checks_cause(controller, alone):
    """Rank 1 alone freezes a parameter; rank 0 is still in backward when rank 1 reads the step
    check, raises and leaves, so rank 0's next exchange finds the peer gone. Rank 0 raises the
    check's verdict, which had arrived, as rank 1 did (before, under Horovod: only
    WorkerLostError; under torch.distributed the lost exchange fails only when waited for, after
    the check, so rank 0 reads the check first)."""
    ranks = alone("freeze-one-late", controller, fails=True)
    for rank in ranks:
        assert rank["error"]["type"] == "OutOfStepError", rank["error"]
        assert "rank 1: parameter 'shift' changed requires_grad" in rank["error"]["message"]


@pytest.mark.parametrize("controller", ["gloo", TORCH])
def test_a_peer_dead_before_construction_raises_worker_lost(controller, alone):
    ranks = alone("dies-early", controller, fails=True)
    assert ranks[0]["error"]["type"] == "WorkerLostError"
    assert "lags.settings" in ranks[0]["error"]["message"]


def test_bfloat16_parameters_at_density_one(shared):
    ranks = shared("bf16-dense")
    assert ranks[0]["error"] is None and ranks[0]["moved"]
    assert ranks[0]["params"] == ranks[1]["params"]


def test_sparse_embedding_gradients_are_exchanged_like_dense_ones(shared):
    """nn.Embedding(sparse=True) trains exactly as with dense gradients and gets its
    gradient back as torch.sparse (as Horovod hands it to e.g. SparseAdam)."""
    ranks = shared("sparse-embedding")
    for rank in ranks:
        assert rank["error"] is None
        assert rank["sparse"] == rank["dense"] and rank["grad_is_sparse"]
    assert ranks[0]["sparse"] == ranks[1]["sparse"]


def test_a_different_learning_rate_on_one_rank_is_named_at_the_first_step(shared):
    """Hyper-parameters may differ at construction (Horovod's pattern aligns them with
    broadcast_optimizer_state); left different, the first step check names them."""
    ranks = shared("lr-differs")
    for rank in ranks:
        assert rank["error"]["type"] == "OutOfStepError"
        assert "hyper-parameters differ between rank 0 and rank 1 at iteration 0" in rank["error"]["message"]


def test_learning_rates_aligned_by_broadcast_optimizer_state_train_in_step(shared):
    ranks = shared("lr-differs-broadcast")
    for rank in ranks:
        assert rank["error"] is None and rank["lr"] == 0.1
    assert ranks[0]["params"] == ranks[1]["params"]


def test_grad_scalers_that_scale_differently_are_named_on_every_rank(shared):
    ranks = shared("scaler-differs")
    for rank in ranks:
        assert rank["error"]["type"] == "OutOfStepError"
        assert "1024 on rank 0, 65536 on rank 1" in rank["error"]["message"]


def test_a_rank_with_an_empty_batch_exchanges_zeros_as_with_horovod(shared):
    """No backward pass on rank 1 at one step (zero_grad, then step): its gradients are zero,
    which is a legitimate contribution; both ranks go on, identical."""
    ranks = shared("empty-batch")
    assert ranks[0]["error"] is None and ranks[1]["error"] is None
    assert ranks[0]["params"] == ranks[1]["params"]


def test_a_unit_planned_dense_on_one_rank_only_is_named_at_once(alone):
    """The ranks then start exchanges of different names; the step check comes first, so the
    error names the plans instead of waiting for exchange_timeout."""
    ranks = alone("dense-one-rank", fails=True)
    for rank in ranks:
        assert rank["error"]["type"] == "OutOfStepError" and "plans diverged" in rank["error"]["message"]
        assert rank["seconds"] < 30


def joined_reference(world: int):
    """The per-layer allgather of tests/workers/hostile_worker.py's ``uneven`` in numpy: at
    each step the ranks with batches left send their top k, the joined ones nothing, and
    the sum is divided by P = ``world``. Returns each rank's parameters when it joined
    and its residuals."""
    model = models.make_model()
    params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    eps = [{n: np.zeros(v.size, np.float32) for n, v in params.items()} for _ in range(world)]
    sgd, at_join = oracle.SGDMomentum(models.LR, models.MOMENTUM), {}
    batches = JOIN_BATCHES[:world]
    for step in range(max(batches)):
        training = [rank for rank in range(world) if step < batches[rank]]
        grads = {}
        for rank in training:
            with torch.no_grad():
                for n, p in model.named_parameters():
                    p.copy_(torch.from_numpy(params[n]))
            grads[rank] = models.gradients(model, rank, step)
        for n in params:
            accs = [
                eps[rank][n] + (grads[rank][n].numpy().ravel() if rank in grads and grads[rank][n] is not None else 0)
                if rank in training
                else np.zeros_like(eps[rank][n])
                for rank in range(world)
            ]  # a joined rank's zeros are sent as nothing
            merged, residuals = oracle.lags_round(accs, oracle.k_for(models.DENSITY, params[n].size))
            for rank in training:
                eps[rank][n] = residuals[rank]
            params[n] = sgd.step(n, params[n], merged.reshape(params[n].shape))
        for rank in range(world):
            if step + 1 == batches[rank]:
                at_join[rank] = {n: v.copy() for n, v in params.items()}
    return at_join, eps


@pytest.mark.parametrize("world,controller", [(2, "gloo"), (3, "mpi"), (3, TORCH)])
def test_uneven_inputs_with_join_match_the_oracle_and_end_in_step(world, controller, shared):
    """Horovod's pattern for uneven inputs: each rank trains its own number of batches, then
    hvd.join(); the others' iterations average over all P ranks with the joined ones
    contributing nothing (numpy reference), every rank learns who joined last, and after
    sharing that rank's model and optimizer state the ranks train on in step."""
    ranks = shared("join", controller, world)
    at_join, eps = joined_reference(world)
    last = int(np.argmax(JOIN_BATCHES[:world]))
    for rank, record in enumerate(ranks):
        assert record["error"] is None and record["last"] == last
        assert record["iteration_at_join"] == JOIN_BATCHES[rank]
        for name, expected in at_join[rank].items():
            np.testing.assert_allclose(
                np.array(record["params_at_join"][name]),
                expected.ravel(),
                rtol=2e-5,
                atol=2e-6,
                err_msg=f"rank {rank} parameter {name}",
            )
        assert sorted(record["residuals"]) == sorted(eps[rank])
        for name, residual in record["residuals"].items():
            np.testing.assert_allclose(
                np.array(residual), eps[rank][name], rtol=2e-5, atol=2e-6, err_msg=f"rank {rank} residual {name}"
            )
        assert record["params"] == ranks[0]["params"]  # one more step together: in step
        assert record["iteration"] == max(JOIN_BATCHES[:world]) + 1


def test_uneven_inputs_with_join_under_reduce_scatter(shared):
    """The joined ranks still own their regions: they reduce and select what the others send."""
    ranks = shared("join-rs", world=3)
    for record in ranks:
        assert record["error"] is None and record["last"] == 1
        assert record["params"] == ranks[0]["params"] and record["iteration"] == max(JOIN_BATCHES) + 1
    assert ranks[1]["params_at_join"] != ranks[0]["params_at_join"]  # rank 1 trained on alone


def test_a_rank_that_neither_trains_nor_joins_ends_the_join_in_bounded_time(alone):
    ranks = alone("join-stall", fails=True)
    assert ranks[0]["error"]["type"] == "ExchangeTimeoutError"
    assert "lags_hvd.join() on rank 0 waited" in ranks[0]["error"]["message"]
    assert ranks[0]["seconds"] < STALL


@pytest.mark.parametrize("scenario", ["lr-one-rank", "lr-one-rank-broadcast"])
@pytest.mark.parametrize("controller", ["gloo", TORCH])
def test_a_learning_rate_changed_on_one_rank_is_named_on_every_rank(controller, scenario, shared):
    """Also after broadcast_optimizer_state, whose load_state_dict replaces the param groups
    (the step check once kept reading the groups of wrapping time and saw no change)."""
    ranks = shared(scenario, controller)
    for rank in ranks:
        assert rank["error"]["type"] == "OutOfStepError"
        assert "hyper-parameters differ between rank 0 and rank 1 at iteration 2" in rank["error"]["message"]


def test_closure_maximize_and_sparse_as_dense_on_two_ranks(shared):
    """step(closure) exchanges the closure's gradients (the same training as backward + step
    and the same on both ranks); SGD(maximize=True, weight_decay) under the default recipe
    leaves momentum correction off and follows torch's SGD bit for bit; SparseAdam with
    sparse_as_dense=True gets its gradients back sparse (Horovod's test_sparse_embeddings)."""
    ranks = shared("usage")
    for rank in ranks:
        assert rank["error"] is None
        assert rank["closure"] == rank["plain"] == ranks[0]["closure"]
        assert rank["maximize"] == rank["torch_maximize"] and not rank["momentum_correction"]
        assert rank["sparse_grad"] and rank["sparse_adam"] == ranks[0]["sparse_adam"]
    assert ranks[0]["losses"] != ranks[1]["losses"]  # each rank's closure, on its own batch


@pytest.mark.parametrize(
    "how,controller", [("load", "gloo"), ("broadcast", "gloo"), ("rank0", "gloo"), ("rank0", TORCH)]
)
def test_resume_from_every_iteration_continues_exactly(how, controller, shared):
    """The default recipe with a density warm-up of 3 and the bucket plan after 2 more
    iterations: the state saved before each step (before, during and after the warm-up and
    the plan), resumed in a fresh model and optimizer, continues bit for bit as the run
    that was not interrupted, with its buckets planned at the same iteration. Loaded on rank 0
    only, rank 1's residuals start from zero: then the plan and the ranks' agreement hold."""
    scenario = "resume-every" + ("" if how == "load" else f"-{how}")
    ranks = shared(scenario, controller)
    for rank in ranks:
        assert rank["error"] is None and rank["plan_iteration"] == 5
        assert sorted(map(int, rank["resumed"])) == list(range(1, RESUME_STEPS))
        for start, resumed in rank["resumed"].items():
            assert resumed["planned at load"] == (int(start) >= 5), (start, resumed)
            assert resumed["buckets"], (start, resumed)
            if how == "rank0":
                assert resumed["params"] == ranks[0]["resumed"][start]["params"], start
            else:
                assert resumed["params"] and resumed["residuals"], (start, resumed)


@pytest.mark.parametrize("controller", ["gloo", TORCH])
def test_average_models_on_one_rank_only_is_named_on_every_rank(controller, alone):
    """Before, rank 0's allreduce met rank 1's next step check: a Gloo size abort on one rank."""
    ranks = alone("average-one-rank", controller, fails=True)
    for rank in ranks:
        assert rank["error"]["type"] == "OutOfStepError", rank
        assert "average_models() is collective: ranks [0] called it, ranks [1] did not" in rank["error"]["message"]


@pytest.mark.parametrize("controller", ["gloo", TORCH])
def test_param_groups_holding_other_parameters_on_one_rank_are_named_on_every_rank(controller, shared):
    """The same hyper-parameters, the groups' parameters swapped on rank 1: once trained silently."""
    ranks = shared("groups-differ", controller)
    for rank in ranks:
        assert rank["error"]["type"] == "RanksDisagreeError", rank
        message = rank["error"]["message"]
        assert "param groups" in message and "'parameters': ['conv.weight', 'conv.bias']" in message


def test_two_optimizers_whose_checks_cross_are_named_not_blamed_on_the_density_plan(alone):
    """torch.distributed matches collectives by order: one backward feeding two optimizers with a
    layer unused on rank 1 starts their checks in different orders on the two ranks. Every rank
    names the crossing (it was once "their density plans diverged"), and no crossed exchange is
    merged: the rank whose own check met the other optimizer's at once, the other, whose own
    check lost its partner when that rank stopped, from its other optimizer's arrived check."""
    ranks = alone("two-optimizers-unused", TORCH, fails=True)
    for rank in ranks:
        assert rank["error"]["type"] == "OutOfStepError" and "met another optimizer's" in rank["error"]["message"]


def test_broadcast_over_a_group_without_this_rank_or_the_root_is_refused_clearly(alone):
    """Before: AttributeError: 'NoneType' object has no attribute 'is_completed'."""
    ranks = alone("broadcast-outside-group", TORCH, fails=True)
    assert ranks[0]["error"] == {"type": "ValueError", "message": ranks[0]["error"]["message"]}
    assert "root_rank 1 is not in the process group" in ranks[0]["error"]["message"]
    assert "rank 1 is not in the process group given" in ranks[1]["error"]["message"]


@pytest.mark.parametrize("controller", ["gloo", TORCH])
def test_saved_on_rank_0_and_loaded_everywhere_resumes_every_rank_exactly(controller, shared):
    """gathered_state_dict() on every rank, the file written by rank 0 alone, loaded by every
    rank: the same parameters and residuals bit for bit as the run that went on, on every rank,
    with SGD under the default recipe and with AdamW under the local residual (whose ranks'
    parameters differ: each rank gets its own back, not rank 0's)."""
    ranks = shared("resume-gathered", controller)
    for rank in ranks:
        assert rank["error"] is None
        for label in ("sgd", "adamw-local"):
            assert rank[label]["params"] and rank[label]["residuals"], (label, rank[label])
            assert rank[label]["residuals nonzero"] and rank[label]["iteration"] == 6, label
    assert ranks[0]["sgd"]["own params"] == ranks[1]["sgd"]["own params"]
    assert ranks[0]["adamw-local"]["own params"] != ranks[1]["adamw-local"]["own params"]


def test_broadcast_object_of_a_value_and_none_reaches_every_rank(shared):
    """Horovod names an unnamed broadcast_object after the object's type, so rank 0's str and the
    others' None met under different names and every rank waited forever."""
    assert [rank["received"] for rank in shared("broadcast-object", "mpi")] == ["from rank 0"] * 2
