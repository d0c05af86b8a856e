/*
 * gpu.c — the CUDA driver, device contexts and streams, and what runs on
 * them: kernels, stream memory operations, lanes, marks and staging (see
 * gpu.h). Clients' GPU memory is imported in gpu_import.c.
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
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gpu/devices.h"
#include "base/log.h"
#include "gpu/gpu_int.h"

#ifdef SP_HAVE_CUDA

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include "sp_kern_cuda.h"

/* The driver's entry points (gpu_int.h), filled by cu_load. */
sp_cu_t sp_cu;

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

/*
 * Lanes and the GPU's hardware queues. A stream of spd's has a hardware queue of
 * its own only up to CUDA_DEVICE_MAX_CONNECTIONS (8 unless the environment sets
 * it, 32 at most); past that, streams share queues, and a lane's wait on a
 * client's ready word at the head of a shared queue holds back every lane behind
 * it: the wait across streams that lanes exist to keep apart. spd asks for 32
 * (a value its environment sets is kept, and bounds the lanes too), and
 * sp_gpu_lane_open counts the lanes of each GPU against the queues left once the
 * device's own stream has one, and against gpu_lanes_max. NCCL's own streams
 * inside a communicator are not counted: they wait only on NCCL's events.
 */
static int connections;               /* CUDA_DEVICE_MAX_CONNECTIONS in force; 0: no driver loaded */
static atomic_int lanes_max = 31;     /* gpu_lanes_max */
static atomic_int lanes_open[SP_TOPO_MAX_GPUS];
static atomic_uint_fast64_t lanes_refused;

static void connections_setup(void)
{
    const char *v = getenv("CUDA_DEVICE_MAX_CONNECTIONS");
    char *end;
    long n = v != NULL ? strtol(v, &end, 10) : 0;
    if (v != NULL && *v != '\0' && *end == '\0' && n >= 1 && n <= 32) {
        connections = (int)n;
        if (n < 32)
            sp_info(XPORT, "CUDA_DEVICE_MAX_CONNECTIONS=%ld (kept): at most %ld lanes per GPU", n, n - 1);
        return;
    }
    if (v != NULL)
        sp_warn(XPORT, "CUDA_DEVICE_MAX_CONNECTIONS=%s ignored (1 to 32): spd asks for 32", v);
    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "32", 1);
    connections = 32;
}

void sp_gpu_lane_limit(int lanes)
{
    atomic_store(&lanes_max, lanes);
}

/* No lane without a driver: 0 until CUDA is loaded. */
static int lanes_most(void)
{
    int most = atomic_load(&lanes_max);
    if (connections == 0)
        return 0;
    return most < connections - 1 ? most : connections - 1;
}

void sp_gpu_lane_counts(uint64_t *open, uint64_t *most, uint64_t *refused)
{
    *open = 0;
    for (int i = 0; i < SP_TOPO_MAX_GPUS; i++)
        *open += (uint64_t)atomic_load(&lanes_open[i]);
    *most = (uint64_t)lanes_most();
    *refused = atomic_load(&lanes_refused);
}

/* Takes one of dev's lanes, or says why there is none. */
static spc_status_t lane_take(int dev, sp_err_t *e)
{
    int most = lanes_most();
    int n = atomic_load(&lanes_open[dev]);
    do {
        if (n >= most) {
            atomic_fetch_add(&lanes_refused, 1);
            return sp_err_set(e, SPC_ERR_LIMIT, "GPU %d has %d streams of spd's open, as many as it may "
                              "(gpu_lanes_max %d; CUDA_DEVICE_MAX_CONNECTIONS %d hardware queues, one for spd's own "
                              "stream): one more would share a queue, where one stream's wait holds back the others; "
                              "destroy a stream first", dev, n, atomic_load(&lanes_max), connections);
        }
    } while (!atomic_compare_exchange_weak(&lanes_open[dev], &n, n + 1));
    return SPC_OK;
}

static CUstream cur(int dev)
{
    return cur_lane[dev] != NULL ? cur_lane[dev] : devs[dev].stream;
}

/*
 * A device whose context failed: a kernel or stream operation faulted (an
 * illegal address, a trap), an error the driver makes sticky. Every later call
 * in that context fails the same way, nothing queued in it runs, and only a new
 * process gets a working one: spd cannot reset a primary context its imports
 * and the CUDA runtime hold. So the device is out of service, with the reason,
 * until spd restarts; the others go on. Set once, by whichever thread saw it.
 */
static pthread_mutex_t fault_lock = PTHREAD_MUTEX_INITIALIZER;
static char fault_why[SP_TOPO_MAX_GPUS][160];
static bool faulted[SP_TOPO_MAX_GPUS];   /* read without the lock: fault_why is written before */

/* The errors after which a context is unusable (the CUDA documentation's list). */
static bool sticky(CUresult rc)
{
    switch (rc) {
    case CUDA_ERROR_ILLEGAL_ADDRESS:
    case CUDA_ERROR_LAUNCH_TIMEOUT:
    case CUDA_ERROR_ASSERT:
    case CUDA_ERROR_HARDWARE_STACK_ERROR:
    case CUDA_ERROR_ILLEGAL_INSTRUCTION:
    case CUDA_ERROR_MISALIGNED_ADDRESS:
    case CUDA_ERROR_INVALID_ADDRESS_SPACE:
    case CUDA_ERROR_INVALID_PC:
    case CUDA_ERROR_LAUNCH_FAILED:
    case CUDA_ERROR_ECC_UNCORRECTABLE:
        return true;
    default:
        return false;
    }
}

