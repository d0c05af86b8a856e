/*
 * Barrier and allreduce across real ranks, checked against references computed
 * here by hand: the sum in rank order (x0 + x1) + x2 ..., in the element type.
 * Inputs are chosen so that another order gives other bits, so a wrong order
 * would be caught. Every rank must hold the same bits, run after run.
 */
#include <math.h>
#include <sys/mman.h>
#include <unistd.h>

#include "sp_test.h"

#define N 4099            /* not a multiple of anything convenient */
#define MAXR 8

/* Values over a wide range of magnitudes and both signs: fp sums of these depend
 * on the order of the additions. */
static double value(int rank, int i, int salt)
{
    uint64_t x = (uint64_t)(rank + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)(i + 1) * 0xBF58476D1CE4E5B9ull ^
                 (uint64_t)salt * 0x94D049BB133111EBull;
    x ^= x >> 31;
    x *= 0xD6E8FEB86659FD93ull;
    x ^= x >> 29;
    double m = (double)(x & 0xFFFFF) / (double)0xFFFFF + 0.5;
    int e = (int)((x >> 20) % 48) - 24;
    return ((x >> 40) & 1 ? -1.0 : 1.0) * ldexp(m, e);
}

struct results {
    double f64[MAXR][N];
    float  f32[MAXR][N];
    double max64[MAXR][N];
    float  min32[MAXR][N];
    double reg64[MAXR][N];
};

static struct results *res;

static int rank_ops(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    int salt = *(int *)arg;
    CHECK_OK(h, spc_barrier(h, world, 10000));

    double *d = spc_alloc(h, N * sizeof *d);
    float *f = spc_alloc(h, N * sizeof *f);
    double *dm = spc_alloc(h, N * sizeof *dm);
    float *fm = spc_alloc(h, N * sizeof *fm);
    CHECK(d && f && dm && fm);
    for (int i = 0; i < N; i++) {
        d[i] = value(rank, i, salt);
        f[i] = (float)value(rank, i, salt + 1);
        dm[i] = value(rank, i, salt + 2);
        fm[i] = (float)value(rank, i, salt + 3);
    }
    /* Four ops in flight before the first wait, waited for out of order. */
    spc_request_t *r[4];
    CHECK_OK(h, spc_iallreduce(h, world, d, d, N, SPC_F64, SPC_SUM, &r[0]));
    CHECK_OK(h, spc_iallreduce(h, world, f, f, N, SPC_F32, SPC_SUM, &r[1]));
    CHECK_OK(h, spc_iallreduce(h, world, dm, dm, N, SPC_F64, SPC_MAX, &r[2]));
    CHECK_OK(h, spc_iallreduce(h, world, fm, fm, N, SPC_F32, SPC_MIN, &r[3]));
    for (int k = 3; k >= 0; k--) {
        CHECK_OK(h, spc_wait(r[k], 10000));
        spc_request_release(r[k]);
    }

    /* The references, written independently of spd: fold ranks 0..P-1 in order. */
    int bad = 0;
    for (int i = 0; i < N; i++) {
        double sd = value(0, i, salt), md = value(0, i, salt + 2);
        float sf = (float)value(0, i, salt + 1), mf = (float)value(0, i, salt + 3);
        for (int k = 1; k < nranks; k++) {
            sd = sd + value(k, i, salt);
            sf = sf + (float)value(k, i, salt + 1);
            md = fmax(md, value(k, i, salt + 2));
            mf = fminf(mf, (float)value(k, i, salt + 3));
        }
        bad += memcmp(&sd, &d[i], sizeof sd) != 0;
        bad += memcmp(&sf, &f[i], sizeof sf) != 0;
        bad += md != dm[i];
        bad += mf != fm[i];
    }
    if (bad)
        SP_FAIL("rank %d: %d elements differ from the rank-order reference", rank, bad);
    memcpy(res->f64[rank], d, sizeof res->f64[rank]);
    memcpy(res->f32[rank], f, sizeof res->f32[rank]);
    memcpy(res->max64[rank], dm, sizeof res->max64[rank]);
    memcpy(res->min32[rank], fm, sizeof res->min32[rank]);

    /* Registered (non-arena) memory, and a mix of the two, out of place. */
    double *send = malloc(N * sizeof *send), *recv = malloc(N * sizeof *recv);
    spc_region_t rs, rr;
    CHECK_OK(h, spc_register(h, send, N * sizeof *send, &rs));
    CHECK_OK(h, spc_register(h, recv, N * sizeof *recv, &rr));
    CHECK(rs != rr && rs != SPC_REGION_ARENA);
    for (int i = 0; i < N; i++) {
        send[i] = value(rank, i, salt);
        recv[i] = -1;
    }
    CHECK_OK(h, spc_allreduce(h, world, send, recv, N, SPC_F64, SPC_SUM, 10000));
    CHECK(memcmp(recv, res->f64[rank], N * sizeof *recv) == 0);   /* same bits as through the arena */
    for (int i = 0; i < N; i++)
        CHECK_EQ(send[i] == value(rank, i, salt), 1);               /* send untouched */
    memcpy(res->reg64[rank], recv, sizeof res->reg64[rank]);
    for (int i = 0; i < N; i++)
        d[i] = value(rank, i, salt);
    CHECK_OK(h, spc_allreduce(h, world, d, recv, N, SPC_F64, SPC_SUM, 10000));   /* arena → registered */
    CHECK(memcmp(recv, res->f64[rank], N * sizeof *recv) == 0);
    CHECK_OK(h, spc_deregister(h, rs));
    CHECK_ST(h, spc_deregister(h, rs), SPC_ERR_BAD_REGION);
    CHECK_OK(h, spc_deregister(h, rr));
    free(send);
    free(recv);

    CHECK_OK(h, spc_barrier(h, world, 10000));
    return 0;
}

