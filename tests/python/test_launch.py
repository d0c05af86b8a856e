"""A launch in one line: spclient.init() under torchrun, and the README's quick start.

* torchrun starts client/examples/quickstart.py as 4 ranks with nothing else
  set up (only SPC_SOCKET, for this test's private spd, and the checkout's
  spclient on PYTHONPATH): each rank's init() joins the launch's job, and the
  example's all-to-all, ring shift and loss, checked against references in the
  example, pass; the job ends with the launch;
* the README's Python quick start is that file, verbatim;
* init() without a launcher says which variables it looked for; two launches
  under one SPC_JOB: the second is refused naming the first, whose ranks then
  run undisturbed;
* srun's tasks on two nodes, each with its own spd linked to the other, join
  one job through init() alone.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT

import spclient

EXAMPLE = os.path.join(ROOT, "client", "examples", "quickstart.py")


def _torchrun():
    """torchrun as the README runs it: Debian's python3-torch ships it; else the
    same program from this interpreter's torch."""
    pytest.importorskip("torch")
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def _launcher_env():
    """This process's environment without what a launcher would have set."""
    drop = re.compile(r"^(RANK|WORLD_SIZE|LOCAL_RANK|LOCAL_WORLD_SIZE|MASTER_(ADDR|PORT)|TORCHELASTIC_.*|"
                      r"OMPI_.*|PMIX_.*|SLURM_.*|SPC_JOB)$")
    return {k: v for k, v in os.environ.items() if not drop.match(k)}


def test_torchrun_quickstart(spd):
    env = _launcher_env()
    env["PYTHONPATH"] = os.path.join(ROOT, "client", "python") + os.pathsep + env.get("PYTHONPATH", "")
    # The README's command: --redirects/--tee as Debian 12's torchrun needs them (its
    # torch 1.13 under Python 3.11 cannot parse its own default of 0).
    cmd = _torchrun() + ["--standalone", "--nproc_per_node", "4", "--redirects", "1", "--tee", "1", EXAMPLE]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    out = p.stdout + p.stderr
    print(out)
    assert p.returncode == 0, out
    m = re.search(r"4 ranks of (torchrun-\S+): Mesh\(dp=1, sp=4, ulysses=2, ring=2\), all-to-all, ring shift and "
                  r"loss checked", out)
    assert m, out
    # The job was the launch's: it ended with its last rank.
    with spclient.attach() as h:
        deadline = time.time() + 5
        while [j for j in h.query("jobs") if j["id"].endswith("/" + m.group(1))]:
            assert time.time() < deadline, h.query("jobs")
            time.sleep(0.01)


def test_readme_quickstart_is_the_example():
    readme = open(os.path.join(ROOT, "README.md")).read()
    section = readme.split("## Python quick start", 1)
    assert len(section) == 2, "README.md has no '## Python quick start' section"
    blocks = re.findall(r"```python\n(.*?)```", section[1], re.S)
    assert blocks, "no python block in the README's quick start"
    assert blocks[0] == open(EXAMPLE).read(), "README.md's quick start and client/examples/quickstart.py differ"


# A rank: spclient.init(), then an all-reduce of rank + 1 over the world.
RANK = """
import json, spclient
try:
    with spclient.init(timeout_ms=20000) as run:
        x = run.handle.empty((1,), "float64")
        x[0] = run.rank + 1
        run.handle.allreduce(run.world, x)
        print(json.dumps(["ok", [run.launcher, run.job, run.launch, run.rank, run.world_size], float(x[0])]))
except spclient.SpdError as e:
    print(json.dumps(["error", e.name, e.detail]))
"""


def _rank(env):
    """A rank process with `env` as its whole environment (and the checkout's spclient)."""
    env = dict(env, PYTHONPATH=os.path.join(ROOT, "client", "python"))
    return subprocess.Popen([sys.executable, "-c", RANK], env=env, stdout=subprocess.PIPE, text=True)


