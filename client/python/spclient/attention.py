"""Causal attention over sequence-parallel ranks: Ulysses, zigzag Ring, and both.

A batch is laid out once (SeqLayout, spclient/layout.py): the sequence, padded
inside the layout to a length that splits evenly, is split zigzag over the ring
ranks (chunks r and 2R-1-r, so every ring rank does the same causal work) and
each ring shard is cut into equal pieces for the Ulysses ranks inside it. A
rank feeds the model its own real tokens (layout.local) with their global
position ids: an SP boundary is not a document boundary, a packed document's
start is.

attention() then does, for q, k, v of this rank's real tokens, padded to its
piece (layout.pad; the output is cut back with layout.unpad):

  1. Ulysses seq->head over the Ulysses group (when it has more than one rank):
     every rank of the group gets its ring shard whole, for its share of heads
     (dummy heads and KV replication come from spd);
  2. over the ring group, zigzag Ring attention: K/V blocks rotate on shift
     channel 0 while the block in hand is computed, blocks merge through their
     log-sum-exp; backward rotates K/V again and carries the dK/dV
     accumulators on channel 1, as ring-flash-attention does. With one ring
     rank the block is the whole sequence, on the backend a single process
     runs, so Ulysses alone changes no bit;
  3. Ulysses head->seq back to this rank's tokens.

With more than one rank, steps 1-3 run over groups of heads in turn
(head_chunks; tiled Ulysses, as Arctic's long-sequence training does, and the
ring the same way): a rank then holds one group's tensors of the whole ring
shard, and one group's K/V blocks and dK/dV accumulators in the ring, at a
time, and keeps none for backward, which redoes each group's all-to-all.

The mask is causal inside each document: a token sees the tokens of its own
document at or before it. Documents come from the position ids (a document
starts where the position is 0 or does not follow the previous one; see
spclient.torch.cu_seqlens; mRoPE ids: layout.py); the padding is a document
of its own. Each block (this rank's queries against one ring rank's keys; with
one ring rank, the whole sequence against itself) runs on one backend, chosen
in choose_backend:

  blockwise  spclient.blockwise: tiles, online softmax, no [Sq, Sk] tensor,
             fully masked tiles skipped (any device, any dtype; the default
             but for fp16/bf16 on a GPU);
  flash      spclient.flash: torch's varlen flash kernel (fp16/bf16 on a GPU,
             the default there);
  einsum     one dense [B, H, Sq, Sk] product with a [B, Sq, Sk] mask, the
             reference the others are measured against.

Blocks merge through their log-sum-exp in fp32 (fp64 for fp64 inputs). On a
GPU the K/V rotation of a step overlaps the step's block: the shift runs on
spd's side stream and the block on the current one.

projected_attention() takes the hidden states and the q/k/v projections
instead, and overlaps step 1 with the query's projection (async Ulysses): K
and V go first, through spclient.torch.iseq_to_head.
"""
import math

import torch

from . import BSHD, HEAD_TO_SEQ, HEADS_KV, HEADS_Q, SEQ_TO_HEAD, blockwise, flash
from . import torch as spt
from .layout import SeqLayout, document_ids  # noqa: F401 (spclient.attention.SeqLayout, as before)


# ---------------------------------------------------------------- one block


def _expand_kv(x, heads):
    """GQA: kv head j serves query heads j*g .. j*g+g-1 (as spd deals them out)."""
    g = heads // x.shape[2]
    return x if g == 1 else x.repeat_interleave(g, dim=2)


def softmax_attention(q, k, v, mask, scale=None):
    """Plain attention: q [B, Sq, H, D], k, v [B, Sk, Hk, D], mask [B, Sq, Sk]
    (dense_mask). A reference for a single process, in memory that grows with
    Sq x Sk; attention() runs the backends below instead."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    k, v = _expand_kv(k, q.shape[2]), _expand_kv(v, q.shape[2])
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v)


def _block_forward(q, k, v, mask, scale):
    """One K/V block: its normalised output [B, Sq, H, D] and log-sum-exp [B, H, Sq]
    (-inf, with output 0, for rows that see nothing of the block)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = s.masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v), lse


