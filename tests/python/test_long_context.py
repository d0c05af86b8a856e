"""client/examples/long_context.py once, at tiny sizes on the CPU, with --json:
every point it promises is there, each line parses, and the numbers are sane
(positive, within the cap, a larger S never using less memory on the same
series). Not a timing test: no time is compared with another."""
import json
import os
import subprocess
import sys

from conftest import ROOT

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
