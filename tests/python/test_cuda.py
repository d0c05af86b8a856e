"""The binding's ops on CUDA tensors through a real spd: 2 to 4 rank processes on
one GPU, every result copied to the host and compared with a reference computed
here, on the CPU, from every rank's inputs (not through spd).

  allreduce   fp32, fp64, bf16 sums (rank order: the same bits as the host sum
              in rank order, 16-bit folded in fp32), max and min; in place and
              out of place;
  alltoall    Ulysses seq->head and back through spclient.torch, with dummy
              heads and padding rows (H = 6 over P = 4, S = 10), and the
              backward of seq->head;
  shift       cyclic, linear and reverse, two tensors of other sizes, and the
              backward;
  alltoallv   uneven rows on 4 ranks, one holding and getting nothing, one
              sending only to itself, and the backward (the transposed op);
  streams     an op on a non-default torch stream after a kernel on it sees the
              kernel's result, later kernels see the op's result, with no
              synchronize; the i-form on the side stream; an error of a stream-
              ordered op raised by synchronize() and the stream still usable;
  regions     one registration per allocation, freed and reused allocations
              registered afresh, the cache bounded; tensors of expandable
              segments (cuMem memory) across chunk edges, registered again
              after empty_cache remapped their chunks;
  attention   Ulysses and zigzag Ring attention, forward and backward, against
              attention written out token by token; a length that does not
              split evenly, its layout from each rank's ids on the GPU, q, k, v
              as BSHD and as BHSD views;
  training    client/examples/train_tiny_sp.py on the GPU: every SP
              configuration matches SP = 1 as on the host, and the losses are
              the host's within fp32 rounding.
  per GPU     where torch sees several GPUs, 4 ranks each on cuda:(rank mod
              the GPU count): all-reduce in and out of place, Ulysses seq->head
              and the ring shift, bit for bit as above (skipped on one GPU).

The ops run in stream order where libspclient and spd can, else host-
synchronously; the first group of tests runs both ways (attach(streams=False)).
Skipped, with the reason, where torch sees no GPU.
"""
import json
import os
import subprocess
import sys
import time

import pytest
import torch

import spclient
import spclient.torch as spt
from conftest import ROOT, in_child, run_ranks


