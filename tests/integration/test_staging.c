/*
 * Registered memory costs spd at most staging_bytes, whatever the client
 * registered. spd runs with staging_bytes = 32M, alone, or (--nodes N) as N
 * daemons on loopback with the ranks spread over them:
 *
 *   1. the attack: two ranks each register an untouched 1 GiB mapping
 *      (MAP_NORESERVE: it costs them nothing until written) and all-reduce it
 *      in place. spd's peak resident memory (VmHWM, reset before) may grow by
 *      the budget and some slack, not by the tensors' size. On one daemon the
 *      op streams and the sums of the few elements the ranks did write are
 *      right; across daemons, where each input would be read whole to be sent,
 *      both ranks are refused with SPC_ERR_LIMIT naming the option, and when
 *      only rank 0's input is registered, rank 1 hears that rank 0 was;
 *   2. the same bits as one pass: all-reduces (fp32 out of place, fp64 in
 *      place), an all-gather, a broadcast and cyclic and linear shifts of two
 *      tensors of different sizes, on 3 ranks, each several windows of
 *      staging and of sizes no window divides, checked byte for byte against
 *      references computed here (the all-reduces folded in rank order);
 *   3. an all-to-all, which cannot stream, larger than the budget: every rank
 *      is refused with SPC_ERR_LIMIT naming the op, the bytes, the budget and
 *      the option to raise, spd logs it, and then serves a small registered
 *      all-to-all and new jobs.
 */
#include <math.h>
#include <sys/mman.h>
#include <unistd.h>

#include "sp_test.h"

#define BUDGET      (32ull << 20)
#define SLACK       (64ull << 20)
#define BIG         (1ull << 30)
#define BIG_STRIDE  ((7ull << 20) + 12)   /* bytes between the elements the ranks write, a float apart */
#define WAIT_MS     60000

static sp_test_daemon_t d;
static int nodes;

/* ------------------------------------------------------------------ spd's memory */

/* A field of /proc/<spd>/status, in bytes. */
static uint64_t spd_status_bytes(const char *field)
{
    return (uint64_t)sp_test_proc_kib(d.pid, field) << 10;
}

/* Resets spd's peak resident size to what it holds now. */
static void spd_reset_peak(void)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/clear_refs", (int)d.pid);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    CHECK(fputs("5", f) >= 0);
    CHECK(fclose(f) == 0);
}

/* ------------------------------------------------------------------ 1. the untouched gigabyte */

static float big_value(int rank, uint64_t k)
{
    return (float)((rank + 1) * 1000 + (int)(k % 997));
}

