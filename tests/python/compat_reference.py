"""The reference path of the compat tests: DeepSpeed-Ulysses' and yunchang's
semantics re-implemented over torch.distributed (gloo), independently of spd,
and the model-side helpers both paths share.

The all-to-all is DeepSpeed's: the input is split in P equal chunks along
scatter_idx, chunk j goes to rank j, and what arrives is concatenated in rank
order along gather_idx; its backward is the same with the indices swapped.
Gloo lacks all_to_all on some builds (this one has all_to_all_single only,
others neither): then it is an all-gather of every rank's chunks, of which a
rank keeps those addressed to it.
"""
import math
import os

import torch
import torch.distributed as dist


def init_gloo(path, rank, world_size):
    """torch.distributed over gloo, rendezvous in file `path` (one per test)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world_size)


def _exchange(send, group):
    """send [P, ...]: send[j] to rank j; returns recv [P, ...], recv[i] from rank i."""
    recv = torch.empty_like(send)
    try:
        dist.all_to_all_single(recv, send, group=group)
        return recv
    except RuntimeError as e:
        if "does not support" not in str(e):
            raise
    P = send.shape[0]
    every = [torch.empty_like(send) for _ in range(P)]
    dist.all_gather(every, send, group=group)
    me = dist.get_rank(group)
    return torch.stack([every[i][me] for i in range(P)])


class SeqAllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x, scatter_idx, gather_idx):
        ctx.group, ctx.scatter_idx, ctx.gather_idx = group, scatter_idx, gather_idx
        P = dist.get_world_size(group)
        if x.shape[scatter_idx] % P:
            raise ValueError(f"dim {scatter_idx} of {tuple(x.shape)} does not split over {P} ranks")
        recv = _exchange(torch.stack(torch.tensor_split(x, P, scatter_idx)).contiguous(), group)
        return torch.cat(recv.unbind(0), dim=gather_idx)

    @staticmethod
    def backward(ctx, grad):
        return None, SeqAllToAll.apply(ctx.group, grad.contiguous(), ctx.gather_idx, ctx.scatter_idx), None, None


class RefDistributedAttention(torch.nn.Module):
    """deepspeed.sequence.layer.DistributedAttention's semantics."""

    def __init__(self, local_attention, sequence_process_group, scatter_idx=2, gather_idx=0):
        super().__init__()
        self.local_attn, self.spg = local_attention, sequence_process_group
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx

    def forward(self, query, key, value, *args, **kwargs):
        q, k, v = (SeqAllToAll.apply(self.spg, x, self.scatter_idx, self.gather_idx) for x in (query, key, value))
        context = self.local_attn(q, k, v, *args, **kwargs)
        return SeqAllToAll.apply(self.spg, context, self.gather_idx, self.scatter_idx)


# ---------------------------------------------------------------- attention


def causal_attention(q, k, v, scale=None, q_pos=None, k_pos=None):
    """Softmax attention of q [B, Sq, H, D] over k, v [B, Sk, Hk, D] (query head
    i uses key/value head i // (H / Hk)), a query seeing the keys at or before
    its position (q_pos, k_pos: global positions; by default 0..S-1)."""
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    g = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    q_pos = (torch.arange(q.shape[1]) if q_pos is None else q_pos).to(q.device)
    k_pos = (torch.arange(k.shape[1]) if k_pos is None else k_pos).to(q.device)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    s = s.masked_fill(~(q_pos[:, None] >= k_pos[None, :]), float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, dim=-1), v)


def local_attention(q, k, v, scale=None, seq_first=False):
    """A user's local attention as DistributedAttention calls it: [B, S, H, D],
    or [S, B, H, D] with seq_first."""
    if seq_first:
        return causal_attention(*(x.transpose(0, 1) for x in (q, k, v)), scale=scale).transpose(0, 1)
    return causal_attention(q, k, v, scale=scale)


