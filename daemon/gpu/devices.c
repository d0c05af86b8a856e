/*
 * devices.c — GPU and transport discovery.
 *
 * The CUDA driver, UCX and NCCL are found at run time rather than linked: the
 * same spd binary runs on nodes without a driver or without NCCL, where it
 * serves host memory and says what it did not find. The driver is gpu.c's,
 * which keeps it loaded for the GPU data path.
 */
#include "gpu/devices.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "gpu/gpu.h"
#include "base/log.h"

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

void sp_devices_probe(sp_devices_t *d, const char *nccl_library)
{
    static const char *const ucx[] = { "libucp.so.0", NULL };
    static const char *const defaults[] = {
#ifdef SP_NCCL_LIBRARY
        SP_NCCL_LIBRARY,   /* where the build found it */
#endif
        "libnccl.so.2", NULL };
    /* The operator's library, and only it, when named (nccl.c loads the same). */
    const char *const named[] = { nccl_library, NULL };
    const char *const *nccl = nccl_library != NULL && nccl_library[0] != '\0' ? named : defaults;

    memset(d, 0, sizeof *d);
    sp_gpu_probe(d);   /* gpu.c owns the driver: it loads it once, here */
    snprintf(d->shm, sizeof d->shm, "active");
    probe_library(ucx, "ucp_get_version_string", ucx_version, d->ucx, sizeof d->ucx);
    probe_library(nccl, "ncclGetVersion", nccl_version, d->nccl, sizeof d->nccl);
    sp_info(XPORT, "transports: shm %s; ucx %s; nccl %s", d->shm, d->ucx, d->nccl);
    sp_info(XPORT, "gpus: %d (%s)", d->gpu_count, d->gpu_status);
    for (int i = 0; i < d->gpu_count && i < SP_MAX_GPUS_SHOWN; i++)
        sp_info(XPORT, "gpu %d: %s", i, d->gpu_names[i]);
}
