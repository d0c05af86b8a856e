"""yunchang's UlyssesAttention, LongContextAttention and set_seq_parallel_pg on spd.

    from spclient.compat.yunchang import LongContextAttention, set_seq_parallel_pg
    set_seq_parallel_pg(ulysses_degree, ring_degree, rank, world_size)
    attn = LongContextAttention(ring_impl_type="zigzag")
    out = attn(q, k, v, causal=True)            # [B, S/P, H, D] pieces in and out

As yunchang's: q, k, v hold this rank's piece, [B, S/P, H, D] (scatter_idx=2,
gather_idx=1); Ulysses runs over the Ulysses group, a causal attention of the
whole sequence of this rank's heads over the ring group, and the output comes
back as this rank's piece, all heads. set_seq_parallel_pg makes the groups
with yunchang's rank layout (use_ulysses_low: a Ulysses group is consecutive
ranks, a ring group takes one of each), and the pieces are where yunchang's
extract_local puts them: with ring_impl_type="basic", sp rank p holds chunk p
of the sequence; with "zigzag", ring rank r holds chunks r and 2R-1-r of 2R,
cut in Ulysses-size pieces (spclient.attention.SeqLayout's layout);
EXTRACT_FUNC_DICT and the extract functions are here too. A rank
whose spd mesh coordinates are not those of its rank in that layout (spd
placed it by its GPU's links) is refused on every rank, not fed other tokens.

Underneath: q, k and v in one spd all-to-all, the ring is
spclient.attention's (K/V rotating on one spd channel while a block is
computed, dK/dV on another), the blocks run on spd's kernels (flash for
fp16/bf16 on a GPU, blockwise otherwise), whatever attn_type says. What spd
adds, as in spclient.compat.deepspeed: heads the Ulysses group does not
divide, fewer key/value heads than its ranks (query head i of a rank uses its
key/value head i // (H_loc / Hk_loc)), and, for UlyssesAttention and a ring
of one, pieces of any length.

What it does not take: causal=False (spd's kernels compute causal attention,
that of decoder language models; a bidirectional model runs
spclient.compat.deepspeed.DistributedAttention around its own attention),
dropout, sliding windows, softcapping and ALiBi, and the "strip" ring. These
are refused with the reason, never ignored. use_sync and use_pack_qkv are
taken: spd's ops are in order and carry q, k and v together anyway.
deterministic: spd's attention always is.

The groups (set_seq_parallel_pg): over torch.distributed, as yunchang's; or,
with handle= an spd handle in a job whose ranks are these, over its job.
"""
import types

import torch

from .. import Group
from .. import attention as spa
from .. import torch as spt
from . import (BSHD, PLACEMENT, ProcessGroup, Split, all_agree, head_to_seq, layout_of, mesh, process_group,
               seq_to_head)

__all__ = ["UlyssesAttention", "LongContextAttention", "set_seq_parallel_pg", "PROCESS_GROUP", "basic_extract_local",
           "zigzag_extract_local", "EXTRACT_FUNC_DICT"]

# yunchang.globals.PROCESS_GROUP: the groups set_seq_parallel_pg made.
PROCESS_GROUP = types.SimpleNamespace(ULYSSES_PG=None, RING_PG=None)


