"""spclient.linear on CUDA tensors through a real spd: the convolution's halo
(linear shifts of device memory) and the recurrence's state (an all-gather of
device memory) between 2 and 4 rank processes on the GPU, outputs and every
gradient against the single-process recurrence on the host, as
test_linear.py holds them on the host: fp64 within 1e-12, fp32 within 1e-5.
Skipped, with the reason, where torch sees no GPU."""
import subprocess
import sys

import pytest
import torch

from conftest import run_ranks
from test_linear import LAYOUTS, TOL, reference, same_as_single_process, sp_rank


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
