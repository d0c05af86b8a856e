/*
 * cuda.c — exporting GPU memory to the daemon.
 *
 * libspclient does not link the CUDA driver: an application without a GPU links
 * the same library, so the driver API is loaded here at run time, on first use.
 * (The static CUDA runtime that spc_lse_merge's kernel brings, merge.c, loads
 * the driver itself, and only when a merge of device memory calls it.) The few
 * driver types and numbers used are written out below; they are the driver's
 * ABI (cuda.h), which does not change between releases.
 *
 * What spc_register_device needs of a device pointer: that it is device memory;
 * the GPU (PCI bus id and UUID, since ordinals depend on CUDA_VISIBLE_DEVICES);
 * and a way for the daemon to open the memory, which depends on how it was made:
 *
 *   - cudaMalloc (cuMemAlloc) memory: the allocation it lies in (base and size:
 *     the IPC handle names the whole allocation), its buffer id (so the daemon
 *     can tell a reused address from the allocation it imported), and the
 *     cuIpcGetMemHandle handle;
 *   - cuMem (virtual memory management) memory, as PyTorch's expandable
 *     segments make it: physical allocations mapped back to back into one
 *     reserved range, 2 or 20 MiB at a time, which cuIpcGetMemHandle cannot
 *     export. The range is walked chunk by chunk: each physical allocation it
 *     touches is exported as a POSIX file descriptor, with its extent and the
 *     buffer id of its mapping.
 *
 * The last sections answer the registration cache's questions (devcache.c:
 * what memory a pointer lies in, which chunk is mapped at an address) and give
 * stream.c the driver calls of stream order.
 */
#include "internal.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef int cu_result_t;                 /* CUresult */
typedef unsigned long long cu_ptr_t;     /* CUdeviceptr */
typedef void *cu_ctx_t;                  /* CUcontext */
typedef unsigned long long cu_mem_t;     /* CUmemGenericAllocationHandle */

/* CUmemAllocationProp (32 bytes); enums are ints. */
typedef struct cu_mem_prop {
    int   type;                          /* CUmemAllocationType */
    int   requested_handle_types;        /* CUmemAllocationHandleType bits */
    struct { int type, id; } location;   /* CUmemLocation */
    void *win32_metadata;
    struct {
        unsigned char  compression_type, gpu_direct_rdma_capable;
        unsigned short usage;
        unsigned char  reserved[4];
    } alloc_flags;
} cu_mem_prop_t;

enum {
    CU_SUCCESS = 0,
    CU_ATTR_MEMORY_TYPE = 2,
    CU_ATTR_BUFFER_ID = 7,
    CU_ATTR_IS_MANAGED = 8,
    CU_ATTR_DEVICE_ORDINAL = 9,
    CU_ATTR_IS_LEGACY_IPC_CAPABLE = 10,
    CU_ATTR_RANGE_START_ADDR = 11,
    CU_ATTR_RANGE_SIZE = 12,
    CU_ATTR_MAPPED = 13,
    CU_ATTR_MEMORY_BLOCK_ID = 20,
    CU_MEMORYTYPE_DEVICE = 2,
    CU_ERROR_NOT_READY = 600,
    CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS = 122,
    CU_MEMHOSTREGISTER_PORTABLE = 1,
    CU_MEMHOSTREGISTER_DEVICEMAP = 2,
    CU_STREAM_WAIT_VALUE_GEQ = 0,
    CU_STREAM_WRITE_VALUE_DEFAULT = 0,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1,
    CU_MEM_LOCATION_TYPE_DEVICE = 1,
};

