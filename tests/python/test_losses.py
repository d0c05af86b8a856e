"""spclient.losses over a real spd and forked ranks, against one process: the
all-gather's backward, GRPO's gathered log-probs, the reward at the last real
token, and the accumulation window's token count (fp64, 1e-12)."""
import pytest
import torch

import spclient.losses as spl
import spclient.torch as spt
from conftest import in_child, run_ranks
from spclient.layout import SeqLayout

V, D = 11, 5              # vocabulary, embedding width of the per-token model
TOL = 1e-12


def owner(t, S, ulysses, ring):
    """(sp rank, index among its tokens) of global token t, from the layout's
    rule written out: S padded to what splits, zigzag chunks k and 2R-1-k to
    ring rank k, each ring shard cut into `ulysses` equal pieces. The padding
    is the last tokens of the sequence, so a rank's real tokens come first."""
    unit = 2 * ring * ulysses if ring > 1 else ulysses
    Sp = -(-S // unit) * unit
    if ring == 1:
        shard, i = 0, t
    else:
        c = Sp // (2 * ring)
        k = t // c
        shard = k if k < ring else 2 * ring - 1 - k
        i = t - k * c + (0 if k < ring else c)
    piece = Sp // ring // ulysses
    return shard * ulysses + i // piece, i % piece


def own_tokens(p, S, ulysses, ring):
    """Global indices of sp rank p's real tokens, in the order it holds them."""
    mine = [(owner(t, S, ulysses, ring)[1], t) for t in range(S) if owner(t, S, ulysses, ring)[0] == p]
    return torch.tensor([t for _, t in sorted(mine)], dtype=torch.int64)


def rand(shape, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def model(device="cpu"):
    """The same weights on every rank: embedding E [V, D] and output W [D, V]."""
    return tuple(rand(shape, seed).to(device).requires_grad_(True) for shape, seed in (((V, D), 1), ((D, V), 2)))


def logprobs(E, W, tokens, labels):
    """log p(label) of each token: a model with no mixing across tokens, so
    that only how the loss is reduced separates SP from one process."""
    return torch.log_softmax(E[tokens] @ W, dim=-1).gather(-1, labels[..., None])[..., 0]


def data(B, S, seed=7):
    """tokens, labels, and the mask of tokens with a label: rows of lengths
    S, S - 2, ... (right padding), the first token of each a prompt."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(V, (B, S), generator=g)
    labels = torch.randint(V, (B, S), generator=g)
    lengths = torch.tensor([max(S - 2 * b, 2) for b in range(B)])
    mask = (torch.arange(S) < lengths[:, None]) & (torch.arange(S) > 0)
    return tokens, labels, mask


def grads(E, W):
    return torch.cat([E.grad.reshape(-1), W.grad.reshape(-1)])


def averaged(h, group, g):
    """g averaged over the group, as data parallelism averages gradients."""
    flat = h.empty(tuple(g.shape), g.dtype, device=g.device)
    flat.copy_(g)
    return h.allreduce(group, flat) / group.size


# ---------------------------------------------------------------- all_gather


def test_all_gather_backward_is_a_reduce_scatter(spd):
    """y = all_gather(x_p), each rank's loss (y w_p).sum(): rank p's gradient is
    the sum over ranks q of w_q's block p."""
    P = 3

    def rank_fn(h, world, rank, size):
        x = rand((2, 3), 10 + rank).requires_grad_(True)
        y = spl.all_gather(h, world, x)
        (y * rand((P, 2, 3), 20 + rank)).sum().backward()
        return y.detach().clone(), x.grad.clone()

    out = run_ranks(P, rank_fn)
    for r in range(P):
        assert torch.equal(out[r][0], torch.stack([rand((2, 3), 10 + q) for q in range(P)]))
        want = sum(rand((P, 2, 3), 20 + q)[r] for q in range(P))
        assert torch.allclose(out[r][1], want, rtol=0, atol=TOL), (out[r][1], want)


# ---------------------------------------------------------------- GRPO's log-probs

CLIP, BETA = 0.2, 0.04


def grpo_inputs(B, S):
    """π_θold and π_ref log-probs near the model's (ratios on both sides of the
    clip) and advantages of both signs."""
    tokens, labels, mask = data(B, S)
    with torch.no_grad():
        lp = logprobs(*model(), tokens, labels)
    old = lp + 0.6 * (torch.rand(B, S, generator=torch.Generator().manual_seed(3), dtype=torch.float64) - 0.5)
    ref = lp + 0.3 * rand((B, S), 4)
    adv = rand((B,), 5)
    return tokens, labels, mask, old, ref, adv


def grpo_reference(lp, old, ref, adv, mask, T):
    """GRPO's per-token objective written token by token: the clipped surrogate
    as its two cases (Â >= 0: min(r, 1 + ε) Â; else max(r, 1 - ε) Â) and the
    k3 KL estimate, summed over the masked tokens, over T."""
    total = 0
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if not mask[b, t]:
                continue
            r = torch.exp(lp[b, t] - old[b, t])
            a = adv[b]
            surrogate = torch.clamp(r, max=1 + CLIP) * a if a >= 0 else torch.clamp(r, min=1 - CLIP) * a
            q = torch.exp(ref[b, t] - lp[b, t])
            total = total + surrogate - BETA * (q - torch.log(q) - 1)
    return -total / T


MESHES = [(2, 1, 7), (1, 2, 7), (1, 2, 8), (2, 2, 5)]     # ulysses, ring, S; (2, 2, 5): sp rank 1 holds nothing


@pytest.mark.parametrize("ulysses,ring,S", MESHES)
def test_grpo_logprob_gather(spd, ulysses, ring, S):
    """Per-token log-probs of each rank's tokens, gathered with autograd into
    whole rows: the rows of one process, and GRPO's loss and gradients (the
    token's own on each rank, sp times over; the parameters', averaged over
    the group) those of one process."""
    check_grpo_gather(run_ranks(ulysses * ring, grpo_rank_fn, ulysses, ring, S), ulysses, ring, S)


GRPO_ROWS = 3


def grpo_rank_fn(h, world, rank, size, ulysses, ring, S, device="cpu"):
    """One rank of test_grpo_logprob_gather (on `device`)."""
    tokens, labels, mask, old, ref, adv = (t.to(device) for t in grpo_inputs(GRPO_ROWS, S))
    mesh = h.mesh(sp=size, heads=2, ulysses=ulysses, ring=ring)
    layout = SeqLayout.for_mesh(torch.arange(S).repeat(GRPO_ROWS, 1), mesh)
    mine = own_tokens(mesh.sp_group.rank, S, ulysses, ring)
    E, W = model(device)
    lp = logprobs(E, W, tokens[:, mine], labels[:, mine])
    lp.retain_grad()
    full = spl.gather_tokens(h, mesh.sp_group, layout, lp)
    window = spl.Window(h, mesh.sp_group, [mask[:, mine]])
    loss = spl.grpo_loss(full, old, ref, adv, mask, window, clip=CLIP, beta=BETA)
    loss.backward()
    return mine, full.detach().clone(), loss.item(), lp.grad.clone(), averaged(h, mesh.sp_group, grads(E, W))


def check_grpo_gather(out, ulysses, ring, S):
    """The ranks' results of grpo_rank_fn against one process on the host."""
    B = GRPO_ROWS
    tokens, labels, mask, old, ref, adv = grpo_inputs(B, S)

    def reference():
        E, W = model()
        lp = logprobs(E, W, tokens, labels)
        lp.retain_grad()
        loss = grpo_reference(lp, old, ref, adv, mask, int(mask.sum()))
        loss.backward()
        return lp.detach(), loss.item(), lp.grad, grads(E, W)

    lp_ref, loss_ref, lp_grad_ref, g_ref = in_child(reference)
    assert sorted(torch.cat([o[0] for o in out]).tolist()) == list(range(S))
    if (ulysses, ring, S) == (2, 2, 5):
        assert out[1][0].numel() == 0
    P = ulysses * ring
    for mine, full, loss, lp_grad, g in out:
        assert full.shape == (B, S)
        assert torch.allclose(full, lp_ref, rtol=0, atol=TOL), (full - lp_ref).abs().max()
        assert abs(loss - loss_ref) <= TOL, (loss, loss_ref)
        assert torch.allclose(lp_grad, P * lp_grad_ref[:, mine], rtol=0, atol=TOL)
        assert torch.allclose(g, g_ref, rtol=0, atol=TOL), (g - g_ref).abs().max()


def test_gather_refuses_a_group_the_layout_is_not_for(spd):
    def rank_fn(h, world, rank, size):
        layout = SeqLayout(torch.arange(6)[None], ulysses=size, ulysses_rank=1 - rank)
        x = torch.zeros(1, 3, dtype=torch.float64)
        with pytest.raises(ValueError, match="the layout places it at sp rank"):
            spl.gather_tokens(h, world, layout, x)
        with pytest.raises(ValueError, match="real tokens"):
            spl.gather_tokens(h, world, SeqLayout(torch.arange(6)[None], size, rank), x[:, :2])
        return True

    assert run_ranks(2, rank_fn) == [True, True]


# ---------------------------------------------------------------- the reward


@pytest.mark.parametrize("ulysses,ring,S", [(1, 2, 7), (2, 2, 7)])
def test_last_token_reward(spd, ulysses, ring, S):
    """Each row's value at its last real token, from whichever rank holds it,
    on every rank; the gradient reaches the holder's token alone. With zigzag
    the sequence's last token is on ring rank 0, not on the last rank."""
    check_reward(run_ranks(ulysses * ring, reward_rank_fn, ulysses, ring, S), ulysses, ring, S)


def reward_inputs(S):
    """Per-token values of 3 rows of lengths S, S - 2 and 1, and a weight for each row's reward."""
    return rand((3, S), 30), torch.tensor([S, S - 2, 1]), torch.tensor([1.0, -2.0, 3.0], dtype=torch.float64)


def reward_rank_fn(h, world, rank, size, ulysses, ring, S, device="cpu"):
    """One rank of test_last_token_reward (on `device`)."""
    values, lengths, weights = reward_inputs(S)
    mesh = h.mesh(sp=size, heads=2, ulysses=ulysses, ring=ring)
    layout = SeqLayout.for_mesh(torch.arange(S).repeat(values.shape[0], 1), mesh)
    mine = own_tokens(mesh.sp_group.rank, S, ulysses, ring)
    v = values[:, mine].to(device).requires_grad_(True)
    reward = spl.last_token_reward(h, mesh.sp_group, layout, v, lengths.to(device))
    (reward * weights.to(device)).sum().backward()
    return mine, reward.detach().clone(), v.grad.clone()


def check_reward(out, ulysses, ring, S):
    """The ranks' results of reward_rank_fn against the values read here."""
    values, lengths, weights = reward_inputs(S)
    B, P = values.shape[0], ulysses * ring
    want = values[torch.arange(B), lengths - 1]
    holders = [owner(int(n) - 1, S, ulysses, ring)[0] for n in lengths]
    assert holders[0] == ulysses - 1 and len(set(holders)) > 1
    for p, (mine, reward, grad) in enumerate(out):
        assert torch.equal(reward, want), (reward, want)
        expect = torch.zeros(B, mine.numel(), dtype=torch.float64)
        for b in range(B):
            if holders[b] == p:
                expect[b, mine.tolist().index(int(lengths[b]) - 1)] = P * weights[b]
        assert torch.equal(grad, expect), (p, grad, expect)


# ---------------------------------------------------------------- accumulation

ROWS, S_ACC = 4, 7

# name, world, sp, ulysses, ring, accumulation steps: each cuts the same
# window of ROWS rows into micro-batches its own way.
ACCUMULATION = [
    ("SP=2 ring, accumulation 1", 2, 2, 1, 2, 1),
    ("SP=2 Ulysses, accumulation 4", 2, 2, 2, 1, 4),
    ("DP=2 x SP=2 ring, accumulation 2", 4, 2, 1, 2, 2),
    ("DP=2, accumulation 2", 2, 1, 1, 1, 2),
]


def micro_rows(dp_rank, dp, step, steps):
    """The window's rows of one DP rank's micro-batch."""
    n = ROWS // (dp * steps)
    first = (step * dp + dp_rank) * n
    return torch.arange(first, first + n)


def sp_rank_fn(h, world, rank, size, sp, ulysses, ring, steps, task, device="cpu"):
    """One rank's window: counted first (Window), then `steps` micro-batches,
    gradients accumulated and averaged over the world."""
    tokens, labels, mask, old, ref, adv = (t.to(device) for t in grpo_inputs(ROWS, S_ACC))
    mesh = h.mesh(sp=sp, heads=2, ulysses=ulysses, ring=ring)
    mine = own_tokens(mesh.sp_group.rank, S_ACC, ulysses, ring)
    batches = [micro_rows(mesh.dp_group.rank, mesh.dp, m, steps) for m in range(steps)]
    window = spl.Window(h, world, [mask[rows][:, mine] for rows in batches], sp=sp)
    E, W = model(device)
    for rows in batches:
        layout = SeqLayout.for_mesh(torch.arange(S_ACC).repeat(len(rows), 1), mesh)
        lp = logprobs(E, W, tokens[rows][:, mine], labels[rows][:, mine])
        if task == "sft":
            loss = spl.sft_loss(h, mesh.sp_group, lp, mask[rows][:, mine], window)
        else:
            full = spl.gather_tokens(h, mesh.sp_group, layout, lp)
            loss = spl.grpo_loss(full, old[rows], ref[rows], adv[rows], mask[rows], window, clip=CLIP, beta=BETA)
        loss.backward()
    return window.tokens, averaged(h, world, grads(E, W))


def one_process(task, normalise="window"):
    """The window in one process, one row a micro-batch (DP = ROWS simulated at
    accumulation ROWS), gradients summed. normalise: "window", each row's sum
    over the window's tokens; "micro-batch", each row's own token mean over
    the rows (the per-micro-batch mean)."""
    tokens, labels, mask, old, ref, adv = grpo_inputs(ROWS, S_ACC)
    T = int(mask.sum())
    E, W = model()
    for b in range(ROWS):
        lp = logprobs(E, W, tokens[b:b + 1], labels[b:b + 1])
        n = T if normalise == "window" else int(mask[b].sum()) * ROWS
        if task == "sft":
            loss = -lp[mask[b:b + 1]].sum() / n
        else:
            loss = grpo_reference(lp, old[b:b + 1], ref[b:b + 1], adv[b:b + 1], mask[b:b + 1], n)
        loss.backward()
    return T, grads(E, W)


@pytest.mark.parametrize("task", ["sft", "grpo"])
@pytest.mark.parametrize("name,world,sp,ulysses,ring,steps", ACCUMULATION)
def test_accumulation_window(spd, task, name, world, sp, ulysses, ring, steps):
    """SP, DP and accumulation cut one window of rows their own ways; with the
    window's token count every one gives one process's gradients."""
    T, g_ref = in_child(one_process, task)
    out = run_ranks(world, sp_rank_fn, sp, ulysses, ring, steps, task)
    for tokens, g in out:
        assert tokens == T
        assert torch.allclose(g, g_ref, rtol=0, atol=TOL), f"{name}: {(g - g_ref).abs().max()}"


def test_per_rank_and_per_micro_batch_means_are_not_the_token_mean(spd):
    """The pitfall: each SP rank's own token mean, averaged over the ranks, and
    each micro-batch's token mean (spclient.torch.token_mean_loss), averaged
    over the accumulation steps, weight tokens by the count of their rank or
    micro-batch. Zigzag over 2 ranks gives them 5 and 8 of the window's 13
    tokens, and the rows hold 6, 4, 2 and 1 (accumulation 4), so both are off;
    the window's count is not."""
    T, g_ref = in_child(one_process, "sft")
    _, g_micro = in_child(one_process, "sft", "micro-batch")

    def rank_fn(h, world, rank, size):
        tokens, labels, mask, *_ = grpo_inputs(ROWS, S_ACC)
        mine = own_tokens(rank, S_ACC, 1, 2)
        E, W = model()
        lp = logprobs(E, W, tokens[:, mine], labels[:, mine])
        own = mask[:, mine]
        (-lp[own].sum() / own.sum()).backward()                 # this rank's mean alone
        per_rank = averaged(h, world, grads(E, W))
        E, W = model()
        for b in range(ROWS):
            lp = logprobs(E, W, tokens[b:b + 1, mine], labels[b:b + 1, mine])
            own = mask[b:b + 1, mine]
            (spt.token_mean_loss(h, world, -lp[own].sum(), own.sum()) / ROWS).backward()
        per_micro = averaged(h, world, grads(E, W))
        return int(mask[:, mine].sum()), per_rank, per_micro

    out = run_ranks(2, rank_fn)
    assert [n for n, _, _ in out] == [5, 8] and T == 13
    per_rank, per_micro = out[0][1], out[0][2]
    assert (per_rank - g_ref).abs().max() > 1e-3
    assert (per_micro - g_ref).abs().max() > 1e-3
    assert torch.allclose(per_micro, g_micro, rtol=0, atol=TOL)        # it is the per-micro-batch mean
    T_sp, g_window = run_ranks(2, sp_rank_fn, 2, 1, 2, ROWS, "sft")[0]
    assert T_sp == T and torch.allclose(g_window, g_ref, rtol=0, atol=TOL)
