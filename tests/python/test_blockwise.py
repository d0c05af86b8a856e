"""Attention blocks on every backend that runs on the host (blockwise, einsum;
flash, on a GPU, is test_cuda_blockwise.py's) against full attention over the
whole sequence, a zigzag ring played out in one process; the tiles blockwise
skips; and that blockwise never holds a [Sq, Sk] tensor."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import spclient.attention as spa
from spclient import blockwise, flash

# Packed documents per batch row (lengths); each row adds up to S.
S = 48
DOCS = [[5, 13, 1, 20, 9], [48]]


def doc_ids(rows):
    """[B, S] document index of every token, from the document lengths."""
    return torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in rows])


def dense_mask(rows):
    """[B, S, S]: causal inside each document, written out document by document."""
    n = sum(rows[0])
    m = torch.zeros(len(rows), n, n, dtype=torch.bool)
    for b, row in enumerate(rows):
        at = 0
        for n in row:
            m[b, at:at + n, at:at + n] = torch.ones(n, n, dtype=torch.bool).tril()
            at += n
    return m


def reference(q, k, v, mask):
    """Plain softmax attention over the whole sequence, heads of k and v repeated
    for GQA (kv head j serves query heads j*g ..)."""
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    p = torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def zigzag(ring, rank, n=S):
    """Ring rank `rank`'s tokens of n: chunks rank and 2R-1-rank of 2R."""
    c = n // (2 * ring)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * ring - 1 - rank) * c,
                                                                           (2 * ring - rank) * c)])


def tensors(heads, kv_heads, dtype, D=8, seed=3, B=len(DOCS), S=S):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, S, heads, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, kv_heads, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, S, kv_heads, D, generator=g, dtype=torch.float64)
    w = torch.randn(B, S, heads, D, generator=g, dtype=torch.float64)
    return [t.to(dtype) for t in (q, k, v, w)]


def ring_in_one_process(backend, q, k, v, w, ring, docs):
    """A zigzag ring of `ring` ranks played out block by block: every rank's
    output, merged over its blocks, and the gradients of (out * w).sum(), each
    block's backward given the final lse, scattered back to the whole sequence.
    A ring of one runs as attention() runs it: its block alone (out in q's
    dtype) and its gradients added into dq in q's dtype."""
    scale, n = 1.0 / math.sqrt(q.shape[-1]), q.shape[1]
    out, dq, dk, dv = (torch.zeros(t.shape, dtype=torch.float64, device=q.device) for t in (q, q, k, v))
    for me in range(ring):
        mine = zigzag(ring, me, n)
        qm, wm = q[:, mine], w[:, mine]
        o = lse = None
        for src in range(ring):
            theirs = zigzag(ring, src, n)
            blk = spa.block_forward(backend, qm, k[:, theirs], v[:, theirs], mine, theirs, docs, scale,
                                    alone=ring == 1)
            if blk is not None:
                o, lse = spa._merge(o, lse, *blk)
        o = o.to(q.dtype)
        out[:, mine] = o.double()
        delta = (wm.to(lse.dtype) * o.to(lse.dtype)).sum(-1).transpose(1, 2)
        for src in range(ring):
            theirs = zigzag(ring, src, n)
            acc = blockwise.acc_dtype(q.dtype)
            into = (torch.zeros_like(qm) if ring == 1 else torch.zeros(qm.shape, dtype=acc, device=q.device),
                    torch.zeros(k[:, theirs].shape, dtype=acc, device=q.device),
                    torch.zeros(v[:, theirs].shape, dtype=acc, device=q.device))
            g = spa.block_backward(backend, qm, k[:, theirs], v[:, theirs], o, lse, wm, delta, mine, theirs,
                                   docs, scale, into=into)
            if g is not None:
                dq[:, mine] += g[0].double()
                dk[:, theirs] += g[1].double()
                dv[:, theirs] += g[2].double()
    return out, dq, dk, dv


def full_attention(q, k, v, w, docs=DOCS):
    """out, dq, dk, dv of full attention in fp64 on the host."""
    q, k, v = (t.detach().cpu().double().requires_grad_(True) for t in (q, k, v))
    o = reference(q, k, v, dense_mask(docs))
    (o * w.cpu().double()).sum().backward()
    return o.detach(), q.grad, k.grad, v.grad


