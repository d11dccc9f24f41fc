"""Bytes per worker of the two sparse aggregations, measured at P = 2, 3, 4 and 8.

Entry point of ``lags_hvd.experiments.traffic`` (``--help`` for its options).
"""

from lags_hvd.experiments.traffic import main

if __name__ == "__main__":
    main()
