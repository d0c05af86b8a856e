"""Losses over sequence-parallel ranks beyond the token mean: per-token values
gathered into whole sequences, values read at given tokens wherever the layout
put them, and the token count of a whole gradient-accumulation window.

The convention is spclient.torch's: every rank of an SP group computes the
same loss, each collective's backward sums the gradient over the group, and
the parameter gradients are then averaged over the ranks that train one model
(the SP group, or DP x SP), as data parallelism averages them. A token's
gradient thus arrives sp times over on the rank that holds it, and the average
brings it back to the single-process gradient.

* all_gather: every rank's tensor, stacked in group rank order; backward is a
  reduce-scatter in rank order (h.reduce_scatter), so each rank gets the sum
  over the group of the gradients of its own block, the same bits every run.
* gather_tokens: this rank's tokens of a SeqLayout (zigzag or contiguous) to
  the whole [B, S, ...] in global order, the layout's padding dropped: the
  per-token log-probs that GRPO and PPO take whole.
* read_tokens, last_token_reward: the values at given tokens (the last real
  one of each row), from whichever rank holds each, on every rank of the
  group; only the holder's values get a gradient.
* Window: the valid tokens of a whole accumulation window over the ranks that
  average their gradients, counted with one all-reduce before the window
  starts, so that each micro-batch's loss is its share of the window's token
  mean. SP = N, DP = N and one process then give the same gradients for the
  same window however it is cut into micro-batches (the DeepSpeed Ulysses
  document's DP = 8 vs SP = 8 at accumulation 8 table). A mean per rank or per
  micro-batch instead weights each token by how many others happened to share
  its rank or micro-batch.
* sft_loss, grpo_loss: the SFT token mean and the GRPO objective over a Window.
"""
import torch

from . import torch as spt


# ---------------------------------------------------------------- all-gather


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, group, x):
        ctx.h, ctx.group = h, group
        send = spt._staged(h, x)
        return h.allgather(group, send, spt._empty(h, send, (group.size,) + tuple(send.shape)))

    @staticmethod
    def backward(ctx, grad):
        # Rank r's block of every rank's gradient, summed in rank order.
        grad = spt._staged(ctx.h, grad)
        return None, None, ctx.h.reduce_scatter(ctx.group, grad, spt._empty(ctx.h, grad, grad.shape[1:]))


def all_gather(h, group, x):
    """[P, *x.shape]: every rank's x in group rank order (every rank's x has one
    shape and dtype). Backward: each rank's x gets the sum over the group of
    the gradients of its block, reduced in rank order by spd."""
    return _AllGather.apply(h, group, x)


# ---------------------------------------------------------------- tokens of a layout


def _check_layout(what, group, layout, x):
    """Raises ValueError unless group is the SP group `layout` was made for,
    this rank in it where the layout says (sp rank = ring rank x ulysses +
    ulysses rank, as spd's meshes place them), and x holds this rank's real
    tokens on dim 1."""
    P = layout.ulysses * layout.ring
    me = layout.ring_rank * layout.ulysses + layout.ulysses_rank
    if (group.size, group.rank) != (P, me):
        raise ValueError(f"{what}: this rank is rank {group.rank} of a group of {group.size}; the layout places it "
                         f"at sp rank {me} of {P} (ring rank {layout.ring_rank} x {layout.ulysses} + ulysses rank "
                         f"{layout.ulysses_rank}): pass the SP group the layout was made for")
    if x.dim() < 2 or x.shape[1] != layout.local.numel():
        raise ValueError(f"{what}: x has shape {tuple(x.shape)}; dim 1 must hold this rank's "
                         f"{layout.local.numel()} real tokens (layout.local)")


