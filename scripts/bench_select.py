"""Selection benchmark: torch.topk vs lags_hvd's selector vs one abs() pass, side by side.

Entry point of ``lags_hvd.experiments.bench_select`` (``--help`` for its options).
"""

from lags_hvd.experiments.bench_select import main

if __name__ == "__main__":
    main()
