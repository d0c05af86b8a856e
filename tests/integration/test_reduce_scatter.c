/*
 * Reduce-scatter across real ranks of a real spd (or, with --nodes 2, of two),
 * checked against a reference this file computes on its own: rank r's receive
 * is block r of the element-wise fold of every rank's send, folded in rank
 * order ((x0 op x1) op x2 ...), 16-bit types widened exactly to fp32 and the
 * result rounded once to nearest, ties to even; integer sums wrap.
 *
 *   1. Every redop (sum, max, min) over every dtype of allreduce (fp32, fp64,
 *      fp16, bf16, int32, int64), at odd counts (1 and 1007), 18 ops in flight
 *      before the first wait; each block also has the bits of the same
 *      elements of an all-reduce of the sends, and nothing past a receive or in
 *      a send is written.
 *   2. Registered memory: on one daemon larger than its staging (2 MiB here),
 *      so the op runs in windows; across daemons, copied and its blocks packed
 *      for the other daemon. The same bits.
 *   3. Refusals: a dtype that cannot be reduced, send and receive overlapping,
 *      ranks that disagree on the reduction (MISMATCH naming it).
 */
#include <math.h>
#include <stdlib.h>

#include "sp_test.h"

#define MAXR  4
#define TMO   20000
#define TAIL  8            /* guard elements past each receive */
#define GUARD 0xA5

static const spc_dtype_t DTYPES[] = { SPC_F32, SPC_F64, SPC_F16, SPC_BF16, SPC_I32, SPC_I64 };
static const char *const DTYPE_NAMES[] = { "fp32", "fp64", "fp16", "bf16", "int32", "int64" };
#define NDT (sizeof DTYPES / sizeof DTYPES[0])
static const spc_redop_t REDOPS[] = { SPC_SUM, SPC_MAX, SPC_MIN };
static const char *const REDOP_NAMES[] = { "sum", "max", "min" };
#define NOP 3

static size_t dt_size(spc_dtype_t dt)
{
    return dt == SPC_F64 || dt == SPC_I64 ? 8 : dt == SPC_F16 || dt == SPC_BF16 ? 2 : 4;
}

static uint64_t mix(uint64_t a, uint64_t b, uint64_t c)
{
    uint64_t x = (a + 1) * 0x9E3779B97F4A7C15ull ^ (b + 1) * 0xC2B2AE3D27D4EB4Full ^ (c + 1) * 0x165667B19E3779F9ull;
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ull;
    return x ^ (x >> 33);
}

/* ---------------------------------------------------------------- 16-bit conversions */

/* bf16 is the top half of a float; fp16 goes through the compiler's _Float16
 * (both convert to nearest, ties to even). */
static float bf16_widen(uint16_t b)
{
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint16_t bf16_narrow(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);   /* inputs are finite: no NaN case */
}

static float fp16_widen(uint16_t b)
{
    _Float16 h;
    memcpy(&h, &b, sizeof h);
    return (float)h;
}

static uint16_t fp16_narrow(float f)
{
    _Float16 h = (_Float16)f;
    uint16_t b;
    memcpy(&b, &h, sizeof b);
    return b;
}

/* ---------------------------------------------------------------- inputs and reference */

/* Rank r's element i of the op (dtype index d, redop o): finite and non-zero,
 * of mixed magnitudes so that the order of a float sum shows in its bits. */
static void input(int d, int o, int r, uint64_t i, void *out)
{
    uint64_t x = mix((uint64_t)d * 8 + (uint64_t)o, (uint64_t)r, i);
    double v = (double)((x >> 11) % 2000001) / 1000.0 - 1000.0;
    v = (v == 0 ? 1.5 : v) * ldexp(1.0, (int)((x >> 3) % 9) - 4);
    switch (DTYPES[d]) {
    case SPC_F32: *(float *)out = (float)v; break;
    case SPC_F64: *(double *)out = v * 1.000000001; break;
    case SPC_F16: *(uint16_t *)out = fp16_narrow((float)v); break;
    case SPC_BF16: *(uint16_t *)out = bf16_narrow((float)v); break;
    case SPC_I32: *(int32_t *)out = (int32_t)(uint32_t)x; break;
    case SPC_I64: *(int64_t *)out = (int64_t)x; break;
    default: break;
    }
}

static double fold_d(double acc, double x, int o)
{
    return o == 0 ? acc + x : o == 1 ? (x > acc ? x : acc) : (x < acc ? x : acc);
}

static float fold_f(float acc, float x, int o)
{
    return o == 0 ? acc + x : o == 1 ? (x > acc ? x : acc) : (x < acc ? x : acc);
}

