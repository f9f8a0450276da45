#!/bin/sh
# The project's tools on rxe0 in the guest (run by scripts/vm-test; the tools are in the payload
# directory, the working directory): each tool against itself through the verbs provider, then
# rc_pingpong <-> ibv_rc_pingpong, write_bw <-> ib_write_bw and send_lat <-> ib_send_lat, each
# pair in both roles. Prints PASS/FAIL per pair; exits with the number of failures.
#
# ERDMA_TOOLS_SET=iwarp runs the iWARP set instead (tests/vm/siw.sh, on siw0): every tool with
# -R (rdma_cm) against itself and the C tools' -R in both roles, and a tool without -R refused
# up front. ERDMA_TOOLS_HOST is the address clients dial (default 127.0.0.1; on iWARP the
# device's own, since rdma_cm picks the device by address).
dev=${ERDMA_VM_DEVICE:-rxe0}
gidx=${ERDMA_VM_GID_INDEX:-1}
limit=${ERDMA_TOOLS_TIMEOUT:-120}
host=${ERDMA_TOOLS_HOST:-127.0.0.1}
port=18700
failed=0
tmp=${TMPDIR:-/tmp}/tools.$$
mkdir -p "$tmp"

# pair NAME 'SERVER COMMAND' 'CLIENT COMMAND' [PATTERN]: starts the server, then the client
# against $host on a fresh TCP port (appended to both as -p PORT); both must exit 0 and the
# client's output must match PATTERN (an extended regex; default: a table row).
pair() {
  name=$1 server=$2 client=$3 pattern=${4:-'^ *[0-9]+ +[0-9]+ +[0-9.]+'}
  port=$((port + 1))
  # shellcheck disable=SC2086
  timeout "$limit" $server -p $port >"$tmp/server" 2>&1 &
  spid=$!
  # The C clients do not retry their connection: give the server time to listen (up to 30 s:
  # a tool's start in the emulated guest took over 10 s once, on a loaded host).
  i=0
  while [ $i -lt 150 ] && ! (netstat -ltn 2>/dev/null || ss -ltn) | grep -q ":$port "; do
    sleep 0.2
    i=$((i + 1))
  done
  # shellcheck disable=SC2086
  timeout "$limit" $client -p $port "$host" >"$tmp/client" 2>&1
  crc=$?
  wait $spid
  src=$?
  if [ $crc -eq 0 ] && [ $src -eq 0 ] && grep -Eq "$pattern" "$tmp/client"; then
    echo "PASS $name"
    grep -E "$pattern" "$tmp/client" | head -3 | sed 's/^/    /'
  else
    echo "FAIL $name (client exit $crc, server exit $src)"
    echo "  --- client"
    tail -15 "$tmp/client" | sed 's/^/    /'
    echo "  --- server"
    tail -15 "$tmp/server" | sed 's/^/    /'
    failed=$((failed + 1))
  fi
}

# Each tool against itself: self_pairs FLAGS BW_ITERS LAT_ITERS.
self_pairs() {
  for t in write_bw send_bw read_bw write_lat send_lat read_lat; do
    case $t in *_bw) n=$2 ;; *) n=$3 ;; esac
    # shellcheck disable=SC2086 # FLAGS are words
    pair "$t$1 <-> $t$1" "./$t -d $dev$1 -n $n" "./$t -d $dev$1 -n $n"
  done
}

if ./devinfo -d "$dev" | grep -q PORT_ACTIVE; then
  echo "PASS devinfo -d $dev"
else
  echo "FAIL devinfo -d $dev"
  failed=$((failed + 1))
fi

if [ "${ERDMA_TOOLS_SET:-}" = iwarp ]; then
  if ./devinfo -d "$dev" | grep -Eq 'transport:[[:space:]]*iWARP'; then
    echo "PASS devinfo -d $dev says iWARP"
  else
    echo "FAIL devinfo -d $dev does not say iWARP"
    ./devinfo -d "$dev"
    failed=$((failed + 1))
  fi
  self_pairs " -R" 300 300
  pair "write_bw -R -q 2" "./write_bw -d $dev -R -n 300 -q 2" "./write_bw -d $dev -R -n 300 -q 2"
  # send_bw is left out: its phases follow ib_write_bw's, not ib_send_bw's (as without -R).
  for t in write_bw send_lat read_bw; do
    pair "ib_$t -R (server) <-> $t -R (client)" "ib_$t -d $dev -R -n 300" "./$t -d $dev -R -n 300"
    pair "$t -R (server) <-> ib_$t -R (client)" "./$t -d $dev -R -n 300" "ib_$t -d $dev -R -n 300"
  done
  # Without -R: refused before any connection, saying what to do.
  if ./write_bw -d "$dev" -p 18799 >"$tmp/norm" 2>&1; then
    echo "FAIL write_bw without -R on $dev ran"
    failed=$((failed + 1))
  elif grep -q "iWARP device.*-R" "$tmp/norm"; then
    echo "PASS write_bw without -R on $dev refused: $(cat "$tmp/norm")"
  else
    echo "FAIL write_bw without -R on $dev: $(cat "$tmp/norm")"
    failed=$((failed + 1))
  fi
  rm -rf "$tmp"
  echo "tools (iWARP): $failed failed"
  exit $failed
fi

self_pairs "" 1000 500
pair "write_bw -q 2 --oob erdma" "./write_bw -d $dev -n 300 -q 2 --oob erdma" \
  "./write_bw -d $dev -n 300 -q 2 --oob erdma"

pp='[0-9]+ iters in [0-9.]+ seconds'
pair "rc_pingpong <-> rc_pingpong" "./rc_pingpong -d $dev -n 200" "./rc_pingpong -d $dev -n 200" "$pp"
pair "ibv_rc_pingpong (server) <-> rc_pingpong (client)" \
  "ibv_rc_pingpong -d $dev -g $gidx -n 200" "./rc_pingpong -d $dev -n 200" "$pp"
pair "rc_pingpong (server) <-> ibv_rc_pingpong (client)" \
  "./rc_pingpong -d $dev -n 200" "ibv_rc_pingpong -d $dev -g $gidx -n 200" "$pp"

pair "ib_write_bw (server) <-> write_bw (client)" \
  "ib_write_bw -d $dev -x $gidx -n 1000" "./write_bw -d $dev -n 1000"
pair "write_bw (server) <-> ib_write_bw (client)" \
  "./write_bw -d $dev -n 1000" "ib_write_bw -d $dev -x $gidx -n 1000"
pair "ib_send_lat (server) <-> send_lat (client)" \
  "ib_send_lat -d $dev -x $gidx -n 500" "./send_lat -d $dev -n 500"
pair "send_lat (server) <-> ib_send_lat (client)" \
  "./send_lat -d $dev -n 500" "ib_send_lat -d $dev -x $gidx -n 500"

rm -rf "$tmp"
echo "tools: $failed failed"
exit $failed
