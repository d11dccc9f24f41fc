"""One side-by-side benchmark run: every method on one model, in the same P processes.

Entry point of ``lags_hvd.experiments.bench_worker`` (``--help`` for its options).
"""

from lags_hvd.experiments.bench_worker import main

if __name__ == "__main__":
    main()
