"""A PyTorch training loop through spclient rides through spd being SIGKILLed
and started again on its socket: 4 ranks run Ulysses seq->head and head->seq,
a ring shift and the loss all-reduce (spclient.torch, with autograd backward)
every step, each forward result and gradient checked against a reference each
rank computes from the whole step's data with plain torch; the new spd takes
every rank over (h.resume_info()) and the loop finishes. An all-reduce in place
each step is right, or, the one the kill caught if any, raises RestartedError
("not retried (in place)")."""
import os
import select
import shutil
import signal
import tempfile

import pytest
import torch

import spclient
import spclient.torch as spt
from conftest import run_ranks, spd_start

P, B, S, H, D = 4, 2, 16, 8, 4
KILL_AT = 5            # rank 0 says it reached this step; spd is killed then
AFTER_RESUME = 10      # steps run once every rank was taken over
MAX_STEPS = 3000


class Restartable:
    """spd on a socket in a private directory, which a test kills and starts again."""

    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="spd-py-restart-")
        self.sock = os.path.join(self.dir, "run", "spd.sock")
        self.starts = 0
        self.proc = self._start()

    def _start(self):
        self.starts += 1
        return spd_start(self.sock, os.path.join(self.dir, f"spd{self.starts}.log"))

    def kill_and_start(self):
        self.proc.send_signal(signal.SIGKILL)
        assert self.proc.wait(timeout=10) == -signal.SIGKILL
        self.proc = self._start()

    def close(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            assert self.proc.wait(timeout=15) == 0, "spd did not exit cleanly on SIGTERM"
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def restartable():
    spd = Restartable()
    yield spd
    spd.close()


def step_data(k):
    """Step k's whole activations X and weights W, [B, S, H, D], the same on every rank."""
    g = torch.Generator().manual_seed(1000 + k)
    return (torch.randn(B, S, H, D, generator=g, dtype=torch.float64),
            torch.randn(B, S, H, D, generator=g, dtype=torch.float64))


def seq_part(x, r):
    return x[:, r * S // P:(r + 1) * S // P]


def head_part(x, r):
    return x[:, :, r * H // P:(r + 1) * H // P]


def train_step(h, world, rank, k):
    """One step's ops, each result checked; whether its in-place all-reduce
    failed with RestartedError (the one op spd does not run twice)."""
    X, W = step_data(k)
    x = seq_part(X, rank).clone().requires_grad_()
    y, = spt.seq_to_head(h, world, S, [H], x)
    assert torch.equal(y, head_part(X, rank)), f"step {k}: seq_to_head"
    z = y * head_part(W, rank)
    back, = spt.head_to_seq(h, world, S, [H], z)
    XW = X * W
    assert torch.equal(back, seq_part(XW, rank)), f"step {k}: head_to_seq"
    s, = spt.shift(h, world, back)
    assert torch.equal(s, seq_part(XW, (rank - 1) % P)), f"step {k}: shift"
    loss = spt.all_reduce(h, world, (s * s).sum().reshape(1))[0]
    want = torch.zeros((), dtype=torch.float64)
    for r in range(P):                      # spd sums in rank order
        want = want + (seq_part(XW, (r - 1) % P) ** 2).sum()
    assert torch.equal(loss.detach(), want), f"step {k}: loss {loss.item()} != {want.item()}"
    loss.backward()
    # d loss / d s = 2 s, summed over the P ranks' losses by the all-reduce's backward;
    # it goes back through the shift, head->seq and seq->head to this rank's x.
    assert torch.equal(x.grad, seq_part(XW * W, rank) * (2 * P)), f"step {k}: gradient"

    inplace = h.empty((B * H * D,), torch.float64)
    inplace.copy_(X[:, rank].reshape(-1))
    try:
        h.allreduce(world, inplace)
    except spclient.RestartedError as e:
        assert "not retried (in place)" in str(e), str(e)
        return True
    assert torch.equal(inplace, sum(X[:, r].reshape(-1) for r in range(P))), f"step {k}: all-reduce in place"
    return False


def trainer(h, world, rank, n, say_fd):
    pid0 = h.daemon_pid
    k, not_retried, resumed_at = 0, 0, None
    flag, every = h.empty((1,), torch.float64), h.empty((1,), torch.float64)
    while True:
        not_retried += train_step(h, world, rank, k)
        if rank == 0 and k == KILL_AT:
            os.write(say_fd, b"k")
        # The ranks leave together: once each was taken over, and some steps on.
        flag[0] = h.resume_info().resumes
        h.allreduce(world, flag, every)
        if every[0] >= n and resumed_at is None:
            resumed_at = k
        k += 1
        if resumed_at is not None and k > resumed_at + AFTER_RESUME:
            break
        assert k < MAX_STEPS, f"spd was not started again within {MAX_STEPS} steps"
    return {"steps": k, "info": h.resume_info(), "pids": (pid0, h.daemon_pid), "not_retried": not_retried}


def test_training_rides_through_spd_killed(restartable):
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
        assert o["info"].replayed >= o["info"].retried
        assert o["steps"] > KILL_AT + AFTER_RESUME
        assert o["not_retried"] <= 1, f"rank {r}: {o['not_retried']} all-reduces in place not retried; one spd went"


def test_restarted_error_is_an_spd_error():
    assert issubclass(spclient.RestartedError, spclient.SpdError)
    e = spclient._error(spclient.Status.ERR_RESTARTED, "spd restarted mid-op; not retried (in place)")
    assert isinstance(e, spclient.RestartedError) and e.name == "SPC_ERR_RESTARTED"
    assert e.detail.endswith("not retried (in place)")


def test_resume_info_of_a_handle_never_taken_over(restartable):
    with spclient.attach(socket=restartable.sock) as h:
        assert h.resume_info() == spclient.ResumeInfo(0, 0, 0, 0)
        assert h.daemon_pid == restartable.proc.pid
