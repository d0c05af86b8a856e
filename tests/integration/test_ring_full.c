/*
 * Back-pressure: a rank that submits faster than its peers can match fills its
 * rings; submit then says RING_FULL and queues nothing. When the peer catches
 * up, every accepted op completes with its own, correct result: no entry was
 * overwritten.
 */
#include <unistd.h>

#include <sched.h>

#include "sp_test.h"

#define SQ 8                 /* the completion ring holds 16 */
#define MAXOPS 64

static int count_pipe[2];

struct child { const char *job; int rank; };

static int rank_main(void *arg)
{
    const char *job = ((struct child *)arg)->job;
    int rank = ((struct child *)arg)->rank;
    /* Small rings for this test: sq_entries = 8. */
    spc_attach_params_t p = { .struct_size = sizeof p, .sq_entries = SQ };
    spc_handle_t *h;
    CHECK_OK(NULL, spc_attach(&p, &h));
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job, 2, (uint32_t)rank, 20000, &world));

    double *x = spc_alloc(h, MAXOPS * sizeof *x);
    spc_request_t *r[MAXOPS];
    int n = 0;
    if (rank == 0) {
        /* Two limits say RING_FULL: a full SQ (the daemon has not taken the entries
         * yet; it will) and the completion ring's size in requests in flight
         * (nothing can complete until rank 1 arrives). Keep submitting until the
         * second, which is the steady state. */
        int sq_full = 0;
        uint64_t start = sp_test_now_ms(), end = start + 10000;
        while (n < MAXOPS && sp_test_now_ms() < end) {
            x[n] = n;
            spc_status_t st = spc_iallreduce(h, world, &x[n], &x[n], 1, SPC_F64, SPC_SUM, &r[n]);
            if (st == SPC_OK) {
                n++;
                continue;
            }
            CHECK_ST(h, st, SPC_ERR_RING_FULL);
            if (spc_inflight(h) == 2 * SQ)
                break;
            sq_full++;
        }
        CHECK_EQ(n, 2 * SQ);
        printf("rank 0: %d ops accepted in %llu ms (SQ full %d times on the way), then RING_FULL: %s\n", n,
               (unsigned long long)(sp_test_now_ms() - start), sq_full, spc_last_error(h));
        /* Asking again changes nothing. */
        spc_request_t *extra;
        CHECK_ST(h, spc_iallreduce(h, world, &x[n], &x[n], 1, SPC_F64, SPC_SUM, &extra), SPC_ERR_RING_FULL);
        CHECK_EQ(spc_inflight(h), 2 * SQ);
        CHECK(write(count_pipe[1], &n, sizeof n) == sizeof n);
    } else {
        CHECK(read(count_pipe[0], &n, sizeof n) == sizeof n);
        /* Twice as many ops as the SQ holds: a full SQ here just means "again". */
        for (int i = 0; i < n; i++) {
            x[i] = 1000.0 * i;
            spc_status_t st;
            while ((st = spc_iallreduce(h, world, &x[i], &x[i], 1, SPC_F64, SPC_SUM, &r[i])) == SPC_ERR_RING_FULL)
                sched_yield();
            CHECK_OK(h, st);
        }
    }
    for (int i = 0; i < n; i++) {
        CHECK_OK(h, spc_wait(r[i], 20000));
        spc_request_release(r[i]);
        if (x[i] != 1001.0 * i)
            SP_FAIL("rank %d op %d: %g, expected %g", rank, i, x[i], 1001.0 * i);
    }
    /* The rings drained; submitting works again. */
    x[0] = 1;
    CHECK_OK(h, spc_allreduce(h, world, x, x, 1, SPC_F64, SPC_SUM, 20000));
    CHECK_EQ(x[0], 2);
    spc_detach(h);
    return 0;
}

int main(void)
{
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    CHECK(pipe(count_pipe) == 0);
    spc_handle_t *owner = sp_test_attach();
    char job[SPC_JOB_ID_MAX];
    CHECK_OK(owner, spc_job_create(owner, job, sizeof job));
    struct child c0 = { job, 0 }, c1 = { job, 1 };
    pid_t pids[2] = { sp_test_fork(rank_main, &c0), sp_test_fork(rank_main, &c1) };
    sp_test_wait_all_ok(pids, 2, 60000);
    spc_detach(owner);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("ring_full: ok\n");
    return 0;
}
