"""Autograd for sequence parallelism over spd.

The backward of each op is the op a single-process model's gradient needs:

* all_reduce (the SP loss reduction): forward sums over the group; backward sums
  the gradient over the group too, as torch.distributed.nn.all_reduce does. With
  two ranks holding x = 2 and x = 3, y = w0·x all-reduced and loss = 2y − 1, the
  ranks' w0 gradients are 8 and 12 and their mean 10 is the single-process
  gradient; a plain (non-autograd) all-reduce would give 4 and 6.
* seq_to_head / head_to_seq (Ulysses): each is the other's backward. A KV tensor
  replicated on its way in gets its gradient summed over the copies on its way
  back (SPC_A2A_SUM_REPLICAS).
* shift (Ring): the gradient of a tensor sent to rank + 1 comes back from rank + 1,
  that is, shifts the other way; linear stays linear (the first rank's zeros have
  no gradient, the last rank's block sent nowhere gets zeros).
* alltoallv (uneven all-to-all): the backward is the transposed alltoallv, each
  gradient block going back to the rank its rows came from (the counts swap).

Host tensors handed in are copied into the handle's arena when they are not
there already (one host copy); their results live in the arena. CUDA tensors
are used where they are (made contiguous when they are not) and their results
are new CUDA tensors of the same device, ordered on the current torch stream:
forward and backward return without waiting for spd (backward runs on the
stream of its forward, which autograd makes current).
"""
import ctypes
import math

import torch

from . import BSHD, HEAD_TO_SEQ, HEADS_KV, HEADS_Q, SEQ_TO_HEAD, SUM_REPLICAS, Status, _check, _raise
from . import _lib
from ._lib import lib


def _staged(h, x):
    """x as an op may name it: a CUDA tensor as it is (contiguous); a host tensor
    itself when it is a contiguous arena tensor of h, else a copy in the arena."""
    x = x.detach()
    if x.is_cuda:
        return x.contiguous()
    if x.is_contiguous() and h.in_arena(x):
        return x
    y = h.empty(tuple(x.shape), x.dtype)
    y.copy_(x)
    return y


def _empty(h, x, shape=None):
    """An uninitialised result for an op on x: in h's arena, or on x's GPU."""
    return h.empty(tuple(x.shape) if shape is None else tuple(shape), x.dtype, device=x.device)


def _sum(h, group, x):
    """The sum of x over the group into a new tensor (x stays untouched). Never
    in place: an op that reads only its inputs runs again whole after a restart
    of spd, where one in place would fail with RestartedError."""
    x = _staged(h, x)
    return h.allreduce(group, x, _empty(h, x))


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, group, x):
        ctx.h, ctx.group = h, group
        return _sum(h, group, x)

    @staticmethod
    def backward(ctx, grad):
        return None, None, _sum(ctx.h, ctx.group, grad)


def all_reduce(h, group, x):
    """Sum over the group with the gradient all-reduced in backward."""
    return _AllReduce.apply(h, group, x)


class _Ulysses(torch.autograd.Function):
    """One direction of the Ulysses all-to-all; its backward is the other one,
    summing replicated KV gradients when it goes back to sequence shards."""

    @staticmethod
    def forward(ctx, h, group, direction, seq_len, heads, kv_heads, layout, kinds, *xs):
        ctx.args = (h, group, direction, seq_len, heads, kv_heads, layout, kinds)
        return tuple(_exchange(h, group, direction, seq_len, heads, kv_heads, layout, xs, sum_replicas=False,
                               kinds=kinds))

    @staticmethod
    def backward(ctx, *grads):
        h, group, direction, seq_len, heads, kv_heads, layout, kinds = ctx.args
        back = HEAD_TO_SEQ if direction == SEQ_TO_HEAD else SEQ_TO_HEAD
        gs = _exchange(h, group, back, seq_len, heads, kv_heads, layout, [g.contiguous() for g in grads],
                       sum_replicas=back == HEAD_TO_SEQ, kinds=kinds)
        return (None,) * 8 + tuple(gs)


