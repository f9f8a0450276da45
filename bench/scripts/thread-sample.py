#!/usr/bin/env python3
"""Where the threads of some processes spend a few seconds, without perf:
    thread-sample.py SECS PID...
Reads every thread's /proc state as fast as it can for SECS: its scheduler state (R, S, D), the
system call it sleeps in (/proc/TID/syscall; 'on-cpu' while it runs), and its schedstat (time
on a CPU, time runnable but waiting for one). Prints one line per thread that ran >= 2 %."""
import collections
import os
import sys
import time

secs = float(sys.argv[1]); pids = sys.argv[2:]
names = {0:'read',1:'write',7:'poll',44:'sendto',45:'recvfrom',46:'sendmsg',47:'recvmsg',202:'futex',232:'epoll_wait',281:'epoll_pwait',307:'sendmmsg',299:'recvmmsg',310:'process_vm_readv',24:'sched_yield',441:'epoll_pwait2',230:'clock_nanosleep',271:'ppoll',270:'pselect6'}
def tids():
    out = []
    for p in pids:
        for t in os.listdir(f'/proc/{p}/task'):
            out.append((p, t))
    return out
def sched(p, t):
    with open(f'/proc/{p}/task/{t}/schedstat') as f:
        a = f.read().split(); return int(a[0]), int(a[1])
ts = tids()
comm = {}
for p, t in ts:
    with open(f'/proc/{p}/task/{t}/comm') as f: comm[(p,t)] = f.read().strip()
s0 = {k: sched(*k) for k in ts}
counts = collections.defaultdict(collections.Counter)
end = time.time() + secs; n = 0
while time.time() < end:
    n += 1
    for p, t in ts:
        try:
            with open(f'/proc/{p}/task/{t}/stat') as f: st = f.read().rsplit(')',1)[1].split()[0]
            with open(f'/proc/{p}/task/{t}/syscall') as f: sc = f.read().split()[0]
        except OSError:
            continue
        if sc == 'running': key = st + ':on-cpu'
        else:
            try: key = st + ':' + names.get(int(sc), sc)
            except ValueError: key = st + ':' + sc
        counts[(p,t)][key] += 1
s1 = {k: sched(*k) for k in ts if os.path.exists(f'/proc/{k[0]}/task/{k[1]}')}
for k in ts:
    c = counts[k]; tot = sum(c.values()) or 1
    if k not in s1: continue
    run = (s1[k][0]-s0[k][0])/1e9/secs*100; wait = (s1[k][1]-s0[k][1])/1e9/secs*100
    if run < 2: continue
    top = ', '.join(f'{a} {b*100//tot}%' for a, b in c.most_common(5))
    print(f'  pid {k[0]} {comm[k]:<16} on-CPU {run:5.1f}%  runnable-waiting {wait:5.1f}%  | {top}')
print(f'  ({n} sweeps)')
