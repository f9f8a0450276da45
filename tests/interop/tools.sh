#!/usr/bin/env bash
# The project's tools on the host's soft device (10.77.0.1) against the C tools on rxe0 in the
# guest (10.77.0.2): rc_pingpong <-> ibv_rc_pingpong, write_bw <-> ib_write_bw and
# send_lat <-> ib_send_lat, each in both roles. Run by scripts/interop-rxe from the project's
# root with $PAYLOAD holding the built examples; needs root (tap0). Exits non-zero on failure.
set -uo pipefail
# shellcheck source=tests/interop/lib/pair.sh
. "$(dirname "$0")/lib/pair.sh"
: "${PAYLOAD:?PAYLOAD must name the directory holding the built examples}"
host_dev=soft:10.77.0.1
limit=${ERDMA_TOOLS_TIMEOUT:-300}
port=18800
failed=0
summary=""

# one NAME WHO-SERVES HOST-TOOL-ARGS GUEST-TOOL-ARGS: the host runs ./HOST-TOOL-ARGS on the soft
# device, the guest runs GUEST-TOOL-ARGS (a C tool) on rxe0; WHO-SERVES is host or guest.
one() {
  local name=$1 server=$2 host=$3 guest=$4
  port=$((port + 1))
  local host_cmd guest_cmd wait=()
  if [ "$server" = host ]; then
    host_cmd="cd '$PAYLOAD' && ./$host -d $host_dev -p $port"
    guest_cmd="$guest -d \$ERDMA_VM_DEVICE -p $port \$ERDMA_VM_PEER_IP"
    wait=(--host-wait "tcp:$port")
  else
    # The host's client retries its connection until the guest's server listens.
    host_cmd="cd '$PAYLOAD' && ./$host -d $host_dev -p $port --timeout 120 10.77.0.2"
    guest_cmd="$guest -d \$ERDMA_VM_DEVICE -p $port"
  fi
  pair "$name" "$limit" "$PAYLOAD" "$host_cmd" "$guest_cmd" "${wait[@]}"
}

gid='-g $ERDMA_VM_GID_INDEX'
gidx='-x $ERDMA_VM_GID_INDEX'
one "rc_pingpong (host soft) serves ibv_rc_pingpong (guest rxe)" host \
  "rc_pingpong -n 200" "ibv_rc_pingpong $gid -n 200"
one "ibv_rc_pingpong (guest rxe) serves rc_pingpong (host soft)" guest \
  "rc_pingpong -n 200" "ibv_rc_pingpong $gid -n 200"
one "write_bw (host soft) serves ib_write_bw (guest rxe)" host \
  "write_bw -n 1000" "ib_write_bw $gidx -n 1000"
one "ib_write_bw (guest rxe) serves write_bw (host soft)" guest \
  "write_bw -n 1000" "ib_write_bw $gidx -n 1000"
one "send_lat (host soft) serves ib_send_lat (guest rxe)" host \
  "send_lat -n 500" "ib_send_lat $gidx -n 500"
one "ib_send_lat (guest rxe) serves send_lat (host soft)" guest \
  "send_lat -n 500" "ib_send_lat $gidx -n 500"

echo
echo "=== tools interop summary$summary"
exit "$failed"
