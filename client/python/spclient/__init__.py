"""spclient — Python binding of libspclient, the client library of spd.

    import spclient
    run = spclient.init()                       # under torchrun, srun or mpirun: attach, join the launch
    h, world = run.handle, run.world
    x = h.empty((n,), "float64")                # numpy array in the shared arena: zero copy
    h.allreduce(world, x)                       # in place; rank-order sum, same bits everywhere
    run.close()

Without a launcher, h = spclient.attach() and h.join(job_id, world_size, rank),
rank 0 having made job_id with h.job_create() and handed it to the others.

Arrays and tensors handed to an op must live in the handle's arena (h.empty) or in
memory registered with h.register(); anything else is refused with BadRegionError.
CUDA tensors need nothing of the kind: an op whose tensors are all on one GPU
has their memory registered by libspclient's cache (spc_device_cover: a
cudaMalloc allocation once; with expandable segments, the mapped chunks under
them) and runs in the order of the
device's current torch stream, returning without a host round trip; see
_device.py, h.synchronize() and h.gpu_status(). An op's tensors are all on one
GPU or all in host memory.
Every spd status other than success becomes an SpdError subclass carrying the
daemon's detail ("rank 2 (pid 4711) lost: ...").

When spd is killed or restarted under a job on one node, the next spd on the
socket takes the handle over and its ops go on, those on CUDA tensors in stream
order included (h.resume_info() counts the take-overs); only an in-place
all-reduce that may have run in part fails, with RestartedError, rather than
read what it wrote.

A handle belongs to one thread at a time and to the process that attached it.
An arena array that is no longer referenced (nor any view of it) returns its
memory by itself, so a training loop that makes new tensors every step does not
fill the arena; h.free() returns it at once. h.close() ends the handle's ops,
but the shared memory stays mapped while an arena array of it is alive: a
result read after close() is still the result, never a crash.
"""
import builtins
import collections
import ctypes
import enum
import weakref

from . import _lib
from ._lib import lib

__all__ = ["init", "attach", "Launch", "Handle", "Group", "Mesh", "Request", "ResumeInfo", "SpdError",
           "dtype_code"]

# ---------------------------------------------------------------- errors

# The statuses as libspclient names them (SPC_ERR_TIMEOUT is Status.ERR_TIMEOUT).
Status = enum.IntEnum("Status", {name.removeprefix("SPC_"): value for name, value in _lib.statuses().items()})
Status.__doc__ = "spc_status_t, from libspclient itself (spc_status_name)."


class SpdError(Exception):
    """A failed spd call: .status (a Status), .name, .detail. Each error status
    has its subclass (_BY_STATUS), which is also the matching built-in exception
    where there is one: SpdTimeoutError is a TimeoutError, InvalidArgumentError a
    ValueError, NoMemoryError a MemoryError, SpdPermissionError a PermissionError."""

    def __init__(self, status, detail):
        try:
            self.status = Status(status)
        except ValueError:          # a status newer than this library names
            self.status = status
        self.name = lib.spc_status_name(status).decode()
        self.detail = detail
        msg = lib.spc_status_message(status).decode()
        super().__init__(f"{self.name}: {detail or msg}")


# The built-in exception each error status also is, where one means the same.
_BUILTIN = {
    "SPC_ERR_INVALID_ARG": ValueError, "SPC_ERR_NO_MEMORY": MemoryError, "SPC_ERR_BAD_REGION": ValueError,
    "SPC_ERR_OUT_OF_BOUNDS": ValueError, "SPC_ERR_UNSUPPORTED": NotImplementedError,
    "SPC_ERR_MISMATCH": ValueError, "SPC_ERR_TIMEOUT": TimeoutError, "SPC_ERR_RING_FULL": BlockingIOError,
    "SPC_ERR_NOT_FOUND": LookupError, "SPC_ERR_PEER_LOST": ConnectionError, "SPC_ERR_TRANSPORT": ConnectionError,
    "SPC_ERR_DAEMON_LOST": ConnectionError, "SPC_ERR_CONNECT": ConnectionError, "SPC_ERR_PERMISSION": PermissionError,
}


def _error_class(status):
    """SPC_ERR_PEER_LOST -> PeerLostError; Spd in front of a built-in's name
    (SpdTimeoutError); InvalidArgumentError, as it was first called."""
    words = status.name.removeprefix("ERR_").split("_")
    name = "InvalidArgument" if status == Status.ERR_INVALID_ARG else "".join(w.capitalize() for w in words)
    name += "Error"
    if hasattr(builtins, name):
        name = "Spd" + name
    builtin = _BUILTIN.get(f"SPC_{status.name}")
    bases = (SpdError, builtin) if builtin else (SpdError,)
    doc = f"SPC_{status.name}: {lib.spc_status_message(status).decode()}"
    return type(name, bases, {"__doc__": doc, "__module__": __name__})


