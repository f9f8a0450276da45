#!/bin/sh
# The SDK, the tools and the AllReduce on the guest's soft-iWARP device (siw0, on its own dummy
# netdev; see scripts/vm/README.md), all through rdma_cm, the only way an iWARP queue pair
# connects:
#  1. the device as the SDK sees it, and what its limits layer refuses before the kernel;
#  2. every operation siw carries, 0 B to 1 MiB, server and client in two processes; immediate
#     data, atomics and a two-SGE READ refused up front; SEND WITH INVALIDATE;
#  3. private data at the limit and one byte over (through the SDK and through bare librdmacm),
#     a peer that vanishes;
#  4. tests/vm/cm.sh on siw0: nobody listening, a reject with its reason, no device, an address
#     nobody answers, a listener that never answers, and rdmacm-utils' rdma_server/rdma_client
#     and rping, both roles;
#  5. the C tools without rdma_cm fail on siw (their QPs cannot reach RTS), as the SDK says;
#  6. the project's tools with -R (rdma_cm) against each other and perftest's -R, both roles;
#  7. the ring AllReduce, 2-4 ranks, every dtype, through rdma_cm and without immediate data.
# Runs in /payload with the `cm` and `iwarp` test binaries; non-zero on any failure.
set -u
dev=${ERDMA_VM_SIW_DEVICE:?}
ip=${ERDMA_VM_SIW_IP:?}
netdev=${ERDMA_VM_SIW_NETDEV:?}
export ERDMA_CM_EXPECT=rdma_cm ERDMA_CM_TRANSPORT=iwarp
# siw counts every registration against RLIMIT_MEMLOCK, root or not (8 MiB by default).
ulimit -l unlimited
failed=0

# shellcheck source=lib/roles.sh
. vm/lib/roles.sh
# Prints the lines of an iwarp role's log that start with one of the given words.
said() {
  name=$1
  shift
  for w in "$@"; do grep -h "^$w" "/tmp/iwarp-$name.log"; done
}
# A server role in the background and its client in the foreground; both must pass.
#   duo BINARY SERVER CLIENT PORT [VAR=VALUE...]
duo() {
  bin=$1 server=$2 client=$3 port=$4
  shift 4
  role "$bin" "$server" ERDMA_CM_LISTEN="$ip:$port" "$@" &
  spid=$!
  role "$bin" "$client" ERDMA_CM_PEER="$ip:$port" "$@" || failed=$((failed + 1))
  wait $spid || failed=$((failed + 1))
}

# 1. The device.
role iwarp iwarp_device_role ERDMA_IWARP_DEVICE="$dev" ERDMA_IWARP_NETDEV="$netdev" \
  ERDMA_IWARP_IP="$ip" || failed=$((failed + 1))
said iwarp_device_role device:

# 2. Every operation, both directions.
duo iwarp iwarp_server_role iwarp_client_role 7500
said iwarp_client_role client:
said iwarp_server_role server:

# 3. rdma_cm's error paths particular to iWARP: private data at the limit and one byte over,
# through the SDK and bare librdmacm; a peer that vanishes.
duo iwarp iwarp_private_server_role iwarp_private_client_role 7506
said iwarp_private_client_role client:
said iwarp_private_server_role server:
duo iwarp iwarp_raw_server_role iwarp_wire_limit_role 7507
said iwarp_wire_limit_role "raw client:"
# The vanishing server exits (status 0) in the middle of its test, so libtest prints no summary:
# its last words are the check.
log=/tmp/iwarp-iwarp_vanishing_server_role.log
ERDMA_CM_LISTEN="$ip:7508" timeout 120 ./iwarp --ignored --exact iwarp_vanishing_server_role \
  --nocapture >$log 2>&1 &
spid=$!
role iwarp iwarp_abandoned_client_role ERDMA_CM_PEER="$ip:7508" || failed=$((failed + 1))
if wait $spid && grep -q "^server: exiting without a disconnect" $log; then
  echo "ok   iwarp_vanishing_server_role"
