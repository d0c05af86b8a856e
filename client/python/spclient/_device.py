"""Ops on CUDA tensors: the GPU memory spd may touch and the stream an op follows.

Per handle, two caches, both bounded:

* Regions. spd reaches a process's GPU memory through registrations
  (spc_register_device), and one client's registrations must not overlap. The
  driver says what memory a tensor's pointer lies in (cuPointerGetAttributes);
  it is one of two kinds, told apart as libspclient tells them
  (IS_LEGACY_CUDA_IPC_CAPABLE):

  - a cudaMalloc allocation, as PyTorch's caching allocator makes by default (a
    segment holding many tensors). The allocation is registered whole, once,
    keyed by its base address: every tensor in it is then covered, and views
    that overlap never make overlapping registrations. The allocation's buffer
    id tells an allocation freed (torch.cuda.empty_cache) and made again at the
    same address, or over part of the old range, from the one registered;

  - cuMem memory, as PyTorch makes with expandable_segments:True: physical
    chunks (2 or 20 MiB) mapped on demand into a reservation far larger than
    what is mapped, so the allocation the driver names is no thing to register.
    A tensor's span is covered by a registration of the run of mapped chunks
    under it (each chunk's extent from cuMemGetAddressRange), or by an existing
    registration whose range contains the span. A run that would overlap
    registrations already made (a tensor across the edge of one) is merged with
    them into one registration over all their chunks (a span gets a run of its
    own where that would pass the 1024 chunks of one registration). They are
    deregistered first, once no op of the handle can still name them: streams
    drained, and a host-synchronous request naming them waited for (its wait()
    still gives its outcome; it was submitted before the op being built, so on
    ranks that submit in one order that wait holds nothing up). Each chunk's
    buffer id and memory block id are kept: a chunk the allocator unmapped, or
    unmapped and mapped anew at the same address, is caught by comparing them,
    for the chunks under a span on every op (one driver call per chunk) and for
    every registration on each miss, and its registration is dropped and made
    again. A span over address space with nothing mapped is refused
    (SPC_ERR_OUT_OF_BOUNDS). The chunks must have been made with the POSIX
    descriptor among their requested handle types (which torch versions do
    is not checked here); where not, libspclient refuses them saying so.

  Every miss first drops the registrations whose memory is gone, so spd does
  not keep freed memory imported; past `max_regions` registrations the least
  recently used are deregistered, at a moment when no op of the handle can
  still name them. The C library maps an op's pointers to (region, offset) by
  the region that contains them; as registrations never overlap and each span
  was covered whole, that is the registration made or found here.

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
import bisect
import collections
import ctypes
import weakref

from . import Status, _check, _lib, _raise
from ._lib import lib

# cuda.h's numbers, the driver's ABI.
_CU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2
_CU_POINTER_ATTRIBUTE_BUFFER_ID = 7
_CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10
_CU_POINTER_ATTRIBUTE_RANGE_START_ADDR = 11
_CU_POINTER_ATTRIBUTE_RANGE_SIZE = 12
_CU_POINTER_ATTRIBUTE_MAPPED = 13
_CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID = 20
_CU_MEMORYTYPE_DEVICE = 2

_SPC_STREAMS_MAX = 32
_SPC_DEVICE_MAX_CHUNKS = 1024     # the most cuMem chunks one spc_register_device takes


class _Query:
    """One cuPointerGetAttributes call for a fixed list of attributes."""

    def __init__(self, f, attrs):
        self._f, self._n = f, len(attrs)
        self._attrs = (ctypes.c_int * self._n)(*attrs)
        # Every attribute asked is at most 8 bytes; zeroed before each call, the
        # 4-byte ones (memory type, flags) read right from their 8-byte slots.
        self._vals = (ctypes.c_uint64 * self._n)()
        base = ctypes.addressof(self._vals)
        self._ptrs = (ctypes.c_void_p * self._n)(*(base + 8 * i for i in range(self._n)))

    def __call__(self, ptr):
        """The attributes' values at ptr, or None when the driver refuses the call."""
        ctypes.memset(self._vals, 0, ctypes.sizeof(self._vals))
        if self._f(self._n, self._attrs, self._ptrs, ptr) != 0:
            return None
        return tuple(self._vals)


