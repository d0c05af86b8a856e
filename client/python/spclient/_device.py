"""Ops on CUDA tensors: the GPU memory spd may touch and the stream an op follows.

Per handle, two caches, both bounded:

* Regions. spd reaches a process's GPU memory through registrations
  (spc_register_device), and one client's registrations must not overlap. A
  CUDA tensor lies in an allocation of PyTorch's caching allocator (a cudaMalloc
  segment holding many tensors), so the allocation is registered whole, once,
  keyed by its base address: every tensor in it is then covered, and views that
  overlap never make overlapping registrations. The driver says which allocation
  a pointer lies in and that allocation's buffer id (cuPointerGetAttributes), so
  an allocation freed (torch.cuda.empty_cache) and made again at the same
  address, or over part of the old range, is told apart from the one
  registered. Every miss first drops the registrations whose allocations are
  gone, so spd does not keep freed memory imported; past `max_regions`
  allocations the least recently used are deregistered, at a moment when no op
  of the handle can still name them.

* Streams. An op on CUDA tensors follows the current torch stream of its
  device: one spc stream per torch stream (keyed by the device and the stream's
  handle; torch never destroys the streams of its pools), made current with
  spc_set_stream before the op is submitted. The blocking forms then return as
  soon as the op is enqueued on that stream, as torch.distributed's NCCL
  collectives do; errors spd finds later stay with the stream and are raised by
  the next op on it, by wait() of a request on it, or by Handle.synchronize().
  The i-forms run on a side stream of the device that first waits for the
  current stream, so the caller's kernels overlap the op; Request.wait() makes
  the then current stream wait for it (torch.distributed's work.wait()).

  Without stream order (a libspclient built before the stream API, spd or the
  GPU unable to do it, or attach(streams=False)), ops on CUDA tensors are
  host-synchronous: the current stream is synchronized before the op is
  submitted, and an op is complete, results written, when its wait returns.
"""
import collections
import ctypes

from . import _check, _lib, _raise
from ._lib import lib

# cuda.h's numbers, the driver's ABI.
_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
_CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12
_CU_MEMORYTYPE_DEVICE = 2

_SPC_ERR_INVALID_ARG = -1
_SPC_ERR_BAD_REGION = -3
_SPC_ERR_OUT_OF_BOUNDS = -4
_SPC_ERR_UNSUPPORTED = -5
_SPC_ERR_RING_FULL = -8
_SPC_ERR_NO_DEVICE = -201
_SPC_ERR_LIMIT = -305
_SPC_STREAMS_MAX = 32


class _Driver:
    """cuPointerGetAttributes through ctypes; torch has loaded the driver already."""

    def __init__(self):
        f = ctypes.CDLL("libcuda.so.1").cuPointerGetAttributes
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_uint, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p),
                      ctypes.c_uint64]
        self._f = f
        self._attrs = (ctypes.c_int * 4)(_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, _CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
                                         _CU_POINTER_ATTRIBUTE_RANGE_SIZE, _CU_POINTER_ATTRIBUTE_BUFFER_ID)
        # Every attribute asked is at most 8 bytes; zeroed before each call, the
        # 4-byte memory type reads right from its 8-byte slot.
        self._vals = (ctypes.c_uint64 * 4)()
        base = ctypes.addressof(self._vals)
        self._ptrs = (ctypes.c_void_p * 4)(*(base + 8 * i for i in range(4)))

    def allocation(self, ptr):
        """(base, size, buffer id) of the device allocation ptr lies in, or None
        when ptr is not (or no longer) device memory."""
        ctypes.memset(self._vals, 0, ctypes.sizeof(self._vals))
        if self._f(4, self._attrs, self._ptrs, ptr) != 0 or self._vals[0] != _CU_MEMORYTYPE_DEVICE:
            return None
        return self._vals[1], self._vals[2], self._vals[3]


_driver = None


def _drv():
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


def _torch():
    import torch
    return torch


class _Entry:
    __slots__ = ("base", "size", "buffer_id", "region")

    def __init__(self, base, size, buffer_id, region):
        self.base, self.size, self.buffer_id, self.region = base, size, buffer_id, region


