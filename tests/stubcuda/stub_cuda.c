/*
 * stub_cuda.c — libcuda.so.1 without a GPU, for tests (see stub_cuda.h).
 *
 * One device (ordinal 0, PCI 0000:ff:00.0), or N with SPD_STUB_CUDA_GPUS=N
 * (at most STUB_MAX_GPUS): device i at PCI 0000:(ff - i):00.0, its UUID that
 * of device 0 with the last byte xor i. Peer access between devices is what
 * SPD_STUB_CUDA_P2P lists, pairs joined by commas, both directions each:
 * "A=B" is NVLink (peer access, native atomics, performance rank 0), "A-B" is
 * PCIe (peer access, no native atomics, performance rank 1); other pairs have
 * no peer access. So "0=1,2=3,1-2" is two NVLink pairs joined over PCIe by 1
 * and 2.
 * With SPD_STUB_CUDA_MIG=1 the devices are MIG instances of one board: every
 * one has device 0's PCI bus id (cuDeviceGetByPCIBusId finds device 0), their
 * UUIDs stay apart.
 *
 * Device memory is host memory that belongs to a device, shared between
 * processes through memfds, so that what one process writes another reads:
 *
 *   - cuMem: a reservation is PROT_NONE address space; an allocation is a
 *     memfd of its size on the device its properties name, with a tag unique
 *     across processes (pid and a counter) in the memfd's name, its requested
 *     handle types and a reference count (its handle, each retain, each
 *     mapping, each import); a mapping puts the memfd at an address of a
 *     reservation (MAP_SHARED), with a buffer id never reused in the process,
 *     and the devices cuMemSetAccess let at it; the MEMORY_BLOCK_ID attribute
 *     is the allocation's tag; an export is a descriptor of the memfd, and an
 *     import reads the tag, device and size back, so the importer's records
 *     name the exporter's allocation;
 *   - cuMemAlloc: a memfd mapped at once, on the current context's device; its
 *     IPC handle names the exporting process and descriptor, and opening it
 *     maps the same memfd in the opener.
 *
 * Contexts are the devices' primary ones. A stream belongs to the device of
 * the context current when it was made; a thread of its own runs what is
 * enqueued in order: waits on and writes of 64-bit values, event records,
 * waits for events (of any device's stream), host functions. A kernel is a
 * host function launched with stub_launch, naming the device memory it
 * touches: it is refused, loudly (the log and CUDA_ERROR_ILLEGAL_ADDRESS),
 * where the stream's device may not reach that memory: cuMem memory without
 * cuMemSetAccess for that device, cudaMalloc memory not mapped in that
 * device's context (allocated there, or an IPC handle opened there, which for
 * another device's memory takes CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS and a pair
 * SPD_STUB_CUDA_P2P joins), or memory the stub does not know; pinned host
 * memory every device reaches.
 *
 * A device fault: SPD_STUB_CUDA_FAULT="<gpu>:<n>" makes the n-th kernel
 * launched on that GPU in the process fault where its stream runs it, as an
 * illegal address does on a GPU: the error is sticky for the device's
 * context. From then its streams run nothing more (no write, no record, no
 * host function; a wait in progress is dropped), and every call on them, a
 * launch, an event query or a synchronize, returns
 * CUDA_ERROR_ILLEGAL_ADDRESS; other devices go on.
 */
#include "stub_cuda.h"

#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define MEMFD_NAME "spd-stub-cuda"

enum {
    STUB_ERROR_PEER_ACCESS_UNSUPPORTED = 217,
    STUB_ERROR_INVALID_HANDLE = 400,
    STUB_ERROR_NOT_READY = 600,
    STUB_ERROR_ILLEGAL_ADDRESS = 700,
    STUB_ATTR_CAN_USE_64_BIT_STREAM_MEM_OPS = 122,
    STUB_IPC_LAZY_ENABLE_PEER_ACCESS = 1,
};

typedef struct alloc {
    uint64_t tag;
    size_t   size;
    int      types;
    int      refs;
    int      dev;
    int      fd;          /* the memfd holding its bytes */
} alloc_t;

typedef struct mapping {
    stub_ptr_t va;
    size_t     size;
    alloc_t   *a;
    uint64_t   buffer_id;
    unsigned   access;    /* bit d: device d may read and write it */
} mapping_t;

typedef struct reservation {
    stub_ptr_t va;
    size_t     size;
    void      *raw;
    size_t     raw_size;
} reservation_t;

/* cudaMalloc-like memory: allocated here (cuMemAlloc) or opened (cuIpcOpenMemHandle),
 * mapped in one device's context: the kernels of that device reach it there. */
typedef struct devmem {
    stub_ptr_t va;
    size_t     size;
    int        dev;       /* whose memory it is */
    int        ctx_dev;   /* whose context it is mapped in */
    int        fd;        /* allocated here: its memfd, which IPC handles name; opened: -1 */
    uint64_t   buffer_id;
} devmem_t;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static mapping_t *maps;
static size_t nmaps, maps_cap;
static reservation_t *res;
static size_t nres, res_cap;
static devmem_t *dmem;
static size_t ndmem, dmem_cap;
/* Pinned host memory (cuMemHostAlloc, cuMemHostRegister): every device reaches it. */
typedef struct pinned {
    stub_ptr_t va;
    size_t     size;
} pinned_t;
static pinned_t *pins;
static size_t npins, pins_cap;
static size_t nallocs;
static uint64_t next_tag = 1, next_buffer_id = 1000;
static __thread void *current_ctx;

static void stub_log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void stub_log(const char *fmt, ...)
{
    const char *path = getenv("SPD_STUB_CUDA_LOG");
    if (path == NULL)
        return;
    char line[512];
    int n = snprintf(line, sizeof line, "%d ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof line - 2)
        n = (int)sizeof line - 2;
    line[n++] = '\n';
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0600);
    if (fd >= 0) {
        if (write(fd, line, (size_t)n) < 0) {
            /* a lost log line shows up as a test failure, not here */
        }
        close(fd);
    }
}

static stub_result_t refuse(const char *call, const char *why)
{
    stub_log("refused %s: %s", call, why);
    return STUB_ERROR_INVALID_VALUE;
}

/* Every allocation holds a memfd, and tests make a thousand chunks and more. */
__attribute__((constructor)) static void stub_init(void)
{
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
}

__attribute__((destructor)) static void stub_exit(void)
{
    stub_log("exit reservations=%zu mappings=%zu allocations=%zu", nres, nmaps, nallocs);
}

/* ------------------------------------------------------------ bookkeeping */

