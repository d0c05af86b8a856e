/*
 * devices.c — GPU and transport discovery.
 *
 * The CUDA driver, UCX and NCCL are found at run time rather than linked: the
 * same spd binary runs on nodes without a driver or without NCCL, where it
 * serves host memory and says what it did not find.
 */
#include "devices.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "log.h"

#ifdef SP_HAVE_CUDA
#include <cuda.h>
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
    typedef CUresult (*busid_fn)(char *, int, CUdevice);

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
    busid_fn cu_busid = (busid_fn)dlsym(lib, "cuDeviceGetPCIBusId");
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
    for (int i = 0; i < n && i < SP_TOPO_MAX_GPUS; i++) {
        CUdevice dev;
        if (cu_get(&dev, i) != CUDA_SUCCESS)
            continue;
        if (i < SP_MAX_GPUS_SHOWN)
            cu_name(d->gpu_names[i], sizeof d->gpu_names[i], dev);
        /* The topology finds each GPU's NUMA node in sysfs by this id. */
        if (cu_busid != NULL && cu_busid(d->gpu_bus[i], sizeof d->gpu_bus[i], dev) != CUDA_SUCCESS)
            d->gpu_bus[i][0] = '\0';
    }
    /* The library stays loaded: later issues use the driver from here. */
#else
    d->gpu_count = 0;
    snprintf(d->gpu_status, sizeof d->gpu_status, "built without CUDA");
#endif
}

/*
 * Looks for a shared library by the names given, in order, and reads its version
 * through `symbol` -- in a child process that exits right after. Loading UCX at
 * all installs its memory hooks (libucm patches the relocations of madvise,
 * mmap and friends, and closing the library does not undo it), and NCCL maps
 * 200 MB; neither belongs in the daemon before a transport uses it. Called at
 * start-up, before any thread exists, so fork() is safe.
 */
typedef void (*version_fmt_fn)(void *fn, char *buf, size_t len);

static void probe_library(const char *const *names, const char *symbol, version_fmt_fn fmt, char *out, size_t len)
{
    int fds[2];
    snprintf(out, len, "not probed");
    if (pipe2(fds, O_CLOEXEC) != 0)
        return;
    pid_t pid = fork();
    if (pid < 0) {
        close(fds[0]);
        close(fds[1]);
        return;
    }
    if (pid == 0) {
        char msg[160];
        void *lib = NULL;
        const char *found = NULL;
        for (int i = 0; names[i] != NULL && lib == NULL; i++) {
            lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
            found = names[i];
        }
        if (lib == NULL) {
            snprintf(msg, sizeof msg, "not installed (%s not found)", names[0]);
        } else {
            char version[64] = "?";
            void *fn = dlsym(lib, symbol);
            if (fn != NULL)
                fmt(fn, version, sizeof version);
            snprintf(msg, sizeof msg, "found (%s, %s)", version, found);
        }
        ssize_t w = write(fds[1], msg, strlen(msg));
        _exit(w > 0 ? 0 : 1);
    }
    close(fds[1]);
    size_t got = 0;
    ssize_t n;
    while (got + 1 < len && (n = read(fds[0], out + got, len - got - 1)) > 0)
        got += (size_t)n;
    out[got] = '\0';
    close(fds[0]);
    waitpid(pid, NULL, 0);
    if (got == 0)
        snprintf(out, len, "probe failed");
}

static void ucx_version(void *fn, char *buf, size_t len)
{
    snprintf(buf, len, "UCX %s", ((const char *(*)(void))fn)());
}

static void nccl_version(void *fn, char *buf, size_t len)
{
    int v = 0;
    ((int (*)(int *))fn)(&v);
    snprintf(buf, len, "NCCL %d.%d.%d", v / 10000, (v / 100) % 100, v % 100);
}

void sp_devices_probe(sp_devices_t *d)
{
    static const char *const ucx[] = { "libucp.so.0", NULL };
    static const char *const nccl[] = {
#ifdef SP_NCCL_LIBRARY
        SP_NCCL_LIBRARY,   /* where the build found it */
#endif
        "libnccl.so.2", NULL };

    memset(d, 0, sizeof *d);
    probe_gpus(d);
    snprintf(d->shm, sizeof d->shm, "active");
    probe_library(ucx, "ucp_get_version_string", ucx_version, d->ucx, sizeof d->ucx);
    probe_library(nccl, "ncclGetVersion", nccl_version, d->nccl, sizeof d->nccl);
    if (strncmp(d->nccl, "found", 5) == 0) {   /* the GPU data path is still to come */
        size_t n = strlen(d->nccl);
        snprintf(d->nccl + n, sizeof d->nccl - n, "; carries nothing yet");
    }
    sp_info(XPORT, "transports: shm %s; ucx %s; nccl %s", d->shm, d->ucx, d->nccl);
    sp_info(XPORT, "gpus: %d (%s)", d->gpu_count, d->gpu_status);
    for (int i = 0; i < d->gpu_count && i < SP_MAX_GPUS_SHOWN; i++)
        sp_info(XPORT, "gpu %d: %s", i, d->gpu_names[i]);
}