def heads_for(x, heads, P):
    """The usual workaround where P does not divide the heads, or a GQA model
    has fewer key/value heads than P: x's heads repeated to `heads` (the query
    heads), then zero heads up to a multiple of P. What a model does before
    DeepSpeed's or yunchang's attention, whose all-to-all takes neither."""
    if x.shape[2] != heads:
        x = x.repeat_interleave(heads // x.shape[2], dim=2)
    extra = (-heads) % P
    if extra:
        x = torch.cat([x, x.new_zeros(x.shape[:2] + (extra,) + x.shape[3:])], dim=2)
    return x


def inputs(seed, B, S, H, Hk, D):
    """Full q, k, v [B, S, H|Hk, D] and an output weight w, fp64, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, S, h, D, generator=g, dtype=torch.float64) for h in (H, Hk, Hk))
    return q, k, v, torch.randn(B, S, H, D, generator=g, dtype=torch.float64)


def max_diff(a, b):
    return float((a - b).abs().max()) if a.numel() else 0.0


# ---------------------------------------------------------------- yunchang


class _Groups:
    """yunchang.globals.PROCESS_GROUP"""
    ULYSSES_PG = RING_PG = None


REF_PROCESS_GROUP = _Groups()


def ref_set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree, rank, world_size):
    """yunchang's set_seq_parallel_pg with use_ulysses_low: per dp block of
    sp ranks, Ulysses groups of consecutive ranks, ring groups one of each."""
    U, R = sp_ulysses_degree, sp_ring_degree
    sp = U * R
    for offset in range(0, world_size, sp):
        for i in range(R):
            ranks = list(range(offset + i * U, offset + (i + 1) * U))
            g = dist.new_group(ranks)
            if rank in ranks:
                REF_PROCESS_GROUP.ULYSSES_PG = g
        for i in range(U):
            ranks = list(range(offset + i, offset + sp, U))
            g = dist.new_group(ranks)
            if rank in ranks:
                REF_PROCESS_GROUP.RING_PG = g


def ring_positions(kind, L, R, j):
    """Global positions of ring rank j's shard of L tokens: yunchang's basic
    (contiguous) or zigzag (chunks j and 2R-1-j of 2R) extraction."""
    if kind == "basic":
        return torch.arange(j * L, (j + 1) * L)
    chunks = torch.arange(L * R).chunk(2 * R)
    return torch.cat([chunks[j], chunks[2 * R - 1 - j]])


class _AllGather(torch.autograd.Function):
    """Every ring rank's shard, concatenated along dim 1 in ring order; the
    gradient of a shard is the sum of every rank's gradient of it."""

    @staticmethod
    def forward(ctx, group, x):
        ctx.group = group
        every = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(every, x.contiguous(), group=group)
        return torch.cat(every, dim=1)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return None, grad.chunk(dist.get_world_size(ctx.group), dim=1)[dist.get_rank(ctx.group)]


def ring_attention(q, k, v, group, kind, scale):
    """What ring_flash_attn_func (basic) and zigzag_ring_flash_attn_func compute
    with causal=True: this ring rank's queries over every shard's keys at or
    before them. The K/V blocks are gathered rather than passed round the
    ring: the same attention, computed plainly."""
    R, me, L = dist.get_world_size(group), dist.get_rank(group), q.shape[1]
    k_pos = torch.cat([ring_positions(kind, L, R, j) for j in range(R)])
    return causal_attention(q, _AllGather.apply(group, k), _AllGather.apply(group, v), scale,
                            q_pos=ring_positions(kind, L, R, me), k_pos=k_pos)


def _causal_only(causal):
    if not causal:
        raise ValueError("the reference computes causal attention only")


class RefUlyssesAttention(torch.nn.Module):
    """yunchang.UlyssesAttention's semantics (the local attention causal)."""

    def __init__(self, sequence_process_group=None, scatter_idx=2, gather_idx=1, use_sync=False, attn_type=None):
        super().__init__()
        self.spg, self.scatter_idx, self.gather_idx = sequence_process_group, scatter_idx, gather_idx

    def forward(self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False, *args):
        _causal_only(causal)
        q, k, v = (SeqAllToAll.apply(self.spg, x, self.scatter_idx, self.gather_idx) for x in (query, key, value))
        context = causal_attention(q, k, v, softmax_scale)
        return SeqAllToAll.apply(self.spg, context, self.gather_idx, self.scatter_idx)


class RefLongContextAttention(torch.nn.Module):
    """yunchang.LongContextAttention's semantics over REF_PROCESS_GROUP."""

    def __init__(self, scatter_idx=2, gather_idx=1, ring_impl_type="basic", use_pack_qkv=False, use_sync=False,
                 attn_type=None):
        super().__init__()
        self.ulysses_pg, self.ring_pg = REF_PROCESS_GROUP.ULYSSES_PG, REF_PROCESS_GROUP.RING_PG
        self.scatter_idx, self.gather_idx, self.kind = scatter_idx, gather_idx, ring_impl_type

    def forward(self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False, *args):
        _causal_only(causal)
        q, k, v = (SeqAllToAll.apply(self.ulysses_pg, x, self.scatter_idx, self.gather_idx)
                   for x in (query, key, value))
        context = ring_attention(q, k, v, self.ring_pg, self.kind, softmax_scale)
        return SeqAllToAll.apply(self.ulysses_pg, context, self.gather_idx, self.scatter_idx)
