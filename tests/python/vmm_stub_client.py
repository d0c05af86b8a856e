"""A client process for test_vmm_stub.py: the binding's registration cache
(spclient._device.Regions, libspclient's spc_device_cover) over the stand-in
driver of tests/stubcuda.

It must be a process of its own, started with the stub's directory first in
LD_LIBRARY_PATH: this client and libspclient both load "libcuda.so.1" by name,
and libspclient does so once per process. It reads one JSON command per line
and answers each with one JSON line; offsets are from the start of the
reservation. Commands:

  reserve {chunks}         reserve that many chunks of address space
  map {i} / unmap {i}      a new physical allocation mapped at chunk i / unmapped
  cover {spans, limit?}    Regions.cover of [[offset, bytes], ...], the cache
                           bounded to `limit` registrations (default 256)
  deregister {region}      spc_deregister's status
  close                    deregister all, unmap, free, detach; then exit
Every answer to cover has the registrations after it, the counters, the
offsets of the registrations that hold the spans (used), and the error if one
was raised.
"""
import ctypes
import json
import os
import sys

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "client", "python"))

import spclient  # noqa: E402
from spclient import _device  # noqa: E402


class MemProp(ctypes.Structure):
    """CUmemAllocationProp."""
    _fields_ = [("type", ctypes.c_int), ("requested_handle_types", ctypes.c_int), ("location_type", ctypes.c_int),
                ("location_id", ctypes.c_int), ("win32_metadata", ctypes.c_void_p), ("alloc_flags", ctypes.c_uint64)]


class AccessDesc(ctypes.Structure):
    """CUmemAccessDesc."""
    _fields_ = [("location_type", ctypes.c_int), ("location_id", ctypes.c_int), ("flags", ctypes.c_int)]


CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_LOCATION_TYPE_DEVICE = 1, 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 1, 3


class Memory:
    """cuMem memory as PyTorch's expandable segments make it: one reservation,
    one physical allocation per chunk, each mapped and made accessible."""

    def __init__(self):
        self.cu = ctypes.CDLL("libcuda.so.1")
        name = ctypes.create_string_buffer(64)
        self.cu.cuDeviceGetName(name, 64, 0)
        if name.value != b"spd test stub":
            sys.exit(f"libcuda.so.1 is not the stand-in driver (device 0 is {name.value!r}): put "
                     "tests/stubcuda's directory first in LD_LIBRARY_PATH")
        self.prop = MemProp(CU_MEM_ALLOCATION_TYPE_PINNED, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                            CU_MEM_LOCATION_TYPE_DEVICE, 0, None, 0)
        g = ctypes.c_size_t()
        self.check(self.cu.cuMemGetAllocationGranularity(ctypes.byref(g), ctypes.byref(self.prop), 0),
                   "granularity")
        self.chunk = g.value
        self.va, self.n, self.handles = 0, 0, {}

    @staticmethod
    def check(rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: CUDA error {rc}")

    def reserve(self, chunks):
        va = ctypes.c_uint64()
        self.check(self.cu.cuMemAddressReserve(ctypes.byref(va), ctypes.c_size_t(chunks * self.chunk),
                                               ctypes.c_size_t(self.chunk), ctypes.c_uint64(0),
                                               ctypes.c_uint64(0)), "cuMemAddressReserve")
        self.va, self.n = va.value, chunks

    def map(self, i):
        h = ctypes.c_uint64()
        at = ctypes.c_uint64(self.va + i * self.chunk)
        size = ctypes.c_size_t(self.chunk)
        self.check(self.cu.cuMemCreate(ctypes.byref(h), size, ctypes.byref(self.prop), ctypes.c_uint64(0)),
                   "cuMemCreate")
        self.check(self.cu.cuMemMap(at, size, ctypes.c_size_t(0), h, ctypes.c_uint64(0)), "cuMemMap")
        access = AccessDesc(CU_MEM_LOCATION_TYPE_DEVICE, 0, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        self.check(self.cu.cuMemSetAccess(at, size, ctypes.byref(access), ctypes.c_size_t(1)), "cuMemSetAccess")
        self.handles[i] = h

    def unmap(self, i):
        self.check(self.cu.cuMemUnmap(ctypes.c_uint64(self.va + i * self.chunk), ctypes.c_size_t(self.chunk)),
                   "cuMemUnmap")
        self.check(self.cu.cuMemRelease(self.handles.pop(i)), "cuMemRelease")

    def free(self):
        for i in list(self.handles):
            self.unmap(i)
        if self.n:
            self.check(self.cu.cuMemAddressFree(ctypes.c_uint64(self.va), ctypes.c_size_t(self.n * self.chunk)),
                       "cuMemAddressFree")


def main():
    mem = Memory()
    h = spclient.attach(name="vmm-stub")
    regions = _device.Regions(h._c, 256)

    def state(**kw):
        info = regions.info()
        out = {"entries": [[b - mem.va, s, r] for b, s, r in regions.entries()],
               "registrations": info["registrations"], "dropped": info["dropped"], "merged": info["merged"]}
        out.update(kw)
        return out

    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "reserve":
            mem.reserve(cmd["chunks"])
            out = {"va": mem.va, "chunk": mem.chunk}
        elif op == "map":
            mem.map(cmd["i"])
            out = {}
        elif op == "unmap":
            mem.unmap(cmd["i"])
            out = {}
        elif op == "cover":
            regions.set_limit(cmd.get("limit", 256))
            spans = [(mem.va + off, n) for off, n in cmd["spans"]]
            try:
                used = set(regions.cover(spans))
                out = state(used=sorted(b - mem.va for b, _, r in regions.entries() if r in used))
            except spclient.SpdError as e:
                out = state(error=[e.status, e.detail])
        elif op == "deregister":
            out = {"status": _device.lib.spc_deregister(h._c, cmd["region"])}
        elif op == "close":
            regions.clear()
            mem.free()
            h.close()
            print(json.dumps({}), flush=True)
            return
        else:
            sys.exit(f"unknown command {op!r}")
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
