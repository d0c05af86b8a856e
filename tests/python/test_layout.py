"""spclient.layout: SeqLayout from each rank's own ids (one all-gather over a
real spd), any sequence length, mRoPE ids, and attention's BHSD layout."""
import math

import pytest
import torch

import spclient
import spclient.attention as spa
from conftest import run_ranks

D = 4


def positions(S=24):
    """Row 0: documents of 5, 7 and 12 tokens, the third starting at token 12,
    a shard boundary of every mesh tested but 3 x 1; row 1: a document whose ids start at
    7, then one from 0 at token 5 that runs to the end."""
    row0 = list(range(5)) + list(range(7)) + list(range(12))
    row1 = list(range(7, 12)) + list(range(19))
    return torch.tensor([row0, row1])[:, :S]


def mrope(S=24):
    """Qwen2-VL-like [3, B, S] ids: text, a 2 x 2 image whose patches share one
    temporal position (4) with h and w running over the grid, text again from 6;
    a second document from 0 at token 12. Row 1 is text only, ids 0.. ."""
    t, hh, w = [], [], []
    for start in (0, 12):
        t += list(range(4)) + [4] * 4 + list(range(6, 10))
        hh += list(range(4)) + [4, 4, 5, 5] + list(range(6, 10))
        w += list(range(4)) + [4, 5, 4, 5] + list(range(6, 10))
    text = list(range(24))
    return torch.tensor([[t, text], [hh, text], [w, text]])[..., :S]


def documents(pos):
    """Document ids written out: a token starts a new document where its position
    is 0, or (1-D ids) is not the previous one plus 1, or (mRoPE, row 0) is below
    the previous one."""
    rows = pos[0] if pos.dim() == 3 else pos
    out = []
    for row in rows.tolist():
        d, ids = -1, []
        for i, p in enumerate(row):
            if pos.dim() == 3:
                new = i == 0 or p == 0 or p < row[i - 1]
            else:
                new = i == 0 or p == 0 or p != row[i - 1] + 1
            d += new
            ids.append(d)
        out.append(ids)
    return out