_BY_STATUS = {s: _error_class(s) for s in Status if s < 0}
globals().update({c.__name__: c for c in _BY_STATUS.values()})
__all__ += ["Status"] + [c.__name__ for c in _BY_STATUS.values()]


def _error(status, detail):
    """The exception of `status` (its SpdError subclass), with spd's detail."""
    return _BY_STATUS.get(status, SpdError)(status, detail)


def _raise(status, detail):
    raise _error(status, detail)


def _check(h, status):
    if status != Status.OK:
        _raise(status, lib.spc_last_error(h).decode(errors="replace"))


# ---------------------------------------------------------------- enums
# The values of spclient.h's enums (tests/python/test_abi.py holds them to C's).


class Dtype(enum.IntEnum):
    """spc_dtype_t"""
    F32, F64, F16, BF16, I32, I64, U8 = 1, 2, 3, 4, 5, 6, 7


class ReduceOp(enum.IntEnum):
    """spc_redop_t; ops also take its name ("sum")."""
    SUM, MAX, MIN = 0, 1, 2


class Direction(enum.IntEnum):
    """spc_a2a_direction_t"""
    SEQ_TO_HEAD, HEAD_TO_SEQ = 0, 1


class Layout(enum.IntEnum):
    """spc_layout_t"""
    BSHD, SBHD = 0, 1


class HeadsKind(enum.IntEnum):
    """spc_heads_kind_t"""
    Q, KV = 0, 1


SEQ_TO_HEAD, HEAD_TO_SEQ = Direction.SEQ_TO_HEAD, Direction.HEAD_TO_SEQ
BSHD, SBHD = Layout.BSHD, Layout.SBHD
HEADS_Q, HEADS_KV = HeadsKind.Q, HeadsKind.KV
SUM_REPLICAS = 1                       # SPC_A2A_SUM_REPLICAS
A2A_MAX_TENSORS = 8                    # SPC_A2A_MAX_TENSORS
SHIFT_LINEAR, SHIFT_REVERSE = 1, 2     # SPC_SHIFT_*
__all__ += ["Dtype", "ReduceOp", "Direction", "Layout", "HeadsKind"]

_CODES = {"float32": Dtype.F32, "float64": Dtype.F64, "float16": Dtype.F16, "bfloat16": Dtype.BF16,
          "int32": Dtype.I32, "int64": Dtype.I64, "uint8": Dtype.U8}
_NUMPY = {Dtype.F32: "float32", Dtype.F64: "float64", Dtype.F16: "float16", Dtype.I32: "int32",
          Dtype.I64: "int64", Dtype.U8: "uint8"}


def _redop(op):
    return ReduceOp[op.upper()] if isinstance(op, str) else ReduceOp(op)


def _torch():
    try:
        import torch
        return torch
    except ImportError:
        return None


def dtype_code(dtype):
    """The spd dtype of a numpy or torch dtype (or its name)."""
    name = str(dtype).replace("torch.", "")
    if name not in _CODES:
        raise TypeError(f"spd has no dtype for {dtype}")
    return _CODES[name]


def _is_torch(x):
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def _ptr(x):
    if _is_torch(x):
        if x.device.type not in ("cpu", "cuda"):
            raise TypeError(f"spd moves host memory and CUDA memory, not {x.device.type} tensors")
        if not x.is_contiguous():
            raise ValueError("tensor must be contiguous")
        return x.data_ptr()
    if not x.flags["C_CONTIGUOUS"]:
        raise ValueError("array must be C-contiguous")
    return x.ctypes.data


def _nbytes(x):
    return x.numel() * x.element_size() if _is_torch(x) else x.nbytes


def _count(x):
    return x.numel() if _is_torch(x) else x.size


def _dtype_of(x):
    return dtype_code(x.dtype)


def _device_of(tensors):
    """The torch device of an op whose tensors are all CUDA tensors of one GPU;
    None when they are all in host memory."""
    dev, host = None, False
    for x in tensors:
        if _is_torch(x) and x.is_cuda:
            if dev is not None and x.device != dev:
                raise ValueError(f"an op's CUDA tensors must be on one GPU: {dev} and {x.device}")
            dev = x.device
        else:
            host = True
    if dev is not None and host:
        raise ValueError(f"an op's tensors are all on one GPU or all in host memory: {dev} and host memory")
    return dev


