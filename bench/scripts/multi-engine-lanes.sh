#!/usr/bin/env bash
# Transmit on the lanes, measured: 8 B write_lat and 8/16-queue-pair 64 KiB write_bw between
# soft:127.0.0.2 (client) and soft:127.0.0.1 (server), two processes, for 1 engine (the posting
# thread transmits), 2/4/8 engines (the lanes transmit), 4 engines with the lanes spinning
# (ERDMA_SOFT_SPIN_US) and 4 engines with the posting thread transmitting (ERDMA_SOFT_TX=inline).
# Prints "label q<Q> MB/s" and "label <write_lat row>" lines.
#
# For a machine the report scripts cannot reach (the GPU hosts: build here, send the binaries):
#   bench/scripts/multi-engine-lanes.sh DIR_WITH_write_bw_AND_write_lat [ROUNDS]
# Not run by scripts/bench-report (its name has a dot); its output goes in bench/results/.
set -euo pipefail
bin="${1:?directory holding release write_bw and write_lat}"
rounds="${2:-2}"
port=23000
lat() {
  local label=$1; shift; port=$((port + 1))
  env "$@" "$bin/write_lat" -d soft:127.0.0.1 -s 8 -n 20000 -p $port >/tmp/mel-s.log 2>&1 &
  local s=$!
  sleep 0.4
  env "$@" "$bin/write_lat" -d soft:127.0.0.2 -s 8 -n 20000 -p $port 127.0.0.1 >/tmp/mel-c.log 2>&1
  wait $s
  echo "$label $(grep -E '^ +8 ' /tmp/mel-c.log | tail -n1)"
}
bw() {
  local label=$1 q=$2; shift 2; port=$((port + 1))
  env "$@" "$bin/write_bw" -d soft:127.0.0.1 -q "$q" -s 65536 -D 3 -p $port >/tmp/mel-s.log 2>&1 &
  local s=$!
  sleep 0.4
  env "$@" "$bin/write_bw" -d soft:127.0.0.2 -q "$q" -s 65536 -D 3 -p $port 127.0.0.1 \
    >/tmp/mel-c.log 2>&1
  wait $s
  echo "$label q$q $(grep -E '^ +65536 ' /tmp/mel-c.log | tail -n1 | awk '{print $4}')"
}
for r in $(seq "$rounds"); do
  lat "r$r e1" ERDMA_SOFT_ENGINES=1
  lat "r$r e4" ERDMA_SOFT_ENGINES=4
  lat "r$r e4-spin50" ERDMA_SOFT_ENGINES=4 ERDMA_SOFT_SPIN_US=50
  lat "r$r e4-inline" ERDMA_SOFT_ENGINES=4 ERDMA_SOFT_TX=inline
  lat "r$r e2" ERDMA_SOFT_ENGINES=2
  for q in 8 16; do
    bw "r$r e1" "$q" ERDMA_SOFT_ENGINES=1
    bw "r$r e4" "$q" ERDMA_SOFT_ENGINES=4
    bw "r$r e4-spin20" "$q" ERDMA_SOFT_ENGINES=4 ERDMA_SOFT_SPIN_US=20
    bw "r$r e4-inline" "$q" ERDMA_SOFT_ENGINES=4 ERDMA_SOFT_TX=inline
    bw "r$r e4-pollrx" "$q" ERDMA_SOFT_ENGINES=4 ERDMA_SOFT_POLL_RX=1
    bw "r$r e8-spin20" "$q" ERDMA_SOFT_ENGINES=8 ERDMA_SOFT_SPIN_US=20
  done
done