def _result(p):
    out, _ = p.communicate(timeout=60)
    assert p.returncode == 0, out
    return json.loads(out)


def _slurm(rank, step, job="nightly"):
    return dict(_launcher_env(), SLURM_PROCID=str(rank), SLURM_NTASKS="2", SLURM_LOCALID=str(rank),
                SLURM_STEP_NUM_NODES="1", SLURM_JOB_ID="77", SLURM_STEP_ID=str(step), SPC_JOB=job)


def _slurm_nodes(rank, sock):
    """srun's variables for task `rank` of 4 on 2 nodes, 2 a node, attached to its own node's spd."""
    return dict(_launcher_env(), SLURM_PROCID=str(rank), SLURM_NTASKS="4", SLURM_LOCALID=str(rank % 2),
                SLURM_STEP_NUM_NODES="2", SLURM_NTASKS_PER_NODE="2", SLURM_JOB_ID="78", SLURM_STEP_ID="3",
                SPC_SOCKET=sock)


def _name_lookups(sock):
    with spclient.attach(socket=sock) as h:
        return h.query("status")[0]["name_lookups"]


def test_init_across_two_daemons():
    """srun's 4 tasks on 2 nodes, each node its own spd, the two linked as peers:
    every task's init() joins the launch's job through its own node's spd, rank 0
    last (the others wait for the job's home, which spctl status counts), and
    the all-reduce of rank + 1 is 10 on all four."""
    sys.path.insert(0, os.path.join(ROOT, "client", "examples"))
    import train_tiny_sp as T
    binary = os.environ.get("SPD_BIN", os.path.join(ROOT, "build", "daemon", "spd"))
    saved = os.environ.get("SPC_SOCKET")
    stop = T.start_spd(binary, nodes=2)
    try:
        socks = list(T.SOCKETS)
        ranks = {r: _rank(_slurm_nodes(r, socks[r // 2])) for r in (1, 2, 3)}
        deadline = time.time() + 20
        while (_name_lookups(socks[0]), _name_lookups(socks[1])) != (1, 2):
            assert time.time() < deadline and all(p.poll() is None for p in ranks.values())
            time.sleep(0.01)
        ranks[0] = _rank(_slurm_nodes(0, socks[0]))
        for r, p in sorted(ranks.items()):
            assert _result(p) == ["ok", ["slurm", "slurm-78.3", "78.3", r, 4], 10.0]
        assert (_name_lookups(socks[0]), _name_lookups(socks[1])) == (0, 0)
    finally:
        stop()
        if saved is not None:
            os.environ["SPC_SOCKET"] = saved


def test_init_without_launcher(spd):
    kind, name, detail = _result(_rank(_launcher_env()))
    assert (kind, name) == ("error", "SPC_ERR_NOT_FOUND")
    assert "RANK and WORLD_SIZE (torchrun)" in detail


def test_second_launch_refused(spd):
    """Rank 0 of step 1 waits in the job; step 2's rank 1 under the same SPC_JOB is
    refused naming step 1; step 1's rank 1 then completes the job."""
    first = _rank(_slurm(0, 1))
    with spclient.attach() as h:
        deadline = time.time() + 20
        while not [j for j in h.query("jobs") if j["id"] == f"{os.getuid()}/nightly" and j["joined"] == 1]:
            assert time.time() < deadline and first.poll() is None, h.query("jobs")
            time.sleep(0.01)
    kind, name, detail = _result(_rank(_slurm(1, 2)))
    assert (kind, name) == ("error", "SPC_ERR_BUSY")
    assert "is held by another launch (77.1, 1 of 2 ranks joined" in detail
    assert "this rank's launch is 77.2" in detail
    assert _result(_rank(_slurm(1, 1))) == ["ok", ["slurm", "nightly", "77.1", 1, 2], 3.0]
    assert _result(first) == ["ok", ["slurm", "nightly", "77.1", 0, 2], 3.0]
