from pathlib import Path

from setuptools import Extension, find_packages, setup

ROOT = Path(__file__).parent
version = {}
exec((ROOT / "lags_hvd" / "version.py").read_text(), version)

setup(
    name="lags_hvd",
    version=version["__version__"],
    description="LAGS-SGD: layer-wise adaptive gradient sparsification as a Horovod DistributedOptimizer",
    long_description=(ROOT / "README.md").read_text() if (ROOT / "README.md").exists() else "",
    long_description_content_type="text/markdown",
    packages=find_packages(include=["lags_hvd", "lags_hvd.*"]),
    # selection's candidate search: one compiled pass (plain C, no torch or numpy headers)
    ext_modules=[Extension("lags_hvd._kernels", ["lags_hvd/_kernels.c"], extra_compile_args=["-O3"])],
    python_requires=">=3.11,<3.12",
    install_requires=[
        # Pinned: a looser torch requirement resolves to a multi-GB CUDA build, and
        # Horovod below is compiled against exactly this version.
        "torch==2.13.0",
        # Built from the patched sdist by scripts/install.sh (PyPI has no build for torch 2.13).
        "horovod==0.28.1",
        "numpy>=1.24",
        "mpi4py>=3.1",
        "tqdm>=4.64",
        "matplotlib>=3.7",
    ],
    extras_require={"test": ["pytest>=7.4", "pytest-timeout>=2.1", "hypothesis>=6.80"]},
)
