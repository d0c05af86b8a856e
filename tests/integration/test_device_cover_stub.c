/*
 * The device registration cache (spc_device_cover) of a C client over cuMem
 * memory, without a GPU: libspclient and a real spd load the stand-in driver
 * of tests/stubcuda, as test_register_vmm_stub does. The test reads what the
 * cache holds (spc_device_cache_entries, _info) and what spd holds for this
 * client ("clients": device_regions, device_bytes), and compares both with
 * what it computes from the chunk size.
 *
 *   one chunk  spans inside one chunk: one registration of that chunk, reused;
 *   merge      a span across two chunks: one registration of both; a span
 *              across the edge of registrations made before: one over all
 *              their chunks replaces them (gone in spd); two spans of one op
 *              where the second's merge takes in the first's registration;
 *   hole       a span into reserved space with nothing mapped:
 *              SPC_ERR_OUT_OF_BOUNDS naming the address, nothing registered;
 *   remap      a chunk unmapped and another mapped at its address: the stale
 *              registration is dropped and made again; one elsewhere is swept
 *              on the next miss, also when an earlier span of the op lies in it;
 *   too long   a merge past 1024 chunks: another op's registration goes and
 *              the span gets its own; within one op, SPC_ERR_LIMIT;
 *   bound      past the limit the least recently used go, spd holding what
 *              the cache holds;
 *   in flight  a merge waits for the requests naming the registrations it
 *              replaces (held ones keep their outcome, released ones too) and
 *              leaves others in flight; eviction takes first what no request
 *              names, then waits for the requests naming the rest; ops name
 *              covered pointers without a region of their own.
 *
 * Skipped (77) where spd was built without CUDA.
 */
#include "stub_cuda.h"
#include "sp_test.h"

#define C ((uint64_t)STUB_GRANULARITY)
#define MAX_CHUNKS 1100

/* ================================================================ memory */

typedef struct vmm {
    stub_ptr_t va;
    size_t     n;
    stub_mem_t h[MAX_CHUNKS];
    bool       mapped[MAX_CHUNKS];
} vmm_t;

static void chunk_map(vmm_t *m, size_t i)
{
    stub_mem_prop_t p = { .type = 1, .requested_handle_types = STUB_HANDLE_POSIX_FD, .location = { 1, 0 } };
    stub_access_desc_t a = { .location = { 1, 0 }, .flags = 3 };
    CHECK_EQ(cuMemCreate(&m->h[i], C, &p, 0), STUB_SUCCESS);
    CHECK_EQ(cuMemMap(m->va + i * C, C, 0, m->h[i], 0), STUB_SUCCESS);
    CHECK_EQ(cuMemSetAccess(m->va + i * C, C, &a, 1), STUB_SUCCESS);
    m->mapped[i] = true;
}

static void chunk_unmap(vmm_t *m, size_t i)
{
    CHECK_EQ(cuMemUnmap(m->va + i * C, C), STUB_SUCCESS);
    CHECK_EQ(cuMemRelease(m->h[i]), STUB_SUCCESS);
    m->mapped[i] = false;
}

/* A reservation of n chunks, all mapped but those whose bit is set in `hole`. */
static vmm_t *vmm_make(size_t n, unsigned hole)
{
    vmm_t *m = calloc(1, sizeof *m);
    CHECK(m != NULL && n <= MAX_CHUNKS);
    m->n = n;
    CHECK_EQ(cuMemAddressReserve(&m->va, n * C, C, 0, 0), STUB_SUCCESS);
    for (size_t i = 0; i < n; i++)
        if (i >= 32 || !(hole & (1u << i)))
            chunk_map(m, i);
    return m;
}

static void vmm_free(vmm_t *m)
{
    for (size_t i = 0; i < m->n; i++)
        if (m->mapped[i])
            chunk_unmap(m, i);
    CHECK_EQ(cuMemAddressFree(m->va, m->n * C), STUB_SUCCESS);
    free(m);
}

