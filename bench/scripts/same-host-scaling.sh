#!/usr/bin/env bash
# Several engines on the 16-CPU GPU host (build here, send the binaries), both ways two soft
# devices of one host move payloads, and the drop-in's latency:
#   1. aggregate WRITE bandwidth (write_bw, two processes, 64 KiB messages, 3 s) for 1, 2, 4, 8
#      queue pairs on 1, 2, 4, 8 engines per device (ERDMA_SOFT_ENGINES, both ends), in the
#      datagrams (ERDMA_SOFT_SAME_HOST=off: as between hosts) and by reference (the default on
#      one host), rounds interleaving every setting;
#   2. where the threads of the 8-queue-pair runs at 1 and 4 engines spend their time
#      (bench/scripts/thread-sample.py);
#   3. 8 B half round trips: Debian's ib_write_lat / ib_send_lat on the drop-in libibverbs
#      against write_lat / send_lat, with the engine as it comes and spinning 50 µs
#      (ERDMA_SOFT_SPIN_US), interleaved.
#   bench/scripts/same-host-scaling.sh BIN_DIR DROPIN_DIR OUT_DIR [ROUNDS]
# BIN_DIR holds release write_bw, write_lat, send_lat and Debian's ib_write_lat, ib_send_lat;
# DROPIN_DIR the drop-in libibverbs.so.1 and librdmacm.so.1 with the Debian libraries perftest
# links that the host lacks (libmlx5.so.1, libefa.so.1, libibumad.so.3, libpci.so.3, libnl).
# Not run by scripts/bench-report; its output is bench/results/same-host-scaling-16cpu-output.txt.
set -uo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="${1:?directory holding the release tools}"
dropin="${2:?directory holding the drop-in libraries}"
out="${3:?an output directory}"
rounds="${4:-2}"
{ echo "ptrace_scope $(cat /proc/sys/kernel/yama/ptrace_scope 2>/dev/null || echo none)"
  echo "$(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')"
  echo "kernel $(uname -r)"; } >"$out/host.txt" 2>&1
port=26000

# bw LABEL ENGINES QPS [ENV...]: one write_bw pair, the client's average MB/s.
bw() {
  local label=$1 e=$2 q=$3; shift 3
  port=$((port + 1))
  env ERDMA_SOFT_ENGINES="$e" "$@" "$bin/write_bw" -d soft:127.0.0.1 -q "$q" -s 65536 -D 3 \
    -p $port >/tmp/shs-s.log 2>&1 &
  local sp=$!
  sleep 0.4
  env ERDMA_SOFT_ENGINES="$e" "$@" "$bin/write_bw" -d soft:127.0.0.2 -q "$q" -s 65536 -D 3 \
    -p $port 127.0.0.1 >/tmp/shs-c.log 2>&1
  local rc=$?
  wait $sp
  echo "$label engines $e qps $q MB/s $(grep -E '^ +65536 ' /tmp/shs-c.log | tail -n1 | awk '{print $4}') rc $rc" >>"$out/scaling.txt"
}
for r in $(seq "$rounds"); do
  for m in off cma; do
    for e in 1 2 4 8; do
      for q in 1 2 4 8; do bw "r$r $m" $e $q ERDMA_SOFT_SAME_HOST=$m; done
    done
  done
done

for m in off cma; do
  for e in 1 4; do
    port=$((port + 1))
    ERDMA_SOFT_SAME_HOST=$m ERDMA_SOFT_ENGINES=$e "$bin/write_bw" -d soft:127.0.0.1 -q 8 \
      -s 65536 -D 6 -p $port >/tmp/shs-s.log 2>&1 & s=$!
    sleep 0.5
    ERDMA_SOFT_SAME_HOST=$m ERDMA_SOFT_ENGINES=$e "$bin/write_bw" -d soft:127.0.0.2 -q 8 \
      -s 65536 -D 6 -p $port 127.0.0.1 >/tmp/shs-c.log 2>&1 & c=$!
    sleep 2.5
    echo "== $m, engines $e, 8 queue pairs: server $s, client $c" >>"$out/profile.txt"
    python3 "$here/thread-sample.py" 2 $s $c >>"$out/profile.txt" 2>&1
    wait $c; wait $s
    echo "  MB/s $(grep -E '^ +65536 ' /tmp/shs-c.log | tail -n1 | awk '{print $4}')" >>"$out/profile.txt"
  done
done

# lat LABEL SERVER_DEV CLIENT_DEV TOOL ARGS...: one latency pair at 8 B; the client's typical
# and average (µs).
lat() {
  local label=$1 sd=$2 cd=$3; shift 3
  port=$((port + 1))
  timeout 60 "$@" -d "$sd" -s 8 -n 20000 -p $port >/tmp/shs-s.log 2>&1 &
  local sp=$!
  sleep 0.4
  timeout 60 "$@" -d "$cd" -s 8 -n 20000 -p $port 127.0.0.1 >/tmp/shs-c.log 2>&1
  local rc=$?
  wait $sp
  echo "$label $(awk '$1 == 8 {print "t_typical", $5, "t_avg", $6; exit}' /tmp/shs-c.log) rc $rc" >>"$out/latency.txt"
}
export ERDMA_SOFT_DEVICES=127.0.0.1,127.0.0.2
for r in $(seq "$rounds"); do
  for spin in 0 50; do
    lat "r$r spin $spin ib_write_lat" soft0 soft1 env ERDMA_SOFT_SPIN_US=$spin LD_LIBRARY_PATH="$dropin" \
      "$bin/ib_write_lat"
    lat "r$r spin $spin write_lat" soft:127.0.0.1 soft:127.0.0.2 env ERDMA_SOFT_SPIN_US=$spin "$bin/write_lat"
    lat "r$r spin $spin ib_send_lat" soft0 soft1 env ERDMA_SOFT_SPIN_US=$spin LD_LIBRARY_PATH="$dropin" \
      "$bin/ib_send_lat"
    lat "r$r spin $spin send_lat" soft:127.0.0.1 soft:127.0.0.2 env ERDMA_SOFT_SPIN_US=$spin "$bin/send_lat"
  done
done
cp /tmp/shs-c.log "$out/last-client.log"
