#!/usr/bin/env bash
# Context switches per second of each thread of the client (the program's thread and its
# device's engine thread), counted over 0.3 s in the middle of a run, for ib_write_lat on the
# drop-in, write_lat and write_lat --perftest-loop (8 B, two processes on soft0/soft1, three
# rounds):
#
#   bench/scripts/dropin-loop-wakeups.sh BIN
#
# BIN as for dropin-latency-rings.sh. Shows which thread does the receive work in each loop: an
# engine thread woken for every packet switches tens of thousands of times a second, one left
# parked while the program polls about a thousand (its 1 ms grace rechecks).
B=$1; port=37000
export ERDMA_SOFT_DEVICES=127.0.0.1,127.0.0.2
snap() { for t in /proc/$1/task/*; do echo "$(cat $t/comm 2>/dev/null) $(awk '/^voluntary_ctxt/{v=$2} /^nonvoluntary_ctxt/{n=$2} END{print v, n}' $t/status 2>/dev/null)"; done; }
for r in 1 2 3; do
for v in "ib_write_lat" "write_lat" "write_lat --perftest-loop"; do
  port=$((port+1))
  case $v in ib_*) pre="env LD_LIBRARY_PATH=$B/lib $B/$v"; sd=soft0; cd=soft1;; *) pre="$B/$v"; sd=soft:127.0.0.1; cd=soft:127.0.0.2;; esac
  timeout 60 $pre -d $sd -s 8 -n 400000 -p $port >/tmp/s.log 2>&1 &
  sp=$!; sleep 0.4
  $pre -d $cd -s 8 -n 400000 -p $port 127.0.0.1 >/tmp/c.log 2>&1 &
  cp=$!; sleep 0.5
  a=$(snap $cp); sleep 0.3; b=$(snap $cp)
  wait $cp; wait $sp
  echo "== r$r $v $(awk '$1 == 8 {print "typ", $5; exit}' /tmp/c.log)"
  paste <(echo "$a") <(echo "$b") | awk '{print "  ", $1, "vol/s", ($5-$2)/0.3, "invol/s", ($6-$3)/0.3}'
done; done
