/*
 * stub_cuda.h — a stand-in for libcuda.so.1, for tests on machines without a
 * GPU (tests/stubcuda/stub_cuda.c).
 *
 * It implements the part of the driver API that libspclient and spd load,
 * with the driver's names and ABI, over bookkeeping instead of a GPU: cuMem
 * (virtual memory management) memory is address space reserved PROT_NONE, and
 * its physical allocations are records, exported as memfds that carry the
 * allocation's tag. So the whole path of a cuMem registration runs for real
 * (the client's walk over chunks, descriptors taken by the daemon with
 * pidfd_getfd, the daemon's import, mapping, caching and unmapping) without a
 * byte of GPU memory. What it checks as the driver does: cuMemMap on reserved,
 * unmapped, aligned space, offset 0, no larger than the allocation;
 * cuMemUnmap of whole mappings; cuMemAddressFree of a whole, empty
 * reservation; cuMemSetAccess on mapped space.
 *
 * It models one device, or several with SPD_STUB_CUDA_GPUS and the peer access
 * between them that SPD_STUB_CUDA_P2P lists (stub_cuda.c says how).
 *
 * With SPD_STUB_CUDA_LOG set, every process using it appends to that file one
 * line per import, map, unmap, reservation freed and refused call, prefixed
 * with its pid, and at exit what it still holds:
 *
 *   <pid> import tag=<tag> size=<bytes>
 *   <pid> map tag=<tag> at=<offset in its reservation> size=<bytes>
 *   <pid> unmap tag=<tag> at=<offset>
 *   <pid> addrfree size=<bytes>
 *   <pid> refused <call>: <why>
 *   <pid> exit reservations=<n> mappings=<n> allocations=<n>
 *
 * Tests link it (its soname is libcuda.so.1, so libspclient's dlopen finds the
 * same instance) and put its directory first in spd's LD_LIBRARY_PATH.
 */
#ifndef SP_STUB_CUDA_H
#define SP_STUB_CUDA_H

#include <stddef.h>
#include <stdint.h>

typedef int                stub_result_t;    /* CUresult */
typedef unsigned long long stub_ptr_t;       /* CUdeviceptr */
typedef unsigned long long stub_mem_t;       /* CUmemGenericAllocationHandle */

/* CUmemAllocationProp, CUmemAccessDesc (cuda.h's layouts). */
typedef struct stub_mem_prop {
    int   type;
    int   requested_handle_types;
    struct { int type, id; } location;
    void *win32_metadata;
    struct {
        unsigned char  compression_type, gpu_direct_rdma_capable;
        unsigned short usage;
        unsigned char  reserved[4];
    } alloc_flags;
} stub_mem_prop_t;

typedef struct stub_access_desc {
    struct { int type, id; } location;
    int flags;
} stub_access_desc_t;

enum {
    STUB_SUCCESS = 0,
    STUB_ERROR_INVALID_VALUE = 1,
    STUB_ERROR_INVALID_DEVICE = 101,
    STUB_ERROR_NOT_FOUND = 500,
    STUB_ERROR_NOT_SUPPORTED = 801,
    STUB_ATTR_MEMORY_BLOCK_ID = 20,
    STUB_HANDLE_POSIX_FD = 1,
    STUB_GRANULARITY = 2u << 20,
    STUB_MAX_GPUS = 16,
    /* CUdevice_P2PAttribute */
    STUB_P2P_PERFORMANCE_RANK = 1,
    STUB_P2P_ACCESS_SUPPORTED = 2,
    STUB_P2P_NATIVE_ATOMIC_SUPPORTED = 3,
};

/* What tests call directly. */
stub_result_t cuDevicePrimaryCtxRetain(void **ctx, int d);
stub_result_t cuCtxSetCurrent(void *ctx);
stub_result_t cuMemAddressReserve(stub_ptr_t *ptr, size_t size, size_t alignment, stub_ptr_t addr,
                                  unsigned long long flags);
stub_result_t cuMemAddressFree(stub_ptr_t ptr, size_t size);
stub_result_t cuMemCreate(stub_mem_t *handle, size_t size, const stub_mem_prop_t *prop, unsigned long long flags);
stub_result_t cuMemRelease(stub_mem_t handle);
stub_result_t cuMemMap(stub_ptr_t ptr, size_t size, size_t offset, stub_mem_t handle, unsigned long long flags);
stub_result_t cuMemUnmap(stub_ptr_t ptr, size_t size);
stub_result_t cuMemSetAccess(stub_ptr_t ptr, size_t size, const stub_access_desc_t *desc, size_t count);
stub_result_t cuPointerGetAttributes(unsigned n, int *attrs, void **data, stub_ptr_t ptr);

#endif /* SP_STUB_CUDA_H */
