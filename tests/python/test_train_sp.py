"""The SP-vs-no-SP experiment of client/examples/train_tiny_sp.py, short: 3 steps
of SFT and DPO per configuration, each against one plain torch process."""
import os
import sys

import pytest
import torch

from conftest import ROOT

sys.path.insert(0, os.path.join(ROOT, "client", "examples"))
import train_tiny_sp as T  # noqa: E402


@pytest.mark.parametrize("dtype,loss_tol,grad_tol", [(torch.float64, 1e-10, 1e-10), (torch.float32, 1e-5, 1e-5)])
def test_sp_matches_single_process(spd, dtype, loss_tol, grad_tol):
    table, curves = T.experiment(dtype, steps=3, log=lambda *a: None)
    assert set(table) == {name for name, _, _ in T.CONFIGS}
    for name, rows in table.items():
        for task, (dloss, dgrad, dlp, bitwise) in rows.items():
            where = f"{name} {task}"
            assert dloss <= loss_tol, f"{where}: loss differs by {dloss}"
            assert dgrad <= grad_tol, f"{where}: gradient differs by {dgrad}"
            if "Ring" not in name:
                # Ulysses moves bytes and runs the single process's attention:
                # the forward changes no bit (the allowance is for a BLAS that
                # blocks differently for another row count; the note says which).
                assert dlp <= (1e-14 if dtype == torch.float64 else 1e-6), f"{where}: log-probs differ by {dlp}"
            else:
                assert dlp <= (1e-12 if dtype == torch.float64 else 1e-5), f"{where}: log-probs differ by {dlp}"
        # Training moved: the loss changed over the steps, on every configuration.
        assert curves[name]["sft"][0] != curves[name]["sft"][-1]


def test_gradients_need_the_autograd_allreduce(spd):
    """The control: a loss reduction without the gradient all-reduce in backward
    (torch.distributed.all_reduce semantics) gives gradients 1/sp of SP = 1's."""
    c = T.Cfg(torch.float64, steps=1)
    ref = T.train_single(c)

    plain = T.spt.all_reduce

    class NoBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, h, group, x):
            return plain(h, group, x).detach()

        @staticmethod
        def backward(ctx, g):
            return None, None, g

    T.spt.all_reduce = NoBackward.apply     # token_mean_loss looks it up at call time
    try:
        ranks = T.run_ranks(2, T.train_rank, c, 2, 1)
    finally:
        T.spt.all_reduce = plain
    g_ref, g_sp = ref["sft"][1][0], ranks[0]["sft"][1][0]
    scale = (g_sp.norm() / g_ref.norm()).item()
    assert abs(scale - 0.5) < 1e-9, f"gradient scale {scale}, expected 1/sp = 0.5"


@pytest.mark.parametrize("nodes", [1, 2], ids=["one spd", "one of two daemons"])
def test_training_across_a_restart_of_spd_changes_no_bit(monkeypatch, nodes):
    """The user-facing proof of a restart: spd SIGKILLed under a training job (a
    mesh of Ulysses 2 x Ring 2) after SFT step 1 and another started on its
    socket; every loss and gradient of the run, SFT and DPO, is the uninterrupted
    run's, bit for bit (fp64). Over two linked daemons (two ranks on each) the
    second one is killed: it takes its two ranks over and claims the job back
    from the first, which kept it meanwhile; only its ranks were taken over
    (restart_check raises otherwise)."""
    monkeypatch.setenv("SPC_SOCKET", os.environ.get("SPC_SOCKET", ""))   # start_spd sets it; put back after
    stop = T.start_spd(os.environ["SPD_BIN"], nodes=nodes)
    try:
        runs = T.restart_check(torch.float64, 3, 1, configs=[c for c in T.CONFIGS if c[1] == 2 and c[2] == 2],
                               log=lambda *a: None)
    finally:
        stop()
    (plain, again, same), = runs.values()
    assert same and plain == again, f"final SFT loss {plain!r} uninterrupted, {again!r} across the restart"
