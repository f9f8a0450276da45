#!/usr/bin/env bash
# The drop-in's latency against the project's tools with the packets on the socket
# (ERDMA_SOFT_SAME_HOST=cma) and through the shared-memory rings (shm, the default),
# interleaved, two processes on soft0/soft1 (127.0.0.1/127.0.0.2), 8 B:
#
#   bench/scripts/dropin-latency-rings.sh BIN OUT
#
# BIN holds release send_lat and write_lat, Debian's ib_send_lat and ib_write_lat, and lib/
# with the drop-in libibverbs.so.1 (and, on a host that is not Debian 12, the Debian libraries
# perftest links: libmlx5.so.1, libefa.so.1, libibumad.so.3, libpci.so.3, libnl-3.so.200,
# libnl-route-3.so.200). Appends one line per run to OUT/dropin-latency-rings.txt: t_typical,
# t_avg, t_max in µs. ROUNDS (5), N (50000), MODES ("cma shm").
#
# `write_lat --perftest-loop` runs the Rust tool with perftest's WRITE loop (poll for each
# WRITE's completion, then watch memory alone) instead of its own (poll while it watches), so
# that ib_write_lat's gap splits into what the C layer costs and what the loop does.
set -u
B=$1 out=$2
port=36000
lat() {
  local label=$1 sd=$2 cd=$3
  shift 3
  port=$((port + 1))
  timeout 60 "$@" -d "$sd" -s 8 -n "${N:-50000}" -p $port >/tmp/dlr-s.log 2>&1 &
  local sp=$!
  sleep 0.4
  timeout 60 "$@" -d "$cd" -s 8 -n "${N:-50000}" -p $port 127.0.0.1 >/tmp/dlr-c.log 2>&1
  local rc=$?
  wait $sp
  echo "$label $(awk '$1 == 8 {print "typ", $5, "avg", $6, "max", $4; exit}' /tmp/dlr-c.log)" \
    "rc $rc" | tee -a "$out/dropin-latency-rings.txt"
}
export ERDMA_SOFT_DEVICES=127.0.0.1,127.0.0.2
{ nproc; uname -r; cat /proc/sys/kernel/yama/ptrace_scope; } | tee -a "$out/dropin-latency-rings.txt"
for r in $(seq "${ROUNDS:-5}"); do
  for m in ${MODES:-cma shm}; do
    export ERDMA_SOFT_SAME_HOST=$m
    lat "r$r $m ib_write_lat" soft0 soft1 env LD_LIBRARY_PATH="$B/lib" "$B/ib_write_lat"
    lat "r$r $m write_lat" soft:127.0.0.1 soft:127.0.0.2 "$B/write_lat"
    lat "r$r $m write_lat --perftest-loop" soft:127.0.0.1 soft:127.0.0.2 "$B/write_lat" \
      --perftest-loop
    lat "r$r $m ib_send_lat" soft0 soft1 env LD_LIBRARY_PATH="$B/lib" "$B/ib_send_lat"
    lat "r$r $m send_lat" soft:127.0.0.1 soft:127.0.0.2 "$B/send_lat"
  done
done
