"""What the CUDA driver says a device pointer lies in, asked here and not
through the binding (libspclient's cache asks the same questions): tests
compare what the cache registered with it."""
import ctypes

# cuda.h's numbers, the driver's ABI.
_IS_LEGACY_CUDA_IPC_CAPABLE, _RANGE_START_ADDR = 10, 11


def allocation(ptr):
    """(base, vmm) of the memory at ptr: a cudaMalloc allocation's base, or for
    cuMem memory (vmm True) its reservation's."""
    f = ctypes.CDLL("libcuda.so.1").cuPointerGetAttributes
    f.restype = ctypes.c_int
    f.argtypes = [ctypes.c_uint, ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint64]
    ipc, base = ctypes.c_int(), ctypes.c_uint64()
    attrs = (ctypes.c_int * 2)(_IS_LEGACY_CUDA_IPC_CAPABLE, _RANGE_START_ADDR)
    vals = (ctypes.c_void_p * 2)(ctypes.addressof(ipc), ctypes.addressof(base))
    rc = f(2, attrs, vals, ptr)
    assert rc == 0, f"cuPointerGetAttributes(0x{ptr:x}): CUDA error {rc}"
    return base.value, not ipc.value
