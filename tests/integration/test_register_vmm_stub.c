/*
 * cuMem registration end to end without a GPU: libspclient and a real spd both
 * load the stand-in driver of tests/stubcuda (see stub_cuda.h), which keeps
 * books instead of memory and logs what spd imports and maps. So the client's
 * walk over chunks, the descriptors spd takes with pidfd_getfd, its import,
 * mapping, import cache and unmapping all run here; what only a GPU can show
 * (the driver's own answers, the bytes) is test_register_vmm's.
 *
 *   chunks     a range over two chunks is imported as both, each mapped at its
 *              offset in one reservation of spd's; a range over the next two
 *              (sharing one) is an import of its own; deregistered, every chunk
 *              is unmapped and both reservations freed. No descriptor stays
 *              open in the client;
 *   refusals   memory without the POSIX descriptor handle type, alone or after
 *              an exportable chunk: SPC_ERR_UNSUPPORTED saying what to set; an
 *              unmapped hole: SPC_ERR_OUT_OF_BOUNDS; 1025 chunks:
 *              SPC_ERR_LIMIT before any descriptor is opened;
 *   cache      a second range in the same chunk reuses its import; a range over
 *              that chunk and the next is another import and leaves the first
 *              one's regions be; the chunk replaced under both makes both stale;
 *   death      a client that exits with regions registered: spd unmaps them;
 *   exec       a client that exec'd, whose forked child registers on its
 *              session: spd takes no descriptor of the new program, refuses
 *              with the reason and ends the session;
 *   waiting    a region deregistered while its all-reduce waits for the other
 *              rank: BAD_REGION for it, PEER_REFUSED for the other, spd alive;
 *   misaligned device tensors off their element size (fp64 at byte 4, a bf16
 *              receive at an odd byte): INVALID_ARG naming the tensor, spd
 *              serving.
 *
 * At the end spd's stub holds no reservation, mapping or allocation, and
 * refused no call. Skipped (77) where spd was built without CUDA.
 */
#include <errno.h>
#include <dirent.h>
#include <signal.h>

#include "stub_cuda.h"
#include "sp_test.h"

#define C ((size_t)STUB_GRANULARITY)

static char stub_log_path[256];

/* ================================================================ memory */

#define MAX_CHUNKS 1100

typedef struct vmm {
    stub_ptr_t va;
    size_t     n;
    stub_mem_t h[MAX_CHUNKS];
} vmm_t;

static void chunk_map(vmm_t *m, size_t i, bool exportable)
{
    stub_mem_prop_t p = { .type = 1, .requested_handle_types = exportable ? STUB_HANDLE_POSIX_FD : 0,
                          .location = { 1, 0 } };
    stub_access_desc_t a = { .location = { 1, 0 }, .flags = 3 };
    CHECK_EQ(cuMemCreate(&m->h[i], C, &p, 0), STUB_SUCCESS);
    CHECK_EQ(cuMemMap(m->va + i * C, C, 0, m->h[i], 0), STUB_SUCCESS);
    CHECK_EQ(cuMemSetAccess(m->va + i * C, C, &a, 1), STUB_SUCCESS);
}

static void chunk_unmap(vmm_t *m, size_t i)
{
    CHECK_EQ(cuMemUnmap(m->va + i * C, C), STUB_SUCCESS);
    CHECK_EQ(cuMemRelease(m->h[i]), STUB_SUCCESS);
}

/* n chunks; bit i of `plain` (i < 32) makes chunk i without the POSIX
 * descriptor handle type, bit i of `hole` leaves it unmapped. */
static vmm_t *vmm_make(size_t n, unsigned plain, unsigned hole)
{
    vmm_t *m = calloc(1, sizeof *m);
    CHECK(m != NULL && n <= MAX_CHUNKS);
    m->n = n;
    CHECK_EQ(cuMemAddressReserve(&m->va, n * C, C, 0, 0), STUB_SUCCESS);
    for (size_t i = 0; i < n; i++)
        if (i >= 32 || !(hole & (1u << i)))
            chunk_map(m, i, i >= 32 || !(plain & (1u << i)));
    return m;
}

static void vmm_free(vmm_t *m, unsigned hole)
{
    for (size_t i = 0; i < m->n; i++)
        if (i >= 32 || !(hole & (1u << i)))
            chunk_unmap(m, i);
    CHECK_EQ(cuMemAddressFree(m->va, m->n * C), STUB_SUCCESS);
    free(m);
}

