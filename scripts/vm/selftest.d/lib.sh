# Helpers for the guest halves of scripts/vm/selftest (busybox sh, sourced). Checks report
# "ok"/"FAIL" lines; the calling script exits non-zero when any check failed.

failures=0
pass() { echo "ok   $*"; }
bad() {
  echo "FAIL $*"
  failures=$((failures + 1))
}
# Prints a file indented under a label, for the log of a failed check.
show() {
  [ -s "$2" ] && sed "s/^/    $1| /" "$2"
}
counter() {
  cat "/sys/class/infiniband/$ERDMA_VM_DEVICE/ports/$ERDMA_VM_PORT/hw_counters/$1"
}
# Waits up to 20 s for a TCP listener on the port (the C tools swap QP numbers over TCP).
wait_tcp() {
  i=0
  while ! netstat -ltn 2>/dev/null | grep -q ":$1 "; do
    i=$((i + 1))
    [ $i -gt 200 ] && return 1
    sleep 0.1
  done
}
# pair NAME PORT SERVER CLIENT PATTERN: runs SERVER in the background, waits for it to listen on
# PORT, runs CLIENT; passes when both exit 0 and the client's output matches PATTERN.
pair() {
  name=$1 port=$2 server=$3 client=$4 pattern=$5
  timeout 120 sh -c "$server" >"/tmp/$name.server" 2>&1 &
  spid=$!
  if ! wait_tcp "$port"; then
    bad "$name: the server never listened on TCP $port"
    kill "$spid" 2>/dev/null
    show server "/tmp/$name.server"
    return
  fi
  timeout 120 sh -c "$client" >"/tmp/$name.client" 2>&1
  crc=$?
  wait "$spid"
  src=$?
  if [ $crc -eq 0 ] && [ $src -eq 0 ] && grep -q "$pattern" "/tmp/$name.client"; then
    pass "$name: $(grep "$pattern" "/tmp/$name.client" | head -n 1 | tr -s ' \t' '  ' | sed 's/^ //')"
  else
    bad "$name (server exit $src, client exit $crc)"
    show server "/tmp/$name.server"
    show client "/tmp/$name.client"
  fi
}
finish() {
  if [ "$failures" -eq 0 ]; then
    echo "guest checks: all passed"
    exit 0
  fi
  echo "guest checks: $failures failed"
  exit 1
}
