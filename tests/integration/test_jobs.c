/* Jobs: create and join, and every way a join can be refused. */
#include <signal.h>
#include <unistd.h>

#include "sp_test.h"

static char job_id[SPC_JOB_ID_MAX];

static int join_late(void *arg)
{
    (void)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, 2, 1, 10000, &world));
    CHECK_OK(h, spc_barrier(h, world, 10000));
    spc_detach(h);
    return 0;
}

/* Rank 1 of a 2-rank world whose rank 0 never comes: the join times out, or
 * (with a long timeout) the process is killed while it waits. */
static int join_alone(void *arg)
{
    int timeout_ms = *(const int *)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_ST(h, spc_job_join(h, job_id, 2, 1, (uint32_t)timeout_ms, &world), SPC_ERR_TIMEOUT);
    spc_detach(h);
    return 0;
}

/*
 * A job lives while its creator or a rank in it is attached. Here the creator
 * leaves while one rank waits in its join; when that join ends, by its timeout
 * (kill == false) or by the rank's death, nobody holds the job and it must end.
 */
static void job_ends_with_last_joiner(spc_handle_t *watcher, bool kill_it)
{
    spc_handle_t *creator = sp_test_attach();
    CHECK_OK(creator, spc_job_create(creator, job_id, sizeof job_id));
    int timeout_ms = kill_it ? 60000 : 500;
    pid_t joiner = sp_test_fork(join_alone, &timeout_ms);
    CHECK(sp_test_wait_job_joined(watcher, job_id, 1, 10000));
    spc_detach(creator);
    CHECK(sp_test_wait_job_joined(watcher, job_id, 1, 0));   /* the waiting rank holds it */
    if (kill_it)
        kill(joiner, SIGKILL);
    CHECK_EQ(sp_test_wait(joiner, 20000), kill_it ? -SIGKILL : 0);
    if (!sp_test_wait_job_joined(watcher, job_id, -1, 10000))
        SP_FAIL("job %s outlived its creator and its last joining rank (%s)", job_id,
                kill_it ? "killed" : "timed out");
}

/* A rank of a 2-rank job that meets its peer in a barrier and leaves. */
static int barrier_rank(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    (void)rank, (void)nranks, (void)arg;
    CHECK_OK(h, spc_barrier(h, world, 10000));
    return 0;
}

/*
 * A launcher that stays attached and creates a job per run: each job ends once
 * its ranks have all left, so spd holds none of them, and a late join into one
 * hears that it ended. Only the last jobs' ids are remembered; an older one is
 * simply unknown.
 */
static void launcher_keeps_no_jobs(void)
{
    spc_handle_t *launcher = sp_test_attach();
    int64_t before = sp_test_status_int(launcher, "jobs");   /* the earlier cases' owner still holds some */
    char first[SPC_JOB_ID_MAX] = "";
    const int runs = 80;   /* more than spd remembers (64) */
    for (int i = 0; i < runs; i++) {
        char id[SPC_JOB_ID_MAX];
        CHECK_OK(launcher, spc_job_create(launcher, id, sizeof id));
        if (i == 0)
            snprintf(first, sizeof first, "%s", id);
        sp_test_run_job_in(id, 2, barrier_rank, NULL);
        CHECK(sp_test_wait_job_joined(launcher, id, -1, 10000));
        if (i == runs - 1) {
            spc_group_t world;
            CHECK_ST(launcher, spc_job_join(launcher, id, 2, 0, 1000, &world), SPC_ERR_BUSY);
            CHECK_CONTAINS(spc_last_error(launcher), "has ended (every rank left); create a new job");
        }
    }
    CHECK_EQ(sp_test_status_int(launcher, "jobs"), before);
    spc_group_t world;
    CHECK_ST(launcher, spc_job_join(launcher, first, 2, 0, 1000, &world), SPC_ERR_NOT_FOUND);
    CHECK_CONTAINS(spc_last_error(launcher), "no job");
    spc_detach(launcher);
}

