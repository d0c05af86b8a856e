"""spclient.compat.yunchang against yunchang's semantics.

Model code written against yunchang's UlyssesAttention, LongContextAttention
and set_seq_parallel_pg runs in real rank processes on spd's path and on the
reference's (compat_reference.py: yunchang's groups, all-to-all and ring
attention over gloo), on pieces cut as yunchang's extract_local cuts them.
Outputs and the gradients of q, k and v must agree in fp64, and both must
match one process's causal attention of the whole sequence. As in
test_compat_deepspeed.py, the reference runs what it cannot take as it is
with the usual workaround (key/value heads repeated, zero heads added), and
where pieces differ in length the single process is the reference.
"""
import functools
import types

import pytest
import torch
import torch.distributed as dist

import spclient
import spclient.compat.yunchang as spd_yunchang
from compat_reference import (RefLongContextAttention, RefUlyssesAttention, causal_attention, heads_for, init_gloo,
                              inputs, max_diff, ref_set_seq_parallel_pg, ring_positions)
from conftest import run_ranks

TOL = 1e-10
B, D, SCALE = 2, 4, 0.3

REFERENCE = types.SimpleNamespace(UlyssesAttention=RefUlyssesAttention, LongContextAttention=RefLongContextAttention,
                                  set_seq_parallel_pg=ref_set_seq_parallel_pg)


def model(api, kind, ring_impl, U, R, rank, world_size, q, k, v):
    """Model code against yunchang's API; api is the module it imports."""
    if kind == "ulysses":
        attn = api.UlyssesAttention()
    else:
        api.set_seq_parallel_pg(U, R, rank, world_size)
        attn = api.LongContextAttention(ring_impl_type=ring_impl)
    return attn(q, k, v, softmax_scale=SCALE, causal=True)


