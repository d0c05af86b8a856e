"""The registration cache of ops on CUDA tensors (spclient._device.Regions),
without a GPU: the driver's answers (which allocation a pointer lies in) and
libspclient's register/deregister are played by fakes, so the cache's decisions
are checked here on every machine; test_cuda.py runs it against a real GPU."""
import ctypes

import pytest

from spclient import _device


class FakeDriver:
    """Allocations by base: (size, buffer id); a pointer lies in the one that holds it."""

    def __init__(self):
        self.allocs, self.next_id = {}, 1

    def malloc(self, base, size):
        self.allocs[base] = (size, self.next_id)
        self.next_id += 1

    def free(self, base):
        del self.allocs[base]

    def allocation(self, ptr):
        for base, (size, bid) in self.allocs.items():
            if base <= ptr < base + size:
                return base, size, bid, False
        return None


class FakeLib:
    """spc_register_device / spc_deregister as spd answers them: overlapping
    registrations refused, unknown regions BAD_REGION."""

    def __init__(self):
        self.regions, self.next_region, self.calls = {}, 1, []

    def spc_register_device(self, h, ptr, size, region_p):
        base = ptr.value
        self.calls.append(("register", base, size))
        for b, s in self.regions.values():
            if base < b + s and b < base + size:
                return -1
        r = self.next_region
        self.next_region += 1
        self.regions[r] = (base, size)
        ctypes.cast(region_p, ctypes.POINTER(ctypes.c_uint32))[0] = r
        return 0

    def spc_deregister(self, h, region):
        self.calls.append(("deregister", region))
        return 0 if self.regions.pop(region, None) else -3


@pytest.fixture
def fakes(monkeypatch):
    drv, lib = FakeDriver(), FakeLib()
    monkeypatch.setattr(_device, "_driver", drv)
    monkeypatch.setattr(_device, "lib", lib)
    return drv, lib


def registered(lib):
    return sorted(lib.regions.values())


def test_one_registration_per_allocation(fakes):
    drv, lib = fakes
    drv.malloc(0x10000, 0x2000)
    r = _device.Regions(limit=8)
    r.cover(None, [(0x10000, 0x100), (0x10080, 0x100)])       # overlapping views
    r.cover(None, [(0x11000, 0x1000)])
    assert registered(lib) == [(0x10000, 0x2000)] and r.registrations == 1


def test_reused_address_registered_afresh(fakes):
    drv, lib = fakes
    drv.malloc(0x10000, 0x2000)
    r = _device.Regions(limit=8)
    r.cover(None, [(0x10000, 0x100)])
    drv.free(0x10000)
    drv.malloc(0x10000, 0x2000)                                 # same address, new buffer id
    r.cover(None, [(0x10000, 0x100)])
    assert registered(lib) == [(0x10000, 0x2000)] and r.registrations == 2 and r.dropped == 1


def test_freed_allocation_dropped_before_an_overlapping_one(fakes):
    """A bigger allocation over a freed one's range: the stale registration goes
    first, so spd never sees two overlap."""
    drv, lib = fakes
    drv.malloc(0x10000, 0x1000)
    drv.malloc(0x40000, 0x1000)
    r = _device.Regions(limit=8)
    r.cover(None, [(0x10000, 0x10), (0x40000, 0x10)])
    drv.free(0x10000)
    drv.malloc(0x8000, 0x4000)                                  # covers the old 0x10000
    r.cover(None, [(0x8000, 0x10)])
    assert registered(lib) == [(0x8000, 0x4000), (0x40000, 0x1000)] and r.dropped == 1


def test_spd_dropped_it_already(fakes):
    """spd drops by itself the regions of an allocation made again at the same
    address: the deregistration's BAD_REGION is expected, not an error."""
    drv, lib = fakes
    drv.malloc(0x10000, 0x1000)
    r = _device.Regions(limit=8)
    r.cover(None, [(0x10000, 0x10)])
    lib.regions.clear()
    drv.free(0x10000)
    drv.malloc(0x10000, 0x1000)
    r.cover(None, [(0x10000, 0x10)])
    assert registered(lib) == [(0x10000, 0x1000)]