typedef struct cu_api {
    cu_result_t (*init)(unsigned);
    cu_result_t (*error_string)(cu_result_t, const char **);
    cu_result_t (*pointer_get_attributes)(unsigned, int *, void **, cu_ptr_t);
    cu_result_t (*ipc_get_mem_handle)(void *, cu_ptr_t);
    cu_result_t (*device_get)(int *, int);
    cu_result_t (*device_get_pci_bus_id)(char *, int, int);
    cu_result_t (*device_get_uuid)(void *, int);
    cu_result_t (*ctx_get_current)(cu_ctx_t *);
    cu_result_t (*primary_ctx_retain)(cu_ctx_t *, int);
    cu_result_t (*primary_ctx_release)(int);
    cu_result_t (*ctx_push)(cu_ctx_t);
    cu_result_t (*ctx_pop)(cu_ctx_t *);
    /* Stream order (stream.c). */
    cu_result_t (*stream_get_ctx)(void *, cu_ctx_t *);
    cu_result_t (*ctx_get_device)(int *);
    cu_result_t (*device_get_attribute)(int *, int, int);
    cu_result_t (*host_register)(void *, size_t, unsigned);
    cu_result_t (*host_unregister)(void *);
    cu_result_t (*host_get_device_pointer)(cu_ptr_t *, void *, unsigned);
    cu_result_t (*write_value64)(void *, cu_ptr_t, unsigned long long, unsigned);
    cu_result_t (*wait_value64)(void *, cu_ptr_t, unsigned long long, unsigned);
    cu_result_t (*stream_synchronize)(void *);
    /* cuMem memory */
    cu_result_t (*mem_get_address_range)(cu_ptr_t *, size_t *, cu_ptr_t);
    cu_result_t (*mem_retain)(cu_mem_t *, void *);
    cu_result_t (*mem_props)(cu_mem_prop_t *, cu_mem_t);
    cu_result_t (*mem_export)(void *, cu_mem_t, int, unsigned long long);
    cu_result_t (*mem_release)(cu_mem_t);
} cu_api_t;

static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static cu_api_t cu;
static bool cu_ok;
static char cu_why[160];

static const char *cu_msg(cu_result_t rc)
{
    const char *s = NULL;
    if (cu.error_string == NULL || cu.error_string(rc, &s) != CU_SUCCESS || s == NULL)
        s = "unknown CUDA error";
    return s;
}

/* Whether a stream is being captured into a graph: asked where the driver
 * has it (every CUDA 12 driver does), so not among the calls cu_load needs. */
static cu_result_t (*cu_stream_is_capturing)(void *, int *);

/* Loads the driver once per process; the library stays loaded. */
static void cu_load(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        snprintf(cu_why, sizeof cu_why, "no CUDA driver on this machine (%s)", dlerror());
        return;
    }
    *(void **)&cu_stream_is_capturing = dlsym(lib, "cuStreamIsCapturing");
    /* The _v2 names are what cuda.h maps the plain ones to. */
    *(void **)&cu.init = dlsym(lib, "cuInit");
    *(void **)&cu.error_string = dlsym(lib, "cuGetErrorString");
    *(void **)&cu.pointer_get_attributes = dlsym(lib, "cuPointerGetAttributes");
    *(void **)&cu.ipc_get_mem_handle = dlsym(lib, "cuIpcGetMemHandle");
    *(void **)&cu.device_get = dlsym(lib, "cuDeviceGet");
    *(void **)&cu.device_get_pci_bus_id = dlsym(lib, "cuDeviceGetPCIBusId");
    *(void **)&cu.device_get_uuid = dlsym(lib, "cuDeviceGetUuid_v2");
    if (cu.device_get_uuid == NULL)
        *(void **)&cu.device_get_uuid = dlsym(lib, "cuDeviceGetUuid");
    *(void **)&cu.ctx_get_current = dlsym(lib, "cuCtxGetCurrent");
    *(void **)&cu.primary_ctx_retain = dlsym(lib, "cuDevicePrimaryCtxRetain");
    *(void **)&cu.primary_ctx_release = dlsym(lib, "cuDevicePrimaryCtxRelease_v2");
    *(void **)&cu.ctx_push = dlsym(lib, "cuCtxPushCurrent_v2");
    *(void **)&cu.ctx_pop = dlsym(lib, "cuCtxPopCurrent_v2");
    *(void **)&cu.stream_get_ctx = dlsym(lib, "cuStreamGetCtx");
    *(void **)&cu.ctx_get_device = dlsym(lib, "cuCtxGetDevice");
    *(void **)&cu.device_get_attribute = dlsym(lib, "cuDeviceGetAttribute");
    *(void **)&cu.host_register = dlsym(lib, "cuMemHostRegister_v2");
    *(void **)&cu.host_unregister = dlsym(lib, "cuMemHostUnregister");
    *(void **)&cu.host_get_device_pointer = dlsym(lib, "cuMemHostGetDevicePointer_v2");
    *(void **)&cu.write_value64 = dlsym(lib, "cuStreamWriteValue64_v2");
    *(void **)&cu.wait_value64 = dlsym(lib, "cuStreamWaitValue64_v2");
    *(void **)&cu.stream_synchronize = dlsym(lib, "cuStreamSynchronize");
    *(void **)&cu.mem_get_address_range = dlsym(lib, "cuMemGetAddressRange_v2");
    *(void **)&cu.mem_retain = dlsym(lib, "cuMemRetainAllocationHandle");
    *(void **)&cu.mem_props = dlsym(lib, "cuMemGetAllocationPropertiesFromHandle");
    *(void **)&cu.mem_export = dlsym(lib, "cuMemExportToShareableHandle");
    *(void **)&cu.mem_release = dlsym(lib, "cuMemRelease");
    for (size_t i = 0; i < sizeof cu / sizeof(void *); i++) {
        if (((void **)&cu)[i] == NULL) {
            snprintf(cu_why, sizeof cu_why, "libcuda.so.1 lacks the driver API this library needs (CUDA 12 or later)");
            return;
        }
    }
    cu_result_t rc = cu.init(0);
    if (rc != CU_SUCCESS) {
        snprintf(cu_why, sizeof cu_why, "cuInit failed: %s (error %d)", cu_msg(rc), rc);
        return;
    }
    cu_ok = true;
}

