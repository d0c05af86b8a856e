/*
 * stub_cuda.c — libcuda.so.1 without a GPU, for tests (see stub_cuda.h).
 *
 * One device (ordinal 0, PCI 0000:ff:00.0), or N with SPD_STUB_CUDA_GPUS=N
 * (at most STUB_MAX_GPUS): device i at PCI 0000:(ff - i):00.0, its UUID that
 * of device 0 with the last byte xor i. Peer access between devices is what
 * SPD_STUB_CUDA_P2P lists, pairs joined by commas, both directions each:
 * "A=B" is NVLink (peer access, native atomics, performance rank 0), "A-B" is
 * PCIe (peer access, no native atomics, performance rank 1); other pairs have
 * no peer access. So "0=1,2=3,1-2" is two NVLink pairs joined over PCIe by 1
 * and 2. No context, stream or kernel does anything; cudaMalloc memory, CUDA
 * IPC and stream order are not supported. cuMem memory is device 0's:
 *
 *   - a reservation is PROT_NONE address space (never touched);
 *   - an allocation is a record with a tag unique across processes (pid and
 *     a counter), its size, requested handle types and a reference count
 *     (its handle, each retain, each mapping, each import);
 *   - a mapping puts an allocation at an address of a reservation, with a
 *     buffer id never reused in the process; the MEMORY_BLOCK_ID attribute is
 *     the allocation's tag;
 *   - an export is a new memfd of the allocation's size holding its tag; an
 *     import reads the tag and size back, so the importer's records name the
 *     exporter's allocation.
 */
#include "stub_cuda.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define MEMFD_NAME "spd-stub-cuda"

typedef struct alloc {
    uint64_t tag;
    size_t   size;
    int      types;
    int      refs;
} alloc_t;

typedef struct mapping {
    stub_ptr_t va;
    size_t     size;
    alloc_t   *a;
    uint64_t   buffer_id;
    bool       access;
} mapping_t;

typedef struct reservation {
    stub_ptr_t va;
    size_t     size;
    void      *raw;
    size_t     raw_size;
} reservation_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static mapping_t *maps;
static size_t nmaps, maps_cap;
static reservation_t *res;
static size_t nres, res_cap;
static size_t nallocs;
static uint64_t next_tag = 1, next_buffer_id = 1000;
static __thread void *current_ctx;