/* ================================================================ what each side holds */

/* A span [off, off + bytes) of m. */
#define SPAN(m, off, bytes) ((spc_device_span_t){ (const void *)(uintptr_t)((m)->va + (off)), (bytes) })

static spc_status_t cover(spc_handle_t *h, const vmm_t *m, uint64_t off, uint64_t bytes)
{
    spc_device_span_t s = SPAN(m, off, bytes);
    return spc_device_cover(h, &s, 1, NULL);
}

/* The cache's registrations as "offset+size" from m's start, by address: "0+C 1C+2C". */
static const char *held(spc_handle_t *h, const vmm_t *m)
{
    static char out[512];
    spc_device_entry_t e[16];
    uint32_t n = spc_device_cache_entries(h, e, 16);
    CHECK(n <= 16);
    size_t len = 0;
    out[0] = '\0';
    for (uint32_t i = 0; i < n; i++) {
        CHECK_EQ((e[i].base - m->va) % C, 0);
        CHECK_EQ(e[i].size % C, 0);
        CHECK_EQ(e[i].chunks, e[i].size / C);
        len += (size_t)snprintf(out + len, sizeof out - len, "%s%lluC+%lluC", i ? " " : "",
                                (unsigned long long)((e[i].base - m->va) / C), (unsigned long long)(e[i].size / C));
    }
    return out;
}

static spc_device_cache_info_t info(spc_handle_t *h)
{
    spc_device_cache_info_t i = SPC_DEVICE_CACHE_INFO_INIT;
    CHECK_OK(h, spc_device_cache_info(h, &i));
    return i;
}

/* This process's device regions and bytes in spd. */
static void spd_holds(spc_handle_t *h, int64_t *regions, int64_t *bytes)
{
    spc_query_result_t *q;
    CHECK_OK(h, spc_query(h, "clients", "", &q));
    int found = 0;
    for (size_t r = 0; r < spc_query_records(q); r++) {
        long pid = spc_query_find(q, r, "pid");
        if (pid < 0 || spc_query_int(q, r, (size_t)pid) != getpid())
            continue;
        found++;
        *regions = spc_query_int(q, r, (size_t)spc_query_find(q, r, "device_regions"));
        *bytes = spc_query_int(q, r, (size_t)spc_query_find(q, r, "device_bytes"));
    }
    spc_query_free(q);
    CHECK_EQ(found, 1);
}

/* spd holds exactly what the cache holds. */
static void check_spd_agrees(spc_handle_t *h)
{
    spc_device_entry_t e[16];
    uint32_t n = spc_device_cache_entries(h, e, 16);
    int64_t bytes = 0, spd_regions = -1, spd_bytes = -1;
    for (uint32_t i = 0; i < n; i++)
        bytes += (int64_t)e[i].size;
    spd_holds(h, &spd_regions, &spd_bytes);
    CHECK_EQ(spd_regions, n);
    CHECK_EQ(spd_bytes, bytes);
}

/* ================================================================ one chunk, merge */

static void test_one_chunk(spc_handle_t *h)
{
    vmm_t *m = vmm_make(4, 1u << 3);
    spc_device_cache_info_t before = info(h);
    CHECK_OK(h, cover(h, m, 4096, 8192));
    CHECK_STREQ(held(h, m), "0C+1C");                 /* chunk 0, not the reservation */
    spc_device_span_t two[2] = { SPAN(m, C / 2, 4096), SPAN(m, C - 16, 16) };
    spc_region_t r[2];
    CHECK_OK(h, spc_device_cover(h, two, 2, r));      /* elsewhere in chunk 0: reused */
    CHECK_EQ(r[0], r[1]);
    CHECK_STREQ(held(h, m), "0C+1C");
    CHECK_EQ(info(h).registrations, before.registrations + 1);
    check_spd_agrees(h);
    CHECK_OK(h, spc_device_cache_clear(h));
    vmm_free(m);
    printf("one chunk: one registration of the chunk, reused\n");
}

