"""Blockwise causal attention inside documents: one set of query tokens against
one set of key tokens, in tiles, with an online softmax, never holding [Sq, Sk].

Tokens are named by their global indices (layout.shard(j): the whole sequence,
or a zigzag shard's two contiguous halves); query i sees key j when j <= i and
both lie in one document. Documents are contiguous runs of the [B, S] global
document ids, so with each token's document start and end (Docs) a whole tile
of queries [qa, qb) against keys [ka, kb) is decided per batch row in O(1):

  * some pair is visible iff the first query at or after ka, i0 = max(qa, ka),
    is in the tile (i0 < qb) and its document starts before kb;
  * every pair is visible iff kb - 1 <= qa and the last query's document starts
    at or before ka.

A tile no row sees is skipped without computing (zigzag's masked half blocks
fall out of this: they are whole runs of such tiles); a tile every row sees
whole needs no mask; the rest get a mask of one tile. Tiles never straddle the
two halves of a zigzag shard.

forward() keeps, per query tile, the running max, sum and output in fp32 (fp64
for fp64 inputs) and returns the normalised output and log-sum-exp in that
dtype; backward() recomputes each tile's probabilities from the final
log-sum-exp, as flash attention does. Memory beyond inputs and outputs: one
query tile's accumulators and one tile of scores per head.
"""
import collections
import math

import torch

# Tokens per tile (read at each call, so a benchmark or test may set it): big
# enough that each tile's matmuls amortise the Python loop, small enough that
# [B, H, TILE, TILE] scores stay a few MiB.
TILE = 256


def acc_dtype(dtype):
    """What out, lse and gradients accumulate in: fp64 stays fp64, all else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class Docs(collections.namedtuple("Docs", "doc start end")):
    """[B, S] document id, first token and one past the last token of every
    token's document, from document ids that never decrease along a row."""

    @classmethod
    def of(cls, doc, device=None):
        doc = doc.contiguous()
        start = torch.searchsorted(doc, doc)
        end = torch.searchsorted(doc, doc, right=True)
        return cls(*(t.to(device) if device is not None else t for t in (doc, start, end)))


