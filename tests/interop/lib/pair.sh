# Sourced by tests/interop/*.sh: one host <-> guest pair over the tap link, with its verdict
# added to $summary and counted in $failed (both the caller's).
#
#   pair NAME LIMIT PAYLOAD HOST_CMD GUEST_CMD [--host-wait tcp:PORT]
#
# perftest's C tools time with the CPU's cycle counter and refuse to report when calibrating it
# against the clock fails ("Correlation coefficient r^2 ... < 0.9"), which the emulated guest's
# irregular speed sometimes makes happen: only that failure is tried again (twice).
pair() {
  local name=$1 limit=$2 payload=$3 host_cmd=$4 guest_cmd=$5 rc log attempt
  shift 5
  echo "=== $name"
  log=$(mktemp)
  for attempt in 1 2 3; do
    scripts/vm/run --tap --timeout "$limit" --payload "$payload" \
      --host-cmd "$host_cmd" "$@" -- "$guest_cmd" 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
    if [ "$rc" -eq 0 ] || ! grep -q "Correlation coefficient r^2" "$log"; then
      break
    fi
    echo "--- $name: the C tool could not calibrate its clock in the guest (attempt $attempt)"
  done
  rm -f "$log"
  if [ "$rc" -eq 0 ]; then
    summary="$summary
PASS $name"
  else
    summary="$summary
FAIL $name (exit $rc)"
    failed=$((failed + 1))
  fi
}
