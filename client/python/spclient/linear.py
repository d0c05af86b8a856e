"""Linear attention over sequence-parallel ranks (context parallelism, as FLA
does it): the short convolution's halo and the gated delta rule's state,
passed from rank to rank.

A hybrid model's linear-attention layer (GatedDeltaNet: Qwen3-Next, Qwen3.5)
runs a causal depthwise convolution of width k over q, k and v, then the gated
delta rule, a recurrence over the tokens:

    S_t = A_t S_{t-1} + beta_t k_t v_t^T,   A_t = exp(g_t) (I - beta_t k_t k_t^T)
    o_t = S_t^T q_t                          (S: [Dk, Dv] per head)

Under sequence parallelism each rank holds a contiguous piece of the sequence,
so both reach back into the ranks before it:

* the convolution needs the last k-1 tokens of the pieces before this one
  (conv_halo: a linear shift to ring rank + 1, the first rank getting zeros;
  in backward the halo's gradient goes back the same way, reversed);
* the recurrence needs the state at the start of the piece. The state at the
  end of a piece is affine in the state at its start, S_out = M S_in + h: every
  rank runs its piece from a zero state, which gives h [B, H, Dk, Dv], and
  carries M [B, H, Dk, Dk], the product of its A_t. One all-gather of the (h, M)
  pairs, and each rank folds those of the ranks before it in rank order (in
  fp32, fp64 for fp64): S_in(r) = M_{r-1} S_in(r-1) + h_{r-1}. Its outputs then
  need no second pass: o_t = h_t^T q_t + S_in^T (M_t^T q_t), with h_t and M_t
  carried through the piece anyway. Backward all-gathers the gradients of the
  incoming states and folds them the other way (S_in's gradient flows to the
  ranks before).

Why one all-gather and not a scan over the ring (each rank waiting for the state
of the one before, adding its own, sending it on): the scan moves less, one
state [B, H, Dk, Dv] per hop against P pairs (h, M) of B H Dk (Dk + Dv) per rank,
but its P - 1 hops are in series, each an op's latency on the critical path of
the last rank, and that latency does not shrink with the bytes. With
Qwen3-Next's 32 value heads of 128 x 128 the pair is 4 MiB in fp32, 32 MiB
received per rank on 8 ranks, against 7 hops of 2 MiB one after another: beside
what a layer holds for thousands of tokens a rank the bytes are small, and they
do not grow with the sequence; the hops grow with P. The fold itself, P matrix
products per rank, costs less than the piece's own recurrence once a piece has
more tokens than P x Dk. Each rank folds the same pairs in the same order, so
the ranks agree on every state bit for bit.

Documents. Packed batches reset at every document start, taken from the global
position ids (the batch's SeqLayout, or from_cu_seqlens): an SP boundary is not
a document boundary. A document starting inside a piece, or exactly at its
first token, cuts the state coming in (that rank's M is 0 from there on), and
the convolution takes no tap from another document: the halo is zero exactly
for its tokens of another document than the piece's first token (documents
are contiguous, so such a token shares a document with no token of the piece
whose window reaches it), and every other tap of another document is left out
as a varlen convolution leaves it out.

Why contiguous pieces and not zigzag: zigzag balances softmax attention, whose
work grows with a token's position; a linear layer costs the same per token
wherever it sits, so contiguous pieces balance it already. And zigzag would
give each rank two separate chunks, the state and the halo crossing between
ranks 2P - 1 times instead of P - 1. The layout is therefore a SeqLayout of one
Ulysses group and no ring (contiguous pieces, padding at the end), which is
also the layout of Ulysses softmax attention: a hybrid model runs both kinds of
layer on the same tokens with no re-layout between them.

Ulysses (VeOmni's way for GatedDeltaNet). With a Ulysses group, q, k, v,
beta and the log decay g go seq->head in one all-to-all of five tensors of two
head counts, each rank runs the recurrence over its Ulysses group's whole
stretch of the sequence for its heads, and the output comes back head->seq.
q and k may have fewer heads than v (Qwen3-Next: 16 against 32; value head j
reads q/k head j // (Hv / Hk), torch's repeat_interleave): they travel as
key/value-like tensors (HEADS_KV) and v, beta and g as the query-like tensors
of Hk groups (HEADS_Q, kv_heads = Hk), so a rank gets the q/k heads of its v
heads. Where the Hk heads are fewer than the ranks, each is replicated to the
ranks of its group (its gradient summed over the replicas on the way back);
where heads do not split evenly, spd pads with dummy heads, zeros, which a
rank runs as it runs the others (k = 0, beta = 0, g = 0: the state stays zero)
and which head->seq drops.

With Ulysses inside context parallelism (a mesh of ulysses x ring), the
Ulysses group's stretch is one ring rank's contiguous shard, and the state is
passed between the ring ranks as above, per head: the ring group's ranks hold
the same heads. With Ulysses alone the stretch is the whole sequence and
nothing is passed: local_recurrence() with the global resets is the
single-process layer.

Why the convolution runs before the all-to-all, on the pieces with the halo,
and not after it on whole sequences for the rank's channels: the convolution
is per channel along the tokens, so either is exact. After the all-to-all it
would need no halo, but each rank would convolve with its slice of the
weight, whose rows follow the heads spd deals out (replicated q/k heads on
several ranks, dummy heads on none), and the q/k channels would be convolved,
activated and normalised once per replica; the weight's gradient of a
replicated channel would then be a sum over the replicas. Before it, every
channel of every token is convolved once, by the same code for context
parallelism, Ulysses and both, with the whole weight, and the all-to-all
carries what the recurrence reads (the convolved, activated, normalised q, k,
v) in the same bytes; the price is the halo, one linear shift of k-1 tokens
per layer, in a model whose every layer already moves far more in its
all-to-alls.

The recurrence here is a plain loop over tokens in torch ops (autograd does its
backward): a reference for small sizes, not a kernel. A chunked kernel takes
its place by computing the same (o, U, h, M) of a piece.
"""
import torch

