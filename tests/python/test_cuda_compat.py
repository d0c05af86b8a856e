"""spclient.compat's DeepSpeed and yunchang modules on CUDA tensors through a
real spd: every case of test_compat_deepspeed.py and test_compat_yunchang.py
with spd's path on each rank's GPU (all-to-alls and ring shifts of device
memory, the blocks on spd's GPU kernels), outputs and the gradients of q, k
and v against one process's attention on the host in fp64: within 1e-10 in
fp64, 2e-5 in fp32. Skipped, with the reason, where torch sees no GPU."""
import pytest
import torch

import test_compat_deepspeed as ds
import test_compat_yunchang as yc
from conftest import run_ranks
from test_cuda_linear import _gpus

if _gpus() == 0:
    pytest.skip(f"no CUDA device: torch {torch.__version__} says torch.cuda.is_available() is False",
                allow_module_level=True)

TOL = {torch.float64: 1e-10, torch.float32: 2e-5}


def _check(results, name, dtype):
    for rank, diffs in enumerate(results):
        for what, diff in diffs.items():
            assert diff <= TOL[dtype], f"rank {rank}: {what} differ by {diff:.3g} ({dtype}, {name}, on the GPU)"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(ds.CASES))
def test_distributed_attention_on_the_gpu(spd, tmp_path, name, dtype):
    case = ds.CASES[name]
    world = sum(len(g) for g in case[5])
    _check(run_ranks(world, ds._rank, str(tmp_path / "gloo"), case, "cuda", dtype, timeout=300), name, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("name", list(yc.CASES))
def test_yunchang_on_the_gpu(spd, tmp_path, name, dtype):
    case = yc.CASES[name]
    _check(run_ranks(len(case[7]), yc._rank, str(tmp_path / "gloo"), case, "cuda", dtype, timeout=300), name, dtype)
