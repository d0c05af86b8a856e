#!/usr/bin/env python3
"""How long a sequence one attention layer reaches with sequence parallelism
through spd: peak memory per rank and time, forward + backward.

    python3 client/examples/long_context.py --spd build/daemon/spd --seq 4096,8192 --sp 1,2,4
    python3 client/examples/long_context.py --spd build/daemon/spd --seq 2048 --search --mem-cap 64e6
    python3 client/examples/long_context.py --spd build/daemon/spd --device cuda --dtype bf16 \\
        --seq 8192,32768,131072 --sp 1,2,4 --mode ring,ulysses --mem-cap 60e9 --json

The layer (--layer attention, the default) is causal attention alone
(spclient.attention.attention) on random q, k, v of one document, [B, S/P, H, D]
per rank, no projections: what grows with S is attention's. --layer proj puts
it between a q, k, v projection of hidden states x [B, S/P, H * D] and an output
projection, so that q, k and v are the layer's own. Every point forks its own P
rank processes (SP = 1 too, one process through the same call), which attach to
spd, build their mesh (Ulysses: P x 1; Ring: 1 x P; hybrid: Ulysses 2 x Ring
P/2), make their inputs, and then run forward and backward once while
measuring:

  peak memory  over what is allocated once the inputs exist: on the CPU, every
               allocation and free of torch's CPU allocator (torch.profiler
               with profile_memory) and of spd's arena (h.empty, marked in the
               same profile), replayed in order: exact (--mem profiler, the
               default); or the rise of the resident set's high-water mark
               (--mem hwm: VmHWM, reset through clear_refs, which also sees
               pages kept resident after a free); on CUDA,
               torch.cuda.max_memory_allocated;
  with inputs  the peak plus the inputs' bytes (q, k, v and dout; with
               --layer proj, x and dy), what a cap on the whole device sees;
  time         wall time of forward + backward (CUDA synchronized), the median
               of --iters further runs when there are any (not profiled).

A point's figures are its slowest rank's and its largest peak. Per (sp, mode,
backend) the sizes run upward and stop after the first that does not fit
--mem-cap (the peak, or with --count-inputs the peak with inputs; or runs out
of GPU memory); with --search, S doubles from --seq's first until a point does
not fit and --refine bisections follow. The summary gives the largest S within
the cap beside SP = 1's and beside the einsum backend's (the path attention took
before it had backends), and, under a cap, the S at which the line through each
series' two longest points reaches it, over the inputs and with them (memory grows
linearly with S on the blockwise and flash backends, so this is the largest S
within the cap without running it). On CUDA, torch's
scaled_dot_product_attention on the whole sequence in one process (mode "sdpa")
is measured too, for time.

--backend is passed to attention(..., backend=...), --head-chunks to its
head_chunks (Ulysses over head groups in turn; unset, attention's own choice).
A spclient.attention without backends has one path, einsum: "auto" and
"einsum" then both run it (reported as einsum) and other backends are skipped,
saying so.

--json prints one JSON object per point on stdout (seq, sp, mode, backend,
peak_bytes, peak_with_inputs, seconds, fits, and per rank peak_bytes,
inputs_bytes and seconds); the tables go to stderr then. --json-file appends
the same lines to a file.
"""
import argparse
import ctypes
import inspect
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "python"))

import torch  # noqa: E402

import spclient  # noqa: E402
import spclient.attention as spa  # noqa: E402
import train_tiny_sp as tts  # noqa: E402  (its spd start-up and rank processes)

DTYPES = {"fp32": torch.float32, "fp64": torch.float64, "bf16": torch.bfloat16, "fp16": torch.float16}
HAS_BACKEND = "backend" in inspect.signature(spa.attention).parameters