class Regions:
    """Registered allocations by base address, least recently used first."""

    def __init__(self, limit):
        self.limit = limit
        self._by_base = collections.OrderedDict()
        self.registrations = 0      # spc_register_device calls made
        self.dropped = 0            # registrations dropped because their allocation went away

    def __len__(self):
        return len(self._by_base)

    def cover(self, h, spans):
        """Registers the allocations that the (ptr, nbytes) spans lie in, as needed;
        returns the set of their bases."""
        used = set()
        for ptr, nbytes in spans:
            if nbytes == 0:
                continue
            a = _drv().allocation(ptr)
            if a is None:
                _raise(_SPC_ERR_INVALID_ARG, f"a CUDA tensor at 0x{ptr:x} is not in device memory the driver "
                       "knows (managed or host memory goes through the host path)")
            base, size, buffer_id = a
            if ptr + nbytes > base + size:
                _raise(_SPC_ERR_OUT_OF_BOUNDS, f"a CUDA tensor at 0x{ptr:x} of {nbytes} bytes runs past its "
                       f"allocation (0x{base:x} + {size} bytes)")
            e = self._by_base.get(base)
            if e is None or e.size != size or e.buffer_id != buffer_id:
                self._sweep(h)
                r = ctypes.c_uint32()
                _check(h, lib.spc_register_device(h, ctypes.c_void_p(base), size, ctypes.byref(r)))
                self.registrations += 1
                e = self._by_base[base] = _Entry(base, size, buffer_id, r.value)
            self._by_base.move_to_end(base)
            used.add(base)
        return used

    def _sweep(self, h):
        """Drops the registrations of allocations that were freed or replaced."""
        for e in list(self._by_base.values()):
            if _drv().allocation(e.base) != (e.base, e.size, e.buffer_id):
                self._drop(h, e)
                self.dropped += 1

    def _drop(self, h, e):
        del self._by_base[e.base]
        st = lib.spc_deregister(h, e.region)
        # spd drops by itself the regions of an allocation it saw made again
        # at the same address.
        if st not in (0, _SPC_ERR_BAD_REGION):
            _check(h, st)

    def evict(self, h, keep):
        """Deregisters the least recently used quarter, none of `keep`."""
        n = max(1, len(self._by_base) // 4)
        for e in list(self._by_base.values()):
            if n == 0:
                break
            if e.base not in keep:
                self._drop(h, e)
                n -= 1

    def clear(self, h):
        for e in list(self._by_base.values()):
            self._drop(h, e)


class Streams:
    """spc streams by (device, torch stream handle), least recently used first."""

    def __init__(self, enabled):
        self._by_key = collections.OrderedDict()
        self._pinned = set()        # keys of the side streams: never destroyed before close
        self.why_not = None
        if not enabled:
            self.why_not = "stream order turned off (attach(streams=False))"
        elif not _lib.has_streams:
            self.why_not = f"{_lib.path} has no stream API (spc_stream_create)"

    def __len__(self):
        return len(self._by_key)

    def get(self, h, stream, pin=False):
        """The spc stream of torch stream `stream`, made on first use (pin: kept
        until close); None when ops must be host-synchronous (why_not says why)."""
        if self.why_not is not None:
            return None
        key = (stream.device.index, stream.cuda_stream)
        s = self._by_key.get(key)
        if s is not None:
            self._by_key.move_to_end(key)
            return s
        if len(self._by_key) >= _SPC_STREAMS_MAX:
            self._destroy_lru(h)
        out = ctypes.c_void_p()
        torch = _torch()
        with torch.cuda.device(stream.device):
            st = lib.spc_stream_create(h, ctypes.c_void_p(stream.cuda_stream or None), ctypes.byref(out))
            if st == _SPC_ERR_LIMIT and self._by_key:
                self._destroy_lru(h)
                st = lib.spc_stream_create(h, ctypes.c_void_p(stream.cuda_stream or None), ctypes.byref(out))
        if st in (_SPC_ERR_NO_DEVICE, _SPC_ERR_UNSUPPORTED):
            self.why_not = lib.spc_last_error(h).decode(errors="replace") or "spc_stream_create refused"
            return None
        _check(h, st)
        self._by_key[key] = out.value
        if pin:
            self._pinned.add(key)
        return out.value

    def _destroy_lru(self, h):
        """Frees the least recently used stream that is not pinned; raises what
        its ops reported since the last check."""
        key = next((k for k in self._by_key if k not in self._pinned), None)
        if key is None:
            return
        _check(h, lib.spc_stream_destroy(self._by_key.pop(key)))

    def check(self, h, s):
        """Raises the first error spd reported for stream s since the last check
        (nothing once s was destroyed: its errors were raised then)."""
        if s in self._by_key.values():
            _check(h, lib.spc_stream_query(s))

    def synchronize(self, h):
        """Waits for every stream's ops; raises the first error of any."""
        first = None
        for s in list(self._by_key.values()):
            st = lib.spc_stream_synchronize(s)
            if st != 0 and first is None:
                first = (st, lib.spc_last_error(h).decode(errors="replace"))
        if first is not None:
            _raise(*first)

    def destroy(self):
        self._pinned.clear()
        while self._by_key:
            _, s = self._by_key.popitem(last=False)
            lib.spc_stream_destroy(s)


class Gpu:
    """A handle's state for ops on CUDA tensors."""

    def __init__(self, streams=True, max_regions=256):
        self.regions = Regions(max_regions)
        self.streams = Streams(streams)
        self._side = {}           # device index -> the side stream of the i-forms
        self.pending = 0          # host-synchronous requests not yet waited

    def status(self):
        return {"mode": "host-synchronous" if self.streams.why_not else "stream",
                "why": self.streams.why_not or "", "regions": len(self.regions),
                "registrations": self.regions.registrations, "dropped": self.regions.dropped,
                "streams": len(self.streams)}

    def _quiet(self, h):
        """True once no op of the handle can still name a region: every stream
        drained, no host-synchronous request outstanding."""
        if self.pending:
            return False
        self.streams.synchronize(h)
        return True

    def side_stream(self, device):
        s = self._side.get(device.index)
        if s is None:
            s = self._side[device.index] = _torch().cuda.Stream(device=device)
        return s

    def run(self, handle, device, ifn, bfn, args, result, tensors, blocking, timeout_ms):
        """Submits an op whose tensors are all CUDA tensors of `device`: registers
        their allocations, then runs it on the current stream (blocking forms),
        on the side stream (i-forms), or host-synchronously."""
        from . import Request
        torch = _torch()
        h = handle._c
        used = self.regions.cover(h, [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors])
        if len(self.regions) > self.regions.limit and self._quiet(h):
            self.regions.evict(h, used)
        with torch.cuda.device(device):
            cur = torch.cuda.current_stream(device)
            s = self.streams.get(h, cur)
            if s is not None and blocking:
                self.streams.check(h, s)
                _check(h, lib.spc_set_stream(h, s))
                _check(h, bfn(h, *args, timeout_ms))
                return result
            if s is not None:
                side = self.side_stream(device)
                ss = self.streams.get(h, side, pin=True)
                if ss is not None:
                    return self._on_side(handle, h, device, cur, side, ss, ifn, args, result, tensors)
            # Host-synchronous: spd's stream reads what our kernels wrote.
            if _lib.has_streams:
                _check(h, lib.spc_set_stream(h, None))
            cur.synchronize()
            req = ctypes.c_void_p()
            _check(h, ifn(h, *args, ctypes.byref(req)))
            r = Request(handle, req.value, result, tensors, gpu=self)
            self.pending += 1
            return r.wait(timeout_ms) if blocking else r

    def _on_side(self, handle, h, device, cur, side, ss, ifn, args, result, tensors):
        from . import Request
        torch = _torch()
        side.wait_stream(cur)
        self.streams.check(h, ss)
        _check(h, lib.spc_set_stream(h, ss))
        req = ctypes.c_void_p()
        st = ifn(h, *args, ctypes.byref(req))
        if st == _SPC_ERR_RING_FULL:     # back-pressure: let the side stream's ops drain
            self.streams.check(h, ss)
            _check(h, lib.spc_stream_synchronize(ss))
            st = ifn(h, *args, ctypes.byref(req))
        _check(h, st)
        # The caching allocator must not give the tensors' memory to the current
        # stream before the side stream is done with it.
        for t in tensors:
            t.record_stream(side)
        ev = torch.cuda.Event()
        ev.record(side)
        return Request(handle, req.value, result, tensors, event=(ev, device, ss))

    def synchronize(self, h):
        self.streams.synchronize(h)

    def close(self):
        """Frees the streams (each synchronized first); errors are dropped, as the
        handle is going."""
        self.streams.destroy()
