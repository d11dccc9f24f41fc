"""One rank of a torch.distributed job started by tests/test_torch_backend.py without torchrun
(RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment), so that a rank's end is
seen by the others rather than by a launcher that stops them. Writes ``<scenario>.<rank>.json``.

  collectives  every collective of TorchDistributedCollectives against its plain meaning:
               allgather of equal and unequal sizes and into a buffer, alltoall with and without the received
               sizes, allreduce (sum, average with pre- and postscale, max), broadcast, the
               object helpers; an alltoall polled but never waited does not start its payload
  die          rank 1 exits while rank 0 waits in an allgather: WorkerLostError
  stall        rank 1 sleeps past rank 0's timeout: ExchangeTimeoutError naming the exchange
  no-horovod   imports lags_hvd with Horovod's import refused, trains one LAGS step at P = 1
"""

import json
import os
import sys
import time

import torch

SLEEP = 10.0  # the stall scenario's sleep, seconds (rank 0 waits TIMEOUT)
TIMEOUT = 2.0


class RefuseHorovod:
    """An import hook under which ``import horovod`` fails, as where it is not installed."""

    def find_spec(self, name, path=None, target=None):
        if name == "horovod" or name.startswith("horovod."):
            raise ImportError(f"No module named {name!r} (refused by the test)")
        return None


def collectives_scenario(c) -> dict:
    from lags_hvd.collectives import allgather_object, broadcast_object

    rank, size = c.rank, c.size
    result = {}
    mine = torch.arange(3, dtype=torch.float32) + 10 * rank
    result["allgather"] = c.wait(c.allgather(mine, "equal"), "equal", TIMEOUT).tolist()
    sizes = [r + 1 for r in range(size)]
    rows = torch.full((rank + 1, 2), float(rank))
    result["allgather_sizes"] = c.wait(c.allgather(rows, "unequal", sizes=sizes), "unequal", TIMEOUT).tolist()
    inbox = torch.empty(3 * size)  # the caller's receive buffer, written over by each allgather into it
    result["allgather_into"] = []
    for turn, out in enumerate((inbox, inbox, torch.empty(1))):  # the last too small: allocated
        got = c.wait(c.allgather(mine + turn, f"into.{turn}", out=out), "into", TIMEOUT)
        result["allgather_into"].append([got.tolist(), got.data_ptr() == inbox.data_ptr()])
    splits = torch.tensor([r + rank for r in range(size)], dtype=torch.int32)  # rank sends r + rank rows to r
    data = torch.cat([torch.full((int(n), 1), 100.0 * rank + r) for r, n in enumerate(splits)])
    unknown = c.alltoall(data, splits, "a2a")
    assert not c.done(unknown)  # polled only: the payload waits for wait()
    got, got_splits = c.wait(unknown, "a2a", TIMEOUT)
    result["alltoall"] = [got.view(-1).tolist(), got_splits.tolist()]
    known = c.alltoall(data, splits, "a2a-known", received=[r + rank for r in range(size)])
    got, got_splits = c.wait(known, "a2a-known", TIMEOUT)
    result["alltoall_known"] = [got.view(-1).tolist(), got_splits.tolist()]
    summed = torch.tensor([1.0 + rank, 2.0])
    result["sum"] = c.wait(c.allreduce(summed, "sum"), "sum", TIMEOUT).tolist()
    averaged = torch.tensor([4.0 * (rank + 1)])
    reduced = c.wait(c.allreduce(averaged, "avg", "average", prescale=0.5, postscale=3.0), "avg", TIMEOUT)
    result["average"] = reduced.tolist()
    result["average_in_place"] = averaged.tolist()
    result["max"] = c.wait(c.allreduce(torch.tensor([float(rank)]), "max", "max"), "max", TIMEOUT).tolist()
    source = torch.tensor([7.0 + rank])
    result["broadcast"] = c.wait(c.broadcast(source, 1, "bcast"), "bcast", TIMEOUT).tolist()
    result["broadcast_source_kept"] = source.tolist()
    result["objects"] = allgather_object(c, {"rank": rank, "pad": "x" * (50 * rank)}, "objects")
    result["object"] = broadcast_object(c, {"from": rank}, 0, "object")
    return result


def main():
    out, scenario = sys.argv[1], sys.argv[2]
    rank = int(os.environ["RANK"])
    if scenario == "no-horovod":
        sys.meta_path.insert(0, RefuseHorovod())
    import torch.distributed as dist

    import lags_hvd
    import lags_hvd.distributed as lags
    from lags_hvd.collectives.torch_distributed import TorchDistributedCollectives

    dist.init_process_group("gloo")
    c = TorchDistributedCollectives()
    result, started = {}, time.monotonic()
    try:
        if scenario == "collectives":
            result = collectives_scenario(c)
        elif scenario == "die":
            if rank == 1:
                time.sleep(1.0)
                os._exit(0)
            c.wait(c.allgather(torch.ones(4), "lags.doomed"), "the exchange 'lags.doomed'", 60.0)
        elif scenario == "stall":
            if rank == 1:
                time.sleep(SLEEP)
            c.wait(c.allgather(torch.ones(4), "lags.late"), "the exchange 'lags.late'", TIMEOUT)
        elif scenario == "no-horovod":
            result["horovod_loaded"] = any(name.split(".")[0] == "horovod" for name in sys.modules)
            try:
                lags_hvd.DistributedOptimizer  # noqa: B018 (the attribute's error is the point)
            except ImportError as error:
                result["horovod_api"] = str(error)
            torch.manual_seed(0)
            model = torch.nn.Linear(8, 4)
            optimizer = lags.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), density=0.25, recipe="paper"
            )
            before = model.weight.detach().clone()
            model(torch.randn(2, 8)).square().sum().backward()
            optimizer.step()
            result["moved"] = int((model.weight.detach() != before).sum())
            result["k"] = dict(optimizer.lags_state.k)
    except Exception as error:
        result = {"error": {"type": type(error).__name__, "message": str(error)}}
    result["seconds"] = time.monotonic() - started
    with open(os.path.join(out, f"{scenario}.{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # no teardown: a peer may be gone


if __name__ == "__main__":
    main()