static void device_failed(int dev, const char *what, CUresult rc)
{
    pthread_mutex_lock(&fault_lock);
    if (!faulted[dev]) {
        snprintf(fault_why[dev], sizeof fault_why[dev], "its context failed (%s: %s, error %d)", what, sp_cu_msg(rc),
                 (int)rc);
        __atomic_store_n(&faulted[dev], true, __ATOMIC_RELEASE);
        sp_error(XPORT, "GPU %d is out of service: %s; spd refuses ops on it until it restarts", dev, fault_why[dev]);
    }
    pthread_mutex_unlock(&fault_lock);
}

const char *sp_gpu_fault(int dev)
{
    return dev >= 0 && dev < SP_TOPO_MAX_GPUS && __atomic_load_n(&faulted[dev], __ATOMIC_ACQUIRE) ? fault_why[dev]
                                                                                                  : NULL;
}

const char *sp_cu_msg(CUresult rc)
{
    const char *s = NULL;
    if (sp_cu.error_string == NULL || sp_cu.error_string(rc, &s) != CUDA_SUCCESS || s == NULL)
        s = "unknown CUDA error";
    return s;
}

const char *sp_cu_missing(void)
{
    return cu_loaded ? NULL : cu_why;
}

static bool cu_load(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        snprintf(cu_why, sizeof cu_why, "no CUDA driver (libcuda.so.1 not found)");
        return false;
    }
    *(void **)&sp_cu.init = dlsym(lib, "cuInit");
    *(void **)&sp_cu.error_string = dlsym(lib, "cuGetErrorString");
    *(void **)&sp_cu.driver_version = dlsym(lib, "cuDriverGetVersion");
    *(void **)&sp_cu.device_count = dlsym(lib, "cuDeviceGetCount");
    *(void **)&sp_cu.device_get = dlsym(lib, "cuDeviceGet");
    *(void **)&sp_cu.device_name = dlsym(lib, "cuDeviceGetName");
    *(void **)&sp_cu.device_bus_id = dlsym(lib, "cuDeviceGetPCIBusId");
    *(void **)&sp_cu.device_uuid = dlsym(lib, "cuDeviceGetUuid_v2");
    if (sp_cu.device_uuid == NULL)
        *(void **)&sp_cu.device_uuid = dlsym(lib, "cuDeviceGetUuid");
    *(void **)&sp_cu.primary_retain = dlsym(lib, "cuDevicePrimaryCtxRetain");
    *(void **)&sp_cu.ctx_set_current = dlsym(lib, "cuCtxSetCurrent");
    *(void **)&sp_cu.stream_create = dlsym(lib, "cuStreamCreate");
    *(void **)&sp_cu.stream_synchronize = dlsym(lib, "cuStreamSynchronize");
    *(void **)&sp_cu.ipc_open = dlsym(lib, "cuIpcOpenMemHandle_v2");
    *(void **)&sp_cu.ipc_close = dlsym(lib, "cuIpcCloseMemHandle");
    *(void **)&sp_cu.device_attribute = dlsym(lib, "cuDeviceGetAttribute");
    *(void **)&sp_cu.can_access_peer = dlsym(lib, "cuDeviceCanAccessPeer");
    *(void **)&sp_cu.p2p_attribute = dlsym(lib, "cuDeviceGetP2PAttribute");
    *(void **)&sp_cu.host_register = dlsym(lib, "cuMemHostRegister_v2");
    *(void **)&sp_cu.host_unregister = dlsym(lib, "cuMemHostUnregister");
    *(void **)&sp_cu.host_device_pointer = dlsym(lib, "cuMemHostGetDevicePointer_v2");
    *(void **)&sp_cu.wait_value64 = dlsym(lib, "cuStreamWaitValue64_v2");
    *(void **)&sp_cu.write_value64 = dlsym(lib, "cuStreamWriteValue64_v2");
    *(void **)&sp_cu.event_create = dlsym(lib, "cuEventCreate");
    *(void **)&sp_cu.event_record = dlsym(lib, "cuEventRecord");
    *(void **)&sp_cu.event_query = dlsym(lib, "cuEventQuery");
    *(void **)&sp_cu.event_destroy = dlsym(lib, "cuEventDestroy_v2");
    *(void **)&sp_cu.stream_wait_event = dlsym(lib, "cuStreamWaitEvent");
    *(void **)&sp_cu.stream_destroy = dlsym(lib, "cuStreamDestroy_v2");
    *(void **)&sp_cu.mem_import = dlsym(lib, "cuMemImportFromShareableHandle");
    *(void **)&sp_cu.mem_props = dlsym(lib, "cuMemGetAllocationPropertiesFromHandle");
    *(void **)&sp_cu.mem_granularity = dlsym(lib, "cuMemGetAllocationGranularity");
    *(void **)&sp_cu.mem_reserve = dlsym(lib, "cuMemAddressReserve");
    *(void **)&sp_cu.mem_addr_free = dlsym(lib, "cuMemAddressFree");
    *(void **)&sp_cu.mem_map = dlsym(lib, "cuMemMap");
    *(void **)&sp_cu.mem_unmap = dlsym(lib, "cuMemUnmap");
    *(void **)&sp_cu.mem_set_access = dlsym(lib, "cuMemSetAccess");
    *(void **)&sp_cu.mem_release = dlsym(lib, "cuMemRelease");
    *(void **)&sp_cu.mem_alloc = dlsym(lib, "cuMemAlloc_v2");
    *(void **)&sp_cu.host_alloc = dlsym(lib, "cuMemHostAlloc");
    *(void **)&sp_cu.copy_htod = dlsym(lib, "cuMemcpyHtoDAsync_v2");
    *(void **)&sp_cu.copy_dtoh = dlsym(lib, "cuMemcpyDtoHAsync_v2");
    *(void **)&sp_cu.stream_query = dlsym(lib, "cuStreamQuery");
    for (size_t i = 0; i < sizeof sp_cu / sizeof(void *); i++) {
        if (((void **)&sp_cu)[i] == NULL) {
            snprintf(cu_why, sizeof cu_why, "libcuda.so.1 lacks the driver API spd needs (CUDA 12 or later)");
            dlclose(lib);
            return false;
        }
    }
    /* Every kernel loaded with its context (sp_gpu_dev_open), never at its first
     * launch: CUDA's lazy loading (the default since 12.2) may synchronize the
     * context to load a kernel, and spd's lanes hold waits on clients' streams
     * that last until those streams get there (up to an op's timeout), so the
     * progress thread would stall behind them: with LAZY, a new kernel's op
     * waited out a 5 s stall of another rank's stream on an H100. So spd loads
     * eagerly whatever its environment says (a trainer's image may set LAZY). */
    connections_setup();
    const char *mode = getenv("CUDA_MODULE_LOADING");
    if (mode != NULL && strcmp(mode, "EAGER") != 0)
        sp_warn(XPORT, "CUDA_MODULE_LOADING=%s ignored: spd loads its kernels eagerly", mode);
    setenv("CUDA_MODULE_LOADING", "EAGER", 1);
    CUresult rc = sp_cu.init(0);
    if (rc != CUDA_SUCCESS) {
        snprintf(cu_why, sizeof cu_why, "cuInit failed: %s (error %d)", sp_cu_msg(rc), (int)rc);
        dlclose(lib);
        return false;
    }
    /* The library stays loaded: imports and kernels use it from here on. */
    return true;
}

