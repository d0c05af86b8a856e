"""ctypes declarations of libspclient (client/include/spclient/spclient.h).

Only this module knows the C layout. Structures mirror the header field by field
(tests/python/test_abi.py holds each to C's size and offsets); every struct with
a `struct_size` gets it filled in by `new()`. The status codes are not copied:
statuses() asks the library for them.
"""
import ctypes
import ctypes.util
import os
from ctypes import (POINTER, Structure, c_char, c_char_p, c_double, c_int, c_int32, c_int64,
                    c_size_t, c_uint32, c_uint64, c_void_p)

SPC_JOB_ID_MAX = 128


class AttachParams(Structure):
    _fields_ = [("struct_size", c_size_t), ("socket_path", c_char_p), ("name", c_char_p),
                ("flags", c_uint32), ("sq_entries", c_uint32), ("arena_bytes", c_uint64),
                ("timeout_ms", c_int)]


class JobParams(Structure):
    _fields_ = [("struct_size", c_size_t), ("allow_uids", POINTER(c_uint32)), ("nallow_uids", c_uint32)]


SPC_JOB_NAME_MAX, SPC_JOB_LAUNCH_MAX = 64, 128


class Launch(Structure):
    _fields_ = [("struct_size", c_size_t), ("rank", c_uint32), ("world_size", c_uint32),
                ("local_rank", c_uint32), ("local_world_size", c_uint32), ("nodes", c_uint32),
                ("launcher", c_char * 16),
                ("job", c_char * SPC_JOB_NAME_MAX), ("launch", c_char * SPC_JOB_LAUNCH_MAX),
                ("world", c_uint32)]


class MeshSpec(Structure):
    _fields_ = [("struct_size", c_size_t), ("sp", c_uint32), ("ulysses", c_uint32),
                ("ring", c_uint32), ("heads", c_uint32), ("kv_heads", c_uint32)]


class Mesh(Structure):
    _fields_ = [("id", c_uint32), ("dp", c_uint32), ("sp", c_uint32), ("ulysses", c_uint32),
                ("ring", c_uint32), ("dp_group", c_uint32), ("sp_group", c_uint32),
                ("ulysses_group", c_uint32), ("ring_group", c_uint32), ("dp_rank", c_uint32),
                ("sp_rank", c_uint32), ("ulysses_rank", c_uint32), ("ring_rank", c_uint32),
                ("explain", c_char * 256)]


class A2ATensor(Structure):
    _fields_ = [("send", c_void_p), ("recv", c_void_p), ("heads", c_uint32),
                ("head_dim", c_uint32), ("kind", c_uint32), ("flags", c_uint32)]


class AlltoallDesc(Structure):
    _fields_ = [("struct_size", c_size_t), ("group", c_uint32), ("dtype", c_int),
                ("direction", c_uint32), ("layout", c_uint32), ("batch", c_uint32),
                ("seq_len", c_uint32), ("kv_heads", c_uint32), ("ntensors", c_uint32),
                ("tensors", A2ATensor * 4), ("timeout_ms", c_uint32), ("more_tensors", A2ATensor * 4)]


class AlltoallvDesc(Structure):
    _fields_ = [("struct_size", c_size_t), ("group", c_uint32), ("dtype", c_int), ("send", c_void_p),
                ("recv", c_void_p), ("send_counts", POINTER(c_uint64)), ("recv_counts", POINTER(c_uint64)),
                ("timeout_ms", c_uint32)]


class ShiftTensor(Structure):
    _fields_ = [("send", c_void_p), ("recv", c_void_p), ("bytes", c_uint64)]


class DeviceSpan(Structure):
    _fields_ = [("ptr", c_void_p), ("bytes", c_uint64)]


class DeviceCacheInfo(Structure):
    _fields_ = [("struct_size", c_size_t), ("regions", c_uint32), ("limit", c_uint32),
                ("registrations", c_uint64), ("dropped", c_uint64), ("merged", c_uint64)]


class ResumeInfo(Structure):
    _fields_ = [("struct_size", c_size_t), ("resumes", c_uint32), ("replayed", c_uint64), ("retried", c_uint64),
                ("last_gap_ms", c_uint64)]


class DeviceEntry(Structure):
    _fields_ = [("base", c_uint64), ("size", c_uint64), ("region", c_uint32), ("chunks", c_uint32)]


class ShiftDesc(Structure):
    _fields_ = [("struct_size", c_size_t), ("group", c_uint32), ("channel", c_uint32),
                ("flags", c_uint32), ("ntensors", c_uint32), ("tensors", ShiftTensor * 4),
                ("timeout_ms", c_uint32)]