def _gathered_order(layout):
    """Where each of the S real tokens lies in the pieces of every SP rank laid
    end to end in rank order (what all_gather of layout.pad(x) holds)."""
    pieces = [layout._piece(p // layout.ulysses, p % layout.ulysses) for p in range(layout.ulysses * layout.ring)]
    return torch.argsort(torch.cat(pieces))[:layout.seq_len]     # the padding, indices >= S, sorts last


def gather_tokens(h, group, layout, x):
    """The whole [B, S, ...] of per-token x, every rank's real tokens in global
    order, on every rank of the SP group `group`; x: [B, n, ...], this rank's
    tokens (layout.local). One all-gather of the ranks' pieces, padded alike;
    backward gives each rank the gradient of its own tokens, summed over the
    group (a reduce-scatter in rank order)."""
    _check_layout("gather_tokens", group, layout, x)
    pieces = all_gather(h, group, layout.pad(x))                 # [P, B, piece, ...]
    whole = pieces.movedim(0, 1).flatten(1, 2)                   # [B, P x piece, ...]
    return whole.index_select(1, _gathered_order(layout).to(x.device))


def read_tokens(h, group, layout, x, index):
    """[B, K]: x[b, index[b, k]] of the whole sequence, on every rank of the SP
    group `group`. x: [B, n], this rank's tokens; index: [B, K] global token
    indices below S. Each rank puts in the values it holds and zeros
    elsewhere, and one all-reduce adds them (a value plus zeros is the value,
    bit for bit): every row's reads in one op wherever zigzag put them, not a
    broadcast per holder. Backward: the holder's x gets the gradient, summed
    over the group; the other ranks' x get zeros there."""
    _check_layout("read_tokens", group, layout, x)
    if x.dim() != 2 or index.dim() != 2 or index.shape[0] != x.shape[0]:
        raise ValueError(f"read_tokens: x [B, n] and index [B, K] of one B, not {tuple(x.shape)} and "
                         f"{tuple(index.shape)}")
    if index.numel() and not 0 <= int(index.min()) <= int(index.max()) < layout.seq_len:
        raise ValueError(f"read_tokens: index runs from {int(index.min())} to {int(index.max())}; the sequence "
                         f"holds tokens 0 to {layout.seq_len - 1}")
    at = torch.full((layout.seq_len,), -1, dtype=torch.int64)
    at[layout.local] = torch.arange(layout.local.numel())
    at = at[index.cpu()].to(x.device)                            # [B, K]: where in x, or -1
    # Padded, x has at least one column, so a rank holding no token reads too
    # and stays in the graph: every rank must take part in the backward.
    mine = torch.where(at >= 0, layout.pad(x).gather(1, at.clamp(min=0)), torch.zeros((), dtype=x.dtype,
                                                                                       device=x.device))
    return spt.all_reduce(h, group, mine)


def last_token_reward(h, group, layout, values, lengths=None):
    """[B]: each row's value at its last real token, on every rank of the SP
    group: what a reward or value model scores a sequence with. values: [B, n]
    per-token scores of this rank's tokens; lengths: [B] real tokens of each
    row, right-padded after them (None: every row is S long). The rank that
    holds a row's last token follows from the layout (under zigzag, often not
    the last rank); only its values get the row's gradient."""
    if lengths is None:
        ends = torch.full((values.shape[0], 1), layout.seq_len - 1, dtype=torch.int64)
    else:
        ends = lengths.to("cpu", torch.int64).reshape(-1, 1) - 1
    return read_tokens(h, group, layout, values, ends)[:, 0]


# ---------------------------------------------------------------- accumulation window


class Window:
    """The valid tokens of one gradient-accumulation window, counted before the
    window starts:

      tokens: T, the valid tokens of every micro-batch of the window on every
              rank of `group`;
      dp:     the data-parallel replicas among them (group.size / sp).

    group: the ranks whose parameter gradients are averaged together (the SP
    group; with data parallelism, the DP x SP world). sp: the SP degree inside
    it (None: group is one SP group). counts: this rank's own valid tokens of
    each micro-batch of the window, as ints or masks of its own tokens (not of
    gathered rows, which every SP rank holds). One all-reduce over the group.
    """

    def __init__(self, h, group, counts, sp=None):
        sp = group.size if sp is None else sp
        if sp < 1 or group.size % sp:
            raise ValueError(f"Window: sp = {sp} does not divide the group's {group.size} ranks")
        n = h.empty((1,), torch.int64)
        n[0] = sum(int(c.sum()) if isinstance(c, torch.Tensor) else int(c) for c in counts)
        self.tokens = int(h.allreduce(group, n, h.empty((1,), torch.int64))[0])   # not in place: restart-safe
        self.dp = group.size // sp

    def normalise(self, total):
        """A micro-batch's share of the window's token mean, from `total`, the sum
        over its tokens (the same on every rank of its SP group): total x dp / T.
        Parameter gradients, summed over the window's micro-batches and averaged
        over the group, are then those of (sum over the window) / T. A window
        with no valid token gives 0."""
        return total * (self.dp / self.tokens) if self.tokens else total * 0


def sft_loss(h, group, logprobs, mask, window):
    """One micro-batch's share of the window's token-mean negative log-likelihood:
    -(sum of log p over the SP group's valid tokens) x dp / T.

    logprobs, mask: [B, n] for this rank's own tokens (mask: the tokens with a
    label). The sum is all-reduced over the SP group `group` with autograd,
    so every rank of it holds the same loss."""
    own = torch.where(mask, logprobs, torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)).sum()
    return -window.normalise(spt.all_reduce(h, group, own.reshape(1))[0])


def grpo_loss(logprobs, old_logprobs, ref_logprobs, advantages, mask, window, clip=0.2, beta=0.04):
    """One micro-batch's share of the GRPO loss over the window.

    GRPO (Shao et al., DeepSeekMath, 2024, arXiv:2402.03300, section 4.1.1,
    eq. 3 and 4) maximises

      J(θ) = E[ 1/G Σ_i 1/|o_i| Σ_t { min( r_it Â_it, clip(r_it, 1 - ε, 1 + ε) Â_it )
                                       - β D_KL[π_θ || π_ref]_it } ]
      r_it = π_θ(o_it | q, o_i<t) / π_θold(o_it | q, o_i<t)
      D_KL[π_θ || π_ref]_it = π_ref(o_it | ...) / π_θ(o_it | ...)
                              - log(π_ref(o_it | ...) / π_θ(o_it | ...)) - 1

    over G outputs o_i of a question q, Â the advantages. The per-sequence
    mean 1/|o_i| and the mean over G are replaced here by one mean over the T
    response tokens of the whole accumulation window, the token-level loss of
    DAPO (Yu et al., 2025, arXiv:2503.14476, section 3.3), so that the split
    into ranks and micro-batches changes nothing:

      loss = -(1 / T) Σ_window Σ_it mask_it { min( r Â, clip(r) Â ) - β D_KL }

    and this micro-batch's part of it is window.normalise of its sum.

    logprobs: [B, S] log π_θ of each token, whole rows (gather_tokens), the
    same on every rank of the SP group; old_logprobs, ref_logprobs: [B, S]
    under π_θold and π_ref (no gradient taken); advantages: [B] per sequence
    or [B, S] per token; mask: [B, S], the response tokens."""
    adv = advantages if advantages.dim() == 2 else advantages[:, None]
    ratio = torch.exp(logprobs - old_logprobs.detach())
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip, 1 + clip) * adv)
    log_ref = ref_logprobs.detach() - logprobs
    kl = torch.exp(log_ref) - log_ref - 1
    per_token = torch.where(mask, surrogate - beta * kl, torch.zeros((), dtype=logprobs.dtype,
                                                                     device=logprobs.device))
    return -window.normalise(per_token.sum())
