"""Losses over ranks and the batch helpers of spclient.torch."""
import torch

import spclient.torch as spt
from conftest import run_ranks


def test_dpo_and_token_mean(spd):
    """Per-sequence log-probs split over 2 ranks by tokens (rank 0 has no response
    token of pair 1): loss and gradients equal single-process DPO."""
    tok = torch.tensor([[-1.0, -2.0, -0.5, -0.25], [-3.0, -1.5, -0.75, -2.0]], dtype=torch.float64)  # [pair, token]

    def rank_fn(h, world, rank, size):
        mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]] if rank == 0 else [[0, 0, 1, 1], [1, 1, 1, 1]],
                            dtype=torch.float64)
        lp = (tok * mask).clone().requires_grad_(True)
        part = lp.sum(1)                                   # this rank's part of each sequence's sum
        loss = spt.dpo_loss(h, world, part, part * 0.5, part * 0.9, part * 0.4, beta=0.5)
        loss.backward()
        n = mask.sum()
        mean = spt.token_mean_loss(h, world, (-(tok * mask)).sum(), n)
        return loss.item(), lp.grad.clone(), mean.item()

    out = run_ranks(2, rank_fn)
    full = tok.clone().requires_grad_(True)
    s = full.sum(1)
    ref = -torch.nn.functional.logsigmoid(0.5 * ((s - 0.9 * s) - (0.5 * s - 0.4 * s))).mean()
    ref.backward()
    for loss, grad, mean in out:
        assert abs(loss - ref.item()) < 1e-12
        assert abs(mean - (-tok).sum().item() / tok.numel()) < 1e-12
    masks = [torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]]), torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])]
    summed = out[0][1] * masks[0] + out[1][1] * masks[1]
    assert torch.allclose(summed, full.grad * (masks[0] + masks[1]), rtol=0, atol=1e-12)


def test_zigzag_and_cu_seqlens():
    P = 3
    x = torch.arange(2 * 14).reshape(2, 14)
    xp = spt.pad_to_multiple(x, 2 * P, dim=1, value=-1)
    assert xp.shape == (2, 18) and (xp[:, 14:] == -1).all()
    shards = [spt.zigzag_split(xp, P, r) for r in range(P)]
    c = 18 // (2 * P)
    for r in range(P):                                    # chunks r and 2P-1-r, by index
        want = list(range(r * c, (r + 1) * c)) + list(range((2 * P - 1 - r) * c, (2 * P - r) * c))
        assert shards[r].tolist() == xp[:, want].tolist()
    assert torch.equal(spt.zigzag_merge(shards), xp)

    pos = torch.tensor([0, 1, 2, 0, 1, 0, 5, 6, 7, 8])       # documents 3, 2, 1 (0), 4 (jump to 5)
    cu, longest = spt.cu_seqlens(pos)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 5, 6, 10] and longest == 4
    cu, longest = spt.cu_seqlens(torch.tensor([7, 8, 9]))   # a shard that starts mid-document
    assert cu.tolist() == [0, 3] and longest == 3


def test_c_helpers_match_the_torch_path():
    """Host tensors go through libspclient's helpers, tracked (and GPU) tensors
    through torch: the same shards, the same merge, the same offsets."""
    P = 2
    for shape, dim in (((3, 8, 2, 5), 1), ((8, 3, 4), 0), ((2, 3, 12), -1)):
        x = torch.randn(shape, dtype=torch.float64)
        tracked = x.clone().requires_grad_(True)
        shards = [spt.zigzag_split(x, P, r, dim=dim) for r in range(P)]
        for r in range(P):
            assert torch.equal(shards[r], spt.zigzag_split(tracked, P, r, dim=dim).detach())
        assert torch.equal(spt.zigzag_merge(shards, dim=dim), x)
    S = 24
    for r in range(3):
        by_torch = spt.zigzag_split(torch.arange(S, dtype=torch.float64).requires_grad_(True), 3, r, dim=0)
        assert spt.zigzag_positions(S, 3, r).tolist() == by_torch.long().tolist()
    pos = torch.tensor([[3, 4, 0, 1, 2, 0, 0, 7]], dtype=torch.int32)
    cu, longest = spt.cu_seqlens(pos)
    assert cu.tolist() == [0, 2, 5, 6, 7, 8] and longest == 3
