#!/bin/sh
# rdma_cm on rxe0 in the guest, through erdma::connect::cm (tests/vm/siw.sh runs it on siw0 too,
# with ERDMA_VM_DEVICE, ERDMA_VM_GUEST_IP and ERDMA_CM_TRANSPORT=iwarp):
#  1. the SDK's server and client (two processes) connect by address, WRITE and SEND, and check
#     every byte on both sides, then disconnect;
#  2. connecting where nobody listens is a typed refusal, fast;
#  3. listening on an address no RDMA device has, and connecting to an address nobody answers,
#     are typed errors in bounded time;
#  4. the SDK against the C rdma_server / rdma_client and rping of rdmacm-utils, both roles.
# Runs in /payload with the `cm` test binary; non-zero on any failure.
set -u
ip=${ERDMA_VM_GUEST_IP:?}
export ERDMA_CM_EXPECT=rdma_cm
failed=0

# shellcheck source=lib/roles.sh
. vm/lib/roles.sh

# 1. SDK <-> SDK.
role cm cm_server_role ERDMA_CM_LISTEN="$ip:7471" &
server=$!
role cm cm_client_role ERDMA_CM_PEER="$ip:7471" ERDMA_CM_SOURCE="$ip" ERDMA_CM_DEVICE="$ERDMA_VM_DEVICE" ||
  failed=$((failed + 1))
wait $server || failed=$((failed + 1))
grep -h "verified" /tmp/cm-cm_server_role.log /tmp/cm-cm_client_role.log

# The same under the eRDMA limit profile (rxe checked against eRDMA's limits), the server on the
# wildcard address and disconnecting by dropping its connection, the client on a verbs context
# of its own rather than rdma_cm's.
role cm cm_server_role ERDMA_CM_LISTEN="0.0.0.0:7474" ERDMA_PROFILE=erdma ERDMA_CM_DROP=1 &
server=$!
role cm cm_client_role ERDMA_CM_PEER="$ip:7474" ERDMA_PROFILE=erdma ERDMA_CM_OWN_CONTEXT=1 ||
  failed=$((failed + 1))
wait $server || failed=$((failed + 1))

# 2. Nobody listens on 7999.
role cm cm_refused_role ERDMA_CM_PEER="$ip:7999" || failed=$((failed + 1))
grep -h "refused as expected" /tmp/cm-cm_refused_role.log

# 3. No RDMA device has an address of TEST-NET-2; nobody answers for an unused neighbour.
role cm cm_no_device_role ERDMA_CM_ADDR=198.51.100.77 || failed=$((failed + 1))
grep -h "^bind:" /tmp/cm-cm_no_device_role.log
role cm cm_unreachable_role ERDMA_CM_PEER="${ip%.*}.99:7471" || failed=$((failed + 1))
grep -h "unreachable as expected" /tmp/cm-cm_unreachable_role.log

# A connection request too large for RoCE's 56 bytes; a server whose setup fails rejects with
# its reason; a listener nobody connects to and one that never answers time out.
role cm cm_oversized_role ERDMA_CM_PEER="$ip:7999" || failed=$((failed + 1))
role cm cm_reject_server_role ERDMA_CM_LISTEN="$ip:7475" &
server=$!
role cm cm_rejected_client_role ERDMA_CM_PEER="$ip:7475" || failed=$((failed + 1))
wait $server || failed=$((failed + 1))
grep -h "^client:" /tmp/cm-cm_rejected_client_role.log
role cm cm_accept_timeout_role ERDMA_CM_LISTEN="$ip:7476" || failed=$((failed + 1))
role cm cm_silent_server_role ERDMA_CM_LISTEN="$ip:7477" ERDMA_CM_HOLD_MS=6000 &
server=$!
sleep 1
role cm cm_silent_peer_client_role ERDMA_CM_PEER="$ip:7477" || failed=$((failed + 1))
wait $server || failed=$((failed + 1))
grep -h "^client:" /tmp/cm-cm_silent_peer_client_role.log

# 4. Against the C tools.
if command -v rdma_server >/dev/null 2>&1 && command -v rdma_client >/dev/null 2>&1; then
  timeout 90 rdma_server -p 7472 >/tmp/cm-rdma_server.log 2>&1 &
  cserver=$!
  role cm cm_c_server_peer_role ERDMA_CM_PEER="$ip:7472" || failed=$((failed + 1))
  if wait $cserver; then echo "ok   rdma_server (C) finished"; else
    echo "FAIL rdma_server (C)"; cat /tmp/cm-rdma_server.log; failed=$((failed + 1)); fi

  role cm cm_c_client_peer_role ERDMA_CM_LISTEN="$ip:7473" &
  sdkserver=$!
  ok=0
  for _ in $(seq 1 50); do
    if timeout 30 rdma_client -s "$ip" -p 7473 >/tmp/cm-rdma_client.log 2>&1; then ok=1; break; fi
    sleep 0.3
  done
  if [ $ok = 1 ]; then echo "ok   rdma_client (C) finished"; else
    echo "FAIL rdma_client (C)"; cat /tmp/cm-rdma_client.log; failed=$((failed + 1)); fi
  wait $sdkserver || failed=$((failed + 1))
else
  echo "rdma_server/rdma_client not in the image: C interop skipped"
fi
if command -v rping >/dev/null 2>&1; then
  timeout 90 rping -s -a "$ip" -p 7480 -v >/tmp/cm-rping-server.log 2>&1 &
  cserver=$!
  role cm cm_rping_server_peer_role ERDMA_CM_PEER="$ip:7480" ERDMA_CM_RPING_COUNT=5 ||
    failed=$((failed + 1))
  if wait $cserver; then echo "ok   rping -s (C) finished: $(grep -c 'ping data' /tmp/cm-rping-server.log) pings"; else
    echo "FAIL rping -s (C)"; cat /tmp/cm-rping-server.log; failed=$((failed + 1)); fi

  role cm cm_rping_client_peer_role ERDMA_CM_LISTEN="$ip:7481" ERDMA_CM_RPING_COUNT=5 &
  sdkserver=$!
  ok=0
  for _ in $(seq 1 50); do
    if timeout 30 rping -c -a "$ip" -p 7481 -C 5 -v -V >/tmp/cm-rping-client.log 2>&1; then ok=1; break; fi
    sleep 0.3
  done
  if [ $ok = 1 ] && [ "$(grep -c 'ping data' /tmp/cm-rping-client.log)" = 5 ]; then
    echo "ok   rping -c -V (C) finished: 5 pings validated"; else
    echo "FAIL rping -c (C)"; cat /tmp/cm-rping-client.log; failed=$((failed + 1)); fi
  wait $sdkserver || failed=$((failed + 1))
else
  echo "rping not in the image: rping interop skipped"
fi

echo "cm.sh: $failed failure(s)"
[ $failed = 0 ]
