"""spclient.linear over a real spd: the short convolution's halo and the gated
delta rule's state passed between ranks, against the single-process recurrence
of client/examples/train_hybrid_sp.py (torch's conv1d per document, the
recurrence token by token), on the DeepSpeed write-up's packed layout
[0, 1, 2, 0, 1, 0, 1, 2] split over 2 and 4 ranks so that documents cross the
shard boundaries, with the recurrence by context parallelism (the state passed
between ranks), by Ulysses (q, k, v, beta and g seq->head in one all-to-all,
q/k with fewer heads than v, replicated or padded with dummy heads) and by
Ulysses inside context parallelism; gradcheck of the distributed functions;
the wrong cases the write-up warns of; the hybrid stack's outputs and
gradients on every such mesh."""
import os
import sys

import pytest
import torch

import spclient.attention as spa
import spclient.linear as spl
import spclient.torch as spt
from conftest import ROOT, in_child, run_ranks

sys.path.insert(0, os.path.join(ROOT, "client", "examples"))
import train_hybrid_sp as T  # noqa: E402

SEED = [0, 1, 2, 0, 1, 0, 1, 2]          # every SP boundary of 2 and 4 ranks inside a document
AT_BOUNDARY = [0, 1, 2, 3, 0, 1, 2, 0]   # a document starts exactly at the 2-rank boundary
# Rows whose documents run through a whole piece of 4 ranks: the state passes
# through a rank's transition M, and a halo reaches two pieces back.
LONG = [[0, 1, 2, 3, 4, 5, 0, 1], list(range(8))]
LAYOUTS = {"seed": [SEED], "at_boundary": [AT_BOUNDARY], "long": LONG}
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
H, DK, DV, C, K = 2, 3, 2, 3, 4          # K - 1 = 3 > the 2 tokens a rank of 4 holds: two hops


def inputs(B, S, dtype, heads=H, dk=DK, dv=DV, channels=C, k=K, v_heads=None):
    """x, weight, q, k, v, beta, g of B rows and the loss weights of both
    outputs; k normalised, beta in (0, 1), g < 0, as a GatedDeltaNet makes them.
    q and k have `heads` heads, v, beta and g v_heads (default: as many)."""
    hv = v_heads or heads
    gen = torch.Generator().manual_seed(7)

    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x, w = r(B, S, channels), r(channels, k) / k
    q, kk, v = r(B, S, heads, dk), r(B, S, heads, dk), r(B, S, hv, dv)
    kk = kk / kk.norm(dim=-1, keepdim=True)
    beta, g = torch.sigmoid(r(B, S, hv)), -torch.nn.functional.softplus(r(B, S, hv))
    wc, wo = r(B, S, channels), r(B, S, hv, dv)
    return [t.to(dtype) for t in (x, w, q, kk, v, beta, g, wc, wo)]


TOKENS = (0, 2, 3, 4, 5, 6)     # which of inputs()' tensors run along the tokens (w does not)


def reference(pos, dtype, heads=(H, H)):
    """The single-process outputs and every input's gradient; heads: those of
    q/k and of v."""
    def run():
        ids = torch.tensor(pos)
        x, w, q, k, v, beta, g, wc, wo = (t.requires_grad_(i < 7) for i, t in
                                          enumerate(inputs(*ids.shape, dtype, heads=heads[0], v_heads=heads[1])))
        yc = T.plain_conv(x, w, ids)
        o = T.Single(None, ids).gated_delta(q, k, v, beta, g)
        ((yc * wc).sum() + (o * wo).sum()).backward()
        return yc.detach(), o.detach(), [t.grad for t in (x, w, q, k, v, beta, g)]
    return in_child(run)