/* A memfd of `size` bytes named for the allocation's tag and device. */
static int memfd_new(uint64_t tag, int dev, size_t size)
{
    char name[64];
    snprintf(name, sizeof name, MEMFD_NAME ".%llu.%d", (unsigned long long)tag, dev);
    int fd = memfd_create(name, MFD_CLOEXEC);
    if (fd >= 0 && ftruncate(fd, (off_t)size) != 0) {
        close(fd);
        fd = -1;
    }
    return fd;
}

static alloc_t *alloc_new(uint64_t tag, size_t size, int types, int dev, int fd)
{
    alloc_t *a = calloc(1, sizeof *a);
    if (a == NULL)
        return NULL;
    *a = (alloc_t){ .tag = tag, .size = size, .types = types, .refs = 1, .dev = dev, .fd = fd };
    nallocs++;
    return a;
}

static void alloc_unref(alloc_t *a)
{
    if (--a->refs == 0) {
        close(a->fd);
        free(a);
        nallocs--;
    }
}

static mapping_t *map_at(stub_ptr_t p)
{
    for (size_t i = 0; i < nmaps; i++)
        if (p >= maps[i].va && p - maps[i].va < maps[i].size)
            return &maps[i];
    return NULL;
}

static reservation_t *res_at(stub_ptr_t p)
{
    for (size_t i = 0; i < nres; i++)
        if (p >= res[i].va && p - res[i].va < res[i].size)
            return &res[i];
    return NULL;
}

static pinned_t *pinned_at(stub_ptr_t p)
{
    for (size_t i = 0; i < npins; i++)
        if (p >= pins[i].va && p - pins[i].va < pins[i].size)
            return &pins[i];
    return NULL;
}

static devmem_t *dmem_at(stub_ptr_t p)
{
    for (size_t i = 0; i < ndmem; i++)
        if (p >= dmem[i].va && p - dmem[i].va < dmem[i].size)
            return &dmem[i];
    return NULL;
}

static bool grow(void **arr, size_t *cap, size_t n, size_t elem)
{
    if (n < *cap)
        return true;
    size_t c = *cap ? 2 * *cap : 64;
    void *p = realloc(*arr, c * elem);
    if (p == NULL)
        return false;
    *arr = p;
    *cap = c;
    return true;
}

/* ------------------------------------------------------------ driver, device, context */

stub_result_t cuInit(unsigned flags)
{
    return STUB_SUCCESS;
}

stub_result_t cuGetErrorString(stub_result_t rc, const char **s)
{
    switch (rc) {
    case STUB_SUCCESS: *s = "no error"; break;
    case STUB_ERROR_INVALID_VALUE: *s = "invalid argument (stub)"; break;
    case STUB_ERROR_INVALID_DEVICE: *s = "invalid device ordinal (stub)"; break;
    case STUB_ERROR_NOT_FOUND: *s = "named symbol not found (stub)"; break;
    case STUB_ERROR_NOT_SUPPORTED: *s = "operation not supported (stub)"; break;
    case STUB_ERROR_PEER_ACCESS_UNSUPPORTED: *s = "peer access is not supported between these two devices (stub)";
        break;
    case STUB_ERROR_INVALID_HANDLE: *s = "invalid resource handle (stub)"; break;
    case STUB_ERROR_NOT_READY: *s = "device not ready (stub)"; break;
    case STUB_ERROR_ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered (stub)"; break;
    default: *s = "unknown error (stub)"; break;
    }
    return STUB_SUCCESS;
}

stub_result_t cuDriverGetVersion(int *v)
{
    *v = 13000;
    return STUB_SUCCESS;
}

/* SPD_STUB_CUDA_GPUS, or 1 when unset or not a count in [1, STUB_MAX_GPUS]. */
static int gpu_count(void)
{
    const char *v = getenv("SPD_STUB_CUDA_GPUS");
    char *end;
    long n = v != NULL ? strtol(v, &end, 10) : 1;
    return v != NULL && (end == v || *end != '\0' || n < 1 || n > STUB_MAX_GPUS) ? 1 : (int)n;
}

/* The SPD_STUB_CUDA_P2P entry joining a and b: '=' (NVLink), '-' (PCIe), or 0. */
static char p2p_kind(int a, int b)
{
    const char *s = getenv("SPD_STUB_CUDA_P2P");
    while (s != NULL && *s != '\0') {
        char *end;
        long x = strtol(s, &end, 10);
        char kind = *end;
        if (end == s || (kind != '=' && kind != '-'))
            return 0;
        s = end + 1;
        long y = strtol(s, &end, 10);
        if (end == s)
            return 0;
        if ((x == a && y == b) || (x == b && y == a))
            return kind;
        s = *end == ',' ? end + 1 : end;
    }
    return 0;
}

stub_result_t cuDeviceGetCount(int *n)
{
    *n = gpu_count();
    return STUB_SUCCESS;
}

stub_result_t cuDeviceGet(int *d, int ordinal)
{
    if (ordinal < 0 || ordinal >= gpu_count())
        return STUB_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return STUB_SUCCESS;
}

stub_result_t cuDeviceCanAccessPeer(int *can, int d, int peer)
{
    if (d < 0 || d >= gpu_count() || peer < 0 || peer >= gpu_count())
        return STUB_ERROR_INVALID_DEVICE;
    *can = d != peer && p2p_kind(d, peer) != 0;
    return STUB_SUCCESS;
}

stub_result_t cuDeviceGetP2PAttribute(int *v, int attr, int src, int dst)
{
    if (src < 0 || src >= gpu_count() || dst < 0 || dst >= gpu_count() || src == dst)
        return STUB_ERROR_INVALID_DEVICE;
    char kind = p2p_kind(src, dst);
    switch (attr) {
    case STUB_P2P_PERFORMANCE_RANK: *v = kind == '-' ? 1 : 0; break;
    case STUB_P2P_ACCESS_SUPPORTED: *v = kind != 0; break;
    case STUB_P2P_NATIVE_ATOMIC_SUPPORTED: *v = kind == '='; break;
    default: return refuse("cuDeviceGetP2PAttribute", "an attribute the stub does not have");
    }
    return STUB_SUCCESS;
}

stub_result_t cuDeviceGetName(char *name, int len, int d)
{
    snprintf(name, (size_t)len, "spd test stub");
    return STUB_SUCCESS;
}

stub_result_t cuDeviceGetPCIBusId(char *bus, int len, int d)
{
    if (d < 0 || d >= gpu_count())
        return STUB_ERROR_INVALID_DEVICE;
    const char *mig = getenv("SPD_STUB_CUDA_MIG");
    snprintf(bus, (size_t)len, "0000:%02X:00.0", 0xFF - (mig != NULL && strcmp(mig, "1") == 0 ? 0 : d));
    return STUB_SUCCESS;
}

