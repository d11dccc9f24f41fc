#!/usr/bin/env bash
# The GPU path, checked where a CUDA GPU and a CUDA build of torch are present:
#   1. the device tests, on the CPU and on CUDA (tests/test_devices.py: one process, NCCL for
#      CUDA tensors; the optimizer, both Adam rules and the DDP hook against the numpy oracles,
#      host reads counted, backward under CUDA's sync debug mode set to errors), then two ranks
#      on the one GPU, their CUDA tensors over Gloo (tests/launch.py's "torch-cuda": the oracle
#      scenarios, reduce_scatter, both Adam rules, the default recipe with CUDA graphs, the DDP hook);
#   2. selection on the GPU against torch.topk (scripts/bench_select.py --device cuda);
#   3. the engine's cost inside the paper's models' iterations on the GPU, both recipes, with
#      and without the selections replayed from CUDA graphs (lags_hvd.experiments.device_timing).
# Figures go to $OUT (default runs/gpu-check). Without a GPU it says so and exits 0. Without
# Horovod (a CUDA machine with torch alone) the tests run over torch.distributed only.
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
# absent, not broken: a Horovod that is installed but fails to import fails the tests
if "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('horovod') is not None)"; then
  export LAGS_TESTS_WITHOUT_HOROVOD=1
fi
echo "== 1/3 device tests on CUDA"
tests=0
"$PYTHON" -m pytest -q -p no:cacheprovider -ra tests/test_devices.py || tests=$?
echo "== 1/3 (cont.) two ranks on the one GPU over Gloo: the oracles of both aggregations, both Adam rules, the DDP hook"
"$PYTHON" -m pytest -q -p no:cacheprovider -ra tests/test_distributed.py tests/test_ddp.py -k "torch-cuda or one_gpu" \
  || tests=$?
echo "== 2/3 selection on the GPU"
"$PYTHON" scripts/bench_select.py --device cuda --out "$OUT/select_cuda.json"
echo "== 3/3 selection and merge in the paper's models' iterations"
"$PYTHON" -m lags_hvd.experiments.device_timing --device cuda --model resnet20 vgg16 resnet50 lstm_ptb \
  --recipe paper default paper-graphs default-graphs --out "$OUT/device_timing_cuda.json"
if [ "$tests" -ne 0 ]; then
  echo "gpu_check: the device tests FAILED (pytest exit $tests); figures in $OUT"
  exit "$tests"
fi
echo "gpu_check: done; figures in $OUT (docs/gpu.md's table: device_timing --report on the timing file)"