def set_seq_parallel_pg(sp_ulysses_degree, sp_ring_degree, rank, world_size, use_ulysses_low=True, handle=None):
    """yunchang's: the Ulysses and ring groups of sp = ulysses x ring among
    world_size ranks, dp outermost, into PROCESS_GROUP. handle: an spd handle
    whose job rank is `rank` (else torch.distributed's, see spclient.compat)."""
    if not use_ulysses_low:
        raise ValueError(f"set_seq_parallel_pg(use_ulysses_low=False): {PLACEMENT}, so its Ulysses groups are "
                         "consecutive ranks (use_ulysses_low=True)")
    U, R = sp_ulysses_degree, sp_ring_degree
    sp = U * R
    if world_size % sp:
        raise ValueError(f"set_seq_parallel_pg: ulysses {U} x ring {R} does not divide world_size {world_size}")
    h, m = mesh(sp, U, R, handle)
    want = (rank // sp, (rank % sp) // U, rank % U)
    got = (m.dp_group.rank, m.ring_group.rank, m.ulysses_group.rank)
    if not all_agree(h, m, m.dp * m.sp == world_size and got == want):
        raise ValueError(f"set_seq_parallel_pg: rank {rank} of {world_size} belongs at (dp, ring, ulysses) {want}; "
                         f"spd's mesh of {m.dp * m.sp} ranks placed it at {got}, here or on another rank: "
                         f"{PLACEMENT}")
    PROCESS_GROUP.ULYSSES_PG = ProcessGroup(h, m.ulysses_group)
    PROCESS_GROUP.RING_PG = ProcessGroup(h, m.ring_group)


def basic_extract_local(value, rank, world_size, *args, **kwargs):
    """yunchang's: sp rank `rank`'s piece of the full [B, S, ...] value, the
    sequence cut in world_size contiguous chunks (the basic ring's layout)."""
    return value.chunk(world_size, dim=1)[rank].detach().clone()


def zigzag_extract_local(value, rank, world_size, rd, ud, dim=1, *args, **kwargs):
    """yunchang's: the zigzag ring's layout, ring rank rank // ud's shard
    (chunks r and 2rd-1-r of 2rd) cut in ud pieces, of which piece rank % ud."""
    return spt.zigzag_split(value.detach(), rd, rank // ud, dim=dim).chunk(ud, dim=dim)[rank % ud].contiguous()


EXTRACT_FUNC_DICT = {"basic": basic_extract_local, "zigzag": zigzag_extract_local}


def _check_options(dropout_p, causal, window_size, softcap, alibi_slopes):
    """Refuses what spd's attention does not compute, naming it."""
    refused = [what for what, bad in (("causal=False (spd's attention is causal)", not causal),
                                      (f"dropout_p={dropout_p}", dropout_p != 0.0),
                                      (f"window_size={tuple(window_size)}", tuple(window_size) != (-1, -1)),
                                      (f"softcap={softcap}", softcap != 0.0),
                                      ("alibi_slopes", alibi_slopes is not None)) if bad]
    if refused:
        raise ValueError(f"spclient.compat.yunchang: {', '.join(refused)} is not supported on spd")


def _bshd(scatter_idx, gather_idx):
    if layout_of(scatter_idx, gather_idx) != BSHD:
        raise ValueError(f"scatter_idx {scatter_idx}, gather_idx {gather_idx}: yunchang's layout is [B, S, H, D] "
                         "(scatter_idx=2, gather_idx=1)")


_ALONE = types.SimpleNamespace(ulysses_group=Group(0, 1, 0), ring_group=Group(0, 1, 0))


def _whole(h, q, k, v, scale):
    """Causal attention of q over k, v [B, S, H|Hk, D], the whole sequence on
    this process: spclient.attention on a mesh of one rank."""
    B, S = q.shape[:2]
    layout = spa.SeqLayout(torch.arange(S).expand(B, S))
    return spa.attention(h, _ALONE, layout, q, k, v, q.shape[2], k.shape[2], scale)


class _RingShards:
    """The layout spclient.attention's ring reads (shard(j): the global tokens
    of ring rank j; doc: one document) for yunchang's basic (contiguous) or
    zigzag ring of R shards of L tokens."""

    def __init__(self, kind, B, L, R):
        if kind == "zigzag" and L % 2:
            raise ValueError(f"ring_impl_type='zigzag': a ring shard of {L} tokens does not split in two chunks")
        self.kind, self.L, self.R = kind, L, R
        self.doc = torch.zeros(B, L * R, dtype=torch.int64)

    def shard(self, j):
        if self.kind == "zigzag":
            return spt.zigzag_positions(self.L * self.R, self.R, j)
        return torch.arange(j * self.L, (j + 1) * self.L)


class UlyssesAttention(torch.nn.Module):
    """yunchang's UlyssesAttention: Ulysses around a causal attention."""

    def __init__(self, sequence_process_group=None, scatter_idx=2, gather_idx=1, use_sync=False, attn_type=None):
        super().__init__()
        _bshd(scatter_idx, gather_idx)
        self.spg = process_group(sequence_process_group)
        self.scatter_idx, self.gather_idx = scatter_idx, gather_idx
        self.use_sync, self.attn_type = use_sync, attn_type

    def forward(self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *args):
        _check_options(dropout_p, causal, window_size, softcap, alibi_slopes)
        if self.spg.size() == 1:
            return _whole(self.spg.h, query, key, value, softmax_scale)
        split = Split.of(self.spg, query.shape[1])
        q, k, v = seq_to_head(self.spg, split, BSHD, query, key, value)
        context = _whole(self.spg.h, q, k, v, softmax_scale)
        return head_to_seq(self.spg, split, BSHD, context, query.shape[2], key.shape[2])


class LongContextAttention(torch.nn.Module):
    """yunchang's LongContextAttention: Ulysses over PROCESS_GROUP.ULYSSES_PG
    around Ring attention over PROCESS_GROUP.RING_PG."""

    def __init__(self, scatter_idx=2, gather_idx=1, ring_impl_type="basic", use_pack_qkv=False, use_sync=False,
                 attn_type=None):
        super().__init__()
        _bshd(scatter_idx, gather_idx)
        if ring_impl_type not in ("basic", "zigzag"):
            raise ValueError(f"ring_impl_type {ring_impl_type!r}: spd runs the 'basic' and 'zigzag' rings")
        self.ulysses_pg, self.ring_pg = PROCESS_GROUP.ULYSSES_PG, PROCESS_GROUP.RING_PG
        if self.ulysses_pg is None or self.ring_pg is None:
            raise RuntimeError("LongContextAttention: call spclient.compat.yunchang.set_seq_parallel_pg() first")
        self.scatter_idx, self.gather_idx, self.ring_impl_type = scatter_idx, gather_idx, ring_impl_type
        self.use_pack_qkv, self.use_sync, self.attn_type = use_pack_qkv, use_sync, attn_type

    def forward(self, query, key, value, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, *args):
        _check_options(dropout_p, causal, window_size, softcap, alibi_slopes)
        upg, rpg = self.ulysses_pg, self.ring_pg
        q, k, v = query, key, value
        if upg.size() > 1:
            split = Split.of(upg, query.shape[1])
            q, k, v = seq_to_head(upg, split, BSHD, q, k, v)
        if rpg.size() > 1:
            layout = _RingShards(self.ring_impl_type, q.shape[0], q.shape[1], rpg.size())
            context = spa.ring_attention(rpg.h, rpg.group, layout, q, k, v, softmax_scale)
        else:
            context = _whole(rpg.h, q, k, v, softmax_scale)
        if upg.size() > 1:
            context = head_to_seq(upg, split, BSHD, context, query.shape[2], key.shape[2])
        return context