stub_result_t cuDeviceGetByPCIBusId(int *d, const char *bus)
{
    for (int i = 0; i < gpu_count(); i++) {
        char mine[16];
        cuDeviceGetPCIBusId(mine, sizeof mine, i);
        if (strcasecmp(bus, mine) == 0) {
            *d = i;
            return STUB_SUCCESS;
        }
    }
    return STUB_ERROR_INVALID_VALUE;
}

stub_result_t cuDeviceGetUuid_v2(unsigned char *uuid, int d)
{
    if (d < 0 || d >= gpu_count())
        return STUB_ERROR_INVALID_DEVICE;
    for (int i = 0; i < 16; i++)
        uuid[i] = (unsigned char)(0xA0 + i);
    uuid[15] ^= (unsigned char)d;
    return STUB_SUCCESS;
}

/* Each device's primary context: a distinct address, which cuCtxGetDevice maps back. */
static char primary_ctx[STUB_MAX_GPUS];

stub_result_t cuDevicePrimaryCtxRetain(void **ctx, int d)
{
    if (d < 0 || d >= gpu_count())
        return STUB_ERROR_INVALID_DEVICE;
    *ctx = &primary_ctx[d];
    return STUB_SUCCESS;
}

stub_result_t cuDevicePrimaryCtxRelease_v2(int d)
{
    return STUB_SUCCESS;
}

stub_result_t cuCtxGetCurrent(void **ctx)
{
    *ctx = current_ctx;
    return STUB_SUCCESS;
}

stub_result_t cuCtxSetCurrent(void *ctx)
{
    current_ctx = ctx;
    return STUB_SUCCESS;
}

/* The thread's context stack below the current one, as the driver keeps it. */
static __thread void *ctx_below[16];
static __thread int ctx_depth;

stub_result_t cuCtxPushCurrent_v2(void *ctx)
{
    if (ctx_depth == (int)(sizeof ctx_below / sizeof ctx_below[0]))
        return refuse("cuCtxPushCurrent", "the stub's context stack is full");
    ctx_below[ctx_depth++] = current_ctx;
    current_ctx = ctx;
    return STUB_SUCCESS;
}

stub_result_t cuCtxPopCurrent_v2(void **ctx)
{
    *ctx = current_ctx;
    current_ctx = ctx_depth > 0 ? ctx_below[--ctx_depth] : NULL;
    return STUB_SUCCESS;
}

/* The current context's device; device 0 when none is current. */
static int cur_dev(void)
{
    uintptr_t ctx = (uintptr_t)current_ctx, first = (uintptr_t)primary_ctx;
    return ctx >= first && ctx < first + STUB_MAX_GPUS ? (int)(ctx - first) : 0;
}

stub_result_t cuCtxGetDevice(int *d)
{
    *d = cur_dev();
    return STUB_SUCCESS;
}

/* ------------------------------------------------------------ streams and events */

typedef struct event {
    int      dev;
    uint64_t recorded;    /* records enqueued */
    uint64_t reached;     /* the last of them its stream has run */
} event_t;

enum { OP_WAIT64, OP_WRITE64, OP_RECORD, OP_WAIT_EVENT, OP_HOST, OP_FAULT };

typedef struct stream_op {
    struct stream_op *next;
    int               kind;
    stub_ptr_t        addr;
    uint64_t          v;        /* the value; for events the record waited for or reached */
    event_t          *ev;
    void            (*fn)(void *);
    void             *arg;
} stream_op_t;

typedef struct stream {
    int             dev;
    pthread_t       thread;
    stream_op_t    *head, *tail;
    uint64_t        enqueued, ran;
    bool            destroyed;   /* freed by its thread once it has run everything */
    bool            capturing;   /* between cuStreamBeginCapture and cuStreamEndCapture */
} stream_t;

/* Streams and events change under one lock; a stream's thread sleeps on `moved`,
 * which every step of every stream broadcasts (a wait for an event may be on
 * another stream's step). */
static pthread_mutex_t slock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t moved = PTHREAD_COND_INITIALIZER;

/* The sticky error of each device's context (SPD_STUB_CUDA_FAULT); 0: none. */
static int dev_fault[STUB_MAX_GPUS];

static int fault_of(int dev)
{
    return __atomic_load_n(&dev_fault[dev], __ATOMIC_ACQUIRE);
}

static void nap(void)
{
    struct timespec ts = { 0, 20000 };
    nanosleep(&ts, NULL);
}

/* Runs the stream's ops in order. A wait on a value polls host memory, which
 * another process may write; a wait for an event sleeps until its stream ran
 * that far. */
static void *stream_main(void *arg)
{
    stream_t *s = arg;
    pthread_mutex_lock(&slock);
    for (;;) {
        stream_op_t *op = s->head;
        if (op == NULL) {
            if (s->destroyed)
                break;
            pthread_cond_wait(&moved, &slock);
            continue;
        }
        switch (fault_of(s->dev) != 0 ? -1 : op->kind) {
        case -1:   /* the context failed: what is queued is dropped */
            break;
        case OP_WAIT64: {
            uint64_t *p = (uint64_t *)(uintptr_t)op->addr;
            pthread_mutex_unlock(&slock);
            while ((int64_t)(__atomic_load_n(p, __ATOMIC_ACQUIRE) - op->v) < 0 && fault_of(s->dev) == 0)
                nap();
            pthread_mutex_lock(&slock);
            break;
        }
        case OP_FAULT:
            __atomic_store_n(&dev_fault[s->dev], STUB_ERROR_ILLEGAL_ADDRESS, __ATOMIC_RELEASE);
            stub_log("fault on GPU %d: its context has a sticky error from now on", s->dev);
            fprintf(stderr, "stub_cuda: a kernel on GPU %d faulted (SPD_STUB_CUDA_FAULT)\n", s->dev);
            break;
        case OP_WRITE64:
            __atomic_store_n((uint64_t *)(uintptr_t)op->addr, op->v, __ATOMIC_RELEASE);
            break;
        case OP_RECORD:
            if (op->ev->reached < op->v)
                op->ev->reached = op->v;
            break;
        case OP_WAIT_EVENT:   /* an event of a failed device is never reached: not waited for */
            while (op->ev->reached < op->v && fault_of(op->ev->dev) == 0)
                pthread_cond_wait(&moved, &slock);
            break;
        case OP_HOST:
            pthread_mutex_unlock(&slock);
            op->fn(op->arg);
            pthread_mutex_lock(&slock);
            break;
        }
        s->head = op->next;
        if (s->head == NULL)
            s->tail = NULL;
        s->ran++;
        free(op);
        pthread_cond_broadcast(&moved);
    }
    pthread_mutex_unlock(&slock);
    free(s);
    return NULL;
}

