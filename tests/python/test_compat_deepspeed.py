"""spclient.compat.deepspeed.DistributedAttention against DeepSpeed's semantics.

The same model code (a DistributedAttention around a user's local attention,
constructed with DeepSpeed's signature) runs in real rank processes on two
paths: spd's, and the reference (compat_reference.py: DeepSpeed's all-to-all
over gloo). Outputs and the gradients of q, k and v must agree in fp64, and
both must match one process's attention of the whole sequence. Where DeepSpeed
cannot run the model as it is (heads the group does not divide, fewer
key/value heads than ranks) its path runs the model with the usual workaround
(key/value heads repeated, zero heads added); spd's runs it unchanged. Where
the pieces differ in length DeepSpeed has no path, and the single process is
the reference.
"""
import pytest
import torch
import torch.distributed as dist

import spclient
import spclient.compat
from compat_reference import RefDistributedAttention, heads_for, init_gloo, inputs, local_attention, max_diff
from conftest import run_ranks
from spclient.compat.deepspeed import DistributedAttention

TOL = 1e-10
B, D, SCALE = 2, 4, 0.3


class Model(torch.nn.Module):
    """Model code written against DeepSpeed's DistributedAttention: only the
    class it is given differs between the paths."""

    def __init__(self, attention_class, group, gather_idx):
        super().__init__()
        self.seq_first = gather_idx == 0
        self.attn = attention_class(local_attention, group, scatter_idx=2, gather_idx=gather_idx)

    def forward(self, q, k, v):
        return self.attn(q, k, v, scale=SCALE, seq_first=self.seq_first)


def _expected(q, k, v, w):
    """One process: the output and the q, k, v gradients of the whole sequence."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out = local_attention(*leaves, scale=SCALE)
    (out * w).sum().backward()
    return out.detach(), [x.grad for x in leaves]


def _rank(h, world, rank, n, path, case, device="cpu", dtype=torch.float64):
    """One rank: the differences between spd's path, the reference's (on the
    host, where gloo runs) and one process. device "cuda": spd's path on this
    rank's GPU, in dtype, against the host's fp64."""
    H, Hk, S, gather, lengths, groups, route = case
    if device == "cuda":
        device = f"cuda:{rank % torch.cuda.device_count()}"
    init_gloo(path, rank, n)
    group_ranks = next(g for g in groups if rank in g)
    tgroups = [dist.new_group(g) for g in groups]          # every rank makes every group, as torch asks
    tgroup = tgroups[groups.index(group_ranks)]
    P, me = len(group_ranks), group_ranks.index(rank)
    q, k, v, w = inputs(11 + groups.index(group_ranks), B, S, H, Hk, D)
    start, count = sum(lengths[:me]), lengths[me]

    def piece(x):
        x = x[:, start:start + count]
        return (x.transpose(0, 1) if gather == 0 else x).contiguous()

    def run(attention_class, group, workaround, device="cpu", dtype=torch.float64):
        leaves = [piece(x).to(device, dtype).requires_grad_() for x in (q, k, v)]
        xs = [heads_for(x, H, P) for x in leaves] if workaround else leaves
        out = Model(attention_class, group, gather)(*xs)[:, :, :H]
        (out * piece(w).to(device, dtype)).sum().backward()
        return [t.to("cpu", torch.float64) for t in [out.detach()] + [x.grad for x in leaves]]

    out_e, grads_e = _expected(q, k, v, w)
    expected = [piece(out_e)] + [piece(g) for g in grads_e]
    if route == "spd":
        group = spclient.compat.ProcessGroup(h, h.mesh(n, heads=n, ulysses=n).ulysses_group)
    else:
        group = tgroup
    got = run(DistributedAttention, group, False, device, dtype)
    diffs = {"spd vs one process": max(max_diff(a, b) for a, b in zip(got, expected))}
    if len(set(lengths)) == 1 and device == "cpu":
        ref = run(RefDistributedAttention, tgroup, workaround=H % P != 0 or Hk % P != 0)
        diffs["spd vs DeepSpeed's"] = max(max_diff(a, b) for a, b in zip(got, ref))
        diffs["DeepSpeed's vs one process"] = max(max_diff(a, b) for a, b in zip(ref, expected))
    dist.destroy_process_group()
    return diffs


CASES = {
    # name: (heads, kv_heads, S, gather_idx, lengths, groups, route)
    "mha_sbhd": (4, 4, 8, 0, [4, 4], [[0, 1]], "torch"),
    "gqa_bshd": (4, 2, 8, 1, [4, 4], [[0, 1]], "torch"),
    "heads_not_divisible": (3, 3, 8, 0, [4, 4], [[0, 1]], "torch"),
    "gqa_below_sp": (4, 1, 8, 1, [2, 2, 2, 2], [[0, 1, 2, 3]], "torch"),
    "gqa_below_sp_heads_not_divisible": (6, 2, 8, 0, [2, 2, 2, 2], [[0, 1, 2, 3]], "torch"),
    "two_groups": (4, 2, 8, 1, [4, 4], [[0, 1], [2, 3]], "torch"),
    "uneven_spd_split": (4, 2, 7, 1, [4, 3], [[0, 1]], "torch"),
    "uneven_any_split": (3, 3, 6, 0, [2, 2, 1, 1], [[0, 1, 2, 3]], "torch"),
    "spd_group": (3, 1, 8, 1, [4, 4], [[0, 1]], "spd"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_distributed_attention(spd, tmp_path, name):
    case = CASES[name]
    world = sum(len(g) for g in case[5])
    for rank, diffs in enumerate(run_ranks(world, _rank, str(tmp_path / "gloo"), case, timeout=120)):
        for what, diff in diffs.items():
            assert diff <= TOL, f"rank {rank}: {what} differ by {diff:.3g} (fp64, {name})"


def _misplaced_rank(h, world, rank, n, path):
    init_gloo(path, rank, n)
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    try:
        DistributedAttention(local_attention, groups[rank % 2])
    except ValueError as e:
        return str(e)
    finally:
        dist.destroy_process_group()
    return None


def test_group_spd_did_not_place_is_refused_on_every_rank(spd, tmp_path):
    """Torch groups of ranks {0, 2} and {1, 3}: spd's Ulysses groups of two are
    {0, 1} and {2, 3}, so every rank refuses, none runs on the wrong tokens."""
    for rank, why in enumerate(run_ranks(4, _misplaced_rank, str(tmp_path / "gloo"), timeout=60)):
        assert why is not None and "torch group holds" in why, f"rank {rank}: {why!r}"
