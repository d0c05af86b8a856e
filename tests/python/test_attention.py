"""spclient.attention over real ranks against attention written out token by token."""
import math
import types

import pytest
import torch

import spclient.attention as spa
import spclient.torch as spt
from conftest import run_ranks

B, S, D = 2, 24, 4


def positions():
    """Two rows of packed documents; row 0's second document crosses every shard
    boundary of sp = 2, 3 and 4, row 1 is one document."""
    row0 = list(range(5)) + list(range(13)) + list(range(6))
    return torch.tensor([row0, list(range(S))])


def reference(q, k, v, pos):
    """Causal attention inside each document, one query token at a time. Documents
    start where the position is 0 or does not follow the previous one."""
    Bq, Sq, H, _ = q.shape
    g = H // k.shape[2]
    out = []
    for b in range(Bq):
        doc, d = [], -1
        for i in range(Sq):
            d += 1 if i == 0 or pos[b, i] != pos[b, i - 1] + 1 else 0
            doc.append(d)
        rows = []
        for i in range(Sq):
            seen = [j for j in range(i + 1) if doc[j] == doc[i]]
            heads = []
            for hd in range(H):
                s = torch.stack([q[b, i, hd] @ k[b, j, hd // g] for j in seen]) / math.sqrt(D)
                p = torch.softmax(s, dim=0)
                heads.append(sum(p[n] * v[b, j, hd // g] for n, j in enumerate(seen)))
            rows.append(torch.stack(heads))
        out.append(torch.stack(rows))
    return torch.stack(out)


def tensors(heads, kv_heads):
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, S, heads, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, S, kv_heads, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, S, kv_heads, D, generator=g, dtype=torch.float64)
    w = torch.randn(B, S, heads, D, generator=g, dtype=torch.float64)
    return q, k, v, w


def sp_rank(h, world, rank, size, ulysses, ring, heads, kv_heads, backend=None):
    mesh = h.mesh(sp=size, heads=heads, kv_heads=kv_heads, ulysses=ulysses, ring=ring)
    layout = spa.SeqLayout.for_mesh(positions(), mesh)
    q, k, v, w = (t[:, layout.local].clone() for t in tensors(heads, kv_heads))
    for t in (q, k, v):
        t.requires_grad_(True)
    o = spa.SPAttention(h, mesh, heads, kv_heads, backend=backend)(layout, q, k, v)
    (o * w).sum().backward()
    return layout.local, o.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("ulysses,ring,heads,kv_heads,backend", [
    (2, 1, 4, 2, None),         # Ulysses
    (1, 3, 4, 2, None),         # zigzag Ring, 3 ranks
    (2, 2, 4, 2, None),         # Ulysses 2 x Ring 2
    (4, 1, 6, 2, None),         # dummy query heads, KV heads replicated
    (1, 2, 3, 3, None),         # Ring, plain multi-head
    (1, 3, 4, 2, "einsum"),     # the dense reference backend, blocks of a ring
    (2, 1, 4, 2, "einsum"),     # and the whole sequence
])
def test_sp_attention_matches_reference(spd, ulysses, ring, heads, kv_heads, backend):
    out = run_ranks(ulysses * ring, sp_rank, ulysses, ring, heads, kv_heads, backend)
    q, k, v, w = tensors(heads, kv_heads)
    for t in (q, k, v):
        t.requires_grad_(True)
    o = reference(q, k, v, positions())
    (o * w).sum().backward()
    covered = torch.cat([idx for idx, *_ in out]).sort().values
    assert torch.equal(covered, torch.arange(S))            # every token on exactly one rank
    for idx, o_r, dq, dk, dv in out:
        for got, want, what in ((o_r, o, "out"), (dq, q.grad, "dq"), (dk, k.grad, "dk"), (dv, v.grad, "dv")):
            err = (got - want.detach()[:, idx]).abs().max().item()
            assert err < 1e-12, f"{what}: max error {err}"


def test_ulysses_alone_changes_no_bit(spd):
    """With one ring rank the attention Ulysses runs is the single-process one:
    the output equals spclient.attention in one process, on a mesh of one rank,
    over the whole sequence, bit for bit."""
    heads, kv_heads = 4, 2
    out = run_ranks(2, sp_rank, 2, 1, heads, kv_heads)
    q, k, v, _ = tensors(heads, kv_heads)
    alone = types.SimpleNamespace(ulysses_group=types.SimpleNamespace(size=1),
                                  ring_group=types.SimpleNamespace(size=1))
    full = spa.attention(None, alone, spa.SeqLayout(positions()), q, k, v, heads, kv_heads)
    for idx, o_r, *_ in out:
        assert torch.equal(o_r, full[:, idx])


def tiled_rank(h, world, rank, size, ulysses, ring, heads, kv_heads, head_chunks, backend=None, n=S):
    mesh = h.mesh(sp=size, heads=heads, kv_heads=kv_heads, ulysses=ulysses, ring=ring)
    layout = spa.SeqLayout.for_mesh(positions()[:, :n], mesh)
    q, k, v, w = (t[:, :n][:, layout.local].clone() for t in tensors(heads, kv_heads))
    for t in (q, k, v):
        t.requires_grad_(True)
    o = spa.attention(h, mesh, layout, q, k, v, heads, kv_heads, backend=backend, head_chunks=head_chunks)
    kept = len(h._allocs)     # arena tensors alive between forward and backward
    (o * w).sum().backward()
    return layout.local, o.detach(), q.grad, k.grad, v.grad, kept


@pytest.mark.parametrize("ulysses,ring,heads,kv_heads,head_chunks,backend,n", [
    (2, 1, 4, 2, 2, None, S),       # GQA, one KV head a group, replicated over the two ranks
    (2, 1, 6, 3, 2, None, S),       # 3 KV heads in 2 groups: 4 query heads, then 2
    (2, 1, 5, 5, 3, None, S),       # 5 heads in groups of 2, 2, 1: the last with a dummy head
    (4, 1, 6, 2, None, None, S),    # chosen: one group (6 heads over 4 ranks), dummy heads, KV replicated
    (4, 1, 8, 4, 4, None, S),       # groups of 2 query heads over 4 ranks: dummy heads in every group
    (2, 2, 4, 2, 2, None, S),       # Ulysses 2 x Ring 2: each group's ring in turn
    (2, 1, 4, 4, 1, None, S),       # one group: the all-to-all redone in backward, nothing else
    (2, 1, 4, 2, 2, "einsum", S),
    (2, 1, 4, 2, 2, None, 21),      # 21 tokens: 11 and 10, padded to 22 on the way out
    (2, 2, 6, 3, 2, None, 21),      # and to 24 over Ulysses 2 x Ring 2
    (1, 3, 4, 2, None, None, S),    # Ring alone: a ring per KV head, the dK/dV summed over its 2 query heads
    (1, 2, 3, 3, 2, None, 21),      # 3 heads in rings of 2 and 1, padded
    (1, 2, 4, 2, 2, "einsum", S),
])
def test_tiled_heads_match_reference(spd, ulysses, ring, heads, kv_heads, head_chunks, backend, n):
    """Ulysses and Ring over head groups in turn give full attention's out and
    gradients (fp64, token by token), and keep no arena tensor from forward
    to backward: the head-sharded q, k, v and out of every group are gone,
    where untiled Ulysses keeps them."""
    out = run_ranks(ulysses * ring, tiled_rank, ulysses, ring, heads, kv_heads, head_chunks, backend, n)
    q, k, v, w = (t[:, :n].clone() for t in tensors(heads, kv_heads))
    for t in (q, k, v):
        t.requires_grad_(True)
    o = reference(q, k, v, positions()[:, :n])
    (o * w).sum().backward()
    covered = torch.cat([idx for idx, *_ in out]).sort().values
    assert torch.equal(covered, torch.arange(n))
    for idx, o_r, dq, dk, dv, kept in out:
        for got, want, what in ((o_r, o, "out"), (dq, q.grad, "dq"), (dk, k.grad, "dk"), (dv, v.grad, "dv")):
            err = (got - want.detach()[:, idx]).abs().max().item()
            assert err < 1e-10, f"{what}: max error {err}"
        assert kept == 0, f"{kept} arena tensors kept for backward"
    if ulysses > 1:
        untiled = run_ranks(ulysses * ring, tiled_rank, ulysses, ring, heads, kv_heads, 0, backend, n)
        assert all(kept >= 3 for *_, kept in untiled), [kept for *_, kept in untiled]


def test_head_groups():
    """Groups are runs of whole GQA groups, one KV head apart at most; the
    default leaves every Ulysses rank a query head of each group."""
    def sizes(*args):
        return [(g.stop - g.start, kv.stop - kv.start) for g, kv in spa.head_groups(*args)]
    assert sizes(8, 8, 4) == [(4, 4), (4, 4)]
    assert sizes(32, 8, 4) == [(4, 1)] * 8
    assert sizes(6, 3, 2, 2) == [(4, 2), (2, 1)]
    assert sizes(6, 2, 4) == [(6, 2)]
    assert sizes(8, 8, 1) == [(1, 1)] * 8             # no Ulysses group: a ring per KV head
    assert sizes(5, 5, 2, 3) == [(2, 2), (2, 2), (1, 1)]
    groups = spa.head_groups(12, 4, 2, 3)
    assert [(g.start, kv.start) for g, kv in groups] == [(0, 0), (6, 2), (9, 3)]
    for bad in (0, 5):
        with pytest.raises(ValueError):
            spa.head_groups(8, 4, 2, bad)


def projected_rank(h, world, rank, size, ulysses, ring, heads, kv_heads):
    """Both paths on one rank from hidden states x [B, S, E]: attention() of the
    three projections, and projected_attention(); the outputs, the gradients of
    x and of the weights, and the order of the all-to-alls, the query
    projection and the weights' gradients in the second."""
    mesh = h.mesh(sp=size, heads=heads, kv_heads=kv_heads, ulysses=ulysses, ring=ring)
    layout = spa.SeqLayout.for_mesh(positions(), mesh)
    g = torch.Generator().manual_seed(11)
    E = 5
    x_all = torch.randn(B, S, E, generator=g, dtype=torch.float64)
    ws = [torch.randn(E, n * D, generator=g, dtype=torch.float64) for n in (heads, kv_heads, kv_heads)]
    w_out = torch.randn(B, S, heads, D, generator=g, dtype=torch.float64)[:, layout.local]
    events = []
    exchange = spt._exchange

    def logged(h_, group, direction, seq_len, heads_, kv_heads_, lay, xs, sum_replicas, kinds=None, blocking=True):
        events.append(("s2h" if direction == spt.SEQ_TO_HEAD else "h2s", len(xs), blocking))
        return exchange(h_, group, direction, seq_len, heads_, kv_heads_, lay, xs, sum_replicas, kinds, blocking)

    def run(projected):
        x = x_all[:, layout.local].clone().requires_grad_(True)
        wq, wk, wv = (w.clone().requires_grad_(True) for w in ws)
        for w, name in ((wq, "dwq"), (wk, "dwk")):
            w.register_hook(lambda grad, name=name: events.append(name))

        def q_proj(t):
            events.append("q_proj")
            return t @ wq

        if projected:
            o = spa.SPAttention(h, mesh, heads, kv_heads).project(layout, x, q_proj, lambda t: t @ wk,
                                                                    lambda t: t @ wv)
        else:
            o = spa.attention(h, mesh, layout, *(spa._heads_of(x @ w, n) for w, n in
                                                 ((wq, heads), (wk, kv_heads), (wv, kv_heads))), heads, kv_heads,
                              head_chunks=0)
        (o * w_out).sum().backward()
        return [o.detach(), x.grad, wq.grad, wk.grad, wv.grad]

    plain = run(False)
    spt._exchange = logged
    try:
        events.clear()
        projected = run(True)
    finally:
        spt._exchange = exchange
    return plain, projected, events


@pytest.mark.parametrize("ulysses,ring,heads,kv_heads", [
    (2, 1, 4, 2),       # Ulysses
    (4, 1, 6, 2),       # dummy query heads, KV heads replicated (their gradients summed on the way back)
    (2, 2, 4, 2),       # Ulysses 2 x Ring 2
    (1, 2, 4, 4),       # no Ulysses group: nothing to overlap
])
def test_projected_attention_matches_attention(spd, ulysses, ring, heads, kv_heads):
    """projected_attention gives the bits of attention() untiled (head_chunks=0:
    every head in one all-to-all, as projected_attention sends them) in fp64,
    out and the weights' gradients, on every rank (x's up to the order of its sum); and
    where there is a Ulysses group, K and V are submitted before the query is
    projected, their gradients' all-to-all before dQ's, and it is waited for
    after the query weight's gradient exists."""
    for rank, (plain, projected, events) in enumerate(run_ranks(ulysses * ring, projected_rank, ulysses, ring,
                                                                heads, kv_heads)):
        for what, a, b in zip(("out", "dx", "dwq", "dwk", "dwv"), plain, projected):
            # dx sums the three projections' gradients in the order autograd
            # reaches them, which the overlap changes: the last bit may differ.
            err = (a - b).abs().max().item()
            assert (err <= 1e-14 * a.abs().max().item()) if what == "dx" else torch.equal(a, b), \
                f"rank {rank} {what}: max difference {err}"
        if ulysses == 1:
            assert events == ["q_proj", "dwq", "dwk"] or events == ["q_proj", "dwk", "dwq"], events
            continue
        want = [("s2h", 2, False), "q_proj", ("s2h", 1, True),        # K, V in flight under Q
                ("h2s", 1, True),                                     # the output
                ("s2h", 1, True),                                     # its gradient
                ("h2s", 2, False), ("h2s", 1, True), "dwq", "dwk"]    # dK, dV in flight under dQ and dWq
        assert events == want, f"rank {rank}: {events}"


def test_layout():
    pos = positions()
    lay = [spa.SeqLayout(pos, 2, u, 2, r) for r in range(2) for u in range(2)]
    # Zigzag over the ring (chunks r and 3 - r of 4), contiguous halves inside it.
    assert [x.local.tolist() for x in lay] == [[0, 1, 2, 3, 4, 5], [18, 19, 20, 21, 22, 23],
                                               [6, 7, 8, 9, 10, 11], [12, 13, 14, 15, 16, 17]]
    assert torch.equal(lay[1].position_ids, pos[:, 18:24])          # global positions kept
    assert spa.document_ids(pos)[0].tolist() == [0] * 5 + [1] * 13 + [2] * 6
    # Any S: 21 tokens on two Ulysses ranks are 11 and 10 of a padded 22.
    odd = [spa.SeqLayout(pos[:, :21], 2, u, 1, 0) for u in range(2)]
    assert [x.local.tolist() for x in odd] == [list(range(11)), list(range(11, 21))]
    assert (odd[1].seq_len, odd[1].padded_len, odd[1].pad_len) == (21, 22, 1)


def test_wrong_token_count_is_refused(spd):
    def rank_fn(h, world, rank, size):
        mesh = h.mesh(sp=2, heads=2, ulysses=2)
        layout = spa.SeqLayout.for_mesh(positions(), mesh)
        q = torch.zeros(B, S, 2, D, dtype=torch.float64)         # every token, not this rank's
        with pytest.raises(ValueError, match="layout gives this rank 12"):
            spa.attention(h, mesh, layout, q, q, q, 2)
        return True

    assert run_ranks(2, rank_fn) == [True, True]


def test_ring_backward_rotates_on_its_own_channel(spd):
    """A shift left pending on channel 1 across the backward: the backward's dK/dV
    rotations queue behind it on that channel in the same order on every rank,
    so both the early shift and the gradient come out right."""
    heads = 2

    def rank_fn(h, world, rank, size):
        mesh = h.mesh(sp=2, heads=heads, ring=2)
        layout = spa.SeqLayout.for_mesh(positions(), mesh)
        q, k, v, w = (t[:, layout.local].clone() for t in tensors(heads, heads))
        q.requires_grad_(True)
        o = spa.ring_attention(h, mesh.ring_group, layout, q, k, v)
        marker = h.empty(3, torch.float64)
        marker.fill_(rank)
        early = h.ishift(mesh.ring_group, [(marker, h.empty(3, torch.float64))], channel=1)
        (o * w).sum().backward()
        return early.wait(10000)[0].tolist(), q.grad

    out = run_ranks(2, rank_fn)
    assert out[0][0] == [1.0] * 3 and out[1][0] == [0.0] * 3
    q, k, v, w = tensors(heads, heads)
    q.requires_grad_(True)
    (reference(q, k, v, positions()) * w).sum().backward()
    layout = spa.SeqLayout(positions(), 1, 0, 2, 0)
    assert (out[0][1] - q.grad[:, layout.local]).abs().max() < 1e-12


def test_pad_then_shard_keeps_every_token():
    """An odd-length packed batch padded to 2 x sp: pads form their own document,
    and the zigzag shards of all ranks hold every real token once."""
    pos = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6]])
    padded = spt.pad_to_multiple(pos, 8)
    padded[:, 11:] = torch.arange(5)
    seen = torch.cat([spa.SeqLayout(padded, 2, u, 2, r).local for r in range(2) for u in range(2)])
    assert sorted(seen.tolist()) == list(range(16))
    assert spa.document_ids(padded)[0].tolist() == [0] * 4 + [1] * 7 + [2] * 5