static void *at(const vmm_t *m, size_t off)
{
    return (void *)(uintptr_t)(m->va + off);
}

/* The stub's tag of the allocation mapped at p (its MEMORY_BLOCK_ID). */
static unsigned long long tag_at(const void *p)
{
    int attr = STUB_ATTR_MEMORY_BLOCK_ID;
    unsigned long long tag = 0;
    void *val = &tag;
    CHECK_EQ(cuPointerGetAttributes(1, &attr, &val, (stub_ptr_t)(uintptr_t)p), STUB_SUCCESS);
    CHECK(tag != 0);
    return tag;
}

/* ================================================================ helpers */

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

/* How many lines of spd's stub log (process pid) contain `needle`. */
static int log_count(pid_t pid, const char *needle)
{
    char out[64];
    int rc = sp_test_run(out, sizeof out, "grep '^%d ' %s | grep -c -F '%s'", (int)pid, stub_log_path, needle);
    CHECK(rc == 0 || rc == 1);
    return atoi(out);
}

/* ================================================================ chunks */

static void test_chunks(spc_handle_t *h, pid_t spd)
{
    vmm_t *m = vmm_make(3, 0, 0);
    unsigned long long t0 = tag_at(at(m, 0)), t1 = tag_at(at(m, C)), t2 = tag_at(at(m, 2 * C));
    spc_region_t a, b;
    char line[128];
    const int fds = fd_count();

    /* [C/2, 3C/2): chunks 0 and 1, mapped by spd at 0 and C of its range. */
    CHECK_OK(h, spc_register_device(h, at(m, C / 2), C, &a));
    CHECK_EQ(fd_count(), fds);
    snprintf(line, sizeof line, "map tag=%llu at=0 size=%zu", t0, C);
    CHECK_EQ(log_count(spd, line), 1);
    snprintf(line, sizeof line, "map tag=%llu at=%zu size=%zu", t1, C, C);
    CHECK_EQ(log_count(spd, line), 1);
    CHECK_EQ(sp_test_status_int(h, "gpu_imports"), 1);

    /* [3C/2 + 4 KiB, 5C/2 + 4 KiB): chunks 1 and 2, an import of its own;
     * chunk 1 is in both and imported twice. */
    CHECK_OK(h, spc_register_device(h, at(m, C + C / 2 + 4096), C, &b));
    CHECK_EQ(sp_test_status_int(h, "gpu_imports"), 2);
    CHECK_EQ(sp_test_status_int(h, "gpu_reimports"), 0);
    snprintf(line, sizeof line, "map tag=%llu at=0 size=%zu", t1, C);
    CHECK_EQ(log_count(spd, line), 1);
    snprintf(line, sizeof line, "map tag=%llu at=%zu size=%zu", t2, C, C);
    CHECK_EQ(log_count(spd, line), 1);
    snprintf(line, sizeof line, "import tag=%llu ", t1);
    CHECK_EQ(log_count(spd, line), 2);
    CHECK_EQ(fd_count(), fds);

    CHECK_OK(h, spc_deregister(h, a));
    CHECK_OK(h, spc_deregister(h, b));
    CHECK_EQ(sp_test_status_int(h, "gpu_imports"), 0);
    CHECK_EQ(log_count(spd, " unmap tag="), 4);
    CHECK_EQ(log_count(spd, " addrfree "), 2);
    vmm_free(m, 0);
    printf("chunks: two ranges over three chunks imported, mapped at their offsets and unmapped\n");
}

/* ================================================================ refusals */

