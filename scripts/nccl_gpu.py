#!/usr/bin/env python3
"""torch.distributed (NCCL backend) over whatever network NCCL was told to use: the checks and the
all_reduce bandwidth sweep that scripts/nccl-gpu runs, once per rank (one process per GPU,
started by torch.distributed.run).

  nccl_gpu.py check                  every collective, float32 and bfloat16, 4 B to 1 GiB,
                                     results compared element by element; exit 1 on any mismatch
  nccl_gpu.py bench --out FILE.json  all_reduce float32 1 MiB to 1 GiB: busbw per size (rank 0
                                     writes FILE.json)

Every value sent is a small integer, so sums are exact in bfloat16 as in float32 and a result is
either identical to the expected one or wrong.
"""
import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.distributed as dist

MIB = 1 << 20


def log(msg):
    if dist.get_rank() == 0:
        print(msg, flush=True)


def pattern(count, dtype, rank, salt, device):
    # Integers in [-8, 8]: exact in bfloat16 (8-bit mantissa) and in float32, sums too.
    i = torch.arange(count, device=device, dtype=torch.int32) % 17
    v = (i * 7 + rank * 3 + salt * 5) % 17 - 8
    return v.to(dtype)


def check_equal(what, got, want):
    if torch.equal(got, want):
        return True
    bad = (got != want).nonzero()
    first = bad[0].item() if bad.numel() else -1
    print(
        f"rank {dist.get_rank()}: WRONG {what}: {bad.numel()} of {got.numel()} elements differ, "
        f"first at {first}: got {got.flatten()[first].item()} want {want.flatten()[first].item()}",
        flush=True,
    )
    return False


def check(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    sizes = [4, 28, 1028, 65540, MIB + 12, 16 * MIB + 4, 256 * MIB, 1024 * MIB]
    if args.quick:
        sizes = [s for s in sizes if s <= 16 * MIB + 4]
    ok = True
    n_checks = 0
    t0 = time.time()
    for dtype in (torch.float32, torch.bfloat16):
        esz = torch.tensor([], dtype=dtype).element_size()
        for nbytes in sizes:
            count = max(1, nbytes // esz)
            # Element counts divisible by the world size for the scatter/gather collectives.
            per = max(1, count // world)
            salt = nbytes % 97
            name = f"{str(dtype).replace('torch.', '')} {nbytes} B"

            x = pattern(count, dtype, rank, salt, dev)
            dist.all_reduce(x)
            want = sum(pattern(count, dtype, r, salt, dev) for r in range(world))
            ok &= check_equal(f"all_reduce {name}", x, want)

            x = pattern(per, dtype, rank, salt, dev)
            out = torch.empty(per * world, dtype=dtype, device=dev)
            dist.all_gather_into_tensor(out, x)
            want = torch.cat([pattern(per, dtype, r, salt, dev) for r in range(world)])
            ok &= check_equal(f"all_gather {name}", out, want)

            x = pattern(per * world, dtype, rank, salt, dev)
            out = torch.empty(per, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(out, x)
            full = sum(pattern(per * world, dtype, r, salt, dev) for r in range(world))
            ok &= check_equal(f"reduce_scatter {name}", out, full[rank * per:(rank + 1) * per])

            for root in range(world):
                x = pattern(count, dtype, rank, salt + root, dev)
                dist.broadcast(x, src=root)
                ok &= check_equal(f"broadcast from {root} {name}", x, pattern(count, dtype, root, salt + root, dev))

            # send/recv around the ring, both ways.
            for step in (1, world - 1):
                to, frm = (rank + step) % world, (rank - step) % world
                x = pattern(count, dtype, rank, salt + 11, dev)
                y = torch.empty_like(x)
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, x, to), dist.P2POp(dist.irecv, y, frm)])
                for r in reqs:
                    r.wait()
                ok &= check_equal(f"send/recv {frm}->{rank} {name}", y, pattern(count, dtype, frm, salt + 11, dev))
            torch.cuda.synchronize()
            n_checks += 6 + world
            log(f"checked {name}: all_reduce, all_gather, reduce_scatter, broadcast, send/recv ({time.time() - t0:.1f} s)")
    flag = torch.tensor([0 if ok else 1], device=dev)
    dist.all_reduce(flag)
    if flag.item() != 0:
        log(f"CHECK FAILED: {flag.item()} rank(s) saw wrong results")
        return 1
    log(f"CHECK PASSED: {n_checks} checks per rank, every element exact")
    return 0


def bench(args):
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    sizes = [MIB << k for k in range(11)]  # 1 MiB .. 1 GiB
    if args.quick:
        sizes = [s for s in sizes if s <= 64 * MIB]
    rows = []
    log(f"{'size':>12} {'count':>12} {'time(us)':>12} {'algbw(GB/s)':>12} {'busbw(GB/s)':>12}")
    for nbytes in sizes:
        count = nbytes // 4
        x = torch.ones(count, dtype=torch.float32, device=dev)
        for _ in range(args.warmup):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        # As many iterations as fit about args.seconds (at least 3), decided from one timed call.
        t = time.perf_counter()
        dist.all_reduce(x)
        torch.cuda.synchronize()
        one = time.perf_counter() - t
        iters = int(max(3, min(args.max_iters, args.seconds / max(one, 1e-6))))
        it = torch.tensor([iters], device=dev)
        dist.all_reduce(it, op=dist.ReduceOp.MIN)
        iters = int(it.item())
        dist.barrier()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        elapsed = torch.tensor([(time.perf_counter() - t) / iters], device=dev, dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        sec = elapsed.item()
        algbw = nbytes / sec / 1e9
        busbw = algbw * 2 * (world - 1) / world
        rows.append({"bytes": nbytes, "iters": iters, "us": sec * 1e6, "algbw": algbw, "busbw": busbw})
        log(f"{nbytes:>12} {count:>12} {sec * 1e6:>12.1f} {algbw:>12.3f} {busbw:>12.3f}")
        del x
        torch.cuda.empty_cache()
    if rank == 0 and args.out:
        with open(args.out, "w") as f:
            json.dump({"world": world, "nccl": ".".join(map(str, torch.cuda.nccl.version())), "rows": rows}, f)
    return 0


def main():
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["check", "bench"])
    p.add_argument("--out")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--max-iters", type=int, default=50)
    args = p.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=5), device_id=torch.device("cuda", local))
    log(f"world {dist.get_world_size()}, NCCL {'.'.join(map(str, torch.cuda.nccl.version()))}, torch {torch.__version__}, "
        f"NCCL_NET={os.environ.get('NCCL_NET', '')} NCCL_NET_PLUGIN={os.environ.get('NCCL_NET_PLUGIN', '')}")
    rc = check(args) if args.mode == "check" else bench(args)
    dist.barrier()
    dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(main())