def _merge(out, lse, out_b, lse_b):
    """out/lse of two disjoint key sets -> those of their union. fp32 blocks merge
    through spd's out/LSE merge (spclient.torch.lse_merge: the host reference on
    the CPU, the kernel on a GPU, computed in double and rounded once, so the
    same bits on both and no error that grows with the ring), into the first
    block's tensors, which this function owns from then on (a caller that passes
    views takes the result from the return value, as flash.forward does). fp64 blocks keep
    ring-flash-attention's merge, written with the new lse so that -inf on
    either side is harmless. Blocks come from block_forward, whose tensors are
    new: the first is the accumulator itself, no copy of it."""
    if out is None:   # the first block's tensors, new and the caller's, become the accumulator
        return out_b.contiguous(), lse_b.contiguous()
    if out.dtype == torch.float32:
        return spt.lse_merge(out.contiguous(), lse.contiguous(), out_b.contiguous(), lse_b.contiguous())
    new = torch.logaddexp(lse, lse_b)
    safe = torch.where(torch.isfinite(new), new, torch.zeros_like(new))
    wa = torch.exp(lse - safe).transpose(1, 2)[..., None]
    wb = torch.exp(lse_b - safe).transpose(1, 2)[..., None]
    return wa * out + wb * out_b, new


def _block_backward(q, k, v, mask, scale, dout, lse, delta):
    """Gradients of one block given the final lse and delta = rowsum(dout * out)."""
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    p = torch.exp(s - lse[..., None]).masked_fill(~mask[:, None], 0.0)
    dv = torch.einsum("bhqk,bqhd->bkhd", p, dout)
    dp = torch.einsum("bqhd,bkhd->bhqk", dout, v)
    ds = p * (dp - delta[..., None])
    dq = torch.einsum("bhqk,bkhd->bqhd", ds, k) * scale
    dk = torch.einsum("bhqk,bqhd->bkhd", ds, q) * scale
    return dq, dk, dv


