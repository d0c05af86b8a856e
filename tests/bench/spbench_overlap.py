#!/usr/bin/env python3
"""How much of spd's communication the compute beside it hides, on one GPU:
P rank processes (forked, each attached to a private spd) time each step by
the host's clock.

  ring     Ring attention's K/V rotation: h.ishift of a [B, S/P, H, D] K and V
           to rank + 1 on shift channel 0 (spd's side stream), beside the
           block's attention (torch's scaled_dot_product_attention of the
           rank's queries over the K/V block in hand);
  ulysses  the async Ulysses all-to-all: spclient.torch.iseq_to_head of K
           and V (h.ialltoall seq->head, as projected_attention submits it)
           beside the query projection ([B, S/P, H D] x [H D, H D]) on the
           current stream, which is what VeOmni's async Ulysses overlaps.

Per step and rank, three times, each by the host's clock between two
torch.cuda.synchronize() (CUDA events recorded around a stream wait that
another process's GPU work releases are stamped late, by 0.3 ms to several
ms while contexts share the GPU: docs/performance.md):

  comm      submit, then Request.wait() (the current stream waits for spd's
            side stream), nothing else;
  compute   the compute alone;
  together  submit, the compute, then wait();

and hidden = (comm + compute - together) / comm: 1 when the compute hides
the communication whole, 0 when they ran one after the other. Each step
starts with the GPU idle and every rank past a barrier; the figures are the
medians of --iters steps after --warmup, the slowest rank's (the ranks
share the GPU, so they also share its copy engines and SMs).

    python3 tests/bench/spbench_overlap.py --spd build/daemon/spd
    python3 tests/bench/spbench_overlap.py --spd build/daemon/spd --procs 2,4 --seq 32768 --json-file o.json

Exits 77 (skipped), saying why, where torch sees no GPU.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "examples"))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

import torch  # noqa: E402

import spclient  # noqa: E402
import spclient.torch as spt  # noqa: E402
import train_tiny_sp as tts  # noqa: E402  (its spd start-up and rank processes)

SKIP = 77


def gpu_count():
    """torch's GPU count, asked in a child: this process forks the ranks, and
    CUDA does not survive a fork once initialised here."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    try:
        return int(out.stdout.strip() or 0), out.stderr.strip()
    except ValueError:
        return 0, out.stderr.strip()


def host_ms(fn, device):
    """fn() and all it queued on the GPU, by the host's clock; milliseconds."""
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize(device)
    return (time.perf_counter() - t0) * 1e3


def rank_overlap(h, world, rank, size, a, kind):
    """One rank: the medians (ms) of comm, compute and together over the steps."""
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    B, L, H, D = a.batch, a.seq // size, a.heads, a.head_dim
    g = torch.Generator(device=device).manual_seed(rank)
    bf16 = torch.bfloat16

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=bf16)

    k, v = rand(B, L, H, D), rand(B, L, H, D)
    if kind == "ring":
        q = rand(B, H, L, D)
        k_next, v_next = torch.empty_like(k), torch.empty_like(v)

        def submit():
            return h.ishift(world, [(k, k_next), (v, v_next)], channel=0)

        def compute():
            # The block in hand: this rank's queries over a K/V block, all of it seen.
            torch.nn.functional.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2))
    else:
        x, w = rand(B, L, H * D), rand(H * D, H * D)

        def submit():
            # What spclient.attention.projected_attention submits before the query projection.
            return spt.iseq_to_head(h, world, L * size, (H, H), k, v,
                                    kinds=(spclient.HEADS_KV, spclient.HEADS_KV))

        def compute():
            x @ w                                                   # the query projection

    host = {"submit": [], "wait": []}

    def comm():
        # Where comm's time goes: the host's submit and wait calls (a wait
        # that returns at once leaves the stream to wait; the rest is the GPU's).
        t0 = time.perf_counter()
        req = submit()
        t1 = time.perf_counter()
        req.wait()
        host["submit"].append((t1 - t0) * 1e3)
        host["wait"].append((time.perf_counter() - t1) * 1e3)

    def together():
        req = submit()
        compute()
        req.wait()

    times = {"comm": [], "compute": [], "together": []}
    for step in range(a.warmup + a.iters):
        for name, fn in (("comm", comm), ("compute", compute), ("together", together)):
            torch.cuda.synchronize(device)
            h.barrier(world)
            ms = host_ms(fn, device)
            if step >= a.warmup:
                times[name].append(ms)
    h.synchronize()
    r = {name: statistics.median(t) for name, t in times.items()}
    r.update({f"host_{name}": statistics.median(t[a.warmup:]) for name, t in host.items()})
    return r


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spd", help="start a private spd from this binary (else use $SPC_SOCKET's)")
    ap.add_argument("--procs", default="2,4", help="rank processes on the GPU, comma-separated")
    ap.add_argument("--kind", default="ring,ulysses")
    ap.add_argument("--seq", type=int, default=32768, help="global S; a rank holds S / P")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--json-file", help="append one JSON object per line here too")
    a = ap.parse_args()
    count, why = gpu_count()
    if count == 0:
        print(f"skipped: no CUDA device (torch {torch.__version__}: torch.cuda.is_available() is False) "
              f"{why.splitlines()[-1] if why else ''}".rstrip(), file=sys.stderr)
        return SKIP
    procs = [int(p) for p in a.procs.split(",") if p]
    for p in procs:
        if a.seq % p or a.heads % p:
            ap.error(f"--seq {a.seq} and --heads {a.heads} must be multiples of every --procs ({p})")
    stop = tts.start_spd(a.spd) if a.spd else None
    out = open(a.json_file, "a") if a.json_file else None
    print(f"bf16 K and V [{a.batch}, S/P, {a.heads}, {a.head_dim}], S = {a.seq}, on {count} GPU(s); "
          f"medians of {a.iters} steps, the slowest rank's")
    print("| kind | P | MB sent per rank | comm ms | compute ms | together ms | hidden | host submit, wait ms |")
    print("|---|---|---|---|---|---|---|---|")
    try:
        for kind in a.kind.split(","):
            for p in procs:
                ranks = tts.run_ranks(p, rank_overlap, a, kind, timeout=300)
                m = {name: max(r[name] for r in ranks) for name in ("comm", "compute", "together", "host_submit",
                                                                     "host_wait")}
                hidden = (m["comm"] + m["compute"] - m["together"]) / m["comm"]
                mb = 2 * a.batch * (a.seq // p) * a.heads * a.head_dim * 2 / 1e6
                print(f"| {kind} | {p} | {mb:.1f} | {m['comm']:.3f} | {m['compute']:.3f} | {m['together']:.3f} "
                      f"| {hidden:.0%} | {m['host_submit']:.3f}, {m['host_wait']:.3f} |", flush=True)
                if out:
                    rec = dict(kind=kind, procs=p, seq=a.seq, heads=a.heads, head_dim=a.head_dim, batch=a.batch,
                               comm_ms=m["comm"], compute_ms=m["compute"], together_ms=m["together"],
                               hidden=hidden, ranks=ranks)
                    out.write(json.dumps(rec) + "\n")
    finally:
        if out:
            out.close()
        if stop:
            stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