static void test_merge(spc_handle_t *h)
{
    vmm_t *m = vmm_make(4, 0);
    spc_device_cache_info_t before = info(h);
    spc_region_t old[2];
    spc_device_span_t s12 = SPAN(m, C + C / 2, C), s0 = SPAN(m, 100, 16);
    CHECK_OK(h, spc_device_cover(h, &s12, 1, &old[0]));   /* chunks 1 and 2 */
    CHECK_STREQ(held(h, m), "1C+2C");
    CHECK_OK(h, spc_device_cover(h, &s0, 1, &old[1]));    /* chunk 0, a registration of its own */
    CHECK_STREQ(held(h, m), "0C+1C 1C+2C");
    check_spd_agrees(h);

    /* Across the edge of both: one registration over chunks 0 to 2. */
    CHECK_OK(h, cover(h, m, C - 4096, 8192));
    CHECK_STREQ(held(h, m), "0C+3C");
    CHECK_EQ(info(h).merged, before.merged + 2);
    CHECK_EQ(info(h).registrations, before.registrations + 3);
    check_spd_agrees(h);
    CHECK_ST(h, spc_deregister(h, old[0]), SPC_ERR_BAD_REGION);
    CHECK_ST(h, spc_deregister(h, old[1]), SPC_ERR_BAD_REGION);

    /* Two spans of one op, in chunk 2 and across 2 and 3: the second's merge
     * takes in the first's registration, and both name the merged one. */
    spc_device_span_t op[2] = { SPAN(m, 2 * C + 100, 16), SPAN(m, 3 * C - 8, 16) };
    spc_region_t r[2];
    CHECK_OK(h, spc_device_cover(h, op, 2, r));
    CHECK_STREQ(held(h, m), "0C+4C");
    spc_device_entry_t e;
    CHECK_EQ(spc_device_cache_entries(h, &e, 1), 1);
    CHECK_EQ(r[0], e.region);
    CHECK_EQ(r[1], e.region);
    check_spd_agrees(h);
    CHECK_OK(h, spc_device_cache_clear(h));
    vmm_free(m);
    printf("merge: a span across registrations gets one over all their chunks\n");
}

/* ================================================================ hole, remap */

static void test_hole(spc_handle_t *h)
{
    vmm_t *m = vmm_make(4, 1u << 2);                  /* chunk 2 is a hole */
    spc_device_cache_info_t before = info(h);
    char want[64];
    CHECK_ST(h, cover(h, m, 2 * C + 100, 16), SPC_ERR_OUT_OF_BOUNDS);
    CHECK_CONTAINS(spc_last_error(h), "nothing mapped");
    CHECK_ST(h, cover(h, m, 2 * C - 4096, 8192), SPC_ERR_OUT_OF_BOUNDS);
    snprintf(want, sizeof want, "nothing mapped at 0x%llx", (unsigned long long)(m->va + 2 * C));
    CHECK_CONTAINS(spc_last_error(h), want);
    CHECK_STREQ(held(h, m), "");
    CHECK_EQ(info(h).registrations, before.registrations);
    spc_device_span_t sides[2] = { SPAN(m, C, 16), SPAN(m, 3 * C, 16) };
    CHECK_OK(h, spc_device_cover(h, sides, 2, NULL));
    CHECK_STREQ(held(h, m), "1C+1C 3C+1C");
    check_spd_agrees(h);
    CHECK_OK(h, spc_device_cache_clear(h));
    vmm_free(m);
    printf("hole: refused, naming the address\n");
}

