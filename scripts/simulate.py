"""Predict dense S-SGD, TopK-SGD and LAGS-SGD iteration times at cluster scale.

Entry point of ``lags_hvd.experiments.simulate`` (``--help`` for its options).
"""

from lags_hvd.experiments.simulate import main

if __name__ == "__main__":
    main()
