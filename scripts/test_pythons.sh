#!/usr/bin/env bash
# The package on other Pythons, as a user's pip gives it (no Horovod, torch from PyPI): for each
# version given (default 3.12 3.13), a venv .venv-<version> from pyenv's interpreter, then
# `pip install -e .[test]`, then the tests that need no Horovod: the pure and single-process
# ones and the torchrun oracle (test_distributed.py; its Horovod launches skip). Idempotent: an existing venv is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSIONS=("${@:-3.12 3.13}")
read -r -a VERSIONS <<< "${VERSIONS[*]}"
TESTS=(tests/test_selection.py tests/test_sparse.py tests/test_residual.py tests/test_density.py
       tests/test_updates.py tests/test_planner.py tests/test_regions.py tests/test_torch_backend.py
       tests/test_package.py tests/test_distributed.py)
for version in "${VERSIONS[@]}"; do
  python="$(ls -d "${PYENV_ROOT:-$HOME/.pyenv}"/versions/"$version"*/bin/python3 2>/dev/null | sort -V | tail -1 || true)"
  [[ -x "$python" ]] || { echo "test_pythons: no Python $version under pyenv" >&2; exit 1; }
  venv=".venv-$version"
  [[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check -e ".[test]"
  echo "== Python $("$venv/bin/python" -c 'import sys, torch; print(sys.version.split()[0], "torch", torch.__version__)')"
  LAGS_TESTS_WITHOUT_HOROVOD=1 "$venv/bin/python" -m pytest -q -p no:cacheprovider -n 2 --dist loadscope --no-loadscope-reorder "${TESTS[@]}"
done
