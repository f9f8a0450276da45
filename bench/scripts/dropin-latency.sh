#!/usr/bin/env bash
# The drop-in's latency against the project's tools, interleaved, with two builds of the
# drop-in side by side (for an A/B of a change):
#
#   bench/scripts/dropin-latency.sh BIN OLD NEW OUT
#
# BIN holds release send_lat, write_lat and Debian's ib_send_lat, ib_write_lat; OLD and NEW
# are directories holding a libibverbs.so.1 each (on a host that is not Debian 12, with the
# Debian libraries perftest links: libmlx5.so.1, libefa.so.1, libibumad.so.3, libpci.so.3,
# libnl-3.so.200, libnl-route-3.so.200). Appends to OUT/dropin-latency.txt one line per run:
# t_typical, t_avg, t_max in µs and the voluntary context switches of the client's engine
# thread PEEK seconds into the run (how often it was woken). ROUNDS (6), N (50000), PEEK (0.6).
set -u
B=$1 OLD=$2 NEW=$3 out=$4
port=34000
lat() {
  local label=$1 sd=$2 cd=$3
  shift 3
  port=$((port + 1))
  timeout 60 "$@" -d "$sd" -s 8 -n "${N:-50000}" -p $port >/tmp/dl-s.log 2>&1 &
  local sp=$!
  sleep 0.4
  "$@" -d "$cd" -s 8 -n "${N:-50000}" -p $port 127.0.0.1 >/tmp/dl-c.log 2>&1 &
  local cp=$!
  sleep "${PEEK:-0.6}"
  # `env` execs the tool, so $cp is the tool's PID.
  local sw
  sw=$(for t in /proc/$cp/task/*; do
    [ "$(cat "$t/comm" 2>/dev/null)" = erdma-soft-127. ] &&
      awk '/^voluntary_ctxt/ {print $2}' "$t/status"
  done | head -n1)
  wait $cp
  local rc=$?
  wait $sp
  echo "$label $(awk '$1 == 8 {print "typ", $5, "avg", $6, "max", $4; exit}' /tmp/dl-c.log)" \
    "engine_wakeups_at_${PEEK:-0.6}s ${sw:-?} rc $rc" | tee -a "$out/dropin-latency.txt"
}
export ERDMA_SOFT_DEVICES=127.0.0.1,127.0.0.2
nproc | tee -a "$out/dropin-latency.txt"
for r in $(seq "${ROUNDS:-6}"); do
  lat "r$r ib_send_lat old" soft0 soft1 env LD_LIBRARY_PATH="$OLD" "$B/ib_send_lat"
  lat "r$r ib_send_lat new" soft0 soft1 env LD_LIBRARY_PATH="$NEW" "$B/ib_send_lat"
  lat "r$r send_lat" soft:127.0.0.1 soft:127.0.0.2 env "$B/send_lat"
  lat "r$r ib_write_lat old" soft0 soft1 env LD_LIBRARY_PATH="$OLD" "$B/ib_write_lat"
  lat "r$r ib_write_lat new" soft0 soft1 env LD_LIBRARY_PATH="$NEW" "$B/ib_write_lat"
  lat "r$r write_lat" soft:127.0.0.1 soft:127.0.0.2 env "$B/write_lat"
done
