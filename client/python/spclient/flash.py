"""Ring blocks on torch's own flash-attention kernel (CUDA, fp16/bf16), the
varlen form that returns the log-sum-exp, forward and backward.

A block's queries and keys are contiguous runs of global tokens (one run, or a
zigzag shard's two halves of equal chunks), so each pair of runs is one of:

  * the same run: causal inside each document, one varlen sequence per
    document of each batch row;
  * keys wholly before the queries: only the document that holds the last key
    can reach the queries; its queries see its keys whole (no mask), one
    varlen sequence per batch row;
  * keys wholly after the queries: nothing to compute.

The kernel keeps the log-sum-exp in fp32 as [heads, total tokens]; pieces for
the same queries merge through the caller's out/LSE merge, in fp32.
"""
import collections

import torch

_fwd = getattr(torch.ops.aten, "_flash_attention_forward", None)
_bwd = getattr(torch.ops.aten, "_flash_attention_backward", None)


def why_not(q):
    """Why the flash kernel cannot take q [B, S, H, D] here, or None when it can."""
    if _fwd is None or _bwd is None:
        return f"torch {torch.__version__} has no aten._flash_attention_forward/backward"
    if not q.is_cuda:
        return "the tensors are not on a CUDA device"
    if q.dtype not in (torch.float16, torch.bfloat16):
        return f"the kernel takes fp16 or bf16, not {q.dtype}"
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return f"the kernel takes head dims that are multiples of 8 up to 256, not {q.shape[-1]}"
    return None


# One varlen call: per batch row, [start, stop) of the local query and key rows
# it takes, and the sequence lengths inside them; causal or not.
_Piece = collections.namedtuple("_Piece", "causal q_rows k_rows lens")


def _pieces(q_idx, k_idx, docs, runs):
    """The varlen calls of queries q_idx against keys k_idx (see the module
    docstring). docs: blockwise.Docs; runs: blockwise.runs. Decided on the host."""
    q_idx, k_idx = q_idx.cpu(), k_idx.cpu()
    docs = type(docs)(*(t.cpu() for t in docs))
    out = []
    B = docs.doc.shape[0]
    for qs, qg, ql in runs(q_idx):
        for ks, kg, kl in runs(k_idx):
            if qg == kg and ql == kl:
                rows = [(qs, qs + ql)] * B
                lens = []
                for b in range(B):
                    d = docs.doc[b, qg:qg + ql]
                    cut = torch.nonzero(d[1:] != d[:-1]).flatten() + 1
                    lens.append(torch.diff(torch.cat([torch.tensor([0]), cut, torch.tensor([ql])])).tolist())
                out.append(_Piece(True, rows, rows, lens))
            elif kg + kl <= qg:
                last = kg + kl - 1
                q_rows, k_rows = [], []
                for b in range(B):
                    end, first = int(docs.end[b, last]), max(kg, int(docs.start[b, last]))
                    reach = min(qg + ql, end) - qg
                    if reach > 0:
                        q_rows.append((qs, qs + reach))
                        k_rows.append((ks + first - kg, ks + kl))
                    else:
                        q_rows.append((qs, qs))
                        k_rows.append((ks + kl, ks + kl))
                if any(e > s for s, e in q_rows):
                    out.append(_Piece(False, q_rows, k_rows, None))
            elif kg < qg + ql:
                raise ValueError(f"flash: query run [{qg}, {qg + ql}) and key run [{kg}, {kg + kl}) overlap "
                                 "without being the same run")
    return out


def _gather(x, live, rows):
    """Rows [start, stop) of batch rows `live` of x [B, S, ...], packed and
    contiguous: [total, ...]; one batch row's rows of a contiguous x are x's own
    memory, no copy."""
    if len(live) == 1:
        (s, e), = rows
        return x[live[0], s:e].contiguous()
    return torch.cat([x[b, s:e] for b, (s, e) in zip(live, rows)])


def _cu(lens, device):
    """Varlen offsets (int32) of sequences of `lens` tokens, and the longest."""
    return torch.tensor([0] + lens, dtype=torch.int64).cumsum(0).to(torch.int32).to(device), max(lens)


class _Call(collections.namedtuple("_Call", "live q_rows k_rows cu_q cu_k max_q max_k")):
    """One piece as the kernel takes it: the batch rows whose queries see
    something, their query and key rows, the varlen offsets and longest lengths."""

    @classmethod
    def of(cls, piece, device):
        live = [b for b, (s, e) in enumerate(piece.q_rows) if e > s]
        q_rows, k_rows = [piece.q_rows[b] for b in live], [piece.k_rows[b] for b in live]
        if piece.causal:   # queries and keys are the same tokens, cut at documents
            cu, most = _cu([n for b in live for n in piece.lens[b]], device)
            return cls(live, q_rows, k_rows, cu, cu, most, most)
        cq, mq = _cu([e - s for s, e in q_rows], device)
        ck, mk = _cu([e - s for s, e in k_rows], device)
        return cls(live, q_rows, k_rows, cq, ck, mq, mk)