def _exchange(h, group, direction, seq_len, heads, kv_heads, layout, xs, sum_replicas, kinds=None, blocking=True):
    """One all-to-all of tensors xs ([B, S, H, D] or [S, B, H, D]); heads[i] is the
    global head count of xs[i], its kind kinds[i], or when kinds is None q for the
    first and kv for the others when kv_heads is set. Returns the outputs, in the
    arena or on the inputs' GPU; blocking=False returns the op's Request instead,
    whose wait() returns them."""
    P = group.size
    s_loc = (seq_len + P - 1) // P
    tensors, outs = [], []
    for i, x in enumerate(xs):
        x = _staged(h, x)
        kind = kinds[i] if kinds is not None else HEADS_KV if (kv_heads and i > 0) else HEADS_Q
        local = h.local_heads(heads[i], kind, kv_heads, P)
        if local == 0:
            raise ValueError(f"{heads[i]} heads cannot be dealt to {P} ranks (kv_heads {kv_heads})")
        shape = list(x.shape)
        seq_dim = 1 if layout == BSHD else 0
        if direction == SEQ_TO_HEAD:
            shape[seq_dim], shape[2] = seq_len, local
        else:
            shape[seq_dim], shape[2] = s_loc, heads[i]
        out = _empty(h, x, shape)
        flags = SUM_REPLICAS if (sum_replicas and kind == HEADS_KV) else 0
        tensors.append((x, out, heads[i], kind, flags))
        outs.append(out)
    batch = xs[0].shape[0] if layout == BSHD else xs[0].shape[1]
    if not blocking:
        return h.ialltoall(group, tensors, direction, seq_len, batch=batch, layout=layout, kv_heads=kv_heads)
    h.alltoall(group, tensors, direction, seq_len, batch=batch, layout=layout, kv_heads=kv_heads)
    return outs


def seq_to_head(h, group, seq_len, heads, *xs, kv_heads=0, layout=BSHD, kinds=None):
    """Ulysses before attention: [B, S/P, H, D] -> [B, S, H/P, D] for each of xs,
    up to 8 in one all-to-all (q first; with kv_heads set, the others are key/value
    tensors). heads: the global head count of each tensor. kinds: HEADS_Q or
    HEADS_KV per tensor instead (GatedDeltaNet: q and k as HEADS_KV, replicated
    where they have fewer heads than ranks; v, beta and the gate as HEADS_Q)."""
    return _Ulysses.apply(h, group, SEQ_TO_HEAD, seq_len, tuple(heads), kv_heads, layout,
                          None if kinds is None else tuple(kinds), *xs)


def head_to_seq(h, group, seq_len, heads, *xs, kv_heads=0, layout=BSHD, kinds=None):
    """Ulysses after attention: [B, S, H/P, D] -> [B, S/P, H, D]."""
    return _Ulysses.apply(h, group, HEAD_TO_SEQ, seq_len, tuple(heads), kv_heads, layout,
                          None if kinds is None else tuple(kinds), *xs)


class Pending:
    """A seq->head all-to-all in flight (iseq_to_head): wait() returns its
    outputs, in autograd's graph. Between the two, forward's other work (the
    query projection) runs beside the transfer; in backward the head->seq
    all-to-all of the outputs' gradients is submitted as soon as they exist and
    waited for only when autograd reaches the inputs' gradients, after the work
    recorded between iseq_to_head and wait() (the query's all-to-all and
    projection backward) has run beside it."""

    def __init__(self, h, group, args, xs):
        self._h, self._group, self._args = h, group, args
        self._req = self._back = None
        self._outs = _IUlyssesStart.apply(self, *xs)

    def wait(self):
        if self._outs is None:
            raise RuntimeError("Pending.wait(): already waited for")
        outs, self._outs = self._outs, None
        return _IUlyssesWait.apply(self, *outs)


class _IUlyssesStart(torch.autograd.Function):
    """Submits the all-to-all; its outputs are filled when the op completes."""

    @staticmethod
    def forward(ctx, pending, *xs):
        group, seq_len, heads, kv_heads, layout, kinds = pending._group, *pending._args
        pending._req = _exchange(pending._h, group, SEQ_TO_HEAD, seq_len, heads, kv_heads, layout, xs,
                                 sum_replicas=False, kinds=kinds, blocking=False)
        ctx.pending = pending
        return tuple(pending._req.result)

    @staticmethod
    def backward(ctx, *grads):
        # grads are what _IUlyssesWait.backward passed through unchanged, whose
        # head->seq it submitted then: its result is their gradient here.
        pending = ctx.pending
        back, pending._back = pending._back, None
        return (None,) + tuple(back.wait())