def runs(idx):
    """(local start, global start, length) of each contiguous run of the global
    token indices idx, in order."""
    n = idx.numel()
    cuts = (torch.nonzero(idx[1:] != idx[:-1] + 1).flatten() + 1).tolist()
    bounds = [0] + cuts + [n]
    return [(a, int(idx[a]), b - a) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


def _tiles(idx, tile):
    """Local [start, stop) and global start of tiles of `tile` tokens, cut inside runs."""
    out = []
    for local, glob, n in runs(idx):
        out += [(local + o, local + min(o + tile, n), glob + o) for o in range(0, n, tile)]
    return out


Plan = collections.namedtuple("Plan", "q_tiles k_tiles work")


def plan(q_idx, k_idx, docs, tile=None):
    """The tiles of queries q_idx against keys k_idx and, per query tile, the key
    tiles to compute as (key tile number, needs a mask). docs: Docs on any device
    (decided on the host); tile: tokens per tile, TILE when None."""
    tile = tile or TILE
    qt, kt = _tiles(q_idx.cpu(), tile), _tiles(k_idx.cpu(), tile)
    if not qt or not kt:
        return Plan(qt, kt, [[] for _ in qt])
    start = docs.start.cpu()
    qa = torch.tensor([g for _, _, g in qt])
    qb = qa + torch.tensor([e - s for s, e, _ in qt])
    ka = torch.tensor([g for _, _, g in kt])
    kb = ka + torch.tensor([e - s for s, e, _ in kt])
    i0 = torch.maximum(qa[:, None], ka[None, :])                           # [nq, nk]
    seen = (i0 < qb[:, None]) & (start[:, i0] < kb)                        # [B, nq, nk]
    whole = (kb[None, :] - 1 <= qa[:, None]) & (start[:, qb - 1, None] <= ka)
    seen, whole = seen.any(0).tolist(), whole.all(0).tolist()
    work = [[(j, not w) for j, (s, w) in enumerate(zip(row_seen, row_whole)) if s]
            for row_seen, row_whole in zip(seen, whole)]
    return Plan(qt, kt, work)


Work = collections.namedtuple("Work", "tiles computed masked flops dense_flops")


def work(q_idx, k_idx, doc, heads, head_dim, batch=None, tile=None):
    """What forward() computes for queries q_idx against keys k_idx under [B, S]
    document ids doc: tiles in all, tiles computed, of those the ones with a
    mask, and the forward's matmul FLOPs (2 matmuls of 2 x tq x tk x D per head
    and batch row) computed and for all tiles. A benchmark's skipped share is
    1 - flops / dense_flops."""
    docs = Docs.of(doc)
    p = plan(q_idx, k_idx, docs, tile)
    B = batch if batch is not None else doc.shape[0]
    per = 4 * B * heads * head_dim
    computed = [(i, j, m) for i, js in enumerate(p.work) for j, m in js]

    def size(i, j):
        (qs, qe, _), (ks, ke, _) = p.q_tiles[i], p.k_tiles[j]
        return (qe - qs) * (ke - ks)

    return Work(len(p.q_tiles) * len(p.k_tiles), len(computed), sum(m for *_, m in computed),
                per * sum(size(i, j) for i, j, _ in computed), per * q_idx.numel() * k_idx.numel())


def _tile_mask(docs, q_glob, k_glob):
    """[B, tq, tk] visibility of one tile: same document, key at or before query."""
    same = docs.doc[:, q_glob, None] == docs.doc[:, None, k_glob]
    return same & (q_glob[:, None] >= k_glob[None, :])[None]


def _glob(tiles, i, device):
    """Global indices of tile i (tiles lie inside one run)."""
    s, e, g = tiles[i]
    return torch.arange(g, g + e - s, device=device)


def forward(q, k, v, q_idx, k_idx, docs, scale=None, tile=None, out_dtype=None):
    """Attention of q [B, Sq, H, D] (tokens q_idx) over k, v [B, Sk, Hk, D]
    (tokens k_idx; kv head j serves query heads j*g .. j*g+g-1). docs: Docs on
    q's device. Returns out [B, Sq, H, D] normalised and lse [B, H, Sq], both in
    acc_dtype(q.dtype) (0 and -inf for rows that see nothing), or None when no
    query sees any key; new tensors, the caller's. out_dtype: out's dtype
    instead, each query tile rounded once from its accumulator (a block that
    merges with no other: a ring of one)."""
    p = plan(q_idx, k_idx, docs, tile)
    if not any(p.work):
        return None
    B, Sq, H, D = q.shape
    Hk = k.shape[2]
    g, dt, dev = H // Hk, acc_dtype(q.dtype), q.device
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    out = torch.zeros(B, Sq, H, D, dtype=out_dtype or dt, device=dev)
    lse = torch.full((B, H, Sq), float("-inf"), dtype=dt, device=dev)
    for i, todo in enumerate(p.work):
        if not todo:
            continue
        qs, qe, _ = p.q_tiles[i]
        tq = qe - qs
        qt = q[:, qs:qe].to(dt).view(B, tq, Hk, g, D)
        m = torch.full((B, Hk, g, tq), float("-inf"), dtype=dt, device=dev)
        l = torch.zeros(B, Hk, g, tq, dtype=dt, device=dev)
        o = torch.zeros(B, Hk, g, tq, D, dtype=dt, device=dev)
        for j, masked in todo:
            ks, ke, _ = p.k_tiles[j]
            s = torch.einsum("bqhgd,bkhd->bhgqk", qt, k[:, ks:ke].to(dt)) * scale
            if masked:
                vis = _tile_mask(docs, _glob(p.q_tiles, i, dev), _glob(p.k_tiles, j, dev))
                s = s.masked_fill(~vis[:, None, None], float("-inf"))
            m_new = torch.maximum(m, s.amax(dim=-1))
            # A row that has seen nothing yet keeps max -inf: shift it by 0 so
            # that its scores, all -inf, give probabilities 0 and not NaN.
            shift = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
            pr = torch.exp(s - shift[..., None])
            alpha = torch.exp(m - shift)
            l = l * alpha + pr.sum(dim=-1)
            o = o * alpha[..., None] + torch.einsum("bhgqk,bkhd->bhgqd", pr, v[:, ks:ke].to(dt))
            m = m_new
        o = torch.where(l[..., None] > 0, o / l[..., None], torch.zeros_like(o))
        out[:, qs:qe] = o.permute(0, 3, 1, 2, 4).reshape(B, tq, H, D)
        lse[:, :, qs:qe] = (m + torch.log(l)).reshape(B, H, tq)
    return out, lse


def backward(q, k, v, dout, lse, delta, q_idx, k_idx, docs, scale=None, tile=None, into=None):
    """Gradients of forward()'s block given the final lse [B, H, Sq] (of every
    key the queries see, not only this block's) and delta = rowsum(dout * out)
    [B, H, Sq]: dq [B, Sq, H, D], dk, dv [B, Sk, Hk, D] in acc_dtype(q.dtype),
    or None when no query sees any key. into: (dq, dk, dv) to add them into
    instead, and return (a ring's accumulators: no block-sized temporaries);
    dq may be in q's dtype when nothing else adds to it, since each query
    tile's gradient is added once. dq may be q itself, when the caller lets q
    go: each query tile's gradient then takes the tile's place, which no later
    tile reads (dq is then the gradient alone, nothing added)."""
    p = plan(q_idx, k_idx, docs, tile)
    if not any(p.work):
        return None
    B, Sq, H, D = q.shape
    Sk, Hk = k.shape[1], k.shape[2]
    g, dt, dev = H // Hk, acc_dtype(q.dtype), q.device
    scale = scale if scale is not None else 1.0 / math.sqrt(D)
    dq, dk, dv = into or (torch.zeros(B, Sq, H, D, dtype=dt, device=dev),
                          torch.zeros(B, Sk, Hk, D, dtype=dt, device=dev),
                          torch.zeros(B, Sk, Hk, D, dtype=dt, device=dev))
    # A row that sees nothing has lse -inf; +inf in its place makes its
    # probabilities exp(-inf) = 0 wherever the mask lets a score through.
    lse = lse.to(dt).masked_fill(torch.isneginf(lse), float("inf"))
    in_q = dq is q
    for i, todo in enumerate(p.work):
        qs, qe, _ = p.q_tiles[i]
        if not todo:
            if in_q:
                dq[:, qs:qe] = 0
            continue
        tq = qe - qs
        qt = q[:, qs:qe].to(dt).view(B, tq, Hk, g, D)
        dot = dout[:, qs:qe].to(dt).view(B, tq, Hk, g, D)
        lt = lse[:, :, qs:qe].reshape(B, Hk, g, tq, 1)
        dlt = delta[:, :, qs:qe].to(dt).reshape(B, Hk, g, tq, 1)
        dqt = torch.zeros(B, tq, Hk, g, D, dtype=dt, device=dev)
        for j, masked in todo:
            ks, ke, _ = p.k_tiles[j]
            kt, vt = k[:, ks:ke].to(dt), v[:, ks:ke].to(dt)
            s = torch.einsum("bqhgd,bkhd->bhgqk", qt, kt) * scale
            if masked:
                vis = _tile_mask(docs, _glob(p.q_tiles, i, dev), _glob(p.k_tiles, j, dev))
                s = s.masked_fill(~vis[:, None, None], float("-inf"))
            pr = torch.exp(s - lt)
            dv[:, ks:ke] += torch.einsum("bhgqk,bqhgd->bkhd", pr, dot)
            ds = pr * (torch.einsum("bqhgd,bkhd->bhgqk", dot, vt) - dlt)
            dqt += torch.einsum("bhgqk,bkhd->bqhgd", ds, kt)
            dk[:, ks:ke].add_(torch.einsum("bhgqk,bqhgd->bkhd", ds, qt), alpha=scale)
        if in_q:
            torch.mul(dqt.reshape(B, tq, H, D), scale, out=dq[:, qs:qe])
        else:
            dq[:, qs:qe].add_(dqt.reshape(B, tq, H, D), alpha=scale)
    return dq, dk, dv
