#!/bin/sh
# Guest half of scripts/vm/selftest, everything inside one guest: rxe0 is ACTIVE, verbs RC
# traffic (ibv_rc_pingpong), perftest (ib_write_bw, ib_send_lat), an rdma_cm connection (rping)
# and a netem qdisc; siw0 is ACTIVE and iWARP, and rping runs over it. Expects the run to set
# eth0's MTU to 9000 (rxe's active MTU is then 4096).
. ./lib.sh
dev=$ERDMA_VM_DEVICE
gid=$ERDMA_VM_GID_INDEX
ip=$ERDMA_VM_GUEST_IP
echo "guest: $dev on $ERDMA_VM_NETDEV $ip, IPv4 GID index $gid, netdev MTU $ERDMA_VM_MTU"

ibv_devinfo -v -d "$dev" >/tmp/devinfo 2>&1
if grep -q 'state:[[:space:]]*PORT_ACTIVE' /tmp/devinfo &&
  grep -q 'link_layer:[[:space:]]*Ethernet' /tmp/devinfo &&
  grep -q "GID\[ *$gid\]:[[:space:]]*::ffff:$ip, RoCE v2" /tmp/devinfo; then
  pass "ibv_devinfo -v: $dev PORT_ACTIVE, Ethernet, GID[$gid] ::ffff:$ip RoCE v2"
else
  bad "ibv_devinfo -v"
  show devinfo /tmp/devinfo
fi
if grep -q 'active_mtu:[[:space:]]*4096' /tmp/devinfo; then
  pass "active_mtu 4096 with netdev MTU $ERDMA_VM_MTU"
else
  bad "active_mtu is not 4096 with netdev MTU $ERDMA_VM_MTU"
  grep mtu /tmp/devinfo
fi
if rdma link show "$dev/1" | grep -q 'state ACTIVE'; then
  pass "rdma link show: $dev/1 ACTIVE"
else
  bad "rdma link show $dev/1"
fi

sent0=$(counter sent_pkts)
pair rc_pingpong 18515 \
  "ibv_rc_pingpong -d $dev -g $gid -p 18515 -s 16384 -m 4096 -n 200" \
  "ibv_rc_pingpong -d $dev -g $gid -p 18515 -s 16384 -m 4096 -n 200 $ip" \
  '200 iters'
pair ib_write_bw 18516 \
  "ib_write_bw -d $dev -x $gid -p 18516 -s 65536 -n 500 -F" \
  "ib_write_bw -d $dev -x $gid -p 18516 -s 65536 -n 500 -F $ip" \
  '^ *65536 *500 '
pair ib_send_lat 18517 \
  "ib_send_lat -d $dev -x $gid -p 18517 -s 64 -n 500 -F" \
  "ib_send_lat -d $dev -x $gid -p 18517 -s 64 -n 500 -F $ip" \
  '^ *64 *500 '

# rdma_cm: rping's server listens through the CM, not TCP, so the client retries until it is up.
# rping_pair ADDR COUNT TAG LABEL: COUNT pings between a server and a client on ADDR.
rping_pair() {
  timeout 120 rping -s -a "$1" -C "$2" -v >"/tmp/rping.$3.server" 2>&1 &
  spid=$!
  i=0
  until timeout 60 rping -c -a "$1" -C "$2" -v >"/tmp/rping.$3.client" 2>&1; do
    i=$((i + 1))
    [ $i -ge 20 ] && break
    sleep 0.3
  done
  wait "$spid"
  src=$?
  n=$(grep -c 'ping data: rdma-ping-' "/tmp/rping.$3.client")
  if [ "$src" -eq 0 ] && [ "$n" -eq "$2" ]; then
    pass "$4: $2 pings"
  else
    bad "$4: server exit $src, $n of $2 pings"
    show server "/tmp/rping.$3.server"
    show client "/tmp/rping.$3.client"
  fi
}
rping_pair "$ip" 10 rxe "rping (rdma_cm)"

siw=$ERDMA_VM_SIW_DEVICE
ibv_devinfo -d "$siw" >/tmp/siwinfo 2>&1
if grep -q 'transport:[[:space:]]*iWARP' /tmp/siwinfo &&
  grep -q 'state:[[:space:]]*PORT_ACTIVE' /tmp/siwinfo; then
  pass "ibv_devinfo: $siw iWARP, PORT_ACTIVE on $ERDMA_VM_SIW_NETDEV"
else
  bad "ibv_devinfo -d $siw"
  show devinfo /tmp/siwinfo
fi
rping_pair "$ERDMA_VM_SIW_IP" 5 siw "rping over $siw ($ERDMA_VM_SIW_IP)"

sent=$(($(counter sent_pkts) - sent0))
if [ "$sent" -gt 0 ]; then
  pass "hw_counters: sent_pkts grew by $sent"
else
  bad "hw_counters: sent_pkts did not grow"
fi

if tc qdisc add dev eth0 root netem loss 1% &&
  tc qdisc show dev eth0 | grep -q 'netem.*loss 1%' &&
  tc qdisc del dev eth0 root; then
  pass "tc qdisc add dev eth0 root netem loss 1%"
else
  bad "tc netem"
fi

# A program from the host that needs a library the base image lacks (added by scripts/vm/run).
if [ -n "${SELFTEST_EXTRA:-}" ]; then
  if out=$("./extra/$SELFTEST_EXTRA" --version 2>&1); then
    pass "payload ELF with an extra library: $(echo "$out" | head -n 1)"
  else
    bad "payload ELF with an extra library: $out"
  fi
fi
finish
