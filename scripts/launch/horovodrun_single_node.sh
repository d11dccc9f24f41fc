#!/usr/bin/env bash
# One machine, NP workers (default: one per GPU if any, else 2), Gloo controller.
#   scripts/launch/horovodrun_single_node.sh [NP] [training arguments...]
set -euo pipefail
NP=${1:-$(nvidia-smi -L 2>/dev/null | wc -l | awk '{print ($1 > 0) ? $1 : 2}')}
shift || true
exec horovodrun -np "$NP" -H "localhost:$NP" --gloo \
  python -m lags_hvd.experiments.train "$@"