/* ------------------------------------------------------------ cudaMalloc memory */

/* The IPC handle of the allocation [base, base + size) that [p, p + bytes) lies in. */
static spc_status_t ipc_export(spc_handle_t *h, cu_ptr_t p, size_t bytes, cu_ptr_t base, size_t size,
                               spc__device_export_t *x)
{
    if (p < base || p - base > size || bytes > size - (p - base))
        return spc__fail(h, SPC_ERR_OUT_OF_BOUNDS, "0x%llx + %zu bytes run past its allocation (0x%llx + %zu bytes)",
                         p, bytes, base, size);
    cu_result_t rc = cu.ipc_get_mem_handle(x->ipc_handle, base);
    if (rc != CU_SUCCESS)
        return spc__fail(h, SPC_ERR_DEVICE, "cuIpcGetMemHandle(0x%llx) on device %d: %s (error %d)", base, x->device,
                         cu_msg(rc), rc);
    x->base = base;
    x->size = size;
    return SPC_OK;
}

/* ------------------------------------------------------------ cuMem memory */

/*
 * The extent [*base_p, *base_p + *size_p) of the chunk of cuMem memory mapped
 * at `at`: for cuMem memory cuMemGetAddressRange gives the one mapping that
 * contains the address (the pointer's RANGE_* attributes give the whole
 * reservation instead). An address reserved but not mapped is out of bounds
 * (the MAPPED attribute says so; where the driver cannot say,
 * cuMemGetAddressRange fails there).
 */
static spc_status_t chunk_extent(spc_handle_t *h, cu_ptr_t at, cu_ptr_t *base_p, size_t *size_p)
{
    cu_ptr_t base = 0;
    size_t size = 0;
    int mapped = 1, attr = CU_ATTR_MAPPED;
    void *val = &mapped;

    cu_result_t rc = cu.pointer_get_attributes(1, &attr, &val, at);
    if (rc == CU_SUCCESS && !mapped)
        return spc__fail(h, SPC_ERR_OUT_OF_BOUNDS, "0x%llx is reserved but not mapped: a registered range must be "
                         "backed by memory throughout", at);
    rc = cu.mem_get_address_range(&base, &size, at);
    if (rc != CU_SUCCESS)
        return spc__fail(h, SPC_ERR_OUT_OF_BOUNDS, "0x%llx is not mapped (cuMemGetAddressRange: %s, error %d): a "
                         "registered range must be backed by memory throughout", at, cu_msg(rc), rc);
    if (at < base || at - base >= size)
        return spc__fail(h, SPC_ERR_DEVICE, "cuMemGetAddressRange(0x%llx) gave 0x%llx + %zu bytes, which does not "
                         "hold it", at, base, size);
    *base_p = base;
    *size_p = size;
    return SPC_OK;
}

/*
 * Exports the chunk mapped at [base, base + ch->size):
 *   - its physical allocation, retained only to read its properties: it must
 *     be device memory on the range's GPU (*device, or any when it is -1; it
 *     becomes the chunk's), created with the POSIX file descriptor among its
 *     requested handle types, or it cannot be exported;
 *   - a descriptor of it (cuMemExportToShareableHandle) into ch->fd;
 *   - the ids of the mapping and of the physical allocation (buffer id, memory
 *     block id), by which the daemon tells this chunk from memory mapped at the
 *     same address later.
 * On failure ch->fd stays -1.
 */
