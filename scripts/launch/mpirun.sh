#!/usr/bin/env bash
# Open MPI directly, without horovodrun. HOSTS as for mpirun -H (default: 2 local slots).
#   HOSTS=host1:4,host2:4 NP=8 scripts/launch/mpirun.sh [training arguments...]
set -euo pipefail
NP=${NP:-2}
HOSTS=${HOSTS:-localhost:$NP}
ROOT_FLAG=""; [[ $(id -u) -eq 0 ]] && ROOT_FLAG="--allow-run-as-root"
# -bind-to none / -map-by slot: let each worker use its cores and GPU freely.
# -x: environment Horovod and NCCL need on every host. For slow or shaped links,
# add: --mca pml ob1 --mca btl tcp,self (plain TCP, no shared memory).
exec mpirun $ROOT_FLAG -np "$NP" -H "$HOSTS" -bind-to none -map-by slot \
  -x PATH -x LD_LIBRARY_PATH -x PYTHONPATH -x NCCL_DEBUG=WARN -x HOROVOD_CYCLE_TIME \
  python -m lags_hvd.experiments.train "$@"