/* One question to the driver about from -> to; -1 when it does not answer. */
static int p2p_attribute(CUdevice_P2PAttribute attr, CUdevice from, CUdevice to)
{
    int v = 0;
    return sp_cu.p2p_attribute(&v, attr, from, to) == CUDA_SUCCESS ? v : -1;
}

/* What the driver says of each ordered pair of the first n GPUs: whether one
 * can map the other's memory, how well, and whether atomics across it are
 * native. Asking enables nothing: peer access is the data path's to enable. */
static void probe_peers(sp_devices_t *d, int n)
{
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < n; j++) {
            sp_gpu_peer_t *p = &d->gpu_peer[i][j];
            CUdevice a, b;
            int can = 0;
            *p = (sp_gpu_peer_t){ .access = -1, .atomics = -1, .perf_rank = -1 };
            if (i == j || sp_cu.device_get(&a, i) != CUDA_SUCCESS || sp_cu.device_get(&b, j) != CUDA_SUCCESS)
                continue;
            /* The attribute says the same; it answers where the call does not. */
            if (sp_cu.can_access_peer(&can, a, b) == CUDA_SUCCESS)
                p->access = can != 0;
            else if ((can = p2p_attribute(CU_DEVICE_P2P_ATTRIBUTE_ACCESS_SUPPORTED, a, b)) >= 0)
                p->access = can != 0;
            int atomics = p2p_attribute(CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, a, b);
            p->atomics = (int8_t)(atomics < 0 ? -1 : atomics != 0);
            p->perf_rank = p2p_attribute(CU_DEVICE_P2P_ATTRIBUTE_PERFORMANCE_RANK, a, b);
        }
    }
    d->gpu_peers_asked = true;
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
    sp_cu.device_count(&n);
    sp_cu.driver_version(&ver);
    d->gpu_count = n;
    snprintf(d->gpu_status, sizeof d->gpu_status, "CUDA driver %d.%d", ver / 1000, (ver % 1000) / 10);
    for (int i = 0; i < n && i < SP_TOPO_MAX_GPUS; i++) {
        CUdevice dev;
        if (sp_cu.device_get(&dev, i) != CUDA_SUCCESS)
            continue;
        if (i < SP_MAX_GPUS_SHOWN)
            sp_cu.device_name(d->gpu_names[i], sizeof d->gpu_names[i], dev);
        /* The topology finds each GPU's NUMA node in sysfs by this id. */
        if (sp_cu.device_bus_id(d->gpu_bus[i], sizeof d->gpu_bus[i], dev) != CUDA_SUCCESS)
            d->gpu_bus[i][0] = '\0';
    }
    probe_peers(d, n < SP_TOPO_MAX_GPUS ? n : SP_TOPO_MAX_GPUS);
}

/* Makes device dev's primary context current on this thread. */
spc_status_t sp_gpu_dev_enter(int dev, sp_err_t *e)
{
    const char *why = sp_gpu_fault(dev);
    if (why != NULL)
        return sp_err_set(e, SPC_ERR_DEVICE, "GPU %d is out of service: %s; spd refuses ops on it until it restarts",
                          dev, why);
    CUresult rc = sp_cu.ctx_set_current(devs[dev].ctx);
    if (rc != CUDA_SUCCESS) {
        sp_err_set(e, SPC_ERR_DEVICE, "GPU %d: cuCtxSetCurrent: %s (error %d)", dev, sp_cu_msg(rc), (int)rc);
        sp_error(XPORT, "%s", e->msg);
        return e->status;
    }
    return SPC_OK;
}

