#!/usr/bin/env bash
# Several machines, 4 workers each: HOSTS="host1:4,host2:4" (passwordless ssh between
# them, the same path to this project and its .venv on every host).
#   HOSTS=host1:4,host2:4 scripts/launch/horovodrun_multi_node.sh [training arguments...]
set -euo pipefail
: "${HOSTS:?set HOSTS, e.g. HOSTS=host1:4,host2:4}"
NP=$(tr ',' '\n' <<<"$HOSTS" | awk -F: '{n += ($2 == "" ? 1 : $2)} END {print n}')
# NETWORK_INTERFACE (e.g. eth0) pins Horovod's traffic to one interface when hosts have several.
exec horovodrun -np "$NP" -H "$HOSTS" ${NETWORK_INTERFACE:+--network-interface "$NETWORK_INTERFACE"} \
  python -m lags_hvd.experiments.train "$@"