def sp_rank(h, world, rank, size, pos, dtype, device="cpu", ulysses=1, heads=(H, H)):
    """This rank's share: its tokens' outputs and gradients (the weight's is its
    partial sum) and the global indices of its tokens. device "cuda": rank r's
    tensors on GPU r mod the GPU count. ulysses > 1: the recurrence on a mesh
    of ulysses x size / ulysses ranks, else by context parallelism over the
    world; heads: those of q/k and of v."""
    ids = torch.tensor(pos)
    if ulysses > 1:
        mesh = h.mesh(sp=size, heads=heads[1], kv_heads=heads[0], ulysses=ulysses, ring=size // ulysses)
        ctx = spl.LinearContext.for_mesh(h, mesh, ids)
        layout = ctx.layout
    else:
        layout = spa.SeqLayout(ids, size, rank)
        ctx = spl.LinearContext(h, world, layout)
    dev = torch.device("cuda", rank % torch.cuda.device_count()) if device == "cuda" else torch.device(device)
    full = [t.to(dev) for t in inputs(*ids.shape, dtype, heads=heads[0], v_heads=heads[1])]
    mine = [t if i == 1 else t[:, layout.local] for i, t in enumerate(full)]
    x, w, q, k, v, beta, g, wc, wo = (t.clone().requires_grad_(i < 7) for i, t in enumerate(mine))
    yc = spl.short_conv(ctx, x, w)
    o = spl.gated_delta_rule(ctx, q, k, v, beta, g)
    ((yc * wc).sum() + (o * wo).sum()).backward()
    return layout.local, yc.detach(), o.detach(), [t.grad for t in (x, w, q, k, v, beta, g)]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", LAYOUTS)
def test_conv_and_recurrence_equal_the_single_process(spd, name, size, dtype):
    pos = LAYOUTS[name]
    same_as_single_process(run_ranks(size, sp_rank, pos, dtype), *reference(pos, dtype), TOL[dtype])


# size, ulysses (the ring: size / ulysses), q/k and v heads: Ulysses alone and
# inside context parallelism; q/k heads split (fewer than v), replicated (fewer
# than the ranks), padded with dummies (3 over 2 ranks), and v heads padded
# inside a replicated q/k head's group (3 over 2 ranks of one q/k head).
ULYSSES = [(2, 2, (2, 4)), (4, 4, (2, 4)), (4, 2, (2, 4)), (2, 2, (3, 6)), (2, 2, (1, 3)), (4, 2, (3, 6))]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("size,ulysses,heads", ULYSSES, ids=[f"sp{s}-u{u}-h{h[0]}x{h[1]}" for s, u, h in ULYSSES])
def test_ulysses_equals_the_single_process(spd, size, ulysses, heads, dtype):
    pos = [SEED]
    out = run_ranks(size, sp_rank, pos, dtype, "cpu", ulysses, heads)
    same_as_single_process(out, *reference(pos, dtype, heads), TOL[dtype])


def test_ulysses_inside_context_parallelism_passes_the_state(spd):
    """Documents through whole stretches of 2 x 2 ranks: the state passes from
    one ring rank's stretch to the next per head, through its transition M."""
    out = run_ranks(4, sp_rank, LONG, torch.float64, "cpu", 2, (2, 4))
    same_as_single_process(out, *reference(LONG, torch.float64, (2, 4)), TOL[torch.float64])


def same_as_single_process(out, yc, o, grads, tol):
    """Every rank's outputs and input gradients are the single process's at its
    tokens; the weight's gradients summed over the ranks are the single one."""
    for r, (idx, yc_r, o_r, grads_r) in enumerate(out):
        assert (yc_r - yc[:, idx]).abs().max() <= tol, f"rank {r}: conv output"
        assert (o_r - o[:, idx]).abs().max() <= tol, f"rank {r}: recurrence output"
        for i, name in zip(TOKENS, ("x", "q", "k", "v", "beta", "g")):
            d = (grads_r[i] - grads[i][:, idx]).abs().max()
            assert d <= tol, f"rank {r}: gradient of {name} differs by {d}"
    d = (sum(g[1] for _, _, _, g in out) - grads[1]).abs().max()
    assert d <= tol, f"conv weight gradient (summed over ranks) differs by {d}"


# ---------------------------------------------------------------- gradcheck


class _Replicated(torch.autograd.Function):
    """Inputs every rank holds whole: their gradient is the sum of every rank's."""

    @staticmethod
    def forward(ctx, h, group, *xs):
        ctx.h, ctx.group = h, group
        return tuple(x.clone() for x in xs)

    @staticmethod
    def backward(ctx, *grads):
        flat = torch.cat([g.reshape(-1) for g in grads])
        total = spt._sum(ctx.h, ctx.group, flat).clone()
        return (None, None) + tuple(t.view_as(g) for t, g in zip(total.split([g.numel() for g in grads]), grads))


class _Gathered(torch.autograd.Function):
    """Every rank's piece of y put together [B, S, ...]. Its backward takes this
    rank's piece of the gradient, which is right only when every rank's gradient
    is the same: gradcheck's, which walks the outputs in the same order on every
    rank."""

    @staticmethod
    def forward(ctx, h, group, layout, y):
        ctx.layout = layout
        piece = layout.pad(y).contiguous()
        recv = h.empty((group.size,) + tuple(piece.shape), y.dtype)
        h.allgather(group, spt._staged(h, piece), recv)
        whole = torch.cat(list(recv.clone()), dim=1)
        return whole[:, :layout.seq_len]

    @staticmethod
    def backward(ctx, grad):
        return None, None, None, grad[:, ctx.layout.local]


GRADCHECKS = [(2, 1), (4, 1), (2, 2), (4, 2)]    # size, ulysses (ring: the rest)


@pytest.mark.parametrize("size,ulysses", GRADCHECKS, ids=[f"sp{s}-u{u}" for s, u in GRADCHECKS])
def test_gradcheck(spd, size, ulysses):
    """torch.autograd.gradcheck in fp64 of the whole distributed function, on the
    write-up's row and one document through every piece: every
    rank holds the inputs whole (their gradient summed over ranks), feeds its
    piece to short_conv and gated_delta_rule, and gathers the outputs, so each
    rank checks the full Jacobian, the halo's and the state's cross-rank terms
    included, against finite differences. With Ulysses, 1 q/k head (replicated)
    and 2 value heads, the all-to-all's terms too."""

    def rank_fn(h, world, rank, n):
        ids = torch.tensor([SEED, LONG[1]])
        if ulysses > 1:
            mesh = h.mesh(sp=n, heads=2, kv_heads=1, ulysses=ulysses, ring=n // ulysses)
            ctx = spl.LinearContext.for_mesh(h, mesh, ids)
            layout = ctx.layout
        else:
            layout = spa.SeqLayout(ids, n, rank)
            ctx = spl.LinearContext(h, world, layout)
        xs = [t.requires_grad_() for t in inputs(2, 8, torch.float64, heads=1, dk=2, dv=2, channels=2,
                                                  v_heads=ulysses)[:7]]

        def f(*full):
            x, w, q, k, v, beta, g = (t if i == 1 else t[:, layout.local]
                                      for i, t in enumerate(_Replicated.apply(h, world, *full)))
            yc = spl.short_conv(ctx, x, w)
            o = spl.gated_delta_rule(ctx, q, k, v, beta, g)
            return _Gathered.apply(h, world, layout, yc), _Gathered.apply(h, world, layout, o)

        return torch.autograd.gradcheck(f, xs, eps=1e-6, atol=1e-7, rtol=1e-5)

    assert run_ranks(size, rank_fn, timeout=120) == [True] * size


# ---------------------------------------------------------------- the wrong cases


@pytest.mark.parametrize("size", [2, 4])
def test_a_halo_across_a_document_start_is_not_taken(spd, size):
    """x = global index + 1 on every channel. The tokens before a piece are all
    there (a plain linear shift brings them), but the halo keeps only those of
    the piece's first token's document, and only they get a gradient back."""

    def rank_fn(h, world, rank, n):
        layout = spa.SeqLayout(torch.tensor([SEED]), n, rank)
        ctx = spl.LinearContext(h, world, layout)
        x = (layout.local.to(torch.float64) + 1)[None, :, None].repeat(1, 1, 2).requires_grad_()
        halo = spl.conv_halo(ctx, x, K)
        halo.sum().backward()
        plain = spt.shift(h, world, x.detach()[:, -1:].contiguous(), linear=True)[0]   # the token before
        return halo.detach()[0, :, 0].tolist(), x.grad[0, :, 0].tolist(), plain[0, 0, 0].item()

    out = run_ranks(size, rank_fn)
    docs = T.documents(torch.tensor(SEED))
    doc = [next(d for d, (a, e) in enumerate(docs) if a <= t < e) for t in range(len(SEED))]
    L = len(SEED) // size
    taken = [0] * len(SEED)
    for r, (halo, _, before) in enumerate(out):
        start = r * L
        want = [float(t + 1) if t >= 0 and doc[t] == doc[start] else 0.0 for t in range(start - K + 1, start)]
        assert halo == want, f"rank {r}: halo {halo}, expected {want}"
        assert before == float(start), f"rank {r}: the token before the piece came as {before}"
        for t in range(max(0, start - K + 1), start):
            taken[t] += doc[t] == doc[start]
    dropped = sum(1 for r in range(1, size) for t in range(max(0, r * L - K + 1), r * L) if doc[t] != doc[r * L])
    assert dropped > 0, "the layout never puts another document in a halo"
    grads = [g for _, grad, _ in out for g in grad]
    assert grads == [float(c) for c in taken]


def test_a_document_starting_at_a_boundary_cuts_halo_and_state(spd):
    """AT_BOUNDARY over 2 ranks: rank 1's piece starts a document, so its halo
    is all zeros and its outputs do not depend on anything rank 0 holds."""

    def rank_fn(h, world, rank, n):
        layout = spa.SeqLayout(torch.tensor([AT_BOUNDARY]), n, rank)
        ctx = spl.LinearContext(h, world, layout)
        x, _, q, k, v, beta, g = (t[:, layout.local].clone().requires_grad_() if i != 1 else t
                                  for i, t in enumerate(inputs(1, 8, torch.float64)[:7]))
        halo = spl.conv_halo(ctx, x, K)
        o = spl.gated_delta_rule(ctx, q, k, v, beta, g)
        ((halo.sum() + o.sum()) * (rank == 1)).backward()      # rank 1's outputs only
        return halo.abs().max().item(), [t.grad.abs().max().item() for t in (x, q, k, v, beta, g)]

    out = run_ranks(2, rank_fn)
    assert out[1][0] == 0.0
    assert out[0][1] == [0.0] * 6, "rank 1's outputs reach back into rank 0's tokens"
    assert min(out[1][1][1:]) > 0


def test_position_ids_made_again_after_sharding(spd):
    """The write-up's example: one document of 16 tokens over 4 ranks, each rank
    making its ids again as [0, 1, 2, 3]. Sharded zigzag (a ring of 4), each
    rank's second chunk goes on from its first instead of its neighbour's:
    SeqLayout.from_local refuses the ids on every rank. Sharded contiguously,
    as the linear layers shard, the ids read exactly like four packed documents
    starting at the boundaries; from_local takes them so, and the layers then
    cut the halo and the state at every boundary: only the global ids, sharded,
    tell the two apart."""

    def rank_fn(h, world, rank, n):
        again = torch.arange(4)[None]
        mesh = h.mesh(sp=n, heads=4, ulysses=1, ring=n)
        with pytest.raises(ValueError) as refused:
            spa.SeqLayout.from_local(h, mesh, again)
        wrong = spl.LinearContext(h, world, spa.SeqLayout.from_local(h, world, again))
        right = spl.LinearContext(h, world, spa.SeqLayout(torch.arange(16)[None], n, rank))
        x = torch.ones(1, 4, 1, dtype=torch.float64)
        halos = [spl.conv_halo(c, x, K).sum().item() for c in (wrong, right)]
        return str(refused.value), wrong.layout.doc[0].tolist(), bool(wrong.resets[0, 0]), halos

    out = run_ranks(4, rank_fn)
    for r, (msg, doc, reset, (halo_wrong, halo_right)) in enumerate(out):
        assert "position ids do not fit" in msg and "made again" in msg, msg
        assert doc == [d for d in range(4) for _ in range(4)]
        assert reset and halo_wrong == 0.0
        assert halo_right == (0.0 if r == 0 else 3.0)
    assert len({msg for msg, *_ in out}) == 1, "the ranks name different culprits"


def test_a_layout_with_a_ring_is_refused(spd):
    def rank_fn(h, world, rank, n):
        with pytest.raises(ValueError, match="contiguous pieces"):
            spl.LinearContext(h, world, spa.SeqLayout(torch.tensor([SEED]), 1, 0, n, rank))
        return True

    assert run_ranks(2, rank_fn) == [True, True]


def test_ulysses_and_ring_swapped_are_refused(spd):
    """2 x 2 ranks with the mesh's Ulysses and ring groups swapped: ranks 1 and 2
    (ring rank 0, ulysses rank 1 and the reverse) find their coordinates do not
    lay out their pieces and refuse; ranks 0 and 3 cannot tell."""

    def rank_fn(h, world, rank, n):
        mesh = h.mesh(sp=n, heads=2, kv_heads=1, ulysses=2, ring=2)
        layout = spa.SeqLayout(torch.tensor([SEED]), n, mesh.sp_group.rank)
        try:
            spl.LinearContext(h, mesh.sp_group, layout, mesh.ring_group, mesh.ulysses_group)
        except ValueError as e:
            return str(e)
        return None

    out = run_ranks(4, rank_fn)
    assert out[0] is None and out[3] is None
    for r in (1, 2):
        assert out[r] is not None and "consecutive ranks" in out[r], out[r]


def test_from_cu_seqlens_is_the_layout_of_the_ids(spd):
    def rank_fn(h, world, rank, n):
        a = spl.LinearContext.from_cu_seqlens(h, world, torch.tensor([0, 3, 5, 8]))
        b = spl.LinearContext(h, world, spa.SeqLayout(torch.tensor([SEED]), n, rank))
        return torch.equal(a.layout.doc, b.layout.doc) and torch.equal(a.resets, b.resets)

    assert run_ranks(2, rank_fn) == [True, True]


# ---------------------------------------------------------------- the hybrid stack


def logit_weights(c):
    """The loss is the sum of the logits times these: random, over the 8 tokens
    a token mean as training's loss is, so that the gradients are of its scale
    (a few units; fp32 rounds them to ~1e-6)."""
    return torch.randn(1, 8, c.vocab, generator=torch.Generator().manual_seed(3), dtype=c.dtype) / 8


def stack_single(dtype):
    """The single process's logits and every parameter's gradient."""
    def run():
        c = T.Cfg(dtype)
        pos = torch.tensor([SEED])
        model = T.new_model(c)
        logits = model(torch.arange(8)[None] * 7 % c.vocab, pos, T.Single(c, pos))
        (logits * logit_weights(c)).sum().backward()
        return logits.detach(), [p.grad for p in model.parameters()]
    return in_child(run)


def stack_rank(h, world, rank, size, dtype, ulysses, device="cpu"):
    """This rank's logits and parameter gradients, the linear layers on
    ulysses x size / ulysses ranks; device "cuda": the model on GPU rank mod
    the GPU count."""
    c = T.Cfg(dtype)
    dev = torch.device("cuda", rank % torch.cuda.device_count()) if device == "cuda" else torch.device(device)
    mesh, linear_mesh = T.meshes(h, c, size, ulysses, size // ulysses)
    pos = torch.tensor([SEED])
    layout = spa.SeqLayout.for_mesh(pos, mesh)
    tokens = (torch.arange(8)[None, layout.local] * 7 % c.vocab).to(dev)
    model = T.new_model(c).to(dev)
    logits = model(tokens, layout.position_ids.to(dev), T.Parallel(h, mesh, linear_mesh, c, layout))
    (logits * logit_weights(c)[:, layout.local].to(dev)).sum().backward()
    return layout.local, logits.detach().cpu(), [p.grad.cpu() for p in model.parameters()]


def stack_same_as_single_process(out, logits, grads, tol):
    for r, (idx, lg, _) in enumerate(out):
        d = (lg - logits[:, idx]).abs().max()
        assert d <= tol, f"rank {r}: logits differ by {d}"
    names = [n for n, _ in T.new_model(T.Cfg()).named_parameters()]
    for i, name in enumerate(names):
        d = (sum(g[i] for _, _, g in out) - grads[i]).abs().max()
        assert d <= tol, f"gradient of {name} differs by {d}"


STACKS = [(2, 1), (2, 2), (4, 1), (4, 4), (4, 2)]     # size, the linear layers' ulysses (ring: the rest)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("size,ulysses", STACKS, ids=[f"sp{s}-u{u}" for s, u in STACKS])
def test_hybrid_stack_equals_the_single_process(spd, size, ulysses, dtype):
    """Every logit and every parameter's gradient (summed over the ranks) of the
    example's hybrid stack on the packed layout, its linear layers by context
    parallelism, by Ulysses and by both."""
    stack_same_as_single_process(run_ranks(size, stack_rank, dtype, ulysses), *stack_single(dtype), TOL[dtype])


def test_training_matches_single_process(spd):
    """The example itself, 3 steps in fp64: the table's bounds."""
    table, curves = T.experiment(torch.float64, steps=3, log=lambda *a: None)
    assert set(table) == {name for name, *_ in T.CONFIGS}
    for name, (dloss, dgrad, dlp, _) in table.items():
        assert dloss <= 1e-10 and dgrad <= 1e-10 and dlp <= 1e-12, f"{name}: {dloss}, {dgrad}, {dlp}"
        assert curves[name][0] != curves[name][-1]