static stub_result_t enqueue(void *stream, stream_op_t o)
{
    stream_t *s = stream;
    if (s == NULL)
        return refuse("a stream call", "the default stream: the stub has only streams made with cuStreamCreate");
    if (fault_of(s->dev) != 0)
        return fault_of(s->dev);
    stream_op_t *op = malloc(sizeof *op);
    if (op == NULL)
        return refuse("a stream call", "out of memory");
    *op = o;
    op->next = NULL;
    pthread_mutex_lock(&slock);
    if (s->tail != NULL)
        s->tail->next = op;
    else
        s->head = op;
    s->tail = op;
    s->enqueued++;
    pthread_cond_broadcast(&moved);
    pthread_mutex_unlock(&slock);
    return STUB_SUCCESS;
}

stub_result_t cuStreamCreate(void **stream, unsigned flags)
{
    stream_t *s = calloc(1, sizeof *s);
    if (s == NULL)
        return refuse("cuStreamCreate", "out of memory");
    s->dev = cur_dev();
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    int rc = pthread_create(&s->thread, &attr, stream_main, s);
    pthread_attr_destroy(&attr);
    if (rc != 0) {
        free(s);
        return refuse("cuStreamCreate", "pthread_create failed");
    }
    *stream = s;
    return STUB_SUCCESS;
}

stub_result_t cuStreamDestroy_v2(void *stream)
{
    stream_t *s = stream;
    pthread_mutex_lock(&slock);
    s->destroyed = true;   /* what is still on it runs out first */
    pthread_cond_broadcast(&moved);
    pthread_mutex_unlock(&slock);
    return STUB_SUCCESS;
}

stub_result_t cuStreamSynchronize(void *stream)
{
    stream_t *s = stream;
    if (s == NULL)
        return STUB_SUCCESS;
    pthread_mutex_lock(&slock);
    uint64_t want = s->enqueued;
    while (s->ran < want)
        pthread_cond_wait(&moved, &slock);
    pthread_mutex_unlock(&slock);
    return fault_of(s->dev);
}

/* Whether the stream has run everything enqueued on it; a failed context's
 * streams report its error. */
stub_result_t cuStreamQuery(void *stream)
{
    stream_t *s = stream;
    if (s == NULL)
        return refuse("cuStreamQuery", "the default stream: the stub has only streams made with cuStreamCreate");
    if (fault_of(s->dev) != 0)
        return fault_of(s->dev);
    pthread_mutex_lock(&slock);
    bool done = s->ran >= s->enqueued;
    pthread_mutex_unlock(&slock);
    return done ? STUB_SUCCESS : STUB_ERROR_NOT_READY;
}

stub_result_t cuStreamGetCtx(void *stream, void **ctx)
{
    if (stream == NULL)
        return STUB_ERROR_INVALID_HANDLE;
    *ctx = &primary_ctx[((stream_t *)stream)->dev];
    return STUB_SUCCESS;
}

/* Graph capture, as far as a client can see it: whether a stream captures. */
stub_result_t cuStreamBeginCapture_v2(void *stream, int mode)
{
    if (stream == NULL)
        return STUB_ERROR_INVALID_HANDLE;
    ((stream_t *)stream)->capturing = true;
    return STUB_SUCCESS;
}

stub_result_t cuStreamEndCapture(void *stream, void **graph)
{
    if (stream == NULL || !((stream_t *)stream)->capturing)
        return STUB_ERROR_INVALID_HANDLE;
    ((stream_t *)stream)->capturing = false;
    *graph = NULL;   /* the stub keeps no graph */
    return STUB_SUCCESS;
}

stub_result_t cuStreamIsCapturing(void *stream, int *status)
{
    *status = stream != NULL && ((stream_t *)stream)->capturing;   /* CU_STREAM_CAPTURE_STATUS_ACTIVE: 1 */
    return STUB_SUCCESS;
}

stub_result_t cuStreamWaitValue64_v2(void *stream, stub_ptr_t addr, unsigned long long v, unsigned flags)
{
    if (flags != 0)   /* CU_STREAM_WAIT_VALUE_GEQ */
        return refuse("cuStreamWaitValue64", "a comparison other than GEQ");
    return enqueue(stream, (stream_op_t){ .kind = OP_WAIT64, .addr = addr, .v = v });
}

stub_result_t cuStreamWriteValue64_v2(void *stream, stub_ptr_t addr, unsigned long long v, unsigned flags)
{
    return enqueue(stream, (stream_op_t){ .kind = OP_WRITE64, .addr = addr, .v = v });
}

stub_result_t cuLaunchHostFunc(void *stream, void (*fn)(void *), void *arg)
{
    return enqueue(stream, (stream_op_t){ .kind = OP_HOST, .fn = fn, .arg = arg });
}

stub_result_t cuEventCreate(void **event, unsigned flags)
{
    event_t *ev = calloc(1, sizeof *ev);
    if (ev == NULL)
        return refuse("cuEventCreate", "out of memory");
    ev->dev = cur_dev();
    *event = ev;
    return STUB_SUCCESS;
}

stub_result_t cuEventRecord(void *event, void *stream)
{
    event_t *ev = event;
    if (stream == NULL || ((stream_t *)stream)->dev != ev->dev)
        return refuse("cuEventRecord", "the event and the stream are of different devices");
    pthread_mutex_lock(&slock);
    uint64_t gen = ++ev->recorded;
    pthread_mutex_unlock(&slock);
    return enqueue(stream, (stream_op_t){ .kind = OP_RECORD, .ev = ev, .v = gen });
}

stub_result_t cuEventQuery(void *event)
{
    event_t *ev = event;
    if (fault_of(ev->dev) != 0)
        return fault_of(ev->dev);
    pthread_mutex_lock(&slock);
    bool done = ev->reached >= ev->recorded;
    pthread_mutex_unlock(&slock);
    return done ? STUB_SUCCESS : STUB_ERROR_NOT_READY;
}

stub_result_t cuEventDestroy_v2(void *event)
{
    free(event);
    return STUB_SUCCESS;
}

/* Waits for the event's latest record, whatever device's stream it is on. */
stub_result_t cuStreamWaitEvent(void *stream, void *event, unsigned flags)
{
    event_t *ev = event;
    pthread_mutex_lock(&slock);
    uint64_t gen = ev->recorded;
    pthread_mutex_unlock(&slock);
    return gen == 0 ? STUB_SUCCESS : enqueue(stream, (stream_op_t){ .kind = OP_WAIT_EVENT, .ev = ev, .v = gen });
}

