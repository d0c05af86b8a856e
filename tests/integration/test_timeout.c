/*
 * A rank that never arrives: the ranks that did time out with the missing rank
 * named; a late rank then gets the same error for that op; the next op of the
 * group works, because sequence numbers stayed aligned.
 */
#include <unistd.h>

#include "sp_test.h"

static int turn[2];

static spc_status_t barrier_timeout(spc_handle_t *h, spc_group_t world, uint32_t timeout_ms)
{
    spc_op_t op = { .struct_size = sizeof op, .opcode = SPC_OP_BARRIER, .group = world, .timeout_ms = timeout_ms };
    return sp_test_submit_wait(h, &op, 30000);
}

static int rank_main(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    char c = 'x';
    if (rank == 0) {
        uint64_t t0 = sp_test_now_ms();
        CHECK_ST(h, barrier_timeout(h, world, 300), SPC_ERR_TIMEOUT);
        uint64_t took = sp_test_now_ms() - t0;
        CHECK_CONTAINS(spc_last_error(h), "timed out waiting for rank 1 (1 of 2 missing) in barrier #0");
        CHECK(took >= 290 && took < 5000);
        CHECK(write(turn[1], &c, 1) == 1);
    } else {
        CHECK(read(turn[0], &c, 1) == 1);   /* arrives after rank 0 gave up */
        uint64_t t0 = sp_test_now_ms();
        CHECK_ST(h, barrier_timeout(h, world, 0), SPC_ERR_TIMEOUT);
        CHECK(sp_test_now_ms() - t0 < 2000);   /* at once: that op already failed */
        CHECK_CONTAINS(spc_last_error(h), "timed out waiting for rank 1");
    }
    /* Both at the next op: fine. */
    CHECK_OK(h, barrier_timeout(h, world, 0));
    double *x = spc_alloc(h, sizeof *x);
    *x = 1;
    CHECK_OK(h, spc_allreduce(h, world, x, x, 1, SPC_F64, SPC_SUM, 10000));
    CHECK_EQ(*x, 2);
    return 0;
}

int main(void)
{
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    CHECK(pipe(turn) == 0);
    sp_test_run_job(2, rank_main, NULL);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("timeout: ok\n");
    return 0;
}