# Blockwise with tiles that cut documents and zigzag chunks anywhere (5 divides
# no chunk), that fit a chunk (16), that hold a whole shard (256); einsum whole.
@pytest.mark.parametrize("backend,tile", [("blockwise", 5), ("blockwise", 16), ("blockwise", 256), ("einsum", None)])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
@pytest.mark.parametrize("ring", [1, 2, 3, 4])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3)])
def test_backend_matches_full_attention(monkeypatch, backend, tile, dtype, tol, ring, heads, kv_heads):
    if tile:
        monkeypatch.setattr(blockwise, "TILE", tile)
    q, k, v, w = tensors(heads, kv_heads, dtype)
    got = ring_in_one_process(backend, q, k, v, w, ring, blockwise.Docs.of(doc_ids(DOCS)))
    want = full_attention(q, k, v, w)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
        assert err < tol, f"{name}: error {err} against full attention"


class VarlenKernel:
    """Stands in for torch's varlen flash kernel on the host, written from its
    contract: packed [total, H, D] rows, sequences cut by int32 offsets, causal
    or not, log-sum-exp as [H, total]; backward from out, lse and dout. Lets
    the flash backend's cutting of blocks into varlen calls run here."""

    @staticmethod
    def _scores(q, k, causal, scale):
        g = q.shape[1] // k.shape[1]
        s = torch.einsum("qhd,khd->hqk", q.double(), k.repeat_interleave(g, 1).double()) * scale
        if causal:
            s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool).triu(1), float("-inf"))
        return s

    @classmethod
    def forward(cls, q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, scale):
        assert dropout == 0.0 and not debug and cu_q.dtype == cu_k.dtype == torch.int32
        out, lse = torch.zeros(q.shape, dtype=q.dtype), torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
        g = q.shape[1] // k.shape[1]
        for i in range(cu_q.numel() - 1):
            a, b, c, d = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
            assert b - a <= max_q and d - c <= max_k and (not causal or b - a == d - c)
            s = cls._scores(q[a:b], k[c:d], causal, scale)
            lse[:, a:b] = torch.logsumexp(s, -1).float()
            out[a:b] = torch.einsum("hqk,khd->qhd", torch.softmax(s, -1), v[c:d].repeat_interleave(g, 1).double())
        return out, lse, None, None, None

    @classmethod
    def backward(cls, dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, dropout, causal, seed, offset, scale):
        g = q.shape[1] // k.shape[1]
        dq, dk, dv = torch.zeros(q.shape), torch.zeros(k.shape), torch.zeros(v.shape)
        for i in range(cu_q.numel() - 1):
            a, b, c, d = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
            p = torch.exp(cls._scores(q[a:b], k[c:d], causal, scale) - lse[:, a:b, None].double())
            do, o = dout[a:b].double(), out[a:b].double()
            ve, ke = v[c:d].repeat_interleave(g, 1).double(), k[c:d].repeat_interleave(g, 1).double()
            ds = p * (torch.einsum("qhd,khd->hqk", do, ve) - (do * o).sum(-1).t()[..., None])
            dq[a:b] = torch.einsum("hqk,khd->qhd", ds, ke).float() * scale
            fold = (lambda x: x.reshape(x.shape[0], k.shape[1], g, -1).sum(2).float())
            dk[c:d] = fold(torch.einsum("hqk,qhd->khd", ds, q[a:b].double())) * scale
            dv[c:d] = fold(torch.einsum("hqk,qhd->khd", p, do))
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@pytest.mark.parametrize("ring", [1, 2, 3, 4])
def test_flash_blocks_cut_into_varlen_calls(monkeypatch, ring):
    """The flash backend over the stand-in kernel, fp32 in, out and gradients
    against full attention: every document and zigzag half cut right."""
    monkeypatch.setattr(flash, "_fwd", lambda *a, scale: VarlenKernel.forward(*a, scale))
    monkeypatch.setattr(flash, "_bwd", lambda *a, scale: VarlenKernel.backward(*a, scale))
    q, k, v, w = tensors(4, 2, torch.float32)
    got = ring_in_one_process("flash", q, k, v, w, ring, blockwise.Docs.of(doc_ids(DOCS)))
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, full_attention(q, k, v, w)):
        err = (a - b).abs().max().item() / max(1.0, b.abs().max().item())
        assert err < 1e-5, f"{name}: error {err} against full attention"


