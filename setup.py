"""The C extension only: everything else about the package is in pyproject.toml (PEP 621)."""

from setuptools import Extension, setup

setup(
    # selection's candidate search and the streamed zeroing: plain C, no torch or numpy headers
    ext_modules=[Extension("lags_hvd._kernels", ["lags_hvd/_kernels.c"], extra_compile_args=["-O3"])],
)
