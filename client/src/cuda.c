/*
 * cuda.c — exporting a GPU allocation to the daemon.
 *
 * libspclient does not link CUDA: an application without a GPU links the same
 * library, so the driver API is loaded here at run time, on first use. The few
 * driver types and numbers used are written out below; they are the driver's
 * ABI (cuda.h), which does not change between releases.
 *
 * What spc_register_device needs of a device pointer: that it is device memory;
 * the allocation it lies in (base and size: the IPC handle names the whole
 * allocation); the allocation's buffer id (so the daemon can tell a reused
 * address from the allocation it imported); the GPU (PCI bus id and UUID, since
 * ordinals depend on CUDA_VISIBLE_DEVICES); and the IPC handle itself.
 */
#include "internal.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

typedef int cu_result_t;                 /* CUresult */
typedef unsigned long long cu_ptr_t;     /* CUdeviceptr */
typedef void *cu_ctx_t;                  /* CUcontext */

enum {
    CU_SUCCESS = 0,
    CU_ATTR_MEMORY_TYPE = 2,
    CU_ATTR_BUFFER_ID = 7,
    CU_ATTR_IS_MANAGED = 8,
    CU_ATTR_DEVICE_ORDINAL = 9,
    CU_ATTR_IS_LEGACY_IPC_CAPABLE = 10,
    CU_ATTR_RANGE_START_ADDR = 11,
    CU_ATTR_RANGE_SIZE = 12,
    CU_MEMORYTYPE_DEVICE = 2,
    CU_ERROR_NOT_READY = 600,
    CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS = 122,
    CU_MEMHOSTREGISTER_PORTABLE = 1,
    CU_MEMHOSTREGISTER_DEVICEMAP = 2,
    CU_STREAM_WAIT_VALUE_GEQ = 0,
    CU_STREAM_WRITE_VALUE_DEFAULT = 0,
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

/* Loads the driver once per process; the library stays loaded. */
static void cu_load(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        snprintf(cu_why, sizeof cu_why, "no CUDA driver on this machine (%s)", dlerror());
        return;
    }
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

spc_status_t spc__cuda_export(spc_handle_t *h, const void *dptr, size_t bytes, spc__device_export_t *x_p)
{
    pthread_once(&cu_once, cu_load);
    if (!cu_ok)
        return spc__fail(h, SPC_ERR_NO_DEVICE, "%s", cu_why);

    const cu_ptr_t p = (cu_ptr_t)(uintptr_t)dptr;
    unsigned memtype = 0;
    int ordinal = -1, managed = 0, ipc_capable = 0;
    unsigned long long buffer_id = 0;
    cu_ptr_t base = 0;
    size_t size = 0;
    int attrs[] = { CU_ATTR_MEMORY_TYPE, CU_ATTR_DEVICE_ORDINAL, CU_ATTR_IS_MANAGED, CU_ATTR_IS_LEGACY_IPC_CAPABLE,
                    CU_ATTR_BUFFER_ID, CU_ATTR_RANGE_START_ADDR, CU_ATTR_RANGE_SIZE };
    void *vals[] = { &memtype, &ordinal, &managed, &ipc_capable, &buffer_id, &base, &size };
    /* A pointer the driver does not know (plain host memory) comes back as
     * memory type 0 without an error. */
    cu_result_t rc = cu.pointer_get_attributes(sizeof attrs / sizeof attrs[0], attrs, vals, p);
    if (rc != CU_SUCCESS)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "%p: cuPointerGetAttributes failed: %s (error %d)", dptr,
                         cu_msg(rc), rc);
    if (memtype != CU_MEMORYTYPE_DEVICE || managed)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "%p is not device memory (%s): spc_register takes host memory",
                         dptr, managed ? "managed memory" : memtype == 0 ? "unknown to the driver" : "host memory");
    if (!ipc_capable)
        return spc__fail(h, SPC_ERR_UNSUPPORTED, "%p lies in a cuMem (virtual memory management) allocation, which "
                         "cannot be exported with cuIpcGetMemHandle; the shareable-handle path for it is to come "
                         "(use cudaMalloc, or PyTorch without expandable_segments)", dptr);
    if (p < base || p - base > size || bytes > size - (p - base))
        return spc__fail(h, SPC_ERR_OUT_OF_BOUNDS, "%p + %zu bytes run past its allocation (0x%llx + %zu bytes)",
                         dptr, bytes, base, size);

    spc__device_export_t x;
    memset(&x, 0, sizeof x);
    int dev;
    if ((rc = cu.device_get(&dev, ordinal)) != CU_SUCCESS ||
        (rc = cu.device_get_pci_bus_id(x.pci_bus_id, sizeof x.pci_bus_id, dev)) != CU_SUCCESS ||
        (rc = cu.device_get_uuid(x.uuid, dev)) != CU_SUCCESS)
        return spc__fail(h, SPC_ERR_DEVICE, "device %d of %p: %s (error %d)", ordinal, dptr, cu_msg(rc), rc);

    /* cuIpcGetMemHandle wants a current context; a thread that allocated
     * through the runtime has its device's primary context, another may not. */
    cu_ctx_t cur = NULL, pushed = NULL;
    if (cu.ctx_get_current(&cur) != CU_SUCCESS || cur == NULL) {
        if ((rc = cu.primary_ctx_retain(&pushed, dev)) != CU_SUCCESS)
            return spc__fail(h, SPC_ERR_DEVICE, "device %d: cuDevicePrimaryCtxRetain: %s (error %d)", ordinal,
                             cu_msg(rc), rc);
        if ((rc = cu.ctx_push(pushed)) != CU_SUCCESS) {
            cu.primary_ctx_release(dev);
            return spc__fail(h, SPC_ERR_DEVICE, "device %d: cuCtxPushCurrent: %s (error %d)", ordinal, cu_msg(rc),
                             rc);
        }
    }
    rc = cu.ipc_get_mem_handle(x.ipc_handle, base);
    if (pushed != NULL) {
        cu_ctx_t popped;
        cu.ctx_pop(&popped);
        cu.primary_ctx_release(dev);
    }
    if (rc != CU_SUCCESS)
        return spc__fail(h, SPC_ERR_DEVICE, "cuIpcGetMemHandle(0x%llx) on device %d: %s (error %d)", base, ordinal,
                         cu_msg(rc), rc);
    x.base = base;
    x.size = size;
    x.buffer_id = buffer_id;
    x.device = ordinal;
    *x_p = x;
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
