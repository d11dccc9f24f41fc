#!/usr/bin/env bash
# The GPU path, checked where a CUDA GPU and a CUDA build of torch are present:
#   1. the device-parametrized tests on CUDA (tests/test_devices.py: one process, NCCL for
#      CUDA tensors, the optimizer against the numpy oracle, host reads counted);
#   2. selection on the GPU against torch.topk (scripts/bench_select.py --device cuda);
#   3. selection and merge inside ResNet-20 iterations on the GPU (lags_hvd.experiments.device_timing).
# Figures go to $OUT (default runs/gpu-check). Without a GPU it says so and exits 0.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
OUT=${OUT:-runs/gpu-check}
if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$PYTHON" -c "import torch; print(f'gpu_check: no CUDA GPU usable by torch {torch.__version__} '
    f'(CUDA build: {torch.version.cuda or \"none\"}): nothing checked, the GPU path stays untested here')"
  exit 0
fi
mkdir -p "$OUT"
"$PYTHON" -c "import torch; print('gpu_check on', torch.cuda.get_device_name(0), 'torch', torch.__version__, 'CUDA', torch.version.cuda)"
echo "== 1/3 device tests on CUDA"
"$PYTHON" -m pytest -q -p no:cacheprovider tests/test_devices.py -k cuda
echo "== 2/3 selection on the GPU"
"$PYTHON" scripts/bench_select.py --device cuda --out "$OUT/select_cuda.json"
echo "== 3/3 selection and merge in ResNet-20 iterations"
"$PYTHON" -m lags_hvd.experiments.device_timing --device cuda --out "$OUT/device_timing_cuda.json"
echo "gpu_check: done; figures in $OUT"
