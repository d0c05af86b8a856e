"""The binding's registrations of cuMem memory (PyTorch's expandable segments),
without a GPU: a client process (vmm_stub_client.py) drives the binding's
Regions.cover (libspclient's spc_device_cover) over the stand-in driver of
tests/stubcuda, which keeps books of
reservations, chunks and mappings, and a real spd, built with CUDA and loading
the same stub, imports what the client registers. So the binding's walk over
chunks, libspclient's export of them and spd's import all run; here the test
reads what the binding holds and, from spd ("clients" and "status"), what spd
holds, and compares both with what it computes from the chunk size.

  one chunk   spans inside one chunk: one registration of that chunk, reused;
  two chunks  a span across two: one registration of both; a span across the
              edge of registrations made before: they are merged into one, the
              old regions gone in spd (that a merge waits for the requests in
              flight naming them is test_device_cover_stub's);
  hole        a span in reserved space with nothing mapped, or running into it:
              SPC_ERR_OUT_OF_BOUNDS naming the address, nothing registered;
  remap       a chunk unmapped and another mapped at its address: the stale
              registration is dropped and made again (its region gone in spd),
              and one elsewhere is swept on the next miss, also when an earlier
              span of the same op lies in it;
  bound       past the limit the least recently used go, spd holding what the
              binding holds.

Skipped where spd was built without CUDA (it then imports no GPU memory).
"""
import json
import os
import subprocess
import sys

import pytest

import spclient
from conftest import ROOT, spd_running

HERE = os.path.dirname(os.path.abspath(__file__))
STUB = os.environ.get("SP_STUB_CUDA", os.path.join(ROOT, "build", "tests", "stubcuda", "libcuda.so.1"))
OUT_OF_BOUNDS, BAD_REGION = -4, -3


def _with_stub():
    """The environment that makes a process load the stub as libcuda.so.1."""
    old = os.environ.get("LD_LIBRARY_PATH")
    return {"LD_LIBRARY_PATH": os.path.dirname(STUB) + (":" + old if old else "")}


@pytest.fixture(scope="module")
def stub_spd():
    if not os.path.exists(STUB):
        pytest.skip(f"no stand-in driver at {STUB} (built as tests/stubcuda; SP_STUB_CUDA names it)")
    with spd_running(_with_stub()) as sock:
        with spclient.attach(socket=sock) as h:
            gpu = h.query("status")[0].get("gpu_status", "")
        if gpu == "built without CUDA":
            pytest.skip("spd was built without CUDA: it imports no GPU memory")
        assert "CUDA driver" in gpu, f"spd did not load the stand-in driver: {gpu}"
        yield sock


