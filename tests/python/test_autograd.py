"""Backward semantics of spclient.torch, against single-process autograd."""
import torch

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
        total = h.allreduce(world, spt._arena_copy(h, y.detach().reshape(1)))   # no autograd
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
