/*
 * gpu.c — the CUDA driver, device contexts and streams, and clients' GPU
 * allocations imported with CUDA IPC (see gpu.h).
 *
 * The driver is loaded with dlopen, never linked: the same spd runs on nodes
 * without a driver, where it serves host memory and refuses device regions
 * with the reason it found at start-up. Each device gets its primary context
 * (the one the CUDA runtime, and so the kernels of kernels/cuda, also use) and
 * one non-blocking stream of the daemon's own, both made on the first import
 * on that device and kept until the daemon exits. Driver errors are translated
 * here, where they are first seen, and logged with the driver's message.
 */
#include "gpu.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "devices.h"
#include "engine.h"
#include "log.h"

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
    uint64_t         base, size, buffer_id;
    int              dev;         /* the daemon's ordinal */
    CUdeviceptr      dptr;        /* the allocation's base in the daemon */
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
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
    CUresult (*mem_free)(CUdeviceptr);
} cu;

static bool cu_loaded;
static char cu_why[160] = "the CUDA driver was not probed";

/* Per device of the daemon: made on the first import there (lock held). */
static struct {
    CUcontext   ctx;
    CUstream    stream;
    CUdeviceptr scratch;        /* the fp32 accumulator of 16-bit reductions (progress thread only) */
    size_t      scratch_bytes;
} devs[SP_TOPO_MAX_GPUS];

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
    *(void **)&cu.mem_alloc = dlsym(lib, "cuMemAlloc_v2");
    *(void **)&cu.mem_free = dlsym(lib, "cuMemFree_v2");
    for (size_t i = 0; i < sizeof cu / sizeof(void *); i++) {
        if (((void **)&cu)[i] == NULL) {
            snprintf(cu_why, sizeof cu_why, "libcuda.so.1 lacks the driver API spd needs (CUDA 11.4 or later)");
            dlclose(lib);
            return false;
        }
    }
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
    devs[dev].stream = stream;
    sp_info(XPORT, "GPU %d: primary context and stream ready", dev);
    return SPC_OK;
}

