"""spd SIGKILLed and started again under a PyTorch loop on CUDA tensors in
stream order: 2 ranks on cuda:0 all-reduce each step's tensor into a new one
on the current stream (the call returns at once), a torch kernel on the result
follows on that stream, and torch's own .cpu() waits for it in the CUDA driver,
never entering the library: when spd goes, only libspclient's stream watcher
can hand the ranks to the next spd. Every step's result is checked against
the sum computed here from every rank's input; each rank is taken over once
(h.resume_info(), h.daemon_pid the new spd's) and the loop finishes.
Skipped, with the reason, where torch sees no GPU."""
import os
import select

import pytest
import torch

import spclient
from conftest import run_ranks
from test_cuda import DEV      # its import skips this module too where torch sees no GPU
from test_restart import Restartable

P, N = 2, 1 << 16
KILL_AT = 5            # rank 0 says it reached this step; spd is killed then
AFTER_RESUME = 10      # steps run once every rank was taken over
MAX_STEPS = 3000


@pytest.fixture
def restartable():
    spd = Restartable()
    yield spd
    spd.close()


def step_input(rank, k):
    """Rank `rank`'s tensor at step k: small integers, whose fp32 sums are exact."""
    return ((torch.arange(N, dtype=torch.int64) * 7 + rank * 1000 + k * 13) % 4093).to(torch.float32)


def trainer(h, world, rank, n, say_fd):
    assert h.gpu_status()["mode"] == "stream", h.gpu_status()
    pid0 = h.daemon_pid
    k, resumed_at = 0, None
    flag = torch.zeros(1, device=DEV)
    while True:
        y = h.allreduce(world, step_input(rank, k).to(DEV), torch.empty(N, device=DEV))
        got = (y * 2).cpu()            # the kernel after the op, and torch's wait in the driver
        want = sum(step_input(r, k) for r in range(n)) * 2
        assert torch.equal(got, want), f"step {k}: max diff {(got - want).abs().max()}"
        if rank == 0 and k == KILL_AT:
            os.write(say_fd, b"k")
        # The ranks leave together: once each was taken over, and some steps on.
        flag.fill_(h.resume_info().resumes)
        every = h.allreduce(world, flag, torch.empty_like(flag)).cpu()
        if every[0] >= n and resumed_at is None:
            resumed_at = k
        k += 1
        if resumed_at is not None and k > resumed_at + AFTER_RESUME:
            break
        assert k < MAX_STEPS, f"spd was not started again within {MAX_STEPS} steps"
    return {"steps": k, "info": h.resume_info(), "pids": (pid0, h.daemon_pid)}


def test_stream_ordered_loop_rides_through_spd_killed(restartable):
    with spclient.attach(socket=restartable.sock) as h:
        st = h.query("status")[0]
    if st.get("gpu_status") == "built without CUDA":
        pytest.skip("spd was built without CUDA: it cannot import GPU memory")
    rd, wr = os.pipe()
    old_pid = restartable.proc.pid

    def kill_when_told():
        os.close(wr)
        # Nothing comes when the ranks failed before: run_ranks reports why.
        if select.select([rd], [], [], 60)[0] and os.read(rd, 1) == b"k":
            restartable.kill_and_start()

    try:
        out = run_ranks(P, trainer, wr, attach={"socket": restartable.sock}, timeout=120, meanwhile=kill_when_told)
    finally:
        os.close(rd)
    for r, o in enumerate(out):
        assert o["info"].resumes == 1, f"rank {r}: {o['info']}"
        assert o["pids"] == (old_pid, restartable.proc.pid), f"rank {r}: served by {o['pids']}"
        assert o["steps"] > KILL_AT + AFTER_RESUME