def mesh_shape(mode, sp):
    """(ulysses, ring) of a mode at SP = sp, or None where the mode has no such mesh."""
    if sp == 1:
        return 1, 1
    if mode == "ulysses":
        return sp, 1
    if mode == "ring":
        return 1, sp
    return (2, sp // 2) if sp >= 4 and sp % 2 == 0 else None


def backend_runs(backend):
    """The backend name a point reports, or None where this spclient cannot run it."""
    if HAS_BACKEND:
        return backend
    return "einsum" if backend in ("auto", "einsum") else None


# ---------------------------------------------------------------- memory


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


class PeakMemory:
    """The peak this process reaches from now on, over what it holds now."""

    def __init__(self, device):
        self.device = device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.base = torch.cuda.memory_allocated(device)
            return
        # Writing 5 to clear_refs resets VmHWM to the current RSS (Linux 4.0).
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.base = _status_kib("VmRSS") * 1024

    def peak(self):
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.base
        return max(0, _status_kib("VmHWM") * 1024 - self.base)


class HostAllocations:
    """Every host allocation of this process from now on, counted exactly: torch's
    CPU allocator's through torch.profiler (profile_memory records each
    allocation and free with its size), spd's arena's (h.empty, freed when the
    last view goes) through a marker event in the same profile for each. peak()
    replays both in the order they happened and returns the largest sum over
    what was live at the start. Unlike the resident set, it does not see pages
    the C library or the arena keeps resident after a free."""

    MARK = "spd arena "

    def __init__(self, h):
        self.h, self.sizes = h, {}
        empty, release = h.empty, h._release

        def arena_empty(shape, dtype="float32", device=None):
            x = empty(shape, dtype, device)
            if isinstance(x, torch.Tensor) and not x.is_cuda and h.in_arena(x):
                self.sizes[x.data_ptr()] = n = x.numel() * x.element_size()
                self._mark(n)
            return x

        def arena_release(addr):
            n = self.sizes.pop(addr, None)
            if n is not None:
                self._mark(-n)
            release(addr)

        # Instance attributes: a finalizer made from now on calls arena_release.
        h.empty, h._release = arena_empty, arena_release
        self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self.prof.__enter__()

    def _mark(self, n):
        # The op form: record_function's context manager makes small tensors of
        # its own, which would be counted.
        rf = torch.ops.profiler._record_function_enter_new(f"{self.MARK}{n:+d}", None)
        torch.ops.profiler._record_function_exit._RecordFunction(rf)

    def peak(self):
        self.prof.__exit__(None, None, None)
        del self.h.empty            # the handle's own methods again
        deltas = []
        for e in self.prof.profiler.kineto_results.events():
            name = e.name()
            if name == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU:
                deltas.append((e.start_us(), e.nbytes()))
            elif name.startswith(self.MARK):
                deltas.append((e.start_us(), int(name[len(self.MARK):])))
        deltas.sort(key=lambda d: d[0])      # stable: events of one microsecond keep their order
        total = peak = 0
        for _, n in deltas:
            total += n
            peak = max(peak, total)
        return peak


# ---------------------------------------------------------------- one rank


def _record_history(on):
    """Starts (on) or stops recording the CUDA allocator's history."""
    rec = torch.cuda.memory._record_memory_history
    try:
        rec("all" if on else None, context="alloc", stacks="python", max_entries=200000)
    except TypeError:                    # torch before 2.1: a switch only
        rec(on)


def live_at_peak(top):
    """The `top` largest blocks live when the recorded history peaked.

    Each is (bytes, where): where is the innermost frame in spclient or in this
    file, which says which tensor of the attention path the block holds."""
    live, total, peak, at_peak = {}, 0, -1, {}
    for ev in torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = (ev["size"], ev.get("frames", []))
            total += ev["size"]
            if total > peak:
                peak, at_peak = total, dict(live)
        elif ev["action"] == "free_completed" and ev["addr"] in live:
            total -= live.pop(ev["addr"])[0]

    def where(frames):
        for f in frames:
            if "spclient" in f["filename"] or f["filename"].endswith("long_context.py"):
                return f"{os.path.basename(f['filename'])}:{f['line']} {f['name']}"
        return "elsewhere"
    blocks = sorted(((size, where(frames)) for size, frames in at_peak.values()), reverse=True)
    return {"peak": peak, "blocks": len(blocks), "top": blocks[:top]}


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def meter(a, h, device):
    """The peak memory meter --mem names for this device."""
    if device.type == "cpu" and a.mem in ("auto", "profiler"):
        return HostAllocations(h)
    return PeakMemory(device)


def rank_point(h, world, rank, size, a, seq, mode, backend):
    """One rank of one point: {peak_bytes, inputs_bytes, seconds} or {oom: message}."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    device = torch.device("cpu")
    if a.device == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    U, R = mesh_shape(mode, size)
    mesh = h.mesh(sp=size, heads=a.heads, ulysses=U, ring=R)
    pos = torch.arange(seq).expand(a.batch, seq)
    layout = spa.SeqLayout.for_mesh(pos, mesh)
    kwargs = {"backend": None if backend == "auto" else backend} if HAS_BACKEND else {}
    if a.head_chunks is not None:
        kwargs["head_chunks"] = a.head_chunks
    g = torch.Generator(device=device).manual_seed(1000 + rank)
    local = layout.local.numel()
    dtype, E = DTYPES[a.dtype], a.heads * a.head_dim

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=dtype)

    if a.layer == "attention":
        inputs = [randn(a.batch, local, a.heads, a.head_dim) for _ in range(4)]   # q, k, v, dout

        def one_step(q, k, v, dout):
            out = spa.attention(h, mesh, layout, q, k, v, a.heads, **kwargs)
            out.backward(dout)
    else:
        # x -> the q, k, v projection -> attention -> the output projection: q, k
        # and v are the layer's own, which the attention may let go.
        inputs = [randn(a.batch, local, E), randn(a.batch, local, E)]               # x, dy
        w_qkv, w_o = randn(E, 3 * E) / E ** 0.5, randn(E, E) / E ** 0.5

        def one_step(x, dy):
            q, k, v = (t.unflatten(-1, (a.heads, a.head_dim)) for t in (x @ w_qkv).chunk(3, dim=-1))
            out = spa.attention(h, mesh, layout, q, k, v, a.heads, **kwargs)
            (out.flatten(2) @ w_o).backward(dy)
        w_qkv.requires_grad_()
        w_o.requires_grad_()

    def clear():
        for x in inputs[:-1] + ([] if a.layer == "attention" else [w_qkv, w_o]):
            x.grad = None

    try:
        for x in inputs[:-1]:
            x.requires_grad_()
        _sync(device)
        mem = meter(a, h, device)
        trace = a.mem_trace and device.type == "cuda" and rank == 0
        if trace:
            _record_history(True)
        t0 = time.perf_counter()
        one_step(*inputs)
        _sync(device)
        times = [time.perf_counter() - t0]
        peak = mem.peak()
        if trace:
            traced = live_at_peak(a.mem_trace)
            _record_history(False)
        for _ in range(a.iters):
            clear()
            t0 = time.perf_counter()
            one_step(*inputs)
            _sync(device)
            times.append(time.perf_counter() - t0)
    except torch.cuda.OutOfMemoryError as e:
        return {"oom": str(e).splitlines()[0]}
    except spclient.SpdError as e:
        # A peer that ran out of memory left: this rank's op fails with it.
        return {"error": f"{type(e).__name__}: {e}"}
    r = {"peak_bytes": int(peak), "inputs_bytes": sum(x.numel() * x.element_size() for x in inputs),
         "seconds": statistics.median(times[1:] or times)}
    if trace:
        r["live_at_peak"] = traced
    return r


def sdpa_point(a, seq):
    """torch's scaled_dot_product_attention on the whole sequence, one process."""
    device = torch.device("cuda", 0)
    g = torch.Generator(device=device).manual_seed(7)
    shape = (a.batch, a.heads, seq, a.head_dim)
    try:
        q, k, v, dout = (torch.randn(shape, generator=g, device=device, dtype=DTYPES[a.dtype]) for _ in range(4))
        for x in (q, k, v):
            x.requires_grad_()
        mem = PeakMemory(device)
        times = []
        for _ in range(1 + a.iters):
            q.grad = k.grad = v.grad = None
            t0 = time.perf_counter()
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(dout)
            _sync(device)
            times.append(time.perf_counter() - t0)
        return {"peak_bytes": int(mem.peak()), "inputs_bytes": 4 * q.numel() * q.element_size(),
                "seconds": statistics.median(times[1:] or times)}
    except torch.cuda.OutOfMemoryError as e:
        return {"oom": str(e).splitlines()[0]}


# ---------------------------------------------------------------- points


def run_point(a, seq, sp, mode, backend):
    """Runs one point; returns its record (fits False, peak None when memory ran out)."""
    # The ring stages K and V (and in backward their gradients) in the arena.
    shard = a.batch * seq // sp * a.heads * a.head_dim * torch.finfo(DTYPES[a.dtype]).bits // 8
    os.environ["SPC_ARENA_BYTES"] = str(max(256 << 20, 16 * shard))
    rec = {"seq": seq, "sp": sp, "mode": mode, "backend": backend, "dtype": a.dtype, "device": a.device}
    missed = {"peak_bytes": None, "peak_with_inputs": None, "seconds": None, "fits": False}
    try:
        if mode == "sdpa":
            ranks = [tts.in_child(sdpa_point, a, seq, timeout=a.point_timeout)]
        else:
            ranks = tts.run_ranks(sp, rank_point, a, seq, mode, backend, timeout=a.point_timeout)
    except RuntimeError as e:
        # A rank that died (the kernel's OOM killer) or hung (its peer gone
        # while its stream waited) leaves no figures.
        return dict(rec, **missed, why=f"failed: {str(e).strip()[-300:]}")
    oom = [r["oom"] for r in ranks if "oom" in r]
    errors = [r["error"] for r in ranks if "error" in r]
    if oom:
        return dict(rec, **missed, why=f"out of memory: {oom[0]}")
    if errors:
        raise RuntimeError(f"seq {seq} sp {sp} {mode} {backend}: " + "; ".join(errors))
    peak = max(r["peak_bytes"] for r in ranks)
    with_inputs = max(r["peak_bytes"] + r["inputs_bytes"] for r in ranks)
    capped = with_inputs if a.count_inputs else peak
    return dict(rec, peak_bytes=peak, peak_with_inputs=with_inputs, seconds=max(r["seconds"] for r in ranks),
                fits=a.mem_cap is None or capped <= a.mem_cap, ranks=ranks)


def points(a):
    """(sp, mode, backend) series, each with its sizes upward."""
    # torch's own attention first on CUDA: the reference the others are beside.
    series = [(1, "sdpa", "torch")] if a.device == "cuda" else []
    for backend in a.backend:
        name = backend_runs(backend)
        if name is None:
            print(f"backend {backend}: this spclient.attention has no backend argument; skipped", file=sys.stderr)
            continue
        for sp in a.sp:
            for mode in (["single"] if sp == 1 else a.mode):
                if sp > 1 and mesh_shape(mode, sp) is None:
                    print(f"{mode} at SP = {sp}: needs SP a multiple of 4 (Ulysses 2 x Ring SP/2); skipped",
                          file=sys.stderr)
                    continue
                if (sp, mode, name) not in series:
                    series.append((sp, mode, name))
    return series


def meter_name(a):
    if a.device == "cuda":
        return "torch.cuda.max_memory_allocated over what was allocated before the step"
    if a.mem == "hwm":
        return "the rise of the resident set's high-water mark (VmHWM)"
    return "torch.profiler's record of every CPU allocation and free, and spd's arena's, replayed"


def _gib(n):
    return "-" if n is None else f"{n / 2**30:.3f}"


def _mib(n):
    return "-" if n is None else f"{n / 2**20:.1f}"


def by_line(points, cap, key):
    """The S at which the line through a series' two longest measured points
    reaches cap (peak memory grows linearly with S on the blockwise and flash
    backends: there, exact), or None."""
    pts = sorted((r["seq"], r[key]) for r in points if r[key] is not None)[-2:]
    if len(pts) < 2 or pts[1][1] <= pts[0][1]:
        return None
    (s0, p0), (s1, p1) = pts
    return s1 + (cap - p1) * (s1 - s0) / (p1 - p0)


def summary(records, a, log):
    """Largest S within the cap per series, beside SP = 1's and einsum's; and,
    under a cap, the S at which the line through each series' two longest points
    reaches it, over the inputs and with them, beside SP = 1's."""
    best, series = {}, {}
    for r in records:
        key = (r["sp"], r["mode"], r["backend"])
        best.setdefault(key, None)
        series.setdefault(key, []).append(r)
        if r["fits"]:
            best[key] = max(best[key] or 0, r["seq"])
    cap = "no cap" if a.mem_cap is None else f"{a.mem_cap / 2**30:.3f} GiB"
    cap += ", the inputs counted" if a.count_inputs else ", over the inputs"
    tried = f"doubling from {a.seq[0]}, {a.refine} bisections" if a.search else f"of {','.join(map(str, a.seq))}"
    log(f"\nlargest S within the memory cap ({cap}), {tried}:")
    log("| SP | mode | backend | largest S | x SP = 1 | x einsum |")
    log("|---|---|---|---|---|---|")
    ratio = lambda x, y: f"{x / y:.2f}" if x and y else "-"  # noqa: E731
    for (sp, mode, backend), s in best.items():
        one = best.get((1, "single", backend)) if mode != "sdpa" else None
        ein = best.get((sp, mode, "einsum")) if backend != "einsum" and mode != "sdpa" else None
        log(f"| {sp} | {mode} | {backend} | {s or 'none'} | {ratio(s, one) if sp > 1 else '-'} | "
            f"{ratio(s, ein)} |")
    if a.mem_cap is None:
        return
    log(f"\nS at the cap ({a.mem_cap / 2**30:.3f} GiB) on the line through each series' two longest points:")
    log("| SP | mode | backend | S, over the inputs | x SP = 1 | S, inputs counted | x SP = 1 |")
    log("|---|---|---|---|---|---|---|")
    line = {key: [by_line(pts, a.mem_cap, k) for k in ("peak_bytes", "peak_with_inputs")]
            for key, pts in series.items()}
    for (sp, mode, backend), (over, counted) in line.items():
        one = line.get((1, "single", backend), (None, None)) if sp > 1 and mode != "sdpa" else (None, None)
        log(f"| {sp} | {mode} | {backend} | {over and round(over)} | {ratio(over, one[0])} | "
            f"{counted and round(counted)} | {ratio(counted, one[1])} |")


def report(r, a, log):
    """One point's line (and JSON)."""
    if a.json:
        print(json.dumps(r), flush=True)
    if a.json_file:
        with open(a.json_file, "a") as f:
            f.write(json.dumps(r) + "\n")
    per_rank = " ".join(_mib(x["peak_bytes"]) for x in r.get("ranks", []))
    secs = "-" if r["seconds"] is None else f"{r['seconds']:.3f}"
    log(f"| {r['seq']} | {r['sp']} | {r['mode']} | {r['backend']} | {_mib(r['peak_bytes'])} | "
        f"{_mib(r['peak_with_inputs'])} | {secs} | {per_rank} |"
        + ("" if r["fits"] else f" over the cap{': ' + r['why'] if 'why' in r else ''}"))
    for x in r.get("ranks", [])[:1]:
        if "live_at_peak" in x:
            t = x["live_at_peak"]
            log(f"  rank 0 at its peak: {_gib(t['peak'])} GiB in {t['blocks']} blocks; the largest:")
            for size, where in t["top"]:
                log(f"    {size / 2**20:9.1f} MiB  {where}")


def search(a, sp, mode, point, log):
    """--search: S doubles from --seq's first until a point passes the cap, then
    --refine bisections between the last that fit and the first that did not,
    on multiples of the first S / 2^refine (and of 2 x SP)."""
    quantum = max(a.seq[0] >> a.refine, 2 * sp)
    if mode != "sdpa" and a.seq[0] % quantum or quantum % (2 * sp):
        log(f"--search from S {a.seq[0]}: not a multiple of 2 x SP = {2 * sp} after {a.refine} halvings; skipped")
        return
    lo, hi = None, a.seq[0]
    while point(hi):
        lo, hi = hi, 2 * hi
    for _ in range(a.refine if lo else 0):
        mid = (lo + hi) // 2 // quantum * quantum
        if mid in (lo, hi):
            break
        if point(mid):
            lo = mid
        else:
            hi = mid


def parse_list(text, kind=str):
    return [kind(x) for x in text.split(",") if x]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spd", help="start a private spd from this binary (else use $SPC_SOCKET's)")
    ap.add_argument("--seq", type=lambda t: parse_list(t, int), default=[4096, 8192, 16384])
    ap.add_argument("--sp", type=lambda t: parse_list(t, int), default=[1, 2, 4])
    ap.add_argument("--mode", type=parse_list, default=["ulysses", "ring"],
                    help="ulysses, ring, hybrid (Ulysses 2 x Ring SP/2), comma-separated")
    ap.add_argument("--backend", type=parse_list, default=["auto"],
                    help="attention backends, comma-separated: auto, blockwise, flash, einsum")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cuda: rank r on GPU r mod the GPU count (one GPU may hold every rank)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--iters", type=int, default=0, help="timed runs after the first (the time is their median)")
    ap.add_argument("--mem-cap", type=float, default=None, help="bytes a rank may use (e.g. 8e9)")
    ap.add_argument("--count-inputs", action="store_true",
                    help="the cap holds the inputs too (q, k, v, dout; with --layer proj, x and dy)")
    ap.add_argument("--mem", choices=("auto", "profiler", "hwm"), default="auto",
                    help="the host's meter: profiler (every allocation of torch and of spd's arena, exact; "
                         "auto on the CPU) or hwm (the resident set's high-water mark); CUDA: the allocator's")
    ap.add_argument("--search", action="store_true",
                    help="S doubles from --seq's first until past --mem-cap, then --refine bisections")
    ap.add_argument("--refine", type=int, default=3, help="bisections after --search's doubling")
    ap.add_argument("--layer", choices=("attention", "proj"), default="attention",
                    help="proj: x -> q, k, v projection -> attention -> output projection")
    ap.add_argument("--head-chunks", type=int, default=None,
                    help="attention(..., head_chunks=N): Ulysses over N head groups in turn (default: its own)")
    ap.add_argument("--point-timeout", type=float, default=600, help="seconds one point may take")
    ap.add_argument("--mem-trace", type=int, default=0, metavar="N",
                    help="CUDA: print the N largest blocks rank 0 holds at its peak, and where each was made")
    ap.add_argument("--json", action="store_true", help="one JSON object per point on stdout")
    ap.add_argument("--json-file", help="append one JSON object per point here too")
    a = ap.parse_args(argv)
    for m in a.mode:
        if m not in ("ulysses", "ring", "hybrid"):
            ap.error(f"--mode: {m} is not ulysses, ring or hybrid")
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if a.json else print
    # A fixed mmap threshold: large blocks are mapped and unmapped as they come
    # and go, so the resident set follows what is live (glibc otherwise raises
    # the threshold after a free and keeps freed blocks resident in its heap).
    ctypes.CDLL(None).mallopt(-3, 1 << 17)          # M_MMAP_THRESHOLD
    stop = tts.start_spd(a.spd) if a.spd else None
    records = []
    try:
        log(f"attention forward + backward, {a.dtype} on {a.device}, B {a.batch}, H {a.heads}, D {a.head_dim}"
            f"{'' if HAS_BACKEND else ' (spclient.attention without backends: einsum)'}")
        log(f"peak memory: {meter_name(a)}")
        log("| S | SP | mode | backend | peak MiB per rank | with inputs | seconds | ranks' peak MiB |")
        log("|---|---|---|---|---|---|---|---|")
        for sp, mode, backend in points(a):
            def point(seq, sp=sp, mode=mode, backend=backend):
                r = run_point(a, seq, sp, mode, backend)
                records.append(r)
                report(r, a, log)
                return r["fits"]
            if a.search:
                search(a, sp, mode, point, log)
                continue
            for seq in a.seq:
                if mode != "sdpa" and seq % (2 * sp):
                    log(f"S {seq} is not a multiple of 2 x SP = {2 * sp}; skipped")
                    continue
                if not point(seq):
                    break
        summary(records, a, log)
    finally:
        if stop:
            stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