def _reduce_kv(dx, kv_heads):
    """The gradient of _expand_kv: sum over the query heads a kv head served."""
    B, S, H, D = dx.shape
    return dx if H == kv_heads else dx.reshape(B, S, kv_heads, H // kv_heads, D).sum(dim=3)


# ---------------------------------------------------------------- kernels

BACKENDS = ("blockwise", "flash", "einsum")


def dense_mask(doc, q_idx, k_idx):
    """[B, Sq, Sk] True where query token q_idx[i] may attend key token k_idx[j]
    under [B, S] document ids doc: the einsum backend's mask."""
    same_doc = doc[:, q_idx, None] == doc[:, None, k_idx]
    return same_doc & (q_idx[:, None] >= k_idx[None, :])[None]


def choose_backend(q, backend=None):
    """The kernel every block of an attention of q [B, S, H, D] runs on. None
    chooses: torch's flash kernel for fp16/bf16 on a GPU where it exists, else
    the blockwise path (any device, any dtype). "einsum" is the dense reference
    (memory grows with the square of the block). Asking for flash where it
    cannot run is an error that says why."""
    if backend is None:
        return "flash" if flash.why_not(q) is None else "blockwise"
    if backend not in BACKENDS:
        raise ValueError(f"attention backend {backend!r}: expected one of {', '.join(BACKENDS)} or None")
    if backend == "flash" and flash.why_not(q) is not None:
        raise ValueError(f"attention backend flash cannot run: {flash.why_not(q)}")
    return backend


def block_forward(backend, q, k, v, q_idx, k_idx, docs, scale, alone=False):
    """One block: queries q (global tokens q_idx) over keys k, v (tokens k_idx),
    docs a blockwise.Docs on q's device. Returns out [B, Sq, H, D] and lse
    [B, H, Sq] in blockwise.acc_dtype(q.dtype), new tensors, or None when no
    query sees a key. alone: the block merges with no other (a ring of one),
    so out may come in q's dtype, with no accumulator beside it."""
    if backend == "blockwise":
        return blockwise.forward(q, k, v, q_idx, k_idx, docs, scale, out_dtype=q.dtype if alone else None)
    if backend == "flash":
        return flash.forward(q, k, v, q_idx, k_idx, docs, scale, _merge, blockwise.runs,
                             out_dtype=q.dtype if alone else None)
    mask = dense_mask(docs.doc, q_idx.to(docs.doc.device), k_idx.to(docs.doc.device))
    if not bool(mask.any()):
        return None
    dt = blockwise.acc_dtype(q.dtype)
    H = q.shape[2]
    out, lse = _block_forward(q.to(dt), _expand_kv(k, H).to(dt), _expand_kv(v, H).to(dt), mask, scale)
    return out, lse


def block_backward(backend, q, k, v, out, lse, dout, delta, q_idx, k_idx, docs, scale, into=None, alone=False):
    """Gradients of block_forward's block given the attention's final out (q's
    dtype), lse and delta = rowsum(dout * out) [B, H, Sq] (see _delta): dq,
    and dk, dv with k's heads, in blockwise.acc_dtype(q.dtype); None when no
    query sees a key.
    into: (dq, dk, dv) to add them into and return instead (see
    blockwise.backward). into (dq, None, None), on flash: dk and dv are added
    later, by the function returned in their place, (dq, add_kv, None): a
    ring's accumulators for them are still on their way. alone: the block is the
    whole attention (a ring of one), so with no into the gradients may come in
    q's dtype (flash: the kernel's own)."""
    if backend == "blockwise":
        return blockwise.backward(q, k, v, dout, lse, delta, q_idx, k_idx, docs, scale, into=into)
    if backend == "flash":
        return flash.backward(q, k, v, out, lse, dout, q_idx, k_idx, docs, scale, blockwise.runs, into=into,
                              alone=alone)
    mask = dense_mask(docs.doc, q_idx.to(docs.doc.device), k_idx.to(docs.doc.device))
    if not bool(mask.any()):
        return None
    dt = blockwise.acc_dtype(q.dtype)
    H, Hk = q.shape[2], k.shape[2]
    dq, dk, dv = _block_backward(q.to(dt), _expand_kv(k, H).to(dt), _expand_kv(v, H).to(dt), mask, scale,
                                 dout.to(dt), lse, delta)
    grads = dq, _reduce_kv(dk, Hk), _reduce_kv(dv, Hk)
    if into is None:
        return grads
    for acc, g in zip(into, grads):
        acc += g
    return into


def _delta(backend, dout, out):
    """rowsum(dout * out) [B, H, S], in the accumulation dtype, or None for the
    flash backend, whose kernel takes it from out itself: one dot product
    per row as a batched matmul over the rows where they lie, with no [B, S, H,
    D] product (nor the copies einsum makes to bring h before s)."""
    if backend == "flash":
        return None
    dt = blockwise.acc_dtype(out.dtype)
    return (dout.to(dt)[..., None, :] @ out.to(dt)[..., None]).reshape(dout.shape[:3]).transpose(1, 2)


def _row_delta(dout, out):
    """_delta's rowsum(dout * out) as [B, S, H, 1], where a token's heads lie in
    dout and out [B, S, H, D]: a tensor the all-to-all takes as it takes them."""
    dt = blockwise.acc_dtype(out.dtype)
    return (dout.to(dt)[..., None, :] @ out.to(dt)[..., None]).reshape(*dout.shape[:3], 1)


def _zeros(h, like, dtype):
    """Zeros of like's shape in dtype: in h's arena on the host, on like's GPU
    otherwise."""
    return h.zeros(tuple(like.shape), dtype, device=like.device)


def _local_forward(backend, layout, docs, scale, q, k, v):
    """Attention of the tokens of ring shard layout.ring_rank among themselves
    (a ring of one): out in q's dtype, and lse."""
    idx = layout.shard(layout.ring_rank)
    out, lse = block_forward(backend, q, k, v, idx, idx, docs, scale, alone=True)
    return out.to(q.dtype), lse


def _local_backward(arena, backend, layout, docs, scale, q, k, v, out, lse, dout, delta=None):
    """_local_forward's gradients dq, dk, dv, in the dtypes of q, k, v; made in
    the arena, when there is one, where an all-to-all takes them next (on the
    host, it would copy them there). delta: rowsum(dout * out) when the caller
    has it; out is then not read (but by the flash backend, which takes no
    delta)."""
    idx = layout.shard(layout.ring_rank)
    dout = dout.contiguous()
    # Each query's gradient is whole after one block: dq is made in q's
    # dtype; dK/dV sum over query tiles, in the accumulation dtype.
    acc = blockwise.acc_dtype(q.dtype)
    if backend == "flash":
        into = None   # on a GPU, nothing to stage: the kernel's own gradients, where one call makes them
    elif arena is not None:
        into = (_zeros(arena, q, q.dtype), _zeros(arena, k, acc), _zeros(arena, v, acc))
    else:
        into = (torch.zeros_like(q), torch.zeros(k.shape, dtype=acc, device=k.device),
                torch.zeros(v.shape, dtype=acc, device=v.device))
    if delta is None:
        delta = _delta(backend, dout, out)
    dq, dk, dv = block_backward(backend, q, k, v, out, lse, dout, delta, idx, idx, docs, scale, into=into,
                                alone=True)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _LocalAttention(torch.autograd.Function):
    """Attention of tokens idx among themselves, on one process (a ring of one)."""

    @staticmethod
    def forward(ctx, arena, backend, layout, scale, q, k, v):
        docs = blockwise.Docs.of(layout.doc, q.device)
        out, lse = _local_forward(backend, layout, docs, scale, q, k, v)
        ctx.arena, ctx.backend, ctx.layout, ctx.docs, ctx.scale = arena, backend, layout, docs, scale
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = _local_backward(ctx.arena, ctx.backend, ctx.layout, ctx.docs, ctx.scale, *ctx.saved_tensors, dout)
        return (None,) * 4 + grads


# ---------------------------------------------------------------- the ring


def _ring_forward(h, group, layout, docs, scale, backend, q, k, v):
    """Zigzag Ring attention of ring shard group.rank's queries over every
    shard's keys: out in q's dtype, and lse."""
    R, me = group.size, group.rank
    q_idx = layout.shard(me)
    cur = [spt._staged(h, k), spt._staged(h, v)]
    out = lse = None
    for step in range(R):
        req = None
        if step + 1 < R:   # the next block travels while this one is computed
            nxt = [spt._empty(h, t) for t in cur]
            req = h.ishift(group, list(zip(cur, nxt)), channel=0)
        blk = block_forward(backend, q, cur[0], cur[1], q_idx, layout.shard((me - step) % R), docs, scale)
        if blk is not None:
            out, lse = _merge(out, lse, *blk)
        if req is not None:
            cur = req.wait()
    return out.to(q.dtype), lse      # step 0's block holds every query's own token


def _ring_backward(h, group, layout, docs, scale, backend, q, k, v, out, lse, dout, delta=None, dq=None):
    """_ring_forward's gradients dq, dk, dv, in the dtypes of q, k, v. delta:
    rowsum(dout * out) when the caller has it (see _local_backward). dq:
    zeros of q's shape in the accumulation dtype to add dq into (the
    caller's own gradient), else made here. q and dout are read where they
    lie (any strides); k and v travel."""
    R, me = group.size, group.rank
    if delta is None:
        delta = _delta(backend, dout, out)
    q_idx = layout.shard(me)
    acc = blockwise.acc_dtype(q.dtype)
    if dq is None:
        dq = _zeros(h, q, acc)     # in the arena on the host: a head->seq after us takes it as it is
    cur = [spt._staged(h, k), spt._staged(h, v)]
    sums_req = None
    for step in range(R):
        if step == 0:
            sums = [_zeros(h, k, acc), _zeros(h, v, acc)]
        elif backend != "flash":   # see below; waited before the next K/V block is made
            sums = sums_req.wait()
        kv_req = None
        if step + 1 < R:
            nxt = [spt._empty(h, t) for t in cur]
            kv_req = h.ishift(group, list(zip(cur, nxt)), channel=0)
        # dq accumulates in place. This block's dK/dV accumulators come from
        # ring rank - 1 and go on to ring rank + 1 on channel 1; at step 0
        # they start here. The block adds into them: on flash, whose kernel
        # makes its pieces in q's dtype, the pieces wait while the
        # accumulators travel and are added once they are here; on the other
        # backends the block waits for the accumulators instead, so that no
        # fp32 share of the block lies beside the pair in flight (the K/V
        # rotation still overlaps the block).
        k_idx = layout.shard((me - step) % R)
        if step == 0 or backend != "flash":
            block_backward(backend, q, cur[0], cur[1], out, lse, dout, delta, q_idx, k_idx, docs, scale,
                           into=(dq, *sums))
        else:
            grads = block_backward(backend, q, cur[0], cur[1], out, lse, dout, delta, q_idx, k_idx, docs,
                                   scale, into=(dq, None, None))
            sums = sums_req.wait()
            if grads is not None:
                grads[1](*sums)   # add_kv
            grads = None          # gone before the next accumulators are made
        nxt_sums = [spt._empty(h, t) for t in sums]
        sums_req = h.ishift(group, list(zip(sums, nxt_sums)), channel=1)
        if kv_req is not None:
            cur = kv_req.wait()
    dk, dv = sums_req.wait()      # after R hops our own block's sums are home
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


class _RingAttention(torch.autograd.Function):
    """Zigzag Ring attention over `group`; q, k, v hold ring shard group.rank.
    Blocks merge, and dK/dV accumulate over the ring, in
    blockwise.acc_dtype(q.dtype): fp32 for fp16/bf16 inputs, so that rounding
    does not grow with the number of ring ranks."""

    @staticmethod
    def forward(ctx, h, group, layout, scale, backend, q, k, v):
        docs = blockwise.Docs.of(layout.doc, q.device)
        out, lse = _ring_forward(h, group, layout, docs, scale, backend, q, k, v)
        ctx.h, ctx.group, ctx.layout, ctx.scale, ctx.backend, ctx.docs = h, group, layout, scale, backend, docs
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        grads = _ring_backward(ctx.h, ctx.group, ctx.layout, ctx.docs, ctx.scale, ctx.backend, *ctx.saved_tensors,
                               dout)
        return (None,) * 5 + grads


def ring_attention(h, group, layout, q, k, v, scale=None, backend=None):
    """Zigzag Ring attention over the ring group: q, k, v [B, L, H, D] hold this
    ring rank's shard (layout.shard(group.rank)), k and v with H or fewer (GQA)
    heads. backend: see choose_backend. Differentiable; backward rotates dK/dV
    on channel 1."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    return _RingAttention.apply(h, group, layout, scale, choose_backend(q, backend), q, k, v)


# ---------------------------------------------------------------- the whole op


def _check_tokens(layout, x):
    if x.shape[1] != layout.local.numel():
        raise ValueError(f"q holds {x.shape[1]} tokens, the layout gives this rank {layout.local.numel()}")


def _attend(h, mesh, layout, q, k, v, heads, kv_heads, scale, backend):
    """Steps 2 and 3: attention of q, k, v with this rank's heads of the whole
    ring shard, then head->seq back to this rank's real tokens."""
    U, R = mesh.ulysses_group.size, mesh.ring_group.size
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    if R > 1:
        o = ring_attention(h, mesh.ring_group, layout, q, k, v, scale, backend)
    else:
        # With Ulysses, the gradients go to an all-to-all: made in its arena.
        o = _LocalAttention.apply(h if U > 1 else None, choose_backend(q, backend), layout, scale, q, k, v)
    if U > 1:
        (o,) = spt.head_to_seq(h, mesh.ulysses_group, layout.shard_len, (heads,), o, kv_heads=kv_heads)
    return layout.unpad(o)


def head_groups(heads, kv_heads, ulysses, chunks=None):
    """The head groups attention() attends in turn: (query heads, kv heads),
    a pair of slices per group. Groups follow the KV heads, each a run of whole
    GQA groups, as even as they come (a count that does not divide the KV
    heads gives groups one KV head apart). chunks None: as many groups as
    leave each Ulysses rank a query head of every group (heads // ulysses, at
    most kv_heads), the fewest tensors of the whole sequence on a rank at once
    without spd's dummy heads (with no Ulysses group: a group per KV head).
    1: one group, untiled but for what it keeps for backward (see
    _TiledHeads)."""
    if chunks is None:
        chunks = max(1, min(kv_heads, heads // ulysses))
    if not 1 <= chunks <= kv_heads:
        raise ValueError(f"head_chunks {chunks}: between 1 and the {kv_heads} KV heads")
    g = heads // kv_heads
    base, extra = divmod(kv_heads, chunks)
    groups, a = [], 0
    for c in range(chunks):
        b = a + base + (c < extra)
        groups.append((slice(a * g, b * g), slice(a, b)))
        a = b
    return groups


class _TiledHeads(torch.autograd.Function):
    """Steps 1-3 over one head group at a time (Arctic long-sequence training's
    tiled Ulysses): the group's seq->head all-to-all, its attention over the
    ring group (a ring of one: the whole ring shard) and its head->seq back
    into this rank's output. A rank so holds one group's tensors of the whole
    ring shard at a time, not every head's, and the ring rotates one group's
    K/V blocks and dK/dV accumulators (with no Ulysses group, the all-to-alls
    are the group's slices, padded, made contiguous). Kept for backward: the
    caller's own q, k, v (of its real tokens: a group is padded on its way
    out) and the output, and each group's log-sum-exp; backward redoes each
    group's seq->head of q, k, v and dout, sends rowsum(dout * out) where out
    went (out itself for the flash kernel), and sends the group's gradients
    back before the next group's come, so the head-sharded copies never
    outlive their group. With Ulysses alone and a D term, a group's queries
    come in chunks besides (_ulysses_backward)."""

    @staticmethod
    def forward(ctx, h, mesh, layout, groups, scale, backend, q, k, v):
        docs = blockwise.Docs.of(layout.doc, q.device)
        o = torch.empty_like(q, memory_format=torch.contiguous_format)
        lses = []
        for qs, ks in groups:
            hq, hk = qs.stop - qs.start, ks.stop - ks.start
            qg, kg, vg = _exchange(h, mesh, layout, SEQ_TO_HEAD, (hq, hk, hk), hk,
                                   (q[:, :, qs], k[:, :, ks], v[:, :, ks]), (HEADS_Q, HEADS_KV, HEADS_KV))
            og, lse = _attend_heads(h, mesh, layout, docs, scale, backend, qg, kg, vg)
            del qg, kg, vg
            (o[:, :, qs],) = _exchange(h, mesh, layout, HEAD_TO_SEQ, (hq,), hk, (og,), (HEADS_Q,))
            lses.append(lse)
        ctx.h, ctx.mesh, ctx.layout, ctx.docs = h, mesh, layout, docs
        ctx.groups, ctx.scale, ctx.backend = groups, scale, backend
        ctx.save_for_backward(q, k, v, o, *lses)
        return o

    @staticmethod
    def backward(ctx, dout):
        h, mesh, layout, docs = ctx.h, ctx.mesh, ctx.layout, ctx.docs
        q, k, v, o, *lses = ctx.saved_tensors
        # The softmax backward's rowsum(dout * out) is per token and head: made
        # here, before the all-to-all, it goes in place of out, 1/D of its size
        # (the flash kernel takes out itself).
        rows = None if ctx.backend == "flash" else _row_delta(dout, o)
        # A ring alone adds each group's dq straight into its slice of dq,
        # where its tokens and dtype are dq's own: no group-sized accumulator.
        direct = mesh.ulysses_group.size == 1 and layout.pad_len == 0 and blockwise.acc_dtype(q.dtype) == q.dtype
        dq = (torch.zeros_like if direct else torch.empty_like)(q, memory_format=torch.contiguous_format)
        dk, dv = (torch.empty_like(x, memory_format=torch.contiguous_format) for x in (k, v))
        by_queries = mesh.ulysses_group.size > 1 and mesh.ring_group.size == 1 and rows is not None
        for (qs, ks), lse in zip(ctx.groups, lses):
            if by_queries:
                _ulysses_backward(h, mesh, layout, docs, ctx.scale, ctx.backend, q, k, v, rows, dout, lse, qs, ks,
                                  dq, dk, dv)
                continue
            hq, hk = qs.stop - qs.start, ks.stop - ks.start
            per_row = o if rows is None else rows
            qg, kg, vg, rg, dog = _exchange(h, mesh, layout, SEQ_TO_HEAD, (hq, hk, hk, hq, hq), hk,
                                            (q[:, :, qs], k[:, :, ks], v[:, :, ks], per_row[:, :, qs], dout[:, :, qs]),
                                            (HEADS_Q, HEADS_KV, HEADS_KV, HEADS_Q, HEADS_Q))
            og, delta = (rg, None) if rows is None else (None, rg[..., 0].transpose(1, 2))
            del rg
            grads = _attend_heads_backward(h, mesh, layout, docs, ctx.scale, ctx.backend, qg, kg, vg, og, lse, dog,
                                           delta, dq[:, :, qs] if direct else None)
            del qg, kg, vg, og, dog, delta
            # One gradient at a time, each let go once it is back: a group's
            # head-sharded gradients and their sequence shards are not all
            # held at once.
            grads, back = list(grads), [(dq[:, :, qs], hq, HEADS_Q), (dk[:, :, ks], hk, HEADS_KV),
                                        (dv[:, :, ks], hk, HEADS_KV)]
            for i, (dst, n, kind) in enumerate(back):
                g, grads[i] = grads[i], None
                if not (direct and i == 0):     # a ring alone made dq in place
                    (y,) = _exchange(h, mesh, layout, HEAD_TO_SEQ, (n,), hk, (g,), (kind,))
                    del g
                    dst.copy_(y)
                    del y
        return (None,) * 6 + (dq, dk, dv)


def _ulysses_backward(h, mesh, layout, docs, scale, backend, q, k, v, rows, dout, lse, qs, ks, dq, dk, dv):
    """A head group's backward with Ulysses alone (and a D term: not on
    flash), into its slices of dq, dk and dv. K and V come head-sharded and
    whole, and their gradients accumulate beside them, while the queries come
    in U chunks: chunk c is tokens [c m, (c + 1) m) of every rank's piece, an
    all-to-all of m tokens a rank each for q, dout and the D term, and its dq
    goes back before the next chunk comes. A rank so holds the group's K, V,
    dK and dV of the whole ring shard and a U-th of its q, dout and dq, where
    whole queries hold all six."""
    group, U = mesh.ulysses_group, mesh.ulysses_group.size
    hq, hk = qs.stop - qs.start, ks.stop - ks.start
    kg, vg = _exchange(h, mesh, layout, SEQ_TO_HEAD, (hk, hk), hk, (k[:, :, ks], v[:, :, ks]),
                       (HEADS_KV, HEADS_KV))
    acc = blockwise.acc_dtype(q.dtype)
    dkg, dvg = _zeros(h, kg, acc), _zeros(h, vg, acc)
    shard = layout.shard(layout.ring_rank)   # the head-sharded rows' tokens
    n, real = layout.shard_len // U, layout.local.numel()
    m = -(-n // U)
    pieces = [layout.pad(x[:, :, qs]) for x in (q, rows, dout)]
    for a in range(0, n, m):
        b = min(a + m, n)
        qc, rc, dc = (spt._exchange(h, group, SEQ_TO_HEAD, (b - a) * U, (hq,), hk, BSHD, (x[:, a:b],),
                                    sum_replicas=False, kinds=(HEADS_Q,))[0] for x in pieces)
        at = (torch.arange(U)[:, None] * n + torch.arange(a, b)[None]).flatten()   # the chunk's rows
        dqc = qc if backend == "blockwise" else _zeros(h, qc, q.dtype)   # blockwise: dq made in qc, tile by tile
        block_backward(backend, qc, kg, vg, None, lse[:, :, at.to(lse.device)], dc, rc[..., 0].transpose(1, 2),
                       shard[at], shard, docs, scale, into=(dqc, dkg, dvg))
        del qc, rc, dc
        (y,) = spt._exchange(h, group, HEAD_TO_SEQ, (b - a) * U, (hq,), hk, BSHD, (dqc.to(q.dtype),),
                             sum_replicas=False, kinds=(HEADS_Q,))
        del dqc
        if a < real:                                  # the chunk's real tokens
            dq[:, a:min(b, real), qs] = y[:, :min(b, real) - a]
        del y
    grads = [dkg, dvg]
    del kg, vg, dkg, dvg
    for i, dst in enumerate((dk[:, :, ks], dv[:, :, ks])):
        g, grads[i] = grads[i], None
        (y,) = _exchange(h, mesh, layout, HEAD_TO_SEQ, (hk,), hk, (g.to(dst.dtype),), (HEADS_KV,))
        del g
        dst.copy_(y)


def _exchange(h, mesh, layout, direction, heads, kv_heads, xs, kinds):
    """A head group's tensors xs over the Ulysses group, outside autograd: one
    all-to-all each, so that one slice at a time is copied where the
    all-to-all takes it (the arena on the host, contiguous memory on a GPU).
    seq->head pads this rank's real tokens on the way out, head->seq returns
    them alone (a view); KV gradients on their way back are summed over their
    replicas. With no Ulysses group, the slices themselves: K and V (kind
    HEADS_KV) in the arena on the host, where the ring's shifts take them;
    the rest, which the ring only reads, where they lie."""
    out = []
    for x, n, kind in zip(xs, heads, kinds):
        if direction == SEQ_TO_HEAD:
            x = layout.pad(x)
        if mesh.ulysses_group.size == 1:
            if direction == HEAD_TO_SEQ:
                x = layout.unpad(x)
            out.append(spt._staged(h, x) if direction == SEQ_TO_HEAD and kind == HEADS_KV else x)
            continue
        (y,) = spt._exchange(h, mesh.ulysses_group, direction, layout.shard_len, (n,), kv_heads, BSHD, (x,),
                             sum_replicas=direction == HEAD_TO_SEQ, kinds=(kind,))
        out.append(y if direction == SEQ_TO_HEAD else layout.unpad(y))
    return out


def _attend_heads(h, mesh, layout, docs, scale, backend, q, k, v):
    """Step 2 for head-sharded q, k, v of the whole ring shard: out, lse."""
    if mesh.ring_group.size > 1:
        return _ring_forward(h, mesh.ring_group, layout, docs, scale, backend, q, k, v)
    return _local_forward(backend, layout, docs, scale, q, k, v)


def _attend_heads_backward(h, mesh, layout, docs, scale, backend, q, k, v, out, lse, dout, delta, dq=None):
    """Step 2's gradients; dq: zeros to add the ring's dq into (see _ring_backward)."""
    if mesh.ring_group.size > 1:
        return _ring_backward(h, mesh.ring_group, layout, docs, scale, backend, q, k, v, out, lse, dout, delta, dq)
    return _local_backward(h, backend, layout, docs, scale, q, k, v, out, lse, dout, delta)


def attention(h, mesh, layout, q, k, v, heads, kv_heads=None, scale=None, backend=None, qkv_layout="bshd",
              head_chunks=None):
    """Causal attention of this rank's tokens over the whole sequence.

    q [B, n, heads, D], k and v [B, n, kv_heads, D] (kv_heads defaults to
    heads) hold this rank's n real tokens (layout.local); returns the output of
    the same tokens, [B, n, heads, D]. qkv_layout="bhsd" takes and returns
    [B, heads, n, D] instead, what HF's attention functions receive: a
    transposed view of [B, n, heads, D] memory (as HF's q_proj(x).view(...)
    .transpose(1, 2) is) costs no copy; the output is such a view of the
    all-to-all's result (transpose it back for HF's [B, n, heads, D]). mesh:
    an spclient.Mesh, or any object with ulysses_group and ring_group.
    backend: the kernel of the attention blocks, None to choose by device and
    dtype (see choose_backend). Differentiable end to end. projected_attention
    takes the projections instead, and overlaps K's and V's all-to-all with
    the query's projection.

    head_chunks: with more than one rank, the number of head groups (whole
    GQA groups, 1 to kv_heads) whose all-to-all, attention (the ring's K/V
    rotation) and all-to-all back run one after the other, so that a rank
    holds one group's head-sharded tensors and ring buffers at a time, and
    none between forward and backward (backward redoes the all-to-all: see
    _TiledHeads). None chooses (head_groups); 0 exchanges every head at once
    and keeps the head-sharded q, k, v and output for backward (one
    all-to-all fewer each way, the most memory)."""
    if qkv_layout not in ("bshd", "bhsd"):
        raise ValueError(f'qkv_layout is "bshd" or "bhsd", not {qkv_layout!r}')
    if qkv_layout == "bhsd":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    kv_heads = kv_heads or heads
    _check_tokens(layout, q)
    U = mesh.ulysses_group.size
    if (U > 1 or mesh.ring_group.size > 1) and head_chunks != 0:
        scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
        o = _TiledHeads.apply(h, mesh, layout, head_groups(heads, kv_heads, U, head_chunks), scale,
                              choose_backend(q, backend), q, k, v)
        return o.transpose(1, 2) if qkv_layout == "bhsd" else o
    q, k, v = layout.pad(q), layout.pad(k), layout.pad(v)
    if U > 1:   # sequence shards -> this rank's heads of the whole ring shard
        q, k, v = spt.seq_to_head(h, mesh.ulysses_group, layout.shard_len, (heads, kv_heads, kv_heads), q, k, v,
                                  kv_heads=kv_heads)
    o = _attend(h, mesh, layout, q, k, v, heads, kv_heads, scale, backend)
    return o.transpose(1, 2) if qkv_layout == "bhsd" else o


def _heads_of(x, heads):
    """A projection's [B, n, heads * D] output as [B, n, heads, D] (4-d as it is)."""
    return x.unflatten(-1, (heads, -1)) if x.dim() == 3 else x


def projected_attention(h, mesh, layout, x, q_proj, k_proj, v_proj, heads, kv_heads=None, scale=None,
                        backend=None):
    """attention() of the projections of hidden states x [B, n, ...] of this
    rank's n real tokens, with Ulysses' all-to-all overlapped (VeOmni's async
    Ulysses): K and V are projected first and their seq->head all-to-all
    submitted (spclient.torch.iseq_to_head), the query is projected while they
    travel, and then goes alone. In backward the dK/dV head->seq travels while
    dQ's and the query projection's gradients are computed. The same bits as
    attention(h, mesh, layout, q_proj(x), k_proj(x), v_proj(x), ...).

    q_proj(x) gives [B, n, heads, D] or [B, n, heads * D], k_proj(x) and
    v_proj(x) the same with kv_heads (modules or any callables: rotary
    embeddings go inside them). Returns [B, n, heads, D]. Without a Ulysses
    group there is nothing to overlap, and this is attention() of the three.
    Its Ulysses is untiled (attention(..., head_chunks=0)): every head at once,
    the head-sharded tensors kept for backward."""
    kv_heads = kv_heads or heads
    group, L = mesh.ulysses_group, layout.shard_len
    k, v = (layout.pad(_heads_of(p(x), kv_heads)) for p in (k_proj, v_proj))
    if group.size > 1:
        kv = spt.iseq_to_head(h, group, L, (kv_heads, kv_heads), k, v, kv_heads=kv_heads,
                              kinds=(HEADS_KV, HEADS_KV))
    q = _heads_of(q_proj(x), heads)
    _check_tokens(layout, q)
    q = layout.pad(q)
    if group.size > 1:
        (q,) = spt.seq_to_head(h, group, L, (heads,), q, kv_heads=kv_heads)
        k, v = kv.wait()
    return _attend(h, mesh, layout, q, k, v, heads, kv_heads, scale, backend)


class SPAttention(torch.nn.Module):
    """attention() as a module: construct it with the handle and mesh, call it with
    the batch's layout and q, k, v of this rank's tokens, or project() with the
    hidden states and the projections (projected_attention)."""

    def __init__(self, h, mesh, heads, kv_heads=None, scale=None, backend=None, qkv_layout="bshd",
                 head_chunks=None):
        super().__init__()
        self.h, self.mesh, self.heads, self.kv_heads, self.scale = h, mesh, heads, kv_heads or heads, scale
        self.backend, self.qkv_layout, self.head_chunks = backend, qkv_layout, head_chunks

    def forward(self, layout, q, k, v):
        return attention(self.h, self.mesh, layout, q, k, v, self.heads, self.kv_heads, self.scale, self.backend,
                         self.qkv_layout, self.head_chunks)

    def project(self, layout, x, q_proj, k_proj, v_proj):
        """projected_attention of hidden states x; returns [B, n, heads, D]."""
        return projected_attention(self.h, self.mesh, layout, x, q_proj, k_proj, v_proj, self.heads,
                                   self.kv_heads, self.scale, self.backend)