class LseMergeDesc(Structure):
    _fields_ = [("struct_size", c_size_t), ("memory", c_uint32), ("layout", c_uint32), ("batch", c_uint32),
                ("seq_len", c_uint32), ("heads", c_uint32), ("head_dim", c_uint32), ("out", c_void_p),
                ("lse", c_void_p), ("out_a", c_void_p), ("lse_a", c_void_p), ("out_b", c_void_p),
                ("lse_b", c_void_p), ("cu_stream", c_void_p)]


SPC_MEMORY_HOST, SPC_MEMORY_CUDA = 0, 1


def new(struct_type, **fields):
    """A zeroed struct with struct_size set and the given fields."""
    s = struct_type()
    s.struct_size = ctypes.sizeof(struct_type)
    for k, v in fields.items():
        setattr(s, k, v)
    return s


def _candidates():
    env = os.environ.get("SPCLIENT_LIB")
    if env:
        yield env
    # The build tree, when imported from client/python in a checkout.
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.normpath(os.path.join(here, "..", "..", ".."))
    for build in ("build", "build-host", "build-asan", "build-gpu"):
        yield os.path.join(root, build, "client", "libspclient.so")
    # Installed: PREFIX/lib/python3/dist-packages/spclient, the library in PREFIX/lib
    # (under /usr, Debian's multiarch directory: the loader's search below finds it).
    yield os.path.normpath(os.path.join(here, "..", "..", "..", "libspclient.so.0"))
    found = ctypes.util.find_library("spclient")
    if found:
        yield found
    # By soname, through the loader's own search (LD_LIBRARY_PATH, as where a
    # packed copy of the library travels without its build tree).
    yield "libspclient.so.0"


def _load():
    errors = []
    for path in _candidates():
        if os.path.sep in path and not os.path.exists(path):
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            errors.append(f"{path}: {e}")
    raise ImportError("libspclient not found (set SPCLIENT_LIB, build the tree, or install it): " +
                      "; ".join(errors))


lib, path = _load()