class Client:
    """vmm_stub_client.py, one command at a time."""

    def __init__(self, sock):
        env = dict(os.environ, SPC_SOCKET=sock, **_with_stub())
        self.proc = subprocess.Popen([sys.executable, os.path.join(HERE, "vmm_stub_client.py")], env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.sock = sock

    def __call__(self, op, **args):
        self.proc.stdin.write(json.dumps(dict(op=op, **args)) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        assert line, f"the client died on {op} {args} (status {self.proc.wait()}; its stderr is above)"
        return json.loads(line)

    def cover(self, *spans, **kw):
        return self("cover", spans=[list(s) for s in spans], **kw)

    def spd_sees(self):
        """(device_regions, device_bytes) of this client in spd, and spd's imports."""
        with spclient.attach(socket=self.sock) as h:
            me = [c for c in h.query("clients") if c["pid"] == self.proc.pid]
            imports = h.query("status")[0]["gpu_imports"]
        assert len(me) == 1, f"spd lists {len(me)} clients of pid {self.proc.pid}"
        return me[0]["device_regions"], me[0]["device_bytes"], imports

    def close(self):
        if self.proc.poll() is None:
            self("close")
        assert self.proc.wait(timeout=30) == 0


@pytest.fixture
def client(stub_spd):
    c = Client(stub_spd)
    yield c
    c.close()


def _memory(c, chunks, mapped):
    """Reserves `chunks` chunks and maps those in `mapped`; returns the chunk size."""
    C = c("reserve", chunks=chunks)["chunk"]
    for i in mapped:
        c("map", i=i)
    return C


def test_span_in_one_chunk(client):
    c = client
    C = _memory(c, 4, range(3))
    out = c.cover((4096, 8192))
    assert [e[:2] for e in out["entries"]] == [[0, C]], out       # chunk 0, not the reservation
    assert out["used"] == [0] and out["registrations"] == 1
    assert c.spd_sees() == (1, C, 1)
    out = c.cover((C // 2, 4096), (C - 16, 16))                   # elsewhere in chunk 0: reused
    assert [e[:2] for e in out["entries"]] == [[0, C]] and out["registrations"] == 1, out
    assert c.spd_sees() == (1, C, 1)


def test_span_across_chunks_and_merge(client):
    c = client
    C = _memory(c, 4, range(4))
    out = c.cover((C + C // 2, C))                                # chunks 1 and 2
    assert [e[:2] for e in out["entries"]] == [[C, 2 * C]], out
    out = c.cover((100, 16))                                      # chunk 0, a registration of its own
    assert [e[:2] for e in out["entries"]] == [[0, C], [C, 2 * C]], out
    assert c.spd_sees() == (2, 3 * C, 2)
    old = [e[2] for e in out["entries"]]

    # Across the edge of both: one registration over chunks 0 to 2.
    out = c.cover((C - 4096, 8192))
    assert [e[:2] for e in out["entries"]] == [[0, 3 * C]], out
    assert out["merged"] == 2 and out["registrations"] == 3, out
    assert c.spd_sees() == (1, 3 * C, 1)
    assert [c("deregister", region=r)["status"] for r in old] == [BAD_REGION] * 2

    # Two spans of one op, in chunk 2 and across 2 and 3: the second's merge
    # takes in the first's registration, and the op uses the merged one.
    out = c.cover((2 * C + 100, 16), (3 * C - 8, 16))
    assert [e[:2] for e in out["entries"]] == [[0, 4 * C]] and out["used"] == [0], out
    assert c.spd_sees() == (1, 4 * C, 1)


def test_hole(client):
    c = client
    C = _memory(c, 4, (0, 1, 3))                                  # chunk 2 is a hole
    for span in ((2 * C + 100, 16), (2 * C - 4096, 8192)):
        out = c.cover(span)
        st, detail = out["error"]
        assert st == OUT_OF_BOUNDS and "nothing mapped" in detail, out
        assert out["entries"] == [] and out["registrations"] == 0, out
    assert c.spd_sees() == (0, 0, 0)
    out = c.cover((C, 16), (3 * C, 16))                           # either side of the hole
    assert [e[:2] for e in out["entries"]] == [[C, C], [3 * C, C]], out
    assert c.spd_sees() == (2, 2 * C, 2)


def test_remap(client):
    c = client
    C = _memory(c, 4, range(4))
    out = c.cover((C // 2, C), (3 * C + 64, 64))                  # chunks 0-1, and 3
    (_, _, r01), (_, _, r3) = out["entries"]
    assert c.spd_sees() == (2, 3 * C, 2)

    # Chunk 1 unmapped and another allocation mapped at its address: the span's
    # registration no longer holds what is there.
    c("unmap", i=1)
    c("map", i=1)
    out = c.cover((C // 2, C))
    assert [e[:2] for e in out["entries"]] == [[0, 2 * C], [3 * C, C]], out
    assert out["dropped"] == 1 and out["registrations"] == 3, out
    assert r01 not in [e[2] for e in out["entries"]]
    assert c("deregister", region=r01)["status"] == BAD_REGION
    assert c.spd_sees() == (2, 3 * C, 2)

    # A span inside chunk 0 alone still hits (chunk 0 is the same); chunk 3
    # remapped is found by the sweep of the next miss, a span elsewhere.
    assert c.cover((64, 64))["registrations"] == 3
    c("unmap", i=3)
    c("map", i=3)
    c("unmap", i=2)
    out = c.cover((C + 64, 64))                                   # hits chunks 0-1: no sweep yet
    assert out["registrations"] == 3 and len(out["entries"]) == 2, out
    out = c.cover((2 * C + 64, 64))                               # a miss, into the hole chunk 2 left
    assert out["error"][0] == OUT_OF_BOUNDS and out["dropped"] == 2, out
    assert [e[:2] for e in out["entries"]] == [[0, 2 * C]] and r3 not in [e[2] for e in out["entries"]], out
    assert c.spd_sees() == (1, 2 * C, 1)


def test_sweep_inside_one_op(client):
    """The first span of an op hits a registration whose other chunk was
    remapped; the second span's miss sweeps that registration away. The op's
    spans must still all be covered when cover() returns."""
    c = client
    C = _memory(c, 4, range(4))
    c.cover((C // 2, C))                                          # chunks 0-1
    c("unmap", i=1)
    c("map", i=1)
    out = c.cover((64, 64), (3 * C + 64, 64))
    assert [e[:2] for e in out["entries"]] == [[0, C], [3 * C, C]], out
    assert out["used"] == [0, 3 * C] and out["dropped"] == 1, out
    assert c.spd_sees() == (2, 2 * C, 2)


def test_bound(client):
    c = client
    C = _memory(c, 6, range(6))
    for i in range(6):                                            # one registration per chunk, limit 4
        out = c.cover((i * C + 64, 64), limit=4)
        assert len(out["entries"]) <= 4, out
    assert [e[0] for e in out["entries"]] == [2 * C, 3 * C, 4 * C, 5 * C], out
    n = len(out["entries"])
    assert c.spd_sees() == (n, n * C, n)
