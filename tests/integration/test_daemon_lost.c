/*
 * The daemon killed (SIGKILL) while clients wait, and no spd comes back: every
 * wait returns DAEMON_LOST once the clients' reconnect window (SPC_RECONNECT_MS,
 * 2 s here) passed without an spd on the socket, well within its own timeout,
 * saying so; every later call says the same at once. (test_restart: an spd that
 * comes back takes the clients over.)
 */
#include <signal.h>
#include <unistd.h>

#include "sp_test.h"

static char job_id[SPC_JOB_ID_MAX];

static int rank_main(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, 3, (uint32_t)rank, 20000, &world));
    if (rank == 2) {
        /* Never arrives: sleeps on its own, outside spd. */
        pause();
        return 1;
    }
    spc_request_t *r;
    CHECK_OK(h, spc_ibarrier(h, world, &r));
    uint64_t t0 = sp_test_now_ms();
    CHECK_ST(h, spc_wait(r, 20000), SPC_ERR_DAEMON_LOST);
    uint64_t took = sp_test_now_ms() - t0;
    CHECK_CONTAINS(spc_last_error(h), "spd closed the connection");
    CHECK_CONTAINS(spc_last_error(h), "no spd took it over within 2000 ms (SPC_RECONNECT_MS)");
    CHECK(took >= 2000 && took < 10000);
    printf("rank %d: DAEMON_LOST after %llu ms of waiting\n", rank, (unsigned long long)took);
    spc_request_release(r);
    CHECK_ST(h, spc_noop(h, 1000), SPC_ERR_DAEMON_LOST);
    CHECK_ST(h, spc_barrier(h, world, 1000), SPC_ERR_DAEMON_LOST);
    spc_region_t reg;
    static char buf[64];
    CHECK_ST(h, spc_register(h, buf, sizeof buf, &reg), SPC_ERR_DAEMON_LOST);
    spc_detach(h);   /* safe after the daemon is gone */
    return 0;
}

int main(void)
{
    sp_test_daemon_t d;
    setenv("SPC_RECONNECT_MS", "2000", 1);
    sp_test_daemon_start(&d, NULL);
    spc_handle_t *owner = sp_test_attach();
    CHECK_OK(owner, spc_job_create(owner, job_id, sizeof job_id));
    pid_t pids[3];
    for (int r = 0; r < 3; r++)
        pids[r] = sp_test_fork(rank_main, (void *)(intptr_t)r);

    /* Both waiters are in the daemon's hands: it holds their barrier ops. */
    CHECK(sp_test_wait_status(owner, "ops_inflight", 2, 20000));
    /* The waiters spin for 20 us and then sleep on their completion futex, so by
     * now they are asleep: the loss must be noticed from there. */

    CHECK_EQ(kill(d.pid, SIGKILL), 0);
    CHECK_EQ(sp_test_wait(d.pid, 5000), -SIGKILL);
    d.pid = 0;
    sp_test_wait_all_ok(pids, 2, 20000);
    kill(pids[2], SIGKILL);
    sp_test_wait(pids[2], 5000);
    CHECK_ST(owner, spc_noop(owner, 1000), SPC_ERR_DAEMON_LOST);
    spc_detach(owner);
    sp_test_daemon_cleanup(&d);
    printf("daemon_lost: ok\n");
    return 0;
}