from . import HEADS_KV, HEADS_Q
from . import torch as spt
from .blockwise import acc_dtype
from .layout import SeqLayout


class LinearContext:
    """One batch's contiguous layout as the linear layers use it.

    h, group: the handle and the group of the pieces (a Mesh's ulysses_group
    with no ring, or any Group); layout: the batch's SeqLayout of group.size
    Ulysses ranks and no ring, this rank's place in it group.rank.

    piece:  L, the tokens of every rank's piece, padding included
    start:  the global index of this rank's first token
    resets: [B, L] True where a document starts (the sequence's first token
            included)

    The recurrence runs, by default, with context parallelism over group.
    ulysses, a Group of consecutive ranks of group (a Mesh's ulysses_group),
    runs it by Ulysses over those ranks instead, each rank taking its heads of
    the group's stretch [B, U L] of the sequence; ring, the group of the ranks
    holding the same heads of the other stretches (a Mesh's ring_group), then
    passes the state between the stretches. for_mesh() takes both from a Mesh.

    stretch, stretch_start, stretch_resets: piece, start and resets of what
    this rank's recurrence runs over (its piece without Ulysses).
    """

    def __init__(self, h, group, layout, ulysses=None, ring=None):
        if layout.ring != 1 or layout.ulysses != group.size or layout.ulysses_rank != group.rank:
            raise ValueError(f"the linear layers take contiguous pieces: a SeqLayout of ulysses {group.size}, ring 1, "
                             f"ulysses rank {group.rank}; this one is ulysses {layout.ulysses} rank "
                             f"{layout.ulysses_rank}, ring {layout.ring}")
        self.h, self.group, self.layout = h, group, layout
        self.piece = layout.shard_len // group.size
        self.start = group.rank * self.piece
        doc = layout.doc
        starts = torch.ones_like(doc, dtype=torch.bool)
        starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
        self.resets = starts[:, self.start:self.start + self.piece]
        self.ulysses = ulysses if ulysses is not None and ulysses.size > 1 else None
        self.ring = group if ulysses is None else ring
        U, R = ulysses.size if ulysses is not None else 1, self.ring.size if self.ring is not None else 1
        if (U * R != group.size or (ulysses is not None and group.rank % U != ulysses.rank)
                or (self.ring is not None and self.ring.rank != group.rank // U)):
            raise ValueError(f"ulysses {U} x ring {R} does not lay out rank {group.rank} of {group.size}: the "
                             f"pieces run in rank order, rank = ring rank x {U} + ulysses rank, so each Ulysses "
                             "group is a run of consecutive ranks (a Mesh's sp_group, ulysses_group and ring_group)")
        self.stretch = U * self.piece
        self.stretch_start = self.start // self.stretch * self.stretch
        self.stretch_resets = starts[:, self.stretch_start:self.stretch_start + self.stretch]

    @classmethod
    def for_mesh(cls, h, mesh, position_ids):
        """The linear layers of spclient.Mesh `mesh` for a batch of [B, S]
        position ids: contiguous pieces over mesh.sp_group in its rank order
        (ring rank x ulysses + ulysses rank), the recurrence by Ulysses over
        mesh.ulysses_group and context parallelism over mesh.ring_group."""
        layout = SeqLayout(position_ids, mesh.sp, mesh.sp_group.rank)
        return cls(h, mesh.sp_group, layout, mesh.ulysses_group, mesh.ring_group)

    @classmethod
    def from_cu_seqlens(cls, h, group, cu_seqlens):
        """From the global cu_seqlens [0, ..., S] of a batch of one row."""
        cu = [int(c) for c in cu_seqlens]
        pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])
        return cls(h, group, SeqLayout(pos[None], group.size, group.rank))

    def window_docs(self, k):
        """[B, k-1+L] the document of every token a width-k window of this piece
        reads: the k-1 before the piece (-1 before the sequence), then its own."""
        idx = torch.arange(self.start - (k - 1), self.start + self.piece)
        return self.layout.doc[:, idx.clamp(min=0)].masked_fill((idx < 0)[None], -1)

    def halo_keep(self, k):
        """[B, k-1] True for the halo tokens of the piece's first token's document."""
        docs = self.window_docs(k)
        return docs[:, :k - 1] == docs[:, k - 1:k]


