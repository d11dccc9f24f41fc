"""Side-by-side benchmarks of LAGS-SGD and its baselines on an emulated slow network.

Entry point of ``lags_hvd.experiments.benchmark`` (``--help`` for its options).
"""

from lags_hvd.experiments.benchmark import main

if __name__ == "__main__":
    main()