def _gpus():
    """torch's GPU count, asked in a child process: this one forks the ranks, and
    the CUDA driver does not survive a fork once initialised."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        return int(out.stdout.strip() or 0), out.stderr.strip().splitlines()[-1:] or [""]
    except (subprocess.SubprocessError, ValueError) as e:
        return 0, [str(e)]


_count, _why = _gpus()
if _count == 0:
    pytest.skip(f"no CUDA device: torch {torch.__version__} says torch.cuda.is_available() is False "
                f"{_why[0]}".rstrip(), allow_module_level=True)

DEV = "cuda:0"
STREAMS = [pytest.param({}, id="stream"), pytest.param({"streams": False}, id="hostsync")]


@pytest.fixture(scope="module", autouse=True)
def gpu_spd(spd):
    with spclient.attach(socket=spd) as h:
        st = h.query("status")[0]
    if st.get("gpu_status") == "built without CUDA":
        pytest.skip("spd was built without CUDA: it cannot import GPU memory")
    assert st.get("gpus", 0) > 0, f"torch sees a GPU, spd does not: {st.get('gpu_status')}"
    return spd


def _rand(shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _mode(h):
    return h.gpu_status()["mode"]


# ---------------------------------------------------------------- allreduce


@pytest.mark.parametrize("attach", STREAMS)
def test_allreduce(spd, attach):
    P, n = 3, 4099

    def rank_fn(h, world, rank, size):
        out = {}
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            x = _rand((n,), 10 * rank + 1, dtype).to(DEV)
            y = h.allreduce(world, x, torch.empty_like(x))          # out of place
            h.allreduce(world, x)                                   # in place
            out[str(dtype)] = (y.cpu(), x.cpu())
        m = _rand((n,), 10 * rank + 2).to(DEV)
        out["max"] = h.allreduce(world, m, torch.empty_like(m), op="max").cpu()
        out["min"] = h.allreduce(world, m, torch.empty_like(m), op="min").cpu()
        return out, _mode(h)

    res = run_ranks(P, rank_fn, attach=attach, timeout=120)
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        xs = [_rand((n,), 10 * r + 1, dtype) for r in range(P)]
        acc = xs[0].float() if dtype == torch.bfloat16 else xs[0].clone()
        for x in xs[1:]:                                            # rank order, fp32 for 16-bit
            acc = acc + (x.float() if dtype == torch.bfloat16 else x)
        want = acc.to(dtype)
        for r, (out, _) in enumerate(res):
            for got, how in zip(out[str(dtype)], ("out of place", "in place")):
                assert torch.equal(got, want), f"rank {r} {dtype} {how}: max diff {(got - want).abs().max()}"
    ms = torch.stack([_rand((n,), 10 * r + 2) for r in range(P)])
    for r, (out, _) in enumerate(res):
        assert torch.equal(out["max"], ms.max(0).values) and torch.equal(out["min"], ms.min(0).values)
    want_mode = "host-synchronous" if attach else None
    if want_mode:
        assert all(mode == want_mode for _, mode in res)


# ---------------------------------------------------------------- Ulysses all-to-all


def _seq_to_head_ref(full, P, heads):
    """[B, S, H, D] of the whole sequence -> rank p's [B, S, H_pad/P, D]: heads
    padded with zero dummies to a multiple of P, dealt out in order."""
    B, S, H, D = full.shape
    hp = -(-heads // P) * P
    padded = torch.cat([full, torch.zeros(B, S, hp - H, D, dtype=full.dtype)], dim=2)
    return [padded[:, :, p * hp // P:(p + 1) * hp // P] for p in range(P)]


def _head_to_seq_ref(parts, P, heads, S):
    """The inverse: rank p's rows [p*S_loc, (p+1)*S_loc) of every real head, rows
    past S zero."""
    full = torch.cat(parts, dim=2)[:, :, :heads]
    s_loc = -(-S // P)
    B, _, H, D = full.shape
    full = torch.cat([full, torch.zeros(B, s_loc * P - S, H, D, dtype=full.dtype)], dim=1)
    return [full[:, p * s_loc:(p + 1) * s_loc] for p in range(P)]


def _local_rows(full, P, p):
    """Rank p's sequence shard [B, S_loc, H, D] (rows past S arbitrary: 7s)."""
    B, S, H, D = full.shape
    s_loc = -(-S // P)
    out = torch.full((B, s_loc, H, D), 7.0, dtype=full.dtype)
    rows = full[:, p * s_loc:min(S, (p + 1) * s_loc)]
    out[:, :rows.shape[1]] = rows
    return out


@pytest.mark.parametrize("attach", STREAMS)
@pytest.mark.parametrize("P,S,H", [(2, 8, 4), (4, 10, 6)])   # the second: padding rows, 2 dummy heads
def test_ulysses_alltoall(spd, attach, P, S, H):
    B, D = 2, 5

    def rank_fn(h, world, rank, size):
        x = _local_rows(_rand((B, S, H, D), 1), size, rank).to(DEV).requires_grad_(True)
        (y,) = spt.seq_to_head(h, world, S, (H,), x)
        w = _rand(tuple(y.shape), 100 + rank).to(DEV)
        (y * w).sum().backward()
        (back,) = spt.head_to_seq(h, world, S, (H,), y.detach())
        return y.detach().cpu(), back.cpu(), x.grad.cpu(), _mode(h)

    res = run_ranks(P, rank_fn, attach=attach, timeout=120)
    full = _rand((B, S, H, D), 1)
    heads = _seq_to_head_ref(full, P, H)
    backs = _head_to_seq_ref(heads, P, H, S)
    grads = _head_to_seq_ref([_rand(tuple(heads[p].shape), 100 + p) for p in range(P)], P, H, S)
    for p, (y, back, gx, _) in enumerate(res):
        assert torch.equal(y, heads[p]), f"rank {p}: seq->head"
        assert torch.equal(back, backs[p]), f"rank {p}: head->seq"
        assert torch.equal(gx, grads[p]), f"rank {p}: the gradient of seq->head"
        assert y.shape[2] == -(-H // P)


# ---------------------------------------------------------------- shift


@pytest.mark.parametrize("attach", STREAMS)
@pytest.mark.parametrize("linear,reverse", [(False, False), (True, False), (False, True)])
def test_shift(spd, attach, linear, reverse):
    P = 4

    def rank_fn(h, world, rank, size):
        a = _rand((3, 50), rank).to(DEV).requires_grad_(True)
        b = _rand((7,), 10 + rank, torch.float64).to(DEV)
        ya, yb = spt.shift(h, world, a, b, linear=linear, reverse=reverse)
        (ya * (rank + 1.0)).sum().backward()
        return ya.detach().cpu(), yb.cpu(), a.grad.cpu()

    res = run_ranks(P, rank_fn, attach=attach, timeout=120)
    step = -1 if reverse else 1
    for r, (ya, yb, ga) in enumerate(res):
        src = r - step
        if linear and not 0 <= src < P:
            assert torch.equal(ya, torch.zeros(3, 50)) and torch.equal(yb, torch.zeros(7, dtype=torch.float64))
        else:
            src %= P
            assert torch.equal(ya, _rand((3, 50), src)) and torch.equal(yb, _rand((7,), 10 + src, torch.float64))
        dst = r + step                       # where a went: its gradient is that rank's weight
        want = torch.zeros(3, 50) if linear and not 0 <= dst < P else torch.full((3, 50), dst % P + 1.0)
        assert torch.equal(ga, want), f"rank {r}: gradient {ga[0, 0]}, expected {want[0, 0]}"


# ---------------------------------------------------------------- alltoallv


@pytest.mark.parametrize("attach", STREAMS)
def test_alltoallv(spd, attach):
    P, D = 4, 6
    C = [[2, 1, 0, 3], [0, 4, 0, 0], [1, 1, 0, 2], [0, 0, 0, 0]]   # C[i][j]: rows rank i sends rank j

    def rank_fn(h, world, rank, size):
        x = _rand((sum(C[rank]), D), 70 + rank).to(DEV).requires_grad_(True)
        y = spt.alltoallv(h, world, x, C[rank], [C[i][rank] for i in range(P)])
        (y * _rand(tuple(y.shape), 80 + rank).to(DEV)).sum().backward()
        return y.detach().cpu(), x.grad.cpu()

    res = run_ranks(P, rank_fn, attach=attach, timeout=120)
    xs = [_rand((sum(C[i]), D), 70 + i) for i in range(P)]
    grads = [torch.zeros_like(x) for x in xs]
    for j, (y, _) in enumerate(res):
        blocks = [xs[i][sum(C[i][:j]):sum(C[i][:j + 1])] for i in range(P)]
        assert torch.equal(y, torch.cat(blocks)), f"rank {j}: forward"
        w, at = _rand(tuple(y.shape), 80 + j), 0
        for i in range(P):                   # the gradient of block i -> j is j's weights there
            grads[i][sum(C[i][:j]):sum(C[i][:j + 1])] = w[at:at + C[i][j]]
            at += C[i][j]
    for i, (_, gx) in enumerate(res):
        assert torch.equal(gx, grads[i]), f"rank {i}: gradient"


# ---------------------------------------------------------------- stream order


def test_stream_order(spd):
    """On a side torch stream: a long kernel, then x.mul_(2), then the all-reduce
    of x, then z = x * 3, then z to the host. No synchronize anywhere: the op
    must read x after the mul and z must see the sum. In stream order the call
    returns long before the kernel ahead of it is done."""
    P, n = 2, 1 << 22

    def rank_fn(h, world, rank, size):
        s = torch.cuda.Stream(device=DEV)
        with torch.cuda.stream(s):
            x = torch.ones(n, device=DEV)
            h.allreduce(world, x)                 # registers x's allocation, makes the spc stream
            warm = x[0].item()
            x.fill_(rank + 1)
            torch.cuda._sleep(500_000_000)        # about 0.25 s of GPU time ahead of the op
            x.mul_(2)
            t0 = time.monotonic()
            h.allreduce(world, x)
            returned = time.monotonic() - t0
            z = x * 3
            got = z.cpu()                         # waits for s, only
            # The i-form: on the side stream; wait() orders the current stream.
            y = torch.full((n,), float(rank + 1), device=DEV)
            req = h.iallreduce(world, y)
            y2 = req.wait() * 2
            got2 = y2.cpu()
        return got[:3].tolist(), got[-1].item(), got2[:2].tolist(), returned, _mode(h), warm

    res = run_ranks(P, rank_fn, timeout=120)
    want = 3 * sum(2.0 * (r + 1) for r in range(P))
    for r, (head, last, y2, returned, mode, warm) in enumerate(res):
        assert head == [want] * 3 and last == want, f"rank {r}: {head} {last}, expected {want}"
        assert y2 == [2 * sum(q + 1.0 for q in range(P))] * 2 and warm == P
        if mode == "stream":
            assert returned < 0.1, f"rank {r}: the stream-ordered all-reduce took {returned:.3f} s to return"
    print("mode:", res[0][4])


def test_stream_error_surfaces(spd):
    """Ranks disagree (count 8 against 9): the error comes back, at the call
    (host-synchronous) or from synchronize() (stream order), and the next op on
    the stream runs."""
    def rank_fn(h, world, rank, size):
        x = torch.ones(8 + rank, device=DEV)
        with pytest.raises(spclient.MismatchError):
            h.allreduce(world, x)
            h.synchronize()
        y = torch.ones(5, device=DEV)
        h.allreduce(world, y)
        h.synchronize()
        return y.cpu().tolist()

    assert run_ranks(2, rank_fn, timeout=120) == [[2.0] * 5] * 2


# ---------------------------------------------------------------- regions


def test_registrations_per_allocation(spd):
    """Views and slices of one allocation: one registration. An allocation freed
    (empty_cache) and made again: registered afresh, results right. Twelve big
    allocations with at most 4 kept registered: the cache stays bounded, and an
    op on an evicted one registers it again."""
    from cuda_where import allocation

    def rank_fn(h, world, rank, size):
        base = torch.zeros(1 << 16, device=DEV)
        parts = [base[i * 1000:(i + 1) * 1000] for i in range(5)]
        for i, p in enumerate(parts):
            p.fill_(rank + i)
            h.allreduce(world, p)
        first = h.gpu_status()
        sums = [p[0].item() for p in parts]
        del parts, base, p
        torch.cuda.empty_cache()
        again = torch.full((1 << 16,), float(rank), device=DEV)
        h.allreduce(world, again)
        after = h.gpu_status()
        big = [torch.full((3 << 20,), float(rank + i), device=DEV) for i in range(12)]   # 12 MiB each
        nbig = len({allocation(b.data_ptr())[0] for b in big})
        for b in big:
            h.allreduce(world, b)
        ok = [b[-1].item() == sum(q + i for q in range(size)) for i, b in enumerate(big)]
        h.allreduce(world, big[0])                      # evicted long ago
        ok.append(big[0][0].item() == size * sum(range(size)))
        return first, sums, again[0].item(), after, ok, nbig, h.gpu_status()

    res = run_ranks(2, rank_fn, attach={"max_device_regions": 4}, timeout=120)
    for first, sums, again, after, ok, nbig, last in res:
        assert first["registrations"] == 1, first
        assert sums == [sum(q + i for q in range(2)) for i in range(5)]
        assert again == 1.0 and after["registrations"] == 2 and after["dropped"] >= 1, after
        assert all(ok), ok
        assert nbig > 4, f"the big tensors share allocations: {nbig}"
        assert last["regions"] <= 4 and last["registrations"] == 2 + nbig + 1, last


# The ranks of test_expandable_segments, in a process started with
# PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: torch reads it when its
# allocator starts, and this process's forks inherit torch from here.
_EXPANDABLE = r"""
import json, os, sys
sys.path[:0] = sys.argv[1:3]                          # tests/python, client/python
import torch
import spclient
from conftest import run_ranks
from cuda_where import allocation

SIZES = [1000, 300_000, 3 << 20, 7 << 20, 12 << 20]   # fp32: 4 KB to 48 MB, over 2 and 20 MiB pages

def rank_fn(h, world, rank, size):
    dev = "cuda:0"
    want = lambda base, i: float(sum(r + base + i for r in range(size)))
    xs = [torch.full((n,), float(rank + 1 + i), device=dev) for i, n in enumerate(SIZES)]
    vmm = [allocation(x.data_ptr())[1] for x in xs]
    try:
        for x in xs:
            h.allreduce(world, x)
    except spclient.UnsupportedError as e:
        return {"unsupported": str(e)}
    ok = [bool((x == want(1, i)).all()) for i, x in enumerate(xs)]
    v = xs[4][12345:(10 << 20)]                       # a view over the pages of the biggest
    h.allreduce(world, v)
    ok.append(bool((v == want(1, 4) * size).all()) and bool((xs[4][:12345] == want(1, 4)).all()))
    # Everything freed and the pages given back: the same sizes land on
    # chunks mapped anew, whose registrations must be made again.
    del xs, v
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    ys = [torch.full((n,), float(rank + i), device=dev) for i, n in enumerate(SIZES)]
    for y in ys:
        h.allreduce(world, y)
    ok += [bool((y == want(0, i)).all()) for i, y in enumerate(ys)]
    h.synchronize()
    entries = h._gpu.regions.entries()
    # This rank's client by its job rank: a second handle of this process
    # (same pid) would list no regions.
    me = [c for c in h.query("clients") if c["pid"] == os.getpid() and c["rank"] == rank]
    return {"vmm": vmm, "ok": ok, "last": h.gpu_status(), "mine": len(entries),
            "mine_bytes": sum(e[1] for e in entries), "spd": [[c["device_regions"], c["device_bytes"]] for c in me]}

print(json.dumps(run_ranks(2, rank_fn, attach=json.loads(sys.argv[3]), timeout=240)))
"""


@pytest.mark.parametrize("attach", STREAMS)
def test_expandable_segments(spd, attach):
    """All-reduces on tensors of PyTorch's expandable segments (cuMem memory,
    chunks mapped on demand into one huge reservation), across chunk edges and
    on a view: results right, spd holding what the binding registered; after
    empty_cache the chunks are new and registered again."""
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    out = subprocess.run([sys.executable, "-c", _EXPANDABLE, os.path.dirname(__file__),
                          os.path.join(ROOT, "client", "python"), json.dumps(attach)],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    if "unsupported" in res[0]:
        pytest.skip(f"torch {torch.__version__} makes expandable segments spd cannot import: {res[0]['unsupported']}")
    if not any(res[0]["vmm"]):
        pytest.skip(f"torch {torch.__version__} made no cuMem memory with expandable_segments:True")
    for r, got in enumerate(res):
        assert all(got["vmm"]), f"rank {r}: some tensors are not cuMem memory: {got['vmm']}"
        assert all(got["ok"]), f"rank {r}: wrong results: {got['ok']}"
        assert got["last"]["dropped"] >= 1, got["last"]
        assert got["spd"] == [[got["mine"], got["mine_bytes"]]], got
        # The registrations are runs of chunks, never the reservation (GiBs).
        assert got["mine_bytes"] < 1 << 30, got


@pytest.mark.parametrize("attach", STREAMS)
def test_one_rank_per_gpu(spd, attach):
    if _count < 2:
        pytest.skip(f"one rank per GPU needs two GPUs; torch sees {_count}")
    P, B, S, H, D, n = 4, 2, 12, 8, 16, 4099

    def rank_fn(h, world, rank, size):
        dev = torch.device("cuda", rank % _count)
        x = _rand((n,), 10 * rank + 1, torch.bfloat16).to(dev)
        y = h.allreduce(world, x, torch.empty_like(x))
        h.allreduce(world, x)
        (heads,) = spt.seq_to_head(h, world, S, (H,), _local_rows(_rand((B, S, H, D), 1), size, rank).to(dev))
        (prev,) = spt.shift(h, world, _rand((3, 50), rank).to(dev))
        return y.cpu(), x.cpu(), heads.cpu(), prev.cpu(), str(y.device), _mode(h)

    res = run_ranks(P, rank_fn, attach=attach, timeout=120)
    acc = _rand((n,), 1, torch.bfloat16).float()
    for r in range(1, P):                                       # rank order, in fp32
        acc = acc + _rand((n,), 10 * r + 1, torch.bfloat16).float()
    want, heads = acc.to(torch.bfloat16), _seq_to_head_ref(_rand((B, S, H, D), 1), P, H)
    for r, (y, x, hd, prev, where, _) in enumerate(res):
        assert where == f"cuda:{r % _count}"
        assert torch.equal(y, want) and torch.equal(x, want), f"rank {r}: all-reduce"
        assert torch.equal(hd, heads[r]), f"rank {r}: seq->head"
        assert torch.equal(prev, _rand((3, 50), (r - 1) % P)), f"rank {r}: shift"


def test_mixed_devices_refused(spd):
    def rank_fn(h, world, rank, size):
        with pytest.raises(ValueError, match="one GPU or all in host memory"):
            h.allreduce(world, torch.ones(4, device=DEV), torch.ones(4))
        with pytest.raises(TypeError, match="register CUDA tensors"):
            h.register(torch.ones(4, device=DEV))
        return True

    assert run_ranks(2, rank_fn, timeout=120) == [True, True]


# ---------------------------------------------------------------- attention and training


@pytest.mark.parametrize("attach", STREAMS)
@pytest.mark.parametrize("ulysses,ring,heads,kv_heads,head_chunks", [
    (2, 1, 4, 2, None), (2, 1, 4, 2, 0), (1, 3, 4, 2, None), (1, 3, 4, 2, 0), (2, 2, 4, 2, None),
    (2, 2, 4, 2, 0), (4, 1, 6, 2, None), (2, 1, 6, 3, 2)])
def test_sp_attention_cuda(spd, attach, ulysses, ring, heads, kv_heads, head_chunks):
    """Ring attention's K/V shifts are i-forms: on the side stream, or host-
    synchronous requests. Ulysses and Ring over head groups in turn
    (head_chunks None: as chosen; 2: 3 KV heads in groups of 2 and 1) and
    untiled (0)."""
    import spclient.attention as spa
    from test_attention import positions, reference, tensors

    def rank_fn(h, world, rank, size):
        mesh = h.mesh(sp=size, heads=heads, kv_heads=kv_heads, ulysses=ulysses, ring=ring)
        layout = spa.SeqLayout.for_mesh(positions(), mesh)
        q, k, v, w = (t[:, layout.local].to(DEV) for t in tensors(heads, kv_heads))
        for t in (q, k, v):
            t.requires_grad_(True)
        o = spa.SPAttention(h, mesh, heads, kv_heads, head_chunks=head_chunks)(layout, q, k, v)
        (o * w).sum().backward()
        return layout.local, o.detach().cpu(), q.grad.cpu(), k.grad.cpu(), v.grad.cpu()

    out = run_ranks(ulysses * ring, rank_fn, attach=attach, timeout=120)

    def ref():
        q, k, v, w = tensors(heads, kv_heads)
        for t in (q, k, v):
            t.requires_grad_(True)
        o = reference(q, k, v, positions())
        (o * w).sum().backward()
        return o, q.grad, k.grad, v.grad

    o, qg, kg, vg = in_child(ref)   # backward() here would start CUDA in this process
    for idx, o_r, dq, dk, dv in out:
        for got, want, what in ((o_r, o, "out"), (dq, qg, "dq"), (dk, kg, "dk"), (dv, vg, "dv")):
            err = (got - want.detach()[:, idx]).abs().max().item()
            assert err < 1e-12, f"{what}: max error {err}"


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2), (2, 2)])
def test_head_groups_flash_bf16(spd, ulysses, ring):
    """Head groups in turn on torch's flash kernel (bf16, what attention
    chooses there): out, dq, dk, dv within bf16's error of fp64 attention, as
    the untiled path is."""
    import spclient.attention as spa
    from spclient import flash

    heads, kv_heads, D, S = 8, 2, 64, 256
    pos = torch.arange(S)[None]

    def inputs():
        g = torch.Generator().manual_seed(3)
        return [torch.randn(1, S, n, D, generator=g, dtype=torch.float64) for n in (heads, kv_heads, kv_heads, heads)]

    def rank_fn(h, world, rank, size):
        why = flash.why_not(torch.zeros(1, 1, 1, D, dtype=torch.bfloat16, device=DEV))
        if why is not None:
            return why
        mesh = h.mesh(sp=size, heads=heads, kv_heads=kv_heads, ulysses=ulysses, ring=ring)
        layout = spa.SeqLayout.for_mesh(pos, mesh)
        got = {}
        for chunks in (None, 0):
            q, k, v, w = (t[:, layout.local].to(DEV, torch.bfloat16) for t in inputs())
            for t in (q, k, v):
                t.requires_grad_(True)
            o = spa.attention(h, mesh, layout, q, k, v, heads, kv_heads, head_chunks=chunks)
            (o.float() * w.float()).sum().backward()
            got[chunks] = [t.detach().cpu().double() for t in (o, q.grad, k.grad, v.grad)]
        return layout.local, got

    out = run_ranks(ulysses * ring, rank_fn, timeout=120)
    if isinstance(out[0], str):
        pytest.skip(f"no flash kernel: {out[0]}")

    def ref():
        q, k, v, w = inputs()
        for t in (q, k, v):
            t.requires_grad_(True)
        o = spa.softmax_attention(q, k, v, torch.ones(S, S, dtype=torch.bool).tril()[None])
        (o * w).sum().backward()
        return [t.detach() for t in (o, q.grad, k.grad, v.grad)]

    want = in_child(ref)    # backward() here would start CUDA in this process
    for idx, got in out:
        for chunks, grads in got.items():
            for name, a, b in zip(("out", "dq", "dk", "dv"), grads, want):
                err = ((a - b[:, idx]).abs().max() / b.abs().max()).item()
                assert err < 3e-2, f"head_chunks {chunks} {name}: bf16 error {err}"