static spc_status_t chunk_export(spc_handle_t *h, cu_ptr_t base, int *device, spc__device_chunk_t *ch)
{
    cu_mem_t mem;
    cu_mem_prop_t prop;
    int fd = -1;
    unsigned long long id = 0, block = 0;

    cu_result_t rc = cu.mem_retain(&mem, (void *)(uintptr_t)base);
    if (rc != CU_SUCCESS)
        return spc__fail(h, SPC_ERR_UNSUPPORTED, "0x%llx lies in memory that neither CUDA IPC nor a cuMem export "
                         "can share (cuMemRetainAllocationHandle: %s), such as cudaMallocAsync pool memory: use "
                         "cudaMalloc or cuMemCreate memory", base, cu_msg(rc));
    memset(&prop, 0, sizeof prop);
    if ((rc = cu.mem_props(&prop, mem)) != CU_SUCCESS) {
        cu.mem_release(mem);
        return spc__fail(h, SPC_ERR_DEVICE, "cuMemGetAllocationPropertiesFromHandle of the memory at 0x%llx: %s "
                         "(error %d)", base, cu_msg(rc), rc);
    }
    if (!(prop.requested_handle_types & CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)) {
        cu.mem_release(mem);
        return spc__fail(h, SPC_ERR_UNSUPPORTED, "the cuMem allocation mapped at 0x%llx (%llu bytes) was created "
                         "without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR in its requested handle types, so it "
                         "cannot be exported to spd: set CUmemAllocationProp.requestedHandleTypes to include it "
                         "when calling cuMemCreate", base, (unsigned long long)ch->size);
    }
    if (prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE || (*device >= 0 && prop.location.id != *device)) {
        cu.mem_release(mem);
        return spc__fail(h, SPC_ERR_INVALID_ARG, "the cuMem allocation mapped at 0x%llx is %s (location type %d, "
                         "id %d): a registered range must lie in the memory of one GPU", base,
                         prop.location.type != CU_MEM_LOCATION_TYPE_DEVICE ? "not GPU memory" : "on another GPU",
                         prop.location.type, prop.location.id);
    }
    rc = cu.mem_export(&fd, mem, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
    cu.mem_release(mem);   /* the mapping keeps the memory; the retain was only for asking */
    if (rc != CU_SUCCESS)
        return spc__fail(h, SPC_ERR_DEVICE, "cuMemExportToShareableHandle of the cuMem allocation at 0x%llx: %s "
                         "(error %d); each chunk holds a file descriptor until spd replies, so RLIMIT_NOFILE may be "
                         "what ran out", base, cu_msg(rc), rc);
    int attr = CU_ATTR_BUFFER_ID;
    void *val = &id;
    rc = cu.pointer_get_attributes(1, &attr, &val, base);
    if (rc != CU_SUCCESS || id == 0) {
        close(fd);
        return spc__fail(h, rc != CU_SUCCESS ? SPC_ERR_DEVICE : SPC_ERR_UNSUPPORTED, "the buffer id of the cuMem "
                         "mapping at 0x%llx: %s; without it spd could not tell this memory from memory mapped there "
                         "later", base, rc != CU_SUCCESS ? cu_msg(rc) : "the driver gives none");
    }
    /* Drivers before the attribute refuse it: the buffer id alone is then the identity. */
    attr = CU_ATTR_MEMORY_BLOCK_ID;
    val = &block;
    if (cu.pointer_get_attributes(1, &attr, &val, base) != CU_SUCCESS)
        block = 0;
    *device = prop.location.id;
    ch->buffer_id = id;
    ch->block_id = block;
    ch->fd = fd;
    return SPC_OK;
}

/* Appends a chunk to x's list. */
static spc_status_t chunk_append(spc_handle_t *h, spc__device_export_t *x, uint32_t *cap,
                                 const spc__device_chunk_t *ch)
{
    if (x->nchunks == *cap) {
        uint32_t ncap = *cap ? 2 * *cap : 8;
        spc__device_chunk_t *n = realloc(x->chunks, ncap * sizeof *n);
        if (n == NULL)
            return spc__fail(h, SPC_ERR_NO_MEMORY, "out of memory");
        x->chunks = n;
        *cap = ncap;
    }
    x->chunks[x->nchunks++] = *ch;
    return SPC_OK;
}

/* Exports every chunk [p, p + bytes) touches, in address order; they must be
 * mapped back to back. The extents come first, so that a range over too many
 * chunks, or into a hole, is refused before any descriptor is open. x->device
 * becomes the chunks' GPU. */
static spc_status_t vmm_export(spc_handle_t *h, cu_ptr_t p, size_t bytes, spc__device_export_t *x)
{
    uint32_t cap = 0;
    int device = -1;
    spc_status_t st = SPC_OK;

    if (bytes > ~0ull - p)
        return spc__fail(h, SPC_ERR_OUT_OF_BOUNDS, "0x%llx + %zu bytes wrap around the address space", p, bytes);
    for (cu_ptr_t at = p; at < p + bytes && st == SPC_OK;) {
        cu_ptr_t base = 0;
        size_t size = 0;
        if (x->nchunks == SP_DEVICE_MAX_CHUNKS) {
            st = spc__fail(h, SPC_ERR_LIMIT, "0x%llx + %zu bytes span more than %u cuMem chunks, the most one "
                           "registration takes: register a shorter range", p, bytes, SP_DEVICE_MAX_CHUNKS);
            break;
        }
        if ((st = chunk_extent(h, at, &base, &size)) != SPC_OK)
            break;
        if (x->nchunks == 0)
            x->base = base;
        /* Each step starts where the chunk before ended, so the next chunk
         * holds that address: it starts there unless the driver's ranges
         * overlap, which would be a driver bug. */
        if (x->nchunks > 0 && base != at) {
            st = spc__fail(h, SPC_ERR_DEVICE, "cuMem mappings overlap at 0x%llx (one starts at 0x%llx)", at, base);
            break;
        }
        spc__device_chunk_t ch = { .offset = base - x->base, .size = size, .fd = -1 };
        st = chunk_append(h, x, &cap, &ch);
        at = base + size;
    }
    for (uint32_t i = 0; i < x->nchunks && st == SPC_OK; i++)
        st = chunk_export(h, x->base + x->chunks[i].offset, &device, &x->chunks[i]);
    if (st != SPC_OK) {
        spc__cuda_export_release(x);
        return st;
    }
    const spc__device_chunk_t *last = &x->chunks[x->nchunks - 1];
    x->size = last->offset + last->size;
    x->device = device;
    return SPC_OK;
}

void spc__cuda_export_release(spc__device_export_t *x)
{
    for (uint32_t i = 0; i < x->nchunks; i++)
        if (x->chunks[i].fd >= 0)
            close(x->chunks[i].fd);
    free(x->chunks);
    x->chunks = NULL;
    x->nchunks = 0;
}

/* What the driver says of a pointer. One it does not know (plain host memory)
 * comes back as memory type 0 without an error. */
typedef struct ptr_attrs {
    unsigned           memtype;
    int                ordinal, managed, ipc_capable;
    unsigned long long buffer_id;
    cu_ptr_t           base;
    size_t             size;
} ptr_attrs_t;

static cu_result_t pointer_attrs(cu_ptr_t p, ptr_attrs_t *a)
{
    *a = (ptr_attrs_t){ .ordinal = -1 };
    int attrs[] = { CU_ATTR_MEMORY_TYPE, CU_ATTR_DEVICE_ORDINAL, CU_ATTR_IS_MANAGED, CU_ATTR_IS_LEGACY_IPC_CAPABLE,
                    CU_ATTR_BUFFER_ID, CU_ATTR_RANGE_START_ADDR, CU_ATTR_RANGE_SIZE };
    void *vals[] = { &a->memtype, &a->ordinal, &a->managed, &a->ipc_capable, &a->buffer_id, &a->base, &a->size };
    return cu.pointer_get_attributes(sizeof attrs / sizeof attrs[0], attrs, vals, p);
}

/* ------------------------------------------------------------ the export */

spc_status_t spc__cuda_export(spc_handle_t *h, const void *dptr, size_t bytes, spc__device_export_t *x_p)
{
    pthread_once(&cu_once, cu_load);
    if (!cu_ok)
        return spc__fail(h, SPC_ERR_NO_DEVICE, "%s", cu_why);

    const cu_ptr_t p = (cu_ptr_t)(uintptr_t)dptr;
    ptr_attrs_t a;
    cu_result_t rc = pointer_attrs(p, &a);
    if (rc != CU_SUCCESS)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "%p: cuPointerGetAttributes failed: %s (error %d)", dptr,
                         cu_msg(rc), rc);
    if (a.memtype != CU_MEMORYTYPE_DEVICE || a.managed)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "%p is not device memory (%s): spc_register takes host memory",
                         dptr, a.managed ? "managed memory" : a.memtype == 0 ? "unknown to the driver" : "host memory");

    spc__device_export_t x;
    memset(&x, 0, sizeof x);
    x.device = a.ordinal;
    int dev = -1;
    /* cuIpcGetMemHandle and cuMemGetAddressRange want a current context; a
     * thread that allocated through the runtime has its device's primary
     * context, another may not. */
    cu_ctx_t cur = NULL, pushed = NULL;
    if (cu.ctx_get_current(&cur) != CU_SUCCESS || cur == NULL) {
        if ((rc = cu.device_get(&dev, a.ordinal)) != CU_SUCCESS || (rc = cu.primary_ctx_retain(&pushed, dev)) != CU_SUCCESS)
            return spc__fail(h, SPC_ERR_DEVICE, "device %d: no context to ask in: %s (error %d)", a.ordinal,
                             cu_msg(rc), rc);
        if ((rc = cu.ctx_push(pushed)) != CU_SUCCESS) {
            cu.primary_ctx_release(dev);
            return spc__fail(h, SPC_ERR_DEVICE, "device %d: cuCtxPushCurrent: %s (error %d)", a.ordinal, cu_msg(rc),
                             rc);
        }
    }
    spc_status_t st = a.ipc_capable ? ipc_export(h, p, bytes, a.base, a.size, &x) : vmm_export(h, p, bytes, &x);
    if (pushed != NULL) {
        cu_ctx_t popped;
        cu.ctx_pop(&popped);
        cu.primary_ctx_release(dev);
    }
    if (st != SPC_OK)
        return st;

    /* The GPU by names that mean the same in the daemon. */
    if ((rc = cu.device_get(&dev, x.device)) != CU_SUCCESS ||
        (rc = cu.device_get_pci_bus_id(x.pci_bus_id, sizeof x.pci_bus_id, dev)) != CU_SUCCESS ||
        (rc = cu.device_get_uuid(x.uuid, dev)) != CU_SUCCESS) {
        spc__cuda_export_release(&x);
        return spc__fail(h, SPC_ERR_DEVICE, "device %d of %p: %s (error %d)", x.device, dptr, cu_msg(rc), rc);
    }
    if (a.ipc_capable)
        x.buffer_id = a.buffer_id;
    *x_p = x;
    return SPC_OK;
}