static void test_refusals(spc_handle_t *h)
{
    spc_region_t r = 12345;
    const int fds = fd_count();

    vmm_t *plain = vmm_make(1, 1u, 0);
    CHECK_ST(h, spc_register_device(h, at(plain, 4096), 8192, &r), SPC_ERR_UNSUPPORTED);
    CHECK_CONTAINS(spc_last_error(h), "without CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR");
    CHECK_CONTAINS(spc_last_error(h), "CUmemAllocationProp.requestedHandleTypes");
    printf("without the handle type: %s\n", spc_last_error(h));
    vmm_free(plain, 0);

    /* Chunk 0 is exported before chunk 1 is refused: its descriptor closes. */
    vmm_t *mixed = vmm_make(2, 2u, 0);
    CHECK_ST(h, spc_register_device(h, at(mixed, C - 4096), 8192, &r), SPC_ERR_UNSUPPORTED);
    vmm_free(mixed, 0);

    vmm_t *holed = vmm_make(2, 0, 2u);
    CHECK_ST(h, spc_register_device(h, at(holed, C - 4096), 8192, &r), SPC_ERR_OUT_OF_BOUNDS);
    CHECK_CONTAINS(spc_last_error(h), "reserved but not mapped");
    vmm_free(holed, 2u);

    vmm_t *many = vmm_make(SP_DEVICE_MAX_CHUNKS + 1, 0, 0);
    CHECK_ST(h, spc_register_device(h, at(many, 0), many->n * C, &r), SPC_ERR_LIMIT);
    CHECK_CONTAINS(spc_last_error(h), "span more than 1024 cuMem chunks");
    vmm_free(many, 0);

    CHECK_EQ(r, 12345);   /* outputs are set only on success */
    CHECK_EQ(fd_count(), fds);
    CHECK_EQ(sp_test_status_int(h, "gpu_imports"), 0);
    printf("refusals: no handle type, a hole, 1025 chunks\n");
}

/* ================================================================ cache */

static void test_cache(spc_handle_t *h)
{
    vmm_t *m = vmm_make(2, 0, 0);
    spc_region_t a, b, ab, w;
    int64_t total = sp_test_status_int(h, "gpu_imports_total"), re = sp_test_status_int(h, "gpu_reimports");

    CHECK_OK(h, spc_register_device(h, at(m, 4096), 4096, &a));
    CHECK_EQ(sp_test_status_int(h, "gpu_imports_total"), total + 1);
    /* Elsewhere in the same chunk: the same import. */
    CHECK_OK(h, spc_register_device(h, at(m, 65536), 4096, &b));
    CHECK_EQ(sp_test_status_int(h, "gpu_imports_total"), total + 1);
    /* Over chunks 0 and 1: an import of its own from the same base; the first
     * agrees with it and stays. */
    CHECK_OK(h, spc_register_device(h, at(m, C - 4096), 8192, &ab));
    CHECK_EQ(sp_test_status_int(h, "gpu_imports_total"), total + 2);
    CHECK_EQ(sp_test_status_int(h, "gpu_reimports"), re);
    CHECK_EQ(sp_test_status_int(h, "gpu_imports"), 2);

    /* Chunk 0 replaced under both: both stale, their regions gone. */
    chunk_unmap(m, 0);
    chunk_map(m, 0, true);
    CHECK_OK(h, spc_register_device(h, at(m, 8192), 4096, &w));
    CHECK_EQ(sp_test_status_int(h, "gpu_reimports"), re + 2);
    CHECK_EQ(sp_test_status_int(h, "gpu_imports"), 1);
    CHECK_ST(h, spc_deregister(h, a), SPC_ERR_BAD_REGION);
    CHECK_ST(h, spc_deregister(h, b), SPC_ERR_BAD_REGION);
    CHECK_ST(h, spc_deregister(h, ab), SPC_ERR_BAD_REGION);
    CHECK_OK(h, spc_deregister(h, w));
    CHECK_EQ(sp_test_status_int(h, "gpu_imports"), 0);

    /* Only the second chunk replaced under a range over both: re-imported too. */
    spc_region_t r1, r2;
    re = sp_test_status_int(h, "gpu_reimports");
    CHECK_OK(h, spc_register_device(h, at(m, C / 2), C, &r1));
    chunk_unmap(m, 1);
    chunk_map(m, 1, true);
    CHECK_OK(h, spc_register_device(h, at(m, C / 2), C, &r2));
    CHECK_EQ(sp_test_status_int(h, "gpu_reimports"), re + 1);
    CHECK_ST(h, spc_deregister(h, r1), SPC_ERR_BAD_REGION);
    CHECK_OK(h, spc_deregister(h, r2));
    CHECK_EQ(sp_test_status_int(h, "gpu_imports"), 0);
    vmm_free(m, 0);
    printf("cache: reuse within a chunk, ranges sharing a chunk, stale when a chunk is replaced\n");
}

/* ================================================================ death */

