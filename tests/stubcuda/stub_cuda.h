/*
 * stub_cuda.h — a stand-in for libcuda.so.1, for tests on machines without a
 * GPU (tests/stubcuda/stub_cuda.c).
 *
 * It implements the part of the driver API that libspclient and spd load,
 * with the driver's names and ABI, over host memory instead of a GPU: device
 * memory is shared memory (memfds) that belongs to a device, streams run what
 * they hold on threads of their own, in order, and kernels are host functions
 * that name the memory they touch (stub_launch), refused where their device may
 * not reach it. So the whole path of a registration runs for real (the client's
 * walk over chunks, descriptors taken by the daemon with pidfd_getfd, the
 * daemon's import, mapping, caching and unmapping), and with stand-in kernels
 * (stub_kern.c) the whole path of a device op in stream order, on one device
 * or several. What it checks as the driver does: cuMemMap on reserved,
 * unmapped, aligned space, offset 0, no larger than the allocation;
 * cuMemUnmap of whole mappings; cuMemAddressFree of a whole, empty
 * reservation; cuMemSetAccess on mapped space; peer access only between
 * devices that have it; events recorded on their own device's streams;
 * copies between host and device (cuMemcpyHtoDAsync, cuMemcpyDtoHAsync) in
 * stream order, refused where the stream's device may not reach the device
 * side.
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
 *   <pid> access at=<address> size=<bytes> devices=<mask>
 *   <pid> ipc open gpu<owner> size=<bytes> in gpu<context's device>
 *   <pid> ipc close size=<bytes>
 *   <pid> host alloc size=<bytes>
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

/* A range of device memory a stand-in kernel reads or writes. */
typedef struct stub_touch {
    stub_ptr_t ptr;
    size_t     bytes;
} stub_touch_t;

/* Enqueues fn(arg) on `stream` as a kernel that touches the ranges listed:
 * CUDA_ERROR_ILLEGAL_ADDRESS (700), logged and on stderr, where the stream's
 * device may not reach one of them; nothing is enqueued then. With
 * SPD_STUB_CUDA_SLOW="<gpu>:<microseconds>" each kernel of that GPU waits that
 * long before it touches memory. The kernel SPD_STUB_CUDA_FAULT names never
 * runs (its device's context fails there, stub_cuda.c): arg, which fn would
 * have freed, is freed with free(). */
stub_result_t stub_launch(void *stream, const char *what, const stub_touch_t *touch, size_t ntouch,
                          void (*fn)(void *), void *arg);

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
stub_result_t cuMemAlloc_v2(stub_ptr_t *ptr, size_t size);
stub_result_t cuMemFree_v2(stub_ptr_t ptr);
stub_result_t cuStreamCreate(void **stream, unsigned flags);
stub_result_t cuStreamDestroy_v2(void *stream);
stub_result_t cuStreamSynchronize(void *stream);
stub_result_t cuStreamWaitValue64_v2(void *stream, stub_ptr_t addr, unsigned long long v, unsigned flags);
stub_result_t cuStreamWriteValue64_v2(void *stream, stub_ptr_t addr, unsigned long long v, unsigned flags);
stub_result_t cuStreamBeginCapture_v2(void *stream, int mode);
stub_result_t cuStreamEndCapture(void *stream, void **graph);
stub_result_t cuStreamIsCapturing(void *stream, int *status);
stub_result_t cuLaunchHostFunc(void *stream, void (*fn)(void *), void *arg);
stub_result_t cuStreamQuery(void *stream);
stub_result_t cuMemHostAlloc(void **p, size_t n, unsigned flags);
stub_result_t cuMemcpyHtoDAsync_v2(stub_ptr_t dst, const void *src, size_t n, void *stream);
stub_result_t cuMemcpyDtoHAsync_v2(void *dst, stub_ptr_t src, size_t n, void *stream);

#endif /* SP_STUB_CUDA_H */
