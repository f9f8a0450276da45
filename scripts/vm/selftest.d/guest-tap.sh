#!/bin/sh
# Guest half of the tap check in scripts/vm/selftest: the host answers ping and ARP, and
# ibv_rc_pingpong over rxe0 completes against the userspace RoCEv2 peer on the host (the host
# half has the peer listening before this script is released).
. ./lib.sh
dev=$ERDMA_VM_DEVICE
gid=$ERDMA_VM_GID_INDEX
peer=$ERDMA_VM_PEER_IP
echo "guest: $dev on $ERDMA_VM_NETDEV $ERDMA_VM_GUEST_IP, IPv4 GID index $gid, host $peer"

if ping -c 2 -W 2 "$peer" >/tmp/ping 2>&1; then
  pass "guest pings the host $peer"
else
  bad "guest cannot ping the host $peer"
  show ping /tmp/ping
fi
mac=$(ip neigh show "$peer" dev eth0 | sed -n 's/.*lladdr \([0-9a-f:]*\).*/\1/p')
if [ -n "$mac" ]; then
  pass "ARP: the host's $peer is at $mac"
else
  bad "ARP: no neighbour entry for $peer"
  ip neigh show dev eth0
fi

rcvd0=$(counter rcvd_pkts)
sent0=$(counter sent_pkts)
if timeout 90 ibv_rc_pingpong -d "$dev" -g "$gid" -s 4096 -n 3 -m 1024 "$peer" >/tmp/pp 2>&1 &&
  grep -q '3 iters' /tmp/pp; then
  pass "ibv_rc_pingpong against the host peer: $(grep iters /tmp/pp)"
else
  bad "ibv_rc_pingpong against the host peer"
  show pingpong /tmp/pp
fi
rcvd=$(($(counter rcvd_pkts) - rcvd0))
sent=$(($(counter sent_pkts) - sent0))
# Three 4096-byte SENDs each way at MTU 1024 (four packets each) plus the ACKs of either side.
if [ "$rcvd" -ge 12 ] && [ "$sent" -ge 12 ]; then
  pass "hw_counters: rcvd_pkts +$rcvd, sent_pkts +$sent"
else
  bad "hw_counters: rcvd_pkts +$rcvd, sent_pkts +$sent (want 12 or more each)"
fi
finish