static void test_remap(spc_handle_t *h)
{
    vmm_t *m = vmm_make(4, 0);
    spc_device_span_t op[2] = { SPAN(m, C / 2, C), SPAN(m, 3 * C + 64, 64) };
    spc_region_t r[2];
    CHECK_OK(h, spc_device_cover(h, op, 2, r));       /* chunks 0-1, and 3 */
    CHECK_STREQ(held(h, m), "0C+2C 3C+1C");
    spc_device_cache_info_t before = info(h);

    /* Chunk 1 replaced: the span's registration no longer holds what is there. */
    chunk_unmap(m, 1);
    chunk_map(m, 1);
    spc_region_t again;
    CHECK_OK(h, spc_device_cover(h, &op[0], 1, &again));
    CHECK_STREQ(held(h, m), "0C+2C 3C+1C");
    CHECK(again != r[0]);
    CHECK_EQ(info(h).dropped, before.dropped + 1);
    CHECK_EQ(info(h).registrations, before.registrations + 1);
    CHECK_ST(h, spc_deregister(h, r[0]), SPC_ERR_BAD_REGION);
    check_spd_agrees(h);

    /* Chunk 3 replaced and chunk 2 unmapped: a hit on chunks 0-1 sweeps
     * nothing; the next miss, into the hole, drops both stale ones. */
    chunk_unmap(m, 3);
    chunk_map(m, 3);
    chunk_unmap(m, 2);
    CHECK_OK(h, cover(h, m, C + 64, 64));
    CHECK_STREQ(held(h, m), "0C+2C 3C+1C");
    CHECK_ST(h, cover(h, m, 2 * C + 64, 64), SPC_ERR_OUT_OF_BOUNDS);
    CHECK_EQ(info(h).dropped, before.dropped + 2);
    CHECK_STREQ(held(h, m), "0C+2C");
    check_spd_agrees(h);
    CHECK_OK(h, spc_device_cache_clear(h));
    vmm_free(m);
    printf("remap: stale registrations dropped and made again\n");
}

/* The first span of an op hits a registration whose other chunk was
 * remapped; the second span's miss sweeps it away: both spans must still be
 * covered when the call returns. */
static void test_sweep_inside_one_op(spc_handle_t *h)
{
    vmm_t *m = vmm_make(4, 0);
    CHECK_OK(h, cover(h, m, C / 2, C));               /* chunks 0-1 */
    spc_device_cache_info_t before = info(h);
    chunk_unmap(m, 1);
    chunk_map(m, 1);
    spc_device_span_t op[2] = { SPAN(m, 64, 64), SPAN(m, 3 * C + 64, 64) };
    spc_region_t r[2];
    CHECK_OK(h, spc_device_cover(h, op, 2, r));
    CHECK_STREQ(held(h, m), "0C+1C 3C+1C");
    CHECK_EQ(info(h).dropped, before.dropped + 1);
    spc_device_entry_t e[2];
    CHECK_EQ(spc_device_cache_entries(h, e, 2), 2);
    CHECK_EQ(r[0], e[0].region);
    CHECK_EQ(r[1], e[1].region);
    check_spd_agrees(h);
    CHECK_OK(h, spc_device_cache_clear(h));
    vmm_free(m);
    printf("sweep inside one op: every span covered on return\n");
}

/* ================================================================ too long, bound */

static void test_too_long(spc_handle_t *h)
{
    vmm_t *m = vmm_make(1100, 0);
    spc_device_cache_info_t before = info(h);
    CHECK_OK(h, cover(h, m, 0, 600 * C));
    CHECK_STREQ(held(h, m), "0C+600C");
    /* Over the edge, reaching chunk 1099: one over both would take 1100. */
    CHECK_OK(h, cover(h, m, 599 * C, 501 * C));
    CHECK_STREQ(held(h, m), "599C+501C");
    CHECK_EQ(info(h).merged, before.merged + 1);
    CHECK_OK(h, cover(h, m, 0, 599 * C));
    CHECK_STREQ(held(h, m), "0C+599C 599C+501C");
    /* The same op names both: nothing can hold them together. */
    spc_device_span_t op[2] = { SPAN(m, 100, 16), SPAN(m, 598 * C, C + 16) };
    CHECK_ST(h, spc_device_cover(h, op, 2, NULL), SPC_ERR_LIMIT);
    CHECK_CONTAINS(spc_last_error(h), "more than the 1024 one registration takes");
    CHECK_STREQ(held(h, m), "0C+599C 599C+501C");
    check_spd_agrees(h);
    CHECK_OK(h, spc_device_cache_clear(h));
    vmm_free(m);
    printf("too long: another op's registration replaced, the same op's refused\n");
}