def reference(q, k, v, docs):
    """Causal attention inside each document over the whole sequence, from a
    dense mask built token by token."""
    B, S, H, _ = q.shape
    mask = torch.tensor([[[j <= i and doc[j] == doc[i] for j in range(S)] for i in range(S)] for doc in docs])
    g = H // k.shape[2]
    k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
    s = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D)
    p = torch.softmax(s.masked_fill(~mask[:, None], float("-inf")), dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", p, v)


def tensors(S, heads, kv_heads):
    g = torch.Generator().manual_seed(11)
    shapes = [(2, S, heads, D), (2, S, kv_heads, D), (2, S, kv_heads, D), (2, S, heads, D)]
    return [torch.randn(*s, generator=g, dtype=torch.float64) for s in shapes]


def same_layout(a, b):
    """The fields other code reads, equal."""
    assert (a.seq_len, a.padded_len, a.shard_len, a.ring, a.ring_rank, a.ulysses, a.ulysses_rank) == \
        (b.seq_len, b.padded_len, b.shard_len, b.ring, b.ring_rank, b.ulysses, b.ulysses_rank)
    assert torch.equal(a.doc, b.doc) and torch.equal(a.local, b.local)
    assert torch.equal(a.position_ids, b.position_ids)
    for j in range(a.ring):
        assert torch.equal(a.shard(j), b.shard(j))


MESHES = [(2, 1), (1, 2), (2, 2), (1, 3), (3, 1)]


@pytest.mark.parametrize("ulysses,ring", MESHES)
@pytest.mark.parametrize("S,ids", [(24, positions), (21, positions), (24, mrope), (19, mrope)])
def test_from_local_equals_full_ids(spd, ulysses, ring, S, ids):
    def rank_fn(h, world, rank, size):
        mesh = h.mesh(sp=size, heads=6, ulysses=ulysses, ring=ring)
        full = spa.SeqLayout.for_mesh(ids(S), mesh)
        given = S if S % (size * (2 if ring > 1 else 1)) else None      # None: S / sp tokens a rank
        got = spa.SeqLayout.from_local(h, mesh, full.position_ids, seq_len=given)
        same_layout(got, full)
        return full.local, full.doc

    out = run_ranks(ulysses * ring, rank_fn)
    assert sorted(torch.cat([idx for idx, _ in out]).tolist()) == list(range(S))   # every real token once
    doc = out[0][1]
    assert doc[:, :S].tolist() == documents(ids(S))
    assert bool((doc[:, S:] == doc[:, S - 1:S] + 1).all())                  # the padding: one more document


def test_document_at_a_shard_boundary():
    """Row 0's third document starts exactly where ring rank 1's first chunk does."""
    lay = spa.SeqLayout(positions(), 1, 0, 2, 1)
    assert lay.shard(1).tolist()[:6] == list(range(6, 12)) and lay.doc[0, 12] == lay.doc[0, 11] + 1
    assert spa.document_ids(mrope())[0].tolist() == [0] * 12 + [1] * 12


def test_group_is_ulysses_alone(spd):
    def rank_fn(h, world, rank, size):
        full = spa.SeqLayout(positions(), size, rank)
        same_layout(spa.SeqLayout.from_local(h, world, full.position_ids), full)
        return True

    assert run_ranks(2, rank_fn) == [True, True]


def refused(h, mesh, ids, seq_len=None):
    with pytest.raises(ValueError) as e:
        spa.SeqLayout.from_local(h, mesh, ids, seq_len=seq_len)
    return str(e.value)


def test_mismatched_local_ids_are_refused_naming_the_rank(spd):
    """Every rank raises, naming the same rank; spd serves the job on."""

    def rank_fn(h, world, rank, size):
        mesh = h.mesh(sp=size, heads=4, ulysses=1, ring=2)
        full = spa.SeqLayout.for_mesh(positions(), mesh)
        mine = full.position_ids
        n = mine.shape[1]
        msgs = [
            # Ids made again on each rank after the zigzag split: every shard from 0.
            refused(h, mesh, torch.arange(n).expand(2, n)),
            # Rank 1 one token short, S left to be inferred from it.
            refused(h, mesh, mine[:, :n - 1] if rank == 1 else mine),
            # The same with S given: rank 1's count does not fit its piece.
            refused(h, mesh, mine[:, :n - 1] if rank == 1 else mine[:, :n], seq_len=24),
            # Rank 1 holds a batch of one row.
            refused(h, mesh, mine[:1] if rank == 1 else mine),
            # Rank 1 sends 1-D ids, rank 0 mRoPE ones of the same size.
            refused(h, mesh, mine if rank == 1 else mine.expand(1, 2, n)),
        ]
        again = spa.SeqLayout.from_local(h, mesh, mine)       # spd keeps serving the group
        same_layout(again, full)
        x = h.empty((3,), torch.float64)
        x.fill_(rank + 1)
        return msgs, h.allreduce(world, x).tolist()

    out = run_ranks(2, rank_fn)
    assert out[0][1] == out[1][1] == [3.0] * 3
    for i in (0, 1, 2, 4):
        assert out[0][0][i] == out[1][0][i], "the ranks name different culprits"
    regen, short, count, batch, kind = out[0][0]
    assert "sp rank 0's position ids do not fit sp rank 1's" in regen and "made again" in regen
    # 11 tokens a rank make S = 22, padded to the same pieces as 24: the claims differ.
    assert "sp rank 1 claims ulysses 1 x ring 2, batch 2, S = 22" in short
    assert "sp rank 1 passes 11 tokens a row" in count and "holds 12" in count
    assert "rank 1 (job rank 1) sent count 20, rank 0 (job rank 0) sent 32" in batch   # 8 claim words + B x 12
    assert "here, sp rank 1: [B, n] = [1, 12] of S = 24" in out[1][0][3]
    assert "sp rank 1 claims" in kind and "1-D ids" in kind and "mRoPE" in kind


def test_a_document_not_starting_at_0_at_a_boundary_is_refused(spd):
    """Positions that jump at a piece boundary without a 0 read as ids made
    again per shard; inside a piece (row 1 from ids 7) they are a document."""

    def rank_fn(h, world, rank, size):
        pos = positions()
        pos[0, 12:] += 3                   # row 0's third document now starts at 3, on the boundary
        full = spa.SeqLayout(pos, size, rank)
        return refused(h, world, full.position_ids)

    out = run_ranks(2, rank_fn)
    assert all("sp rank 1's position ids do not fit sp rank 0's: at token 12 of row 0 position 3 follows 6" in m
               for m in out)


def sp_attention(h, mesh, layout, S, heads, kv_heads, qkv_layout="bshd"):
    q, k, v, w = (t[:, layout.local].clone() for t in tensors(S, heads, kv_heads))
    for t in (q, k, v):
        t.requires_grad_(True)
    if qkv_layout == "bhsd":
        o = spa.attention(h, mesh, layout, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), heads, kv_heads,
                          qkv_layout="bhsd").transpose(1, 2)
    else:
        o = spa.attention(h, mesh, layout, q, k, v, heads, kv_heads)
    (o * w).sum().backward()
    return layout.local, o.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("ulysses,ring,S", [(2, 1, 21), (3, 1, 22), (4, 1, 5), (1, 2, 21), (2, 2, 21), (1, 3, 13)])
