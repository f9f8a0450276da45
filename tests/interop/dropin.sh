#!/usr/bin/env bash
# Unmodified Debian C tools on both ends: on the host over the drop-in libibverbs.so.1 on the
# soft device (soft0 at 10.77.0.1, $PAYLOAD/dropin), in the guest over rxe0 (10.77.0.2):
# ibv_rc_pingpong, ib_write_bw, ib_read_bw and ib_send_lat, each in both roles. Run by
# scripts/interop-rxe from the project's root; needs root (tap0). Exits non-zero on failure.
set -uo pipefail
# shellcheck source=tests/interop/lib/pair.sh
. "$(dirname "$0")/lib/pair.sh"
: "${PAYLOAD:?PAYLOAD must name the directory holding the build}"
[ -f "$PAYLOAD/dropin/libibverbs.so.1" ] || { echo "dropin.sh: no drop-in library in $PAYLOAD/dropin"; exit 1; }
limit=${ERDMA_TOOLS_TIMEOUT:-300}
port=18900
failed=0
summary=""
host_env="LD_LIBRARY_PATH='$PAYLOAD/dropin' ERDMA_SOFT_DEVICES=10.77.0.1"

# one NAME WHO-SERVES TOOL HOST-GID-FLAG ARGS: TOOL runs with ARGS on the host (soft0, drop-in)
# and in the guest (rxe0); WHO-SERVES is host or guest.
one() {
  local name=$1 server=$2 tool=$3 gflag=$4 args=$5
  port=$((port + 1))
  local host_cmd guest_cmd wait=()
  if [ "$server" = host ]; then
    host_cmd="$host_env $tool -d soft0 $gflag 1 -p $port $args"
    guest_cmd="$tool -d \$ERDMA_VM_DEVICE $gflag \$ERDMA_VM_GID_INDEX -p $port $args \$ERDMA_VM_PEER_IP"
    wait=(--host-wait "tcp:$port")
  else
    # The guest's server starts after the host's command: the host's client tries again while
    # nobody listens (a client that connected and then failed leaves no server to try again).
    host_cmd="for i in \$(seq 60); do $host_env $tool -d soft0 $gflag 1 -p $port $args 10.77.0.2 && exit 0; sleep 2; done; exit 1"
    guest_cmd="$tool -d \$ERDMA_VM_DEVICE $gflag \$ERDMA_VM_GID_INDEX -p $port $args"
  fi
  pair "$name" "$limit" "$PAYLOAD" "$host_cmd" "$guest_cmd" "${wait[@]}"
}

for who in host guest; do
  one "ibv_rc_pingpong, $who serves (host: drop-in on soft0, guest: rxe0)" $who \
    ibv_rc_pingpong -g "-n 200 -s 4096"
  one "ib_write_bw, $who serves (host: drop-in on soft0, guest: rxe0)" $who \
    ib_write_bw -x "-n 1000 -s 65536"
  one "ib_read_bw, $who serves (host: drop-in on soft0, guest: rxe0)" $who \
    ib_read_bw -x "-n 1000 -s 65536"
  one "ib_send_lat, $who serves (host: drop-in on soft0, guest: rxe0)" $who \
    ib_send_lat -x "-n 500"
done

echo
echo "=== drop-in interop summary$summary"
exit "$failed"
