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