/* The daemon's ordinal of the client's GPU: by PCI bus id, the UUID checked. */
static spc_status_t dev_find(const sp_gpu_export_t *x, int *dev_p, char *err, size_t errlen)
{
    CUdevice d;
    CUuuid uuid;
    CUresult rc = cu.device_by_bus_id(&d, x->pci_bus_id);
    if (rc != CUDA_SUCCESS) {
        snprintf(err, errlen, "the client's GPU %d (PCI %s) is not visible to spd: %s (error %d)", x->device,
                 x->pci_bus_id, cu_msg(rc), (int)rc);
        return SPC_ERR_NO_DEVICE;
    }
    if ((rc = cu.device_uuid(&uuid, d)) != CUDA_SUCCESS) {
        snprintf(err, errlen, "GPU at PCI %s: cuDeviceGetUuid: %s (error %d)", x->pci_bus_id, cu_msg(rc), (int)rc);
        sp_error(XPORT, "%s", err);
        return SPC_ERR_DEVICE;
    }
    if (memcmp(uuid.bytes, x->uuid, SP_GPU_UUID_BYTES) != 0) {
        snprintf(err, errlen, "the client's GPU %d: PCI bus id %s and its UUID name different GPUs", x->device,
                 x->pci_bus_id);
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
    snprintf(err, errlen, "GPU at PCI %s is beyond the %d GPUs spd serves", x->pci_bus_id, SP_TOPO_MAX_GPUS);
    return SPC_ERR_UNSUPPORTED;
}

spc_status_t sp_gpu_import_open(sp_engine_t *eng, sp_client_t *c, const sp_gpu_export_t *x,
                                sp_gpu_import_t **imp_p, char *err, size_t errlen)
{
    CUipcMemHandle handle;
    CUdeviceptr dptr;
    int dev;

    if (!cu_loaded) {
        snprintf(err, errlen, "spd cannot import GPU memory: %s", cu_why);
        return SPC_ERR_NO_DEVICE;
    }
    spc_status_t st = dev_find(x, &dev, err, errlen);
    if (st == SPC_OK)
        st = dev_open(dev, err, errlen);
    if (st == SPC_OK)
        st = dev_enter(dev, err, errlen);
    if (st != SPC_OK)
        return st;
    sp_gpu_import_t *imp = calloc(1, sizeof *imp);
    if (imp == NULL) {
        snprintf(err, errlen, "out of memory");
        return SPC_ERR_NO_MEMORY;
    }
    memcpy(handle.reserved, x->ipc_handle, sizeof handle.reserved);
    CUresult rc = cu.ipc_open(&dptr, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (rc != CUDA_SUCCESS) {
        snprintf(err, errlen, "cannot open the IPC handle of 0x%" PRIx64 " (%" PRIu64 " bytes) of pid %d on GPU %d: "
                 "%s (error %d)", x->base, x->size, (int)c->pid, dev, cu_msg(rc), (int)rc);
        sp_warn(MEM, "client %" PRIu64 ": %s", c->id, err);
        free(imp);
        return SPC_ERR_DEVICE;
    }
    *imp = (sp_gpu_import_t){ .next = c->imports, .owner = c, .owner_id = c->id, .listed = true, .refs = 1, .base = x->base,
                              .size = x->size, .buffer_id = x->buffer_id, .dev = dev, .dptr = dptr };
    c->imports = imp;
    eng->gpu_imports++;
    eng->gpu_imports_total++;
    sp_info(MEM, "client %" PRIu64 ": imported 0x%" PRIx64 " (%" PRIu64 " bytes, buffer id %" PRIu64 ") on GPU %d",
            c->id, x->base, x->size, x->buffer_id, dev);
    *imp_p = imp;
    return SPC_OK;
}

sp_gpu_import_t *sp_gpu_import_find(const sp_client_t *c, uint64_t base)
{
    for (sp_gpu_import_t *imp = c->imports; imp != NULL; imp = imp->next)
        if (imp->base == base)
            return imp;
    return NULL;
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
        CUresult rc = cu.ipc_close(imp->dptr);
        if (rc != CUDA_SUCCESS)
            sp_error(MEM, "client %" PRIu64 ": cuIpcCloseMemHandle(0x%" PRIx64 "): %s (error %d)", imp->owner_id,
                     imp->base, cu_msg(rc), (int)rc);
    }
    eng->gpu_imports--;
    sp_info(MEM, "client %" PRIu64 ": closed the import of 0x%" PRIx64, imp->owner_id, imp->base);
    free(imp);
}

uint64_t sp_gpu_import_buffer_id(const sp_gpu_import_t *imp) { return imp->buffer_id; }
uint64_t sp_gpu_import_size(const sp_gpu_import_t *imp)      { return imp->size; }
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
    return st != SPC_OK ? st : launched(sp_kern_shift_cuda(dst, src, n, devs[dev].stream), dev, "copy", err, errlen);
}

spc_status_t sp_gpu_reduce(int dev, void *acc, const void *src, uint64_t n, unsigned dtype, unsigned redop,
                           char *err, size_t errlen)
{
    spc_status_t st = dev_enter(dev, err, errlen);
    return st != SPC_OK ? st
                        : launched(sp_kern_reduce_cuda(acc, src, n, dtype, redop, devs[dev].stream), dev, "reduction",
                                   err, errlen);
}

/* Device dev's fp32 scratch of at least `bytes`. Only the progress thread runs
 * tasks, one at a time, and each ends with its stream synchronized: no kernel
 * still uses a scratch this frees. */
static spc_status_t scratch(int dev, size_t bytes, char *err, size_t errlen)
{
    if (devs[dev].scratch_bytes >= bytes)
        return SPC_OK;
    if (devs[dev].scratch != 0)
        cu.mem_free(devs[dev].scratch);
    devs[dev].scratch = 0;
    devs[dev].scratch_bytes = 0;
    CUresult rc = cu.mem_alloc != NULL ? cu.mem_alloc(&devs[dev].scratch, bytes) : CUDA_ERROR_NOT_SUPPORTED;
    if (rc != CUDA_SUCCESS) {
        snprintf(err, errlen, "GPU %d: no %zu bytes for the fp32 accumulator: %s (error %d)", dev, bytes, cu_msg(rc),
                 (int)rc);
        sp_error(XPORT, "%s", err);
        return rc == CUDA_ERROR_OUT_OF_MEMORY ? SPC_ERR_NO_MEMORY : SPC_ERR_DEVICE;
    }
    devs[dev].scratch_bytes = bytes;
    return SPC_OK;
}

