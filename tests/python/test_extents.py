"""Buffers of the wrong shape for an op are refused before anything is submitted.

7 heads on 4 ranks: each rank holds ceil(7/4) = 2 heads (rank 3 one real and one
dummy), so a receive shaped for 7 // 4 = 1 head is a ValueError naming the shape
the op needs; so is a send of 7 // 4 = 1 row where the padded sequence gives each
rank ceil(7/4) = 2. Nothing reached spd: the same ranks then run the op with the
right shapes and get the right heads.
"""
import pytest
import torch

import spclient
from conftest import run_ranks

D = 4


def test_alltoall_shapes_checked(spd):
    S, H = 8, 7

    def rank_fn(h, world, rank, size):
        s_loc, local = S // size, h.local_heads(H, spclient.HEADS_Q, 0, size)
        assert (s_loc, local) == (2, 2)
        full = torch.arange(S * H * D, dtype=torch.float32).reshape(1, S, H, D)
        x = h.empty((1, s_loc, H, D), torch.float32)
        x.copy_(full[:, rank * s_loc:(rank + 1) * s_loc])
        short = h.zeros((1, S, H // size, D), torch.float32)      # 7 // 4 = 1 head
        guard = h.zeros((64,), torch.float32)                      # the allocation right after it
        with pytest.raises(ValueError) as e:
            h.alltoall(world, [(x, short, H, spclient.HEADS_Q)], spclient.SEQ_TO_HEAD, S)
        assert "recv has shape (1, 8, 1, 4); the op needs (1, 8, 2, 4)" in str(e.value)
        assert "2 local heads of 7, dummies included" in str(e.value)

        y = h.empty((1, S, local, D), torch.float32)
        h.alltoall(world, [(x, y, H, spclient.HEADS_Q)], spclient.SEQ_TO_HEAD, S)
        want = torch.zeros(1, S, local, D)
        real = max(0, min(local, H - rank * local))
        want[:, :, :real] = full[:, :, rank * local:rank * local + real]
        assert torch.equal(y, want)
        assert not short.any() and not guard.any()
        return True

    assert run_ranks(4, rank_fn) == [True] * 4


def test_padded_sequence_checked(spd):
    S, H = 7, 8

    def rank_fn(h, world, rank, size):
        x = h.zeros((1, S // size, H, D), torch.float32)           # 7 // 4 = 1 row
        y = h.zeros((1, S, H // size, D), torch.float32)
        with pytest.raises(ValueError) as e:
            h.alltoall(world, [(x, y, H, spclient.HEADS_Q)], spclient.SEQ_TO_HEAD, S)
        assert "send has shape (1, 1, 8, 4); the op needs (1, 2, 8, 4)" in str(e.value)
        back = h.zeros((S // size, 1, H, D), torch.float32)        # seq-first, one row short
        with pytest.raises(ValueError) as e:
            h.alltoall(world, [(y, back, H, spclient.HEADS_Q)], spclient.HEAD_TO_SEQ, S, layout=spclient.SBHD)
        assert "send has shape (1, 7, 2, 4); the op needs (7, 1, 2, 4)" in str(e.value)
        ys = h.zeros((S, 1, H // size, D), torch.float32)
        with pytest.raises(ValueError) as e:
            h.alltoall(world, [(ys, back, H, spclient.HEADS_Q)], spclient.HEAD_TO_SEQ, S, layout=spclient.SBHD)
        assert "recv has shape (1, 1, 8, 4); the op needs (2, 1, 8, 4)" in str(e.value)
        h.barrier(world)
        return True

    assert run_ranks(4, rank_fn) == [True] * 4


def test_allgather_receive_checked(spd):
    def rank_fn(h, world, rank, size):
        mine = h.empty(4, torch.float32)
        mine.fill_(rank)
        short = h.zeros((size * 4 - 1,), torch.float32)
        with pytest.raises(ValueError, match="recv holds 7 elements; 2 ranks of 4 need 8"):
            h.allgather(world, mine, short)
        g = h.empty(size * 4, torch.float32)
        h.allgather(world, mine, g)
        return g.tolist()

    assert run_ranks(2, rank_fn) == [[0.0] * 4 + [1.0] * 4] * 2