def forward(q, k, v, q_idx, k_idx, docs, scale, merge, runs, out_dtype=None):
    """Like blockwise.forward (out and lse in fp32), on the flash kernel. merge:
    the out/lse merge of two disjoint key sets; runs: blockwise.runs.
    out_dtype: out in q's dtype, the kernel's own output, where the block is
    one call over every query row (a ring of one: the whole sequence against
    itself), with nothing to merge."""
    B, Sq, H, D = q.shape
    pieces = _pieces(q_idx, k_idx, docs, runs)
    if not pieces:
        return None
    if out_dtype is not None and len(pieces) == 1 and pieces[0].q_rows == [(0, Sq)] * B:
        return _whole(q, k, v, pieces[0], scale)
    out = torch.zeros(B, Sq, H, D, dtype=torch.float32, device=q.device)
    lse = torch.full((B, H, Sq), float("-inf"), dtype=torch.float32, device=q.device)
    for piece in pieces:
        c = _Call.of(piece, q.device)
        o, l = _fwd(_gather(q, c.live, c.q_rows), _gather(k, c.live, c.k_rows), _gather(v, c.live, c.k_rows),
                    c.cu_q, c.cu_k, c.max_q, c.max_k, 0.0, piece.causal, False, scale=scale)[:2]
        if l.dim() != 2:
            raise RuntimeError(f"flash: the kernel's log-sum-exp is {tuple(l.shape)}, not [heads, tokens]")
        at = 0
        for b, (s, e) in zip(c.live, c.q_rows):
            rows = slice(s, e)
            out[b:b + 1, rows], lse[b:b + 1, :, rows] = merge(out[b:b + 1, rows], lse[b:b + 1, :, rows],
                                                              o[None, at:at + e - s].float(),
                                                              l[None, :, at:at + e - s])
            at += e - s
    return out, lse


def _whole(q, k, v, piece, scale):
    """forward() of a block that is one call over every query row, in order:
    the kernel's packed [B Sq, H, D] output is out, in q's dtype."""
    B, Sq, H, D = q.shape
    c = _Call.of(piece, q.device)
    o, l = _fwd(_gather(q, c.live, c.q_rows), _gather(k, c.live, c.k_rows), _gather(v, c.live, c.k_rows),
                c.cu_q, c.cu_k, c.max_q, c.max_k, 0.0, piece.causal, False, scale=scale)[:2]
    if l.dim() != 2:
        raise RuntimeError(f"flash: the kernel's log-sum-exp is {tuple(l.shape)}, not [heads, tokens]")
    return o.reshape(B, Sq, H, D), l.reshape(H, B, Sq).transpose(0, 1).contiguous()


def backward(q, k, v, out, lse, dout, q_idx, k_idx, docs, scale, runs, into=None, alone=False):
    """Like blockwise.backward, on the flash kernel: out is the final output in
    q's dtype (the kernel takes delta from it), lse the final log-sum-exp.
    Returns dq, dk, dv in fp32, or into's (dq, dk, dv) with them added.

    into's dk and dv may be None (a ring, whose accumulators for them are
    still on their way): dk, dv then come back as a function that adds them
    into the accumulators it is given, holding the kernel's pieces in q's
    dtype meanwhile rather than fp32 block-sized sums. alone: the block is the
    whole attention (a ring of one); where it is one call over every row, the
    kernel's own dq, dk, dv, in q's dtype, are the gradients, with nothing to
    add them to."""
    B, Sq, H, D = q.shape
    pieces = _pieces(q_idx, k_idx, docs, runs)
    if not pieces:
        return None
    if alone and into is None and len(pieces) == 1 and pieces[0].q_rows == [(0, Sq)] * B:
        c = _Call.of(pieces[0], q.device)
        dqp, dkp, dvp = _kernel_backward(q, k, v, out, lse, dout, c, pieces[0].causal, scale)
        return dqp.reshape(q.shape), dkp.reshape(k.shape), dvp.reshape(v.shape)
    dq, dk, dv = into or (torch.zeros(B, Sq, H, D, dtype=torch.float32, device=q.device),
                          torch.zeros(k.shape, dtype=torch.float32, device=q.device),
                          torch.zeros(v.shape, dtype=torch.float32, device=q.device))
    later = []
    for piece in pieces:
        c = _Call.of(piece, q.device)
        dqp, dkp, dvp = _kernel_backward(q, k, v, out, lse, dout, c, piece.causal, scale)
        at_q = at_k = 0
        for b, (s, e), (ks, ke) in zip(c.live, c.q_rows, c.k_rows):
            # In-place adds compute in the sum's dtype: no fp32 copy of the pieces.
            dq[b, s:e] += dqp[at_q:at_q + e - s]
            if dk is None:
                later.append((b, ks, ke, dkp[at_k:at_k + ke - ks], dvp[at_k:at_k + ke - ks]))
            else:
                dk[b, ks:ke] += dkp[at_k:at_k + ke - ks]
                dv[b, ks:ke] += dvp[at_k:at_k + ke - ks]
            at_q, at_k = at_q + e - s, at_k + ke - ks
    if dk is not None:
        return dq, dk, dv

    def add_kv(dk, dv):
        for b, ks, ke, dkp, dvp in later:
            dk[b, ks:ke] += dkp
            dv[b, ks:ke] += dvp
    return dq, add_kv, None


def _kernel_backward(q, k, v, out, lse, dout, c, causal, scale):
    """The kernel's dq, dk, dv of one call (packed rows, q's dtype)."""
    # Dropout is off: the kernel reads no random state, any will do (a uint64
    # pair since torch 2.3, int64 seeds before).
    rng = torch.zeros(2, dtype=getattr(torch, "uint64", torch.int64), device=q.device)
    lp = torch.cat([lse[b, :, s:e] for b, (s, e) in zip(c.live, c.q_rows)], dim=1).float().contiguous()
    return _bwd(_gather(dout, c.live, c.q_rows).contiguous(), _gather(q, c.live, c.q_rows),
                _gather(k, c.live, c.k_rows), _gather(v, c.live, c.k_rows),
                _gather(out, c.live, c.q_rows).contiguous(), lp,
                c.cu_q, c.cu_k, c.max_q, c.max_k, 0.0, causal, rng, rng, scale=scale)[:3]
