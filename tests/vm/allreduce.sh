#!/bin/sh
# Guest script: the ring AllReduce through verbs on the guest's kernel rxe device, ranks as
# processes in this one guest; every iteration checked against a local reference (the tool
# exits non-zero on any wrong element). Sizes from one element to 1 MiB, odd counts included.
set -eu
dev="${ERDMA_VM_DEVICE:-rxe0}"
out=/tmp/allreduce.out
run() {
  echo "--- allreduce $*"
  if ! timeout 300 ./allreduce --device "$dev" --timeout 60 "$@" >"$out" 2>&1; then
    cat "$out"
    echo "FAIL: allreduce $*"
    return 1
  fi
  cat "$out"
  grep -q '^# Wrong elements : 0 OK' "$out" || { echo "FAIL: no clean check line"; return 1; }
  # The ranks share the guest's device: its port counters (rxe's hw_counters, read from sysfs)
  # are reported once.
  grep -q '^# Port counters over the sweep (1 device(s)): completer_retry_err [0-9]' "$out" ||
    { echo "FAIL: no port counters line"; return 1; }
  # The table must have reached the largest size asked for.
  [ "$(grep -v '^#' "$out" | grep -c .)" -ge 2 ] || { echo "FAIL: too few rows"; return 1; }
}
run --ranks 2 -b 4 -e 1M -f 16 -n 3 -w 1 -c 1
run --ranks 3 -b 12 -e 300K -f 5 -n 2 -w 1 -c 1 -q 3 --chunk 8K -d half -o max
run --ranks 4 -b 4K -e 1M -f 4 -n 2 -w 1 -c 1 -d bfloat16
run --ranks 4 -b 4 -e 64K -f 16 -n 2 -w 0 -c 1 -d int32 -q 8
echo "allreduce on $dev: all checked runs clean"
