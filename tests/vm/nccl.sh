#!/bin/sh
# Guest script: the NCCL network plugin (libnccl-net-erdma.so) on a kernel verbs device, driven
# as NCCL drives it by the `plugin` test binary: every size from 0 B to 64 MiB checked byte by
# byte, many requests in flight, grouped receives; then one queue pair, SEND notices (siw's
# mode), queue pairs connected through rdma_cm; then a sender and a receiver killed
# mid-transfer (ncclRemoteError in bounded time). Both ends of every connection use
# $ERDMA_VM_DEVICE (rxe0, siw0, ...): the plugin picks rdma_cm and SEND notices by itself on
# iWARP devices. Runs in /payload; non-zero on any failure.
set -u
dev="${ERDMA_VM_DEVICE:-rxe0}"
export ERDMA_NCCL_PLUGIN="$PWD/libnccl-net-erdma.so"
[ -f "$ERDMA_NCCL_PLUGIN" ] || { echo "FAIL: no plugin library in the payload"; exit 1; }
[ -x ./plugin ] || { echo "FAIL: no plugin test binary in the payload"; exit 1; }
export ERDMA_NCCL_DEVICES="$dev" ERDMA_NCCL_TEST_PAIR=0,0 NCCL_DEBUG=WARN
failed=0

# Runs one role of the test binary with extra variables; insists that it ran and passed.
role() {
  what=$1
  name=$2
  shift 2
  log=/tmp/nccl-$name-$(echo "$what" | tr ' /' '__').log
  if env "$@" ERDMA_NCCL_ROLE="$name" timeout 600 ./plugin --ignored --exact "$name" \
    --nocapture --test-threads=1 >"$log" 2>&1 && grep -q "1 passed" "$log"; then
    echo "ok   $what"
    return 0
  fi
  echo "FAIL $what"
  tail -n 40 "$log"
  failed=$((failed + 1))
  return 1
}

role "suite on $dev" role_suite
role "suite on $dev, one queue pair" role_suite ERDMA_NCCL_QPS=1
role "suite on $dev, SEND notices, 3 queue pairs, 4K chunks" role_suite \
  ERDMA_NCCL_NOTICE=send ERDMA_NCCL_QPS=3 ERDMA_NCCL_CHUNK=4K
role "suite on $dev, queue pairs through rdma_cm" role_suite ERDMA_NCCL_CM=1 ERDMA_NCCL_QPS=2

log=/tmp/nccl-killed.log
if ERDMA_NCCL_TEST_KILL_DEVICE="$dev" timeout 600 ./plugin --exact peer_killed_mid_transfer \
  --nocapture >"$log" 2>&1 && grep -q "1 passed" "$log"; then
  echo "ok   a peer killed mid-transfer on $dev"
else
  echo "FAIL a peer killed mid-transfer on $dev"
  tail -n 40 "$log"
  failed=$((failed + 1))
fi

[ $failed -eq 0 ] && echo "nccl plugin on $dev: all runs clean"
exit $failed
