"""Measure this cluster's collectives and save the cost models for the adaptive planner.

    horovodrun -np 4 -H host1:2,host2:2 python -m lags_hvd.experiments.netprofile --out network.json

Every rank takes part; rank 0 prints the samples and the least-squares
``alpha + beta * bytes`` lines, and writes the JSON (the cost models through the
samples, the lines' slopes beyond them) that
``DistributedOptimizer(..., density="adaptive", network_profile="network.json")``
loads instead of measuring.
"""

import argparse

import horovod.torch as hvd

from ..collectives.horovod import HorovodCollectives
from ..profiling import DEFAULT_SIZES, profile_network, save_network_profile


def main(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m lags_hvd.experiments.netprofile", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--out", default="network.json", help="JSON file written by rank 0")
    parser.add_argument(
        "--sizes", default=",".join(map(str, DEFAULT_SIZES)), help="message sizes in bytes, comma separated"
    )
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]
    if len(set(sizes)) < 2 or min(sizes) < 1 or args.repeats < 1:
        parser.error("need at least two different positive sizes and repeats >= 1")

    hvd.init()
    model, samples = profile_network(HorovodCollectives(), sizes, args.repeats)
    if hvd.rank() == 0:
        print(f"{'bytes':>10} {'allgather ms':>13} {'allreduce ms':>13}   (P={model.world_size}, slowest rank)")
        for (nbytes, gather), (_, reduce) in zip(samples["allgather"], samples["allreduce"]):
            print(f"{nbytes:>10,d} {1e3 * gather:>13.3f} {1e3 * reduce:>13.3f}")
        for kind in ("allgather", "allreduce"):
            cost = getattr(model, kind)
            print(
                f"{kind}: alpha = {1e6 * cost.alpha:.1f} us, beta = {1e9 * cost.beta:.3f} ns/byte "
                f"({8 / max(cost.beta, 1e-30) / 1e9:.2f} Gbit/s)"
            )
        save_network_profile(model, args.out, samples)
        print(f"wrote {args.out}")
    hvd.shutdown()


if __name__ == "__main__":
    main()