static int dying_client(void *arg)
{
    spc_handle_t *h = sp_test_attach();
    vmm_t *m = vmm_make(3, 0, 0);
    spc_region_t a, b;
    CHECK_OK(h, spc_register_device(h, at(m, 0), 2 * C, &a));
    CHECK_OK(h, spc_register_device(h, at(m, 2 * C), C, &b));
    return 0;   /* exits with both registered, nothing deregistered or freed */
}

static void test_death(spc_handle_t *h)
{
    CHECK_EQ(sp_test_wait(sp_test_fork(dying_client, NULL), 30000), 0);
    if (!sp_test_wait_status(h, "gpu_imports", 0, 5000))
        SP_FAIL("the dead client's imports are still open: %" PRId64, sp_test_status_int(h, "gpu_imports"));
    printf("death: the imports of a client gone are closed\n");
}

/* ================================================================ exec */

struct exec_seen {
    spc_status_t st;
    char         err[256];
    bool         done;
};

/* Attaches, forks the child that keeps the session, and becomes sleep(1). */
static int exec_client(void *arg)
{
    struct exec_seen *seen = arg;
    spc_handle_t *h = sp_test_attach();
    pid_t child = fork();
    CHECK(child >= 0);
    if (child > 0) {
        execl("/bin/sleep", "sleep", "60", (char *)NULL);
        SP_FAIL("exec sleep: %s", strerror(errno));
    }
    char exe[64], link[256] = "";
    snprintf(exe, sizeof exe, "/proc/%d/exe", (int)getppid());
    for (uint64_t t0 = sp_test_now_ms(); strstr(link, "sleep") == NULL; ) {
        CHECK(sp_test_now_ms() - t0 < 10000);
        ssize_t n = readlink(exe, link, sizeof link - 1);
        link[n > 0 ? n : 0] = '\0';
    }
    vmm_t *m = vmm_make(1, 0, 0);
    spc_region_t r;
    seen->st = spc_register_device(h, at(m, 0), C, &r);
    snprintf(seen->err, sizeof seen->err, "%s", spc_last_error(h));
    seen->done = true;
    return 0;
}

static void test_exec(spc_handle_t *h)
{
    struct exec_seen *seen = sp_test_shared(sizeof *seen);
    pid_t p = sp_test_fork(exec_client, seen);
    for (uint64_t t0 = sp_test_now_ms(); !__atomic_load_n(&seen->done, __ATOMIC_ACQUIRE); )
        CHECK(sp_test_now_ms() - t0 < 20000);
    kill(p, SIGKILL);
    CHECK_EQ(sp_test_wait(p, 10000), -SIGKILL);
    CHECK_ST(NULL, seen->st, SPC_ERR_PERMISSION);
    CHECK_CONTAINS(seen->err, "is no longer the process that attached (it exec'd)");
    CHECK_OK(h, spc_noop(h, 5000));
    printf("exec: no descriptor taken from the program the client exec'd\n");
}

/* ================================================================ deregistered while waiting */

static char wait_job[SPC_JOB_ID_MAX];
static int dereg_pipe[2];

/* Rank 0 submits an all-reduce over its device region and deregisters the
 * region while the op waits for rank 1; rank 1 then submits. Validation was
 * at submit: spd must check again once both are in (it used to crash there). */
static int dereg_rank(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, wait_job, 2, (uint32_t)rank, 20000, &world));
    vmm_t *m = vmm_make(1, 0, 0);
    spc_region_t reg;
    CHECK_OK(h, spc_register_device(h, at(m, 0), C, &reg));
    if (rank == 0) {
        spc_request_t *r;
        CHECK_OK(h, spc_iallreduce(h, world, at(m, 0), at(m, 0), 16, SPC_F64, SPC_SUM, &r));
        CHECK(sp_test_wait_status(h, "ops_inflight", 1, 10000));   /* spd holds it */
        CHECK_OK(h, spc_deregister(h, reg));
        CHECK(write(dereg_pipe[1], "d", 1) == 1);
        CHECK_ST(h, spc_wait(r, 15000), SPC_ERR_BAD_REGION);
        CHECK_CONTAINS(spc_request_detail(r), "deregistered while the op waited");
        spc_request_release(r);
    } else {
        char c;
        CHECK(read(dereg_pipe[0], &c, 1) == 1);
        CHECK_ST(h, spc_allreduce(h, world, at(m, 0), at(m, 0), 16, SPC_F64, SPC_SUM, 15000),
                 SPC_ERR_PEER_REFUSED);
        CHECK_CONTAINS(spc_last_error(h), "deregistered while the op waited");
        CHECK_OK(h, spc_deregister(h, reg));
    }
    spc_detach(h);
    vmm_free(m, 0);
    return 0;
}

