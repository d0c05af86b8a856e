"""The ctypes binding against a real spd: arrays in the arena, ops, errors."""
import os

import numpy as np
import pytest
import torch

import spclient
from conftest import run_ranks


def values(rank, n, seed):
    rng = np.random.default_rng(seed * 100 + rank)
    return rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n)


def test_allreduce_rank_order_numpy(spd):
    n = 1001

    def rank_fn(h, world, rank, size):
        x = h.empty(n, "float64")
        x[:] = values(rank, n, 1)
        h.allreduce(world, x)
        return x.copy()

    out = run_ranks(3, rank_fn)
    ref = values(0, n, 1)
    for r in range(1, 3):
        ref = ref + values(r, n, 1)       # (x0 + x1) + x2, the order spd sums in
    for r in range(3):
        assert out[r].tobytes() == ref.tobytes()


def test_reduce_scatter_rank_order_numpy(spd):
    n, size = 257, 3

    def rank_fn(h, world, rank, size):
        x = h.empty(size * n, "float64")
        x[:] = values(rank, size * n, 2)
        out = h.empty(n, "float64")
        h.reduce_scatter(world, x, out)
        with pytest.raises(ValueError, match="reduce_scatter"):
            h.reduce_scatter(world, x, h.empty(n + 1, "float64"))
        return out.copy()

    out = run_ranks(size, rank_fn)
    ref = values(0, size * n, 2)
    for r in range(1, size):
        ref = ref + values(r, size * n, 2)   # (x0 + x1) + x2, the order spd sums in
    for r in range(size):
        assert out[r].tobytes() == ref[r * n:(r + 1) * n].tobytes()


def test_torch_tensors_in_the_arena(spd):
    def rank_fn(h, world, rank, size):
        x = h.empty((2, 3), torch.bfloat16)
        assert isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16
        x.fill_(rank + 1)
        h.allreduce(world, x, op="max")
        g = h.empty(size * 4, torch.int64)
        mine = h.empty(4, torch.int64)
        mine[:] = torch.arange(4) + 10 * rank
        h.allgather(world, mine, g)
        b = h.empty(5, torch.float32)
        b.fill_(rank)
        h.broadcast(world, b, root=size - 1)
        h.barrier(world)
        return x.float().tolist(), g.tolist(), b.tolist()

    out = run_ranks(2, rank_fn)
    for x, g, b in out:
        assert x == [[2.0] * 3] * 2
        assert g == [0, 1, 2, 3, 10, 11, 12, 13]
        assert b == [1.0] * 5


