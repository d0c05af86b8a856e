/*
 * gpu.c — the CUDA driver, device contexts and streams, and clients' GPU
 * memory imported with CUDA IPC or as cuMem shareable handles (see gpu.h).
 *
 * The driver is loaded with dlopen, never linked: the same spd runs on nodes
 * without a driver, where it serves host memory and refuses device regions
 * with the reason it found at start-up. Each device gets its primary context
 * (the one the CUDA runtime, and so the kernels of kernels/cuda, also use) and
 * one non-blocking stream of the daemon's own, both made on the first import
 * on that device and kept until the daemon exits. Driver errors are translated
 * here, where they are first seen, and logged with the driver's message.
 */
#include "gpu/gpu.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/devices.h"
#include "core/engine.h"
#include "base/log.h"

#ifdef SP_HAVE_CUDA

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include "sp_kern_cuda.h"

struct sp_gpu_import {
    sp_gpu_import_t *next;        /* owner->imports while listed */
    sp_client_t     *owner;       /* valid while listed: a client's end unlists its imports */
    uint64_t         owner_id;
    bool             listed;
    uint32_t         refs;
    /* What the client said the memory is: found again, and told apart, by it. */
    uint64_t         base, size, buffer_id;
    uint32_t         nchunks;     /* 0: a cudaMalloc allocation, opened over IPC */
    sp_gpu_chunk_t  *chunks;      /* cuMem: offsets, sizes and ids (fds -1) */
    int              dev;         /* the daemon's ordinal */
    CUdeviceptr      dptr;        /* the memory's base in the daemon */
};

/* The driver entry points spd uses; the _v2 names are what cuda.h maps the
 * plain ones to. */