spc_status_t sp_gpu_fold16(int dev, void *dst, const void *const *src, uint32_t nsrc, uint64_t n, unsigned dtype,
                           unsigned redop, char *err, size_t errlen)
{
    spc_status_t st = dev_enter(dev, err, errlen);
    if (st == SPC_OK)
        st = scratch(dev, (size_t)(n ? n : 1) * sizeof(float), err, errlen);
    if (st != SPC_OK)
        return st;
    float *acc = (float *)(uintptr_t)devs[dev].scratch;
    CUstream s = devs[dev].stream;
    st = launched(sp_kern_widen_cuda(acc, src[0], n, dtype, s), dev, "widening", err, errlen);
    for (uint32_t r = 1; r < nsrc && st == SPC_OK; r++)
        st = launched(sp_kern_reduce_widen_cuda(acc, src[r], n, dtype, redop, s), dev, "reduction", err, errlen);
    if (st == SPC_OK)
        st = launched(sp_kern_narrow_cuda(dst, acc, n, dtype, s), dev, "rounding", err, errlen);
    return st;
}

spc_status_t sp_gpu_a2a(int dev, void *dst, const void *const *src, const sp_kern_a2a_desc_t *d, uint32_t rank,
                        char *err, size_t errlen)
{
    spc_status_t st = dev_enter(dev, err, errlen);
    return st != SPC_OK ? st
                        : launched(sp_kern_a2a_cuda(dst, src, d, rank, devs[dev].stream), dev, "all-to-all", err,
                                   errlen);
}

spc_status_t sp_gpu_sync(int dev, char *err, size_t errlen)
{
    spc_status_t st = dev_enter(dev, err, errlen);
    if (st != SPC_OK)
        return st;
    CUresult rc = cu.stream_synchronize(devs[dev].stream);
    if (rc != CUDA_SUCCESS) {
        snprintf(err, errlen, "GPU %d: the daemon's stream failed: %s (error %d)", dev, cu_msg(rc), (int)rc);
        sp_error(XPORT, "%s", err);
        return SPC_ERR_DEVICE;
    }
    return SPC_OK;
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
sp_gpu_import_t *sp_gpu_import_find(const sp_client_t *c, uint64_t base) { return NULL; }
void sp_gpu_import_unlist(sp_gpu_import_t *imp) {}
void sp_gpu_import_ref(sp_gpu_import_t *imp) {}
void sp_gpu_import_unref(sp_engine_t *eng, sp_gpu_import_t *imp) {}
uint64_t sp_gpu_import_buffer_id(const sp_gpu_import_t *imp) { return 0; }
uint64_t sp_gpu_import_size(const sp_gpu_import_t *imp) { return 0; }
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

spc_status_t sp_gpu_reduce(int dev, void *acc, const void *src, uint64_t n, unsigned dtype, unsigned redop,
                           char *err, size_t errlen)
{
    return no_cuda(err, errlen);
}

spc_status_t sp_gpu_fold16(int dev, void *dst, const void *const *src, uint32_t nsrc, uint64_t n, unsigned dtype,
                           unsigned redop, char *err, size_t errlen)
{
    return no_cuda(err, errlen);
}

spc_status_t sp_gpu_a2a(int dev, void *dst, const void *const *src, const sp_kern_a2a_desc_t *d, uint32_t rank,
                        char *err, size_t errlen)
{
    return no_cuda(err, errlen);
}

spc_status_t sp_gpu_sync(int dev, char *err, size_t errlen)
{
    return no_cuda(err, errlen);
}

#endif /* SP_HAVE_CUDA */
