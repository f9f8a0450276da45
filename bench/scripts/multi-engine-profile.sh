#!/usr/bin/env bash
# Per-thread CPU of both write_bw processes (-q 8, 64 KiB, soft:127.0.0.1 serving
# soft:127.0.0.2) over 2 s in the middle of a 6 s run, for each engine count in $ENGINES
# (default "1 4"); $BIN holds a release write_bw. Made bench/results/multi-engine.md's profile:
#   BIN=DIR ENGINES="1 4 8" bench/scripts/multi-engine-profile.sh
snap() { for p in "$@"; do for t in /proc/$p/task/*; do
  echo "$p $(basename $t) $(cat $t/comm | tr ' ' _) $(awk '{print $14+$15}' $t/stat)"; done; done; }
for e in ${ENGINES:-1 4}; do
  port=$((21000 + e))
  ERDMA_SOFT_ENGINES=$e "${BIN:-.}/write_bw" -d soft:127.0.0.1 -q 8 -s 65536 -D 6 -p $port > /tmp/s.log 2>&1 & s=$!
  sleep 0.5
  ERDMA_SOFT_ENGINES=$e "${BIN:-.}/write_bw" -d soft:127.0.0.2 -q 8 -s 65536 -D 6 -p $port 127.0.0.1 > /tmp/c.log 2>&1 & c=$!
  sleep 3; snap $s $c > /tmp/a; sleep 2; snap $s $c > /tmp/b
  wait $c; wait $s
  echo "== engines $e: $(grep -E '^ +65536 ' /tmp/c.log | tail -n1 | awk '{print $4}') MB/s; % of a CPU per thread over 2 s (server pid $s, client pid $c)"
  join -j 2 <(sort -k2 /tmp/a) <(sort -k2 /tmp/b) | awk '{d=$7-$4; if (d>2) printf "  %s %s %s %d%%\n", ($2=='$s'?"server":"client"), $1, $3, d/2}'
done