@pytest.mark.parametrize("qkv_layout", ["bshd", "bhsd"])
@pytest.mark.parametrize("ulysses,ring,S", [(2, 1, 21), (1, 2, 21), (2, 2, 21)])
def test_any_length_cuda(spd, ulysses, ring, S, qkv_layout):
    """A sequence that does not split evenly, its layout from each rank's own
    ids on the GPU (from_local), q, k, v as [B, S, H, D] or as HF's [B, H, S, D]
    views: the real tokens' attention and gradients are full attention's."""
    import spclient.attention as spa
    from test_layout import documents, positions, reference, tensors
    heads, kv_heads = 4, 2

    def rank_fn(h, world, rank, size):
        mesh = h.mesh(sp=size, heads=heads, kv_heads=kv_heads, ulysses=ulysses, ring=ring)
        mine = spa.SeqLayout.for_mesh(positions(S), mesh).position_ids.to(DEV)
        layout = spa.SeqLayout.from_local(h, mesh, mine, seq_len=S)
        q, k, v, w = (t[:, layout.local].to(DEV) for t in tensors(S, heads, kv_heads))
        for t in (q, k, v):
            t.requires_grad_(True)
        if qkv_layout == "bhsd":
            o = spa.attention(h, mesh, layout, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), heads,
                              kv_heads, qkv_layout="bhsd").transpose(1, 2)
        else:
            o = spa.attention(h, mesh, layout, q, k, v, heads, kv_heads)
        (o * w).sum().backward()
        return layout.local, o.detach().cpu(), q.grad.cpu(), k.grad.cpu(), v.grad.cpu()

    out = run_ranks(ulysses * ring, rank_fn, timeout=120)

    def ref():
        q, k, v, w = tensors(S, heads, kv_heads)
        for t in (q, k, v):
            t.requires_grad_(True)
        o = reference(q, k, v, documents(positions(S)))
        (o * w).sum().backward()
        return o, q.grad, k.grad, v.grad

    o, qg, kg, vg = in_child(ref)   # backward() here would start CUDA in this process
    assert sorted(torch.cat([r[0] for r in out]).tolist()) == list(range(S))
    for idx, o_r, dq, dk, dv in out:
        for got, want, what in ((o_r, o, "out"), (dq, qg, "dq"), (dk, kg, "dk"), (dv, vg, "dv")):
            err = (got - want.detach()[:, idx]).abs().max().item()
            assert err < 1e-12, f"{what}: max error {err}"