static int rank_big(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    (void)arg;
    float *x = mmap(NULL, BIG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    CHECK(x != MAP_FAILED);
    for (uint64_t k = 0; k * BIG_STRIDE < BIG; k++)
        x[k * BIG_STRIDE / sizeof *x] = big_value(rank, k);
    spc_region_t reg;
    CHECK_OK(h, spc_register(h, x, BIG, &reg));
    if (nodes > 1) {
        CHECK_ST(h, spc_allreduce(h, world, x, x, BIG / sizeof *x, SPC_F32, SPC_SUM, WAIT_MS), SPC_ERR_LIMIT);
        char want[160];
        snprintf(want, sizeof want, "allreduce tensor 0: %llu bytes of registered memory to copy for 1 other daemon",
                 BIG);
        CHECK_CONTAINS(spc_last_error(h), want);
        snprintf(want, sizeof want, "staging_bytes (%llu): raise staging_bytes", BUDGET);
        CHECK_CONTAINS(spc_last_error(h), want);
        if (rank == 0)
            printf("1. refused across daemons: %s\n", spc_last_error(h));

        /* Rank 1 in its arena: only rank 0's daemon refuses, and rank 1 hears why. */
        const uint64_t count = (BUDGET + (4u << 20)) / sizeof *x;   /* over the budget by 4 MiB */
        float *y = rank == 0 ? x : spc_alloc(h, count * sizeof *y);
        CHECK(y != NULL);
        spc_status_t st = spc_allreduce(h, world, y, y, count, SPC_F32, SPC_SUM, WAIT_MS);
        CHECK_ST(h, st, rank == 0 ? SPC_ERR_LIMIT : SPC_ERR_PEER_REFUSED);
        CHECK_CONTAINS(spc_last_error(h), want);
        if (rank == 1) {
            CHECK_CONTAINS(spc_last_error(h), "rank 0");
            printf("1. rank 1, in its arena: %s\n", spc_last_error(h));
        }
        CHECK_OK(h, spc_barrier(h, world, WAIT_MS));   /* both heard before either leaves */
        CHECK_OK(h, spc_deregister(h, reg));
        munmap(x, BIG);
        return 0;
    }
    CHECK_OK(h, spc_allreduce(h, world, x, x, BIG / sizeof *x, SPC_F32, SPC_SUM, WAIT_MS));
    for (uint64_t k = 0; k * BIG_STRIDE < BIG; k++) {
        float want = 0;
        for (int q = 0; q < nranks; q++)
            want += big_value(q, k);
        float got = x[k * BIG_STRIDE / sizeof *x];
        if (got != want)
            SP_FAIL("rank %d: element %llu is %g, expected %g", rank,
                    (unsigned long long)(k * BIG_STRIDE / sizeof *x), got, want);
    }
    CHECK(x[1] == 0 && x[BIG / sizeof *x - 1] == 0);
    CHECK_OK(h, spc_deregister(h, reg));
    munmap(x, BIG);
    return 0;
}

static void test_big(void)
{
    spd_reset_peak();
    uint64_t before = spd_status_bytes("VmRSS");
    uint64_t t0 = sp_test_now_ms();
    sp_test_run_job(2, rank_big, NULL);
    uint64_t peak = spd_status_bytes("VmHWM");
    uint64_t grew = peak > before ? peak - before : 0;
    printf("1. an all-reduce of two untouched 1 GiB registrations (%d node%s) ended in %" PRIu64
           " ms: spd's peak grew by %" PRIu64 " MiB (budget %llu MiB)\n", nodes, nodes > 1 ? "s" : "",
           sp_test_now_ms() - t0, grew >> 20, BUDGET >> 20);
    if (grew >= BUDGET + SLACK)
        SP_FAIL("spd's peak resident memory grew by %" PRIu64 " MiB for 2 GiB of registered memory; the staging "
                "budget is %llu MiB (+%llu MiB slack)", grew >> 20, BUDGET >> 20, SLACK >> 20);
}

/* ------------------------------------------------------------------ 2. the same bits */

/* Order-sensitive values, as test_ops has them: wide magnitudes, both signs. */
static double value(int rank, uint64_t i, int salt)
{
    uint64_t x = (uint64_t)(rank + 1) * 0x9E3779B97F4A7C15ull ^ (i + 1) * 0xBF58476D1CE4E5B9ull ^
                 (uint64_t)salt * 0x94D049BB133111EBull;
    x ^= x >> 31;
    x *= 0xD6E8FEB86659FD93ull;
    x ^= x >> 29;
    double m = (double)(x & 0xFFFFF) / (double)0xFFFFF + 0.5;
    int e = (int)((x >> 20) % 48) - 24;
    return ((x >> 40) & 1 ? -1.0 : 1.0) * ldexp(m, e);
}

static uint8_t byte_of(int rank, uint64_t j, int salt)
{
    uint64_t x = (uint64_t)(rank + 1) * 0x9E3779B97F4A7C15ull ^ (j + 1) * 0xD6E8FEB86659FD93ull ^ (uint64_t)salt;
    x ^= x >> 31;
    x *= 0xBF58476D1CE4E5B9ull;
    x ^= x >> 29;
    return (uint8_t)(x >> 24);
}

/* Registered malloc'd memory; the region goes to *reg_p. */
static void *reg_alloc(spc_handle_t *h, size_t bytes, spc_region_t *reg_p)
{
    void *p = malloc(bytes);
    CHECK(p != NULL);
    CHECK_OK(h, spc_register(h, p, bytes, reg_p));
    return p;
}

static void reg_free(spc_handle_t *h, void *p, spc_region_t reg)
{
    CHECK_OK(h, spc_deregister(h, reg));
    free(p);
}

/* The first byte of got[0, n) that is not rank's byte_of (rank < 0: zero), or n. */
static uint64_t first_bad(const uint8_t *got, uint64_t n, int rank, int salt)
{
    uint64_t j = 0;
    while (j < n && got[j] == (rank < 0 ? 0 : byte_of(rank, j, salt)))
        j++;
    return j;
}

#define AR_F32 2500007ull    /* 3 ranks, 6 registered tensors: 60 MB, two windows */
#define AR_F64 1000003ull    /* in place: 48 MB, two windows */
#define AG     3000001ull    /* bytes per rank; 36 MB staged */
#define BC     12000017ull   /* 36 MB staged */
#define SH0    6000011ull    /* two tensors: 42 MB staged */
#define SH1    1000003ull

static int allreduces(spc_handle_t *h, spc_group_t world, int rank, int nranks)
{
    spc_region_t rs, rr;
    float *fs = reg_alloc(h, AR_F32 * sizeof *fs, &rs), *fr = reg_alloc(h, AR_F32 * sizeof *fr, &rr);
    for (uint64_t i = 0; i < AR_F32; i++)
        fs[i] = (float)value(rank, i, 1);
    CHECK_OK(h, spc_allreduce(h, world, fs, fr, AR_F32, SPC_F32, SPC_SUM, WAIT_MS));
    uint64_t bad = 0;
    for (uint64_t i = 0; i < AR_F32; i++) {
        float want = (float)value(0, i, 1);
        for (int q = 1; q < nranks; q++)
            want = want + (float)value(q, i, 1);
        bad += memcmp(&want, &fr[i], sizeof want) != 0;
        bad += fs[i] != (float)value(rank, i, 1);   /* the send is left alone */
    }
    if (bad)
        SP_FAIL("rank %d: %" PRIu64 " fp32 elements differ from the rank-order reference", rank, bad);
    reg_free(h, fs, rs);
    reg_free(h, fr, rr);

    double *x = reg_alloc(h, AR_F64 * sizeof *x, &rs);
    for (uint64_t i = 0; i < AR_F64; i++)
        x[i] = value(rank, i, 2);
    CHECK_OK(h, spc_allreduce(h, world, x, x, AR_F64, SPC_F64, SPC_SUM, WAIT_MS));
    for (uint64_t i = 0; i < AR_F64; i++) {
        double want = value(0, i, 2);
        for (int q = 1; q < nranks; q++)
            want = want + value(q, i, 2);
        bad += memcmp(&want, &x[i], sizeof want) != 0;
    }
    if (bad)
        SP_FAIL("rank %d: %" PRIu64 " fp64 elements differ from the rank-order reference (in place)", rank, bad);
    reg_free(h, x, rs);
    return 0;
}

static int copies(spc_handle_t *h, spc_group_t world, int rank, int nranks)
{
    spc_region_t rs, rr;
    uint8_t *s = reg_alloc(h, AG, &rs), *r = reg_alloc(h, AG * (uint64_t)nranks, &rr);
    for (uint64_t j = 0; j < AG; j++)
        s[j] = byte_of(rank, j, 3);
    CHECK_OK(h, spc_allgather(h, world, s, r, AG, SPC_U8, WAIT_MS));
    for (int q = 0; q < nranks; q++) {
        uint64_t j = first_bad(r + (uint64_t)q * AG, AG, q, 3);
        if (j < AG)
            SP_FAIL("rank %d: allgather byte %" PRIu64 " of rank %d's slot is wrong", rank, j, q);
    }
    reg_free(h, s, rs);
    reg_free(h, r, rr);

    uint8_t *b = reg_alloc(h, BC, &rs);
    for (uint64_t j = 0; j < BC; j++)
        b[j] = byte_of(rank, j, 4);
    CHECK_OK(h, spc_broadcast(h, world, b, BC, SPC_U8, 1, WAIT_MS));
    uint64_t j = first_bad(b, BC, 1, 4);
    if (j < BC)
        SP_FAIL("rank %d: broadcast byte %" PRIu64 " is wrong", rank, j);
    reg_free(h, b, rs);

    const uint64_t n[2] = { SH0, SH1 };
    spc_region_t regs[4];
    uint8_t *sb[2], *rb[2];
    for (uint32_t flags = 0; flags <= SPC_SHIFT_LINEAR; flags += SPC_SHIFT_LINEAR) {
        spc_shift_desc_t sd = { .struct_size = sizeof sd, .group = world, .flags = flags, .ntensors = 2 };
        for (int t = 0; t < 2; t++) {
            sb[t] = reg_alloc(h, n[t], &regs[2 * t]);
            rb[t] = reg_alloc(h, n[t], &regs[2 * t + 1]);
            for (uint64_t k = 0; k < n[t]; k++)
                sb[t][k] = byte_of(rank, k, 5 + t);
            memset(rb[t], 0xA5, n[t]);
            sd.tensors[t].send = sb[t];
            sd.tensors[t].recv = rb[t];
            sd.tensors[t].bytes = n[t];
        }
        CHECK_OK(h, spc_shift(h, &sd, WAIT_MS));
        int from = (rank + nranks - 1) % nranks;
        bool zeros = (flags & SPC_SHIFT_LINEAR) && rank == 0;
        for (int t = 0; t < 2; t++) {
            uint64_t k = first_bad(rb[t], n[t], zeros ? -1 : from, 5 + t);
            if (k < n[t])
                SP_FAIL("rank %d: shift (flags %u) tensor %d byte %" PRIu64 " is wrong", rank, flags, t, k);
            reg_free(h, sb[t], regs[2 * t]);
            reg_free(h, rb[t], regs[2 * t + 1]);
        }
    }
    return 0;
}

static int rank_bits(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    (void)arg;
    return allreduces(h, world, rank, nranks) || copies(h, world, rank, nranks);
}

/* ------------------------------------------------------------------ 3. what cannot stream */

#define A2A_HEADS 2
#define A2A_DIM   1024
#define A2A_SEQ   5120       /* 2 ranks of 2560 rows x 8 KiB: 20 MiB tensors, 40 MiB staged by each rank */

static int a2a(spc_handle_t *h, spc_group_t world, uint32_t seq, float *s, float *r)
{
    spc_alltoall_desc_t ad = { .struct_size = sizeof ad, .group = world, .dtype = SPC_F32,
                               .direction = SPC_SEQ_TO_HEAD, .layout = SPC_LAYOUT_BSHD, .batch = 1,
                               .seq_len = seq, .ntensors = 1 };
    ad.tensors[0] = (spc_a2a_tensor_t){ s, r, A2A_HEADS, A2A_DIM, SPC_HEADS_Q, 0 };
    return spc_alltoall(h, &ad, WAIT_MS);
}

static int rank_a2a(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    (void)arg;
    const size_t bytes = (size_t)A2A_SEQ / nranks * A2A_HEADS * A2A_DIM * sizeof(float);
    spc_region_t rs, rr;
    float *s = reg_alloc(h, bytes, &rs), *r = reg_alloc(h, bytes, &rr);
    memset(s, 0, bytes);
    CHECK_ST(h, a2a(h, world, A2A_SEQ, s, r), SPC_ERR_LIMIT);
    /* One daemon copies both ranks' send and receive; across daemons, each
     * refuses to read its rank's send whole (and pack it) for the other. */
    char want[160];
    if (nodes > 1)
        snprintf(want, sizeof want, "alltoall tensor 0: %zu bytes of registered memory to copy for 1 other daemon",
                 2 * bytes);
    else
        snprintf(want, sizeof want, "alltoall needs %zu bytes of registered memory staged at once", 4 * bytes);
    CHECK_CONTAINS(spc_last_error(h), want);
    snprintf(want, sizeof want, "staging_bytes (%llu): raise staging_bytes", BUDGET);
    CHECK_CONTAINS(spc_last_error(h), want);
    if (rank == 0)
        printf("3. refused: %s\n", spc_last_error(h));

    /* A small one goes through, its heads where they belong: rank q gets head q
     * of every row. */
    const uint32_t seq = 8, rows = seq / (uint32_t)nranks;
    for (uint32_t i = 0; i < rows * A2A_HEADS * A2A_DIM; i++)
        s[i] = (float)(rank * 1000000 + (int)i);
    CHECK_OK(h, a2a(h, world, seq, s, r));
    for (uint32_t g = 0; g < seq; g++)
        for (uint32_t e = 0; e < A2A_DIM; e++) {
            int owner = (int)(g / rows);
            float want_v = (float)(owner * 1000000 + (int)(((g % rows) * A2A_HEADS + (uint32_t)rank) * A2A_DIM + e));
            if (r[g * A2A_DIM + e] != want_v)
                SP_FAIL("rank %d: row %u element %u: %g, expected %g", rank, g, e, r[g * A2A_DIM + e], want_v);
        }
    reg_free(h, s, rs);
    reg_free(h, r, rr);
    return 0;
}

static void test_refused(void)
{
    sp_test_run_job(2, rank_a2a, NULL);
    char out[4096];
    sp_test_run(out, sizeof out, "grep -c 'alltoall.*staging_bytes (%llu): raise staging_bytes' %s", BUDGET, d.log);
    if (atoi(out) < 1)
        SP_FAIL("spd did not log the refusal (%s)", d.log);
    sp_test_daemon_serves();
}

int main(int argc, char **argv)
{
    setenv("SPD_STAGING_BYTES", "32M", 1);   /* every daemon the test starts */
    nodes = sp_test_start(&d, argc, argv);

    test_big();
    uint64_t t0 = sp_test_now_ms();
    sp_test_run_job(3, rank_bits, NULL);
    printf("2. allreduce, allgather, broadcast, shift through the staging windows: same bits (%" PRIu64 " ms)\n",
           sp_test_now_ms() - t0);
    test_refused();

    CHECK_EQ(sp_test_cluster_stop(), 0);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("ok\n");
    return 0;
}