static void test_bound(spc_handle_t *h)
{
    vmm_t *m = vmm_make(6, 0);
    CHECK_OK(h, spc_device_cache_limit(h, 4));
    for (uint64_t i = 0; i < 6; i++) {                /* one registration per chunk */
        CHECK_OK(h, cover(h, m, i * C + 64, 64));
        CHECK(info(h).regions <= 4);
    }
    CHECK_STREQ(held(h, m), "2C+1C 3C+1C 4C+1C 5C+1C");
    check_spd_agrees(h);
    CHECK_OK(h, spc_device_cache_limit(h, 256));
    CHECK_OK(h, spc_device_cache_clear(h));
    CHECK_EQ(info(h).regions, 0);
    check_spd_agrees(h);
    vmm_free(m);
    printf("bound: the least recently used go\n");
}

/* ================================================================ in flight */

static char job[SPC_JOB_ID_MAX];
static int done_pipe[2];

/* An all-reduce of 16 doubles at p on channel `channel`, which spd fails after
 * `deadline_ms` as the other rank never sends it. */
static spc_request_t *lone_allreduce(spc_handle_t *h, spc_group_t world, const void *p, uint32_t channel,
                                     uint32_t deadline_ms)
{
    spc_op_t op = SPC_OP_INIT;
    op.opcode = SPC_OP_ALLREDUCE;
    op.group = world;
    op.dtype = SPC_F64;
    op.redop = SPC_SUM;
    op.count = 16;
    op.ntensors = 2;
    op.tensors[0].ptr = (void *)p;
    op.tensors[1].ptr = (void *)p;
    op.channel = channel;
    op.timeout_ms = deadline_ms;
    spc_request_t *r;
    CHECK_OK(h, spc_submit(h, &op, &r));
    return r;
}

static int in_flight_rank(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job, 2, (uint32_t)rank, 20000, &world));
    if (rank == 1) {                                  /* joins, sends nothing, stays till rank 0 is done */
        char c;
        CHECK(read(done_pipe[0], &c, 1) == 1);
        spc_detach(h);
        return 0;
    }
    vmm_t *m = vmm_make(4, 0);
    spc_device_span_t a = SPAN(m, 0, 128), b = SPAN(m, 2 * C, 128), c = SPAN(m, 3 * C, 128);
    spc_region_t ra, rb, rc;
    CHECK_OK(h, spc_device_cover(h, &b, 1, &rb));     /* chunk 2, the least recently used */
    CHECK_OK(h, spc_device_cover(h, &c, 1, &rc));     /* chunk 3 */
    CHECK_OK(h, spc_device_cover(h, &a, 1, &ra));     /* chunk 0 */

    /* Ops on covered pointers: two on chunk 0 (one held, one released), one on chunk 2. */
    spc_request_t *held_a = lone_allreduce(h, world, a.ptr, 0, 1000);
    spc_request_release(lone_allreduce(h, world, a.ptr, 1, 1200));
    spc_request_t *on_b = lone_allreduce(h, world, b.ptr, 2, 5000);
    CHECK_EQ(spc_inflight(h), 3);

    /* Across chunks 0 and 1: chunk 0's registration goes once both its ops are over. */
    uint64_t t0 = sp_test_now_ms();
    CHECK_OK(h, cover(h, m, C - 64, 128));
    uint64_t waited = sp_test_now_ms() - t0;
    CHECK(waited >= 900);
    CHECK_STREQ(held(h, m), "0C+2C 2C+1C 3C+1C");
    CHECK_ST(h, spc_test(held_a), SPC_ERR_TIMEOUT);   /* its outcome stays */
    CHECK_EQ(spc_test(on_b), SPC_IN_PROGRESS);        /* not named: left in flight */
    CHECK_EQ(spc_inflight(h), 1);
    CHECK_ST(h, spc_deregister(h, ra), SPC_ERR_BAD_REGION);
    spc_request_release(held_a);

    /* Past a limit of 2, eviction takes chunk 3's registration, which nothing
     * names, at once, before chunk 2's, less recently used but named by on_b. */
    CHECK_OK(h, spc_device_cache_limit(h, 2));
    t0 = sp_test_now_ms();
    CHECK_OK(h, cover(h, m, 64, 64));
    CHECK(sp_test_now_ms() - t0 < 1000);
    CHECK_STREQ(held(h, m), "0C+2C 2C+1C");
    CHECK_EQ(spc_test(on_b), SPC_IN_PROGRESS);
    CHECK_ST(h, spc_deregister(h, rc), SPC_ERR_BAD_REGION);

    /* Past a limit of 1 only chunk 2's is left to take: once on_b is done. */
    CHECK_OK(h, spc_device_cache_limit(h, 1));
    CHECK_OK(h, cover(h, m, 64, 64));
    CHECK_STREQ(held(h, m), "0C+2C");
    CHECK_ST(h, spc_test(on_b), SPC_ERR_TIMEOUT);
    spc_request_release(on_b);
    CHECK_ST(h, spc_deregister(h, rb), SPC_ERR_BAD_REGION);
    check_spd_agrees(h);
    printf("in flight: the merge waited %llu ms for the ops naming what it replaced\n", (unsigned long long)waited);

    CHECK(write(done_pipe[1], "d", 1) == 1);
    spc_detach(h);
    vmm_free(m);
    return 0;
}