_sigs = {
    "spc_attach": (c_int, [POINTER(AttachParams), POINTER(c_void_p)]),
    "spc_detach": (None, [c_void_p]),
    "spc_last_error": (c_char_p, [c_void_p]),
    "spc_status_name": (c_char_p, [c_int]),
    "spc_status_message": (c_char_p, [c_int]),
    "spc_daemon_pid": (c_int, [c_void_p]),
    "spc_resume_info": (c_int, [c_void_p, POINTER(ResumeInfo)]),
    "spc_alloc": (c_void_p, [c_void_p, c_size_t]),
    "spc_free": (None, [c_void_p, c_void_p]),
    "spc_register": (c_int, [c_void_p, c_void_p, c_size_t, POINTER(c_uint32)]),
    "spc_register_device": (c_int, [c_void_p, c_void_p, c_size_t, POINTER(c_uint32)]),
    "spc_deregister": (c_int, [c_void_p, c_uint32]),
    "spc_device_cover": (c_int, [c_void_p, POINTER(DeviceSpan), c_uint32, POINTER(c_uint32)]),
    "spc_device_cache_limit": (c_int, [c_void_p, c_uint32]),
    "spc_device_cache_info": (c_int, [c_void_p, POINTER(DeviceCacheInfo)]),
    "spc_device_cache_entries": (c_uint32, [c_void_p, POINTER(DeviceEntry), c_uint32]),
    "spc_device_cache_clear": (c_int, [c_void_p]),
    "spc_job_create": (c_int, [c_void_p, c_char_p, c_size_t]),
    "spc_job_create_with": (c_int, [c_void_p, POINTER(JobParams), c_char_p, c_size_t]),
    "spc_job_join": (c_int, [c_void_p, c_char_p, c_uint32, c_uint32, c_int, POINTER(c_uint32)]),
    "spc_job_join_named": (c_int, [c_void_p, c_char_p, c_char_p, c_uint32, c_uint32, c_int, POINTER(c_uint32)]),
    "spc_launch_from_env": (c_int, [POINTER(Launch)]),
    "spc_init_from_env": (c_int, [POINTER(AttachParams), c_int, POINTER(Launch), POINTER(c_void_p)]),
    "spc_mesh_create": (c_int, [c_void_p, POINTER(MeshSpec), POINTER(Mesh)]),
    "spc_test": (c_int, [c_void_p]),
    "spc_wait": (c_int, [c_void_p, c_int]),
    "spc_request_detail": (c_char_p, [c_void_p]),
    "spc_request_release": (None, [c_void_p]),
    "spc_ibarrier": (c_int, [c_void_p, c_uint32, POINTER(c_void_p)]),
    "spc_iallreduce": (c_int, [c_void_p, c_uint32, c_void_p, c_void_p, c_uint64, c_int, c_int,
                               POINTER(c_void_p)]),
    "spc_iallgather": (c_int, [c_void_p, c_uint32, c_void_p, c_void_p, c_uint64, c_int,
                               POINTER(c_void_p)]),
    "spc_ireduce_scatter": (c_int, [c_void_p, c_uint32, c_void_p, c_void_p, c_uint64, c_int, c_int,
                                    POINTER(c_void_p)]),
    "spc_ibroadcast": (c_int, [c_void_p, c_uint32, c_void_p, c_uint64, c_int, c_uint32,
                               POINTER(c_void_p)]),
    "spc_ialltoall": (c_int, [c_void_p, POINTER(AlltoallDesc), POINTER(c_void_p)]),
    "spc_ialltoallv": (c_int, [c_void_p, POINTER(AlltoallvDesc), POINTER(c_void_p)]),
    "spc_ishift": (c_int, [c_void_p, POINTER(ShiftDesc), POINTER(c_void_p)]),
    # The blocking forms: with a current stream they return once the op is
    # enqueued on it, which is how an op on CUDA tensors runs in stream order.
    "spc_allreduce": (c_int, [c_void_p, c_uint32, c_void_p, c_void_p, c_uint64, c_int, c_int, c_int]),
    "spc_allgather": (c_int, [c_void_p, c_uint32, c_void_p, c_void_p, c_uint64, c_int, c_int]),
    "spc_reduce_scatter": (c_int, [c_void_p, c_uint32, c_void_p, c_void_p, c_uint64, c_int, c_int, c_int]),
    "spc_broadcast": (c_int, [c_void_p, c_uint32, c_void_p, c_uint64, c_int, c_uint32, c_int]),
    "spc_alltoall": (c_int, [c_void_p, POINTER(AlltoallDesc), c_int]),
    "spc_alltoallv": (c_int, [c_void_p, POINTER(AlltoallvDesc), c_int]),
    "spc_shift": (c_int, [c_void_p, POINTER(ShiftDesc), c_int]),
    "spc_a2a_local_heads": (c_uint32, [c_uint32, c_uint32, c_uint32, c_uint32]),
    "spc_zigzag_split": (c_int, [c_void_p, c_void_p, c_uint64, c_uint64, c_uint64, c_uint32, c_uint32]),
    "spc_zigzag_merge": (c_int, [POINTER(c_void_p), c_void_p, c_uint64, c_uint64, c_uint64, c_uint32]),
    "spc_zigzag_positions": (c_int, [c_uint64, c_uint32, c_uint32, c_void_p]),
    "spc_cu_seqlens": (c_int, [c_void_p, c_uint64, c_void_p, c_uint64, POINTER(c_uint64), POINTER(c_int32)]),
    "spc_lse_merge": (c_int, [POINTER(LseMergeDesc)]),
    "spc_dtype_size": (c_size_t, [c_int]),
    "spc_query": (c_int, [c_void_p, c_char_p, c_char_p, POINTER(c_void_p)]),
    "spc_query_records": (c_size_t, [c_void_p]),
    "spc_query_fields": (c_size_t, [c_void_p, c_size_t]),
    "spc_query_key": (c_char_p, [c_void_p, c_size_t, c_size_t]),
    "spc_query_kind": (c_int, [c_void_p, c_size_t, c_size_t]),
    "spc_query_str": (c_char_p, [c_void_p, c_size_t, c_size_t]),
    "spc_query_int": (c_int64, [c_void_p, c_size_t, c_size_t]),
    "spc_query_double": (c_double, [c_void_p, c_size_t, c_size_t]),
    "spc_query_free": (None, [c_void_p]),
}
for _name, (_res, _args) in _sigs.items():
    _f = getattr(lib, _name)
    _f.restype = _res
    _f.argtypes = _args



def statuses():
    """Every spc_status_t the library names, as {name: value}: spc_status_name()
    of each value status.h reserves (1 down to -399), so a status added in C is
    here without an edit."""
    out = {}
    for value in range(1, -400, -1):
        name = lib.spc_status_name(value).decode()
        if name != "SPC_UNKNOWN_STATUS":
            out[name] = value
    return out


# The stream-order API (spclient.h, "GPU streams"). A library built before it
# lacks these; without them, ops on CUDA tensors are host-synchronous.
_stream_sigs = {
    "spc_stream_create": (c_int, [c_void_p, c_void_p, POINTER(c_void_p)]),
    "spc_stream_destroy": (c_int, [c_void_p]),
    "spc_set_stream": (c_int, [c_void_p, c_void_p]),
    "spc_get_stream": (c_void_p, [c_void_p]),
    "spc_stream_query": (c_int, [c_void_p]),
    "spc_stream_synchronize": (c_int, [c_void_p]),
}
has_streams = all(hasattr(lib, _name) for _name in _stream_sigs)
if has_streams:
    for _name, (_res, _args) in _stream_sigs.items():
        _f = getattr(lib, _name)
        _f.restype = _res
        _f.argtypes = _args