class _IUlyssesWait(torch.autograd.Function):
    """Waits for the all-to-all (identity on its outputs); backward submits the
    gradients' head->seq and passes the gradients on."""

    @staticmethod
    def forward(ctx, pending, *outs):
        req, pending._req = pending._req, None
        req.wait()
        ctx.pending = pending
        return outs

    @staticmethod
    def backward(ctx, *grads):
        pending = ctx.pending
        group, seq_len, heads, kv_heads, layout, kinds = pending._group, *pending._args
        grads = [g.contiguous() for g in grads]
        pending._back = _exchange(pending._h, group, HEAD_TO_SEQ, seq_len, heads, kv_heads, layout, grads,
                                  sum_replicas=True, kinds=kinds, blocking=False)
        return (None,) + tuple(grads)


def iseq_to_head(h, group, seq_len, heads, *xs, kv_heads=0, layout=BSHD, kinds=None):
    """seq_to_head submitted and not waited for: returns a Pending whose wait()
    gives seq_to_head's outputs, with autograd. Work between the two runs beside
    the transfer (async Ulysses: K and V travel while Q is projected), and so
    does the same work's backward beside the gradients' all-to-all. Ops
    submitted in between (the query's all-to-all) must be submitted in the same
    order on every rank, as all ops are."""
    return Pending(h, group, (seq_len, tuple(heads), kv_heads, layout, None if kinds is None else tuple(kinds)), xs)


class _Shift(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, group, channel, linear, reverse, *xs):
        ctx.h, ctx.group, ctx.channel, ctx.linear, ctx.reverse = h, group, channel, linear, reverse
        return tuple(_shift(h, group, channel, linear, reverse, xs))

    @staticmethod
    def backward(ctx, *grads):
        # Gradients travel back the way the data came, on the backward channel.
        gs = _shift(ctx.h, ctx.group, (ctx.channel + 1) % 4, ctx.linear, not ctx.reverse,
                    [g.contiguous() for g in grads])
        return (None,) * 5 + tuple(gs)


def _shift(h, group, channel, linear, reverse, xs):
    pairs, outs = [], []
    for x in xs:
        x = _staged(h, x)
        out = _empty(h, x)
        pairs.append((x, out))
        outs.append(out)
    h.shift(group, pairs, channel=channel, linear=linear, reverse=reverse)
    return outs


def shift(h, group, *xs, channel=0, linear=False, reverse=False):
    """Ring rotation with autograd: xs go to ring rank + 1; their gradients come back
    on channel + 1, so a forward K/V rotation and a backward dK/dV one never wait on
    each other."""
    return _Shift.apply(h, group, channel, linear, reverse, *xs)


class _Alltoallv(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, group, send_counts, recv_counts, x):
        ctx.args = (h, group, send_counts, recv_counts)
        return _alltoallv(h, group, x, send_counts, recv_counts)

    @staticmethod
    def backward(ctx, grad):
        h, group, send_counts, recv_counts = ctx.args
        return None, None, None, None, _alltoallv(h, group, grad.contiguous(), recv_counts, send_counts)


def _alltoallv(h, group, x, send_counts, recv_counts):
    x = _staged(h, x)
    out = _empty(h, x, (sum(recv_counts),) + tuple(x.shape[1:]))
    h.alltoallv(group, x, out, send_counts, recv_counts)
    return out


def alltoallv(h, group, x, send_counts, recv_counts):
    """Uneven all-to-all with autograd: send_counts[j] rows of x go to rank j, and the
    result holds recv_counts[i] rows from each rank i, in rank order (shards of
    multimodal sequences that differ in length). Its backward sends each gradient row
    back where the row came from."""
    return _Alltoallv.apply(h, group, tuple(send_counts), tuple(recv_counts), x)


# ---------------------------------------------------------------- losses


def dpo_loss(h, group, policy_chosen, policy_rejected, ref_chosen, ref_rejected, beta=0.1):
    """DPO over sequence-parallel ranks. Each argument holds this rank's partial
    per-sequence log-prob sums (its tokens only); they are all-reduced, with
    autograd, before the sigmoid, so every rank computes the loss of whole
    sequences: -log sigmoid(beta ((pc - rc) - (pr - rr))), averaged over pairs."""
    parts = torch.stack([policy_chosen, policy_rejected, ref_chosen, ref_rejected])
    pc, pr, rc, rr = all_reduce(h, group, parts)
    return -torch.nn.functional.logsigmoid(beta * ((pc - rc) - (pr - rr))).mean()