/* ================================================================ the cache's questions */

/* Runs `call` with a current context: the thread's own, or else the primary
 * context of device `ordinal`, made current only around it. */
#define WITH_SOME_CTX(ordinal, rc, call)                                                \
    do {                                                                                \
        cu_ctx_t cur_ = NULL, popped_;                                                  \
        int dev_ = -1;                                                                  \
        if (cu.ctx_get_current(&cur_) == CU_SUCCESS && cur_ != NULL) {                  \
            (rc) = (call);                                                              \
        } else if (((rc) = cu.device_get(&dev_, (ordinal))) == CU_SUCCESS &&            \
                   ((rc) = cu.primary_ctx_retain(&cur_, dev_)) == CU_SUCCESS) {         \
            if (((rc) = cu.ctx_push(cur_)) == CU_SUCCESS) {                             \
                (rc) = (call);                                                          \
                cu.ctx_pop(&popped_);                                                   \
            }                                                                           \
            cu.primary_ctx_release(dev_);                                               \
        }                                                                               \
    } while (0)

spc_status_t spc__cuda_load(spc_handle_t *h)
{
    pthread_once(&cu_once, cu_load);
    return cu_ok ? SPC_OK : spc__fail(h, SPC_ERR_NO_DEVICE, "%s", cu_why);
}

