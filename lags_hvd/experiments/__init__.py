"""The experiment app: everything that trains, measures and reports, built on the library.

Nothing in ``lags_hvd`` proper imports from here. One module per tool:

* ``train``        the training CLI (``python -m lags_hvd.experiments.train``): data, model,
                   method, checkpoints, per-epoch metrics
* ``methods``      the method factory: dense Horovod, TopK-SGD, LAGS and its variants by name
* ``models``       the paper's models (ResNet-20/50, VGG-16, Inception-v4, LSTMs, small CNNs, a char GPT)
* ``emulation``    an emulated accelerator: the model's layers as timed waits, gradients from a pool
* ``data``         offline datasets (Fashion-MNIST, Shakespeare, synthetic)
* ``checkpoint``   atomic, rank-aware checkpoint files and safe loading
* ``bench_worker`` one timed run of every method in the same processes (under horovodrun)
* ``benchmark``    drives ``bench_worker`` over models, P and emulated links; tables and plots
* ``simulate``     the cluster simulator: extrapolates measured profiles to P workers
* ``convergence``  the multi-seed accuracy suite and its report
* ``bench_select`` selection kernels timed alone; ``bench_engine`` the engine's fixed and
                   per-entry costs and memory; ``soak`` a long run watching memory and state
* ``netprofile``   measures the alpha-beta network profile the planners use
* ``traffic``      bytes per worker of the two sparse aggregations at P = 2, 3, 4, 8

``scripts/`` holds thin entry points to these ``main()`` functions.
"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The source checkout: default home of ``data/``, ``docs/results`` and ``scripts/``."""
