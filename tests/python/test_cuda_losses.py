"""spclient.losses on CUDA tensors through a real spd: test_losses.py's GRPO
log-prob gather, last-token reward and accumulation window with every rank's
model, data and collectives on one GPU (fp64), checked against the same
single-process references on the host (1e-12). Skipped, with the reason, where
torch sees no GPU or spd was built without CUDA."""
import pytest
import torch

import spclient
import test_losses as L
from conftest import in_child, run_ranks

DEV = "cuda:0"


def _gpus():
    """torch's GPU count, asked in a child: this process forks the ranks, and
    the CUDA driver does not survive a fork once initialised."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


if in_child(_gpus) == 0:
    pytest.skip(f"no CUDA device: torch {torch.__version__} says torch.cuda.is_available() is False",
                allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def gpu_spd(spd):
    with spclient.attach(socket=spd) as h:
        st = h.query("status")[0]
    if st.get("gpu_status") == "built without CUDA":
        pytest.skip("spd was built without CUDA: it cannot import GPU memory")
    return spd


@pytest.mark.parametrize("ulysses,ring,S", [(1, 2, 7), (2, 2, 5)])
def test_grpo_logprob_gather_on_gpu(ulysses, ring, S):
    L.check_grpo_gather(run_ranks(ulysses * ring, L.grpo_rank_fn, ulysses, ring, S, DEV, timeout=300),
                        ulysses, ring, S)


def test_last_token_reward_on_gpu():
    L.check_reward(run_ranks(4, L.reward_rank_fn, 2, 2, 7, DEV, timeout=300), 2, 2, 7)


@pytest.mark.parametrize("task", ["sft", "grpo"])
def test_accumulation_window_on_gpu(task):
    T, g_ref = in_child(L.one_process, task)
    for tokens, g in run_ranks(4, L.sp_rank_fn, 2, 1, 2, 2, task, DEV, timeout=300):     # DP=2 x SP=2 ring
        assert tokens == T
        assert torch.allclose(g, g_ref, rtol=0, atol=L.TOL), (g - g_ref).abs().max()
