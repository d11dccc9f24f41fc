#!/usr/bin/env bash
# Run a command inside a private network namespace whose loopback is rate-limited,
# emulating a slow cluster network on one machine. The namespace is always removed.
#
#   scripts/netns_run.sh --rate 100mbit -- horovodrun -np 2 -H localhost:2 --gloo python train.py
#
# Options: --rate R (tc rate, e.g. 400mbit; "none" = no shaping), --burst B (default
# 256kb), --latency L (tbf queue latency, default 100ms). Only loopback exists inside,
# so every worker talks over the shaped 127.0.0.1. Needs root (CAP_NET_ADMIN).
set -euo pipefail

rate=400mbit burst=256kb latency=100ms
while (($#)); do
  case $1 in
    --rate) rate=$2; shift 2 ;;
    --burst) burst=$2; shift 2 ;;
    --latency) latency=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "netns_run.sh: unknown option $1 (use -- before the command)" >&2; exit 2 ;;
  esac
done
(($#)) || { echo "usage: netns_run.sh [--rate R] [--burst B] [--latency L] -- COMMAND..." >&2; exit 2; }
if [[ $(id -u) -ne 0 ]]; then
  echo "netns_run.sh: creating a network namespace needs root (CAP_NET_ADMIN); run it as root or with sudo" >&2
  exit 77
fi
command -v ip >/dev/null && command -v tc >/dev/null \
  || { echo "netns_run.sh: needs 'ip' and 'tc' (Debian package iproute2; make install adds it)" >&2; exit 77; }

ns="lags-$$-$RANDOM"
cleanup() { ip netns del "$ns" 2>/dev/null || true; }
trap cleanup EXIT INT TERM
ip netns add "$ns"
ip -n "$ns" link set lo up
if [[ $rate != none ]]; then
  ip netns exec "$ns" tc qdisc add dev lo root tbf rate "$rate" burst "$burst" latency "$latency"
fi
echo "netns_run.sh: namespace $ns, loopback rate $rate" >&2
set +e
ip netns exec "$ns" "$@"
status=$?
set -e
exit $status