/* The first use of device dev: its primary context and the daemon's stream. */
spc_status_t sp_gpu_dev_open(int dev, sp_err_t *e)
{
    CUresult rc;
    CUdevice d;
    CUcontext ctx;
    CUstream stream;

    if (devs[dev].stream != NULL)
        return SPC_OK;
    if ((rc = sp_cu.device_get(&d, dev)) != CUDA_SUCCESS || (rc = sp_cu.primary_retain(&ctx, d)) != CUDA_SUCCESS) {
        sp_err_set(e, SPC_ERR_DEVICE, "GPU %d: no primary context: %s (error %d)", dev, sp_cu_msg(rc), (int)rc);
        sp_error(XPORT, "%s", e->msg);
        return e->status;
    }
    /* The primary context stays retained for the daemon's life: its streams
     * and imports live in it. */
    devs[dev].ctx = ctx;
    spc_status_t st = sp_gpu_dev_enter(dev, e);
    if (st != SPC_OK)
        return st;
    if ((rc = sp_cu.stream_create(&stream, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS) {
        sp_err_set(e, SPC_ERR_DEVICE, "GPU %d: cuStreamCreate: %s (error %d)", dev, sp_cu_msg(rc), (int)rc);
        sp_error(XPORT, "%s", e->msg);
        return e->status;
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

/*
 * The daemon's ordinal of the client's GPU `ordinal`: the one with its UUID.
 * A UUID names one GPU, or one MIG instance, where a PCI bus id names the
 * whole board that several instances share; the bus id only says in an error
 * which GPU the client meant.
 */
spc_status_t sp_gpu_dev_find(const char *bus, const uint8_t *want_uuid, int ordinal, int *dev_p, sp_err_t *e)
{
    int n = 0;
    sp_cu.device_count(&n);
    for (int i = 0; i < n; i++) {
        CUdevice d;
        CUuuid uuid;
        if (sp_cu.device_get(&d, i) != CUDA_SUCCESS || sp_cu.device_uuid(&uuid, d) != CUDA_SUCCESS ||
            memcmp(uuid.bytes, want_uuid, SP_GPU_UUID_BYTES) != 0)
            continue;
        if (i >= SP_TOPO_MAX_GPUS)   /* devs[] is indexed by the daemon's ordinals */
            return sp_err_set(e, SPC_ERR_UNSUPPORTED, "GPU at PCI %s is beyond the %d GPUs spd serves", bus,
                              SP_TOPO_MAX_GPUS);
        *dev_p = i;
        return SPC_OK;
    }
    return sp_err_set(e, SPC_ERR_NO_DEVICE, "the client's GPU %d (PCI %s) is not visible to spd: no GPU of spd's has "
                      "its UUID", ordinal, bus);
}

/* A launcher's result: -1 is a refusal of its arguments, anything else a cudaError_t. */
static spc_status_t launched(int rc, int dev, const char *what, sp_err_t *e)
{
    if (rc == 0)
        return SPC_OK;
    if (rc == -1)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "%s on GPU %d: the kernel refuses these arguments (alignment or "
                          "size)", what, dev);
    if (sticky((CUresult)rc))   /* the runtime's numbers are the driver's */
        device_failed(dev, what, (CUresult)rc);
    sp_err_set(e, SPC_ERR_DEVICE, "%s on GPU %d: %s (cuda error %d)", what, dev, cudaGetErrorString((cudaError_t)rc),
               rc);
    sp_error(XPORT, "%s", e->msg);
    return e->status;
}

spc_status_t sp_gpu_copy(int dev, void *dst, const void *src, uint64_t n, sp_err_t *e)
{
    spc_status_t st = sp_gpu_dev_enter(dev, e);
    return st != SPC_OK ? st : launched(sp_kern_shift_cuda(dst, src, n, cur(dev)), dev, "copy", e);
}

spc_status_t sp_gpu_allreduce(int dev, void *const *dst, const void *const *src, uint32_t nranks, uint64_t n,
                              unsigned dtype, unsigned redop, sp_err_t *e)
{
    spc_status_t st = sp_gpu_dev_enter(dev, e);
    return st != SPC_OK ? st
                        : launched(sp_kern_allreduce_cuda(dst, src, nranks, n, dtype, redop, cur(dev)), dev,
                                   "all-reduce", e);
}

spc_status_t sp_gpu_a2a(int dev, void *dst, const void *const *src, const sp_kern_a2a_desc_t *d, uint32_t rank,
                        sp_err_t *e)
{
    spc_status_t st = sp_gpu_dev_enter(dev, e);
    return st != SPC_OK ? st
                        : launched(sp_kern_a2a_cuda(dst, src, d, rank, cur(dev)), dev, "all-to-all", e);
}

spc_status_t sp_gpu_stream_device(const char *pci_bus_id, const uint8_t *uuid, int client_ordinal, int *dev_p,
                                  sp_err_t *e)
{
    int dev, on = 0;

    if (!cu_loaded)
        return sp_err_set(e, SPC_ERR_NO_DEVICE, "spd cannot order ops on GPU streams: %s", cu_why);
    spc_status_t st = sp_gpu_dev_find(pci_bus_id, uuid, client_ordinal, &dev, e);
    if (st == SPC_OK)
        st = sp_gpu_dev_open(dev, e);
    if (st != SPC_OK)
        return st;
    CUdevice d;
    CUresult rc = sp_cu.device_get(&d, dev);
    if (rc == CUDA_SUCCESS)
        rc = sp_cu.device_attribute(&on, CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS, d);
    if (rc != CUDA_SUCCESS || !on)
        return sp_err_set(e, SPC_ERR_UNSUPPORTED, "GPU %d cannot wait on 64-bit values in host memory (stream memory "
                          "operations%s)", dev, rc != CUDA_SUCCESS ? ": the driver does not say" : " are off in this "
                          "driver");
    *dev_p = dev;
    return SPC_OK;
}

spc_status_t sp_gpu_host_register(int dev, void *p, size_t n, uint64_t *dptr_p, sp_err_t *e)
{
    spc_status_t st = sp_gpu_dev_enter(dev, e);
    if (st != SPC_OK)
        return st;
    /* Portable: the page is the client's, used from every device's context. */
    CUresult rc = sp_cu.host_register(p, n, CU_MEMHOSTREGISTER_PORTABLE | CU_MEMHOSTREGISTER_DEVICEMAP);
    CUdeviceptr dptr = 0;
    if (rc == CUDA_SUCCESS && (rc = sp_cu.host_device_pointer(&dptr, p, 0)) != CUDA_SUCCESS)
        sp_cu.host_unregister(p);
    if (rc != CUDA_SUCCESS) {
        sp_err_set(e, SPC_ERR_DEVICE, "GPU %d: cannot register the stream semaphores with CUDA: %s (error %d)", dev,
                   sp_cu_msg(rc), (int)rc);
        sp_error(XPORT, "%s", e->msg);
        return e->status;
    }
    *dptr_p = dptr;
    return SPC_OK;
}

void sp_gpu_host_unregister(void *p)
{
    CUresult rc = sp_cu.host_unregister(p);
    if (rc != CUDA_SUCCESS)
        sp_error(XPORT, "cuMemHostUnregister(%p): %s (error %d)", p, sp_cu_msg(rc), (int)rc);
}

static spc_status_t enqueued(CUresult rc, int dev, const char *what, sp_err_t *e)
{
    if (rc == CUDA_SUCCESS)
        return SPC_OK;
    if (sticky(rc))
        device_failed(dev, what, rc);
    sp_err_set(e, SPC_ERR_DEVICE, "GPU %d: %s: %s (error %d)", dev, what, sp_cu_msg(rc), (int)rc);
    sp_error(XPORT, "%s", e->msg);
    return e->status;
}

spc_status_t sp_gpu_wait_value(int dev, uint64_t dptr, uint64_t v, sp_err_t *e)
{
    spc_status_t st = sp_gpu_dev_enter(dev, e);
    return st != SPC_OK ? st
                        : enqueued(sp_cu.wait_value64(cur(dev), dptr, v, CU_STREAM_WAIT_VALUE_GEQ), dev,
                                   "cuStreamWaitValue64", e);
}

spc_status_t sp_gpu_write_value(int dev, uint64_t dptr, uint64_t v, sp_err_t *e)
{
    spc_status_t st = sp_gpu_dev_enter(dev, e);
    /* The default write is ordered after the kernels before it, and fenced:
     * whoever sees the value sees their results. */
    return st != SPC_OK ? st
                        : enqueued(sp_cu.write_value64(cur(dev), dptr, v, CU_STREAM_WRITE_VALUE_DEFAULT), dev,
                                   "cuStreamWriteValue64", e);
}

/* A lane is one more stream of the daemon's on a device. */
struct sp_gpu_lane {
    CUstream s;
    int      dev;
};

spc_status_t sp_gpu_lane_open(int dev, sp_gpu_lane_t **lane_p, sp_err_t *e)
{
    spc_status_t st = sp_gpu_dev_enter(dev, e);
    if (st != SPC_OK)
        return st;
    if ((st = lane_take(dev, e)) != SPC_OK)
        return st;
    sp_gpu_lane_t *l = calloc(1, sizeof *l);
    if (l == NULL) {
        atomic_fetch_sub(&lanes_open[dev], 1);
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    }
    CUresult rc = sp_cu.stream_create(&l->s, CU_STREAM_NON_BLOCKING);
    if (rc != CUDA_SUCCESS) {
        free(l);
        atomic_fetch_sub(&lanes_open[dev], 1);
        return enqueued(rc, dev, "cuStreamCreate", e);
    }
    l->dev = dev;
    *lane_p = l;
    return SPC_OK;
}

void sp_gpu_lane_close(sp_gpu_lane_t *l)
{
    sp_err_t e = SP_ERR_INIT;   /* logged where it arose */
    if (l == NULL)
        return;
    /* What is still on it runs out; the driver frees the stream then. */
    if (sp_gpu_dev_enter(l->dev, &e) == SPC_OK)
        sp_cu.stream_destroy(l->s);
    atomic_fetch_sub(&lanes_open[l->dev], 1);
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

int sp_gpu_lane_idle(const sp_gpu_lane_t *l, sp_err_t *e)
{
    CUresult rc = sp_cu.stream_query(l->s);
    if (rc == CUDA_SUCCESS)
        return 1;
    if (rc == CUDA_ERROR_NOT_READY)
        return 0;
    /* Only a sticky error fails a query: the context is gone. */
    return enqueued(rc, l->dev, "a lane of spd's", e);
}

spc_status_t sp_gpu_copy_in(int dev, void *dst, const void *src, size_t n, sp_err_t *e)
{
    spc_status_t st = sp_gpu_dev_enter(dev, e);
    return st != SPC_OK ? st
                        : enqueued(sp_cu.copy_htod((CUdeviceptr)(uintptr_t)dst, src, n, cur(dev)), dev,
                                   "cuMemcpyHtoDAsync", e);
}

spc_status_t sp_gpu_copy_out(int dev, void *dst, const void *src, size_t n, sp_err_t *e)
{
    spc_status_t st = sp_gpu_dev_enter(dev, e);
    return st != SPC_OK ? st
                        : enqueued(sp_cu.copy_dtoh(dst, (CUdeviceptr)(uintptr_t)src, n, cur(dev)), dev,
                                   "cuMemcpyDtoHAsync", e);
}

spc_status_t sp_gpu_pinned_alloc(size_t bytes, void **p_p, sp_err_t *e)
{
    void *p = NULL;
    /* Portable: every context may copy from and to it, whichever is current. */
    CUresult rc = sp_cu.host_alloc(&p, bytes, CU_MEMHOSTALLOC_PORTABLE);
    if (rc != CUDA_SUCCESS) {
        sp_err_set(e, rc == CUDA_ERROR_OUT_OF_MEMORY ? SPC_ERR_NO_MEMORY : SPC_ERR_DEVICE, "no %zu bytes of pinned "
                   "host memory: cuMemHostAlloc: %s (error %d)", bytes, sp_cu_msg(rc), (int)rc);
        sp_error(XPORT, "%s", e->msg);
        return e->status;
    }
    *p_p = p;
    return SPC_OK;
}

/* Marks are events without timing, kept for reuse: a task records one, and the
 * progress thread polls it. The NCCL thread orders an op's lanes on several
 * GPUs with them too, so the free list has a lock of its own. */
struct sp_gpu_mark {
    sp_gpu_mark_t *next;
    CUevent        ev;
    int            dev;
};

static pthread_mutex_t marks_lock = PTHREAD_MUTEX_INITIALIZER;
static sp_gpu_mark_t *marks_free;

spc_status_t sp_gpu_mark(int dev, sp_gpu_mark_t **mark_p, sp_err_t *e)
{
    spc_status_t st = sp_gpu_dev_enter(dev, e);
    if (st != SPC_OK)
        return st;
    pthread_mutex_lock(&marks_lock);
    sp_gpu_mark_t **pp = &marks_free;
    while (*pp != NULL && (*pp)->dev != dev)
        pp = &(*pp)->next;
    sp_gpu_mark_t *m = *pp;
    if (m != NULL)
        *pp = m->next;
    pthread_mutex_unlock(&marks_lock);
    if (m == NULL) {
        if ((m = calloc(1, sizeof *m)) == NULL)
            return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
        m->dev = dev;
        CUresult rc = sp_cu.event_create(&m->ev, CU_EVENT_DISABLE_TIMING);
        if (rc != CUDA_SUCCESS) {
            free(m);
            return enqueued(rc, dev, "cuEventCreate", e);
        }
    }
    CUresult rc = sp_cu.event_record(m->ev, cur(dev));
    if (rc != CUDA_SUCCESS) {
        sp_gpu_mark_free(m);
        return enqueued(rc, dev, "cuEventRecord", e);
    }
    *mark_p = m;
    return SPC_OK;
}

int sp_gpu_mark_done(sp_gpu_mark_t *m, sp_err_t *e)
{
    if (sp_gpu_dev_enter(m->dev, e) != SPC_OK)
        return e->status;
    CUresult rc = sp_cu.event_query(m->ev);
    if (rc == CUDA_SUCCESS)
        return 1;
    if (rc == CUDA_ERROR_NOT_READY)
        return 0;
    /* What the stream ran failed after it was queued: the context is gone. */
    device_failed(m->dev, "the daemon's stream", rc);
    sp_err_set(e, SPC_ERR_DEVICE, "GPU %d: the daemon's stream failed: %s (error %d); spd refuses ops on GPU %d "
               "until it restarts", m->dev, sp_cu_msg(rc), (int)rc, m->dev);
    return e->status;
}

void sp_gpu_mark_free(sp_gpu_mark_t *m)
{
    if (m == NULL)
        return;
    pthread_mutex_lock(&marks_lock);
    m->next = marks_free;
    marks_free = m;
    pthread_mutex_unlock(&marks_lock);
}

spc_status_t sp_gpu_wait_mark(int dev, sp_gpu_mark_t *m, sp_err_t *e)
{
    spc_status_t st = sp_gpu_dev_enter(dev, e);
    return st != SPC_OK ? st : enqueued(sp_cu.stream_wait_event(cur(dev), m->ev, 0), dev, "cuStreamWaitEvent", e);
}

/* ---------------------------------------------------------------- ops across daemons (exec.c, nccl.c) */

spc_status_t sp_gpu_use(int dev, sp_err_t *e)
{
    /* A task names a device only after an import opened it (lock held then, and
     * the task was handed over under the lock since). */
    if (!cu_loaded || dev < 0 || dev >= SP_TOPO_MAX_GPUS || devs[dev].ctx == NULL)
        return sp_err_set(e, SPC_ERR_NO_DEVICE, "GPU %d is not open in spd", dev);
    return sp_gpu_dev_enter(dev, e);
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
static uint64_t stage_kept[SP_TOPO_MAX_GPUS];           /* bytes made on each GPU, in use or free */
static uint64_t stage_max = UINT64_MAX;                 /* the most per GPU */

void sp_gpu_stage_limit(uint64_t bytes)
{
    pthread_mutex_lock(&stage_lock);
    stage_max = bytes;
    pthread_mutex_unlock(&stage_lock);
}

spc_status_t sp_gpu_stage_get(int dev, uint64_t bytes, sp_gpu_stage_t **s_p, sp_err_t *e)
{
    spc_status_t st = sp_gpu_use(dev, e);
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
    /* Blocks are never freed (above), so what a job made stays made: the cap
     * counts the free ones too, else ops of growing sizes would take the GPU. */
    uint64_t kept = stage_kept[dev], max = stage_max;
    bool room = s == NULL && want <= max && kept <= max - want;
    if (room)
        stage_kept[dev] += want;   /* taken now: the lock is not held across the allocation */
    pthread_mutex_unlock(&stage_lock);
    if (s != NULL) {
        *s_p = s;
        return SPC_OK;
    }
    if (!room) {
        sp_err_set(e, SPC_ERR_LIMIT, "GPU %d: staging %" PRIu64 " bytes of an op across daemons needs %" PRIu64
                   " more bytes of GPU memory; spd keeps %" PRIu64 " there and at most gpu_device_staging_bytes = %"
                   PRIu64, dev, bytes, want, kept, max);
        sp_warn(XPORT, "%s", e->msg);
        return e->status;
    }
    CUresult rc = CUDA_SUCCESS;
    if ((s = calloc(1, sizeof *s)) == NULL)
        sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    else if ((rc = sp_cu.mem_alloc(&s->ptr, want)) != CUDA_SUCCESS)
        sp_err_set(e, rc == CUDA_ERROR_OUT_OF_MEMORY ? SPC_ERR_NO_MEMORY : SPC_ERR_DEVICE, "GPU %d: no %" PRIu64
                   " bytes to stage an op across daemons: %s (error %d)", dev, want, sp_cu_msg(rc), (int)rc);
    if (s == NULL || rc != CUDA_SUCCESS) {
        pthread_mutex_lock(&stage_lock);
        stage_kept[dev] -= want;
        pthread_mutex_unlock(&stage_lock);
        sp_error(XPORT, "%s", e->msg);
        free(s);
        return e->status;
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

/* ---------------------------------------------------------------- between GPUs without peer access */

/* What the driver said of each ordered pair: 1 reaches, -1 does not, 0 not asked. */
static int8_t reach[SP_TOPO_MAX_GPUS][SP_TOPO_MAX_GPUS];

bool sp_gpu_can_reach(int from, int to)
{
    if (from == to)
        return true;
    if (reach[from][to] == 0) {
        CUdevice a, b;
        int can = 0;
        bool ok = sp_cu.device_get(&a, from) == CUDA_SUCCESS && sp_cu.device_get(&b, to) == CUDA_SUCCESS &&
                  sp_cu.can_access_peer(&can, a, b) == CUDA_SUCCESS && can;
        reach[from][to] = ok ? 1 : -1;
        if (!ok)
            sp_info(XPORT, "GPU %d cannot map GPU %d's memory (no peer access): ops between them are staged through "
                    "pinned host memory", from, to);
    }
    return reach[from][to] > 0;
}

/*
 * Pinned host memory that inputs are staged through between GPUs that cannot
 * reach each other: one GPU copies an input in, the others' kernels read it
 * there. Portable and mapped, so every GPU reads it at one address. Blocks are
 * kept once made and handed out again (sizes up to powers of two), as device
 * staging is; taken and given back under the engine lock (the progress thread
 * for one node's ops, the NCCL thread for a daemon's ranks on several GPUs).
 */
struct sp_gpu_hstage {
    sp_gpu_hstage_t *next;
    uint64_t         dptr, bytes;
};

static sp_gpu_hstage_t *hstage_free;
static uint64_t hstage_kept, hstage_max = UINT64_MAX;   /* bytes made, and the most there may be */

void sp_gpu_hstage_limit(uint64_t bytes)
{
    hstage_max = bytes;
}

spc_status_t sp_gpu_hstage_get(uint64_t bytes, sp_gpu_hstage_t **s_p, sp_err_t *e)
{
    uint64_t want = 64u << 10;
    while (want < bytes && want < (1ull << 62))
        want <<= 1;
    sp_gpu_hstage_t **best = NULL;
    for (sp_gpu_hstage_t **pp = &hstage_free; *pp != NULL; pp = &(*pp)->next)
        if ((*pp)->bytes >= want && (best == NULL || (*pp)->bytes < (*best)->bytes))
            best = pp;
    if (best != NULL) {
        *s_p = *best;
        *best = (*s_p)->next;
        (*s_p)->next = NULL;
        return SPC_OK;
    }
    if (want > hstage_max - hstage_kept)
        return sp_err_set(e, SPC_ERR_LIMIT, "staging %" PRIu64 " bytes of a tensor between GPUs without peer access "
                          "needs %" PRIu64 " more bytes of pinned host memory; spd keeps %" PRIu64 " and at most "
                          "gpu_host_staging_bytes = %" PRIu64, bytes, want, hstage_kept, hstage_max);
    sp_gpu_hstage_t *s = calloc(1, sizeof *s);
    void *p = NULL;
    if (s == NULL)
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    CUresult rc = sp_cu.host_alloc(&p, want, CU_MEMHOSTALLOC_PORTABLE | CU_MEMHOSTALLOC_DEVICEMAP);
    CUdeviceptr dptr = 0;
    if (rc == CUDA_SUCCESS)
        rc = sp_cu.host_device_pointer(&dptr, p, 0);
    if (rc != CUDA_SUCCESS) {
        sp_err_set(e, rc == CUDA_ERROR_OUT_OF_MEMORY ? SPC_ERR_NO_MEMORY : SPC_ERR_DEVICE, "no %" PRIu64 " bytes of "
                   "pinned host memory to stage an op between GPUs without peer access: %s (error %d)", want,
                   sp_cu_msg(rc), (int)rc);
        sp_error(XPORT, "%s", e->msg);
        free(s);
        return e->status;
    }
    s->dptr = dptr;
    s->bytes = want;
    hstage_kept += want;
    sp_info(XPORT, "%" PRIu64 " more bytes of pinned host memory for staging between GPUs", want);
    *s_p = s;
    return SPC_OK;
}

void *sp_gpu_hstage_ptr(const sp_gpu_hstage_t *s)
{
    return (void *)(uintptr_t)s->dptr;
}

void sp_gpu_hstage_chain(sp_gpu_hstage_t *s, sp_gpu_hstage_t **list)
{
    s->next = *list;
    *list = s;
}

void sp_gpu_hstage_put(sp_gpu_hstage_t *list)
{
    while (list != NULL) {
        sp_gpu_hstage_t *s = list;
        list = s->next;
        s->next = hstage_free;
        hstage_free = s;
    }
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

void sp_gpu_probe(sp_devices_t *d)
{
    d->gpu_count = 0;
    snprintf(d->gpu_status, sizeof d->gpu_status, "built without CUDA");
}


static spc_status_t no_cuda(sp_err_t *e)
{
    return sp_err_set(e, SPC_ERR_NO_DEVICE, "spd was built without CUDA");
}

spc_status_t sp_gpu_copy(int dev, void *dst, const void *src, uint64_t n, sp_err_t *e)
{
    return no_cuda(e);
}

spc_status_t sp_gpu_allreduce(int dev, void *const *dst, const void *const *src, uint32_t nranks, uint64_t n,
                              unsigned dtype, unsigned redop, sp_err_t *e)
{
    return no_cuda(e);
}

spc_status_t sp_gpu_a2a(int dev, void *dst, const void *const *src, const sp_kern_a2a_desc_t *d, uint32_t rank,
                        sp_err_t *e)
{
    return no_cuda(e);
}

spc_status_t sp_gpu_stream_device(const char *pci_bus_id, const uint8_t *uuid, int client_ordinal, int *dev_p,
                                  sp_err_t *e)
{
    return sp_err_set(e, SPC_ERR_NO_DEVICE, "spd cannot order ops on GPU streams: it was built without CUDA");
}

/* Without a device no stream, task or mark ever exists: these are never reached. */
spc_status_t sp_gpu_host_register(int dev, void *p, size_t n, uint64_t *dptr_p, sp_err_t *e)
{
    return no_cuda(e);
}
void sp_gpu_host_unregister(void *p) {}
spc_status_t sp_gpu_wait_value(int dev, uint64_t dptr, uint64_t v, sp_err_t *e)
{
    return no_cuda(e);
}
spc_status_t sp_gpu_write_value(int dev, uint64_t dptr, uint64_t v, sp_err_t *e)
{
    return no_cuda(e);
}
spc_status_t sp_gpu_mark(int dev, sp_gpu_mark_t **mark_p, sp_err_t *e)
{
    return no_cuda(e);
}
int sp_gpu_mark_done(sp_gpu_mark_t *mark, sp_err_t *e)
{
    return no_cuda(e);
}
void sp_gpu_mark_free(sp_gpu_mark_t *mark) {}
spc_status_t sp_gpu_lane_open(int dev, sp_gpu_lane_t **lane_p, sp_err_t *e)
{
    return no_cuda(e);
}
void sp_gpu_lane_close(sp_gpu_lane_t *lane) {}
void sp_gpu_use_lane(int dev, sp_gpu_lane_t *lane) {}
void *sp_gpu_lane_stream(const sp_gpu_lane_t *lane) { return NULL; }
int sp_gpu_lane_idle(const sp_gpu_lane_t *lane, sp_err_t *e)
{
    return no_cuda(e);
}
spc_status_t sp_gpu_copy_in(int dev, void *dst, const void *src, size_t n, sp_err_t *e)
{
    return no_cuda(e);
}
spc_status_t sp_gpu_copy_out(int dev, void *dst, const void *src, size_t n, sp_err_t *e)
{
    return no_cuda(e);
}
spc_status_t sp_gpu_pinned_alloc(size_t bytes, void **p_p, sp_err_t *e)
{
    return no_cuda(e);
}
spc_status_t sp_gpu_wait_mark(int dev, sp_gpu_mark_t *mark, sp_err_t *e)
{
    return no_cuda(e);
}

spc_status_t sp_gpu_use(int dev, sp_err_t *e)
{
    return no_cuda(e);
}
spc_status_t sp_gpu_stage_get(int dev, uint64_t bytes, sp_gpu_stage_t **s_p, sp_err_t *e)
{
    return no_cuda(e);
}
void *sp_gpu_stage_ptr(const sp_gpu_stage_t *s) { return NULL; }
void sp_gpu_stage_put(sp_gpu_stage_t *s) {}
void sp_gpu_stage_limit(uint64_t bytes) {}
void sp_gpu_lane_limit(int lanes) {}
void sp_gpu_lane_counts(uint64_t *open, uint64_t *most, uint64_t *refused)
{
    *open = *most = *refused = 0;
}
bool sp_gpu_can_reach(int from, int to) { return from == to; }
spc_status_t sp_gpu_hstage_get(uint64_t bytes, sp_gpu_hstage_t **s_p, sp_err_t *e)
{
    return no_cuda(e);
}
void sp_gpu_hstage_limit(uint64_t bytes) {}
const char *sp_gpu_fault(int dev) { return NULL; }
void *sp_gpu_hstage_ptr(const sp_gpu_hstage_t *s) { return NULL; }
void sp_gpu_hstage_chain(sp_gpu_hstage_t *s, sp_gpu_hstage_t **list) {}
void sp_gpu_hstage_put(sp_gpu_hstage_t *list) {}

#endif /* SP_HAVE_CUDA */
