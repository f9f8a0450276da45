#!/usr/bin/env bash
# Payloads by reference between soft devices of one host (ERDMA_SOFT_SAME_HOST=cma, the default)
# against the same devices with every payload in the datagrams (ERDMA_SOFT_SAME_HOST=off), in
# one run, interleaved round by round:
#   - write_bw between two processes (server and client), 64 KiB and 1 MiB, one queue pair,
#     against one TCP stream on loopback (iperf3);
#   - the 4-rank AllReduce (examples/allreduce, a process per rank), 1-64 MiB, against Open
#     MPI's MPI_Allreduce over shared memory (vader/sm) and over TCP, same 4 ranks.
# Prints one line per measurement; bench/results/same-host.md holds a run and its reading.
#   bench/scripts/same-host.sh [rounds]     (default 3)
# MPIRUN / MPICC name another Open MPI (OPAL_PREFIX as it needs); otherwise apt's is used.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$root"
rounds="${1:-3}"
mpirun="${MPIRUN:-mpirun}"
mpicc="${MPICC:-mpicc}"
if ! command -v "$mpirun" >/dev/null || ! command -v "$mpicc" >/dev/null; then
  apt-get install -y openmpi-bin libopenmpi-dev >/dev/null
fi
cargo build -q --release --example write_bw --example allreduce
"$mpicc" -O2 -o target/release/mpi_allreduce bench/scripts/mpi_allreduce.c
shm_btl=vader
"$(dirname "$(command -v "$mpirun")")/ompi_info" --parsable 2>/dev/null | grep -q 'mca:btl:vader' || shm_btl=sm
tools=target/release/examples
port=27000
bw() { # mode, bytes
  port=$((port + 1))
  ERDMA_SOFT_SAME_HOST=$1 "$tools/write_bw" -d soft:127.0.97.1 -s "$2" -D 2 -p "$port" \
    --report_gbits >/tmp/same-host-s.log 2>&1 &
  local s=$!
  sleep 0.5
  ERDMA_SOFT_SAME_HOST=$1 "$tools/write_bw" -d soft:127.0.97.2 -s "$2" -D 2 -p "$port" \
    --report_gbits 127.0.0.1 >/tmp/same-host-c.log 2>&1
  wait "$s"
  echo "write_bw $1 $2 $(awk -v s="$2" '$1 == s { print $4 }' /tmp/same-host-c.log) Gbit/s"
}
tcp() {
  iperf3 -s -1 -p 5297 >/dev/null 2>&1 &
  local s=$!
  sleep 0.5
  echo "tcp $(iperf3 -c 127.0.0.1 -p 5297 -t 2 -J | python3 -c 'import json,sys; print(json.load(sys.stdin)["end"]["sum_received"]["bits_per_second"] / 1e9)') Gbit/s"
  wait "$s" || true
}
ours() { # mode
  echo "== allreduce ours $1"
  ERDMA_SOFT_SAME_HOST=$1 timeout 300 "$tools/allreduce" --ranks 4 --soft-base 127.79.0.1 \
    -b 1M -e 64M -f 2 -n 20 -w 2 -c 0 -d float -o sum | grep -E '^ +[0-9]'
}
mpi() { # btl
  echo "== allreduce mpi $1"
  timeout 300 "$mpirun" -np 4 --oversubscribe --allow-run-as-root --mca pml ob1 \
    --mca btl "$1,self" --mca btl_tcp_if_include lo target/release/mpi_allreduce \
    1048576 67108864 2 20 2 | grep -E '^ *[0-9]'
}
for r in $(seq 1 "$rounds"); do
  echo "=== round $r"
  for s in 65536 1048576; do bw cma "$s"; bw off "$s"; done
  tcp
  ours cma
  ours off
  mpi "$shm_btl"
  mpi tcp
done
echo "=== checked: the AllReduce by reference, 1 KiB-16 MiB, every element compared"
timeout 300 "$tools/allreduce" --ranks 4 --soft-base 127.79.0.1 -b 1K -e 16M -f 4 -n 3 -w 1 \
  -c 1 -d float -o sum | tail -n 3