def token_mean_loss(h, group, loss_sum, n_tokens):
    """The token-weighted mean over ranks: (sum of losses) / (sum of valid tokens),
    both all-reduced; a rank with no valid token contributes 0 / 0 and still gets
    the finite global mean."""
    total = all_reduce(h, group, torch.stack([loss_sum, n_tokens.to(loss_sum.dtype)]))
    return total[0] / total[1]


# ---------------------------------------------------------------- batches


def pad_to_multiple(x, multiple, dim=1, value=0):
    """Pads dim of x at the end to a multiple of `multiple` (2 x sp for zigzag)."""
    n = x.shape[dim]
    extra = (-n) % multiple
    if extra == 0:
        return x
    shape = list(x.shape)
    shape[dim] = extra
    return torch.cat([x, torch.full(shape, value, dtype=x.dtype, device=x.device)], dim=dim)


# The batch helpers are libspclient's (spc_zigzag_*, spc_cu_seqlens) for host
# tensors: the same bytes moved, the same offsets found. Tensors on a GPU, and
# tensors autograd tracks, take the torch path, which keeps them where they are
# (a round trip through host memory would synchronize the stream and copy twice)
# and in the graph.


def _c_side(*xs):
    return not any(x.is_cuda or x.requires_grad for x in xs)


def _rows(x, dim):
    """x as the C helpers see it: [outer, S, row_bytes] around dim."""
    dim %= x.dim()
    return math.prod(x.shape[:dim]), x.shape[dim], math.prod(x.shape[dim + 1:]) * x.element_size(), dim


def _c_check(status, what):
    if status != Status.OK:
        _raise(status, f"{what} refused its arguments")


def zigzag_split(x, ranks, rank, dim=1):
    """Rank `rank`'s zigzag shard along dim: chunks rank and 2P-1-rank of 2P equal
    chunks. Split the position ids the same way: they stay global (a shard
    boundary is not a document boundary)."""
    if x.shape[dim] % (2 * ranks):
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not a multiple of 2 x {ranks}; pad first")
    if not _c_side(x):
        chunks = x.chunk(2 * ranks, dim=dim)
        return torch.cat([chunks[rank], chunks[2 * ranks - 1 - rank]], dim=dim)
    x = x.contiguous()
    outer, seq, row, dim = _rows(x, dim)
    shape = list(x.shape)
    shape[dim] = seq // ranks
    local = torch.empty(shape, dtype=x.dtype)
    _c_check(lib.spc_zigzag_split(x.data_ptr(), local.data_ptr(), outer, seq, row, ranks, rank), "spc_zigzag_split")
    return local


def zigzag_merge(shards, dim=1):
    """The inverse of zigzag_split: shards[r] is rank r's shard."""
    if not _c_side(*shards):
        firsts = [s.chunk(2, dim=dim)[0] for s in shards]
        seconds = [s.chunk(2, dim=dim)[1] for s in shards]
        return torch.cat(firsts + seconds[::-1], dim=dim)
    shards = [s.contiguous() for s in shards]
    outer, local_seq, row, dim = _rows(shards[0], dim)
    shape = list(shards[0].shape)
    shape[dim] = local_seq * len(shards)
    full = torch.empty(shape, dtype=shards[0].dtype)
    ptrs = (ctypes.c_void_p * len(shards))(*(s.data_ptr() for s in shards))
    _c_check(lib.spc_zigzag_merge(ptrs, full.data_ptr(), outer, shape[dim], row, len(shards)), "spc_zigzag_merge")
    return full


