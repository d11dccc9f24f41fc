"""Train a model with dense S-SGD, TopK-SGD or LAGS-SGD on real data, on P workers.

Entry point of ``lags_hvd.experiments.train`` (``--help`` for its options).
"""

from lags_hvd.experiments.train import main

if __name__ == "__main__":
    main()