def _a2a_check_shapes(i, send, recv, heads, kind, P, direction, seq_len, batch, layout, kv_heads):
    """Raises ValueError unless send and recv have the shapes the all-to-all reads
    and writes on P ranks: ceil(seq_len / P) rows a rank on the sequence side and
    the local heads, dummies included, on the head side ([B, S, H, D] for BSHD,
    [S, B, H, D] for SBHD). spd writes the whole extent its own plan gives; a
    smaller buffer would be written past. A head count that cannot be dealt is
    left to spd, which says why."""
    local = lib.spc_a2a_local_heads(heads, kind, kv_heads, P)
    if local == 0:
        return
    s_loc = -(-seq_len // P)
    dim = send.shape[-1] if len(send.shape) > 0 else 0

    def shape(rows, h):
        return (batch, rows, h, dim) if layout == BSHD else (rows, batch, h, dim)

    seq_side, head_side = shape(s_loc, heads), shape(seq_len, local)
    want = {"send": seq_side if direction == SEQ_TO_HEAD else head_side,
            "recv": head_side if direction == SEQ_TO_HEAD else seq_side}
    layout_name = "BSHD" if layout == BSHD else "SBHD"
    for name, x in (("send", send), ("recv", recv)):
        if tuple(x.shape) != want[name]:
            raise ValueError(f"alltoall tensor {i}: {name} has shape {tuple(x.shape)}; the op needs {want[name]} "
                             f"({layout_name}: {s_loc} rows a rank of {seq_len} on {P} ranks, {local} local heads "
                             f"of {heads}, dummies included)")


# ---------------------------------------------------------------- groups, requests


class Group:
    """A group ops run on: its id, size, and this rank's place in it."""

    def __init__(self, gid, size, rank):
        self.id, self.size, self.rank = gid, size, rank

    def __repr__(self):
        return f"Group(id={self.id}, size={self.size}, rank={self.rank})"


class Mesh:
    """world = dp x sp, sp = ring x ulysses: degrees, groups and this rank's coordinates."""

    def __init__(self, m):
        self.id = m.id
        self.dp, self.sp, self.ulysses, self.ring = m.dp, m.sp, m.ulysses, m.ring
        self.dp_group = Group(m.dp_group, m.dp, m.dp_rank)
        self.sp_group = Group(m.sp_group, m.sp, m.sp_rank)
        self.ulysses_group = Group(m.ulysses_group, m.ulysses, m.ulysses_rank)
        self.ring_group = Group(m.ring_group, m.ring, m.ring_rank)
        self.explain = m.explain.decode()

    def __repr__(self):
        return f"Mesh(dp={self.dp}, sp={self.sp}, ulysses={self.ulysses}, ring={self.ring})"


class Request:
    """An op in flight. wait() returns its result (or raises); keep it until then.

    An op on CUDA tensors in stream order runs on a side stream: wait() does
    not block the host but makes the current stream wait for the op (as
    torch.distributed's work.wait()), and raises an error spd has reported for
    the side stream so far; an error found later comes with the next op or
    Handle.synchronize()."""

    def __init__(self, handle, req, result, keep, event=None):
        self._h, self._req, self.result, self._keep = handle, req, result, keep
        self._event = event     # (torch event, device, spc stream) of an op on a side stream

    def test(self):
        """True once the op completed (successfully, or wait() will raise)."""
        if self._event is not None:
            return self._event[0].query()
        return lib.spc_test(self._req) != Status.IN_PROGRESS

    def wait(self, timeout_ms=-1):
        if self._req is None or self._h._live is None:
            raise _error(Status.ERR_INVALID_ARG, "the request was already waited for, or its handle is gone")
        if self._event is not None:
            ev, device, stream = self._event
            _torch().cuda.current_stream(device).wait_event(ev)
            # The op completes in stream order; its error also goes to the stream.
            lib.spc_request_release(self._req)
            self._req = self._keep = self._event = None
            self._h._gpu.streams.check(self._h._c, stream)
            return self.result
        st = lib.spc_wait(self._req, timeout_ms)
        if st == Status.IN_PROGRESS:
            raise _error(Status.ERR_TIMEOUT, f"no completion within {timeout_ms} ms (the op stays queued in spd)")
        detail = lib.spc_request_detail(self._req).decode(errors="replace")
        lib.spc_request_release(self._req)
        self._req = None
        self._keep = None
        if st != Status.OK:
            _raise(st, detail)
        return self.result

    def __del__(self):
        if getattr(self, "_req", None) is not None and self._h._live is not None:
            lib.spc_request_release(self._req)


# ---------------------------------------------------------------- handle


def attach(socket=None, name=None, arena_bytes=0, timeout_ms=0, streams=True, max_device_regions=256):
    """Connects to spd; see spc_attach(). streams=False makes ops on CUDA tensors
    host-synchronous; max_device_regions bounds the GPU registrations kept
    registered (the least recently used go first)."""
    return Handle(socket, name, arena_bytes, timeout_ms, streams, max_device_regions)


class Launch:
    """A rank of a launch, as spclient.init() started it: .handle, .world (the
    world group), .rank, .world_size, .local_rank, .local_world_size, .nodes
    (0 where the launcher does not say), .job (the job name), .launch (the
    launch id) and .launcher ("torchrun", "openmpi", "slurm"). close(), or a
    with block, closes the handle."""

    def __init__(self, handle, c):
        self.handle = handle
        self.rank, self.world_size = c.rank, c.world_size
        self.local_rank, self.local_world_size, self.nodes = c.local_rank, c.local_world_size, c.nodes
        self.launcher, self.job, self.launch = c.launcher.decode(), c.job.decode(), c.launch.decode()
        self.world = Group(c.world, c.world_size, c.rank)

    def close(self):
        self.handle.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"Launch({self.launcher}, job={self.job!r}, rank={self.rank}, world_size={self.world_size})"


def init(socket=None, name=None, arena_bytes=0, timeout_ms=60000, streams=True, max_device_regions=256):
    """Starts this rank of a torchrun, srun or mpirun launch in one call: reads
    the launcher's environment, attaches to spd and joins the launch's named
    job, waiting up to timeout_ms for the other ranks (spc_init_from_env).
    $SPC_JOB names the job instead of the launch id. Nothing has to be set up
    between the ranks: on several nodes each rank attaches to its own node's
    spd (socket, else $SPC_SOCKET), and the nodes' spd, linked as peers, join
    them in the job that lives where rank 0 joined. Returns a Launch. On GPUs, call torch.cuda.set_device()
    first: the join tells spd the rank's GPU."""
    p = _attach_params(socket, name, arena_bytes, timeout_ms=0)
    c = _lib.new(_lib.Launch)
    h = ctypes.c_void_p()
    st = lib.spc_init_from_env(ctypes.byref(p), timeout_ms, ctypes.byref(c), ctypes.byref(h))
    if st != Status.OK:
        _raise(st, lib.spc_last_error(None).decode(errors="replace"))
    return Launch(Handle._adopt(h.value, streams, max_device_regions), c)


def _attach_params(socket, name, arena_bytes, timeout_ms):
    p = _lib.new(_lib.AttachParams, arena_bytes=arena_bytes, timeout_ms=timeout_ms)
    if socket:
        p.socket_path = socket.encode()
    p.name = (name or "python").encode()
    return p


ResumeInfo = collections.namedtuple("ResumeInfo", "resumes replayed retried last_gap_ms")


class Handle:
    def __init__(self, socket=None, name=None, arena_bytes=0, timeout_ms=0, streams=True, max_device_regions=256):
        self._start(None, streams, max_device_regions)   # what close() needs, should attach fail
        p = _attach_params(socket, name, arena_bytes, timeout_ms)
        h = ctypes.c_void_p()
        st = lib.spc_attach(ctypes.byref(p), ctypes.byref(h))
        if st != Status.OK:
            _raise(st, lib.spc_last_error(None).decode(errors="replace"))
        self._start(h.value, streams, max_device_regions)

    @classmethod
    def _adopt(cls, c_handle, streams, max_device_regions):
        """A Handle for a C handle attached elsewhere (spc_init_from_env)."""
        self = cls.__new__(cls)
        self._start(c_handle, streams, max_device_regions)
        return self

    def _start(self, c_handle, streams, max_device_regions):
        self._gpu = None           # _device.Gpu, made by the first op on CUDA tensors
        self._gpu_args = (streams, max_device_regions)
        self._allocs = {}          # arena address -> weakref.finalize that frees it
        self._h = self._live = c_handle   # _h: None once closed; _live: until detached

    @property
    def daemon_pid(self):
        """The pid of the spd serving the handle: another after a restart took it over."""
        return lib.spc_daemon_pid(self._live) if self._live is not None else None

    def resume_info(self):
        """What restarts of spd did to the handle (spc_resume_info): resumes (times a
        new spd took it over), replayed (ops submitted again), retried (of them, ops
        the old spd had taken, which may have run) and last_gap_ms (the last
        take-over, from noticing spd gone to the ops submitted again)."""
        info = _lib.new(_lib.ResumeInfo)
        _check(self._c, lib.spc_resume_info(self._c, ctypes.byref(info)))
        return ResumeInfo(info.resumes, info.replayed, info.retried, info.last_gap_ms)

    # -- lifetime
    def close(self):
        """Ends the handle: no op may be submitted after it. Ops on CUDA tensors are
        waited for first (their streams are synchronized and freed). The detach
        itself (which unmaps the arena) waits until no arena array of the handle
        is alive."""
        if self._gpu is not None and self._h is not None:
            self._gpu.close()
        self._h = None
        if not self._allocs:
            self._detach()

    @property
    def _c(self):
        """The C handle, for an op; raises once the handle is closed."""
        if self._h is None:
            raise _error(Status.ERR_INVALID_ARG, "the handle is closed")
        return self._h

    def _detach(self):
        if self._live is not None:
            lib.spc_detach(self._live)
            self._live = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        self.close()

    # -- jobs and meshes
    def job_create(self, allow_uids=()):
        """A new job, owned by this process's user; the users (uids) in
        allow_uids may join it too. Others are refused (SPC_ERR_PERMISSION)."""
        uids = (ctypes.c_uint32 * len(allow_uids))(*allow_uids)
        params = _lib.new(_lib.JobParams, allow_uids=uids, nallow_uids=len(allow_uids))
        buf = ctypes.create_string_buffer(_lib.SPC_JOB_ID_MAX)
        _check(self._c, lib.spc_job_create_with(self._c, ctypes.byref(params), buf, len(buf)))
        return buf.value.decode()

    def join(self, job_id, world_size, rank, timeout_ms=60000):
        g = ctypes.c_uint32()
        _check(self._c, lib.spc_job_join(self._c, job_id.encode(), world_size, rank, timeout_ms, ctypes.byref(g)))
        return Group(g.value, world_size, rank)

    def join_named(self, name, world_size, rank, launch="", timeout_ms=60000):
        """Joins the job `name` of this user, made by its first join and ended by its
        last rank's leaving; a join of another `launch` id while it lives is
        refused (spc_job_join_named). spclient.init() does this from the launcher."""
        g = ctypes.c_uint32()
        _check(self._c, lib.spc_job_join_named(self._c, name.encode(), launch.encode(), world_size, rank, timeout_ms,
                                               ctypes.byref(g)))
        return Group(g.value, world_size, rank)

    def mesh(self, sp, heads, kv_heads=0, ulysses=0, ring=0):
        spec = _lib.new(_lib.MeshSpec, sp=sp, heads=heads, kv_heads=kv_heads, ulysses=ulysses, ring=ring)
        m = _lib.Mesh()
        _check(self._c, lib.spc_mesh_create(self._c, ctypes.byref(spec), ctypes.byref(m)))
        return Mesh(m)

    # -- memory
    def empty(self, shape, dtype="float32", device=None):
        """An uninitialised array in the shared arena: a torch tensor when dtype is a
        torch dtype, else a numpy array. With a CUDA device: torch.empty on it (ops
        register such memory themselves)."""
        if isinstance(shape, int):
            shape = (shape,)
        code = dtype_code(dtype)
        if device is not None and str(device) != "cpu":
            torch = _torch()
            return torch.empty(shape, dtype=getattr(torch, str(dtype).replace("torch.", "")), device=device)
        count = 1
        for d in shape:
            count *= d
        if count == 0 and "torch." in str(dtype):
            return _torch().empty(shape, dtype=dtype)   # holds no memory: nothing of it is in the arena
        size = lib.spc_dtype_size(code) * count
        addr = lib.spc_alloc(self._c, max(size, 1))
        if not addr:
            raise _error(Status.ERR_NO_MEMORY, f"arena full: {size} bytes do not fit (attach with a larger arena_bytes)")
        raw = (ctypes.c_uint8 * max(size, 1)).from_address(addr)
        # The tensor's storage (or the array's base) holds raw; when the last view
        # goes, raw goes and its memory returns to the arena.
        self._allocs[addr] = weakref.finalize(raw, self._release, addr)
        if "torch." in str(dtype):
            torch = _torch()
            return torch.frombuffer(raw, dtype=dtype, count=count).reshape(shape)
        import numpy as np
        return np.frombuffer(raw, dtype=_NUMPY[code], count=count).reshape(shape)

    def zeros(self, shape, dtype="float32", device=None):
        x = self.empty(shape, dtype, device)
        x[...] = 0
        return x

    def free(self, x):
        """Returns an arena array's memory; x must not be used afterwards."""
        fin = self._allocs.get(_ptr(x))
        if fin is not None:
            fin()

    def _release(self, addr):
        if self._allocs.pop(addr, None) is None:
            return
        if self._h is not None:
            lib.spc_free(self._h, ctypes.c_void_p(addr))
        elif not self._allocs:
            self._detach()          # closed, and the last arena array just went

    def in_arena(self, x):
        """True when x starts an arena allocation of this handle."""
        return _ptr(x) in self._allocs

    def register(self, x):
        """Registers x's host memory (not in the arena) so ops may name it; returns
        the region. CUDA tensors need no registration: ops make their own."""
        if _is_torch(x) and x.is_cuda:
            raise TypeError("ops register CUDA tensors' allocations themselves; h.register() takes host memory")
        r = ctypes.c_uint32()
        _check(self._c, lib.spc_register(self._c, ctypes.c_void_p(_ptr(x)), _nbytes(x), ctypes.byref(r)))
        return r.value

    def deregister(self, region):
        _check(self._c, lib.spc_deregister(self._c, region))

    # -- GPU
    def _gpu_state(self):
        if self._gpu is None:
            from ._device import Gpu
            self._gpu = Gpu(self._c, *self._gpu_args)
        return self._gpu

    def synchronize(self):
        """Waits until spd has done every op on CUDA tensors submitted so far (their
        CUDA streams synchronized) and raises the first error spd reported for
        them. A no-op for host memory, whose ops are done when they return."""
        if self._gpu is not None:
            self._gpu.synchronize(self._c)

    def gpu_status(self):
        """How ops on CUDA tensors run: mode "stream" or "host-synchronous" (and
        why), allocations registered now, registrations made and dropped so far,
        spc streams."""
        return self._gpu_state().status()

    def forget_device_memory(self):
        """Deregisters every GPU allocation the handle registered (after its ops are
        done), so spd holds none imported; e.g. after torch.cuda.empty_cache()."""
        if self._gpu is not None:
            self._gpu.synchronize(self._c)
            self._gpu.regions.clear()

    # -- ops: the i-forms return a Request, the plain forms wait
    def _submit(self, fn, args, result, keep):
        req = ctypes.c_void_p()
        _check(self._c, fn(self._c, *args, ctypes.byref(req)))
        return Request(self, req.value, result, keep)

    def _op(self, ifn, bfn, args, result, tensors, blocking, timeout_ms=-1):
        """Runs an op on host memory (i-form, waited when blocking) or on CUDA
        tensors (_device.Gpu.run)."""
        device = _device_of(tensors)
        if device is not None:
            return self._gpu_state().run(self, device, ifn, bfn, args, result, tensors, blocking, timeout_ms)
        r = self._submit(ifn, args, result, tensors)
        return r.wait(timeout_ms) if blocking else r

    def ibarrier(self, group):
        return self._submit(lib.spc_ibarrier, (group.id,), None, None)

    def barrier(self, group, timeout_ms=-1):
        return self.ibarrier(group).wait(timeout_ms)

    def _allreduce(self, group, send, recv, op, blocking, timeout_ms=-1):
        recv = send if recv is None else recv
        if _count(recv) != _count(send) or _dtype_of(recv) != _dtype_of(send):
            raise ValueError("send and recv differ in size or dtype")
        args = (group.id, ctypes.c_void_p(_ptr(send)), ctypes.c_void_p(_ptr(recv)), _count(send),
                _dtype_of(send), _redop(op))
        return self._op(lib.spc_iallreduce, lib.spc_allreduce, args, recv, (send, recv), blocking, timeout_ms)

    def iallreduce(self, group, send, recv=None, op="sum"):
        return self._allreduce(group, send, recv, op, False)

    def allreduce(self, group, send, recv=None, op="sum", timeout_ms=-1):
        """Element-wise sum/max/min (a ReduceOp or its name) over the group, in rank order; returns recv
        (send when None)."""
        return self._allreduce(group, send, recv, op, True, timeout_ms)

    def _reduce_scatter(self, group, send, recv, op, blocking, timeout_ms=-1):
        if _count(send) != group.size * _count(recv) or _dtype_of(recv) != _dtype_of(send):
            raise ValueError(f"reduce_scatter: send holds {_count(send)} elements; {group.size} ranks' blocks of "
                             f"recv's {_count(recv)} need {group.size * _count(recv)}, of one dtype")
        args = (group.id, ctypes.c_void_p(_ptr(send)), ctypes.c_void_p(_ptr(recv)), _count(recv),
                _dtype_of(send), _redop(op))
        return self._op(lib.spc_ireduce_scatter, lib.spc_reduce_scatter, args, recv, (send, recv), blocking,
                        timeout_ms)

    def ireduce_scatter(self, group, send, recv, op="sum"):
        return self._reduce_scatter(group, send, recv, op, False)

    def reduce_scatter(self, group, send, recv, op="sum", timeout_ms=-1):
        """Element-wise sum/max/min of every rank's send (group.size blocks of recv's size), in rank
        order; block r of it lands in rank r's recv (MPI_Reduce_scatter_block). Returns recv."""
        return self._reduce_scatter(group, send, recv, op, True, timeout_ms)

    def _allgather(self, group, send, recv, blocking, timeout_ms=-1):
        if _count(recv) != group.size * _count(send):
            raise ValueError(f"allgather: recv holds {_count(recv)} elements; {group.size} ranks of "
                             f"{_count(send)} need {group.size * _count(send)}")
        args = (group.id, ctypes.c_void_p(_ptr(send)), ctypes.c_void_p(_ptr(recv)), _count(send), _dtype_of(send))
        return self._op(lib.spc_iallgather, lib.spc_allgather, args, recv, (send, recv), blocking, timeout_ms)

    def iallgather(self, group, send, recv):
        return self._allgather(group, send, recv, False)

    def allgather(self, group, send, recv, timeout_ms=-1):
        return self._allgather(group, send, recv, True, timeout_ms)

    def _broadcast(self, group, buf, root, blocking, timeout_ms=-1):
        args = (group.id, ctypes.c_void_p(_ptr(buf)), _count(buf), _dtype_of(buf), root)
        return self._op(lib.spc_ibroadcast, lib.spc_broadcast, args, buf, (buf,), blocking, timeout_ms)

    def ibroadcast(self, group, buf, root):
        return self._broadcast(group, buf, root, False)

    def broadcast(self, group, buf, root, timeout_ms=-1):
        return self._broadcast(group, buf, root, True, timeout_ms)

    def ialltoall(self, group, tensors, direction, seq_len, batch=1, layout=BSHD, kv_heads=0):
        """Ulysses all-to-all. tensors: (send, recv, heads, kind[, flags]) tuples, each
        [B, S, H, D] (BSHD) or [S, B, H, D] (SBHD); head_dim is the last dimension.
        On the sequence side S is ceil(seq_len / P), on the head side H is
        local_heads(heads, kind, kv_heads, P); other shapes are a ValueError that
        names the one the op needs, before anything is submitted."""
        return self._alltoall(group, tensors, direction, seq_len, batch, layout, kv_heads, False)

    def _alltoall(self, group, tensors, direction, seq_len, batch, layout, kv_heads, blocking, timeout_ms=-1):
        if not 1 <= len(tensors) <= A2A_MAX_TENSORS:
            raise ValueError(f"1 to {A2A_MAX_TENSORS} tensors")
        for i, t in enumerate(tensors):
            _a2a_check_shapes(i, t[0], t[1], t[2], t[3], group.size, direction, seq_len, batch, layout, kv_heads)
        d = _lib.new(_lib.AlltoallDesc, group=group.id, dtype=_dtype_of(tensors[0][0]), direction=direction,
                     layout=layout, batch=batch, seq_len=seq_len, kv_heads=kv_heads, ntensors=len(tensors))
        for i, t in enumerate(tensors):
            send, recv, heads, kind = t[:4]
            slot = _lib.A2ATensor(_ptr(send), _ptr(recv), heads, send.shape[-1], kind, t[4] if len(t) > 4 else 0)
            if i < 4:
                d.tensors[i] = slot
            else:
                d.more_tensors[i - 4] = slot
        recvs = [t[1] for t in tensors]
        return self._op(lib.spc_ialltoall, lib.spc_alltoall, (ctypes.byref(d),), recvs,
                        [x for t in tensors for x in t[:2]], blocking, timeout_ms)

    def alltoall(self, group, tensors, direction, seq_len, batch=1, layout=BSHD, kv_heads=0, timeout_ms=-1):
        return self._alltoall(group, tensors, direction, seq_len, batch, layout, kv_heads, True, timeout_ms)

    def _alltoallv(self, group, send, recv, send_counts, recv_counts, blocking, timeout_ms=-1):
        P = group.size
        if len(send_counts) != P or len(recv_counts) != P:
            raise ValueError(f"alltoallv: {len(send_counts)} send and {len(recv_counts)} recv counts; "
                             f"the group has {P} ranks")
        if _dtype_of(recv) != _dtype_of(send):
            raise ValueError("alltoallv: send and recv differ in dtype")
        # Counts are rows of the first dimension; spd counts elements.
        row = _count(send) // send.shape[0] if send.shape[0] else _count(recv) // max(recv.shape[0], 1)
        if sum(send_counts) != send.shape[0] or sum(recv_counts) != recv.shape[0]:
            raise ValueError(f"alltoallv: send has {send.shape[0]} rows and recv {recv.shape[0]}; the counts "
                             f"add up to {sum(send_counts)} and {sum(recv_counts)}")
        sc = (ctypes.c_uint64 * P)(*[n * row for n in send_counts])
        rc = (ctypes.c_uint64 * P)(*[n * row for n in recv_counts])
        # An empty side names no memory (NULL: the library takes the other side's). A rank
        # with nothing either way on a GPU still names GPU memory, as its group's op is
        # on GPUs: one element of it, untouched.
        tensors = [t for t in (send, recv) if _count(t)]
        ptrs = [_ptr(t) if _count(t) else None for t in (send, recv)]
        if not tensors and _is_torch(send) and send.is_cuda:
            tensors = [_torch().empty(1, dtype=send.dtype, device=send.device)]
            ptrs = [_ptr(tensors[0])] * 2
        d = _lib.new(_lib.AlltoallvDesc, group=group.id, dtype=_dtype_of(send), send=ptrs[0], recv=ptrs[1],
                     send_counts=sc, recv_counts=rc)
        return self._op(lib.spc_ialltoallv, lib.spc_alltoallv, (ctypes.byref(d),), recv, tensors, blocking,
                        timeout_ms)

    def ialltoallv(self, group, send, recv, send_counts, recv_counts):
        return self._alltoallv(group, send, recv, send_counts, recv_counts, False)

    def alltoallv(self, group, send, recv, send_counts, recv_counts, timeout_ms=-1):
        """Uneven all-to-all: send_counts[j] rows (first-dimension entries) of send go to rank j,
        recv_counts[i] rows from rank i land in recv, each side packed in rank order; rank i's
        send_counts[j] must be rank j's recv_counts[i] (spd refuses counts that do not pair up).
        Every other dimension is the same on both sides and every rank. Returns recv."""
        return self._alltoallv(group, send, recv, send_counts, recv_counts, True, timeout_ms)

    def ishift(self, group, pairs, channel=0, linear=False, reverse=False):
        """Ring shift: each (send, recv) goes to group rank + 1 (- 1 with reverse)."""
        return self._shift(group, pairs, channel, linear, reverse, False)

    def _shift(self, group, pairs, channel, linear, reverse, blocking, timeout_ms=-1):
        if not 1 <= len(pairs) <= 4:
            raise ValueError("1 to 4 tensors")
        flags = (SHIFT_LINEAR if linear else 0) | (SHIFT_REVERSE if reverse else 0)
        d = _lib.new(_lib.ShiftDesc, group=group.id, channel=channel, flags=flags, ntensors=len(pairs))
        for i, (send, recv) in enumerate(pairs):
            if _nbytes(send) != _nbytes(recv):
                raise ValueError("send and recv of a shift differ in size")
            d.tensors[i] = _lib.ShiftTensor(_ptr(send), _ptr(recv), _nbytes(send))
        return self._op(lib.spc_ishift, lib.spc_shift, (ctypes.byref(d),), [p[1] for p in pairs],
                        [x for p in pairs for x in p], blocking, timeout_ms)

    def shift(self, group, pairs, channel=0, linear=False, reverse=False, timeout_ms=-1):
        return self._shift(group, pairs, channel, linear, reverse, True, timeout_ms)

    @staticmethod
    def local_heads(heads, kind, kv_heads, ranks):
        """Heads a rank holds after seq->head (dummies included); 0 when invalid."""
        return lib.spc_a2a_local_heads(heads, kind, kv_heads, ranks)

    # -- operator queries
    def query(self, topic, arg=""):
        """spctl's questions: a list of dicts (topics: status, clients, config, jobs, mesh, ops)."""
        r = ctypes.c_void_p()
        _check(self._c, lib.spc_query(self._c, topic.encode(), arg.encode(), ctypes.byref(r)))
        out = []
        try:
            for i in range(lib.spc_query_records(r)):
                rec = {}
                for k in range(lib.spc_query_fields(r, i)):
                    key = lib.spc_query_key(r, i, k).decode()
                    kind = lib.spc_query_kind(r, i, k)
                    rec[key] = (lib.spc_query_str(r, i, k).decode() if kind == 0 else
                                lib.spc_query_int(r, i, k) if kind == 1 else lib.spc_query_double(r, i, k))
                out.append(rec)
        finally:
            lib.spc_query_free(r)
        return out

