"""Ops on CUDA tensors: the GPU memory spd may touch and the stream an op follows.

Per handle, two caches, both bounded:

* Regions. spd reaches a process's GPU memory through registrations, which
  libspclient's cache makes and keeps (spc_device_cover; spclient.h, "device
  memory cache"): every op's tensors are covered before it is submitted. A
  cudaMalloc allocation (a segment of PyTorch's caching allocator) is
  registered whole, once, so views that overlap never make overlapping
  registrations; cuMem memory (expandable_segments:True) by the run of mapped
  chunks under a tensor, registrations a tensor straddles merged into one;
  memory freed and made again is caught by buffer and memory block ids and
  registered afresh; past `max_device_regions` the least recently used go. A
  registration is replaced or evicted only once no request in flight names it:
  the cache waits for those requests itself (their wait() still gives their
  outcome). The C library then maps an op's pointers to (region, offset) by
  the region that contains them.

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

from . import Status, _check, _lib, _raise
from ._lib import lib

_SPC_STREAMS_MAX = 32


def _torch():
    import torch
    return torch


class Regions:
    """The handle's registration cache of device memory, libspclient's."""

    def __init__(self, h, limit):
        self._h = h
        _check(h, lib.spc_device_cache_limit(h, limit))

    def cover(self, spans):
        """Covers the (ptr, nbytes) spans an op names; returns the region of each
        (0 for an empty one)."""
        arr = (_lib.DeviceSpan * len(spans))(*spans)
        regions = (ctypes.c_uint32 * len(spans))()
        _check(self._h, lib.spc_device_cover(self._h, arr, len(spans), regions))
        return list(regions)

    def set_limit(self, limit):
        _check(self._h, lib.spc_device_cache_limit(self._h, limit))

    def info(self):
        """regions (held now), limit, registrations (made), dropped (their memory
        went away), merged (cuMem registrations replaced by a longer run)."""
        i = _lib.new(_lib.DeviceCacheInfo)
        _check(self._h, lib.spc_device_cache_info(self._h, ctypes.byref(i)))
        return {name: getattr(i, name) for name, _ in i._fields_ if name != "struct_size"}

    def entries(self):
        """(base, size, region) of every registration, by address."""
        n = lib.spc_device_cache_entries(self._h, None, 0)
        out = (_lib.DeviceEntry * n)()
        n = min(n, lib.spc_device_cache_entries(self._h, out, n))
        return [(e.base, e.size, e.region) for e in out[:n]]

    def clear(self):
        """Deregisters every registration, each once no request in flight names it."""
        _check(self._h, lib.spc_device_cache_clear(self._h))


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
            if st == Status.ERR_LIMIT and self._by_key:
                self._destroy_lru(h)
                st = lib.spc_stream_create(h, ctypes.c_void_p(stream.cuda_stream or None), ctypes.byref(out))
        if st in (Status.ERR_NO_DEVICE, Status.ERR_UNSUPPORTED):
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
            if st != Status.OK and first is None:
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

    def __init__(self, h, streams=True, max_regions=256):
        self.regions = Regions(h, max_regions)
        self.streams = Streams(streams)
        self._side = {}           # device index -> the side stream of the i-forms

    def status(self):
        cache = self.regions.info()
        return {"mode": "host-synchronous" if self.streams.why_not else "stream",
                "why": self.streams.why_not or "", "regions": cache["regions"],
                "registrations": cache["registrations"], "dropped": cache["dropped"],
                "merged": cache["merged"], "streams": len(self.streams)}

    def side_stream(self, device):
        s = self._side.get(device.index)
        if s is None:
            s = self._side[device.index] = _torch().cuda.Stream(device=device)
        return s

    def run(self, handle, device, ifn, bfn, args, result, tensors, blocking, timeout_ms):
        """Submits an op whose tensors are all CUDA tensors of `device`: covers
        them with registrations, then runs it on the current stream (blocking forms),
        on the side stream (i-forms), or host-synchronously."""
        from . import Request
        torch = _torch()
        h = handle._c
        self.regions.cover([(t.data_ptr(), t.numel() * t.element_size()) for t in tensors])
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
            r = Request(handle, req.value, result, tensors)
            return r.wait(timeout_ms) if blocking else r

    def _on_side(self, handle, h, device, cur, side, ss, ifn, args, result, tensors):
        from . import Request
        torch = _torch()
        side.wait_stream(cur)
        self.streams.check(h, ss)
        _check(h, lib.spc_set_stream(h, ss))
        req = ctypes.c_void_p()
        st = ifn(h, *args, ctypes.byref(req))
        if st == Status.ERR_RING_FULL:     # back-pressure: let the side stream's ops drain
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
