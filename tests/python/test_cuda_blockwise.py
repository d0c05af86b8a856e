"""Attention blocks on a GPU: torch's flash kernel in bf16 and blockwise in fp32
against full attention in fp64 on the host, over a zigzag ring of 1 to 8 ranks
played out in one process (test_blockwise.py's), packed documents and GQA.
The bf16 error must not grow with the ring: blocks merge in fp32. Skipped,
with the reason, where torch sees no GPU or has no flash kernel."""
import pytest
import torch

import spclient.attention as spa
from spclient import blockwise, flash
from test_blockwise import full_attention, ring_in_one_process, tensors

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device")

# 256 tokens: documents that cross the zigzag chunks of every ring size here.
N = 256
DOCS = [[37, 100, 3, 116], [256]]


def doc_ids(rows):
    return torch.tensor([[d for d, n in enumerate(row) for _ in range(n)] for row in rows])


def errors(backend, dtype, ring, heads=8, kv_heads=2, D=64):
    """Relative max error of out, dq, dk, dv against fp64 full attention."""
    q, k, v, w = tensors(heads, kv_heads, torch.float64, D=D, seed=5, B=len(DOCS), S=N)
    want = full_attention(q, k, v, w, DOCS)
    dev = torch.device("cuda")
    docs = blockwise.Docs.of(doc_ids(DOCS), dev)
    got = ring_in_one_process(backend, *(t.to(dev, dtype) for t in (q, k, v, w)), ring, docs)
    return [((a.cpu() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, want)]


def test_auto_chooses_flash_for_bf16():
    q = torch.zeros(1, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
    why = flash.why_not(q)
    if why is not None:
        pytest.skip(f"no flash kernel: {why}")
    assert spa.choose_backend(q) == "flash"
    assert spa.choose_backend(q.float()) == "blockwise"


@pytest.mark.parametrize("ring", [1, 2, 4, 8])
def test_blockwise_fp32_on_the_gpu(ring):
    for name, err in zip(("out", "dq", "dk", "dv"), errors("blockwise", torch.float32, ring)):
        assert err < 1e-5, f"ring {ring} {name}: error {err}"


def test_flash_bf16_error_does_not_grow_with_the_ring():
    why = flash.why_not(torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16, device="cuda"))
    if why is not None:
        pytest.skip(f"no flash kernel: {why}")
    errs = {ring: errors("flash", torch.bfloat16, ring) for ring in (1, 2, 4, 8)}
    print("bf16 flash, relative max error of out, dq, dk, dv by ring size:", errs)
    for ring, e in errs.items():
        for name, err, tol in zip(("out", "dq", "dk", "dv"), e, (1e-2, 3e-2, 3e-2, 3e-2)):
            assert err < tol, f"ring {ring} {name}: bf16 error {err}"
        # bf16 rounds the inputs and the kernel's probabilities once whatever
        # the ring; the merges add fp32 rounding only.
        assert e[0] <= 1.5 * errs[1][0] + 1e-3, f"ring {ring}: out error {e[0]} against {errs[1][0]} at ring 1"
