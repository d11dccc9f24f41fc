#!/usr/bin/env bash
# One machine, NP workers (default: one per GPU if any, else 2), torch.distributed (Gloo).
#   scripts/launch/torchrun_single_node.sh [NP] [training arguments...]
set -euo pipefail
NP=${1:-$(nvidia-smi -L 2>/dev/null | wc -l | awk '{print ($1 > 0) ? $1 : 2}')}
shift || true
exec python -m torch.distributed.run --standalone --nproc-per-node "$NP" \
  -m lags_hvd.experiments.train --backend torch "$@"