class _Driver:
    """The driver calls the cache needs, through ctypes; torch has loaded the driver already."""

    def __init__(self, path="libcuda.so.1"):
        cuda = ctypes.CDLL(path)
        f = cuda.cuPointerGetAttributes
        f.restype = ctypes.c_int
        f.argtypes = [ctypes.c_uint, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p),
                      ctypes.c_uint64]
        self._range = cuda.cuMemGetAddressRange_v2
        self._range.restype = ctypes.c_int
        self._range.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_size_t), ctypes.c_uint64]
        self._where = _Query(f, (_CU_POINTER_ATTRIBUTE_MEMORY_TYPE, _CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
                                 _CU_POINTER_ATTRIBUTE_RANGE_START_ADDR, _CU_POINTER_ATTRIBUTE_RANGE_SIZE,
                                 _CU_POINTER_ATTRIBUTE_BUFFER_ID))
        self._ids = _Query(f, (_CU_POINTER_ATTRIBUTE_MAPPED, _CU_POINTER_ATTRIBUTE_BUFFER_ID,
                               _CU_POINTER_ATTRIBUTE_MEMORY_BLOCK_ID))
        # Drivers before the memory block id refuse a call that asks for it.
        self._ids_no_block = _Query(f, (_CU_POINTER_ATTRIBUTE_MAPPED, _CU_POINTER_ATTRIBUTE_BUFFER_ID))
        self._block_ids = True

    def allocation(self, ptr):
        """(base, size, buffer id, vmm) of the device memory ptr lies in, or None
        when ptr is not (or no longer) device memory. vmm: cuMem memory, for
        which base and size are the whole reservation and the buffer id is the
        mapping's at ptr; else the cudaMalloc allocation."""
        v = self._where(ptr)
        if v is None or v[0] != _CU_MEMORYTYPE_DEVICE:
            return None
        return v[2], v[3], v[4], not v[1]

    def chunk(self, at):
        """(base, size, buffer id, memory block id) of the cuMem chunk mapped at
        `at`, or None when nothing is mapped there. The block id is 0 where the
        driver has none; the buffer id alone then tells mappings apart."""
        ids = self.chunk_ids(at)
        if ids is None or not ids[0]:
            return None
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        if self._range(ctypes.byref(base), ctypes.byref(size), at) != 0:
            return None
        return base.value, size.value, ids[1], ids[2]

    def chunk_ids(self, at):
        """(mapped, buffer id, memory block id) at `at`, or None."""
        if self._block_ids:
            v = self._ids(at)
            if v is not None:
                return v
        v = self._ids_no_block(at)
        if v is None:
            return None
        self._block_ids = False    # the same call without the block id went through
        return v[0], v[1], 0


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
    """A registration: [base, base + size) as region `region`. chunks is None for
    a cudaMalloc allocation (buffer_id is the allocation's); for cuMem memory,
    the (base, size, buffer id, block id) of each chunk in address order, and
    starts their bases, for bisection."""
    __slots__ = ("base", "size", "buffer_id", "region", "chunks", "starts")

    def __init__(self, base, size, buffer_id, region, chunks=None):
        self.base, self.size, self.buffer_id, self.region, self.chunks = base, size, buffer_id, region, chunks
        self.starts = [c[0] for c in chunks] if chunks is not None else None

    @property
    def end(self):
        return self.base + self.size

    def chunks_under(self, lo, hi):
        """The chunks [lo, hi) touches."""
        i = max(bisect.bisect_right(self.starts, lo) - 1, 0)
        while i < len(self.chunks) and self.chunks[i][0] < hi:
            yield self.chunks[i]
            i += 1


def _chunk_same(c):
    """Whether the mapping at chunk c's base is still c's: the same mapping
    (buffer id) of the same physical allocation (memory block id)."""
    ids = _drv().chunk_ids(c[0])
    return ids is not None and ids[0] and ids[1] == c[2] and ids[2] == c[3]