int main(void)
{
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    spc_handle_t *owner = sp_test_attach(), *a = sp_test_attach(), *b = sp_test_attach();
    spc_group_t world;

    CHECK_OK(owner, spc_job_create(owner, job_id, sizeof job_id));
    CHECK(strchr(job_id, ':') != NULL);          /* node:token */
    CHECK_EQ(strlen(strchr(job_id, ':') + 1), 32);   /* 128-bit token in hex */
    char other[SPC_JOB_ID_MAX];
    CHECK_OK(owner, spc_job_create(owner, other, sizeof other));
    CHECK(strcmp(job_id, other) != 0);
    char tiny[4];
    CHECK_ST(owner, spc_job_create(owner, tiny, sizeof tiny), SPC_ERR_INVALID_ARG);

    CHECK_ST(a, spc_job_join(a, "nosuchnode:00", 2, 0, 1000, &world), SPC_ERR_NOT_FOUND);
    CHECK_ST(a, spc_job_join(a, job_id, 2, 2, 1000, &world), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(a), "rank 2 is not below the world size 2");
    CHECK_ST(a, spc_job_join(a, job_id, 0, 0, 1000, &world), SPC_ERR_INVALID_ARG);

    /* A join that nobody completes times out naming the missing ranks. */
    uint64_t t0 = sp_test_now_ms();
    CHECK_ST(a, spc_job_join(a, job_id, 3, 0, 300, &world), SPC_ERR_TIMEOUT);
    uint64_t took = sp_test_now_ms() - t0;
    CHECK(took >= 250 && took < 5000);
    CHECK_CONTAINS(spc_last_error(a), "ranks 1, 2 (2 of 3) have not joined");

    /* The world size is fixed by the first join that stays; a timed-out join
     * leaves its rank free again. */
    CHECK_ST(b, spc_job_join(b, job_id, 3, 0, 300, &world), SPC_ERR_TIMEOUT);
    pid_t late = sp_test_fork(join_late, NULL);
    CHECK_OK(a, spc_job_join(a, job_id, 2, 0, 10000, &world));
    CHECK_OK(a, spc_barrier(a, world, 10000));      /* meets the child's barrier */
    CHECK_EQ(sp_test_wait(late, 20000), 0);
    /* The child has left: the world is broken, whether or not the daemon saw the
     * leave before this barrier arrived. */
    CHECK_ST(a, spc_barrier(a, world, 10000), SPC_ERR_PEER_LOST);
    CHECK_CONTAINS(spc_last_error(a), "rank 1 (pid");
    /* Joining again on the same handle, or a started job, is refused. */
    CHECK_ST(a, spc_job_join(a, other, 1, 0, 1000, &world), SPC_ERR_BUSY);
    CHECK_CONTAINS(spc_last_error(a), "already rank 0 of job");
    CHECK_ST(b, spc_job_join(b, job_id, 2, 1, 1000, &world), SPC_ERR_BUSY);
    CHECK_CONTAINS(spc_last_error(b), "already started");

    /* World size mismatch against a rank that is waiting. */
    spc_handle_t *c = sp_test_attach();
    char third[SPC_JOB_ID_MAX];
    CHECK_OK(owner, spc_job_create(owner, third, sizeof third));
    /* rank 1 of a 2-rank world waits in a child; this handle then claims world 4 */
    snprintf(job_id, sizeof job_id, "%s", third);
    pid_t waiting = sp_test_fork(join_late, NULL);
    /* Wait until the child's join has reached the daemon (it shows up in the job). */
    bool seen = false;
    for (uint64_t end = sp_test_now_ms() + 10000; !seen && sp_test_now_ms() < end;) {
        spc_query_result_t *q;
        CHECK_OK(owner, spc_query(owner, "clients", NULL, &q));
        for (size_t i = 0; i < spc_query_records(q); i++) {
            long f = spc_query_find(q, i, "job");
            if (f >= 0 && strcmp(spc_query_str(q, i, (size_t)f), third) == 0)
                seen = true;
        }
        spc_query_free(q);
    }
    CHECK(seen);
    CHECK_ST(c, spc_job_join(c, third, 4, 0, 1000, &world), SPC_ERR_MISMATCH);
    CHECK_CONTAINS(spc_last_error(c), "has world size 2; this rank said 4");
    CHECK_ST(c, spc_job_join(c, third, 2, 1, 1000, &world), SPC_ERR_BUSY);
    CHECK_CONTAINS(spc_last_error(c), "rank 1 of job");
    CHECK_OK(c, spc_job_join(c, third, 2, 0, 10000, &world));
    CHECK_OK(c, spc_barrier(c, world, 10000));
    CHECK_EQ(sp_test_wait(waiting, 20000), 0);
    spc_detach(c);
    spc_detach(a);
    spc_detach(b);

    job_ends_with_last_joiner(owner, false);
    job_ends_with_last_joiner(owner, true);
    launcher_keeps_no_jobs();
    spc_detach(owner);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("jobs: ok\n");
    return 0;
}