/* ------------------------------------------------------------ kernels */

/* Whether device dev may touch [p, p + n): every byte in memory it reaches. */
static bool reaches(int dev, stub_ptr_t p, size_t n, char *why, size_t len)
{
    stub_ptr_t at = p, end = p + n;
    while (at < end) {
        const mapping_t *m = map_at(at);
        const devmem_t *d = m == NULL ? dmem_at(at) : NULL;
        const pinned_t *h = m == NULL && d == NULL ? pinned_at(at) : NULL;
        if (h != NULL) {
            at = h->va + h->size;
            continue;
        }
        if (m != NULL && !(m->access & (1u << dev))) {
            snprintf(why, len, "cuMem memory of GPU %d at 0x%llx without cuMemSetAccess for GPU %d", m->a->dev, at,
                     dev);
            return false;
        }
        if (d != NULL && d->ctx_dev != dev) {
            snprintf(why, len, "GPU %d's memory at 0x%llx, mapped in GPU %d's context, not opened in GPU %d's",
                     d->dev, at, d->ctx_dev, dev);
            return false;
        }
        if (m == NULL && d == NULL) {
            snprintf(why, len, "0x%llx, which is no device memory the stub knows", at);
            return false;
        }
        at = m != NULL ? m->va + m->size : d->va + d->size;
    }
    return true;
}

/* A slow device: SPD_STUB_CUDA_SLOW="<gpu>:<microseconds>" makes each kernel
 * there wait that long before it touches memory, so that a GPU still reading
 * while another finished shows in a test. */
static void slow_run(void *arg)
{
    long us = (long)(intptr_t)arg;
    struct timespec ts = { us / 1000000, (us % 1000000) * 1000 };
    nanosleep(&ts, NULL);
}

static long slow_us(int dev)
{
    const char *v = getenv("SPD_STUB_CUDA_SLOW");
    int gpu;
    long us;
    return v != NULL && sscanf(v, "%d:%ld", &gpu, &us) == 2 && gpu == dev && us > 0 ? us : 0;
}

/* Whether this launch on dev is the one SPD_STUB_CUDA_FAULT names. */
static bool launch_faults(int dev)
{
    static unsigned long launches[STUB_MAX_GPUS];
    const char *v = getenv("SPD_STUB_CUDA_FAULT");
    int gpu;
    unsigned long n;
    unsigned long k = __atomic_add_fetch(&launches[dev], 1, __ATOMIC_RELAXED);
    return v != NULL && sscanf(v, "%d:%lu", &gpu, &n) == 2 && gpu == dev && k == n;
}

stub_result_t stub_launch(void *stream, const char *what, const stub_touch_t *touch, size_t ntouch,
                          void (*fn)(void *), void *arg)
{
    const stream_t *s = stream;
    if (s == NULL)
        return refuse(what, "the default stream");
    if (fault_of(s->dev) != 0)
        return fault_of(s->dev);
    if (launch_faults(s->dev)) {
        stub_log("%s on GPU %d will fault (SPD_STUB_CUDA_FAULT)", what, s->dev);
        free(arg);   /* fn never runs (stub_cuda.h) */
        return enqueue(stream, (stream_op_t){ .kind = OP_FAULT });
    }
    char why[160];
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < ntouch; i++) {
        if (touch[i].bytes > 0 && !reaches(s->dev, touch[i].ptr, touch[i].bytes, why, sizeof why)) {
            pthread_mutex_unlock(&lock);
            stub_log("refused %s on GPU %d: it touches %s", what, s->dev, why);
            fprintf(stderr, "stub_cuda: %s on GPU %d touches %s\n", what, s->dev, why);
            return STUB_ERROR_ILLEGAL_ADDRESS;
        }
    }
    pthread_mutex_unlock(&lock);
    long us = slow_us(s->dev);
    stub_result_t rc = us > 0 ? cuLaunchHostFunc(stream, slow_run, (void *)(intptr_t)us) : STUB_SUCCESS;
    return rc == STUB_SUCCESS ? cuLaunchHostFunc(stream, fn, arg) : rc;
}

/* Copies between host and device memory, in stream order: a kernel touching
 * the device side, so a device the stream's cannot reach is refused as any
 * kernel's access is. The host side is read or written when the stream gets
 * there, as with pinned memory (what spd copies from and to); the stub does
 * not model the staging a real driver does for pageable memory. */
typedef struct copy {
    void       *dst;
    const void *src;
    size_t      n;
} copy_t;

static void copy_run(void *arg)
{
    copy_t *c = arg;
    memcpy(c->dst, c->src, c->n);
    free(c);
}

static stub_result_t copy_async(const char *what, void *dst, const void *src, size_t n, stub_ptr_t dev_side,
                                void *stream)
{
    copy_t *c = malloc(sizeof *c);
    if (c == NULL)
        return refuse(what, "out of memory");
    *c = (copy_t){ .dst = dst, .src = src, .n = n };
    stub_touch_t t = { dev_side, n };
    stub_result_t rc = stub_launch(stream, what, &t, 1, copy_run, c);
    if (rc != STUB_SUCCESS)
        free(c);
    return rc;
}

stub_result_t cuMemcpyHtoDAsync_v2(stub_ptr_t dst, const void *src, size_t n, void *stream)
{
    return copy_async("cuMemcpyHtoDAsync", (void *)(uintptr_t)dst, src, n, dst, stream);
}

stub_result_t cuMemcpyDtoHAsync_v2(void *dst, stub_ptr_t src, size_t n, void *stream)
{
    return copy_async("cuMemcpyDtoHAsync", dst, (const void *)(uintptr_t)src, n, src, stream);
}

/* ------------------------------------------------------------ cudaMalloc memory and CUDA IPC */

typedef struct stub_ipc_handle {
    char reserved[64];
} stub_ipc_handle_t;

/* What an IPC handle holds: the exporter's pid and memfd, and the memory's facts. */
typedef struct ipc_body {
    uint32_t magic;
    int32_t  pid, fd, dev;
    uint64_t size, buffer_id;
} ipc_body_t;

#define IPC_MAGIC 0x5bd1c0deu

static stub_result_t dmem_add(stub_ptr_t va, size_t size, int dev, int fd, uint64_t buffer_id)
{
    pthread_mutex_lock(&lock);
    bool ok = grow((void **)&dmem, &dmem_cap, ndmem, sizeof *dmem);
    if (ok)
        dmem[ndmem++] = (devmem_t){ .va = va, .size = size, .dev = dev, .ctx_dev = cur_dev(), .fd = fd,
                                    .buffer_id = buffer_id };
    pthread_mutex_unlock(&lock);
    return ok ? STUB_SUCCESS : refuse("cuMemAlloc", "out of memory");
}