def test_alltoall_and_shift(spd):
    S, H, D = 6, 6, 3

    def rank_fn(h, world, rank, size):
        P = size
        s_loc = S // P
        full = torch.arange(S * H * D, dtype=torch.float32).reshape(1, S, H, D)
        x = h.empty((1, s_loc, H, D), torch.float32)
        x.copy_(full[:, rank * s_loc:(rank + 1) * s_loc])
        y = h.empty((1, S, H // P, D), torch.float32)
        h.alltoall(world, [(x, y, H, spclient.HEADS_Q)], spclient.SEQ_TO_HEAD, S)
        assert torch.equal(y, full[:, :, rank * H // P:(rank + 1) * H // P])
        back = h.empty((1, s_loc, H, D), torch.float32)
        h.alltoall(world, [(y, back, H, spclient.HEADS_Q)], spclient.HEAD_TO_SEQ, S)
        assert torch.equal(back, x)
        recv = h.empty(3, torch.float32)
        send = h.empty(3, torch.float32)
        send.fill_(rank)
        req = h.ishift(world, [(send, recv)], channel=1)
        req.wait(10000)
        return recv.tolist()

    out = run_ranks(3, rank_fn)
    assert out == [[2.0] * 3, [0.0] * 3, [1.0] * 3]


def test_errors_are_exceptions(spd):
    def rank_fn(h, world, rank, size):
        outside = np.zeros(4)                        # not in the arena, not registered
        with pytest.raises(spclient.BadRegionError) as e:
            h.allreduce(world, outside)
        assert "neither in the arena" in e.value.detail
        x = h.empty(4, "float32" if rank == 0 else "float64")
        with pytest.raises(spclient.MismatchError) as e:
            h.allreduce(world, x)
        assert "dtype" in e.value.detail and e.value.name == "SPC_ERR_MISMATCH"
        with pytest.raises(spclient.InvalidArgumentError) as e:
            h.mesh(sp=3, heads=8)                    # 3 does not divide the world of 2
        assert "does not divide" in e.value.detail
        reg = np.zeros(4)
        region = h.register(reg)                     # registered memory works
        reg[:] = rank + 1
        h.allreduce(world, reg)
        h.deregister(region)
        return reg.tolist()

    assert run_ranks(2, rank_fn) == [[3.0] * 4, [3.0] * 4]
    with pytest.raises(spclient.ConnectError):
        spclient.attach(socket="/nonexistent/spd.sock")


def test_query(spd):
    with spclient.attach() as h:
        status = h.query("status")[0]
        assert status["state"] == "running" and status["pid"] == h.daemon_pid
        assert h.query("jobs") == [] or all("id" in j for j in h.query("jobs"))


def test_arena_memory_comes_back(spd):
    """A 4 MiB arena, 1 MiB tensors made and dropped 64 times: each one's memory
    returns when its last view goes, so none of them finds the arena full."""
    with spclient.attach(arena_bytes=4 << 20) as h:
        keep = None
        for i in range(64):
            x = h.empty((1 << 18,), torch.float32)
            x.fill_(i)
            keep = x[10:20]                 # a view keeps the previous block alive
        assert keep.tolist() == [63.0] * 10
        del x, keep
        held = []
        with pytest.raises(spclient.SpdError, match="arena full"):
            while True:                                 # held blocks do fill it
                held.append(h.empty((1 << 18,), torch.float32))
        assert 1 <= len(held) <= 4
        h.free(held.pop())                              # freed at once
        held.append(h.empty((1 << 18,), torch.float32))


def test_results_outlive_close(spd):
    """Arena results read after close() are still there; ops after it raise."""
    def rank_fn(h, world, rank, size):
        x = h.empty(4, torch.float64)
        x.fill_(rank + 1)
        h.allreduce(world, x)
        h.close()
        with pytest.raises(spclient.SpdError, match="closed"):
            h.empty(4, torch.float64)
        with pytest.raises(spclient.SpdError, match="closed"):
            h.barrier(world)
        return x.tolist()                  # the arena is still mapped

    assert run_ranks(2, rank_fn) == [[3.0] * 4, [3.0] * 4]


def test_job_grants(spd):
    """A job's creator names other uids that may join it; spd shows the owner
    and takes at most SPC_JOB_MAX_ALLOW_UIDS (16) of them."""
    with spclient.attach() as h:
        job = h.job_create(allow_uids=[60001, 60002])
        world = h.join(job, 1, 0)
        h.barrier(world)
        mine = [j for j in h.query("jobs") if j["id"] == job]
        assert len(mine) == 1 and mine[0]["owner_uid"] == os.getuid()
        with pytest.raises(spclient.SpdError, match="at most 16"):
            h.job_create(allow_uids=range(17))


def test_alltoallv_refuses_counts_that_do_not_pair(spd):
    """Rank 1 expects 2 rows from rank 0, which sends it 1: both hear it, naming
    the ranks and both counts (in elements: rows of 3), and the group goes on."""
    def rank_fn(h, world, rank, size):
        x = h.empty((2, 3), torch.float32)
        x.fill_(rank)
        recv = [1, 1] if rank == 0 else [2, 1]
        y = h.empty((sum(recv), 3), torch.float32)
        with pytest.raises(spclient.MismatchError) as e:
            h.alltoallv(world, x, y, [1, 1], recv)
        assert "rank 0 sends 3 elements to rank 1, which expects 6 from it" in str(e.value)
        y = h.empty((2, 3), torch.float32)
        h.alltoallv(world, x, y, [1, 1], [1, 1])
        return y.tolist()

    out = run_ranks(2, rank_fn)
    assert out == [[[0.0] * 3, [1.0] * 3]] * 2