static void test_in_flight(spc_handle_t *h)
{
    CHECK_OK(h, spc_job_create(h, job, sizeof job));
    CHECK(pipe(done_pipe) == 0);
    pid_t pids[2] = { sp_test_fork(in_flight_rank, (void *)0), sp_test_fork(in_flight_rank, (void *)1) };
    sp_test_wait_all_ok(pids, 2, 60000);
    close(done_pipe[0]);
    close(done_pipe[1]);
}

int main(void)
{
    sp_test_use_stub_cuda(SP_STUB_CUDA_DIR);

    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    spc_handle_t *h = sp_test_attach();
    vmm_t *probe = vmm_make(1, 0);
    spc_status_t st = cover(h, probe, 0, 4096);
    if (st == SPC_ERR_NO_DEVICE && strstr(spc_last_error(h), "built without CUDA") != NULL) {
        fprintf(stderr, "skipped: %s\n", spc_last_error(h));
        vmm_free(probe);
        spc_detach(h);
        sp_test_daemon_stop(&d);
        sp_test_daemon_cleanup(&d);
        return SP_TEST_SKIP;
    }
    CHECK_OK(h, st);
    CHECK_OK(h, spc_device_cache_clear(h));
    vmm_free(probe);
    /* The info struct follows the struct_size rule; a refused one is left alone. */
    spc_device_cache_info_t bad = SPC_DEVICE_CACHE_INFO_INIT;
    bad.struct_size = sizeof bad + 8;
    CHECK_ST(h, spc_device_cache_info(h, &bad), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(h), "spc_device_cache_info_t.struct_size");
    bad.struct_size = 8;
    CHECK_ST(h, spc_device_cache_info(h, &bad), SPC_ERR_INVALID_ARG);
    CHECK_EQ(bad.registrations, 0);
    CHECK_EQ(info(h).registrations, 1);
    CHECK_EQ(info(h).limit, 256);

    test_one_chunk(h);
    test_merge(h);
    test_hole(h);
    test_remap(h);
    test_sweep_inside_one_op(h);
    test_too_long(h);
    test_bound(h);
    test_in_flight(h);
    spc_detach(h);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("device_cover_stub: ok\n");
    return 0;
}