def _positions(kind, ring_impl, U, R, rank, S, lengths):
    """The global positions of rank's piece, as yunchang's extract_local cuts
    it (UlyssesAttention: contiguous pieces of the given lengths)."""
    if kind == "ulysses":
        start = sum(lengths[:rank])
        return torch.arange(start, start + lengths[rank])
    L = S // R
    return ring_positions(ring_impl, L, R, rank // U).chunk(U)[rank % U]


def _rank(h, world, rank, n, path, case, device="cpu", dtype=torch.float64):
    """One rank: as test_compat_deepspeed._rank."""
    kind, U, R, H, Hk, S, ring_impl, lengths, route = case
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
    init_gloo(path, rank, n)
    q, k, v, w = inputs(23, B, S, H, Hk, D)
    pos = _positions(kind, ring_impl, U, R, rank, S, lengths)

    def run(api, workaround, device="cpu", dtype=torch.float64):
        leaves = [x[:, pos].to(device, dtype).requires_grad_() for x in (q, k, v)]
        xs = [heads_for(x, H, U) for x in leaves] if workaround else leaves
        out = model(api, kind, ring_impl, U, R, rank, n, *xs)[:, :, :H]
        (out * w[:, pos].to(device, dtype)).sum().backward()
        return [t.to("cpu", torch.float64) for t in [out.detach()] + [x.grad for x in leaves]]

    full = [x.clone().requires_grad_() for x in (q, k, v)]
    out_full = causal_attention(*full, SCALE)
    (out_full * w).sum().backward()
    expected = [out_full.detach()[:, pos]] + [x.grad[:, pos] for x in full]
    api = spd_yunchang
    if route == "handle":
        api = types.SimpleNamespace(UlyssesAttention=spd_yunchang.UlyssesAttention,
                                    LongContextAttention=spd_yunchang.LongContextAttention,
                                    set_seq_parallel_pg=functools.partial(spd_yunchang.set_seq_parallel_pg, handle=h))
    got = run(api, False, device, dtype)
    diffs = {"spd vs one process": max(max_diff(a, b) for a, b in zip(got, expected))}
    if len(set(lengths)) == 1 and device == "cpu":
        ref = run(REFERENCE, workaround=H % U != 0 or Hk % U != 0)
        diffs["spd vs yunchang's"] = max(max_diff(a, b) for a, b in zip(got, ref))
        diffs["yunchang's vs one process"] = max(max_diff(a, b) for a, b in zip(ref, expected))
    dist.destroy_process_group()
    return diffs


CASES = {
    # name: (module, ulysses, ring, heads, kv_heads, S, ring_impl_type, lengths, route)
    "ulysses_gqa": ("ulysses", 2, 1, 4, 2, 8, None, [4, 4], "torch"),
    "ulysses_heads_not_divisible": ("ulysses", 2, 1, 3, 3, 8, None, [4, 4], "torch"),
    "ulysses_gqa_below_sp": ("ulysses", 4, 1, 4, 1, 8, None, [2, 2, 2, 2], "torch"),
    "ulysses_uneven": ("ulysses", 2, 1, 4, 2, 7, None, [4, 3], "torch"),
    "long_basic": ("long", 2, 2, 4, 2, 16, "basic", [4] * 4, "torch"),
    "long_zigzag_gqa_below_sp_heads_not_divisible": ("long", 2, 2, 3, 1, 16, "zigzag", [4] * 4, "torch"),
    "long_ring_only": ("long", 1, 2, 2, 2, 8, "zigzag", [4] * 2, "torch"),
    "long_ulysses_only": ("long", 2, 1, 4, 4, 8, "basic", [4] * 2, "torch"),
    "long_handle": ("long", 2, 2, 4, 2, 16, "zigzag", [4] * 4, "handle"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_yunchang(spd, tmp_path, name):
    case = CASES[name]
    for rank, diffs in enumerate(run_ranks(len(case[7]), _rank, str(tmp_path / "gloo"), case, timeout=120)):
        for what, diff in diffs.items():
            assert diff <= TOL, f"rank {rank}: {what} differ by {diff:.3g} (fp64, {name})"


def _refusals(h, world, rank, n):
    m = h.mesh(n, heads=n, ulysses=n)
    attn = spd_yunchang.UlyssesAttention(spclient.compat.ProcessGroup(h, m.ulysses_group))
    q = torch.zeros(1, 4, 2, 4, dtype=torch.float64)
    why = []
    for kwargs in ({}, {"causal": True, "dropout_p": 0.1}, {"causal": True, "window_size": (8, 0)}):
        try:
            attn(q, q, q, **kwargs)
            why.append(None)
        except ValueError as e:
            why.append(str(e))
    for kwargs in ({"rank": rank, "use_ulysses_low": False}, {"rank": n - 1 - rank}):
        try:
            spd_yunchang.set_seq_parallel_pg(n, 1, world_size=n, handle=h, **kwargs)
            why.append(None)
        except ValueError as e:
            why.append(str(e))
    return why


def test_what_spd_does_not_compute_is_refused(spd):
    """causal=False (yunchang's default), dropout and windows are refused with
    the reason, as are groups laid out Ulysses outermost and ranks that spd's
    mesh placed elsewhere than yunchang's layout puts them (here: ranks given
    in reverse), on every rank, not run as something else."""
    for rank, why in enumerate(run_ranks(2, _refusals)):
        assert why[0] is not None and "causal=False" in why[0], f"rank {rank}: {why[0]!r}"
        assert why[1] is not None and "dropout_p=0.1" in why[1], f"rank {rank}: {why[1]!r}"
        assert why[2] is not None and "window_size=(8, 0)" in why[2], f"rank {rank}: {why[2]!r}"
        assert why[3] is not None and "use_ulysses_low=False" in why[3], f"rank {rank}: {why[3]!r}"
        assert why[4] is not None and "spd's mesh" in why[4], f"rank {rank}: {why[4]!r}"


@pytest.mark.parametrize("ring_impl,U,R", [("basic", 2, 2), ("zigzag", 2, 2), ("zigzag", 1, 4), ("zigzag", 4, 1)])
def test_extract_local_cuts_as_yunchang(ring_impl, U, R):
    """EXTRACT_FUNC_DICT's pieces are the tokens yunchang's extract_local gives
    each rank (the positions the tests above feed)."""
    x = torch.randn(2, 16, 3, 4, dtype=torch.float64)
    for rank in range(U * R):
        got = spd_yunchang.EXTRACT_FUNC_DICT[ring_impl](x, rank, U * R, rd=R, ud=U)
        want = x[:, _positions("long", ring_impl, U, R, rank, 16, None)]
        assert torch.equal(got, want), f"{ring_impl} rank {rank} of ulysses {U} x ring {R}"
