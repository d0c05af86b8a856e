/*
 * gpu_int.h — what the files of the GPU layer share: the CUDA driver's entry
 * points, loaded once by gpu.c (sp_gpu_probe), and the device calls that
 * imports (gpu_import.c) make before they open anything. Every function of
 * the driver is called through sp_cu; none is linked.
 */
#ifndef SP_GPU_INT_H
#define SP_GPU_INT_H

#ifdef SP_HAVE_CUDA

#include <cuda.h>
#include <stddef.h>
#include <stdint.h>

#include "spclient/status.h"
#include "base/err.h"

/* The driver entry points spd uses; the _v2 names are what cuda.h maps the
 * plain ones to. */
typedef struct sp_cu {
    CUresult (*init)(unsigned);
    CUresult (*error_string)(CUresult, const char **);
    CUresult (*driver_version)(int *);
    CUresult (*device_count)(int *);
    CUresult (*device_get)(CUdevice *, int);
    CUresult (*device_name)(char *, int, CUdevice);
    CUresult (*device_bus_id)(char *, int, CUdevice);
    CUresult (*device_uuid)(CUuuid *, CUdevice);
    CUresult (*primary_retain)(CUcontext *, CUdevice);
    CUresult (*ctx_set_current)(CUcontext);
    CUresult (*stream_create)(CUstream *, unsigned);
    CUresult (*stream_synchronize)(CUstream);
    CUresult (*ipc_open)(CUdeviceptr *, CUipcMemHandle, unsigned);
    CUresult (*ipc_close)(CUdeviceptr);
    CUresult (*device_attribute)(int *, CUdevice_attribute, CUdevice);
    CUresult (*can_access_peer)(int *, CUdevice, CUdevice);
    CUresult (*p2p_attribute)(int *, CUdevice_P2PAttribute, CUdevice, CUdevice);
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
    /* Staging for ops across daemons (sp_gpu_stage_get), and between GPUs
     * without peer access (sp_gpu_hstage_get). */
    CUresult (*mem_alloc)(CUdeviceptr *, size_t);
    CUresult (*host_alloc)(void **, size_t, unsigned);
    /* The NCCL thread's lanes (nccl_work.c): header copies and polls. */
    CUresult (*copy_htod)(CUdeviceptr, const void *, size_t, CUstream);
    CUresult (*copy_dtoh)(void *, CUdeviceptr, size_t, CUstream);
    CUresult (*stream_query)(CUstream);
} sp_cu_t;
extern sp_cu_t sp_cu;

/* NULL once the driver loaded; else why it did not. */
const char *sp_cu_missing(void);
/* The driver's message for rc. */
const char *sp_cu_msg(CUresult rc);
/* Makes device dev's primary context current on this thread. */
spc_status_t sp_gpu_dev_enter(int dev, sp_err_t *e);
/* The first use of device dev: its primary context and the daemon's stream. */
spc_status_t sp_gpu_dev_open(int dev, sp_err_t *e);
/* The daemon's ordinal of the client's GPU `ordinal`: by its UUID (a bus id is
 * shared by MIG instances); the bus id names it in errors. */
spc_status_t sp_gpu_dev_find(const char *bus, const uint8_t *want_uuid, int ordinal, int *dev_p, sp_err_t *e);

#endif /* SP_HAVE_CUDA */

#endif /* SP_GPU_INT_H */
