"""Convergence evidence: dense, TopK-SGD and LAGS-SGD on real data, several seeds.

Entry point of ``lags_hvd.experiments.convergence`` (``--help`` for its options).
"""

from lags_hvd.experiments.convergence import main

if __name__ == "__main__":
    main()