/* Takes the memory at va out of the books; its memfd (if any) into *fd_p. */
static bool dmem_remove(stub_ptr_t va, size_t *size_p, int *fd_p)
{
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < ndmem; i++) {
        if (dmem[i].va == va) {
            *size_p = dmem[i].size;
            *fd_p = dmem[i].fd;
            dmem[i] = dmem[--ndmem];
            pthread_mutex_unlock(&lock);
            return true;
        }
    }
    pthread_mutex_unlock(&lock);
    return false;
}

stub_result_t cuMemAlloc_v2(stub_ptr_t *ptr, size_t size)
{
    if (size == 0)
        return refuse("cuMemAlloc", "no bytes");
    size = (size + 4095) / 4096 * 4096;
    pthread_mutex_lock(&lock);
    uint64_t tag = ((uint64_t)getpid() << 24) | next_tag++, id = next_buffer_id++;
    pthread_mutex_unlock(&lock);
    int dev = cur_dev(), fd = memfd_new(tag, dev, size);
    void *p = fd >= 0 ? mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (p == MAP_FAILED) {
        if (fd >= 0)
            close(fd);
        return refuse("cuMemAlloc", "memfd or mmap failed");
    }
    *ptr = (stub_ptr_t)(uintptr_t)p;
    return dmem_add(*ptr, size, dev, fd, id);
}

stub_result_t cuMemFree_v2(stub_ptr_t ptr)
{
    size_t size;
    int fd;
    if (!dmem_remove(ptr, &size, &fd) || fd < 0)
        return refuse("cuMemFree", "not an allocation of cuMemAlloc");
    munmap((void *)(uintptr_t)ptr, size);
    close(fd);
    return STUB_SUCCESS;
}

stub_result_t cuIpcGetMemHandle(stub_ipc_handle_t *h, stub_ptr_t p)
{
    pthread_mutex_lock(&lock);
    const devmem_t *d = dmem_at(p);
    ipc_body_t b = { 0 };
    if (d != NULL && d->va == p && d->fd >= 0)
        b = (ipc_body_t){ .magic = IPC_MAGIC, .pid = (int32_t)getpid(), .fd = d->fd, .dev = d->dev, .size = d->size,
                          .buffer_id = d->buffer_id };
    pthread_mutex_unlock(&lock);
    if (b.magic == 0)
        return refuse("cuIpcGetMemHandle", "not the base of an allocation of cuMemAlloc");
    memset(h, 0, sizeof *h);
    memcpy(h->reserved, &b, sizeof b);
    return STUB_SUCCESS;
}

/* Maps the exporter's memfd (through /proc, as the same user) at an address of
 * this process's, in the current context; in a context of another device than
 * the memory's only with lazy peer access, and only where the two have it. */
