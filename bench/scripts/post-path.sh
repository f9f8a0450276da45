#!/usr/bin/env bash
# The drop-in's and the tools' 8 B latency on several builds, interleaved round by round, with
# the packets through the shared-memory rings:
#
#   bench/scripts/post-path.sh OUT BUILD...
#
# Each BUILD is a directory as dropin-latency-rings.sh takes it (release send_lat, write_lat,
# Debian's ib_send_lat/ib_write_lat, lib/ with the drop-in and the libraries perftest links).
# Each round runs dropin-latency-rings.sh once (MODES=shm) on every build in turn; its lines go
# to OUT/<build's name>/dropin-latency-rings.txt. ROUNDS (7), N (50000).
set -u
out=$1
shift
here=$(cd "$(dirname "$0")" && pwd)
for r in $(seq "${ROUNDS:-7}"); do
  for b in "$@"; do
    name=$(basename "$b")
    mkdir -p "$out/$name"
    echo "== round $r $name"
    ROUNDS=1 MODES=shm "$here/dropin-latency-rings.sh" "$b" "$out/$name"
  done
done
