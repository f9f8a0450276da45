#!/bin/sh
# Asynchronous events from rxe0 in the guest, read by the SDK: `devinfo --watch` prints the
# port going down and coming back when the link under rxe0 goes down and up (rxe reports both
# as port events to every open context). Runs in /payload; non-zero on any failure.
set -u
dev=${ERDMA_VM_DEVICE:?}
ip=${ERDMA_VM_GUEST_IP:?}
netdev=$(ip -o -4 addr show | awk -v ip="$ip" 'index($4, ip "/") == 1 { print $2; exit }')
[ -n "$netdev" ] || { echo "FAIL no interface holds $ip"; exit 1; }
out=/tmp/port-events.log
./devinfo -d "$dev" --watch 40 >"$out" 2>&1 &
watcher=$!
# The watch has begun once its banner is out.
n=0
until grep -q "watching asynchronous events" "$out"; do
  n=$((n + 1))
  [ $n -lt 300 ] || { echo "FAIL devinfo never started watching"; cat "$out"; exit 1; }
  sleep 0.1
done
ip link set dev "$netdev" down
sleep 2
ip link set dev "$netdev" up
# Back to normal before anything else runs: the port active again.
n=0
until ibv_devinfo -d "$dev" | grep -q PORT_ACTIVE; do
  n=$((n + 1))
  [ $n -lt 300 ] || { echo "FAIL $dev never came back"; exit 1; }
  sleep 0.1
done
n=0
until grep -q "PortActive on port 1" "$out"; do
  n=$((n + 1))
  [ $n -lt 300 ] || break
  sleep 0.1
done
kill $watcher 2>/dev/null
wait $watcher 2>/dev/null
failed=0
for want in "event: PortErr on port 1" "event: PortActive on port 1"; do
  if grep -q "$want" "$out"; then
    echo "ok   $want"
  else
    echo "FAIL $want"
    failed=1
  fi
done
# Down is reported before up.
if [ $failed -eq 0 ] && ! grep -o "PortErr\|PortActive" "$out" | head -1 | grep -q PortErr; then
  echo "FAIL the first port event is not PortErr"
  failed=1
fi
[ $failed -eq 0 ] || cat "$out"
exit $failed