# ---------------------------------------------------------------- the convolution


def conv_halo(ctx, x, k):
    """The k-1 tokens before this rank's piece, [B, k-1, C], from the ranks
    before it (zeros before the sequence), zero where a token is of another
    document than the piece's first. x [B, n, C]: this rank's real tokens.
    Differentiable: the gradient of the halo goes back to the ranks it came
    from. A piece shorter than k-1 tokens takes ceil((k-1) / L) shifts, each
    reaching one piece further back."""
    x = ctx.layout.pad(x)
    w, L = k - 1, x.shape[1]
    halo = x.new_zeros((x.shape[0], w) + tuple(x.shape[2:]))
    for _ in range(-(-w // L)):
        tail = torch.cat([halo, x], dim=1)[:, -w:].contiguous()
        (halo,) = spt.shift(ctx.h, ctx.group, tail, linear=True)
    keep = ctx.halo_keep(k).to(halo.device)
    return halo * keep.reshape(keep.shape + (1,) * (halo.dim() - 2)).to(halo.dtype)


def causal_conv(window, weight, docs):
    """A causal depthwise convolution inside documents: window [B, k-1+L, C] (the
    k-1 tokens before the L of the output, then those), weight [C, k], docs
    [B, k-1+L] the document of each. out[t] = sum_i weight[:, i] window[t + i]
    over the taps of token t's document (torch's conv1d with k-1 zeros on the
    left, per document). Returns [B, L, C]."""
    k = weight.shape[1]
    L = window.shape[1] - (k - 1)
    docs = docs.to(window.device)
    own = docs[:, k - 1:]
    out = None
    for i in range(k):
        same = (docs[:, i:i + L] == own)[..., None].to(window.dtype)
        tap = window[:, i:i + L] * same * weight[:, i]
        out = tap if out is None else out + tap
    return out


def short_conv(ctx, x, weight):
    """The short convolution of a linear layer over this rank's tokens x [B, n, C]
    (weight [C, k]), with the halo from the ranks before. Returns [B, n, C];
    the activation is the caller's."""
    k = weight.shape[1]
    window = torch.cat([conv_halo(ctx, x, k), ctx.layout.pad(x)], dim=1)
    return ctx.layout.unpad(causal_conv(window, weight, ctx.window_docs(k)))


# ---------------------------------------------------------------- the recurrence


def _apply_transition(x, k, beta, decay):
    """A_t x = exp(g_t) (x - beta_t k_t (k_t^T x)) for x [B, H, Dk, *]."""
    kx = torch.einsum("bhk,bhkx->bhx", k, x)
    return decay[..., None, None] * (x - beta[..., None, None] * k[..., :, None] * kx[..., None, :])


def local_recurrence(q, k, v, beta, g, resets):
    """The gated delta rule over one piece, from a zero state, with the
    transition that carries the piece's incoming state along.

    q, k [B, L, Hk, Dk], v [B, L, H, Dv], beta and g (the log decay, <= 0)
    [B, L, H], with H a multiple of Hk (value head j reads q/k head j // (H /
    Hk)), resets [B, L] (a document starts: the state so far is dropped).
    Returns, in acc_dtype(q.dtype):
      o  [B, L, H, Dv]  the outputs from a zero incoming state
      u  [B, L, H, Dk]  M_t^T q_t: the output of token t is o_t + S_in^T u_t
      h  [B, H, Dk, Dv] the state at the end from a zero incoming state
      m  [B, H, Dk, Dk] the transition: the state at the end is m S_in + h
    Over a whole sequence with its resets, o is the single-process layer."""
    dt = acc_dtype(q.dtype)
    q, k, v, beta, decay = q.to(dt), k.to(dt), v.to(dt), beta.to(dt), torch.exp(g.to(dt))
    if k.shape[2] != v.shape[2]:      # value head j reads q/k head j // (Hv / Hk)
        q, k = (x.repeat_interleave(v.shape[2] // k.shape[2], dim=2) for x in (q, k))
    B, L, H, Dk = k.shape
    s = k.new_zeros((B, H, Dk, v.shape[-1]))
    m = torch.eye(Dk, dtype=dt, device=k.device).expand(B, H, Dk, Dk)
    keep = (~resets).to(dt).to(k.device)[:, :, None, None, None]
    outs, us = [], []
    for t in range(L):
        kt, bt, at = k[:, t], beta[:, t], decay[:, t]
        s = _apply_transition(s * keep[:, t], kt, bt, at) + bt[..., None, None] * kt[..., :, None] * v[:, t, :, None]
        m = _apply_transition(m * keep[:, t], kt, bt, at)
        outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t], s))
        us.append(torch.einsum("bhi,bhij->bhj", q[:, t], m))
    return torch.stack(outs, dim=1), torch.stack(us, dim=1), s, m


def _allgather(h, group, *xs):
    """Every rank's xs, in one all-gather: per x a tensor [P, *x.shape]."""
    flat = torch.cat([x.detach().reshape(-1) for x in xs])
    recv = spt._empty(h, flat, (group.size, flat.numel()))
    h.allgather(group, spt._staged(h, flat), recv)
    out, off = [], 0
    for x in xs:
        out.append(recv[:, off:off + x.numel()].reshape((group.size,) + tuple(x.shape)).clone())
        off += x.numel()
    return out


class _StatePass(torch.autograd.Function):
    """The incoming state of this rank's piece from every rank's (h, m): the fold
    S_in(r) = m_{r-1} S_in(r-1) + h_{r-1} over the ranks before, after one
    all-gather. Backward all-gathers the incoming states' gradients and folds
    them from the last rank down: the gradient D of this rank's outgoing state
    is that of rank r+1's incoming one plus m_{r+1}^T times rank r+1's D; then
    dh = D and dm = D S_in^T."""

    @staticmethod
    def forward(ctx, h, group, state, trans):
        states, transs = _allgather(h, group, state, trans)
        s_in = torch.zeros_like(state)
        for j in range(group.rank):
            s_in = transs[j] @ s_in + states[j]
        ctx.h, ctx.group, ctx.transs = h, group, transs
        ctx.save_for_backward(s_in)
        return s_in

    @staticmethod
    def backward(ctx, d_in):
        (s_in,), transs = ctx.saved_tensors, ctx.transs
        (d_ins,) = _allgather(ctx.h, ctx.group, d_in.contiguous())
        d_out = torch.zeros_like(s_in)
        for j in range(ctx.group.size - 1, ctx.group.rank, -1):
            d_out = d_ins[j] + transs[j].transpose(-1, -2) @ d_out
        return None, None, d_out, d_out @ s_in.transpose(-1, -2)


def gated_delta_rule(ctx, q, k, v, beta, g):
    """The gated delta rule of this rank's tokens over the whole sequence: q, k
    [B, n, Hk, Dk], v [B, n, H, Dv], beta and g (log decay) [B, n, H] of its n
    real tokens (H a multiple of Hk); returns o [B, n, H, Dv] in q's dtype,
    resets at the batch's documents. With context parallelism the state from
    the ranks before is passed in (one all-gather); with Ulysses the five go
    seq->head in one all-to-all and o comes back head->seq. Differentiable;
    backward runs the same ops the other way."""
    pad = ctx.layout.pad
    xs = [pad(q), pad(k), pad(v), pad(beta)[..., None], pad(g)[..., None]]
    if ctx.ulysses is not None:
        xs = _seq_to_head(ctx, xs, k.shape[2], v.shape[2])
    o, u, state, trans = local_recurrence(xs[0], xs[1], xs[2], xs[3][..., 0], xs[4][..., 0], ctx.stretch_resets)
    if ctx.ring is not None and ctx.ring.size > 1:
        s_in = _StatePass.apply(ctx.h, ctx.ring, state, trans)
        o = o + torch.einsum("blhk,bhkv->blhv", u, s_in)
    o = o.to(q.dtype)
    if ctx.ulysses is not None:
        (o,) = spt.head_to_seq(ctx.h, ctx.ulysses, ctx.stretch, (v.shape[2],), o, kv_heads=k.shape[2],
                               kinds=(HEADS_Q,))
    return ctx.layout.unpad(o)


def _seq_to_head(ctx, xs, k_heads, v_heads):
    """q, k, v, beta, g (beta and g as [B, L, H, 1]) of this rank's piece ->
    this rank's heads of the Ulysses group's stretch, in one all-to-all: q and
    k as key/value-like tensors of Hk heads, the others as query-like tensors
    of Hk groups, so that a rank holds the q/k heads its v heads read."""
    if v_heads % k_heads:
        raise ValueError(f"v has {v_heads} heads, q and k {k_heads}: the value heads must be a multiple")
    heads = (k_heads, k_heads, v_heads, v_heads, v_heads)
    kinds = (HEADS_KV, HEADS_KV, HEADS_Q, HEADS_Q, HEADS_Q)
    return list(spt.seq_to_head(ctx.h, ctx.ulysses, ctx.stretch, heads, *xs, kv_heads=k_heads, kinds=kinds))