def test_bounded_lru(fakes):
    drv, lib = fakes
    r = _device.Regions(limit=4)
    for i in range(10):
        drv.malloc(0x100000 * (i + 1), 0x1000)
    for i in range(10):
        used = r.cover(None, [(0x100000 * (i + 1), 0x10), (0x100000, 0x10)])   # the first stays hot
        if len(r) > r.limit:
            r.evict(None, used)
        assert len(r) <= r.limit
    assert (0x100000, 0x1000) in registered(lib)
    assert len(lib.regions) == len(r) <= 4 and r.registrations == 10


def test_not_device_memory(fakes):
    drv, _ = fakes
    drv.malloc(0x10000, 0x1000)
    r = _device.Regions(limit=4)
    with pytest.raises(Exception, match="not in device memory"):
        r.cover(None, [(0x90000, 0x10)])
    with pytest.raises(Exception, match="runs past its allocation"):
        r.cover(None, [(0x10800, 0x1000)])


# ---------------------------------------------------------------- cuMem memory
# test_vmm_stub.py runs these paths through libspclient and spd over a stand-in
# driver; here, what would take a thousand chunks there, and the waits.


class FakeVmm:
    """One reservation at 0x1000000 of `n` chunks of 0x1000 bytes, all mapped."""
    BASE, CHUNK = 0x1000000, 0x1000

    def __init__(self, n):
        self.n, self.next_id = n, 1
        self.ids = {}
        for i in range(n):
            self.map(i)

    def map(self, i):
        self.ids[i] = self.next_id
        self.next_id += 1

    def _index(self, ptr):
        i = (ptr - self.BASE) // self.CHUNK
        return i if 0 <= i < self.n and i in self.ids else None

    def allocation(self, ptr):
        if not self.BASE <= ptr < self.BASE + self.n * self.CHUNK:
            return None
        i = self._index(ptr)
        return self.BASE, self.n * self.CHUNK, self.ids[i] if i is not None else 0, True

    def chunk_ids(self, at):
        i = self._index(at)
        return (1, self.ids[i], 7) if i is not None else (0, 0, 0)

    def chunk(self, at):
        i = self._index(at)
        return None if i is None else (self.BASE + i * self.CHUNK, self.CHUNK, self.ids[i], 7)


@pytest.fixture
def vmm(monkeypatch):
    drv, lib = FakeVmm(1100), FakeLib()
    monkeypatch.setattr(_device, "_driver", drv)
    monkeypatch.setattr(_device, "lib", lib)
    return drv, lib


def test_vmm_merge_longer_than_a_registration(vmm):
    """A span over the edge of a registration of 600 chunks, reaching chunk 1099:
    one registration over both would take 1100 chunks. When the old one is
    another op's, it goes and the span gets its own; when the same op names it,
    no registration can hold both, and the op is refused."""
    drv, lib = vmm
    B, C = FakeVmm.BASE, FakeVmm.CHUNK
    r = _device.Regions(limit=8)
    r.cover(None, [(B, 600 * C)])
    assert registered(lib) == [(B, 600 * C)]
    r.cover(None, [(B + 599 * C, 501 * C)])
    assert registered(lib) == [(B + 599 * C, 501 * C)] and r.merged == 1
    r.cover(None, [(B, 599 * C)])
    assert registered(lib) == [(B, 599 * C), (B + 599 * C, 501 * C)]
    with pytest.raises(Exception, match="more than the 1024 one registration takes"):
        r.cover(None, [(B + 100, 16), (B + 598 * C, C + 16)])
    assert registered(lib) == [(B, 599 * C), (B + 599 * C, 501 * C)]


class FakeRequest:
    def __init__(self, bases):
        self._bases, self.settled = frozenset(bases), False

    def _settle(self):
        self.settled = True


def test_idle_waits_for_requests_naming_the_registrations(monkeypatch):
    """Before a merge deregisters registrations, the host-synchronous requests
    that name them are waited for; the others stay in flight."""
    gpu = _device.Gpu(streams=False)
    mine, other = FakeRequest({0x1000}), FakeRequest({0x9000})
    gpu.pending.update((mine, other))
    gpu._idle(None, [_device._Entry(0x1000, 0x1000, 0, 1, ((0x1000, 0x1000, 1, 1),))])
    assert mine.settled and not other.settled