static void test_deregistered_while_waiting(spc_handle_t *h)
{
    CHECK_OK(h, spc_job_create(h, wait_job, sizeof wait_job));
    CHECK(pipe(dereg_pipe) == 0);
    pid_t pids[2] = { sp_test_fork(dereg_rank, (void *)0), sp_test_fork(dereg_rank, (void *)1) };
    sp_test_wait_all_ok(pids, 2, 30000);
    close(dereg_pipe[0]);
    close(dereg_pipe[1]);
    CHECK_OK(h, spc_noop(h, 5000));   /* spd is alive and serving */
    if (!sp_test_wait_status(h, "gpu_imports", 0, 5000))
        SP_FAIL("the ranks' imports are still open: %" PRId64, sp_test_status_int(h, "gpu_imports"));
    printf("deregistered while waiting: BAD_REGION, the peer PEER_REFUSED, spd serving\n");
}

/* ================================================================ misaligned */

/* Device tensors off their element size: refused at submit, naming the
 * tensor, before any kernel could load a misaligned element. */
static int misaligned_rank(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    vmm_t *m = vmm_make(1, 0, 0);
    spc_region_t reg;
    CHECK_OK(h, spc_register_device(h, at(m, 0), C, &reg));
    CHECK_ST(h, spc_allreduce(h, world, at(m, 4), at(m, 4), 16, SPC_F64, SPC_SUM, 15000), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(h), "tensor 0 at");
    CHECK_CONTAINS(spc_last_error(h), "not aligned to its 8-byte fp64 elements");
    printf("misaligned: %s\n", spc_last_error(h));
    CHECK_ST(h, spc_allgather(h, world, at(m, 256), at(m, 1025), 4, SPC_BF16, 15000), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(h), "tensor 1 at");
    CHECK_OK(h, spc_deregister(h, reg));
    vmm_free(m, 0);
    return 0;
}

static void test_misaligned(spc_handle_t *h)
{
    sp_test_run_job(1, misaligned_rank, NULL);
    CHECK_OK(h, spc_noop(h, 5000));   /* spd is alive and serving */
}

int main(void)
{
    sp_test_use_stub_cuda(SP_STUB_CUDA_DIR);
    snprintf(stub_log_path, sizeof stub_log_path, "/tmp/spd-stub-cuda-%d.log", (int)getpid());
    unlink(stub_log_path);
    setenv("SPD_STUB_CUDA_LOG", stub_log_path, 1);

    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    spc_handle_t *h = sp_test_attach();
    spc_region_t r;
    vmm_t *probe = vmm_make(1, 0, 0);
    spc_status_t st = spc_register_device(h, at(probe, 0), 4096, &r);
    if (st == SPC_ERR_NO_DEVICE && strstr(spc_last_error(h), "built without CUDA") != NULL) {
        fprintf(stderr, "skipped: %s\n", spc_last_error(h));
        vmm_free(probe, 0);
        spc_detach(h);
        sp_test_daemon_stop(&d);
        sp_test_daemon_cleanup(&d);
        unsetenv("SPD_STUB_CUDA_LOG");
        unlink(stub_log_path);
        return SP_TEST_SKIP;
    }
    CHECK_OK(h, st);
    CHECK_OK(h, spc_deregister(h, r));
    vmm_free(probe, 0);
    /* From here on, counts in the log are the tests'. */
    unlink(stub_log_path);

    test_chunks(h, d.pid);
    test_refusals(h);
    test_cache(h);
    test_death(h);
    test_exec(h);
    test_deregistered_while_waiting(h);
    test_misaligned(h);
    spc_detach(h);

    const pid_t spd = d.pid;
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    CHECK_EQ(log_count(spd, "exit reservations=0 mappings=0 allocations=0"), 1);
    CHECK_EQ(log_count(spd, " refused "), 0);
    sp_test_daemon_cleanup(&d);
    unsetenv("SPD_STUB_CUDA_LOG");   /* this process's stub logs its exit too */
    unlink(stub_log_path);
    printf("register_vmm_stub: ok\n");
    return 0;
}