static void stub_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void stub_log(const char *fmt, ...)
{
    const char *path = getenv("SPD_STUB_CUDA_LOG");
    if (path == NULL)
        return;
    char line[512];
    int n = snprintf(line, sizeof line, "%d ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof line - 2)
        n = (int)sizeof line - 2;
    line[n++] = '\n';
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (fd >= 0) {
        if (write(fd, line, (size_t)n) < 0) {
            /* a lost log line shows up as a test failure, not here */
        }
        close(fd);
    }
}

static stub_result_t refuse(const char *call, const char *why)
{
    stub_log("refused %s: %s", call, why);
    return STUB_ERROR_INVALID_VALUE;
}

__attribute__((destructor)) static void stub_exit(void)
{
    stub_log("exit reservations=%zu mappings=%zu allocations=%zu", nres, nmaps, nallocs);
}

/* ------------------------------------------------------------ bookkeeping */

static alloc_t *alloc_new(uint64_t tag, size_t size, int types)
{
    alloc_t *a = calloc(1, sizeof *a);
    if (a == NULL)
        return NULL;
    *a = (alloc_t){ .tag = tag, .size = size, .types = types, .refs = 1 };
    nallocs++;
    return a;
}

static void alloc_unref(alloc_t *a)
{
    if (--a->refs == 0) {
        free(a);
        nallocs--;
    }
}

static mapping_t *map_at(stub_ptr_t p)
{
    for (size_t i = 0; i < nmaps; i++)
        if (p >= maps[i].va && p - maps[i].va < maps[i].size)
            return &maps[i];
    return NULL;
}

static reservation_t *res_at(stub_ptr_t p)
{
    for (size_t i = 0; i < nres; i++)
        if (p >= res[i].va && p - res[i].va < res[i].size)
            return &res[i];
    return NULL;
}

static bool grow(void **arr, size_t *cap, size_t n, size_t elem)
{
    if (n < *cap)
        return true;
    size_t c = *cap ? 2 * *cap : 64;
    void *p = realloc(*arr, c * elem);
    if (p == NULL)
        return false;
    *arr = p;
    *cap = c;
    return true;
}

/* ------------------------------------------------------------ driver, device, context */

stub_result_t cuInit(unsigned flags)
{
    return STUB_SUCCESS;
}

stub_result_t cuGetErrorString(stub_result_t rc, const char **s)
{
    switch (rc) {
    case STUB_SUCCESS: *s = "no error"; break;
    case STUB_ERROR_INVALID_VALUE: *s = "invalid argument (stub)"; break;
    case STUB_ERROR_INVALID_DEVICE: *s = "invalid device ordinal (stub)"; break;
    case STUB_ERROR_NOT_FOUND: *s = "named symbol not found (stub)"; break;
    case STUB_ERROR_NOT_SUPPORTED: *s = "operation not supported (stub)"; break;
    default: *s = "unknown error (stub)"; break;
    }
    return STUB_SUCCESS;
}

stub_result_t cuDriverGetVersion(int *v)
{
    *v = 13000;
    return STUB_SUCCESS;
}

/* SPD_STUB_CUDA_GPUS, or 1 when unset or not a count in [1, STUB_MAX_GPUS]. */
static int gpu_count(void)
{
    const char *v = getenv("SPD_STUB_CUDA_GPUS");
    char *end;
    long n = v != NULL ? strtol(v, &end, 10) : 1;
    return v != NULL && (end == v || *end != '\0' || n < 1 || n > STUB_MAX_GPUS) ? 1 : (int)n;
}

/* The SPD_STUB_CUDA_P2P entry joining a and b: '=' (NVLink), '-' (PCIe), or 0. */
static char p2p_kind(int a, int b)
{
    const char *s = getenv("SPD_STUB_CUDA_P2P");
    while (s != NULL && *s != '\0') {
        char *end;
        long x = strtol(s, &end, 10);
        char kind = *end;
        if (end == s || (kind != '=' && kind != '-'))
            return 0;
        s = end + 1;
        long y = strtol(s, &end, 10);
        if (end == s)
            return 0;
        if ((x == a && y == b) || (x == b && y == a))
            return kind;
        s = *end == ',' ? end + 1 : end;
    }
    return 0;
}

stub_result_t cuDeviceGetCount(int *n)
{
    *n = gpu_count();
    return STUB_SUCCESS;
}

stub_result_t cuDeviceGet(int *d, int ordinal)
{
    if (ordinal < 0 || ordinal >= gpu_count())
        return STUB_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return STUB_SUCCESS;
}

stub_result_t cuDeviceCanAccessPeer(int *can, int d, int peer)
{
    if (d < 0 || d >= gpu_count() || peer < 0 || peer >= gpu_count())
        return STUB_ERROR_INVALID_DEVICE;
    *can = d != peer && p2p_kind(d, peer) != 0;
    return STUB_SUCCESS;
}

stub_result_t cuDeviceGetP2PAttribute(int *v, int attr, int src, int dst)
{
    if (src < 0 || src >= gpu_count() || dst < 0 || dst >= gpu_count() || src == dst)
        return STUB_ERROR_INVALID_DEVICE;
    char kind = p2p_kind(src, dst);
    switch (attr) {
    case STUB_P2P_PERFORMANCE_RANK: *v = kind == '-' ? 1 : 0; break;
    case STUB_P2P_ACCESS_SUPPORTED: *v = kind != 0; break;
    case STUB_P2P_NATIVE_ATOMIC_SUPPORTED: *v = kind == '='; break;
    default: return refuse("cuDeviceGetP2PAttribute", "an attribute the stub does not have");
    }
    return STUB_SUCCESS;
}

stub_result_t cuDeviceGetName(char *name, int len, int d)
{
    snprintf(name, (size_t)len, "spd test stub");
    return STUB_SUCCESS;
}

stub_result_t cuDeviceGetPCIBusId(char *bus, int len, int d)
{
    if (d < 0 || d >= gpu_count())
        return STUB_ERROR_INVALID_DEVICE;
    snprintf(bus, (size_t)len, "0000:%02X:00.0", 0xFF - d);
    return STUB_SUCCESS;
}

stub_result_t cuDeviceGetByPCIBusId(int *d, const char *bus)
{
    for (int i = 0; i < gpu_count(); i++) {
        char mine[16];
        cuDeviceGetPCIBusId(mine, sizeof mine, i);
        if (strcasecmp(bus, mine) == 0) {
            *d = i;
            return STUB_SUCCESS;
        }
    }
    return STUB_ERROR_INVALID_VALUE;
}

stub_result_t cuDeviceGetUuid_v2(unsigned char *uuid, int d)
{
    if (d < 0 || d >= gpu_count())
        return STUB_ERROR_INVALID_DEVICE;
    for (int i = 0; i < 16; i++)
        uuid[i] = (unsigned char)(0xA0 + i);
    uuid[15] ^= (unsigned char)d;
    return STUB_SUCCESS;
}

/* Each device's primary context: a distinct address, which cuCtxGetDevice maps back. */
static char primary_ctx[STUB_MAX_GPUS];

stub_result_t cuDevicePrimaryCtxRetain(void **ctx, int d)
{
    if (d < 0 || d >= gpu_count())
        return STUB_ERROR_INVALID_DEVICE;
    *ctx = &primary_ctx[d];
    return STUB_SUCCESS;
}

stub_result_t cuDevicePrimaryCtxRelease_v2(int d)
{
    return STUB_SUCCESS;
}

stub_result_t cuCtxGetCurrent(void **ctx)
{
    *ctx = current_ctx;
    return STUB_SUCCESS;
}

stub_result_t cuCtxSetCurrent(void *ctx)
{
    current_ctx = ctx;
    return STUB_SUCCESS;
}

stub_result_t cuCtxPushCurrent_v2(void *ctx)
{
    current_ctx = ctx;
    return STUB_SUCCESS;
}

stub_result_t cuCtxPopCurrent_v2(void **ctx)
{
    *ctx = current_ctx;
    current_ctx = NULL;
    return STUB_SUCCESS;
}

stub_result_t cuStreamCreate(void **stream, unsigned flags)
{
    *stream = (void *)0x5b2;
    return STUB_SUCCESS;
}

stub_result_t cuStreamSynchronize(void *stream)
{
    return STUB_SUCCESS;
}

/* ------------------------------------------------------------ what the stub does not have */

typedef struct { char reserved[64]; } stub_ipc_handle_t;

stub_result_t cuIpcGetMemHandle(stub_ipc_handle_t *h, stub_ptr_t p)
{
    return STUB_ERROR_NOT_SUPPORTED;
}

stub_result_t cuIpcOpenMemHandle_v2(stub_ptr_t *p, stub_ipc_handle_t h, unsigned flags)
{
    return STUB_ERROR_NOT_SUPPORTED;
}

stub_result_t cuIpcCloseMemHandle(stub_ptr_t p)
{
    return STUB_ERROR_NOT_SUPPORTED;
}

/* Stream order (stream.c on both sides) is not this stub's: its device has no
 * 64-bit stream memory operations, and host registration and events fail. */
stub_result_t cuDeviceGetAttribute(int *v, int attr, int d)
{
    *v = 0;
    return STUB_SUCCESS;
}

/* The current context's device; device 0 when none is current. */
stub_result_t cuCtxGetDevice(int *d)
{
    uintptr_t ctx = (uintptr_t)current_ctx, first = (uintptr_t)primary_ctx;
    *d = ctx >= first && ctx < first + STUB_MAX_GPUS ? (int)(ctx - first) : 0;
    return STUB_SUCCESS;
}

stub_result_t cuStreamGetCtx(void *stream, void **ctx)
{
    return STUB_ERROR_NOT_SUPPORTED;
}

stub_result_t cuMemHostRegister_v2(void *p, size_t n, unsigned flags)
{
    return STUB_ERROR_NOT_SUPPORTED;
}

stub_result_t cuMemHostUnregister(void *p)
{
    return STUB_ERROR_NOT_SUPPORTED;
}

stub_result_t cuMemHostGetDevicePointer_v2(stub_ptr_t *dptr, void *p, unsigned flags)
{
    return STUB_ERROR_NOT_SUPPORTED;
}

stub_result_t cuStreamWaitValue64_v2(void *stream, stub_ptr_t addr, unsigned long long v, unsigned flags)
{
    return STUB_ERROR_NOT_SUPPORTED;
}

stub_result_t cuStreamWriteValue64_v2(void *stream, stub_ptr_t addr, unsigned long long v, unsigned flags)
{
    return STUB_ERROR_NOT_SUPPORTED;
}

stub_result_t cuEventCreate(void **event, unsigned flags)
{
    return STUB_ERROR_NOT_SUPPORTED;
}

stub_result_t cuEventRecord(void *event, void *stream)
{
    return STUB_ERROR_NOT_SUPPORTED;
}

stub_result_t cuEventQuery(void *event)
{
    return STUB_ERROR_NOT_SUPPORTED;
}

stub_result_t cuEventDestroy_v2(void *event)
{
    return STUB_ERROR_NOT_SUPPORTED;
}

stub_result_t cuStreamWaitEvent(void *stream, void *event, unsigned flags)
{
    return STUB_ERROR_NOT_SUPPORTED;
}

stub_result_t cuStreamDestroy_v2(void *stream)
{
    return STUB_ERROR_NOT_SUPPORTED;
}

/* spd stages ops across daemons in cudaMalloc-like memory: not supported here. */
stub_result_t cuMemAlloc_v2(stub_ptr_t *ptr, size_t size)
{
    return STUB_ERROR_NOT_SUPPORTED;
}

/* ------------------------------------------------------------ pointers */

stub_result_t cuPointerGetAttributes(unsigned n, int *attrs, void **data, stub_ptr_t p)
{
    pthread_mutex_lock(&lock);
    const mapping_t *m = map_at(p);
    const reservation_t *r = res_at(p);
    stub_result_t rc = STUB_SUCCESS;
    for (unsigned i = 0; i < n && rc == STUB_SUCCESS; i++) {
        switch (attrs[i]) {
        case 2: *(unsigned *)data[i] = r ? 2 : 0; break;                                /* MEMORY_TYPE */
        case 7: *(unsigned long long *)data[i] = m ? m->buffer_id : 0; break;            /* BUFFER_ID */
        case 8: *(int *)data[i] = 0; break;                                              /* IS_MANAGED */
        case 9: *(int *)data[i] = r ? 0 : -1; break;                                     /* DEVICE_ORDINAL */
        case 10: *(int *)data[i] = 0; break;                                             /* IS_LEGACY_IPC */
        case 11: *(stub_ptr_t *)data[i] = r ? r->va : 0; break;                          /* RANGE_START */
        case 12: *(size_t *)data[i] = r ? r->size : 0; break;                            /* RANGE_SIZE */
        case 13: *(int *)data[i] = m != NULL; break;                                     /* MAPPED */
        case STUB_ATTR_MEMORY_BLOCK_ID: *(unsigned long long *)data[i] = m ? m->a->tag : 0; break;
        default: rc = refuse("cuPointerGetAttributes", "an attribute the stub does not have"); break;
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

stub_result_t cuMemGetAddressRange_v2(stub_ptr_t *base, size_t *size, stub_ptr_t p)
{
    pthread_mutex_lock(&lock);
    const mapping_t *m = map_at(p);
    if (m != NULL) {
        *base = m->va;
        *size = m->size;
    }
    pthread_mutex_unlock(&lock);
    return m != NULL ? STUB_SUCCESS : STUB_ERROR_NOT_FOUND;
}

/* ------------------------------------------------------------ cuMem */

stub_result_t cuMemGetAllocationGranularity(size_t *g, const stub_mem_prop_t *prop, int option)
{
    if (prop->location.id != 0)
        return refuse("cuMemGetAllocationGranularity", "a device other than 0");
    *g = STUB_GRANULARITY;
    return STUB_SUCCESS;
}

stub_result_t cuMemAddressReserve(stub_ptr_t *ptr, size_t size, size_t alignment, stub_ptr_t addr,
                                  unsigned long long flags)
{
    if (size == 0 || size % 4096 != 0 || (alignment & (alignment - 1)) != 0)
        return refuse("cuMemAddressReserve", "size not a page multiple, or alignment not a power of two");
    size_t align = alignment > STUB_GRANULARITY ? alignment : STUB_GRANULARITY;
    size_t raw_size = size + align;
    void *raw = mmap(NULL, raw_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED)
        return refuse("cuMemAddressReserve", "mmap failed");
    pthread_mutex_lock(&lock);
    if (!grow((void **)&res, &res_cap, nres, sizeof *res)) {
        pthread_mutex_unlock(&lock);
        munmap(raw, raw_size);
        return refuse("cuMemAddressReserve", "out of memory");
    }
    stub_ptr_t va = ((stub_ptr_t)(uintptr_t)raw + align - 1) / align * align;
    res[nres++] = (reservation_t){ .va = va, .size = size, .raw = raw, .raw_size = raw_size };
    pthread_mutex_unlock(&lock);
    *ptr = va;
    return STUB_SUCCESS;
}

stub_result_t cuMemAddressFree(stub_ptr_t ptr, size_t size)
{
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < nres; i++) {
        if (res[i].va != ptr)
            continue;
        if (res[i].size != size) {
            pthread_mutex_unlock(&lock);
            return refuse("cuMemAddressFree", "not the size reserved");
        }
        for (size_t j = 0; j < nmaps; j++) {
            if (maps[j].va >= ptr && maps[j].va - ptr < size) {
                pthread_mutex_unlock(&lock);
                return refuse("cuMemAddressFree", "the reservation still has mappings");
            }
        }
        munmap(res[i].raw, res[i].raw_size);
        res[i] = res[--nres];
        pthread_mutex_unlock(&lock);
        stub_log("addrfree size=%zu", size);
        return STUB_SUCCESS;
    }
    pthread_mutex_unlock(&lock);
    return refuse("cuMemAddressFree", "no reservation starts there");
}

stub_result_t cuMemCreate(stub_mem_t *handle, size_t size, const stub_mem_prop_t *prop, unsigned long long flags)
{
    if (size == 0 || size % STUB_GRANULARITY != 0 || prop->location.type != 1 || prop->location.id != 0)
        return refuse("cuMemCreate", "size not a granularity multiple, or not device 0");
    pthread_mutex_lock(&lock);
    alloc_t *a = alloc_new(((uint64_t)getpid() << 24) | next_tag++, size, prop->requested_handle_types);
    pthread_mutex_unlock(&lock);
    if (a == NULL)
        return refuse("cuMemCreate", "out of memory");
    *handle = (stub_mem_t)(uintptr_t)a;
    return STUB_SUCCESS;
}

stub_result_t cuMemRelease(stub_mem_t handle)
{
    pthread_mutex_lock(&lock);
    alloc_unref((alloc_t *)(uintptr_t)handle);
    pthread_mutex_unlock(&lock);
    return STUB_SUCCESS;
}

stub_result_t cuMemRetainAllocationHandle(stub_mem_t *handle, void *addr)
{
    pthread_mutex_lock(&lock);
    mapping_t *m = map_at((stub_ptr_t)(uintptr_t)addr);
    if (m != NULL) {
        m->a->refs++;
        *handle = (stub_mem_t)(uintptr_t)m->a;
    }
    pthread_mutex_unlock(&lock);
    return m != NULL ? STUB_SUCCESS : refuse("cuMemRetainAllocationHandle", "not mapped");
}

stub_result_t cuMemGetAllocationPropertiesFromHandle(stub_mem_prop_t *prop, stub_mem_t handle)
{
    const alloc_t *a = (const alloc_t *)(uintptr_t)handle;
    memset(prop, 0, sizeof *prop);
    prop->type = 1;   /* PINNED */
    prop->requested_handle_types = a->types;
    prop->location.type = 1;
    prop->location.id = 0;
    return STUB_SUCCESS;
}

stub_result_t cuMemExportToShareableHandle(void *shareable, stub_mem_t handle, int type, unsigned long long flags)
{
    const alloc_t *a = (const alloc_t *)(uintptr_t)handle;
    if (type != STUB_HANDLE_POSIX_FD || !(a->types & STUB_HANDLE_POSIX_FD))
        return refuse("cuMemExportToShareableHandle", "not created with the POSIX descriptor handle type");
    int fd = memfd_create(MEMFD_NAME, MFD_CLOEXEC);
    if (fd < 0)
        return refuse("cuMemExportToShareableHandle", "memfd_create failed");
    if (ftruncate(fd, (off_t)a->size) != 0 || pwrite(fd, &a->tag, sizeof a->tag, 0) != (ssize_t)sizeof a->tag) {
        close(fd);
        return refuse("cuMemExportToShareableHandle", "cannot write the memfd");
    }
    *(int *)shareable = fd;
    return STUB_SUCCESS;
}

stub_result_t cuMemImportFromShareableHandle(stub_mem_t *handle, void *os_handle, int type)
{
    int fd = (int)(intptr_t)os_handle;
    char link[64], target[128];
    struct stat st;
    uint64_t tag = 0;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (type != STUB_HANDLE_POSIX_FD || n <= 0)
        return refuse("cuMemImportFromShareableHandle", "not a descriptor");
    target[n] = '\0';
    if (strstr(target, "memfd:" MEMFD_NAME) == NULL)
        return refuse("cuMemImportFromShareableHandle", "not a descriptor the stub exported");
    if (fstat(fd, &st) != 0 || pread(fd, &tag, sizeof tag, 0) != (ssize_t)sizeof tag)
        return refuse("cuMemImportFromShareableHandle", "cannot read the memfd");
    pthread_mutex_lock(&lock);
    alloc_t *a = alloc_new(tag, (size_t)st.st_size, STUB_HANDLE_POSIX_FD);
    pthread_mutex_unlock(&lock);
    if (a == NULL)
        return refuse("cuMemImportFromShareableHandle", "out of memory");
    stub_log("import tag=%llu size=%zu", (unsigned long long)tag, a->size);
    *handle = (stub_mem_t)(uintptr_t)a;
    return STUB_SUCCESS;
}

stub_result_t cuMemMap(stub_ptr_t ptr, size_t size, size_t offset, stub_mem_t handle, unsigned long long flags)
{
    alloc_t *a = (alloc_t *)(uintptr_t)handle;
    if (offset != 0 || size == 0 || size % STUB_GRANULARITY != 0 || ptr % STUB_GRANULARITY != 0 || size > a->size)
        return refuse("cuMemMap", "offset not 0, or size or address not aligned, or larger than the allocation");
    pthread_mutex_lock(&lock);
    const reservation_t *r = res_at(ptr);
    if (r == NULL || size > r->size - (ptr - r->va)) {
        pthread_mutex_unlock(&lock);
        return refuse("cuMemMap", "not inside one reservation");
    }
    for (size_t i = 0; i < nmaps; i++) {
        if (ptr < maps[i].va + maps[i].size && maps[i].va < ptr + size) {
            pthread_mutex_unlock(&lock);
            return refuse("cuMemMap", "already mapped");
        }
    }
    if (!grow((void **)&maps, &maps_cap, nmaps, sizeof *maps)) {
        pthread_mutex_unlock(&lock);
        return refuse("cuMemMap", "out of memory");
    }
    a->refs++;
    maps[nmaps++] = (mapping_t){ .va = ptr, .size = size, .a = a, .buffer_id = next_buffer_id++ };
    stub_ptr_t off = ptr - r->va;
    pthread_mutex_unlock(&lock);
    stub_log("map tag=%llu at=%llu size=%zu", (unsigned long long)a->tag, off, size);
    return STUB_SUCCESS;
}

stub_result_t cuMemUnmap(stub_ptr_t ptr, size_t size)
{
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < nmaps; i++) {
        if (maps[i].va != ptr)
            continue;
        if (maps[i].size != size) {
            pthread_mutex_unlock(&lock);
            return refuse("cuMemUnmap", "not a whole mapping");
        }
        const reservation_t *r = res_at(ptr);
        unsigned long long tag = maps[i].a->tag, off = r ? ptr - r->va : 0;
        alloc_unref(maps[i].a);
        maps[i] = maps[--nmaps];
        pthread_mutex_unlock(&lock);
        stub_log("unmap tag=%llu at=%llu", tag, off);
        return STUB_SUCCESS;
    }
    pthread_mutex_unlock(&lock);
    return refuse("cuMemUnmap", "no mapping starts there");
}

stub_result_t cuMemSetAccess(stub_ptr_t ptr, size_t size, const stub_access_desc_t *desc, size_t count)
{
    pthread_mutex_lock(&lock);
    /* The whole range must be mapped: walk it mapping by mapping. */
    stub_ptr_t at = ptr;
    while (at < ptr + size) {
        mapping_t *m = map_at(at);
        if (m == NULL) {
            pthread_mutex_unlock(&lock);
            return refuse("cuMemSetAccess", "part of the range is not mapped");
        }
        m->access = true;
        at = m->va + m->size;
    }
    pthread_mutex_unlock(&lock);
    return count == 1 && desc->location.type == 1 && desc->location.id == 0 && desc->flags == 3
               ? STUB_SUCCESS
               : refuse("cuMemSetAccess", "not read/write access for device 0");
}
