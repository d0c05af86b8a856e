#!/usr/bin/env python3
"""Where a CUDA tensor's op through spd spends its time, from the binding: a
ring shift of one tensor (to group rank + 1) in P rank processes on one GPU,
beside torch's own copy of the same bytes (the device copy bound), per size.

  copy     y.copy_(x) on the current stream, timed with CUDA events;
  shift    h.shift, the blocking form: on the current stream (stream order),
           timed with CUDA events around it;
  ishift   h.ishift(...).wait(): spd's side stream, the current stream made
           to wait for it, timed the same way;
  wall     host wall time of h.shift between two torch.cuda.synchronize():
           what a host that waits for the result sees;
  iwall    the same of h.ishift(...).wait().

Medians of --iters runs, the slowest rank's; with P = 1 the shift goes to
the rank itself, and the result is checked against x. Exits 77 (skipped),
saying why, where torch sees no GPU.

    python3 tests/bench/spbench_gpu_comm.py --spd build/daemon/spd --procs 1,2 --sizes 1M,16M,128M
"""
import argparse
import json
import os
import statistics
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "examples"))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import train_tiny_sp as tts  # noqa: E402  (its spd start-up and rank processes)
from spbench_overlap import SKIP, gpu_count, host_ms  # noqa: E402


def _events_ms(fn, iters):
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return statistics.median(out)


def _wall_ms(fn, iters):
    return statistics.median(host_ms(fn, None) for _ in range(iters))


def rank_sizes(h, world, rank, size, sizes, iters):
    torch.cuda.set_device(rank % torch.cuda.device_count())
    res = {}
    for n in sizes:
        x = torch.randint(0, 255, (n,), dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        r = {"copy": _events_ms(lambda: y.copy_(x), iters)}
        for name, fn, timer in (("shift", lambda: h.shift(world, [(x, y)]), _events_ms),
                                ("ishift", lambda: h.ishift(world, [(x, y)]).wait(), _events_ms),
                                ("wall", lambda: h.shift(world, [(x, y)]), _wall_ms),
                                ("iwall", lambda: h.ishift(world, [(x, y)]).wait(), _wall_ms)):
            h.barrier(world)
            r[name] = timer(fn, iters)
        if size == 1 and not torch.equal(x, y):
            raise AssertionError(f"{n} bytes: the shift to itself did not give its input back")
        res[n] = r
    return res


def parse_size(t):
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(t[:-1]) * mult[t[-1].upper()] if t[-1].upper() in mult else int(t)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spd", help="start a private spd from this binary (else use $SPC_SOCKET's)")
    ap.add_argument("--procs", default="1,2", help="rank processes on the GPU, comma-separated")
    ap.add_argument("--sizes", default="1M,16M,128M", help="bytes per tensor (K, M, G suffixes)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--json-file", help="append one JSON object per line here too")
    a = ap.parse_args()
    count, why = gpu_count()
    if count == 0:
        print(f"skipped: no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False) "
              f"{why.splitlines()[-1] if why else ''}".rstrip(), file=sys.stderr)
        return SKIP
    sizes = [parse_size(s) for s in a.sizes.split(",") if s]
    stop = tts.start_spd(a.spd) if a.spd else None
    out = open(a.json_file, "a") if a.json_file else None
    print(f"a ring shift of one uint8 tensor through spd on {count} GPU(s); medians of {a.iters}, the slowest rank's")
    print("| P | bytes | torch copy ms (GB/s r+w) | shift ms | ishift ms | wall ms | iwall ms |")
    print("|---|---|---|---|---|---|---|")
    try:
        for p in (int(x) for x in a.procs.split(",") if x):
            ranks = tts.run_ranks(p, rank_sizes, sizes, a.iters, timeout=300)
            for n in sizes:
                m = {k: max(r[n][k] for r in ranks) for k in ("copy", "shift", "ishift", "wall", "iwall")}
                print(f"| {p} | {n} | {m['copy']:.3f} ({2 * n / m['copy'] / 1e6:.0f}) | {m['shift']:.3f} | "
                      f"{m['ishift']:.3f} | {m['wall']:.3f} | {m['iwall']:.3f} |", flush=True)
                if out:
                    out.write(json.dumps(dict(procs=p, bytes=n, **{f"{k}_ms": v for k, v in m.items()})) + "\n")
    finally:
        if out:
            out.close()
        if stop:
            stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