bool spc__cuda_current_bus_id(char *bus, size_t len)
{
    /* Loading the driver costs a host rank time and memory for nothing: only a
     * process that has it loaded already has a current context to speak of. */
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (lib == NULL)
        return false;
    dlclose(lib);   /* the process's own reference keeps it loaded */
    pthread_once(&cu_once, cu_load);
    cu_ctx_t ctx = NULL;
    int dev;
    return cu_ok && cu.ctx_get_current(&ctx) == CU_SUCCESS && ctx != NULL && cu.ctx_get_device(&dev) == CU_SUCCESS &&
           cu.device_get_pci_bus_id(bus, (int)len, dev) == CU_SUCCESS;
}

bool spc__cuda_where(uint64_t p, spc__cuda_where_t *w_p)
{
    ptr_attrs_t a;
    if (pointer_attrs(p, &a) != CU_SUCCESS || a.memtype != CU_MEMORYTYPE_DEVICE || a.managed)
        return false;
    *w_p = (spc__cuda_where_t){ .base = a.base, .size = a.size, .buffer_id = a.buffer_id, .device = a.ordinal,
                                .vmm = !a.ipc_capable };
    return true;
}

/* Whether the driver answers MEMORY_BLOCK_ID; those before it refuse a call
 * that asks for it, and the buffer id alone then tells mappings apart. */
