#!/usr/bin/env bash
# Network faults against the real peer: the soft device on the host (10.77.0.1) and rxe in the
# guest (10.77.0.2) run the two-process test (every opcode, 0 B – 1 MiB, every byte checked)
# while `tc netem` in the guest loses, reorders, duplicates and corrupts the guest's outgoing
# datagrams. Both directions: the guest drives (its requests cross the faults) and the host
# drives (the guest's ACKs and read responses do). Each run must end with the data intact. At
# loss rates above 5 % a requester may also run out of retries (RETRY_EXC_ERR, 7 retries): that
# counts as a pass only there; at 5 % and below it is a failure (the two sides keep their queue
# pairs until each knows the other's last request was acknowledged, so no retry goes to a peer
# that is gone). Never wrong data, a hang or a crash. Run by scripts/interop-rxe with PAYLOAD
# holding two_process.
#
#   ERDMA_NETEM="loss 1%;loss 5%"   the netem settings to run (';'-separated)
#   ERDMA_NETEM_SERVERS="host"      which side serves (default: "host guest", both directions)
set -uo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
: "${PAYLOAD:?PAYLOAD must hold the two_process test binary}"

IFS=';' read -r -a settings <<<"${ERDMA_NETEM:-loss 0.1%;loss 1%;loss 5%;loss 1% duplicate 1% reorder 10% 50% delay 1ms corrupt 0.5%}"
port=18700
failed=0

one() {
  local server=$1 netem=$2
  port=$((port + 1))
  local host_env guest_env host_role guest_role wait=()
  if [ "$server" = host ]; then
    host_role=server_process
    guest_role=client_process
    host_env="ERDMA_TWO_PROCESS_LISTEN=10.77.0.1:$port"
    guest_env="ERDMA_TWO_PROCESS_PEER=10.77.0.1:$port"
    wait=(--host-wait "tcp:$port")
  else
    host_role=client_process
    guest_role=server_process
    host_env="ERDMA_TWO_PROCESS_PEER=10.77.0.2:$port"
    guest_env="ERDMA_TWO_PROCESS_LISTEN=0.0.0.0:$port"
  fi
  local log
  log=$(mktemp)
  echo "--- netem '$netem', $server serves"
  scripts/vm/run --tap --timeout 600 --payload "$PAYLOAD" \
    --host-cmd "cd '$PAYLOAD' && ERDMA_TWO_PROCESS_DEVICE=soft:10.77.0.1 $host_env timeout 500 ./two_process --ignored --exact $host_role --nocapture" \
    "${wait[@]}" \
    -- "tc qdisc add dev eth0 root netem $netem && tc qdisc show dev eth0 && ERDMA_TWO_PROCESS_DEVICE=\$ERDMA_VM_DEVICE $guest_env timeout 500 ./two_process --ignored --exact $guest_role --nocapture; r=\$?; tc -s qdisc show dev eth0; exit \$r" \
    >"$log" 2>&1
  local rc=$?
  grep -E "netem|Sent [0-9]+ bytes|dropped|test result|RetryExc|RETRY_EXC|panicked" "$log" | head -20
  # The loss rate of the setting, in percent (empty when it loses nothing).
  local loss
  loss=$(sed -nE 's/.*loss ([0-9.]+)%.*/\1/p' <<<"$netem")
  if [ "$rc" -eq 0 ]; then
    echo "PASS (data intact): netem '$netem', $server serves"
  elif awk -v l="${loss:-0}" 'BEGIN { exit !(l > 5) }' && grep -qE "RetryExcErr|RETRY_EXC" "$log" &&
    ! grep -qE "differ|mismatch|assertion .* left" "$log"; then
    echo "PASS (retries exhausted, RETRY_EXC_ERR): netem '$netem', $server serves"
  else
    echo "FAIL (exit $rc): netem '$netem', $server serves; log $log"
    tail -30 "$log"
    failed=$((failed + 1))
    return
  fi
  rm -f "$log"
}

for s in "${settings[@]}"; do
  for server in ${ERDMA_NETEM_SERVERS:-host guest}; do
    one "$server" "$s"
  done
done
exit "$failed"
