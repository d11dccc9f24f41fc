#!/usr/bin/env bash
# One machine, NP workers (default: one per GPU if any, else 2), torch.distributed (Gloo).
#   scripts/launch/torchrun_single_node.sh [NP] [training arguments...]
set -euo pipefail
GPUS=$( (nvidia-smi -L 2>/dev/null || true) | grep -c "^GPU" || true)   # 0 without nvidia-smi
NP=${1:-$(( GPUS > 0 ? GPUS : 2 ))}
shift || true
exec python -m torch.distributed.run --standalone --nproc-per-node "$NP" \
  -m lags_hvd.experiments.train --backend torch "$@"
