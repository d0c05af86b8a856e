"""Backward semantics of spclient.torch, against single-process autograd."""
import torch

import spclient
import spclient.torch as spt
from conftest import run_ranks


def test_loss_allreduce_gradient_example(spd):
    """seeds/000 §5.1: x = 2 and x = 3 on two ranks, y = w0·x all-reduced,
    loss = 2y − 1: gradients 8 and 12 (mean 10, the single-process gradient);
    a plain all-reduce gives 4 and 6."""
    def rank_fn(h, world, rank, size):
        x = torch.tensor([2.0, 3.0][rank], dtype=torch.float64)
        w0 = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
        y = spt.all_reduce(h, world, (w0 * x).reshape(1))
        (2 * y - 1).sum().backward()
        g_autograd = w0.grad.item()

        w1 = torch.tensor(1.0, dtype=torch.float64, requires_grad=True)
        y = w1 * x
        total = spt._sum(h, world, y.detach().reshape(1))   # no autograd
        y_plain = y + (total[0] - y.detach())
        (2 * y_plain - 1).backward()
        return g_autograd, w1.grad.item()

    out = run_ranks(2, rank_fn)
    assert [g for g, _ in out] == [8.0, 12.0]
    assert sum(g for g, _ in out) / 2 == 10.0
    assert [p for _, p in out] == [4.0, 6.0]