else
  echo "FAIL iwarp_vanishing_server_role"; cat $log; failed=$((failed + 1))
fi
said iwarp_abandoned_client_role client:

# 4. The rdma_cm suite of rxe0 on siw0: the one-call connection (dropped too), refusals, no
# device, unreachable and silent peers, a reject with its reason, oversized connection info, and
# the C tools of rdmacm-utils (rdma_server, rdma_client, rping) in both roles.
ERDMA_VM_DEVICE="$dev" ERDMA_VM_GUEST_IP="$ip" sh vm/cm.sh || failed=$((failed + 1))

# 5. Without rdma_cm, the C tools cannot connect on siw: the kernel refuses RTS. That is why the
# SDK refuses the out-of-band path up front (section 1).
timeout 30 ibv_rc_pingpong -d "$dev" -g 0 -n 5 -p 7514 >/tmp/siw-pp-server.log 2>&1 &
cserver=$!
sleep 1
timeout 30 ibv_rc_pingpong -d "$dev" -g 0 -n 5 -p 7514 127.0.0.1 >/tmp/siw-pp-client.log 2>&1
crc=$?
wait $cserver
src=$?
# The server moves its QP first (RTR, then RTS, before it answers the client), so it is the one
# that meets the refusal; the client then finds the server gone.
if [ $crc != 0 ] && [ $src != 0 ] && grep -q "Failed to modify QP to RTS" /tmp/siw-pp-server.log; then
  echo "ok   ibv_rc_pingpong on $dev fails at RTS (client exit $crc, server exit $src)"
else
  echo "FAIL ibv_rc_pingpong on $dev: client exit $crc, server exit $src"
  cat /tmp/siw-pp-client.log /tmp/siw-pp-server.log
  failed=$((failed + 1))
fi

# 6. The tools with -R, against each other and against perftest's -R.
ERDMA_VM_DEVICE="$dev" ERDMA_TOOLS_HOST="$ip" ERDMA_TOOLS_SET=iwarp sh vm/tools.sh ||
  failed=$((failed + 1))

# 7. The AllReduce: ranks as processes in this guest, their queue pairs connected through
# rdma_cm, chunks moved as WRITE + SEND (siw has no immediate data); every iteration checked
# against a local reference (the tool exits non-zero on any wrong element), every dtype.
allred() {
  out=/tmp/siw-allreduce.out
  echo "--- allreduce $*"
  if ! timeout 300 ./allreduce --device "$dev" --timeout 60 "$@" >$out 2>&1; then
    cat $out
    echo "FAIL allreduce $*"
    return 1
  fi
  cat $out
  if ! grep -q '^# Wrong elements : 0 OK' $out || [ "$(grep -v '^#' $out | grep -c .)" -lt 2 ]; then
    echo "FAIL allreduce $*: no clean check line or too few rows"
    return 1
  fi
}
allred --ranks 2 -b 4 -e 1M -f 16 -n 3 -w 1 -c 1 || failed=$((failed + 1))
allred --ranks 3 -b 12 -e 300K -f 5 -n 2 -w 1 -c 1 -q 3 --chunk 8K -d half -o max ||
  failed=$((failed + 1))
allred --ranks 4 -b 4K -e 1M -f 4 -n 2 -w 1 -c 1 -d bfloat16 || failed=$((failed + 1))
allred --ranks 4 -b 4 -e 64K -f 16 -n 2 -w 0 -c 1 -d int32 -q 8 || failed=$((failed + 1))
allred --ranks 3 -b 1K -e 256K -f 16 -n 2 -w 0 -c 1 -d float -o max --slots 2 ||
  failed=$((failed + 1))

# 8. The NCCL plugin's harness on siw0: the plugin finds an iWARP device and connects its queue
# pairs through rdma_cm with SEND notices by itself (nccl.sh, as on rxe0).
ERDMA_VM_DEVICE="$dev" sh vm/nccl.sh || failed=$((failed + 1))

echo "siw.sh: $failed failure(s)"
[ $failed = 0 ]