/* Ranks that disagree all hear so, with the ranks and fields named; the group
 * then goes on. */
static int rank_mismatch(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    double *x = spc_alloc(h, 16 * sizeof *x);
    for (int i = 0; i < 16; i++)
        x[i] = rank;
    spc_dtype_t dt = rank == 1 ? SPC_F64 : SPC_F32;
    CHECK_ST(h, spc_allreduce(h, world, x, x, 4, dt, SPC_SUM, 10000), SPC_ERR_MISMATCH);
    CHECK_CONTAINS(spc_last_error(h), "rank 1 sent dtype fp64, rank 0 sent fp32");
    CHECK_EQ(x[0], rank);   /* nothing was written */

    uint64_t count = rank == nranks - 1 ? 8 : 4;
    CHECK_ST(h, spc_allreduce(h, world, x, x, count, SPC_F64, SPC_SUM, 10000), SPC_ERR_MISMATCH);
    char want[64];
    snprintf(want, sizeof want, "rank %d sent count 8, rank 0 sent 4", nranks - 1);
    CHECK_CONTAINS(spc_last_error(h), want);

    /* One rank calls a barrier where the others reduce. */
    if (rank == 0)
        CHECK_ST(h, spc_barrier(h, world, 10000), SPC_ERR_MISMATCH);
    else
        CHECK_ST(h, spc_allreduce(h, world, x, x, 4, SPC_F64, SPC_SUM, 10000), SPC_ERR_MISMATCH);
    CHECK_CONTAINS(spc_last_error(h), "submitted allreduce where rank 0 submitted barrier");

    /* Unsupported combinations are refused by the daemon with the reason. */
    CHECK_ST(h, spc_allreduce(h, world, x, x, 4, SPC_U8, SPC_SUM, 10000), SPC_ERR_UNSUPPORTED);
    CHECK_CONTAINS(spc_last_error(h), "not supported");

    /* A group this rank is not in. */
    CHECK_ST(h, spc_barrier(h, world + 1000, 10000), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(h), "not a member");

    CHECK_OK(h, spc_allreduce(h, world, x, x, 4, SPC_F64, SPC_SUM, 10000));
    CHECK_EQ(x[0], nranks * (nranks - 1) / 2);
    return 0;
}

int main(void)
{
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    res = sp_test_shared(sizeof *res);
    struct results *first = sp_test_shared(sizeof *res);

    for (int p = 1; p <= 4; p++) {
        int salt = 11;
        memset(res, 0, sizeof *res);
        sp_test_run_job(p, rank_ops, &salt);
        /* Every rank holds the same bits. */
        for (int r = 1; r < p; r++) {
            CHECK(memcmp(res->f64[r], res->f64[0], sizeof res->f64[0]) == 0);
            CHECK(memcmp(res->f32[r], res->f32[0], sizeof res->f32[0]) == 0);
            CHECK(memcmp(res->max64[r], res->max64[0], sizeof res->max64[0]) == 0);
            CHECK(memcmp(res->min32[r], res->min32[0], sizeof res->min32[0]) == 0);
            CHECK(memcmp(res->reg64[r], res->reg64[0], sizeof res->reg64[0]) == 0);
        }
        /* The inputs are order-sensitive: summing in reverse gives other bits for
         * some elements, so the rank-order check above has teeth. */
        if (p >= 3) {
            int differ = 0;
            for (int i = 0; i < N; i++) {
                float rev = (float)value(p - 1, i, salt + 1);
                for (int k = p - 2; k >= 0; k--)
                    rev = rev + (float)value(k, i, salt + 1);
                differ += rev != res->f32[0][i];
            }
            printf("P=%d: %d of %d fp32 sums differ when taken in reverse rank order\n", p, differ, N);
            CHECK(differ > 0);
        }
        /* A rerun gives the same bits. */
        if (p == 4) {
            memcpy(first, res, sizeof *res);
            sp_test_run_job(p, rank_ops, &salt);
            CHECK(memcmp(first, res, sizeof *res) == 0);
        }
    }
    sp_test_run_job(3, rank_mismatch, NULL);

    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("ops: ok\n");
    return 0;
}
