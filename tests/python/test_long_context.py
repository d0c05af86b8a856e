"""client/examples/long_context.py at tiny sizes on the CPU, with --json:
every point it promises is there, each line parses, and the numbers are sane
(positive, within the cap, a larger S never using less memory on the same
series); --search doubles and bisects; and its host meter counts torch's and
spd's arena's allocations exactly. Not a timing test: no time is compared with
another."""
import json
import os
import subprocess
import sys

import torch

from conftest import ROOT, run_ranks

SPD = os.environ.get("SPD_BIN", os.path.join(ROOT, "build", "daemon", "spd"))
SCRIPT = os.path.join(ROOT, "client", "examples", "long_context.py")
CAP = 2 << 30


def test_long_context_json():
    args = [sys.executable, SCRIPT, "--spd", SPD, "--seq", "256,1024", "--sp", "1,2,4", "--mode", "ulysses,ring,hybrid",
            "--heads", "4", "--head-dim", "16", "--mem-cap", str(CAP), "--json"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    got = {(r["sp"], r["mode"], r["seq"]): r for r in lines}
    want = {(1, "single"), (2, "ulysses"), (2, "ring"), (4, "ulysses"), (4, "ring"), (4, "hybrid")}
    assert {(sp, mode) for sp, mode, _ in got} == want, run.stderr
    assert len(got) == 2 * len(want), "every series at both sizes"
    for (sp, mode, seq), r in got.items():
        assert r["backend"] and r["dtype"] == "fp32" and r["device"] == "cpu"
        assert r["fits"] is True and 0 < r["peak_bytes"] <= CAP, r
        assert 0 < r["seconds"] < 120, r
        assert len(r["ranks"]) == sp and r["peak_bytes"] == max(x["peak_bytes"] for x in r["ranks"])
        if seq == 1024:
            assert r["peak_bytes"] >= got[(sp, mode, 256)]["peak_bytes"], (sp, mode)
    assert "largest S within the memory cap" in run.stderr


def test_search_proj_layer():
    """--search from S = 256 under a cap that holds the inputs too: S doubles
    while it fits, then bisects between the last fit and the first miss; the
    layer with projections; every point's peak at least what a rank must make
    in the step and hold at once (the q, k, v projection and the attention's
    output: 4 tensors of its [S / 4, H * D])."""
    cap = 2.2 * 2**20
    args = [sys.executable, SCRIPT, "--spd", SPD, "--seq", "256", "--search", "--refine", "2", "--sp", "4",
            "--mode", "ulysses", "--heads", "4", "--head-dim", "16", "--layer", "proj", "--mem-cap", str(cap),
            "--count-inputs", "--json"]
    run = subprocess.run(args, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr
    pts = [json.loads(line) for line in run.stdout.splitlines()]
    seqs, fits = [r["seq"] for r in pts], [r["fits"] for r in pts]
    for r in pts:
        assert r["fits"] == (r["peak_with_inputs"] <= cap), r
        assert r["peak_with_inputs"] == max(x["peak_bytes"] + x["inputs_bytes"] for x in r["ranks"])
        assert r["ranks"][0]["inputs_bytes"] == 2 * 4 * r["seq"] // 4 * 64     # x and dy, fp32
        assert r["peak_bytes"] >= 4 * 4 * r["seq"] // 4 * 64, r
    miss = fits.index(False)
    assert miss >= 1 and seqs[:miss + 1] == [256 << i for i in range(miss + 1)], seqs
    lo, hi = seqs[miss - 1], seqs[miss]
    assert len(seqs) > miss + 1, "bisected"
    for s, ok in zip(seqs[miss + 1:], fits[miss + 1:]):     # bisections, on multiples of 256 / 2^2
        assert lo < s < hi and s % 64 == 0, seqs
        lo, hi = (s, hi) if ok else (lo, s)
    assert "S at the cap" in run.stderr


def meter_rank(h, world, rank, size):
    sys.path.insert(0, os.path.dirname(SCRIPT))
    import long_context
    m = long_context.HostAllocations(h)
    a = torch.empty(1000)                       # 4000 bytes
    b = h.empty((500,), torch.float32)          # 2000 bytes of the arena
    del a
    c = torch.empty(250)                        # 1000 bytes: 3000 live, under the peak of 6000
    del b, c
    d = h.empty((2000,), torch.float64)         # 16000 bytes: the peak
    del d
    return m.peak()


def test_host_meter_is_exact(spd):
    assert run_ranks(1, meter_rank) == [16000]