class Regions:
    """Registrations by base address, least recently used first."""

    def __init__(self, limit):
        self.limit = limit
        self._by_base = collections.OrderedDict()
        self._vmm_bases = []        # bases of the cuMem registrations, sorted: they do not overlap
        self.registrations = 0      # spc_register_device calls made
        self.dropped = 0            # registrations dropped because their memory went away
        self.merged = 0             # cuMem registrations replaced by one over a longer run of chunks

    def __len__(self):
        return len(self._by_base)

    def entries(self):
        """(base, size, region) of every registration, by address."""
        return sorted((e.base, e.size, e.region) for e in self._by_base.values())

    def cover(self, h, spans, idle=None):
        """Registers, as needed, memory that the (ptr, nbytes) spans lie in;
        returns the set of the bases of the registrations that cover them.
        idle(entries) is called before registrations still in use are
        deregistered to merge them; it returns once no op can name them."""
        spans = [(ptr, nbytes) for ptr, nbytes in spans if nbytes]
        found = self._cover(h, spans, idle)
        # A cuMem registration is found sound for the chunks under a span only;
        # a later span's miss sweeps every registration whole and may drop it
        # (a chunk elsewhere in it remapped). After a sweep all are sound, so a
        # second pass finds each span covered.
        if not all(self._holds(e, ptr, nbytes) for e, (ptr, nbytes) in zip(found, spans)):
            found = self._cover(h, spans, idle)
        return {e.base for e in found}

    def _cover(self, h, spans, idle):
        """One pass of cover(): the registration found or made for each span."""
        found, used = [], set()
        for ptr, nbytes in spans:
            a = _drv().allocation(ptr)
            if a is None:
                _raise(Status.ERR_INVALID_ARG, f"a CUDA tensor at 0x{ptr:x} is not in device memory the driver "
                       "knows (managed or host memory goes through the host path)")
            base, size, buffer_id, vmm = a
            if vmm:
                e = self._cover_vmm(h, ptr, nbytes, used, idle)
            else:
                if ptr + nbytes > base + size:
                    _raise(Status.ERR_OUT_OF_BOUNDS, f"a CUDA tensor at 0x{ptr:x} of {nbytes} bytes runs past its "
                           f"allocation (0x{base:x} + {size} bytes)")
                e = self._by_base.get(base)
                if e is None or e.chunks is not None or e.size != size or e.buffer_id != buffer_id:
                    self._sweep(h)
                    e = self._register(h, base, size, buffer_id)
            self._by_base.move_to_end(e.base)
            used.add(e.base)
            found.append(e)
        return found

    def _holds(self, e, ptr, nbytes):
        """Whether registration e, or the one a merge made of it, still covers the span."""
        if self._by_base.get(e.base) is e:
            return True
        return e.chunks is not None and self._vmm_containing(ptr, ptr + nbytes) is not None

    def _register(self, h, base, size, buffer_id, chunks=None):
        r = ctypes.c_uint32()
        _check(h, lib.spc_register_device(h, ctypes.c_void_p(base), size, ctypes.byref(r)))
        self.registrations += 1
        e = self._by_base[base] = _Entry(base, size, buffer_id, r.value, chunks)
        if chunks is not None:
            bisect.insort(self._vmm_bases, base)
        return e

    # -- cuMem memory

    def _cover_vmm(self, h, ptr, nbytes, used, idle):
        """The cuMem registration that contains [ptr, ptr + nbytes), made if need
        be: the run of chunks under the span, merged with the registrations it
        overlaps. `used`: the bases the op's other spans lie in, kept up to date
        when a merge replaces one."""
        end = ptr + nbytes
        e = self._vmm_containing(ptr, end)
        if e is not None:
            if all(_chunk_same(c) for c in e.chunks_under(ptr, end)):
                return e
            self._drop(h, e)          # a chunk under the span was unmapped or mapped anew
            self.dropped += 1
        self._sweep(h)
        run = self._walk(ptr, nbytes, ptr, end)
        lo, hi = run[0][0], run[-1][0] + run[-1][1]
        over = self._vmm_overlapping(lo, hi)
        if over:
            # Every registration left is sound (swept), so the run and those it
            # overlaps are mapped back to back: one run covers them all.
            merged = self._walk(ptr, nbytes, min(lo, over[0].base), max(hi, over[-1].end))
            if len(merged) > _SPC_DEVICE_MAX_CHUNKS:
                # Too long for one registration: the others go and the span gets its own.
                if any(o.base in used for o in over):
                    _raise(Status.ERR_LIMIT, f"a CUDA tensor at 0x{ptr:x} of {nbytes} bytes overlaps the cuMem "
                           f"registration of another tensor of the op, and one over both would span {len(merged)} "
                           f"chunks, more than the {_SPC_DEVICE_MAX_CHUNKS} one registration takes")
                merged = run
            if idle is not None:
                idle(over)
            for o in over:
                self._drop(h, o)
                used.discard(o.base)
                self.merged += 1
            run = merged
        base = run[0][0]
        return self._register(h, base, run[-1][0] + run[-1][1] - base, 0, tuple(run))

    def _walk(self, ptr, nbytes, lo, hi):
        """The chunks mapped back to back over [lo, hi), in address order;
        raises where nothing is mapped (the span is the tensor's, for the message)."""
        run, at = [], lo
        while at < hi:
            c = _drv().chunk(at)
            if c is None:
                _raise(Status.ERR_OUT_OF_BOUNDS, f"a CUDA tensor at 0x{ptr:x} of {nbytes} bytes lies in cuMem "
                       f"address space with nothing mapped at 0x{at:x}: spd can reach only mapped memory")
            if not c[0] <= at < c[0] + c[1]:
                _raise(Status.ERR_DEVICE, f"cuMemGetAddressRange(0x{at:x}) gave 0x{c[0]:x} + {c[1]} bytes, which "
                       "does not hold it")
            run.append(c)
            at = c[0] + c[1]
        return run

    def _vmm_containing(self, lo, hi):
        i = bisect.bisect_right(self._vmm_bases, lo) - 1
        if i < 0:
            return None
        e = self._by_base[self._vmm_bases[i]]
        return e if hi <= e.end else None

    def _vmm_overlapping(self, lo, hi):
        """The cuMem registrations [lo, hi) overlaps, by address."""
        out = []
        i = max(bisect.bisect_right(self._vmm_bases, lo) - 1, 0)
        while i < len(self._vmm_bases) and self._vmm_bases[i] < hi:
            e = self._by_base[self._vmm_bases[i]]
            if e.end > lo:
                out.append(e)
            i += 1
        return out

    # -- dropping

    def _sweep(self, h):
        """Drops the registrations of memory that was freed or replaced: a
        cudaMalloc allocation gone or made again, a cuMem chunk unmapped or
        mapped anew."""
        for e in list(self._by_base.values()):
            if e.chunks is None:
                gone = _drv().allocation(e.base) != (e.base, e.size, e.buffer_id, False)
            else:
                gone = not all(_chunk_same(c) for c in e.chunks)
            if gone:
                self._drop(h, e)
                self.dropped += 1

    def _drop(self, h, e):
        del self._by_base[e.base]
        if e.chunks is not None:
            del self._vmm_bases[bisect.bisect_left(self._vmm_bases, e.base)]
        st = lib.spc_deregister(h, e.region)
        # spd drops by itself the regions of memory it saw made again at the
        # same address.
        if st not in (Status.OK, Status.ERR_BAD_REGION):
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

    def __init__(self, streams=True, max_regions=256):
        self.regions = Regions(max_regions)
        self.streams = Streams(streams)
        self._side = {}           # device index -> the side stream of the i-forms
        # Host-synchronous requests not yet waited, each with the bases of the
        # registrations its op names (Request._bases).
        self.pending = weakref.WeakSet()

    def status(self):
        return {"mode": "host-synchronous" if self.streams.why_not else "stream",
                "why": self.streams.why_not or "", "regions": len(self.regions),
                "registrations": self.regions.registrations, "dropped": self.regions.dropped,
                "merged": self.regions.merged, "streams": len(self.streams)}

    def _quiet(self, h):
        """True once no op of the handle can still name a region: every stream
        drained, no host-synchronous request outstanding."""
        if self.pending:
            return False
        self.streams.synchronize(h)
        return True

    def _idle(self, h, entries):
        """Returns once no op of the handle can still name `entries`: every
        stream drained, and the host-synchronous requests naming one of them
        waited for (their wait() still gives their outcome). Those ops were
        submitted before the op now being built, so on ranks that submit in one
        order they complete without it."""
        self.streams.synchronize(h)
        bases = {e.base for e in entries}
        for r in list(self.pending):
            if r._bases & bases:
                r._settle()

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
        used = self.regions.cover(h, [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors],
                                  idle=lambda entries: self._idle(h, entries))
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
            r = Request(handle, req.value, result, tensors, gpu=self, bases=used)
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
