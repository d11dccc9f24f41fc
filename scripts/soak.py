"""Soak test: many LAGS-SGD iterations on a small model; memory must stay flat.

Entry point of ``lags_hvd.experiments.soak`` (``--help`` for its options).
"""

from lags_hvd.experiments.soak import main

if __name__ == "__main__":
    main()