def zigzag_positions(seq_len, ranks, rank):
    """The global position of each of rank `rank`'s seq_len / ranks zigzag rows
    (int64): the indices zigzag_split takes."""
    pos = torch.empty(seq_len // ranks, dtype=torch.int64)
    _c_check(lib.spc_zigzag_positions(seq_len, ranks, rank, pos.data_ptr()), "spc_zigzag_positions")
    return pos


def cu_seqlens(position_ids):
    """flash-attention varlen offsets (int32) and the longest document from 1-D
    position ids of a packed sequence: a document starts where the position is 0
    or does not follow the previous one. Compute once per batch."""
    pos = position_ids.reshape(-1)
    if pos.is_cuda:
        start = torch.ones_like(pos, dtype=torch.bool)
        start[1:] = (pos[1:] == 0) | (pos[1:] != pos[:-1] + 1)
        idx = torch.nonzero(start).reshape(-1)
        cu = torch.cat([idx, torch.tensor([pos.numel()], device=pos.device)]).to(torch.int32)
        return cu, int((cu[1:] - cu[:-1]).max())
    pos = pos.detach().to(torch.int64).contiguous()
    cu = torch.empty(pos.numel() + 1, dtype=torch.int32)
    ndocs, longest = ctypes.c_uint64(), ctypes.c_int32()
    _c_check(lib.spc_cu_seqlens(pos.data_ptr(), pos.numel(), cu.data_ptr(), cu.numel(), ctypes.byref(ndocs),
                                ctypes.byref(longest)), "spc_cu_seqlens")
    return cu[:ndocs.value + 1], longest.value


def lse_merge(out, lse, out_b, lse_b, layout=BSHD):
    """Merges ring attention's block (out_b, lse_b) into (out, lse), in place, and
    returns (out, lse): attention of the same queries over two disjoint key sets
    gives the two, and their union's is lse = logaddexp(lse, lse_b), out =
    out exp(lse_old - lse) + out_b exp(lse_b - lse), computed by spc_lse_merge in
    double and rounded once, with the same bits on the CPU and on a GPU. A row
    whose lse is -inf (no key seen) adds nothing, whatever its out holds; both
    -inf give lse -inf and out 0.

    All four are fp32 and contiguous: out and out_b [B, S, H, D] (BSHD; [S, B, H,
    D] with layout=SBHD), lse and lse_b [B, H, S]; all on the CPU (merged before
    the call returns) or all on one GPU (a kernel on the current torch stream).
    There is no autograd: it is meant for a forward that autograd does not
    record (an autograd.Function's, as the ring's), and refuses a tensor that
    requires grad while grad mode is on."""
    xs = (out, lse, out_b, lse_b)
    if any(x.dtype != torch.float32 for x in xs):
        raise TypeError(f"lse_merge takes fp32 tensors, not {[str(x.dtype) for x in xs]}")
    if any(not x.is_contiguous() for x in xs):
        raise ValueError("lse_merge takes contiguous tensors")
    if len({x.device for x in xs}) != 1:
        raise ValueError(f"lse_merge's tensors are on {[str(x.device) for x in xs]}: put them on one device")
    if torch.is_grad_enabled() and any(x.requires_grad for x in xs):
        raise RuntimeError("lse_merge writes in place and has no backward: call it under torch.no_grad() "
                           "or in an autograd.Function's forward")
    if out.dim() != 4 or out_b.shape != out.shape:
        raise ValueError(f"out {tuple(out.shape)} and out_b {tuple(out_b.shape)}: want the same 4-d shape")
    B, S, H, D = out.shape if layout == BSHD else (out.shape[1], out.shape[0], out.shape[2], out.shape[3])
    if lse.shape != (B, H, S) or lse_b.shape != (B, H, S):
        raise ValueError(f"lse {tuple(lse.shape)} and lse_b {tuple(lse_b.shape)}: want [B, H, S] = {[B, H, S]}")
    if out.numel() == 0:
        return out, lse
    d = _lib.new(_lib.LseMergeDesc, layout=int(layout), batch=B, seq_len=S, heads=H, head_dim=D,
                 out=out.data_ptr(), lse=lse.data_ptr(), out_a=out.data_ptr(), lse_a=lse.data_ptr(),
                 out_b=out_b.data_ptr(), lse_b=lse_b.data_ptr())
    if out.is_cuda:
        # The kernel runs in the CUDA context current on this thread: the device's.
        with torch.cuda.device(out.device):
            d.memory = _lib.SPC_MEMORY_CUDA
            d.cu_stream = torch.cuda.current_stream(out.device).cuda_stream
            _check(None, lib.spc_lse_merge(ctypes.byref(d)))
    else:
        _check(None, lib.spc_lse_merge(ctypes.byref(d)))
    return out, lse