def test_settled_request_keeps_its_outcome(monkeypatch):
    """A request the binding waited for itself: wait() still returns its result
    or raises its error, once."""
    import types

    import spclient
    calls = []
    fake = types.SimpleNamespace(spc_wait=lambda req, t: -6, spc_request_detail=lambda req: b"rank 1 sent 9",
                                 spc_request_release=lambda req: calls.append(req),
                                 spc_status_name=lambda st: b"SPC_ERR_MISMATCH", spc_status_message=lambda st: b"")
    monkeypatch.setattr(spclient, "lib", fake)
    gpu = _device.Gpu(streams=False)
    h = types.SimpleNamespace(_live=1)
    req = spclient.Request(h, 0x77, "result", None, gpu=gpu, bases=frozenset({0x1000}))
    assert set(gpu.pending) == {req}
    req._settle()
    assert calls == [0x77] and not gpu.pending and req.test()
    with pytest.raises(spclient.MismatchError, match="rank 1 sent 9"):
        req.wait()
    with pytest.raises(spclient.SpdError, match="already waited"):
        req.wait()


# ---------------------------------------------------------------- streams


class FakeStreamLib:
    """spc_stream_* as libspclient answers them; `refuse` makes create fail."""

    def __init__(self, refuse=0):
        self.live, self.next, self.refuse, self.calls = set(), 0x1000, refuse, []

    def spc_stream_create(self, h, cu_stream, s_p):
        if self.refuse:
            return self.refuse
        if len(self.live) >= 32:
            return -305
        self.next += 0x10
        self.live.add(self.next)
        ctypes.cast(s_p, ctypes.POINTER(ctypes.c_void_p))[0] = self.next
        return 0

    def spc_stream_destroy(self, s):
        self.live.remove(s)
        self.calls.append(("destroy", s))
        return 0

    def spc_stream_query(self, s):
        assert s in self.live, "query of a destroyed stream"
        self.calls.append(("query", s))
        return 0

    def spc_last_error(self, h):
        return b"the GPU cannot wait on 64-bit values"


class FakeStream:
    def __init__(self, handle, index=0):
        self.cuda_stream, self.device = handle, type("Dev", (), {"index": index})()


@pytest.fixture
def stream_fakes(monkeypatch):
    import contextlib
    import types
    lib = FakeStreamLib()
    monkeypatch.setattr(_device, "lib", lib)
    monkeypatch.setattr(_device._lib, "has_streams", True)
    fake_torch = types.SimpleNamespace(cuda=types.SimpleNamespace(device=lambda d: contextlib.nullcontext()))
    monkeypatch.setattr(_device, "_torch", lambda: fake_torch)
    return lib


def test_one_spc_stream_per_torch_stream(stream_fakes):
    st = _device.Streams(True)
    a, b = st.get(None, FakeStream(0)), st.get(None, FakeStream(0x77))
    assert a != b and st.get(None, FakeStream(0)) == a and len(stream_fakes.live) == 2
    assert st.get(None, FakeStream(0, index=1)) not in (a, b)          # another GPU's default stream


def test_streams_bounded_side_streams_kept(stream_fakes):
    """Past SPC_STREAMS_MAX the least recently used goes, never a pinned side
    stream; a request's check of a destroyed stream asks nothing of it."""
    st = _device.Streams(True)
    side = st.get(None, FakeStream(0x5), pin=True)
    first = st.get(None, FakeStream(0x100))
    for i in range(1, 40):
        st.get(None, FakeStream(0x100 + i))
    assert side in stream_fakes.live and first not in stream_fakes.live and len(st) == 32
    st.check(None, first)
    assert ("query", first) not in stream_fakes.calls


@pytest.mark.parametrize("status", [-5, -201])
def test_no_stream_order_means_host_synchronous(stream_fakes, status):
    stream_fakes.refuse = status
    st = _device.Streams(True)
    assert st.get(None, FakeStream(0)) is None and "64-bit" in st.why_not
    assert _device.Streams(False).get(None, FakeStream(0)) is None
