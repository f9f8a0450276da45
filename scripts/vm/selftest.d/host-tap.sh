#!/usr/bin/env bash
# Host half of the tap check in scripts/vm/selftest (started by scripts/vm/run --host-cmd once
# rxe0 is up in the guest): ping and ARP towards the guest, then the userspace RoCEv2 peer from
# the shared reference material plays ibv_rc_pingpong's server on 10.77.0.1.
set -euo pipefail
shared="${ERDMA_SHARED:-$(cd "$(dirname "$0")/../../.." && pwd)/../shared}"
demo="$shared/reference/tools/roce_peer_demo.py"

busybox ping -c 2 -W 2 "$ERDMA_VM_GUEST_IP"
mac="$(ip neigh show "$ERDMA_VM_GUEST_IP" dev "${ERDMA_VM_TAP:-tap0}" | sed -n 's/.*lladdr \([0-9a-f:]*\).*/\1/p')"
if [[ $mac != "$ERDMA_VM_GUEST_MAC" ]]; then
  echo "host: ARP for $ERDMA_VM_GUEST_IP gives '$mac', not the guest's $ERDMA_VM_GUEST_MAC" >&2
  exit 1
fi
echo "host: ARP for $ERDMA_VM_GUEST_IP gives $mac"
if [[ ! -f $demo ]]; then
  echo "host: $demo not found (set ERDMA_SHARED to the shared material's directory)" >&2
  exit 1
fi
exec python3 "$demo" "$shared/reference"
