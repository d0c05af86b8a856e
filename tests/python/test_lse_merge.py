"""spclient.torch.lse_merge on CPU tensors against the merge written with torch
in float64 from its definition (logaddexp of the lses, each out weighed by
exp(its lse - the new one)): both layouts, rows where one side or both saw no key
(-inf, their out holding NaN), the merge in place, and what it refuses. The
CUDA cases are in test_cuda.py. No daemon: the merge needs none."""
import pytest
import torch

import spclient
import spclient.torch as spt


def _sides(B, S, H, D, layout=spclient.BSHD, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (B, S, H, D) if layout == spclient.BSHD else (S, B, H, D)
    out_a, out_b = (torch.randn(shape, generator=g) for _ in range(2))
    lse_a, lse_b = (torch.rand(B, H, S, generator=g) * 20 - 10 for _ in range(2))
    pick = torch.rand(B, H, S, generator=g)
    lse_a[pick < 0.1] = -torch.inf
    lse_b[(pick >= 0.1) & (pick < 0.2)] = -torch.inf
    lse_a[(pick >= 0.2) & (pick < 0.25)] = -torch.inf
    lse_b[(pick >= 0.2) & (pick < 0.25)] = -torch.inf
    lse_b[(pick >= 0.25) & (pick < 0.3)] = lse_a[(pick >= 0.25) & (pick < 0.3)] - 300
    # What a side that saw no key holds in its out must not matter.
    for out, lse in ((out_a, lse_a), (out_b, lse_b)):
        rows = (lse == -torch.inf).transpose(1, 2)            # [B, S, H]
        if layout != spclient.BSHD:
            rows = rows.transpose(0, 1)
        out[rows] = torch.nan
    return out_a, lse_a, out_b, lse_b


def _reference(out_a, lse_a, out_b, lse_b, layout=spclient.BSHD):
    """The definition in float64: a side with lse -inf weighs 0."""
    la, lb = lse_a.double(), lse_b.double()
    new = torch.logaddexp(la, lb)
    finite = torch.isfinite(new)
    safe = torch.where(finite, new, torch.zeros_like(new))

    def weighed(out, lse):
        w = torch.where(torch.isfinite(lse), torch.exp(lse - safe), torch.zeros_like(lse))   # [B, H, S]
        w = w.transpose(1, 2)[..., None]                                                      # [B, S, H, 1]
        if layout != spclient.BSHD:
            w = w.transpose(0, 1)
        return torch.where(w != 0, out.double() * w, torch.zeros_like(w))

    return weighed(out_a, la) + weighed(out_b, lb), new


def _close(got, want, what):
    got = got.double()
    both_inf = torch.isinf(got) & torch.isinf(want) & (got == want)
    err = torch.where(both_inf, torch.zeros_like(got), (got - want).abs())
    tol = 4e-7 * want.abs().clamp(min=1)
    assert not torch.isnan(got).any(), f"{what}: NaN"
    assert (err <= tol).all(), f"{what}: off by {err.max().item():.3g}"


@pytest.mark.parametrize("layout", [spclient.BSHD, spclient.SBHD], ids=["BSHD", "SBHD"])
@pytest.mark.parametrize("shape", [(2, 9, 3, 8), (1, 33, 4, 64), (3, 5, 2, 7)])
def test_against_torch(layout, shape):
    out_a, lse_a, out_b, lse_b = _sides(*shape, layout=layout)
    want_out, want_lse = _reference(out_a, lse_a, out_b, lse_b, layout)
    out, lse = out_a.clone(), lse_a.clone()
    got_out, got_lse = spt.lse_merge(out, lse, out_b, lse_b, layout=layout)
    assert got_out is out and got_lse is lse, "merges in place and returns its first two"
    _close(got_lse, want_lse, "lse")
    # out's scale: each side's |out| weighed.
    _close(got_out, want_out, "out")


def test_no_key_rows_exact():
    """A side that saw no key hands the other through bit for bit; neither gives
    lse -inf and out 0."""
    out_a = torch.tensor([[[[1.5, -3.25]], [[2.0, 4.0]]]])        # [1, 2, 1, 2]
    out_b = torch.tensor([[[[torch.nan, 7.0]], [[torch.nan, torch.nan]]]])
    lse_a = torch.tensor([[[0.75, -torch.inf]]])                  # [1, 1, 2]
    lse_b = torch.tensor([[[-torch.inf, -torch.inf]]])
    out, lse = spt.lse_merge(out_a.clone(), lse_a.clone(), out_b, lse_b)
    assert torch.equal(out[0, 0], out_a[0, 0]) and lse[0, 0, 0] == 0.75
    assert torch.equal(out[0, 1], torch.zeros(1, 2)) and lse[0, 0, 1] == -torch.inf


def test_ring_of_blocks():
    """Blocks merged one by one, as a ring does, give the softmax attention of
    all the keys (computed here in float64)."""
    g = torch.Generator().manual_seed(3)
    B, S, H, D, blocks, Sk = 2, 6, 2, 4, 4, 5
    q = torch.randn(B, S, H, D, generator=g, dtype=torch.float64)
    ks = [torch.randn(B, Sk, H, D, generator=g, dtype=torch.float64) for _ in range(blocks)]
    vs = [torch.randn(B, Sk, H, D, generator=g, dtype=torch.float64) for _ in range(blocks)]
    out = lse = None
    for k, v in zip(ks, vs):
        s = torch.einsum("bqhd,bkhd->bhqk", q, k)
        o_b = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), v).float().contiguous()
        l_b = torch.logsumexp(s, -1).float().contiguous()
        if out is None:
            out, lse = o_b, l_b
        else:
            spt.lse_merge(out, lse, o_b, l_b)
    s = torch.einsum("bqhd,bkhd->bhqk", q, torch.cat(ks, 1))
    want = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(s, -1), torch.cat(vs, 1))
    assert (out.double() - want).abs().max() < 1e-5
    assert (lse.double() - torch.logsumexp(s, -1)).abs().max() < 1e-5


def test_refusals():
    out_a, lse_a, out_b, lse_b = _sides(1, 4, 2, 8)
    with pytest.raises(TypeError):
        spt.lse_merge(out_a.double(), lse_a, out_b, lse_b)
    with pytest.raises(ValueError, match="contiguous"):
        spt.lse_merge(out_a.transpose(1, 2), lse_a, out_b.transpose(1, 2), lse_b)
    with pytest.raises(ValueError, match=r"\[B, H, S\]"):
        spt.lse_merge(out_a, lse_a[:, :, :3].contiguous(), out_b, lse_b)
    with pytest.raises(RuntimeError, match="no backward"):
        spt.lse_merge(out_a.requires_grad_(), lse_a, out_b, lse_b)
    with torch.no_grad():
        spt.lse_merge(out_a, lse_a, out_b, lse_b)
