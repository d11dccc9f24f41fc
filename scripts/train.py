"""Training CLI; the same as ``python -m lags_hvd.train`` (see lags_hvd/train.py)."""
from lags_hvd.train import main

if __name__ == "__main__":
    main()