static int block_ids = 1;

bool spc__cuda_chunk_ids(uint64_t at, uint64_t *buffer_id_p, uint64_t *block_id_p)
{
    int mapped = 0;
    unsigned long long id = 0, block = 0;
    int attrs[] = { CU_ATTR_MAPPED, CU_ATTR_BUFFER_ID, CU_ATTR_MEMORY_BLOCK_ID };
    void *vals[] = { &mapped, &id, &block };
    cu_result_t rc = CU_ERROR_NOT_READY;
    if (__atomic_load_n(&block_ids, __ATOMIC_RELAXED))
        rc = cu.pointer_get_attributes(3, attrs, vals, at);
    if (rc != CU_SUCCESS) {
        mapped = 0, id = 0, block = 0;
        if (cu.pointer_get_attributes(2, attrs, vals, at) != CU_SUCCESS)
            return false;
        __atomic_store_n(&block_ids, 0, __ATOMIC_RELAXED);   /* the same call without it went through */
    }
    if (!mapped)
        return false;
    *buffer_id_p = id;
    *block_id_p = block;
    return true;
}

spc_status_t spc__cuda_chunk_at(spc_handle_t *h, int device, uint64_t at, spc__cuda_chunk_t *c_p)
{
    uint64_t id, block;
    cu_ptr_t base = 0;
    size_t size = 0;
    cu_result_t rc = CU_ERROR_NOT_READY;
    if (spc__cuda_chunk_ids(at, &id, &block))
        WITH_SOME_CTX(device, rc, cu.mem_get_address_range(&base, &size, at));
    if (rc != CU_SUCCESS)
        return spc__fail(h, SPC_ERR_OUT_OF_BOUNDS, "nothing mapped at 0x%llx", (unsigned long long)at);
    if (at < base || at - base >= size)
        return spc__fail(h, SPC_ERR_DEVICE, "cuMemGetAddressRange(0x%llx) gave 0x%llx + %zu bytes, which does not "
                         "hold it", (unsigned long long)at, base, size);
    *c_p = (spc__cuda_chunk_t){ .base = base, .size = size, .buffer_id = id, .block_id = block };
    return SPC_OK;
}

/* ================================================================ stream order */

spc_status_t spc__cuda_stream_info(spc_handle_t *h, void *cu_stream, spc__cuda_stream_info_t *info)
{
    pthread_once(&cu_once, cu_load);
    if (!cu_ok)
        return spc__fail(h, SPC_ERR_NO_DEVICE, "%s", cu_why);

    cu_ctx_t ctx = NULL, popped;
    cu_result_t rc = cu_stream != NULL ? cu.stream_get_ctx(cu_stream, &ctx) : cu.ctx_get_current(&ctx);
    if (rc != CU_SUCCESS || ctx == NULL)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "%s: %s", cu_stream ? "the stream's context" : "no current CUDA "
                         "context for the default stream", rc != CU_SUCCESS ? cu_msg(rc) : "none");
    int ordinal = -1, dev, on = 0;
    if ((rc = cu.ctx_push(ctx)) != CU_SUCCESS)
        return spc__fail(h, SPC_ERR_DEVICE, "cuCtxPushCurrent: %s (error %d)", cu_msg(rc), rc);
    rc = cu.ctx_get_device(&ordinal);
    cu.ctx_pop(&popped);
    memset(info, 0, sizeof *info);
    if (rc != CU_SUCCESS || (rc = cu.device_get(&dev, ordinal)) != CU_SUCCESS ||
        (rc = cu.device_get_pci_bus_id(info->pci_bus_id, sizeof info->pci_bus_id, dev)) != CU_SUCCESS ||
        (rc = cu.device_get_uuid(info->uuid, dev)) != CU_SUCCESS ||
        (rc = cu.device_get_attribute(&on, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, dev)) != CU_SUCCESS)
        return spc__fail(h, SPC_ERR_DEVICE, "the stream's device: %s (error %d)", cu_msg(rc), rc);
    if (!on)
        return spc__fail(h, SPC_ERR_UNSUPPORTED, "GPU %d cannot wait on 64-bit values (stream memory operations)",
                         ordinal);
    info->ctx = ctx;
    info->device = ordinal;
    return SPC_OK;
}

