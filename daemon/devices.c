/*
 * devices.c — GPU and transport discovery.
 *
 * The CUDA driver is loaded at run time (dlopen libcuda.so.1) rather than linked:
 * the same spd binary then runs on nodes without a driver, where it serves host
 * memory and says why it sees no GPU.
 */
#include "devices.h"

#include <dlfcn.h>
#include <stdio.h>
#include <string.h>

#include "log.h"

#ifdef SP_HAVE_CUDA
#include <cuda.h>
#endif
#ifdef SP_HAVE_UCX
#include <ucp/api/ucp.h>
#endif
#ifdef SP_HAVE_NCCL
#include <nccl.h>
#endif

static void probe_gpus(sp_devices_t *d)
{
#ifdef SP_HAVE_CUDA
    typedef CUresult (*init_fn)(unsigned);
    typedef CUresult (*count_fn)(int *);
    typedef CUresult (*get_fn)(CUdevice *, int);
    typedef CUresult (*name_fn)(char *, int, CUdevice);
    typedef CUresult (*version_fn)(int *);
    typedef CUresult (*errstr_fn)(CUresult, const char **);

    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        d->gpu_count = 0;
        snprintf(d->gpu_status, sizeof d->gpu_status, "no CUDA driver (libcuda.so.1 not found)");
        return;
    }
    init_fn cu_init = (init_fn)dlsym(lib, "cuInit");
    count_fn cu_count = (count_fn)dlsym(lib, "cuDeviceGetCount");
    get_fn cu_get = (get_fn)dlsym(lib, "cuDeviceGet");
    name_fn cu_name = (name_fn)dlsym(lib, "cuDeviceGetName");
    version_fn cu_version = (version_fn)dlsym(lib, "cuDriverGetVersion");
    errstr_fn cu_errstr = (errstr_fn)dlsym(lib, "cuGetErrorString");
    if (!cu_init || !cu_count || !cu_get || !cu_name || !cu_version) {
        d->gpu_count = 0;
        snprintf(d->gpu_status, sizeof d->gpu_status, "libcuda.so.1 lacks the driver API");
        dlclose(lib);
        return;
    }
    CUresult rc = cu_init(0);
    if (rc != CUDA_SUCCESS) {
        const char *msg = "?";
        if (cu_errstr)
            cu_errstr(rc, &msg);
        d->gpu_count = 0;
        snprintf(d->gpu_status, sizeof d->gpu_status, "cuInit failed: %s (error %d)", msg, (int)rc);
        dlclose(lib);
        return;
    }
    int n = 0, ver = 0;
    cu_count(&n);
    cu_version(&ver);
    d->gpu_count = n;
    snprintf(d->gpu_status, sizeof d->gpu_status, "CUDA driver %d.%d", ver / 1000, (ver % 1000) / 10);
    for (int i = 0; i < n && i < SP_MAX_GPUS_SHOWN; i++) {
        CUdevice dev;
        if (cu_get(&dev, i) == CUDA_SUCCESS)
            cu_name(d->gpu_names[i], sizeof d->gpu_names[i], dev);
    }
    /* The library stays loaded: later issues use the driver from here. */
#else
    d->gpu_count = 0;
    snprintf(d->gpu_status, sizeof d->gpu_status, "built without CUDA");
#endif
}

void sp_devices_probe(sp_devices_t *d)
{
    memset(d, 0, sizeof *d);
    probe_gpus(d);
    snprintf(d->shm, sizeof d->shm, "active");
#ifdef SP_HAVE_UCX
    snprintf(d->ucx, sizeof d->ucx, "linked (UCX %s); carries nothing yet: jobs are single-node", ucp_get_version_string());
#else
    snprintf(d->ucx, sizeof d->ucx, "built without UCX");
#endif
#ifdef SP_HAVE_NCCL
    int v = 0;
    ncclGetVersion(&v);
    snprintf(d->nccl, sizeof d->nccl, "linked (NCCL %d.%d.%d); carries nothing yet: no GPU data path",
             v / 10000, (v / 100) % 100, v % 100);
#else
    snprintf(d->nccl, sizeof d->nccl, "built without NCCL");
#endif
    sp_info(XPORT, "transports: shm %s; ucx %s; nccl %s", d->shm, d->ucx, d->nccl);
    sp_info(XPORT, "gpus: %d (%s)", d->gpu_count, d->gpu_status);
    for (int i = 0; i < d->gpu_count && i < SP_MAX_GPUS_SHOWN; i++)
        sp_info(XPORT, "gpu %d: %s", i, d->gpu_names[i]);
}
