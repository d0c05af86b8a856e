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
                return base, size, bid
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
