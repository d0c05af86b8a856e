/*
 * A rank killed with SIGKILL while the others wait in a barrier: their waits fail
 * with PEER_LOST naming the rank, well within their timeout; the dead client's
 * segment and registrations are gone from `clients`; the group stays broken; and
 * the daemon serves the next job.
 */
#include <signal.h>
#include <unistd.h>

#include "sp_test.h"

static char job_id[SPC_JOB_ID_MAX];
static int hold[2];          /* rank 2 blocks reading this; nobody writes */

static int rank_main(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, 3, (uint32_t)rank, 20000, &world));
    static char buf[2][8192];
    spc_region_t r;
    CHECK_OK(h, spc_register(h, buf[0], sizeof buf[0], &r));
    if (rank == 2) {
        CHECK_OK(h, spc_register(h, buf[1], sizeof buf[1], &r));
        char c;
        (void)!read(hold[0], &c, 1);   /* killed here */
        return 1;
    }
    uint64_t t0 = sp_test_now_ms();
    CHECK_ST(h, spc_barrier(h, world, 30000), SPC_ERR_PEER_LOST);
    uint64_t took = sp_test_now_ms() - t0;
    /* "lost: process exited" or "lost: connection closed", whichever the daemon
     * noticed first: the kernel closes the socket and signals the pidfd. */
    CHECK_CONTAINS(spc_last_error(h), "rank 2 (pid");
    CHECK_CONTAINS(spc_last_error(h), "lost: ");
    CHECK(took < 10000);
    /* The group stays broken: later ops fail at once, naming the same rank. */
    t0 = sp_test_now_ms();
    double *x = spc_alloc(h, sizeof *x);
    CHECK_ST(h, spc_allreduce(h, world, x, x, 1, SPC_F64, SPC_SUM, 30000), SPC_ERR_PEER_LOST);
    CHECK_CONTAINS(spc_last_error(h), "rank 2");
    CHECK(sp_test_now_ms() - t0 < 2000);
    spc_detach(h);
    return 0;
}

struct row { pid_t pid; int64_t inflight, regions; bool present; };

static struct row client_row(spc_handle_t *q, pid_t pid)
{
    spc_query_result_t *r;
    struct row out = { pid, 0, 0, false };
    CHECK_OK(q, spc_query(q, "clients", NULL, &r));
    for (size_t i = 0; i < spc_query_records(r); i++) {
        if (spc_query_int(r, i, (size_t)spc_query_find(r, i, "pid")) != pid)
            continue;
        out.present = true;
        out.inflight = spc_query_int(r, i, (size_t)spc_query_find(r, i, "inflight"));
        out.regions = spc_query_int(r, i, (size_t)spc_query_find(r, i, "regions"));
    }
    spc_query_free(r);
    return out;
}

static int rank_next(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    CHECK_OK(h, spc_barrier(h, world, 10000));
    return 0;
}

int main(void)
{
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    CHECK(pipe(hold) == 0);
    spc_handle_t *owner = sp_test_attach();
    CHECK_OK(owner, spc_job_create(owner, job_id, sizeof job_id));

    pid_t pids[3];
    for (int r = 0; r < 3; r++)
        pids[r] = sp_test_fork(rank_main, (void *)(intptr_t)r);

    /* Wait for the scene: ranks 0 and 1 inside their barrier (the daemon holds
     * their op), rank 2 with its two registrations. */
    bool ready = false;
    for (uint64_t end = sp_test_now_ms() + 20000; !ready && sp_test_now_ms() < end;) {
        struct row a = client_row(owner, pids[0]), b = client_row(owner, pids[1]), c = client_row(owner, pids[2]);
        ready = a.inflight == 1 && b.inflight == 1 && c.regions == 2;
    }
    CHECK(ready);

    CHECK_EQ(kill(pids[2], SIGKILL), 0);
    CHECK_EQ(sp_test_wait(pids[2], 5000), -SIGKILL);
    sp_test_wait_all_ok(pids, 2, 20000);

    /* The dead rank's segment and registrations are gone. */
    struct row c = client_row(owner, pids[2]);
    CHECK(!c.present);

    sp_test_run_job(2, rank_next, NULL);
    spc_detach(owner);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("peer_lost: ok\n");
    return 0;
}
