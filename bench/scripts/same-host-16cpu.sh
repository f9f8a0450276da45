#!/usr/bin/env bash
# Payloads by reference on the 16-CPU GPU host (build here, send the binaries): the 4-rank
# AllReduce (a process per rank) by reference and in the datagrams (ERDMA_SOFT_SAME_HOST=cma /
# off) against Open MPI over TCP and over shared memory, interleaved, three rounds; a checked
# AllReduce by reference; then write_bw between two processes, both ways.
#   bench/scripts/same-host-16cpu.sh BIN_DIR OMPI_DIR OUT_DIR
# BIN_DIR holds release write_bw and allreduce; OMPI_DIR an Open MPI install (the PyPI wheel's
# data/ directory serves) with mpi_allreduce built from bench/scripts/mpi_allreduce.c beside its
# bin/. Not run by scripts/bench-report (its name has a dot); its output goes in bench/results/.
set -uo pipefail
bin="${1:?directory holding release write_bw and allreduce}"
ompi="${2:?an Open MPI install directory}"
out="${3:?an output directory}"
{ cat /proc/sys/kernel/yama/ptrace_scope; nproc; uname -r; } >"$out/host.txt" 2>&1
port=25000
bw() { local label=$1 q=$2 s=$3; shift 3; port=$((port + 1))
  env "$@" "$bin/write_bw" -d soft:127.0.0.1 -q "$q" -s "$s" -D 3 -p $port >/tmp/shb-s.log 2>&1 &
  local sp=$!
  sleep 0.4
  env "$@" "$bin/write_bw" -d soft:127.0.0.2 -q "$q" -s "$s" -D 3 -p $port 127.0.0.1 >/tmp/shb-c.log 2>&1
  wait $sp
  echo "$label q$q s$s $(grep -E "^ +$s " /tmp/shb-c.log | tail -n1 | awk '{print $4}') $(grep -ci error /tmp/shb-c.log /tmp/shb-s.log | tr '\n' ' ')" >>"$out/bw.txt"
}
mpi() { OPAL_PREFIX="$ompi" timeout 120 "$ompi/bin/mpirun" -np 4 --oversubscribe --allow-run-as-root \
  --mca pml ob1 --mca btl "$1,self" --mca btl_tcp_if_include lo "$ompi/mpi_allreduce" \
  1048576 67108864 2 20 2 >>"$out/allreduce.txt" 2>&1; }
for r in 1 2 3; do
  for m in cma off; do
    echo "== r$r ours $m" >>"$out/allreduce.txt"
    ERDMA_SOFT_SAME_HOST=$m timeout 120 "$bin/allreduce" --ranks 4 --soft-base 127.79.0.1 -b 1M \
      -e 64M -f 2 -n 20 -w 2 -c 0 -d float -o sum >>"$out/allreduce.txt" 2>&1
  done
  echo "== r$r mpi tcp" >>"$out/allreduce.txt"; mpi tcp
  echo "== r$r mpi shm" >>"$out/allreduce.txt"; mpi vader
done
echo "== check cma" >>"$out/allreduce.txt"
timeout 120 "$bin/allreduce" --ranks 4 --soft-base 127.79.0.1 -b 1K -e 16M -f 4 -n 3 -w 1 -c 1 \
  -d float -o sum >>"$out/allreduce.txt" 2>&1
echo "rc=$?" >>"$out/allreduce.txt"
for r in 1 2; do
  for m in cma off; do
    bw "r$r $m" 1 65536 ERDMA_SOFT_SAME_HOST=$m
    bw "r$r $m" 1 1048576 ERDMA_SOFT_SAME_HOST=$m
  done
done
