"""Engine cost in one process: the fixed cost per bucket and the passes over gradient memory.

Entry point of ``lags_hvd.experiments.bench_engine`` (``--help`` for its options).
"""

from lags_hvd.experiments.bench_engine import main

if __name__ == "__main__":
    main()
