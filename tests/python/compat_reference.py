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
    q_pos = torch.arange(q.shape[1]) if q_pos is None else q_pos
    k_pos = torch.arange(k.shape[1]) if k_pos is None else k_pos
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
