"""One rank of a torchrun job (tests/test_exit.py) that fails as a user's job does: the rank that
raises lets the exception end the program, no ``os._exit``, so what ends the job is the
interpreter's own exit (torchrun stops the other workers only once one has ended).

  stall-before    rank 1 sleeps STALL seconds before iteration 2: rank 0 raises ExchangeTimeoutError
  stall-backward  rank 1 sleeps STALL seconds in a gradient hook of iteration 2's backward pass
  leaves          rank 1 returns (exit status 0) before iteration 2: rank 0 raises WorkerLostError
  join-stall      rank 0 calls lags_hvd.distributed.join() at iteration 2 (out of batches), rank 1
                  sleeps STALL seconds there: rank 0's join raises ExchangeTimeoutError
  clean           every rank trains STEPS iterations, then the usual end: a barrier, the process
                  group destroyed, the program's end

A rank that raises first writes ``<scenario>.<rank>.json``: the error's type and message, and
``at``, the wall-clock time it was raised, from which the test times the job's end.
"""

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import models  # noqa: E402

import lags_hvd.distributed as lags  # noqa: E402

torch.set_num_threads(1)
STEPS = 5
TIMEOUT = 3.0  # exchange_timeout, seconds
STALL = 600.0  # far beyond any bound of the test: only torchrun ends this sleep
STALL_STEP = 2


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--scenario", required=True)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = models.make_model()
    optimizer = lags.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=models.LR, momentum=models.MOMENTUM),
        model.named_parameters(),
        density=models.DENSITY,
        recipe="paper",
        exchange_timeout=TIMEOUT,
    )
    stalling = rank == 1 and "stall" in args.scenario
    stall_here = {"now": False}
    if stalling and args.scenario == "stall-backward":
        model.fc.weight.register_hook(lambda grad: time.sleep(STALL) if stall_here["now"] else None)
    try:
        for step in range(STEPS):
            if step == STALL_STEP and rank == 1:
                if args.scenario == "leaves":
                    return
                if args.scenario in ("stall-before", "join-stall"):
                    time.sleep(STALL)
                stall_here["now"] = stalling
            if step == STALL_STEP and rank == 0 and args.scenario == "join-stall":
                lags.join()  # out of batches
                break
            optimizer.zero_grad()
            models.loss_of(model, rank, step).backward()
            optimizer.step()
    except Exception as error:
        record = {"type": type(error).__name__, "message": str(error), "at": time.time()}
        with open(os.path.join(args.out, f"{args.scenario}.{rank}.json"), "w") as f:
            json.dump(record, f)
        raise
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