def test_train_tiny_on_the_gpu(spd):
    """train_tiny_sp.py --device cuda, 3 steps: every configuration meets the
    targets against SP = 1 on the GPU, and the GPU's losses are the host's
    within rounding (fp64: 1e-9; fp32: 1e-4 over the 3 AdamW steps)."""
    sys.path.insert(0, os.path.join(ROOT, "client", "examples"))
    import train_tiny_sp as T

    for dtype, target, host_tol in ((torch.float64, 1e-10, 1e-9), (torch.float32, 1e-5, 1e-4)):
        gpu_table, gpu_curves = T.experiment(dtype, 3, log=print, device="cuda")
        # The host run in a child: its backward() would start CUDA in this process.
        cpu_curves = in_child(lambda: T.experiment(dtype, 3, configs=[], log=print)[1])
        for name, rows in gpu_table.items():
            for task, (dloss, dgrad, dlp, _) in rows.items():
                print(f"{dtype} {name} {task}: loss {dloss:.2e} grad {dgrad:.2e} log-prob {dlp:.2e}")
                assert dloss <= target, f"{dtype} {name} {task}: loss differs from SP = 1 by {dloss}"
                assert dgrad <= target, f"{dtype} {name} {task}: gradient differs from SP = 1 by {dgrad}"
        for name, curves in gpu_curves.items():
            for task, losses in curves.items():
                d = max(abs(a - b) for a, b in zip(losses, cpu_curves["SP=1"][task]))
                assert d <= host_tol, f"{dtype} {name} {task}: GPU loss differs from the host's by {d}"


