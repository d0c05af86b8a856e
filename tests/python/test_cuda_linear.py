"""spclient.linear on CUDA tensors through a real spd: the convolution's halo
(linear shifts of device memory), the recurrence's state (an all-gather of
device memory) and Ulysses (q, k, v, beta and g seq->head in one all-to-all of
device memory, alone and inside context parallelism) between 2 and 4 rank
processes on the GPU, outputs and every gradient against the single-process
recurrence on the host, as test_linear.py holds them on the host: fp64 within
1e-12, fp32 within 1e-5; and the hybrid stack of train_hybrid_sp.py on every
mesh of its table. Skipped, with the reason, where torch sees no GPU."""
import subprocess
import sys

import pytest
import torch

from conftest import run_ranks
from test_linear import (LAYOUTS, STACKS, TOL, ULYSSES, reference, same_as_single_process, sp_rank, stack_rank,
                         stack_same_as_single_process, stack_single)


def _gpus():
    """torch's GPU count, asked in a child process: this one forks the ranks, and
    the CUDA driver does not survive a fork once initialised."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
        return int(out.stdout.strip() or 0)
    except (subprocess.SubprocessError, ValueError):
        return 0


if _gpus() == 0:
    pytest.skip(f"no CUDA device: torch {torch.__version__} says torch.cuda.is_available() is False",
                allow_module_level=True)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", LAYOUTS)
def test_conv_and_recurrence_on_the_gpu(spd, name, size, dtype):
    pos = LAYOUTS[name]
    out = run_ranks(size, sp_rank, pos, dtype, "cuda", timeout=300)
    same_as_single_process(out, *reference(pos, dtype), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("size,ulysses,heads", ULYSSES, ids=[f"sp{s}-u{u}-h{h[0]}x{h[1]}" for s, u, h in ULYSSES])
def test_ulysses_on_the_gpu(spd, size, ulysses, heads, dtype):
    pos = LAYOUTS["seed"]
    out = run_ranks(size, sp_rank, pos, dtype, "cuda", ulysses, heads, timeout=300)
    same_as_single_process(out, *reference(pos, dtype, heads), TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("size,ulysses", STACKS, ids=[f"sp{s}-u{u}" for s, u in STACKS])
def test_hybrid_stack_on_the_gpu(spd, size, ulysses, dtype):
    """test_linear.py's hybrid stack with every rank's model on its GPU."""
    single, out = stack_single(dtype), run_ranks(size, stack_rank, dtype, ulysses, "cuda", timeout=300)
    stack_same_as_single_process(out, *single, TOL[dtype])
