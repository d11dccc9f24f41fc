"""Measure this cluster's collectives and save the cost models for the adaptive planner.

Entry point of ``lags_hvd.experiments.netprofile`` (``--help`` for its options).
"""

from lags_hvd.experiments.netprofile import main

if __name__ == "__main__":
    main()