/* Element i of the reduction over P ranks, in rank order. */
static void reference(int d, int o, int P, uint64_t i, void *out)
{
    union { float f; double g; uint16_t h; int32_t i32; int64_t i64; } x, acc;
    input(d, o, 0, i, &acc);
    float wide = DTYPES[d] == SPC_F16 ? fp16_widen(acc.h) : DTYPES[d] == SPC_BF16 ? bf16_widen(acc.h) : 0;
    for (int r = 1; r < P; r++) {
        input(d, o, r, i, &x);
        switch (DTYPES[d]) {
        case SPC_F32: acc.f = fold_f(acc.f, x.f, o); break;
        case SPC_F64: acc.g = fold_d(acc.g, x.g, o); break;
        case SPC_F16: wide = fold_f(wide, fp16_widen(x.h), o); break;
        case SPC_BF16: wide = fold_f(wide, bf16_widen(x.h), o); break;
        case SPC_I32:
            acc.i32 = o == 0 ? (int32_t)((uint32_t)acc.i32 + (uint32_t)x.i32)
                             : o == 1 ? (x.i32 > acc.i32 ? x.i32 : acc.i32) : (x.i32 < acc.i32 ? x.i32 : acc.i32);
            break;
        case SPC_I64:
            acc.i64 = o == 0 ? (int64_t)((uint64_t)acc.i64 + (uint64_t)x.i64)
                             : o == 1 ? (x.i64 > acc.i64 ? x.i64 : acc.i64) : (x.i64 < acc.i64 ? x.i64 : acc.i64);
            break;
        default: break;
        }
    }
    if (DTYPES[d] == SPC_F16)
        acc.h = fp16_narrow(wide);
    else if (DTYPES[d] == SPC_BF16)
        acc.h = bf16_narrow(wide);
    memcpy(out, &acc, dt_size(DTYPES[d]));
}

/* Checks rank's receive (count elements, then TAIL guards) against block `rank`
 * of the reference, and, when `ar` is not NULL, against the same elements of
 * an all-reduce's result. */
static void check_block(int d, int o, int P, int rank, uint64_t count, const uint8_t *recv, const uint8_t *ar,
                        const char *what)
{
    const size_t es = dt_size(DTYPES[d]);
    uint8_t want[8];
    for (uint64_t e = 0; e < count; e++) {
        reference(d, o, P, (uint64_t)rank * count + e, want);
        if (memcmp(recv + e * es, want, es) != 0) {
            uint64_t got = 0, exp = 0;
            memcpy(&got, recv + e * es, es);
            memcpy(&exp, want, es);
            SP_FAIL("P=%d rank %d: %s %s %s count %" PRIu64 ": element %" PRIu64 " is 0x%" PRIx64 ", the rank-order "
                    "fold is 0x%" PRIx64, P, rank, what, DTYPE_NAMES[d], REDOP_NAMES[o], count, e, got, exp);
        }
        if (ar != NULL && memcmp(recv + e * es, ar + ((uint64_t)rank * count + e) * es, es) != 0)
            SP_FAIL("P=%d rank %d: %s %s %s element %" PRIu64 ": not the all-reduce's bits", P, rank, what,
                    DTYPE_NAMES[d], REDOP_NAMES[o], e);
    }
    for (size_t k = 0; k < TAIL * es; k++)
        if (recv[count * es + k] != GUARD)
            SP_FAIL("P=%d rank %d: %s %s %s wrote past its receive (byte %zu)", P, rank, what, DTYPE_NAMES[d],
                    REDOP_NAMES[o], k);
}

/* ---------------------------------------------------------------- 1. every dtype and redop */

static int rank_all(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    const uint64_t count = *(const uint64_t *)arg;
    uint8_t *send[NDT][NOP], *recv[NDT][NOP], *ar[NDT][NOP];
    spc_request_t *req[NDT][NOP];

    for (int d = 0; d < (int)NDT; d++)
        for (int o = 0; o < NOP; o++) {
            const size_t es = dt_size(DTYPES[d]), n = (size_t)P * count;
            send[d][o] = spc_alloc(h, n * es);
            recv[d][o] = spc_alloc(h, (count + TAIL) * es);
            ar[d][o] = spc_alloc(h, n * es);
            CHECK(send[d][o] != NULL && recv[d][o] != NULL && ar[d][o] != NULL);
            for (size_t e = 0; e < n; e++)
                input(d, o, rank, e, send[d][o] + e * es);
            memset(recv[d][o], GUARD, (count + TAIL) * es);
        }
    for (int d = 0; d < (int)NDT; d++)
        for (int o = 0; o < NOP; o++)
            CHECK_OK(h, spc_ireduce_scatter(h, world, send[d][o], recv[d][o], count, DTYPES[d], REDOPS[o],
                                            &req[d][o]));
    for (int d = 0; d < (int)NDT; d++)
        for (int o = 0; o < NOP; o++) {
            spc_status_t st = spc_wait(req[d][o], TMO);
            if (st != SPC_OK)
                SP_FAIL("rank %d: %s %s reduce_scatter: %s (%s)", rank, DTYPE_NAMES[d], REDOP_NAMES[o],
                        spc_status_name(st), spc_request_detail(req[d][o]));
            spc_request_release(req[d][o]);
            CHECK_OK(h, spc_allreduce(h, world, send[d][o], ar[d][o], (uint64_t)P * count, DTYPES[d], REDOPS[o],
                                      TMO));
            check_block(d, o, P, rank, count, recv[d][o], ar[d][o], "arena");
            const size_t es = dt_size(DTYPES[d]);
            uint8_t x[8];
            for (uint64_t e = 0; e < (uint64_t)P * count; e++) {
                input(d, o, rank, e, x);
                if (memcmp(send[d][o] + e * es, x, es) != 0)
                    SP_FAIL("P=%d rank %d: %s %s reduce_scatter wrote its send at %" PRIu64, P, rank,
                            DTYPE_NAMES[d], REDOP_NAMES[o], e);
            }
            spc_free(h, send[d][o]);
            spc_free(h, recv[d][o]);
            spc_free(h, ar[d][o]);
        }
    return 0;
}