def test_rows_that_see_nothing_give_zero_and_minus_inf():
    """Keys of an earlier chunk: the queries of a document that starts in the
    query chunk see none of them."""
    q, k, v, _ = tensors(2, 2, torch.float64)
    docs = blockwise.Docs.of(doc_ids(DOCS))
    q_idx, k_idx = torch.arange(12, 24), torch.arange(0, 12)
    out, lse = blockwise.forward(q[:, q_idx], k[:, k_idx], v[:, k_idx], q_idx, k_idx, docs, tile=5)
    sees = dense_mask(DOCS)[:, q_idx][:, :, k_idx].any(-1)                  # [B, Sq]
    assert not sees[0].all() and sees[0].any()
    assert torch.equal(torch.isneginf(lse), (~sees)[:, None].expand_as(lse))
    assert (out[~sees] == 0).all()
    ref_out, ref_lse = spa.block_forward("einsum", q[:, q_idx], k[:, k_idx], v[:, k_idx], q_idx, k_idx, docs,
                                         1.0 / math.sqrt(q.shape[-1]))
    assert (out - ref_out).abs().max() < 1e-13
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    assert blockwise.forward(k[:, k_idx], q[:, q_idx], v[:, q_idx], k_idx, q_idx, docs) is None   # all later


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_chunks,k_chunks", [((0, 7), (3, 4)), ((1, 6), (1, 6))])
def test_dq_made_in_q_is_dq_added_to_zeros(dtype, q_chunks, k_chunks):
    """backward(into=(q, ...)) puts each query tile's gradient where the tile
    was: the same values as adding it to zeros, and zeros for the tiles that
    see no key of the block (chunk 0's queries against later keys)."""
    q, k, v, w = tensors(4, 2, dtype)
    docs = blockwise.Docs.of(doc_ids(DOCS))
    c = S // 8
    q_idx, k_idx = (torch.cat([torch.arange(i * c, (i + 1) * c) for i in ch]) for ch in (q_chunks, k_chunks))
    qb, kb, vb, wb = q[:, q_idx], k[:, k_idx], v[:, k_idx], w[:, q_idx]
    out, lse = blockwise.forward(qb, kb, vb, q_idx, k_idx, docs, tile=5)
    delta = (wb.to(lse.dtype) * out).sum(-1).transpose(1, 2)
    acc = blockwise.acc_dtype(dtype)

    def grads(dq):
        return blockwise.backward(qb.clone() if dq is None else dq, kb, vb, wb, lse, delta, q_idx, k_idx, docs,
                                  tile=5, into=(torch.zeros_like(qb) if dq is None else dq,
                                                torch.zeros(kb.shape, dtype=acc), torch.zeros(vb.shape, dtype=acc)))
    added = grads(None)
    mine = qb.clone()
    made = grads(mine)
    assert made[0] is mine
    for a, b in zip(added, made):
        assert torch.equal(a, b)
    if q_chunks[0] < k_chunks[0]:     # chunk 0's queries come before every key
        assert (made[0][:, :c] == 0).all()


def tiles_of(idx, tile):
    """Tiles of `tile` tokens cut inside each contiguous run of idx (their
    definition, written again): lists of global indices."""
    runs, cur = [], [int(idx[0])]
    for t in idx[1:].tolist():
        if t == cur[-1] + 1:
            cur.append(t)
        else:
            runs.append(cur)
            cur = [t]
    runs.append(cur)
    return [r[i:i + tile] for r in runs for i in range(0, len(r), tile)]


@pytest.mark.parametrize("ring,tile", [(1, 7), (2, 5), (3, 4), (4, 3), (4, 16)])
def test_skipped_tiles_are_the_fully_masked_ones(ring, tile):
    mask = dense_mask(DOCS)
    for me in range(ring):
        for src in range(ring):
            q_idx, k_idx = zigzag(ring, me), zigzag(ring, src)
            qt, kt = tiles_of(q_idx, tile), tiles_of(k_idx, tile)
            seen = [mask[:, a][:, :, b] for a in qt for b in kt]
            w = blockwise.work(q_idx, k_idx, doc_ids(DOCS), heads=2, head_dim=8, tile=tile)
            assert w.tiles == len(seen)
            assert w.computed == sum(bool(m.any()) for m in seen), (me, src)
            assert w.masked == sum(bool(m.any()) and not bool(m.all()) for m in seen), (me, src)
            pairs = sum(len(a) * len(b) for a in qt for b in kt if bool(mask[:, a][:, :, b].any()))
            assert w.flops == 4 * len(DOCS) * 2 * 8 * pairs