@pytest.mark.parametrize("local", [False, True])
def test_any_length(spd, ulysses, ring, S, local):
    heads, kv_heads = 4, 2 if ulysses != 3 else 1

    def rank_fn(h, world, rank, size):
        mesh = h.mesh(sp=size, heads=heads, kv_heads=kv_heads, ulysses=ulysses, ring=ring)
        layout = spa.SeqLayout.for_mesh(positions(S), mesh)
        if local:
            layout = spa.SeqLayout.from_local(h, mesh, layout.position_ids, seq_len=S)
        return sp_attention(h, mesh, layout, S, heads, kv_heads)

    out = run_ranks(ulysses * ring, rank_fn)
    q, k, v, w = tensors(S, heads, kv_heads)
    for t in (q, k, v):
        t.requires_grad_(True)
    o = reference(q, k, v, documents(positions(S)))
    (o * w).sum().backward()
    assert sorted(torch.cat([r[0] for r in out]).tolist()) == list(range(S))
    for idx, *got in out:
        for g, want, what in zip(got, (o, q.grad, k.grad, v.grad), ("out", "dq", "dk", "dv")):
            err = (g - want.detach()[:, idx]).abs().max().item() if idx.numel() else 0.0
            assert err < 1e-12, f"{what}: max error {err}"


@pytest.mark.parametrize("ulysses,ring", [(2, 1), (1, 2), (2, 2), (1, 1)])
def test_bhsd_is_bshd_transposed(spd, ulysses, ring):
    heads, kv_heads, S = 4, 2, 21

    def rank_fn(h, world, rank, size):
        mesh = h.mesh(sp=size, heads=heads, kv_heads=kv_heads, ulysses=ulysses, ring=ring)
        layout = spa.SeqLayout.for_mesh(positions(S), mesh)
        bshd = sp_attention(h, mesh, layout, S, heads, kv_heads)
        # [B, H, n, D] memory of its own, not a view of [B, n, H, D]:
        q, k, v, w = (t[:, layout.local].transpose(1, 2).contiguous() for t in tensors(S, heads, kv_heads))
        o = spa.attention(h, mesh, layout, q, k, v, heads, kv_heads, qkv_layout="bhsd")
        layer = spa.SPAttention(h, mesh, heads, kv_heads, qkv_layout="bhsd")
        same = layer(layout, q, k, v)
        return bshd, (o.shape, o.transpose(1, 2), same.transpose(1, 2)), sp_attention(h, mesh, layout, S, heads,
                                                                                       kv_heads, "bhsd")

    for bshd, (shape, o, same), bhsd in run_ranks(ulysses * ring, rank_fn):
        assert shape == (2, heads, bshd[0].numel(), D)
        assert torch.equal(o, bshd[1]) and torch.equal(same, bshd[1])
        for a, b in zip(bshd[1:], bhsd[1:]):             # out, dq, dk, dv through the view
            assert torch.equal(a, b)


def test_qkv_layout_is_checked():
    with pytest.raises(ValueError, match='"bshd" or "bhsd"'):
        spa.attention(None, None, None, None, None, None, 1, qkv_layout="sbhd")


def test_spclient_attention_keeps_its_names():
    import spclient.layout as spl
    assert spa.SeqLayout is spl.SeqLayout and spa.document_ids is spl.document_ids
    assert issubclass(spclient.MismatchError, ValueError)