stub_result_t cuIpcOpenMemHandle_v2(stub_ptr_t *ptr, stub_ipc_handle_t h, unsigned flags)
{
    ipc_body_t b;
    char path[64];
    memcpy(&b, h.reserved, sizeof b);
    if (b.magic != IPC_MAGIC)
        return refuse("cuIpcOpenMemHandle", "not a handle of the stub's");
    int dev = cur_dev();
    if (dev != b.dev) {
        if (!(flags & STUB_IPC_LAZY_ENABLE_PEER_ACCESS) || p2p_kind(dev, b.dev) == 0) {
            stub_log("refused cuIpcOpenMemHandle: GPU %d's memory in GPU %d's context without peer access", b.dev,
                     dev);
            return STUB_ERROR_PEER_ACCESS_UNSUPPORTED;
        }
    }
    snprintf(path, sizeof path, "/proc/%d/fd/%d", (int)b.pid, (int)b.fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    void *p = fd >= 0 ? mmap(NULL, b.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0) : MAP_FAILED;
    if (fd >= 0)
        close(fd);
    if (p == MAP_FAILED)
        return refuse("cuIpcOpenMemHandle", "the exporter's memfd cannot be opened");
    *ptr = (stub_ptr_t)(uintptr_t)p;
    stub_log("ipc open gpu%d size=%llu in gpu%d", (int)b.dev, (unsigned long long)b.size, dev);
    return dmem_add(*ptr, b.size, b.dev, -1, b.buffer_id);
}

stub_result_t cuIpcCloseMemHandle(stub_ptr_t p)
{
    size_t size;
    int fd;
    if (!dmem_remove(p, &size, &fd) || fd >= 0)
        return refuse("cuIpcCloseMemHandle", "not an opened IPC mapping");
    munmap((void *)(uintptr_t)p, size);
    stub_log("ipc close size=%zu", size);
    return STUB_SUCCESS;
}

/* ------------------------------------------------------------ device attributes, host memory */

/* Every device can wait on and write 64-bit values; nothing else is asked. */
stub_result_t cuDeviceGetAttribute(int *v, int attr, int d)
{
    *v = attr == STUB_ATTR_CAN_USE_64_BIT_STREAM_MEM_OPS;
    return STUB_SUCCESS;
}

/* Pinned host memory is reached at its own address from every device. */
static stub_result_t pin(void *p, size_t n)
{
    pthread_mutex_lock(&lock);
    bool ok = grow((void **)&pins, &pins_cap, npins, sizeof *pins);
    if (ok)
        pins[npins++] = (pinned_t){ .va = (stub_ptr_t)(uintptr_t)p, .size = n };
    pthread_mutex_unlock(&lock);
    return ok ? STUB_SUCCESS : refuse("cuMemHostRegister", "out of memory");
}

stub_result_t cuMemHostRegister_v2(void *p, size_t n, unsigned flags)
{
    return pin(p, n);
}

stub_result_t cuMemHostUnregister(void *p)
{
    pthread_mutex_lock(&lock);
    pinned_t *h = pinned_at((stub_ptr_t)(uintptr_t)p);
    if (h != NULL)
        *h = pins[--npins];
    pthread_mutex_unlock(&lock);
    return h != NULL ? STUB_SUCCESS : refuse("cuMemHostUnregister", "not registered");
}

stub_result_t cuMemHostAlloc(void **p, size_t n, unsigned flags)
{
    void *m = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return refuse("cuMemHostAlloc", "mmap failed");
    *p = m;
    stub_log("host alloc size=%zu", n);
    return pin(m, n);
}

stub_result_t cuMemHostGetDevicePointer_v2(stub_ptr_t *dptr, void *p, unsigned flags)
{
    *dptr = (stub_ptr_t)(uintptr_t)p;
    return STUB_SUCCESS;
}

/* ------------------------------------------------------------ pointers */

stub_result_t cuPointerGetAttributes(unsigned n, int *attrs, void **data, stub_ptr_t p)
{
    pthread_mutex_lock(&lock);
    const mapping_t *m = map_at(p);
    const reservation_t *r = res_at(p);
    const devmem_t *d = dmem_at(p);
    /* A reservation with nothing mapped there is device 0's, as the driver
     * says of the reservation's location. */
    int dev = m ? m->a->dev : d ? d->dev : r ? 0 : -1;
    stub_result_t rc = STUB_SUCCESS;
    for (unsigned i = 0; i < n && rc == STUB_SUCCESS; i++) {
        switch (attrs[i]) {
        case 2: *(unsigned *)data[i] = r || d ? 2 : 0; break;                           /* MEMORY_TYPE */
        case 7: *(unsigned long long *)data[i] = m ? m->buffer_id : d ? d->buffer_id : 0; break; /* BUFFER_ID */
        case 8: *(int *)data[i] = 0; break;                                              /* IS_MANAGED */
        case 9: *(int *)data[i] = dev; break;                                            /* DEVICE_ORDINAL */
        case 10: *(int *)data[i] = d != NULL; break;                                     /* IS_LEGACY_IPC */
        case 11: *(stub_ptr_t *)data[i] = r ? r->va : d ? d->va : 0; break;              /* RANGE_START */
        case 12: *(size_t *)data[i] = r ? r->size : d ? d->size : 0; break;              /* RANGE_SIZE */
        case 13: *(int *)data[i] = m != NULL || d != NULL; break;                        /* MAPPED */
        case STUB_ATTR_MEMORY_BLOCK_ID: *(unsigned long long *)data[i] = m ? m->a->tag : 0; break;
        default: rc = refuse("cuPointerGetAttributes", "an attribute the stub does not have"); break;
        }
    }
    pthread_mutex_unlock(&lock);
    return rc;
}

stub_result_t cuMemGetAddressRange_v2(stub_ptr_t *base, size_t *size, stub_ptr_t p)
{
    pthread_mutex_lock(&lock);
    const mapping_t *m = map_at(p);
    if (m != NULL) {
        *base = m->va;
        *size = m->size;
    }
    pthread_mutex_unlock(&lock);
    return m != NULL ? STUB_SUCCESS : STUB_ERROR_NOT_FOUND;
}

/* ------------------------------------------------------------ cuMem */

stub_result_t cuMemGetAllocationGranularity(size_t *g, const stub_mem_prop_t *prop, int option)
{
    if (prop->location.id < 0 || prop->location.id >= gpu_count())
        return refuse("cuMemGetAllocationGranularity", "no such device");
    *g = STUB_GRANULARITY;
    return STUB_SUCCESS;
}

stub_result_t cuMemAddressReserve(stub_ptr_t *ptr, size_t size, size_t alignment, stub_ptr_t addr,
                                  unsigned long long flags)
{
    if (size == 0 || size % 4096 != 0 || (alignment & (alignment - 1)) != 0)
        return refuse("cuMemAddressReserve", "size not a page multiple, or alignment not a power of two");
    size_t align = alignment > STUB_GRANULARITY ? alignment : STUB_GRANULARITY;
    size_t raw_size = size + align;
    void *raw = mmap(NULL, raw_size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (raw == MAP_FAILED)
        return refuse("cuMemAddressReserve", "mmap failed");
    pthread_mutex_lock(&lock);
    if (!grow((void **)&res, &res_cap, nres, sizeof *res)) {
        pthread_mutex_unlock(&lock);
        munmap(raw, raw_size);
        return refuse("cuMemAddressReserve", "out of memory");
    }
    stub_ptr_t va = ((stub_ptr_t)(uintptr_t)raw + align - 1) / align * align;
    res[nres++] = (reservation_t){ .va = va, .size = size, .raw = raw, .raw_size = raw_size };
    pthread_mutex_unlock(&lock);
    *ptr = va;
    return STUB_SUCCESS;
}

stub_result_t cuMemAddressFree(stub_ptr_t ptr, size_t size)
{
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < nres; i++) {
        if (res[i].va != ptr)
            continue;
        if (res[i].size != size) {
            pthread_mutex_unlock(&lock);
            return refuse("cuMemAddressFree", "not the size reserved");
        }
        for (size_t j = 0; j < nmaps; j++) {
            if (maps[j].va >= ptr && maps[j].va - ptr < size) {
                pthread_mutex_unlock(&lock);
                return refuse("cuMemAddressFree", "the reservation still has mappings");
            }
        }
        munmap(res[i].raw, res[i].raw_size);
        res[i] = res[--nres];
        pthread_mutex_unlock(&lock);
        stub_log("addrfree size=%zu", size);
        return STUB_SUCCESS;
    }
    pthread_mutex_unlock(&lock);
    return refuse("cuMemAddressFree", "no reservation starts there");
}

stub_result_t cuMemCreate(stub_mem_t *handle, size_t size, const stub_mem_prop_t *prop, unsigned long long flags)
{
    if (size == 0 || size % STUB_GRANULARITY != 0 || prop->location.type != 1 || prop->location.id < 0 ||
        prop->location.id >= gpu_count())
        return refuse("cuMemCreate", "size not a granularity multiple, or not a device");
    pthread_mutex_lock(&lock);
    uint64_t tag = ((uint64_t)getpid() << 24) | next_tag++;
    pthread_mutex_unlock(&lock);
    int fd = memfd_new(tag, prop->location.id, size);
    if (fd < 0)
        return refuse("cuMemCreate", "memfd_create failed");
    pthread_mutex_lock(&lock);
    alloc_t *a = alloc_new(tag, size, prop->requested_handle_types, prop->location.id, fd);
    pthread_mutex_unlock(&lock);
    if (a == NULL) {
        close(fd);
        return refuse("cuMemCreate", "out of memory");
    }
    *handle = (stub_mem_t)(uintptr_t)a;
    return STUB_SUCCESS;
}

stub_result_t cuMemRelease(stub_mem_t handle)
{
    pthread_mutex_lock(&lock);
    alloc_unref((alloc_t *)(uintptr_t)handle);
    pthread_mutex_unlock(&lock);
    return STUB_SUCCESS;
}

stub_result_t cuMemRetainAllocationHandle(stub_mem_t *handle, void *addr)
{
    pthread_mutex_lock(&lock);
    mapping_t *m = map_at((stub_ptr_t)(uintptr_t)addr);
    if (m != NULL) {
        m->a->refs++;
        *handle = (stub_mem_t)(uintptr_t)m->a;
    }
    pthread_mutex_unlock(&lock);
    return m != NULL ? STUB_SUCCESS : refuse("cuMemRetainAllocationHandle", "not mapped");
}

stub_result_t cuMemGetAllocationPropertiesFromHandle(stub_mem_prop_t *prop, stub_mem_t handle)
{
    const alloc_t *a = (const alloc_t *)(uintptr_t)handle;
    memset(prop, 0, sizeof *prop);
    prop->type = 1;   /* PINNED */
    prop->requested_handle_types = a->types;
    prop->location.type = 1;
    prop->location.id = a->dev;
    return STUB_SUCCESS;
}

stub_result_t cuMemExportToShareableHandle(void *shareable, stub_mem_t handle, int type, unsigned long long flags)
{
    const alloc_t *a = (const alloc_t *)(uintptr_t)handle;
    if (type != STUB_HANDLE_POSIX_FD || !(a->types & STUB_HANDLE_POSIX_FD))
        return refuse("cuMemExportToShareableHandle", "not created with the POSIX descriptor handle type");
    int fd = fcntl(a->fd, F_DUPFD_CLOEXEC, 0);
    if (fd < 0)
        return refuse("cuMemExportToShareableHandle", "cannot duplicate the memfd");
    *(int *)shareable = fd;
    return STUB_SUCCESS;
}

stub_result_t cuMemImportFromShareableHandle(stub_mem_t *handle, void *os_handle, int type)
{
    int fd = (int)(intptr_t)os_handle;
    char link[64], target[128];
    struct stat st;
    unsigned long long tag = 0;
    int dev = -1;
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (type != STUB_HANDLE_POSIX_FD || n <= 0)
        return refuse("cuMemImportFromShareableHandle", "not a descriptor");
    target[n] = '\0';
    const char *name = strstr(target, "memfd:" MEMFD_NAME ".");
    if (name == NULL || sscanf(name, "memfd:" MEMFD_NAME ".%llu.%d", &tag, &dev) != 2)
        return refuse("cuMemImportFromShareableHandle", "not a descriptor the stub exported");
    int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (fstat(fd, &st) != 0 || own < 0) {
        if (own >= 0)
            close(own);
        return refuse("cuMemImportFromShareableHandle", "cannot read the memfd");
    }
    pthread_mutex_lock(&lock);
    alloc_t *a = alloc_new(tag, (size_t)st.st_size, STUB_HANDLE_POSIX_FD, dev, own);
    pthread_mutex_unlock(&lock);
    if (a == NULL) {
        close(own);
        return refuse("cuMemImportFromShareableHandle", "out of memory");
    }
    stub_log("import tag=%llu size=%zu", (unsigned long long)tag, a->size);
    *handle = (stub_mem_t)(uintptr_t)a;
    return STUB_SUCCESS;
}

stub_result_t cuMemMap(stub_ptr_t ptr, size_t size, size_t offset, stub_mem_t handle, unsigned long long flags)
{
    alloc_t *a = (alloc_t *)(uintptr_t)handle;
    if (offset != 0 || size == 0 || size % STUB_GRANULARITY != 0 || ptr % STUB_GRANULARITY != 0 || size > a->size)
        return refuse("cuMemMap", "offset not 0, or size or address not aligned, or larger than the allocation");
    pthread_mutex_lock(&lock);
    const reservation_t *r = res_at(ptr);
    if (r == NULL || size > r->size - (ptr - r->va)) {
        pthread_mutex_unlock(&lock);
        return refuse("cuMemMap", "not inside one reservation");
    }
    for (size_t i = 0; i < nmaps; i++) {
        if (ptr < maps[i].va + maps[i].size && maps[i].va < ptr + size) {
            pthread_mutex_unlock(&lock);
            return refuse("cuMemMap", "already mapped");
        }
    }
    if (!grow((void **)&maps, &maps_cap, nmaps, sizeof *maps)) {
        pthread_mutex_unlock(&lock);
        return refuse("cuMemMap", "out of memory");
    }
    if (mmap((void *)(uintptr_t)ptr, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, a->fd, 0) == MAP_FAILED) {
        pthread_mutex_unlock(&lock);
        return refuse("cuMemMap", "mmap of the allocation's memfd failed");
    }
    a->refs++;
    maps[nmaps++] = (mapping_t){ .va = ptr, .size = size, .a = a, .buffer_id = next_buffer_id++ };
    stub_ptr_t off = ptr - r->va;
    pthread_mutex_unlock(&lock);
    stub_log("map tag=%llu at=%llu size=%zu", (unsigned long long)a->tag, off, size);
    return STUB_SUCCESS;
}

stub_result_t cuMemUnmap(stub_ptr_t ptr, size_t size)
{
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < nmaps; i++) {
        if (maps[i].va != ptr)
            continue;
        if (maps[i].size != size) {
            pthread_mutex_unlock(&lock);
            return refuse("cuMemUnmap", "not a whole mapping");
        }
        const reservation_t *r = res_at(ptr);
        unsigned long long tag = maps[i].a->tag, off = r ? ptr - r->va : 0;
        /* The reservation's address space again, nothing behind it. */
        mmap((void *)(uintptr_t)ptr, size, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
        alloc_unref(maps[i].a);
        maps[i] = maps[--nmaps];
        pthread_mutex_unlock(&lock);
        stub_log("unmap tag=%llu at=%llu", tag, off);
        return STUB_SUCCESS;
    }
    pthread_mutex_unlock(&lock);
    return refuse("cuMemUnmap", "no mapping starts there");
}

stub_result_t cuMemSetAccess(stub_ptr_t ptr, size_t size, const stub_access_desc_t *desc, size_t count)
{
    unsigned devs = 0;
    if (count == 0)
        return refuse("cuMemSetAccess", "no device");
    for (size_t i = 0; i < count; i++) {
        if (desc[i].location.type != 1 || desc[i].location.id < 0 || desc[i].location.id >= gpu_count() ||
            desc[i].flags != 3)
            return refuse("cuMemSetAccess", "not read/write access for a device");
        devs |= 1u << desc[i].location.id;
    }
    pthread_mutex_lock(&lock);
    /* The whole range must be mapped: walk it mapping by mapping. */
    stub_ptr_t at = ptr;
    while (at < ptr + size) {
        mapping_t *m = map_at(at);
        if (m == NULL) {
            pthread_mutex_unlock(&lock);
            return refuse("cuMemSetAccess", "part of the range is not mapped");
        }
        at = m->va + m->size;
    }
    for (at = ptr; at < ptr + size;) {
        mapping_t *m = map_at(at);
        m->access |= devs;
        at = m->va + m->size;
    }
    pthread_mutex_unlock(&lock);
    stub_log("access at=0x%llx size=%zu devices=0x%x", ptr, size, devs);
    return STUB_SUCCESS;
}