@pytest.mark.parametrize("ring", [2, 4])
def test_zigzag_computes_within_ten_percent_of_the_causal_minimum(ring):
    """One document of 4096 tokens: the ring's tiles, summed over every block of
    every rank, cost at most 10 % more than the causal triangle."""
    n, tile = 4096, 64
    doc = torch.zeros(1, n, dtype=torch.int64)
    chunk = n // (2 * ring)

    def shard(r):
        return torch.cat([torch.arange(r * chunk, (r + 1) * chunk),
                          torch.arange((2 * ring - 1 - r) * chunk, (2 * ring - r) * chunk)])

    flops = dense = 0
    for me in range(ring):
        for src in range(ring):
            w = blockwise.work(shard(me), shard(src), doc, heads=1, head_dim=1, tile=tile)
            flops, dense = flops + w.flops, dense + w.dense_flops
    causal = 4 * n * (n + 1) // 2
    assert dense == 4 * n * n
    assert flops <= 1.10 * causal, f"{flops / causal:.3f} x the causal minimum"


class _Largest(TorchDispatchMode):
    """Records the largest tensor any op creates while active."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


def _largest_tensor(backend, n, heads=2, D=4, tile=32):
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(1, n, heads, D, generator=g) for _ in range(4))
    idx = torch.arange(n)
    docs = blockwise.Docs.of(torch.zeros(1, n, dtype=torch.int64))
    with _Largest() as probe:
        out, lse = spa.block_forward(backend, q, k, v, idx, idx, docs, 0.5) if backend != "blockwise" else \
            blockwise.forward(q, k, v, idx, idx, docs, 0.5, tile=tile)
        delta = (dout * out).sum(-1).transpose(1, 2)
        if backend == "blockwise":
            blockwise.backward(q, k, v, dout, lse, delta, idx, idx, docs, 0.5, tile=tile)
        else:
            spa.block_backward(backend, q, k, v, out, lse, dout, delta, idx, idx, docs, 0.5)
    return probe.numel


def test_blockwise_memory_is_linear_in_the_sequence():
    """No op of blockwise's forward and backward creates a tensor of Sq x Sk
    elements, and the largest doubles at most when the sequence doubles; the
    einsum backend, measured the same way, does create them."""
    small, big = _largest_tensor("blockwise", 512), _largest_tensor("blockwise", 1024)
    assert big < 1024 * 1024 // 8, f"a tensor of {big} elements for 1024 tokens"
    assert big <= 2 * small, f"largest tensor {small} -> {big} elements when the sequence doubled"
    assert _largest_tensor("einsum", 512) >= 512 * 512


@pytest.mark.parametrize("ring", [1, 2, 4, 8])
def test_fp32_error_does_not_grow_with_the_ring(monkeypatch, ring):
    """fp32 against fp64, blocks merged in fp32: the error at ring 8 stays that
    of one block (the CPU counterpart of the bf16 test on a GPU)."""
    monkeypatch.setattr(blockwise, "TILE", 16)
    q, k, v, w = tensors(2, 2, torch.float64, seed=11, B=1, S=64)
    docs = blockwise.Docs.of(torch.zeros(1, 64, dtype=torch.int64))
    want = ring_in_one_process("blockwise", q, k, v, w, ring, docs)
    got = ring_in_one_process("blockwise", *(t.float() for t in (q, k, v, w)), ring, docs)
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        err = (a - b).abs().max().item() / b.abs().max().item()
        assert err < 2e-6, f"ring {ring} {name}: fp32 error {err}"


def test_backend_choice():
    q = torch.zeros(1, 4, 2, 8)
    assert spa.choose_backend(q) == "blockwise"
    assert spa.choose_backend(q.half()) == "blockwise"          # not on a GPU
    assert spa.choose_backend(q, "einsum") == "einsum"
    with pytest.raises(ValueError, match="flash cannot run: "):
        spa.choose_backend(q, "flash")
    with pytest.raises(ValueError, match="expected one of blockwise, flash, einsum"):
        spa.choose_backend(q, "dense")

