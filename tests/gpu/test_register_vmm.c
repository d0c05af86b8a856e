/*
 * cuMem (virtual memory management) memory as device regions, through a real
 * spd, on one GPU. Memory is made as PyTorch's expandable segments make it: one
 * reserved range, physical chunks of the allocation granularity created with
 * cuMemCreate (POSIX file descriptor handles) and mapped back to back. Results
 * are compared bit for bit with references computed here on the host from
 * every rank's inputs, written out independently of spd and its kernels:
 *
 *   allreduce  fp32 sums in rank order, P = 2 and 4: send and receive ranges
 *              that each span two chunks and share one; then in place over a
 *              range spanning three;
 *   alltoall   Ulysses seq->head and back, fp32, every tensor straddling a
 *              chunk boundary, neighbours sharing chunks;
 *   refusals   a range in memory made without the POSIX descriptor handle type,
 *              alone or after an exportable chunk: SPC_ERR_UNSUPPORTED naming
 *              the handle type to set; a range running into an unmapped hole:
 *              SPC_ERR_OUT_OF_BOUNDS. No descriptor is left open in the rank,
 *              and spd goes on serving;
 *   remap      the second chunk of a registered range unmapped and replaced by
 *              new memory at the same address: registering the range again
 *              re-imports it (the stale region is gone), and the op sees the
 *              new memory;
 *   cache      one process, exact counts: a second range in the same chunk
 *              reuses its import; a range over that chunk and the next is an
 *              import of its own and leaves the first one's regions be; a
 *              chunk replaced under both makes both stale.
 *
 * Every import is closed once the ranks are gone, those of regions left
 * registered at exit included. Needs a GPU with virtual memory management and
 * POSIX descriptor handles; without one it says why and exits 77 (skipped).
 */
#include <cuda.h>
#include <dirent.h>
#include <dlfcn.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sp_gpu_regions.h"

/* ================================================================ the driver */

/* The driver API, loaded at run time as libspclient loads it: the test links no
 * libcuda, so that it starts (and skips) where there is none. */
static struct {
    __typeof__(cuGetErrorString) *error_string;
    __typeof__(cuDeviceGet) *device_get;
    __typeof__(cuDeviceGetAttribute) *device_attr;
    __typeof__(cuMemGetAllocationGranularity) *granularity;
    __typeof__(cuMemAddressReserve) *reserve;
    __typeof__(cuMemAddressFree) *addr_free;
    __typeof__(cuMemCreate) *create;
    __typeof__(cuMemRelease) *release;
    __typeof__(cuMemMap) *map;
    __typeof__(cuMemUnmap) *unmap;
    __typeof__(cuMemSetAccess) *set_access;
} drv;

/* NULL, or why the driver API cannot be had. */
static const char *drv_load(void)
{
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL)
        return "libcuda.so.1 not found";
    *(void **)&drv.error_string = dlsym(lib, "cuGetErrorString");
    *(void **)&drv.device_get = dlsym(lib, "cuDeviceGet");
    *(void **)&drv.device_attr = dlsym(lib, "cuDeviceGetAttribute");
    *(void **)&drv.granularity = dlsym(lib, "cuMemGetAllocationGranularity");
    *(void **)&drv.reserve = dlsym(lib, "cuMemAddressReserve");
    *(void **)&drv.addr_free = dlsym(lib, "cuMemAddressFree");
    *(void **)&drv.create = dlsym(lib, "cuMemCreate");
    *(void **)&drv.release = dlsym(lib, "cuMemRelease");
    *(void **)&drv.map = dlsym(lib, "cuMemMap");
    *(void **)&drv.unmap = dlsym(lib, "cuMemUnmap");
    *(void **)&drv.set_access = dlsym(lib, "cuMemSetAccess");
    for (size_t i = 0; i < sizeof drv / sizeof(void *); i++)
        if (((void **)&drv)[i] == NULL)
            return "libcuda.so.1 lacks the virtual memory management API";
    return NULL;
}

