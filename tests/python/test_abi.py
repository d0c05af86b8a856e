"""The binding against C: every ctypes struct has C's size and each field C's
offset and size, the enums and flags C's values, and the statuses and their
exception classes come from libspclient itself (sp_abi_probe is built from
spclient.h by CMake; ctest passes its path)."""
import ctypes
import os

import pytest

import spclient
from spclient import _lib

# Each ctypes struct of the binding and the C type it mirrors.
STRUCTS = {
    _lib.AttachParams: "spc_attach_params_t",
    _lib.JobParams: "spc_job_params_t",
    _lib.Launch: "spc_launch_t",
    _lib.MeshSpec: "spc_mesh_spec_t",
    _lib.Mesh: "spc_mesh_t",
    _lib.A2ATensor: "spc_a2a_tensor_t",
    _lib.AlltoallDesc: "spc_alltoall_desc_t",
    _lib.AlltoallvDesc: "spc_alltoallv_desc_t",
    _lib.ShiftTensor: "shift_tensor_t",
    _lib.ShiftDesc: "spc_shift_desc_t",
    _lib.DeviceSpan: "spc_device_span_t",
    _lib.DeviceCacheInfo: "spc_device_cache_info_t",
    _lib.DeviceEntry: "spc_device_entry_t",
    _lib.ResumeInfo: "spc_resume_info_t",
    _lib.LseMergeDesc: "spc_lse_merge_desc_t",
}

# Each IntEnum of the binding and the prefix of its members' C names.
ENUMS = {spclient.Dtype: "SPC_", spclient.ReduceOp: "SPC_", spclient.Direction: "SPC_",
         spclient.Layout: "SPC_LAYOUT_", spclient.HeadsKind: "SPC_HEADS_"}


def _probe():
    path = os.environ.get("SP_ABI_PROBE") or os.path.join(
        os.path.dirname(os.path.dirname(_lib.path)), "tests", "libsp_abi_probe.so")
    if not os.path.exists(path):
        pytest.skip(f"no sp_abi_probe at {path} (build the tree, or set SP_ABI_PROBE)")
    p = ctypes.CDLL(path)
    for name in ("sp_probe_sizeof", "sp_probe_nfields"):
        getattr(p, name).argtypes, getattr(p, name).restype = [ctypes.c_char_p], ctypes.c_long
    for name in ("sp_probe_offsetof", "sp_probe_field_size"):
        getattr(p, name).argtypes, getattr(p, name).restype = [ctypes.c_char_p, ctypes.c_char_p], ctypes.c_long
    p.sp_probe_const.argtypes, p.sp_probe_const.restype = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_long)], ctypes.c_int
    return p


def _const(probe, name):
    v = ctypes.c_long()
    assert probe.sp_probe_const(name.encode(), ctypes.byref(v)), f"the probe does not know {name}"
    return v.value


@pytest.mark.parametrize("struct", list(STRUCTS), ids=lambda s: s.__name__)
def test_struct_layout(struct):
    probe, c = _probe(), STRUCTS[struct].encode()
    assert ctypes.sizeof(struct) == probe.sp_probe_sizeof(c), f"sizeof {STRUCTS[struct]}"
    assert len(struct._fields_) == probe.sp_probe_nfields(c), f"fields of {STRUCTS[struct]}"
    for name, ctype in struct._fields_:
        where = f"{STRUCTS[struct]}.{name}"
        assert getattr(struct, name).offset == probe.sp_probe_offsetof(c, name.encode()), f"offsetof {where}"
        assert ctypes.sizeof(ctype) == probe.sp_probe_field_size(c, name.encode()), f"sizeof {where}"


def test_enums_and_flags():
    probe = _probe()
    for enum, prefix in ENUMS.items():
        for member in enum:
            assert member == _const(probe, prefix + member.name), f"{enum.__name__}.{member.name}"
    assert spclient.SUM_REPLICAS == _const(probe, "SPC_A2A_SUM_REPLICAS")
    assert spclient.SHIFT_LINEAR == _const(probe, "SPC_SHIFT_LINEAR")
    assert spclient.SHIFT_REVERSE == _const(probe, "SPC_SHIFT_REVERSE")
    assert _lib.SPC_JOB_ID_MAX == _const(probe, "SPC_JOB_ID_MAX")
    assert _lib.SPC_MEMORY_HOST == _const(probe, "SPC_MEMORY_HOST")
    assert _lib.SPC_MEMORY_CUDA == _const(probe, "SPC_MEMORY_CUDA")
    for dtype in spclient.Dtype:
        assert _lib.lib.spc_dtype_size(dtype) > 0, dtype


BUILTINS = {"ERR_INVALID_ARG": ValueError, "ERR_NO_MEMORY": MemoryError, "ERR_TIMEOUT": TimeoutError,
            "ERR_PERMISSION": PermissionError, "ERR_MISMATCH": ValueError, "ERR_DAEMON_LOST": ConnectionError}


def test_every_status_has_its_exception():
    """Every error status libspclient names has an SpdError subclass carrying it;
    the common ones are also the built-in exception of the same meaning."""
    names = _lib.statuses()
    assert names["SPC_OK"] == 0 and names["SPC_IN_PROGRESS"] == 1 and names["SPC_ERR_CANCELED"] == -306
    errors = {n: v for n, v in names.items() if v < 0}
    assert sorted(int(s) for s in spclient._BY_STATUS) == sorted(errors.values())
    for name, value in errors.items():
        cls = spclient._BY_STATUS[value]
        assert issubclass(cls, spclient.SpdError) and getattr(spclient, cls.__name__) is cls
        e = spclient._error(value, "detail")
        assert type(e) is cls and e.status == value and e.status.name == name.removeprefix("SPC_")
        assert str(e) == f"{name}: detail"
    for name, builtin in BUILTINS.items():
        assert issubclass(spclient._BY_STATUS[spclient.Status[name]], builtin), name
    # The names the binding had before the classes came from C.
    assert spclient.InvalidArgumentError.__mro__[1] is spclient.SpdError
    assert spclient.SpdTimeoutError is spclient._BY_STATUS[spclient.Status.ERR_TIMEOUT]
    with pytest.raises(TimeoutError):
        spclient._raise(spclient.Status.ERR_TIMEOUT, "ranks 1, 2 missing")