/* ---------------------------------------------------------------- 2. registered memory, in windows */

/* Elements per block: on one daemon, 4 ranks' sends of 1 MiB and receives run
 * past the 2 MiB of staging, in windows; across daemons, each send is copied
 * (and its blocks packed) for the other daemon within that budget, two ops'
 * worth of it at once. */
#define REG_COUNT       65535u
#define REG_COUNT_NODES 16383u

static int rank_registered(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    const uint64_t count = *(const uint64_t *)arg;
    static const struct { int d, o; } cases[] = { { 0, 0 }, { 3, 1 }, { 4, 2 } };   /* fp32 sum, bf16 max, int32 min */
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        const int d = cases[c].d, o = cases[c].o;
        const size_t es = dt_size(DTYPES[d]), n = (size_t)P * count;
        uint8_t *send = malloc(n * es), *recv = malloc((count + TAIL) * es);
        CHECK(send != NULL && recv != NULL);
        for (size_t e = 0; e < n; e++)
            input(d, o, rank, e, send + e * es);
        memset(recv, GUARD, (count + TAIL) * es);
        spc_region_t rs, rr;
        CHECK_OK(h, spc_register(h, send, n * es, &rs));
        CHECK_OK(h, spc_register(h, recv, (count + TAIL) * es, &rr));
        CHECK_OK(h, spc_reduce_scatter(h, world, send, recv, count, DTYPES[d], REDOPS[o], TMO));
        check_block(d, o, P, rank, count, recv, NULL, "registered");
        CHECK_OK(h, spc_deregister(h, rs));
        CHECK_OK(h, spc_deregister(h, rr));
        free(send);
        free(recv);
    }
    return 0;
}

/* ---------------------------------------------------------------- 3. refusals */

static int rank_refused(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    uint8_t *buf = spc_alloc(h, 256);
    CHECK(buf != NULL);
    memset(buf, 1, 256);
    CHECK_ST(h, spc_reduce_scatter(h, world, buf, buf + 128, 16, SPC_U8, SPC_SUM, TMO), SPC_ERR_UNSUPPORTED);
    CHECK_ST(h, spc_reduce_scatter(h, world, buf, buf + 4, 4, SPC_F32, SPC_SUM, TMO), SPC_ERR_INVALID_ARG);
    spc_free(h, buf);
    return 0;
}

/* Two ranks that disagree on the reduction: both hear it, naming the field. */
static int rank_mismatch(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    float *send = spc_alloc(h, (size_t)P * 16 * sizeof *send), *recv = spc_alloc(h, 16 * sizeof *recv);
    CHECK(send != NULL && recv != NULL);
    memset(send, 0, (size_t)P * 16 * sizeof *send);
    spc_request_t *r;
    CHECK_OK(h, spc_ireduce_scatter(h, world, send, recv, 16, SPC_F32, rank == 0 ? SPC_SUM : SPC_MAX, &r));
    CHECK_EQ(spc_wait(r, TMO), SPC_ERR_MISMATCH);
    if (strstr(spc_request_detail(r), "redop max") == NULL)
        SP_FAIL("rank %d: the mismatch does not name the redop: %s", rank, spc_request_detail(r));
    spc_request_release(r);
    spc_free(h, send);
    spc_free(h, recv);
    return 0;
}

int main(int argc, char **argv)
{
    uint64_t t0 = sp_test_now_ms();
    sp_test_daemon_t d;

    setenv("SPD_STAGING_BYTES", "2M", 1);   /* every daemon the test starts */
    int nodes = sp_test_start(&d, argc, argv);
    static const uint64_t counts[] = { 1, 1007 };
    for (int P = 1; P <= MAXR; P++)
        for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++)
            sp_test_run_job(P, rank_all, (void *)&counts[c]);
    printf("1. every redop and dtype, counts 1 and 1007, P = 1 .. %d: the rank-order fold, the all-reduce's bits\n",
           MAXR);
    const uint64_t reg_count = nodes == 1 ? REG_COUNT : REG_COUNT_NODES;
    sp_test_run_job(MAXR, rank_registered, (void *)&reg_count);
    printf("2. registered memory through the staging windows: the same bits\n");
    sp_test_run_job(1, rank_refused, NULL);   /* one rank: its own refusal, not its peers' */
    sp_test_run_job(2, rank_mismatch, NULL);
    printf("3. refusals: a type that cannot be reduced, overlapping buffers, ranks that disagree\n");

    CHECK_EQ(sp_test_cluster_stop(), 0);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("reduce_scatter: ok (%" PRIu64 " ms)\n", sp_test_now_ms() - t0);
    return 0;
}