#define CU_CHECK(call)                                                                     \
    do {                                                                                   \
        CUresult r_ = (call);                                                              \
        if (r_ != CUDA_SUCCESS) {                                                          \
            const char *s_ = NULL;                                                         \
            drv.error_string(r_, &s_);                                                     \
            SP_FAIL("%s: %s (error %d)", #call, s_ ? s_ : "?", (int)r_);                   \
        }                                                                                  \
    } while (0)

/* ================================================================ cuMem memory */

#define MAX_CHUNKS 8

/* n chunks of `chunk` bytes, each its own physical allocation, mapped back to
 * back at va (device 0). */
typedef struct vmm {
    CUdeviceptr va;
    size_t      chunk, n;
    CUmemGenericAllocationHandle h[MAX_CHUNKS];
} vmm_t;

static size_t chunk_bytes;   /* the granularity, at least 2 MiB (PyTorch's small segments) */

static CUmemAllocationProp prop_of(bool exportable)
{
    CUmemAllocationProp p;
    memset(&p, 0, sizeof p);
    p.type = CU_MEM_ALLOCATION_TYPE_PINNED;
    p.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    p.location.id = 0;
    p.requestedHandleTypes = exportable ? CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR : CU_MEM_HANDLE_TYPE_NONE;
    return p;
}

/* A process's CUDA set up for the test: device 0's primary context current
 * (before any driver call), the driver API, and the chunk size. */
static void gpu_setup(void)
{
    CUDA_CHECK(cudaSetDevice(0));
    CUDA_CHECK(cudaFree(0));
    const char *why = drv_load();
    if (why != NULL)
        SP_FAIL("%s", why);
    size_t g = 0;
    CUmemAllocationProp p = prop_of(true);
    CU_CHECK(drv.granularity(&g, &p, CU_MEM_ALLOC_GRANULARITY_MINIMUM));
    CHECK(g > 0);
    chunk_bytes = ((2u << 20) + g - 1) / g * g;
}

/* Creates chunk i anew and maps it read/write at its place. */
static void chunk_map(vmm_t *m, size_t i, bool exportable)
{
    CUmemAllocationProp p = prop_of(exportable);
    CUmemAccessDesc a;
    memset(&a, 0, sizeof a);
    a.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    a.location.id = 0;
    a.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
    CU_CHECK(drv.create(&m->h[i], m->chunk, &p, 0));
    CU_CHECK(drv.map(m->va + i * m->chunk, m->chunk, 0, m->h[i], 0));
    CU_CHECK(drv.set_access(m->va + i * m->chunk, m->chunk, &a, 1));
}

/* Unmaps chunk i and frees it (in this process: spd may still hold it). */
static void chunk_unmap(vmm_t *m, size_t i)
{
    CU_CHECK(drv.unmap(m->va + i * m->chunk, m->chunk));
    CU_CHECK(drv.release(m->h[i]));
}

/* n chunks; bit i of `plain` makes chunk i without the POSIX descriptor handle
 * type, bit i of `hole` leaves it unmapped. */
static vmm_t vmm_make(size_t n, unsigned plain, unsigned hole)
{
    vmm_t m = { .chunk = chunk_bytes, .n = n };
    CHECK(n <= MAX_CHUNKS);
    CU_CHECK(drv.reserve(&m.va, n * m.chunk, m.chunk, 0, 0));
    for (size_t i = 0; i < n; i++)
        if (!(hole & (1u << i)))
            chunk_map(&m, i, !(plain & (1u << i)));
    return m;
}

static void vmm_free(vmm_t *m, unsigned hole)
{
    for (size_t i = 0; i < m->n; i++)
        if (!(hole & (1u << i)))
            chunk_unmap(m, i);
    CU_CHECK(drv.addr_free(m->va, m->n * m->chunk));
}

static void *at(const vmm_t *m, size_t off)
{
    return (void *)(uintptr_t)(m->va + off);
}

/* ================================================================ helpers */

static void check_bytes(const void *d, const void *want, size_t n, const char *what, int rank)
{
    uint8_t *got = malloc(n);
    CHECK(got != NULL);
    CUDA_CHECK(cudaMemcpy(got, d, n, cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++)
        if (got[i] != ((const uint8_t *)want)[i])
            SP_FAIL("rank %d, %s: byte %zu of %zu is 0x%02x from spd, 0x%02x from the host reference", rank, what, i,
                    n, got[i], ((const uint8_t *)want)[i]);
    free(got);
}

/* Descriptors this process has open: registration must leave none behind. */
static int fd_count(void)
{
    DIR *d = opendir("/proc/self/fd");
    CHECK(d != NULL);
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        n += e->d_name[0] != '.';
    closedir(d);
    return n - 1;   /* the directory's own */
}

/* Rank q's value i: finite, and sums that round differently in other orders. */
static float value(int q, size_t i)
{
    return (float)(((double)((i * 2654435761u + (uint64_t)q * 97u) % 100003u) - 50000.0) / 7.0);
}

/* Rank q's bytes of a tensor, by splitmix64 from a seed of its own. */
static void fill(void *p, size_t n, int q, int tag)
{
    uint64_t s = 0x9E3779B97F4A7C15ull * (uint64_t)(q + 1) + (uint64_t)tag;
    for (size_t i = 0; i < n; i++) {
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        ((uint8_t *)p)[i] = (uint8_t)(z ^ (z >> 31));
    }
}

/* ================================================================ allreduce */

/* Fills n floats at d with rank `rank`'s values and returns the rank-order sum
 * over P ranks, summed here in fp32 as spd must. */
static float *allreduce_inputs(void *d, size_t n, int rank, int P)
{
    float *mine = malloc(n * sizeof *mine), *want = malloc(n * sizeof *want);
    CHECK(mine != NULL && want != NULL);
    for (size_t i = 0; i < n; i++) {
        mine[i] = value(rank, i);
        float acc = value(0, i);
        for (int q = 1; q < P; q++)
            acc += value(q, i);
        want[i] = acc;
    }
    dev_write(d, mine, n * sizeof *mine);
    free(mine);
    return want;
}

static void test_allreduce(spc_handle_t *h, spc_group_t world, int rank, int P)
{
    vmm_t m = vmm_make(3, 0, 0);
    const size_t c = m.chunk, count = c / sizeof(float);
    /* send: [c/2, 3c/2), chunks 0 and 1; recv: [3c/2 + 4 KiB, 5c/2 + 4 KiB), chunks 1 and 2. */
    void *send = at(&m, c / 2), *recv = at(&m, c + c / 2 + 4096);
    spc_region_t rs, rr;
    float *want = allreduce_inputs(send, count, rank, P);
    CHECK_OK(h, spc_register_device(h, send, c, &rs));
    /* Counted after the first export: the driver may keep descriptors of its
     * own open from then on. */
    const int fds = fd_count();
    CHECK_OK(h, spc_register_device(h, recv, c, &rr));
    CHECK_EQ(fd_count(), fds);
    CHECK_OK(h, spc_allreduce(h, world, send, recv, count, SPC_F32, SPC_SUM, 30000));
    check_bytes(recv, want, c, "allreduce fp32, send and recv over two chunks each, one shared", rank);
    free(want);
    CHECK_OK(h, spc_deregister(h, rs));
    CHECK_OK(h, spc_deregister(h, rr));

    /* In place, over all three chunks. */
    const size_t n3 = (3 * c - 8192) / sizeof(float);
    void *buf = at(&m, 4096);
    want = allreduce_inputs(buf, n3, rank, P);
    spc_region_t r3;
    CHECK_OK(h, spc_register_device(h, buf, n3 * sizeof(float), &r3));
    CHECK_OK(h, spc_allreduce(h, world, buf, buf, n3, SPC_F32, SPC_SUM, 30000));
    check_bytes(buf, want, n3 * sizeof(float), "allreduce fp32 in place over three chunks", rank);
    free(want);
    CHECK_OK(h, spc_deregister(h, r3));
    vmm_free(&m, 0);
}

/* ================================================================ all-to-all */

enum { A2A_B = 2, A2A_S = 256, A2A_H = 8, A2A_D = 64 };

/* Rank q's sequence shard [B, S/P, H, D] of fp32. */
static float *a2a_input(int q, int P)
{
    size_t n = (size_t)A2A_B * (A2A_S / P) * A2A_H * A2A_D;
    float *x = malloc(n * sizeof *x);
    CHECK(x != NULL);
    fill(x, n * sizeof *x, q, 500);
    return x;
}

/* Rank r's head shard [B, S, H/P, D] after seq->head, from every rank's input:
 * row s of the full sequence comes from rank s / (S/P), and rank r keeps heads
 * [r*H/P, (r+1)*H/P). */
static float *a2a_head_want(float *const *in, int r, int P)
{
    const size_t Sl = A2A_S / P, Hl = A2A_H / P;
    float *out = malloc((size_t)A2A_B * A2A_S * Hl * A2A_D * sizeof *out);
    CHECK(out != NULL);
    for (size_t b = 0; b < A2A_B; b++)
        for (size_t s = 0; s < A2A_S; s++)
            for (size_t hl = 0; hl < Hl; hl++)
                memcpy(&out[((b * A2A_S + s) * Hl + hl) * A2A_D],
                       &in[s / Sl][((b * Sl + s % Sl) * A2A_H + (size_t)r * Hl + hl) * A2A_D], A2A_D * sizeof *out);
    return out;
}

static void test_alltoall(spc_handle_t *h, spc_group_t world, int rank, int P)
{
    const size_t seq_bytes = (size_t)A2A_B * (A2A_S / P) * A2A_H * A2A_D * sizeof(float);
    const size_t head_bytes = (size_t)A2A_B * A2A_S * (A2A_H / P) * A2A_D * sizeof(float);
    CHECK_EQ(spc_a2a_local_heads(A2A_H, SPC_HEADS_Q, 0, (uint32_t)P), A2A_H / P);
    CHECK_EQ(seq_bytes, head_bytes);
    vmm_t m = vmm_make(4, 0, 0);
    const size_t c = m.chunk;
    CHECK(seq_bytes <= c);
    /* Each tensor straddles a chunk boundary: seq over chunks 0-1, head over
     * 1-2, back over 2-3; neighbours share a chunk. */
    void *seq = at(&m, c - seq_bytes / 2), *head = at(&m, 2 * c - head_bytes / 2), *back = at(&m, 3 * c - seq_bytes / 2);
    float *in[4];
    for (int q = 0; q < P; q++)
        in[q] = a2a_input(q, P);
    float *want = a2a_head_want(in, rank, P);
    uint8_t *poison = malloc(seq_bytes);
    CHECK(poison != NULL);
    memset(poison, 0x5A, seq_bytes);   /* spd must write every byte */
    dev_write(head, poison, head_bytes);
    dev_write(back, poison, seq_bytes);
    dev_write(seq, in[rank], seq_bytes);
    spc_region_t rs, rh, rb;
    CHECK_OK(h, spc_register_device(h, seq, seq_bytes, &rs));
    CHECK_OK(h, spc_register_device(h, head, head_bytes, &rh));
    CHECK_OK(h, spc_register_device(h, back, seq_bytes, &rb));

    spc_alltoall_desc_t d = { .struct_size = sizeof d, .group = world, .dtype = SPC_F32,
                              .direction = SPC_SEQ_TO_HEAD, .layout = SPC_LAYOUT_BSHD, .batch = A2A_B,
                              .seq_len = A2A_S, .kv_heads = 0, .ntensors = 1 };
    d.tensors[0] = (spc_a2a_tensor_t){ seq, head, A2A_H, A2A_D, SPC_HEADS_Q, 0 };
    CHECK_OK(h, spc_alltoall(h, &d, 30000));
    check_bytes(head, want, head_bytes, "alltoall seq->head, fp32, tensors across chunk boundaries", rank);
    d.direction = SPC_HEAD_TO_SEQ;
    d.tensors[0] = (spc_a2a_tensor_t){ head, back, A2A_H, A2A_D, SPC_HEADS_Q, 0 };
    CHECK_OK(h, spc_alltoall(h, &d, 30000));
    check_bytes(back, in[rank], seq_bytes, "alltoall head->seq: the rank's own input back", rank);

    /* Left registered: spd closes the imports when this rank goes. The memory
     * is freed here first, as an allocator would; spd's mappings keep it. */
    vmm_free(&m, 0);
    for (int q = 0; q < P; q++)
        free(in[q]);
    free(want);
    free(poison);
}

/* ================================================================ refusals */

static void test_refusals(spc_handle_t *h, int rank)
{
    const size_t c = chunk_bytes;
    spc_region_t r = 12345;
    const int fds = fd_count();

    vmm_t plain = vmm_make(1, 1u, 0);
    CHECK_ST(h, spc_register_device(h, at(&plain, 4096), 8192, &r), SPC_ERR_UNSUPPORTED);
    CHECK_CONTAINS(spc_last_error(h), "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR");
    if (rank == 0)
        printf("without the handle type: %s\n", spc_last_error(h));
    vmm_free(&plain, 0);

    /* Chunk 0 is exported before chunk 1 is refused: its descriptor must close. */
    vmm_t mixed = vmm_make(2, 2u, 0);
    CHECK_ST(h, spc_register_device(h, at(&mixed, c - 4096), 8192, &r), SPC_ERR_UNSUPPORTED);
    CHECK_CONTAINS(spc_last_error(h), "CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR");
    vmm_free(&mixed, 0);

    vmm_t holed = vmm_make(2, 0, 2u);
    CHECK_ST(h, spc_register_device(h, at(&holed, c - 4096), 8192, &r), SPC_ERR_OUT_OF_BOUNDS);
    if (rank == 0)
        printf("into an unmapped hole: %s\n", spc_last_error(h));
    vmm_free(&holed, 2u);

    CHECK_EQ(r, 12345);   /* outputs are set only on success */
    CHECK_EQ(fd_count(), fds);
    /* spd goes on serving this client. */
    CHECK(sp_test_status_int(h, "clients") >= 1);
}

/* ================================================================ remap */

static void test_remap(spc_handle_t *h, spc_group_t world, int rank, int P)
{
    vmm_t m = vmm_make(2, 0, 0);
    const size_t c = m.chunk, count = c / sizeof(float);
    void *buf = at(&m, c / 2);   /* [c/2, 3c/2): both chunks */
    float *x = malloc(c), *want = malloc(c);
    CHECK(x != NULL && want != NULL);
    for (size_t i = 0; i < count; i++) {
        x[i] = (float)(rank + 1);
        want[i] = (float)(P * (P + 1) / 2);
    }
    dev_write(buf, x, c);
    spc_region_t r1, r2;
    CHECK_OK(h, spc_register_device(h, buf, c, &r1));
    CHECK_OK(h, spc_allreduce(h, world, buf, buf, count, SPC_F32, SPC_SUM, 30000));
    check_bytes(buf, want, c, "allreduce before the remap", rank);

    /* The second chunk is replaced under the registered range, as an allocator
     * that unmaps and maps again would; the region is not deregistered. */
    chunk_unmap(&m, 1);
    chunk_map(&m, 1, true);
    for (size_t i = 0; i < count; i++) {
        x[i] = (float)(2 * (rank + 1));
        want[i] = (float)(P * (P + 1));
    }
    dev_write(buf, x, c);
    int64_t before = sp_test_status_int(h, "gpu_reimports");
    CHECK_OK(h, spc_register_device(h, buf, c, &r2));
    CHECK(sp_test_status_int(h, "gpu_reimports") > before);
    /* The stale region went with its import. */
    CHECK_ST(h, spc_deregister(h, r1), SPC_ERR_BAD_REGION);
    CHECK_OK(h, spc_allreduce(h, world, buf, buf, count, SPC_F32, SPC_SUM, 30000));
    check_bytes(buf, want, c, "allreduce after the second chunk was mapped anew", rank);
    CHECK_OK(h, spc_deregister(h, r2));
    vmm_free(&m, 0);
    free(x);
    free(want);
}

/* ================================================================ ranks */

static int rank_main(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    gpu_setup();
    test_allreduce(h, world, rank, P);
    test_refusals(h, rank);
    test_remap(h, world, rank, P);
    test_alltoall(h, world, rank, P);
    return 0;
}

/* ================================================================ the import cache */

/* One process, nobody else registering: the counters move only by its doing. */
static int cache_main(void *arg)
{
    spc_handle_t *h = sp_test_attach();
    gpu_setup();
    vmm_t m = vmm_make(2, 0, 0);
    const size_t c = m.chunk;
    spc_region_t a, b, ab, w;
    /* The ranks' imports close as spd sees them go. */
    if (!sp_test_wait_status(h, "gpu_imports", 0, 5000))
        SP_FAIL("the ranks' imports are still open: %" PRId64, sp_test_status_int(h, "gpu_imports"));
    int64_t total = sp_test_status_int(h, "gpu_imports_total"), re = sp_test_status_int(h, "gpu_reimports");

    CHECK_OK(h, spc_register_device(h, at(&m, 4096), 4096, &a));
    CHECK_EQ(sp_test_status_int(h, "gpu_imports_total"), total + 1);
    /* Elsewhere in the same chunk: the same import. */
    CHECK_OK(h, spc_register_device(h, at(&m, 65536), 4096, &b));
    CHECK_EQ(sp_test_status_int(h, "gpu_imports_total"), total + 1);
    /* Over chunk 0 and chunk 1: an import of its own, from the same base; the
     * first one agrees with it and stays. */
    CHECK_OK(h, spc_register_device(h, at(&m, c - 4096), 8192, &ab));
    CHECK_EQ(sp_test_status_int(h, "gpu_imports_total"), total + 2);
    CHECK_EQ(sp_test_status_int(h, "gpu_reimports"), re);
    CHECK_EQ(sp_test_status_int(h, "gpu_imports"), 2);

    /* Chunk 0 replaced: both imports hold it, both are stale, and their
     * regions go. */
    chunk_unmap(&m, 0);
    chunk_map(&m, 0, true);
    CHECK_OK(h, spc_register_device(h, at(&m, 8192), 4096, &w));
    CHECK_EQ(sp_test_status_int(h, "gpu_reimports"), re + 2);
    CHECK_EQ(sp_test_status_int(h, "gpu_imports"), 1);
    CHECK_ST(h, spc_deregister(h, a), SPC_ERR_BAD_REGION);
    CHECK_ST(h, spc_deregister(h, b), SPC_ERR_BAD_REGION);
    CHECK_ST(h, spc_deregister(h, ab), SPC_ERR_BAD_REGION);
    CHECK_OK(h, spc_deregister(h, w));
    CHECK_EQ(sp_test_status_int(h, "gpu_imports"), 0);
    vmm_free(&m, 0);
    spc_detach(h);
    return 0;
}

/* ================================================================ main */

/* Whether the GPU can do what this test needs, asked in a child: CUDA must not
 * start in this process before it forks the ranks. */
static int gpu_probe(void *arg)
{
    int rc = sp_gpu_test_usable();
    if (rc != 0)
        return rc;
    const char *why = drv_load();
    if (why != NULL) {
        fprintf(stderr, "skipped: %s\n", why);
        return SP_TEST_SKIP;
    }
    CUDA_CHECK(cudaSetDevice(0));
    CUDA_CHECK(cudaFree(0));
    CUdevice dev;
    int vmm = 0, posix = 0;
    CU_CHECK(drv.device_get(&dev, 0));
    CU_CHECK(drv.device_attr(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev));
    CU_CHECK(drv.device_attr(&posix, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev));
    if (!vmm || !posix) {
        fprintf(stderr, "skipped: GPU 0 %s\n", !vmm ? "has no virtual memory management"
                                                    : "cannot export memory as POSIX file descriptors");
        return SP_TEST_SKIP;
    }
    gpu_setup();
    printf("GPU 0: cuMem chunks of %zu bytes\n", chunk_bytes);
    return 0;
}

int main(void)
{
    int rc = sp_test_wait(sp_test_fork(gpu_probe, NULL), 60000);
    if (rc == SP_TEST_SKIP)
        return SP_TEST_SKIP;
    CHECK_EQ(rc, 0);

    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    for (int P = 2; P <= 4; P += 2) {
        sp_test_run_job(P, rank_main, NULL);
        printf("P = %d: allreduce over 2 and 3 chunks, alltoall across chunk boundaries, refusals, remap: "
               "bit for bit\n", P);
    }
    CHECK_EQ(sp_test_wait(sp_test_fork(cache_main, NULL), 60000), 0);
    printf("cache: reuse within a chunk, ranges sharing a chunk, both stale when it is replaced\n");

    spc_handle_t *q = sp_test_attach();
    if (!sp_test_wait_status(q, "gpu_imports", 0, 5000))
        SP_FAIL("imports still open after every rank left: %" PRId64, sp_test_status_int(q, "gpu_imports"));
    printf("imports ever %" PRId64 ", open %" PRId64 ", re-imports %" PRId64 "\n", sp_test_status_int(q, "gpu_imports_total"),
           sp_test_status_int(q, "gpu_imports"), sp_test_status_int(q, "gpu_reimports"));
    spc_detach(q);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    char out[256];
    /* grep -c exits 1 when it counts none, which is what is wanted here. */
    CHECK_EQ(sp_test_run(out, sizeof out, "grep -c -e 'cuMemUnmap of' -e 'cuMemAddressFree of' %s", d.log), 1);
    CHECK_EQ(sp_test_run(out, sizeof out, "grep -c 'imported cuMem range' %s", d.log), 0);
    printf("daemon log lines on cuMem imports: %s", out);
    sp_test_daemon_cleanup(&d);
    printf("register_vmm: ok\n");
    return 0;
}
