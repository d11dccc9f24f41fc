"""What every rank must hold alike, through Horovod's documented patterns, on every door
(tests/workers/shared_state_worker.py, all scenarios in one launch per case):

* the hooks read the optimizer's live param groups, so a run whose optimizer state went
  through ``broadcast_optimizer_state`` or a ``load_state_dict`` round trip trains exactly
  as the run that did not (an lr schedule, momentum, betas and weight decay changed);
* after ``join()`` or a resume on rank 0 and the broadcasts, the state every rank must share
  (Adam's moments of the units sent whole) is shared: the ranks' consensus is one, and
  ``average_models()`` leaves the ranks identical, for Adam correction and momentum correction.
"""

import json

import numpy as np
import pytest
from launch import TORCH, horovodrun
from workers.shared_state_worker import RULES

CASES = [(2, "gloo"), (3, "mpi"), (2, TORCH)]  # every backend; P = 3 once (join, resume and averaging count the ranks)


@pytest.fixture(scope="module", params=CASES, ids=[f"P{w}-{c}" for w, c in CASES])
def ranks(request, tmp_path_factory):
    world, controller = request.param
    out = tmp_path_factory.mktemp(f"shared-{world}-{controller}")
    horovodrun(world, controller, "shared_state_worker.py", "--out", str(out), timeout=180)
    return [json.loads((out / f"shared_state.{r}.json").read_text()) for r in range(world)]


def assert_close(a: dict, b: dict, what: str, rtol=1e-6, atol=1e-7):
    assert a.keys() == b.keys(), what
    for name in a:
        np.testing.assert_allclose(np.array(a[name]), np.array(b[name]), rtol=rtol, atol=atol, err_msg=f"{what} {name}")


@pytest.mark.parametrize("rule", RULES)
def test_the_hooks_follow_the_live_param_groups_after_broadcast_and_load(ranks, rule):
    """Before the fix the hooks kept the groups of wrapping time: after the broadcast or the
    reload, the lr schedule never reached Adam correction's step (lr 0 from step 3 moved the
    parameters on), momentum correction ignored the new momentum and weight decay, and
    lr_scaled_residual the new lr."""
    for record in ranks:
        runs = record[f"groups-{rule}"]
        assert_close(runs["broadcast"], runs["as-built"], f"{rule} after broadcast_optimizer_state")
        assert_close(runs["reloaded"], runs["as-built"], f"{rule} after load_state_dict")


@pytest.mark.parametrize("pattern", ["join", "resume"])
@pytest.mark.parametrize("rule", ["adamw", "sgd"])
def test_shared_state_is_shared_after_join_and_resume_and_average_models_leaves_ranks_identical(ranks, pattern, rule):
    record = [r[f"{pattern}-{rule}"] for r in ranks]
    for rank, mine in enumerate(record[1:], start=1):
        together, averaged = mine["together"], mine["averaged"]
        assert_close(together["moments"], record[0]["together"]["moments"], f"rank {rank} Adam moments")
        assert_close(together["consensus"], record[0]["together"]["consensus"], f"rank {rank} consensus")
        assert averaged["params"] == record[0]["averaged"]["params"], f"rank {rank}: ranks differ after average_models"
        assert averaged["moments"] == record[0]["averaged"]["moments"]
    if rule == "adamw":
        assert record[0]["together"]["moments"], "the default recipe sends the 1-D parameters whole"
        assert record[0]["together"]["params"] != record[1]["together"]["params"], "local residuals differ"