/* Runs with ctx current; the thread's own context is back afterwards. */
#define WITH_CTX(ctx, rc, call)                                                         \
    do {                                                                                \
        cu_ctx_t popped_;                                                               \
        (rc) = cu.ctx_push(ctx);                                                        \
        if ((rc) == CU_SUCCESS) {                                                       \
            (rc) = (call);                                                              \
            cu.ctx_pop(&popped_);                                                       \
        }                                                                               \
    } while (0)

spc_status_t spc__cuda_host_register(spc_handle_t *h, void *ctx, void *p, size_t n, uint64_t *dptr_p)
{
    cu_result_t rc;
    WITH_CTX(ctx, rc, cu.host_register(p, n, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP));
    if (rc != CU_SUCCESS)
        return spc__fail(h, SPC_ERR_DEVICE, "registering the stream semaphores with CUDA: %s (error %d)", cu_msg(rc),
                         rc);
    spc_status_t st = spc__cuda_host_pointer(h, ctx, p, dptr_p);
    if (st != SPC_OK)
        spc__cuda_host_unregister(p);
    return st;
}

spc_status_t spc__cuda_host_pointer(spc_handle_t *h, void *ctx, void *p, uint64_t *dptr_p)
{
    cu_result_t rc;
    cu_ptr_t dptr = 0;
    WITH_CTX(ctx, rc, cu.host_get_device_pointer(&dptr, p, 0));
    if (rc != CU_SUCCESS)
        return spc__fail(h, SPC_ERR_DEVICE, "the stream semaphores' device address: %s (error %d)", cu_msg(rc), rc);
    *dptr_p = dptr;
    return SPC_OK;
}

void spc__cuda_host_unregister(void *p)
{
    if (cu_ok)
        cu.host_unregister(p);
}

spc_status_t spc__cuda_write64(spc_handle_t *h, void *ctx, void *cu_stream, uint64_t dptr, uint64_t v)
{
    cu_result_t rc;
    WITH_CTX(ctx, rc, cu.write_value64(cu_stream, dptr, v, CU_STREAM_WRITE_VALUE_DEFAULT));
    return rc == CU_SUCCESS ? SPC_OK
                            : spc__fail(h, SPC_ERR_DEVICE, "cuStreamWriteValue64: %s (error %d)", cu_msg(rc), rc);
}

bool spc__cuda_capturing(void *ctx, void *cu_stream)
{
    (void)ctx;   /* a stream knows its context */
    int status = 0;   /* CU_STREAM_CAPTURE_STATUS_NONE */
    return cu_stream_is_capturing != NULL && cu_stream_is_capturing(cu_stream, &status) == CU_SUCCESS && status != 0;
}

spc_status_t spc__cuda_wait64(spc_handle_t *h, void *ctx, void *cu_stream, uint64_t dptr, uint64_t v)
{
    cu_result_t rc;
    WITH_CTX(ctx, rc, cu.wait_value64(cu_stream, dptr, v, CU_STREAM_WAIT_VALUE_GEQ));
    return rc == CU_SUCCESS ? SPC_OK
                            : spc__fail(h, SPC_ERR_DEVICE, "cuStreamWaitValue64: %s (error %d)", cu_msg(rc), rc);
}

spc_status_t spc__cuda_stream_sync(spc_handle_t *h, void *ctx, void *cu_stream)
{
    cu_result_t rc;
    WITH_CTX(ctx, rc, cu.stream_synchronize(cu_stream));
    return rc == CU_SUCCESS ? SPC_OK
                            : spc__fail(h, SPC_ERR_DEVICE, "cuStreamSynchronize: %s (error %d)", cu_msg(rc), rc);
}
