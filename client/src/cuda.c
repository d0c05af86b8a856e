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
    for (size_t i = 0; i < sizeof cu / sizeof(void *); i++) {
        if (((void **)&cu)[i] == NULL) {
            snprintf(cu_why, sizeof cu_why, "libcuda.so.1 lacks the driver API this library needs (CUDA 11.4 or later)");
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
