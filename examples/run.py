"""Each example as a user launches it, and ``make examples-check``: every example trained for
the budget a new user tries (400 steps on 2 workers), its test accuracy beside plain DDP's
(``dense_ddp.py``, the same model, data, batches and learning rate) on the same seeds.

    python examples/run.py --steps 400 --seeds 0 --out docs/results/examples
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
# example -> (its launcher: "torchrun", "horovodrun" or "python" (Lightning starts its own ranks), extra args)
EXAMPLES = {
    "dense_ddp": ("torchrun", ()),
    "horovod_drop_in": ("horovodrun", ()),
    "torchrun_optimizer": ("torchrun", ()),
    "ddp_hook": ("torchrun", ()),
    "lightning_strategy": ("python", ()),
    "accelerate_hook": ("torchrun", ()),
    "accelerate_hook-accumulate4": ("torchrun", ("--accumulate", "4")),
    "adaptive_density": ("horovodrun", ()),
    "mixed_precision": ("horovodrun", ()),
    "checkpoint_rank0": ("horovodrun", ()),
    "uneven_inputs": ("horovodrun", ()),
}


def command(example: str, world: int = 2) -> list[str]:
    """The command line that starts ``example`` on ``world`` local workers."""
    launcher, extra = EXAMPLES[example]
    script = str(HERE / f"{example.split('-')[0]}.py")
    if launcher == "torchrun":
        return [*TORCHRUN, str(world), script, *extra]
    if launcher == "horovodrun":
        horovodrun = str(Path(sys.executable).with_name("horovodrun"))
        return [horovodrun, "-np", str(world), "-H", f"localhost:{world}", "--gloo", sys.executable, script, *extra]
    assert world == 2, "the Lightning example asks Lightning for 2 devices"
    return [sys.executable, script, *extra]


def environment() -> dict:
    """Loopback only, one thread per worker (two workers on a small machine)."""
    return dict(os.environ, GLOO_SOCKET_IFNAME="lo", HOROVOD_GLOO_IFACE="lo", OMP_NUM_THREADS="1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--examples", nargs="+", default=list(EXAMPLES), choices=list(EXAMPLES))
    parser.add_argument("--out", type=Path, default=Path("runs/examples"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    accuracy: dict[str, list[float]] = {}
    for seed in args.seeds:
        for example in args.examples:
            result = args.out / f"{example}.seed{seed}.json"
            if not result.exists():  # resumable: a finished run is kept
                run = [
                    *command(example),
                    "--steps",
                    str(args.steps),
                    "--seed",
                    str(seed),
                    "--out",
                    str(result.resolve()),
                ]
                # in the output folder: what an example writes (Lightning's logs) stays there
                subprocess.run(run, check=True, env=environment(), cwd=args.out, stdout=subprocess.DEVNULL)
            accuracy.setdefault(example, []).append(json.loads(result.read_text())["accuracy"])
    dense = statistics.mean(accuracy["dense_ddp"]) if "dense_ddp" in accuracy else None
    lines = [f"{'example':<30} {'accuracy (mean of seeds)':>25} {'vs dense (points)':>18}"]
    for example, values in accuracy.items():
        gap = "" if dense is None else f"{100 * (statistics.mean(values) - dense):+.2f}"
        lines.append(f"{example:<30} {100 * statistics.mean(values):>24.2f}% {gap:>18}")
    summary = "\n".join(lines)
    print(summary)
    (args.out / "summary.txt").write_text(f"{args.steps} steps, P = 2, seeds {args.seeds}\n{summary}\n")


if __name__ == "__main__":
    main()