def _full(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


def test_ulysses_backward_is_the_inverse(spd):
    """q (4 heads) and k (1 head, replicated to both ranks) through seq_to_head;
    the distributed gradients equal single-process autograd of the same slicing."""
    S, D, P = 6, 3, 2

    def rank_fn(h, world, rank, size):
        q_full, k_full = _full((1, S, 4, D), 1), _full((1, S, 1, D), 2)
        rows = slice(rank * S // P, (rank + 1) * S // P)
        q = q_full[:, rows].clone().requires_grad_(True)
        k = k_full[:, rows].clone().requires_grad_(True)
        qh, kh = spt.seq_to_head(h, world, S, (4, 1), q, k, kv_heads=1)
        wq, wk = _full(tuple(qh.shape), 10 + rank), _full(tuple(kh.shape), 20 + rank)
        ((qh * wq).sum() + (kh * wk).sum()).backward()
        o = spt.head_to_seq(h, world, S, (4,), qh.detach().clone())[0]
        assert torch.equal(o, q.detach())            # the forward round trip is exact
        return q.grad.clone(), k.grad.clone()

    out = run_ranks(P, rank_fn)
    q_full = _full((1, S, 4, D), 1).requires_grad_(True)
    k_full = _full((1, S, 1, D), 2).requires_grad_(True)
    loss = 0
    for r in range(P):
        qh = q_full[:, :, 2 * r:2 * r + 2]           # rank r's query heads, every row
        kh = k_full                                  # the one kv head, replicated
        loss = loss + (qh * _full(tuple(qh.shape), 10 + r)).sum() + (kh * _full(tuple(kh.shape), 20 + r)).sum()
    loss.backward()
    for r in range(P):
        rows = slice(r * S // P, (r + 1) * S // P)
        assert torch.allclose(out[r][0], q_full.grad[:, rows], rtol=0, atol=1e-12)
        assert torch.allclose(out[r][1], k_full.grad[:, rows], rtol=0, atol=1e-12)


def test_shift_backward_comes_back(spd):
    """y_p = x_{p-1}; the gradient of x_p is the weight of rank p+1 (cyclic), and
    with linear the last rank's block gets zeros."""
    P = 3

    def rank_fn(h, world, rank, size, linear):
        x = torch.full((4,), float(rank), dtype=torch.float64, requires_grad=True)
        y = spt.shift(h, world, x, linear=linear)[0]
        (y * (10.0 * (rank + 1))).sum().backward()
        return y.detach().tolist(), x.grad.tolist()

    out = run_ranks(P, rank_fn, False)
    for r in range(P):
        assert out[r][0] == [float((r - 1) % P)] * 4
        assert out[r][1] == [10.0 * ((r + 1) % P + 1)] * 4
    out = run_ranks(P, rank_fn, True)
    assert out[0][0] == [0.0] * 4
    assert out[P - 1][1] == [0.0] * 4
    assert out[0][1] == [20.0] * 4

def test_ulysses_five_tensors_of_two_head_counts(spd):
    """GatedDeltaNet's q and k (3 heads), v, beta and gate (5 heads; beta and gate
    of head dim 1) in one seq_to_head on 2 ranks: both counts take a zero dummy
    head, the outputs are the padded heads, the round trip is exact and the
    gradients equal single-process autograd of the same padding and slicing."""
    S, P = 6, 2
    heads, dims = (3, 3, 5, 5, 5), (4, 4, 8, 1, 1)

    def padded(x, n):
        return torch.cat([x, x.new_zeros(x.shape[0], x.shape[1], n - x.shape[2], x.shape[3])], dim=2)

    def local(r, H):
        n = -(-H // P)                               # heads per rank, dummies included
        return slice(r * n, (r + 1) * n), n * P

    def rank_fn(h, world, rank, size):
        rows = slice(rank * S // P, (rank + 1) * S // P)
        xs = [_full((1, S, H, D), 30 + i)[:, rows].clone().requires_grad_(True)
              for i, (H, D) in enumerate(zip(heads, dims))]
        ys = spt.seq_to_head(h, world, S, heads, *xs)
        for i, (y, H) in enumerate(zip(ys, heads)):
            cut, n = local(rank, H)
            assert torch.equal(y, padded(_full((1, S, H, dims[i]), 30 + i), n)[:, :, cut])
        loss = sum((y * _full(tuple(y.shape), 40 + 10 * rank + i)).sum() for i, y in enumerate(ys))
        loss.backward()
        back = spt.head_to_seq(h, world, S, heads, *[y.detach().clone() for y in ys])
        assert all(torch.equal(b, x.detach()) for b, x in zip(back, xs))
        return [x.grad.clone() for x in xs]

    out = run_ranks(P, rank_fn)
    fulls = [_full((1, S, H, D), 30 + i).requires_grad_(True) for i, (H, D) in enumerate(zip(heads, dims))]
    loss = 0
    for r in range(P):
        for i, (x, H) in enumerate(zip(fulls, heads)):
            cut, n = local(r, H)
            y = padded(x, n)[:, :, cut]
            loss = loss + (y * _full(tuple(y.shape), 40 + 10 * r + i)).sum()
    loss.backward()
    for r in range(P):
        rows = slice(r * S // P, (r + 1) * S // P)
        for i, x in enumerate(fulls):
            assert torch.equal(out[r][i], x.grad[:, rows])


def test_alltoallv_backward_is_the_transpose(spd):
    """Rows of uneven shards through alltoallv on 3 ranks, rank 2 holding and getting
    nothing and rank 1 sending only to itself; the forward moves each row where the
    counts say, and every rank's gradient equals single-process autograd of the same
    gathering of rows."""
    P, D = 3, 4
    C = [[2, 1, 0], [0, 3, 0], [0, 0, 0]]          # C[i][j]: rows rank i sends rank j

    def rows_of(i):
        return sum(C[i])

    def rank_fn(h, world, rank, size):
        x = _full((rows_of(rank), D), 50 + rank).requires_grad_(True)
        send = [C[rank][j] for j in range(P)]
        recv = [C[i][rank] for i in range(P)]
        y = spt.alltoallv(h, world, x, send, recv)
        w = _full(tuple(y.shape), 60 + rank)
        (y * w).sum().backward()
        return y.detach().clone(), x.grad.clone()

    out = run_ranks(P, rank_fn)
    xs = [_full((rows_of(i), D), 50 + i).requires_grad_(True) for i in range(P)]
    loss = 0
    for j in range(P):
        y = torch.cat([xs[i][sum(C[i][:j]):sum(C[i][:j + 1])] for i in range(P)])
        assert torch.equal(out[j][0], y.detach())
        loss = loss + (y * _full(tuple(y.shape), 60 + j)).sum()
    loss.backward()
    for i in range(P):
        assert torch.equal(out[i][1], xs[i].grad)


def test_ulysses_kinds_per_tensor(spd):
    """GatedDeltaNet on 4 ranks: q and k (2 heads) as key/value-like tensors,
    replicated to the 2 ranks whose v heads use them; v, beta and the gate (4
    heads) split one per rank. Rank p holds k head p // 2 beside v head p; the
    gradients of the replicas are summed, as single-process autograd sums them."""
    S, P = 8, 4
    heads, dims = (2, 2, 4, 4, 4), (3, 3, 5, 1, 1)
    kinds = (spclient.HEADS_KV, spclient.HEADS_KV, spclient.HEADS_Q, spclient.HEADS_Q, spclient.HEADS_Q)

    def held(p, H):                                  # the head rank p holds of a tensor of H heads
        return slice(p * H // P, p * H // P + 1)

    def rank_fn(h, world, rank, size):
        rows = slice(rank * S // P, (rank + 1) * S // P)
        xs = [_full((1, S, H, D), 90 + i)[:, rows].clone().requires_grad_(True)
              for i, (H, D) in enumerate(zip(heads, dims))]
        ys = spt.seq_to_head(h, world, S, heads, *xs, kinds=kinds)
        for i, (y, H) in enumerate(zip(ys, heads)):
            assert torch.equal(y, _full((1, S, H, dims[i]), 90 + i)[:, :, held(rank, H)])
        sum((y * _full(tuple(y.shape), 100 + 10 * rank + i)).sum() for i, y in enumerate(ys)).backward()
        return [x.grad.clone() for x in xs]

    out = run_ranks(P, rank_fn)
    fulls = [_full((1, S, H, D), 90 + i).requires_grad_(True) for i, (H, D) in enumerate(zip(heads, dims))]
    loss = 0
    for p in range(P):
        for i, (x, H) in enumerate(zip(fulls, heads)):
            y = x[:, :, held(p, H)]
            loss = loss + (y * _full(tuple(y.shape), 100 + 10 * p + i)).sum()
    loss.backward()
    for p in range(P):
        rows = slice(p * S // P, (p + 1) * S // P)
        for i, x in enumerate(fulls):
            assert torch.equal(out[p][i], x.grad[:, rows]), f"rank {p} tensor {i}"
