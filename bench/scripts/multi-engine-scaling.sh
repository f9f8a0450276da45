#!/usr/bin/env bash
# Aggregate soft WRITE bandwidth between two soft devices on one host (server soft:127.0.0.1,
# client soft:127.0.0.2, two processes), for 1, 2, 4, 8 queue pairs and 1, 2, 4, 8 engines per
# device (ERDMA_SOFT_ENGINES, the same on both ends), 64 KiB messages, each run -D seconds.
# Rounds interleave the settings, so drift hits every setting alike. Prints one line per run:
#
#   r<round> engines <E> qps <Q> MB/s <average>
#
# For a machine the report scripts cannot reach (the GPU hosts: build here, send the binary):
#   bench/scripts/multi-engine-scaling.sh DIR_WITH_write_bw [ROUNDS] [SECONDS]
# Not run by scripts/bench-report (its name has a dot); its output goes in bench/results/.
set -euo pipefail
bin="${1:?directory holding a release write_bw}"
rounds="${2:-3}"
secs="${3:-3}"
port=20000
echo "# $(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ //'); kernel $(uname -r)"
echo "# write_bw -s 65536 -D $secs -q Q, ERDMA_SOFT_ENGINES=E on both ends; MB/s = the client's BW average"
for r in $(seq "$rounds"); do
  for e in 1 2 4 8; do
    for q in 1 2 4 8; do
      port=$((port + 1))
      ERDMA_SOFT_ENGINES=$e "$bin/write_bw" -d soft:127.0.0.1 -q "$q" -s 65536 -D "$secs" \
        -p "$port" >/tmp/me-srv.log 2>&1 &
      srv=$!
      sleep 0.5
      if ERDMA_SOFT_ENGINES=$e "$bin/write_bw" -d soft:127.0.0.2 -q "$q" -s 65536 -D "$secs" \
          -p "$port" 127.0.0.1 >/tmp/me-cli.log 2>&1; then
        bw=$(grep -E '^ +65536 ' /tmp/me-cli.log | tail -n 1 | awk '{print $4}')
      else
        bw="failed: $(tail -n 2 /tmp/me-cli.log | tr '\n' ' ')"
      fi
      wait "$srv" || true
      echo "r$r engines $e qps $q MB/s $bw"
    done
  done
done