static struct {
    CUresult (*init)(unsigned);
    CUresult (*error_string)(CUresult, const char **);
    CUresult (*driver_version)(int *);
    CUresult (*device_count)(int *);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*device_name)(char *, int, CUdevice);
    CUresult (*device_bus_id)(char *, int, CUdevice);
    CUresult (*device_by_bus_id)(CUdevice *, const char *);
    CUresult (*device_uuid)(CUuuid *, CUdevice);
    CUresult (*primary_retain)(CUcontext *, CUdevice);
    CUresult (*ctx_set_current)(CUcontext);
    CUresult (*stream_create)(CUstream *, unsigned);
    CUresult (*stream_synchronize)(CUstream);
    CUresult (*ipc_open)(CUdeviceptr *, CUipcMemHandle, unsigned);
    CUresult (*ipc_close)(CUdeviceptr);
    CUresult (*device_attribute)(int *, CUdevice_attribute, CUdevice);
    CUresult (*host_register)(void *, size_t, unsigned);
    CUresult (*host_unregister)(void *);
    CUresult (*host_device_pointer)(CUdeviceptr *, void *, unsigned);
    CUresult (*wait_value64)(CUstream, CUdeviceptr, cuuint64_t, unsigned);
    CUresult (*write_value64)(CUstream, CUdeviceptr, cuuint64_t, unsigned);
    CUresult (*event_create)(CUevent *, unsigned);
    CUresult (*event_record)(CUevent, CUstream);
    CUresult (*event_query)(CUevent);
    CUresult (*event_destroy)(CUevent);
    CUresult (*stream_wait_event)(CUstream, CUevent, unsigned);
    CUresult (*stream_destroy)(CUstream);
    /* cuMem (virtual memory management): clients' chunks, imported and mapped. */
    CUresult (*mem_import)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
    CUresult (*mem_props)(CUmemAllocationProp *, CUmemGenericAllocationHandle);
    CUresult (*mem_granularity)(size_t *, const CUmemAllocationProp *, CUmemAllocationGranularity_flags);
    CUresult (*mem_reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
    CUresult (*mem_addr_free)(CUdeviceptr, size_t);
    CUresult (*mem_map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
    CUresult (*mem_unmap)(CUdeviceptr, size_t);
    CUresult (*mem_set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
    CUresult (*mem_release)(CUmemGenericAllocationHandle);
    /* Staging for ops across daemons (sp_gpu_stage_get). */
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
} cu;

static bool cu_loaded;
static char cu_why[160] = "the CUDA driver was not probed";

/* Per device of the daemon: made on the first import there (lock held). */
static struct {
    CUcontext   ctx;
    CUstream    stream;         /* the daemon's own: host-synchronous tasks */
} devs[SP_TOPO_MAX_GPUS];

/* Where the calling thread's enqueue calls go on each device (sp_gpu_use_lane);
 * NULL: the device's own stream. Per thread: the progress thread points it at a
 * client stream's lane while it starts a task, the NCCL thread (nccl.c) at its
 * communicator's lane, and neither holds a lock the other takes for it. */
static _Thread_local CUstream cur_lane[SP_TOPO_MAX_GPUS];

static CUstream cur(int dev)
{
    return cur_lane[dev] != NULL ? cur_lane[dev] : devs[dev].stream;
}

static const char *cu_msg(CUresult rc)
{
    const char *s = NULL;
    if (cu.error_string == NULL || cu.error_string(rc, &s) != CUDA_SUCCESS || s == NULL)
        s = "unknown CUDA error";
    return s;
}

static bool cu_load(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        snprintf(cu_why, sizeof cu_why, "no CUDA driver (libcuda.so.1 not found)");
        return false;
    }
    *(void **)&cu.init = dlsym(lib, "cuInit");
    *(void **)&cu.error_string = dlsym(lib, "cuGetErrorString");
    *(void **)&cu.driver_version = dlsym(lib, "cuDriverGetVersion");
    *(void **)&cu.device_count = dlsym(lib, "cuDeviceGetCount");
    *(void **)&cu.device_get = dlsym(lib, "cuDeviceGet");
    *(void **)&cu.device_name = dlsym(lib, "cuDeviceGetName");
    *(void **)&cu.device_bus_id = dlsym(lib, "cuDeviceGetPCIBusId");
    *(void **)&cu.device_by_bus_id = dlsym(lib, "cuDeviceGetByPCIBusId");
    *(void **)&cu.device_uuid = dlsym(lib, "cuDeviceGetUuid_v2");
    if (cu.device_uuid == NULL)
        *(void **)&cu.device_uuid = dlsym(lib, "cuDeviceGetUuid");
    *(void **)&cu.primary_retain = dlsym(lib, "cuDevicePrimaryCtxRetain");
    *(void **)&cu.ctx_set_current = dlsym(lib, "cuCtxSetCurrent");
    *(void **)&cu.stream_create = dlsym(lib, "cuStreamCreate");
    *(void **)&cu.stream_synchronize = dlsym(lib, "cuStreamSynchronize");
    *(void **)&cu.ipc_open = dlsym(lib, "cuIpcOpenMemHandle_v2");
    *(void **)&cu.ipc_close = dlsym(lib, "cuIpcCloseMemHandle");
    *(void **)&cu.device_attribute = dlsym(lib, "cuDeviceGetAttribute");
    *(void **)&cu.host_register = dlsym(lib, "cuMemHostRegister_v2");
    *(void **)&cu.host_unregister = dlsym(lib, "cuMemHostUnregister");
    *(void **)&cu.host_device_pointer = dlsym(lib, "cuMemHostGetDevicePointer_v2");
    *(void **)&cu.wait_value64 = dlsym(lib, "cuStreamWaitValue64_v2");
    *(void **)&cu.write_value64 = dlsym(lib, "cuStreamWriteValue64_v2");
    *(void **)&cu.event_create = dlsym(lib, "cuEventCreate");
    *(void **)&cu.event_record = dlsym(lib, "cuEventRecord");
    *(void **)&cu.event_query = dlsym(lib, "cuEventQuery");
    *(void **)&cu.event_destroy = dlsym(lib, "cuEventDestroy_v2");
    *(void **)&cu.stream_wait_event = dlsym(lib, "cuStreamWaitEvent");
    *(void **)&cu.stream_destroy = dlsym(lib, "cuStreamDestroy_v2");
    *(void **)&cu.mem_import = dlsym(lib, "cuMemImportFromShareableHandle");
    *(void **)&cu.mem_props = dlsym(lib, "cuMemGetAllocationPropertiesFromHandle");
    *(void **)&cu.mem_granularity = dlsym(lib, "cuMemGetAllocationGranularity");
    *(void **)&cu.mem_reserve = dlsym(lib, "cuMemAddressReserve");
    *(void **)&cu.mem_addr_free = dlsym(lib, "cuMemAddressFree");
    *(void **)&cu.mem_map = dlsym(lib, "cuMemMap");
    *(void **)&cu.mem_unmap = dlsym(lib, "cuMemUnmap");
    *(void **)&cu.mem_set_access = dlsym(lib, "cuMemSetAccess");
    *(void **)&cu.mem_release = dlsym(lib, "cuMemRelease");
    *(void **)&cu.mem_alloc = dlsym(lib, "cuMemAlloc_v2");
    for (size_t i = 0; i < sizeof cu / sizeof(void *); i++) {
        if (((void **)&cu)[i] == NULL) {
            snprintf(cu_why, sizeof cu_why, "libcuda.so.1 lacks the driver API spd needs (CUDA 12 or later)");
            dlclose(lib);
            return false;
        }
    }
    /* Every kernel loaded with its context (dev_open), never at its first
     * launch: CUDA's lazy loading (the default since 12.2) may synchronize the
     * context to load a kernel, and spd's lanes hold waits on clients' streams
     * that last until those streams get there (up to an op's timeout), so the
     * progress thread would stall behind them: with LAZY, a new kernel's op
     * waited out a 5 s stall of another rank's stream on an H100. So spd loads
     * eagerly whatever its environment says (a trainer's image may set LAZY). */
    const char *mode = getenv("CUDA_MODULE_LOADING");
    if (mode != NULL && strcmp(mode, "EAGER") != 0)
        sp_warn(XPORT, "CUDA_MODULE_LOADING=%s ignored: spd loads its kernels eagerly", mode);
    setenv("CUDA_MODULE_LOADING", "EAGER", 1);
    CUresult rc = cu.init(0);
    if (rc != CUDA_SUCCESS) {
        snprintf(cu_why, sizeof cu_why, "cuInit failed: %s (error %d)", cu_msg(rc), (int)rc);
        dlclose(lib);
        return false;
    }
    /* The library stays loaded: imports and kernels use it from here on. */
    return true;
}

void sp_gpu_probe(sp_devices_t *d)
{
    cu_loaded = cu_load();
    if (!cu_loaded) {
        d->gpu_count = 0;
        snprintf(d->gpu_status, sizeof d->gpu_status, "%s", cu_why);
        return;
    }
    int n = 0, ver = 0;
    cu.device_count(&n);
    cu.driver_version(&ver);
    d->gpu_count = n;
    snprintf(d->gpu_status, sizeof d->gpu_status, "CUDA driver %d.%d", ver / 1000, (ver % 1000) / 10);
    for (int i = 0; i < n && i < SP_TOPO_MAX_GPUS; i++) {
        CUdevice dev;
        if (cu.device_get(&dev, i) != CUDA_SUCCESS)
            continue;
        if (i < SP_MAX_GPUS_SHOWN)
            cu.device_name(d->gpu_names[i], sizeof d->gpu_names[i], dev);
        /* The topology finds each GPU's NUMA node in sysfs by this id. */
        if (cu.device_bus_id(d->gpu_bus[i], sizeof d->gpu_bus[i], dev) != CUDA_SUCCESS)
            d->gpu_bus[i][0] = '\0';
    }
}

/* Makes device dev's primary context current on this thread. */
static spc_status_t dev_enter(int dev, char *err, size_t errlen)
{
    CUresult rc = cu.ctx_set_current(devs[dev].ctx);
    if (rc != CUDA_SUCCESS) {
        snprintf(err, errlen, "GPU %d: cuCtxSetCurrent: %s (error %d)", dev, cu_msg(rc), (int)rc);
        sp_error(XPORT, "%s", err);
        return SPC_ERR_DEVICE;
    }
    return SPC_OK;
}

/* The first use of device dev: its primary context and the daemon's stream. */
static spc_status_t dev_open(int dev, char *err, size_t errlen)
{
    CUresult rc;
    CUdevice d;
    CUcontext ctx;
    CUstream stream;

    if (devs[dev].stream != NULL)
        return SPC_OK;
    if ((rc = cu.device_get(&d, dev)) != CUDA_SUCCESS || (rc = cu.primary_retain(&ctx, d)) != CUDA_SUCCESS) {
        snprintf(err, errlen, "GPU %d: no primary context: %s (error %d)", dev, cu_msg(rc), (int)rc);
        sp_error(XPORT, "%s", err);
        return SPC_ERR_DEVICE;
    }
    /* The primary context stays retained for the daemon's life: its streams
     * and imports live in it. */
    devs[dev].ctx = ctx;
    spc_status_t st = dev_enter(dev, err, errlen);
    if (st != SPC_OK)
        return st;
    if ((rc = cu.stream_create(&stream, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS) {
        snprintf(err, errlen, "GPU %d: cuStreamCreate: %s (error %d)", dev, cu_msg(rc), (int)rc);
        sp_error(XPORT, "%s", err);
        return SPC_ERR_DEVICE;
    }
    /* The kernels go into the context now, while no lane waits on a client's
     * stream: a module loaded at a kernel's first launch may synchronize the
     * context, and would wait out such a wait with the progress thread
     * (test_stream_order's first launch case, on an H100). Where the runtime
     * cannot start (a stand-in driver), imports still work and each launch
     * fails with the runtime's reason, as before. */
    int krc = sp_kern_cuda_load();
    if (krc != 0)
        sp_warn(XPORT, "GPU %d: spd's kernels could not be loaded: %s (cuda error %d); device ops on it will fail",
                dev, cudaGetErrorString((cudaError_t)krc), krc);
    devs[dev].stream = stream;
    sp_info(XPORT, "GPU %d: primary context, stream and kernels ready", dev);
    return SPC_OK;
}

/* The daemon's ordinal of the client's GPU `ordinal`: by PCI bus id, the UUID checked. */
static spc_status_t dev_find(const char *bus, const uint8_t *want_uuid, int ordinal, int *dev_p, char *err,
                             size_t errlen)
{
    CUdevice d;
    CUuuid uuid;
    CUresult rc = cu.device_by_bus_id(&d, bus);
    if (rc != CUDA_SUCCESS) {
        snprintf(err, errlen, "the client's GPU %d (PCI %s) is not visible to spd: %s (error %d)", ordinal, bus,
                 cu_msg(rc), (int)rc);
        return SPC_ERR_NO_DEVICE;
    }
    if ((rc = cu.device_uuid(&uuid, d)) != CUDA_SUCCESS) {
        snprintf(err, errlen, "GPU at PCI %s: cuDeviceGetUuid: %s (error %d)", bus, cu_msg(rc), (int)rc);
        sp_error(XPORT, "%s", err);
        return SPC_ERR_DEVICE;
    }
    if (memcmp(uuid.bytes, want_uuid, SP_GPU_UUID_BYTES) != 0) {
        snprintf(err, errlen, "the client's GPU %d: PCI bus id %s and its UUID name different GPUs", ordinal, bus);
        return SPC_ERR_INVALID_ARG;
    }
    /* Ordinals of the daemon's own view; devs[] is indexed by them. */
    int n = 0;
    cu.device_count(&n);
    for (int i = 0; i < n && i < SP_TOPO_MAX_GPUS; i++) {
        CUdevice di;
        if (cu.device_get(&di, i) == CUDA_SUCCESS && di == d) {
            *dev_p = i;
            return SPC_OK;
        }
    }
    snprintf(err, errlen, "GPU at PCI %s is beyond the %d GPUs spd serves", bus, SP_TOPO_MAX_GPUS);
    return SPC_ERR_UNSUPPORTED;
}

/* Opens a cudaMalloc allocation's IPC handle: *dptr_p is its base in the daemon. */
static spc_status_t ipc_open(const sp_client_t *c, const sp_gpu_export_t *x, int dev, CUdeviceptr *dptr_p,
                             char *err, size_t errlen)
{
    CUipcMemHandle handle;

    memcpy(handle.reserved, x->ipc_handle, sizeof handle.reserved);
    CUresult rc = cu.ipc_open(dptr_p, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (rc != CUDA_SUCCESS) {
        snprintf(err, errlen, "cannot open the IPC handle of 0x%" PRIx64 " (%" PRIu64 " bytes) of pid %d on GPU %d: "
                 "%s (error %d)", x->base, x->size, (int)c->pid, dev, cu_msg(rc), (int)rc);
        sp_warn(MEM, "client %" PRIu64 ": %s", c->id, err);
        return SPC_ERR_DEVICE;
    }
    return SPC_OK;
}

/* A failed step of vmm_map, logged with the driver's message. */
static spc_status_t vmm_fail(const sp_client_t *c, const sp_gpu_export_t *x, uint32_t i, const char *what,
                             CUresult rc, char *err, size_t errlen)
{
    snprintf(err, errlen, "cuMem range 0x%" PRIx64 " of pid %d, chunk %u of %u (+%" PRIu64 ", %" PRIu64 " bytes): "
             "%s: %s (error %d)", x->base, (int)c->pid, i, x->nchunks, x->chunks[i].offset, x->chunks[i].size, what,
             cu_msg(rc), (int)rc);
    sp_warn(MEM, "client %" PRIu64 ": %s", c->id, err);
    return SPC_ERR_DEVICE;
}

/*
 * Maps a client's cuMem range into the daemon, device dev's context current:
 *   - imports each chunk's descriptor (cuMemImportFromShareableHandle) and
 *     checks its offset and size against the allocation's granularity, which
 *     cuMemMap requires;
 *   - reserves one range of x->size bytes, aligned as the coarsest chunk needs;
 *   - maps each chunk at its offset and lets device dev read and write it;
 *   - releases the imported handles: the mappings keep the memory until
 *     vmm_unmap (cuMemRelease frees it only when no mapping is left).
 * On failure everything done so far is undone.
 */
static spc_status_t vmm_map(const sp_client_t *c, const sp_gpu_export_t *x, int dev, CUdeviceptr *va_p, char *err,
                            size_t errlen)
{
    CUmemGenericAllocationHandle *h = calloc(x->nchunks, sizeof *h);
    CUdeviceptr va = 0;
    uint32_t imported = 0, mapped = 0;
    size_t align = 0;
    spc_status_t st = SPC_OK;
    CUresult rc;

    if (h == NULL) {
        snprintf(err, errlen, "out of memory");
        return SPC_ERR_NO_MEMORY;
    }
    for (uint32_t i = 0; i < x->nchunks; i++) {
        const sp_gpu_chunk_t *ch = &x->chunks[i];
        CUmemAllocationProp prop;
        size_t g = 0;
        rc = cu.mem_import(&h[i], (void *)(uintptr_t)ch->fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        if (rc != CUDA_SUCCESS) {
            st = vmm_fail(c, x, i, "cuMemImportFromShareableHandle", rc, err, errlen);
            goto undo;
        }
        imported = i + 1;
        memset(&prop, 0, sizeof prop);
        if ((rc = cu.mem_props(&prop, h[i])) == CUDA_SUCCESS) {
            /* Asked for the daemon's device: the handle's location names the
             * client's ordinal of the GPU, which need not be the daemon's. */
            prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            prop.location.id = dev;
            rc = cu.mem_granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
        }
        if (rc != CUDA_SUCCESS) {
            st = vmm_fail(c, x, i, "the allocation's granularity", rc, err, errlen);
            goto undo;
        }
        if (g == 0 || ch->offset % g != 0 || ch->size % g != 0) {
            snprintf(err, errlen, "cuMem range 0x%" PRIx64 ", chunk %u: offset %" PRIu64 " and size %" PRIu64
                     " must be multiples of the allocation granularity (%zu bytes)", x->base, i, ch->offset,
                     ch->size, g);
            st = SPC_ERR_INVALID_ARG;
            goto undo;
        }
        if (g > align)
            align = g;
    }
    /* cuMemAddressReserve takes a power of two, or 0 for its default. */
    rc = cu.mem_reserve(&va, x->size, (align & (align - 1)) == 0 ? align : 0, 0, 0);
    if (rc != CUDA_SUCCESS) {
        va = 0;
        snprintf(err, errlen, "cannot reserve %" PRIu64 " bytes of address space for the cuMem range 0x%" PRIx64
                 " of pid %d: %s (error %d)", x->size, x->base, (int)c->pid, cu_msg(rc), (int)rc);
        sp_warn(MEM, "client %" PRIu64 ": %s", c->id, err);
        st = SPC_ERR_DEVICE;
        goto undo;
    }
    for (uint32_t i = 0; i < x->nchunks; i++) {
        const sp_gpu_chunk_t *ch = &x->chunks[i];
        CUmemAccessDesc access;
        memset(&access, 0, sizeof access);
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = dev;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        if ((rc = cu.mem_map(va + ch->offset, ch->size, 0, h[i], 0)) != CUDA_SUCCESS) {
            st = vmm_fail(c, x, i, "cuMemMap", rc, err, errlen);
            goto undo;
        }
        mapped = i + 1;
        if ((rc = cu.mem_set_access(va + ch->offset, ch->size, &access, 1)) != CUDA_SUCCESS) {
            st = vmm_fail(c, x, i, "cuMemSetAccess", rc, err, errlen);
            goto undo;
        }
    }
    for (uint32_t i = 0; i < x->nchunks; i++)
        cu.mem_release(h[i]);
    free(h);
    *va_p = va;
    return SPC_OK;

undo:
    while (mapped-- > 0)
        cu.mem_unmap(va + x->chunks[mapped].offset, x->chunks[mapped].size);
    if (va != 0)
        cu.mem_addr_free(va, x->size);
    while (imported-- > 0)
        cu.mem_release(h[imported]);
    free(h);
    return st;
}

/* Undoes vmm_map, device imp->dev's context current: each chunk is unmapped
 * (cuMemUnmap takes a whole mapping), then the range is given back. */
static void vmm_unmap(const sp_gpu_import_t *imp)
{
    CUresult rc;
    for (uint32_t i = 0; i < imp->nchunks; i++) {
        rc = cu.mem_unmap(imp->dptr + imp->chunks[i].offset, imp->chunks[i].size);
        if (rc != CUDA_SUCCESS)
            sp_error(MEM, "client %" PRIu64 ": cuMemUnmap of chunk %u of the cuMem range 0x%" PRIx64 ": %s (error %d)",
                     imp->owner_id, i, imp->base, cu_msg(rc), (int)rc);
    }
    rc = cu.mem_addr_free(imp->dptr, imp->size);
    if (rc != CUDA_SUCCESS)
        sp_error(MEM, "client %" PRIu64 ": cuMemAddressFree of the cuMem range 0x%" PRIx64 ": %s (error %d)",
                 imp->owner_id, imp->base, cu_msg(rc), (int)rc);
}

spc_status_t sp_gpu_import_open(sp_engine_t *eng, sp_client_t *c, const sp_gpu_export_t *x,
                                sp_gpu_import_t **imp_p, char *err, size_t errlen)
{
    CUdeviceptr dptr;
    int dev;

    if (!cu_loaded) {
        snprintf(err, errlen, "spd cannot import GPU memory: %s", cu_why);
        return SPC_ERR_NO_DEVICE;
    }
    spc_status_t st = dev_find(x->pci_bus_id, x->uuid, x->device, &dev, err, errlen);
    if (st == SPC_OK)
        st = dev_open(dev, err, errlen);
    if (st == SPC_OK)
        st = dev_enter(dev, err, errlen);
    if (st != SPC_OK)
        return st;
    sp_gpu_import_t *imp = calloc(1, sizeof *imp);
    sp_gpu_chunk_t *chunks = x->nchunks ? calloc(x->nchunks, sizeof *chunks) : NULL;
    if (imp == NULL || (x->nchunks && chunks == NULL)) {
        free(imp);
        free(chunks);
        snprintf(err, errlen, "out of memory");
        return SPC_ERR_NO_MEMORY;
    }
    st = x->nchunks ? vmm_map(c, x, dev, &dptr, err, errlen) : ipc_open(c, x, dev, &dptr, err, errlen);
    if (st != SPC_OK) {
        free(imp);
        free(chunks);
        return st;
    }
    for (uint32_t i = 0; i < x->nchunks; i++)
        chunks[i] = (sp_gpu_chunk_t){ x->chunks[i].offset, x->chunks[i].size, x->chunks[i].buffer_id,
                                      x->chunks[i].block_id, -1 };
    *imp = (sp_gpu_import_t){ .next = c->imports, .owner = c, .owner_id = c->id, .listed = true, .refs = 1,
                              .base = x->base, .size = x->size, .buffer_id = x->buffer_id, .nchunks = x->nchunks,
                              .chunks = chunks, .dev = dev, .dptr = dptr };
    c->imports = imp;
    eng->gpu_imports++;
    eng->gpu_imports_total++;
    char what[128];
    sp_gpu_import_describe(imp, what, sizeof what);
    sp_info(MEM, "client %" PRIu64 ": imported %s on GPU %d", c->id, what, dev);
    *imp_p = imp;
    return SPC_OK;
}

/* [a, a + an) and [b, b + bn) share a byte. Neither sum wraps: region.c checked
 * every export, and imports are made of checked exports. */
static bool overlaps(uint64_t a, uint64_t an, uint64_t b, uint64_t bn)
{
    return a < b + bn && b < a + an;
}

/* Whether two chunks at the same address are the same memory: the same extent,
 * the same mapping (buffer id) of the same physical allocation (block id). */
static bool chunk_same(const sp_gpu_chunk_t *a, const sp_gpu_chunk_t *b)
{
    return a->size == b->size && a->buffer_id == b->buffer_id && a->block_id == b->block_id;
}

/* Whether imp was made of the memory x describes wherever their addresses
 * meet (trivially, where they do not). */
static bool import_agrees(const sp_gpu_import_t *imp, const sp_gpu_export_t *x)
{
    if (!overlaps(imp->base, imp->size, x->base, x->size))
        return true;
    /* A cudaMalloc allocation on either side: live allocations do not overlap,
     * so only the same allocation agrees. */
    if (imp->nchunks == 0 || x->nchunks == 0)
        return imp->nchunks == x->nchunks && imp->base == x->base && imp->size == x->size &&
               imp->buffer_id == x->buffer_id;
    /* Two cuMem ranges: chunks that meet must be the same chunk. Both lists are
     * in address order and back to back, so one walk over both finds every
     * pair that meets. */
    uint32_t i = 0, j = 0;
    while (i < imp->nchunks && j < x->nchunks) {
        const sp_gpu_chunk_t *a = &imp->chunks[i], *b = &x->chunks[j];
        uint64_t as = imp->base + a->offset, bs = x->base + b->offset;
        if (overlaps(as, a->size, bs, b->size) && (as != bs || !chunk_same(a, b)))
            return false;
        if (as + a->size <= bs + b->size)
            i++;
        else
            j++;
    }
    return true;
}

/* Whether imp is exactly the memory x describes. */
static bool import_same(const sp_gpu_import_t *imp, const sp_gpu_export_t *x)
{
    if (imp->base != x->base || imp->size != x->size || imp->nchunks != x->nchunks)
        return false;
    if (imp->nchunks == 0)
        return imp->buffer_id == x->buffer_id;
    for (uint32_t i = 0; i < imp->nchunks; i++)
        if (imp->chunks[i].offset != x->chunks[i].offset || !chunk_same(&imp->chunks[i], &x->chunks[i]))
            return false;
    return true;
}

sp_gpu_import_t *sp_gpu_import_match(const sp_client_t *c, const sp_gpu_export_t *x)
{
    for (sp_gpu_import_t *imp = c->imports; imp != NULL; imp = imp->next)
        if (import_same(imp, x))
            return imp;
    return NULL;
}

sp_gpu_import_t *sp_gpu_import_stale(const sp_client_t *c, const sp_gpu_export_t *x)
{
    for (sp_gpu_import_t *imp = c->imports; imp != NULL; imp = imp->next)
        if (!import_agrees(imp, x))
            return imp;
    return NULL;
}

void sp_gpu_import_describe(const sp_gpu_import_t *imp, char *buf, size_t len)
{
    if (imp->nchunks == 0)
        snprintf(buf, len, "allocation 0x%" PRIx64 " (%" PRIu64 " bytes, buffer id %" PRIu64 ")", imp->base,
                 imp->size, imp->buffer_id);
    else
        snprintf(buf, len, "cuMem range 0x%" PRIx64 " (%" PRIu64 " bytes in %u chunk%s)", imp->base, imp->size,
                 imp->nchunks, imp->nchunks == 1 ? "" : "s");
}

void sp_gpu_import_unlist(sp_gpu_import_t *imp)
{
    if (!imp->listed)
        return;
    sp_gpu_import_t **pp = &imp->owner->imports;
    while (*pp != imp)
        pp = &(*pp)->next;
    *pp = imp->next;
    imp->next = NULL;
    imp->listed = false;
}

void sp_gpu_import_ref(sp_gpu_import_t *imp)
{
    imp->refs++;
}

void sp_gpu_import_unref(sp_engine_t *eng, sp_gpu_import_t *imp)
{
    char err[160];

    if (--imp->refs > 0)
        return;
    sp_gpu_import_unlist(imp);
    if (dev_enter(imp->dev, err, sizeof err) == SPC_OK) {
        if (imp->nchunks > 0) {
            vmm_unmap(imp);
        } else {
            CUresult rc = cu.ipc_close(imp->dptr);
            if (rc != CUDA_SUCCESS)
                sp_error(MEM, "client %" PRIu64 ": cuIpcCloseMemHandle(0x%" PRIx64 "): %s (error %d)", imp->owner_id,
                         imp->base, cu_msg(rc), (int)rc);
        }
    }
    eng->gpu_imports--;
    sp_info(MEM, "client %" PRIu64 ": closed the import of %s0x%" PRIx64, imp->owner_id,
            imp->nchunks ? "the cuMem range " : "", imp->base);
    free(imp->chunks);
    free(imp);
}

uint64_t sp_gpu_import_ptr(const sp_gpu_import_t *imp)       { return imp->dptr; }
int      sp_gpu_import_device(const sp_gpu_import_t *imp)    { return imp->dev; }

/* A launcher's result: -1 is a refusal of its arguments, anything else a cudaError_t. */
static spc_status_t launched(int rc, int dev, const char *what, char *err, size_t errlen)
{
    if (rc == 0)
        return SPC_OK;
    if (rc == -1) {
        snprintf(err, errlen, "%s on GPU %d: the kernel refuses these arguments (alignment or size)", what, dev);
        return SPC_ERR_INVALID_ARG;
    }
    snprintf(err, errlen, "%s on GPU %d: %s (cuda error %d)", what, dev, cudaGetErrorString((cudaError_t)rc), rc);
    sp_error(XPORT, "%s", err);
    return SPC_ERR_DEVICE;
}

spc_status_t sp_gpu_copy(int dev, void *dst, const void *src, uint64_t n, char *err, size_t errlen)
{
    spc_status_t st = dev_enter(dev, err, errlen);
    return st != SPC_OK ? st : launched(sp_kern_shift_cuda(dst, src, n, cur(dev)), dev, "copy", err, errlen);
}

spc_status_t sp_gpu_allreduce(int dev, void *const *dst, const void *const *src, uint32_t nranks, uint64_t n,
                              unsigned dtype, unsigned redop, char *err, size_t errlen)
{
    spc_status_t st = dev_enter(dev, err, errlen);
    return st != SPC_OK ? st
                        : launched(sp_kern_allreduce_cuda(dst, src, nranks, n, dtype, redop, cur(dev)), dev,
                                   "all-reduce", err, errlen);
}

spc_status_t sp_gpu_a2a(int dev, void *dst, const void *const *src, const sp_kern_a2a_desc_t *d, uint32_t rank,
                        char *err, size_t errlen)
{
    spc_status_t st = dev_enter(dev, err, errlen);
    return st != SPC_OK ? st
                        : launched(sp_kern_a2a_cuda(dst, src, d, rank, cur(dev)), dev, "all-to-all", err,
                                   errlen);
}

spc_status_t sp_gpu_stream_device(const char *pci_bus_id, const uint8_t *uuid, int client_ordinal, int *dev_p,
                                  char *err, size_t errlen)
{
    int dev, on = 0;

    if (!cu_loaded) {
        snprintf(err, errlen, "spd cannot order ops on GPU streams: %s", cu_why);
        return SPC_ERR_NO_DEVICE;
    }
    spc_status_t st = dev_find(pci_bus_id, uuid, client_ordinal, &dev, err, errlen);
    if (st == SPC_OK)
        st = dev_open(dev, err, errlen);
    if (st != SPC_OK)
        return st;
    CUdevice d;
    CUresult rc = cu.device_get(&d, dev);
    if (rc == CUDA_SUCCESS)
        rc = cu.device_attribute(&on, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, d);
    if (rc != CUDA_SUCCESS || !on) {
        snprintf(err, errlen, "GPU %d cannot wait on 64-bit values in host memory (stream memory operations%s)", dev,
                 rc != CUDA_SUCCESS ? ": the driver does not say" : " are off in this driver");
        return SPC_ERR_UNSUPPORTED;
    }
    *dev_p = dev;
    return SPC_OK;
}

spc_status_t sp_gpu_host_register(int dev, void *p, size_t n, uint64_t *dptr_p, char *err, size_t errlen)
{
    spc_status_t st = dev_enter(dev, err, errlen);
    if (st != SPC_OK)
        return st;
    /* Portable: the page is the client's, used from every device's context. */
    CUresult rc = cu.host_register(p, n, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP);
    CUdeviceptr dptr = 0;
    if (rc == CUDA_SUCCESS && (rc = cu.host_device_pointer(&dptr, p, 0)) != CUDA_SUCCESS)
        cu.host_unregister(p);
    if (rc != CUDA_SUCCESS) {
        snprintf(err, errlen, "GPU %d: cannot register the stream semaphores with CUDA: %s (error %d)", dev,
                 cu_msg(rc), (int)rc);
        sp_error(XPORT, "%s", err);
        return SPC_ERR_DEVICE;
    }
    *dptr_p = dptr;
    return SPC_OK;
}

void sp_gpu_host_unregister(void *p)
{
    CUresult rc = cu.host_unregister(p);
    if (rc != CUDA_SUCCESS)
        sp_error(XPORT, "cuMemHostUnregister(%p): %s (error %d)", p, cu_msg(rc), (int)rc);
}

static spc_status_t enqueued(CUresult rc, int dev, const char *what, char *err, size_t errlen)
{
    if (rc == CUDA_SUCCESS)
        return SPC_OK;
    snprintf(err, errlen, "GPU %d: %s: %s (error %d)", dev, what, cu_msg(rc), (int)rc);
    sp_error(XPORT, "%s", err);
    return SPC_ERR_DEVICE;
}

spc_status_t sp_gpu_wait_value(int dev, uint64_t dptr, uint64_t v, char *err, size_t errlen)
{
    spc_status_t st = dev_enter(dev, err, errlen);
    return st != SPC_OK ? st
                        : enqueued(cu.wait_value64(cur(dev), dptr, v, CU_STREAM_WAIT_VALUE_GEQ), dev,
                                   "cuStreamWaitValue64", err, errlen);
}

spc_status_t sp_gpu_write_value(int dev, uint64_t dptr, uint64_t v, char *err, size_t errlen)
{
    spc_status_t st = dev_enter(dev, err, errlen);
    /* The default write is ordered after the kernels before it, and fenced:
     * whoever sees the value sees their results. */
    return st != SPC_OK ? st
                        : enqueued(cu.write_value64(cur(dev), dptr, v, CU_STREAM_WRITE_VALUE_DEFAULT), dev,
                                   "cuStreamWriteValue64", err, errlen);
}

/* A lane is one more stream of the daemon's on a device. */
struct sp_gpu_lane {
    CUstream s;
    int      dev;
};

spc_status_t sp_gpu_lane_open(int dev, sp_gpu_lane_t **lane_p, char *err, size_t errlen)
{
    spc_status_t st = dev_enter(dev, err, errlen);
    if (st != SPC_OK)
        return st;
    sp_gpu_lane_t *l = calloc(1, sizeof *l);
    if (l == NULL) {
        snprintf(err, errlen, "out of memory");
        return SPC_ERR_NO_MEMORY;
    }
    CUresult rc = cu.stream_create(&l->s, CU_STREAM_NON_BLOCKING);
    if (rc != CUDA_SUCCESS) {
        free(l);
        return enqueued(rc, dev, "cuStreamCreate", err, errlen);
    }
    l->dev = dev;
    *lane_p = l;
    return SPC_OK;
}

void sp_gpu_lane_close(sp_gpu_lane_t *l)
{
    char err[160];
    if (l == NULL)
        return;
    /* What is still on it runs out; the driver frees the stream then. */
    if (dev_enter(l->dev, err, sizeof err) == SPC_OK)
        cu.stream_destroy(l->s);
    free(l);
}

void sp_gpu_use_lane(int dev, sp_gpu_lane_t *l)
{
    cur_lane[dev] = l != NULL ? l->s : NULL;
}

void *sp_gpu_lane_stream(const sp_gpu_lane_t *l)
{
    return l->s;
}

/* Marks are events without timing, kept for reuse: a task records one, and the
 * progress thread polls it. Only the progress thread uses them. */
struct sp_gpu_mark {
    sp_gpu_mark_t *next;
    CUevent        ev;
    int            dev;
};

static sp_gpu_mark_t *marks_free;

spc_status_t sp_gpu_mark(int dev, sp_gpu_mark_t **mark_p, char *err, size_t errlen)
{
    spc_status_t st = dev_enter(dev, err, errlen);
    if (st != SPC_OK)
        return st;
    sp_gpu_mark_t **pp = &marks_free;
    while (*pp != NULL && (*pp)->dev != dev)
        pp = &(*pp)->next;
    sp_gpu_mark_t *m = *pp;
    if (m != NULL) {
        *pp = m->next;
    } else {
        if ((m = calloc(1, sizeof *m)) == NULL) {
            snprintf(err, errlen, "out of memory");
            return SPC_ERR_NO_MEMORY;
        }
        m->dev = dev;
        CUresult rc = cu.event_create(&m->ev, CU_EVENT_DISABLE_TIMING);
        if (rc != CUDA_SUCCESS) {
            free(m);
            return enqueued(rc, dev, "cuEventCreate", err, errlen);
        }
    }
    CUresult rc = cu.event_record(m->ev, cur(dev));
    if (rc != CUDA_SUCCESS) {
        m->next = marks_free;
        marks_free = m;
        return enqueued(rc, dev, "cuEventRecord", err, errlen);
    }
    *mark_p = m;
    return SPC_OK;
}

int sp_gpu_mark_done(sp_gpu_mark_t *m, char *err, size_t errlen)
{
    if (dev_enter(m->dev, err, errlen) != SPC_OK)
        return SPC_ERR_DEVICE;
    CUresult rc = cu.event_query(m->ev);
    if (rc == CUDA_SUCCESS)
        return 1;
    if (rc == CUDA_ERROR_NOT_READY)
        return 0;
    snprintf(err, errlen, "GPU %d: the daemon's stream failed: %s (error %d)", m->dev, cu_msg(rc), (int)rc);
    sp_error(XPORT, "%s", err);
    return SPC_ERR_DEVICE;
}

void sp_gpu_mark_free(sp_gpu_mark_t *m)
{
    if (m == NULL)
        return;
    m->next = marks_free;
    marks_free = m;
}

spc_status_t sp_gpu_wait_mark(int dev, sp_gpu_mark_t *m, char *err, size_t errlen)
{
    spc_status_t st = dev_enter(dev, err, errlen);
    return st != SPC_OK ? st : enqueued(cu.stream_wait_event(cur(dev), m->ev, 0), dev, "cuStreamWaitEvent", err,
                                        errlen);
}

/* ---------------------------------------------------------------- ops across daemons (exec.c, nccl.c) */

spc_status_t sp_gpu_use(int dev, char *err, size_t errlen)
{
    /* A task names a device only after an import opened it (lock held then, and
     * the task was handed over under the lock since). */
    if (!cu_loaded || dev < 0 || dev >= SP_TOPO_MAX_GPUS || devs[dev].ctx == NULL) {
        snprintf(err, errlen, "GPU %d is not open in spd", dev);
        return SPC_ERR_NO_DEVICE;
    }
    return dev_enter(dev, err, errlen);
}

/*
 * Device memory that ops across daemons stage through. It is kept once made and
 * handed out again, never freed while spd runs: cuMemFree waits for the whole
 * device, the NCCL kernels of other operations included, and one of those may be
 * waiting for a daemon that waits for this one. Sizes go up to powers of two so
 * that blocks fit later requests. Blocks are made on the NCCL thread, never the
 * progress thread.
 */
struct sp_gpu_stage {
    sp_gpu_stage_t *next;         /* in its device's free list */
    int             dev;
    CUdeviceptr     ptr;
    uint64_t        bytes;
};

static pthread_mutex_t stage_lock = PTHREAD_MUTEX_INITIALIZER;
static sp_gpu_stage_t *stage_free[SP_TOPO_MAX_GPUS];

spc_status_t sp_gpu_stage_get(int dev, uint64_t bytes, sp_gpu_stage_t **s_p, char *err, size_t errlen)
{
    spc_status_t st = sp_gpu_use(dev, err, errlen);
    if (st != SPC_OK)
        return st;
    uint64_t want = 64u << 10;
    while (want < bytes && want < (1ull << 62))
        want <<= 1;
    pthread_mutex_lock(&stage_lock);
    sp_gpu_stage_t **best = NULL;
    for (sp_gpu_stage_t **pp = &stage_free[dev]; *pp != NULL; pp = &(*pp)->next)
        if ((*pp)->bytes >= want && (best == NULL || (*pp)->bytes < (*best)->bytes))
            best = pp;
    sp_gpu_stage_t *s = NULL;
    if (best != NULL) {
        s = *best;
        *best = s->next;
        s->next = NULL;
    }
    pthread_mutex_unlock(&stage_lock);
    if (s != NULL) {
        *s_p = s;
        return SPC_OK;
    }
    if ((s = calloc(1, sizeof *s)) == NULL) {
        snprintf(err, errlen, "out of memory");
        return SPC_ERR_NO_MEMORY;
    }
    CUresult rc = cu.mem_alloc(&s->ptr, want);
    if (rc != CUDA_SUCCESS) {
        snprintf(err, errlen, "GPU %d: no %" PRIu64 " bytes to stage an op across daemons: %s (error %d)", dev, want,
                 cu_msg(rc), (int)rc);
        sp_error(XPORT, "%s", err);
        free(s);
        return rc == CUDA_ERROR_OUT_OF_MEMORY ? SPC_ERR_NO_MEMORY : SPC_ERR_DEVICE;
    }
    s->dev = dev;
    s->bytes = want;
    sp_info(XPORT, "GPU %d: %" PRIu64 " more bytes for staging ops across daemons", dev, want);
    *s_p = s;
    return SPC_OK;
}

void *sp_gpu_stage_ptr(const sp_gpu_stage_t *s)
{
    return (void *)(uintptr_t)s->ptr;
}

void sp_gpu_stage_put(sp_gpu_stage_t *s)
{
    if (s == NULL)
        return;
    pthread_mutex_lock(&stage_lock);
    s->next = stage_free[s->dev];
    stage_free[s->dev] = s;
    pthread_mutex_unlock(&stage_lock);
}

#else /* !SP_HAVE_CUDA: a build without the toolkit serves host memory only. */

struct sp_gpu_import {
    int unused;
};

void sp_gpu_probe(sp_devices_t *d)
{
    d->gpu_count = 0;
    snprintf(d->gpu_status, sizeof d->gpu_status, "built without CUDA");
}

spc_status_t sp_gpu_import_open(sp_engine_t *eng, sp_client_t *c, const sp_gpu_export_t *x,
                                sp_gpu_import_t **imp_p, char *err, size_t errlen)
{
    snprintf(err, errlen, "spd cannot import GPU memory: it was built without CUDA");
    return SPC_ERR_NO_DEVICE;
}

/* No import ever exists in this build, so the calls below never get one. */
sp_gpu_import_t *sp_gpu_import_match(const sp_client_t *c, const sp_gpu_export_t *x) { return NULL; }
sp_gpu_import_t *sp_gpu_import_stale(const sp_client_t *c, const sp_gpu_export_t *x) { return NULL; }
void sp_gpu_import_describe(const sp_gpu_import_t *imp, char *buf, size_t len) { snprintf(buf, len, "none"); }
void sp_gpu_import_unlist(sp_gpu_import_t *imp) {}
void sp_gpu_import_ref(sp_gpu_import_t *imp) {}
void sp_gpu_import_unref(sp_engine_t *eng, sp_gpu_import_t *imp) {}
uint64_t sp_gpu_import_ptr(const sp_gpu_import_t *imp) { return 0; }
int      sp_gpu_import_device(const sp_gpu_import_t *imp) { return -1; }

static spc_status_t no_cuda(char *err, size_t errlen)
{
    snprintf(err, errlen, "spd was built without CUDA");
    return SPC_ERR_NO_DEVICE;
}

spc_status_t sp_gpu_copy(int dev, void *dst, const void *src, uint64_t n, char *err, size_t errlen)
{
    return no_cuda(err, errlen);
}

spc_status_t sp_gpu_allreduce(int dev, void *const *dst, const void *const *src, uint32_t nranks, uint64_t n,
                              unsigned dtype, unsigned redop, char *err, size_t errlen)
{
    return no_cuda(err, errlen);
}

spc_status_t sp_gpu_a2a(int dev, void *dst, const void *const *src, const sp_kern_a2a_desc_t *d, uint32_t rank,
                        char *err, size_t errlen)
{
    return no_cuda(err, errlen);
}

spc_status_t sp_gpu_stream_device(const char *pci_bus_id, const uint8_t *uuid, int client_ordinal, int *dev_p,
                                  char *err, size_t errlen)
{
    snprintf(err, errlen, "spd cannot order ops on GPU streams: it was built without CUDA");
    return SPC_ERR_NO_DEVICE;
}

/* Without a device no stream, task or mark ever exists: these are never reached. */
spc_status_t sp_gpu_host_register(int dev, void *p, size_t n, uint64_t *dptr_p, char *err, size_t errlen)
{
    return no_cuda(err, errlen);
}
void sp_gpu_host_unregister(void *p) {}
spc_status_t sp_gpu_wait_value(int dev, uint64_t dptr, uint64_t v, char *err, size_t errlen)
{
    return no_cuda(err, errlen);
}
spc_status_t sp_gpu_write_value(int dev, uint64_t dptr, uint64_t v, char *err, size_t errlen)
{
    return no_cuda(err, errlen);
}
spc_status_t sp_gpu_mark(int dev, sp_gpu_mark_t **mark_p, char *err, size_t errlen)
{
    return no_cuda(err, errlen);
}
int sp_gpu_mark_done(sp_gpu_mark_t *mark, char *err, size_t errlen)
{
    return no_cuda(err, errlen);
}
void sp_gpu_mark_free(sp_gpu_mark_t *mark) {}
spc_status_t sp_gpu_lane_open(int dev, sp_gpu_lane_t **lane_p, char *err, size_t errlen)
{
    return no_cuda(err, errlen);
}
void sp_gpu_lane_close(sp_gpu_lane_t *lane) {}
void sp_gpu_use_lane(int dev, sp_gpu_lane_t *lane) {}
void *sp_gpu_lane_stream(const sp_gpu_lane_t *lane) { return NULL; }
spc_status_t sp_gpu_wait_mark(int dev, sp_gpu_mark_t *mark, char *err, size_t errlen)
{
    return no_cuda(err, errlen);
}

spc_status_t sp_gpu_use(int dev, char *err, size_t errlen)
{
    return no_cuda(err, errlen);
}
spc_status_t sp_gpu_stage_get(int dev, uint64_t bytes, sp_gpu_stage_t **s_p, char *err, size_t errlen)
{
    return no_cuda(err, errlen);
}
void *sp_gpu_stage_ptr(const sp_gpu_stage_t *s) { return NULL; }
void sp_gpu_stage_put(sp_gpu_stage_t *s) {}

#endif /* SP_HAVE_CUDA */