def test_lse_merge_cuda():
    """spclient.torch.lse_merge on CUDA tensors, enqueued on a side stream behind
    the copies that made its inputs: the bits of the CPU merge (the host
    reference), both layouts, rows of head_dim in fours and not, -inf rows; and
    the definition in float64 (test_lse_merge.py's)."""
    from test_lse_merge import _close, _reference, _sides

    cases = [(layout, shape) for layout in (spclient.BSHD, spclient.SBHD) for shape in ((2, 300, 4, 64), (1, 37, 3, 7))]

    def run():
        side, got = torch.cuda.Stream(), []
        for layout, shape in cases:
            xs = _sides(*shape, layout=layout, seed=5)
            with torch.cuda.stream(side):
                g = [x.cuda() for x in xs]
                out, lse = spt.lse_merge(*g, layout=layout)
                got.append((out.cpu(), lse.cpu()))
        return got

    for (layout, shape), (out, lse) in zip(cases, in_child(run)):
        out_a, lse_a, out_b, lse_b = _sides(*shape, layout=layout, seed=5)
        cpu_out, cpu_lse = spt.lse_merge(out_a.clone(), lse_a.clone(), out_b, lse_b, layout=layout)
        assert torch.equal(out, cpu_out) and torch.equal(lse, cpu_lse), f"{layout} {shape}: not the host's bits"
        want_out, want_lse = _reference(out_a, lse_a, out_b, lse_b, layout)
        _close(lse, want_lse, "lse")
        _close(out, want_out, "out")
