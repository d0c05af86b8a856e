/*
 * The failure matrix's lifecycle cells: clients and daemons that die, exit or
 * come back at awkward moments, through a real spd and real rank processes. Each
 * cell asserts the error every survivor hears, that it comes well within the
 * op's timeout, that nothing already delivered is lost or overwritten, and that
 * spd keeps serving with nothing of the dead client left behind.
 *
 *   kill before    a rank SIGKILLed after joining, before any op: the others'
 *                  first op fails at once with PEER_LOST naming it, their
 *                  receive buffers untouched, their handles still good.
 *   kill after     a rank SIGKILLed after its ops completed, the last one
 *                  submitted but never reaped: the others keep both results,
 *                  bit for bit; their next op fails naming it.
 *   exit           a rank that returns from main without spc_detach while the
 *                  others wait for it: PEER_LOST naming it, exit status 0.
 *   rejoin         a rank SIGKILLed while its join waits for the others: its
 *                  slot is freed and a new process joins the same job as the
 *                  same rank; the job then runs correctly.
 *   too late       the replacement of a rank lost after the start, once the
 *                  others left too: its join into the old job is refused (BUSY,
 *                  "has ended ... create a new job"), though the job's creator
 *                  is still attached, and the same handle runs in a new job.
 *   spd restart    spd SIGKILLed while ranks wait, their clients not to be
 *                  taken over (SPC_RECONNECT_MS=0): DAEMON_LOST at once; a new
 *                  spd on the same socket removes the stale one, and the same
 *                  rank processes attach again and run a new job. (test_restart:
 *                  clients that a new spd takes over, jobs and all.)
 *
 * The rest of the matrix lives beside this one; docs/failure-matrix.md maps each
 * case to its test, and `ctest -L matrix` runs them all.
 */
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include "sp_test.h"

#define N      1024          /* doubles per all-reduce */
#define WORLD  3
#define VICTIM 2             /* the rank that dies in each cell */

static sp_test_daemon_t d;

/* What the parent hands its rank processes: the job, and two pipes. Children
 * send single bytes `up` ("I got here") and read single bytes `down` ("go
 * on"). The victim blocks on `hold`, which nobody writes: it is killed there. */
static struct shared {
    char job[SPC_JOB_ID_MAX];
    char job2[SPC_JOB_ID_MAX];
} *sh;
static int up[2], down[2], hold[2];

static void put(int fd, char c)
{
    CHECK(write(fd, &c, 1) == 1);
}

static char take(int fd)
{
    struct pollfd p = { .fd = fd, .events = POLLIN };
    CHECK(poll(&p, 1, 30000) == 1);
    char c;
    CHECK(read(fd, &c, 1) == 1);
    return c;
}

static void take_n(int fd, int n, char want)
{
    for (int i = 0; i < n; i++)
        CHECK_EQ(take(fd), want);
}

static void block_until_killed(void)
{
    char c;
    (void)!read(hold[0], &c, 1);
    _exit(1);   /* only if the parent died */
}

/* Rank r's contribution to all-reduce k, and the sum every rank must get:
 * computed from the formula, not by the code under test. */
static double input(int k, int r, int i)
{
    return (double)((k + 1) * 100000 + (r + 1) * 1000 + i);
}

static double expected_sum(int k, int world, int i)
{
    return (double)(world * (k + 1) * 100000 + 1000 * world * (world + 1) / 2 + world * i);
}

static void fill(double *x, int k, int r)
{
    for (int i = 0; i < N; i++)
        x[i] = input(k, r, i);
}

static void check_sum(const double *x, int k, int world)
{
    for (int i = 0; i < N; i++)
        if (x[i] != expected_sum(k, world, i))
            SP_FAIL("all-reduce %d, element %d: %.1f, expected %.1f", k, i, x[i], expected_sum(k, world, i));
}

static void check_untouched(const double *x)
{
    for (int i = 0; i < N; i++)
        if (x[i] != -1.0)
            SP_FAIL("receive buffer written at %d (%.1f) by a failed op", i, x[i]);
}

static void set_untouched(double *x)
{
    for (int i = 0; i < N; i++)
        x[i] = -1.0;
}

static spc_handle_t *join(const char *job, int world_size, int rank, spc_group_t *world)
{
    spc_handle_t *h = sp_test_attach();
    CHECK_OK(h, spc_job_join(h, job, (uint32_t)world_size, (uint32_t)rank, 20000, world));
    return h;
}

/* A rank that runs one all-reduce in `job` and checks it. */
struct ok_rank {
    const char *job;
    int world_size, rank;
};

static int ok_rank_main(void *arg)
{
    const struct ok_rank *a = arg;
    spc_group_t world;
    spc_handle_t *h = join(a->job, a->world_size, a->rank, &world);
    double *x = spc_alloc(h, N * sizeof *x);
    fill(x, 0, a->rank);
    CHECK_OK(h, spc_allreduce(h, world, x, x, N, SPC_F64, SPC_SUM, 20000));
    check_sum(x, 0, a->world_size);
    spc_detach(h);
    return 0;
}

/* Forks ranks [from, to) of a world_size job running ok_rank_main. */
static void fork_ok_ranks(pid_t *pids, const char *job, int world_size, int from, int to)
{
    for (int r = from; r < to; r++) {
        struct ok_rank a = { job, world_size, r };
        pids[r] = sp_test_fork(ok_rank_main, &a);
    }
}

/* A survivor's op on a group the victim broke: PEER_LOST naming the victim,
 * at once, and nothing written. */
static void expect_peer_lost(spc_handle_t *h, spc_group_t world, double *send, double *recv)
{
    set_untouched(recv);
    uint64_t t0 = sp_test_now_ms();
    CHECK_ST(h, spc_allreduce(h, world, send, recv, N, SPC_F64, SPC_SUM, 20000), SPC_ERR_PEER_LOST);
    uint64_t took = sp_test_now_ms() - t0;
    CHECK_CONTAINS(spc_last_error(h), "rank 2 (pid");
    CHECK(took < 5000);
    check_untouched(recv);
}

/* Waits until spd no longer lists a client of pid (its session and segment are
 * gone). */
static void wait_client_gone(spc_handle_t *q, pid_t pid)
{
    for (uint64_t end = sp_test_now_ms() + 10000; sp_test_now_ms() < end; usleep(2000)) {
        spc_query_result_t *r;
        CHECK_OK(q, spc_query(q, "clients", NULL, &r));
        bool present = false;
        for (size_t i = 0; i < spc_query_records(r); i++)
            present |= spc_query_int(r, i, (size_t)spc_query_find(r, i, "pid")) == pid;
        spc_query_free(r);
        if (!present)
            return;
    }
    SP_FAIL("spd still lists the client of pid %d 10 s after it died", (int)pid);
}

/* After each cell: only the test's own handle is attached, and new clients are
 * served. */
static void after_cell(spc_handle_t *owner, const char *cell, uint64_t t0)
{
    CHECK(sp_test_wait_status(owner, "clients", 1, 10000));
    sp_test_daemon_serves();
    printf("%-12s ok (%llu ms)\n", cell, (unsigned long long)(sp_test_now_ms() - t0));
    fflush(stdout);
}

static void pipes_open(void)
{
    CHECK(pipe(up) == 0 && pipe(down) == 0 && pipe(hold) == 0);
}

static void pipes_close(void)
{
    int *all[] = { up, down, hold };
    for (int i = 0; i < 3; i++) {
        close(all[i][0]);
        close(all[i][1]);
    }
}

static void kill_and_reap(spc_handle_t *owner, pid_t pid)
{
    CHECK_EQ(kill(pid, SIGKILL), 0);
    CHECK_EQ(sp_test_wait(pid, 5000), -SIGKILL);
    wait_client_gone(owner, pid);
}

/* Opens the pipes, creates the cell's job and forks its WORLD ranks. */
static void cell_start(spc_handle_t *owner, int (*rank_main)(void *), pid_t *pids)
{
    pipes_open();
    CHECK_OK(owner, spc_job_create(owner, sh->job, sizeof sh->job));
    for (int r = 0; r < WORLD; r++)
        pids[r] = sp_test_fork(rank_main, (void *)(intptr_t)r);
}

/* One byte from each rank, in any order: `victim` from the victim, `survivor`
 * from every other. */
static void take_roles(char victim, char survivor)
{
    int v = 0, s = 0;
    for (int i = 0; i < WORLD; i++) {
        char c = take(up[0]);
        v += c == victim;
        s += c == survivor;
    }
    CHECK(v == 1 && s == WORLD - 1);
}

static void release_survivors(void)
{
    for (int i = 0; i < WORLD - 1; i++)
        put(down[1], 'g');
}

/* ------------------------------------------------------------ kill before an op */

static int before_rank(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_group_t world;
    spc_handle_t *h = join(sh->job, WORLD, rank, &world);
    double *send = spc_alloc(h, 2 * N * sizeof(double)), *recv = send + N;
    put(up[1], 'j');
    if (rank == VICTIM)
        block_until_killed();
    take(down[0]);   /* the victim is gone */
    fill(send, 0, rank);
    expect_peer_lost(h, world, send, recv);
    CHECK_OK(h, spc_noop(h, 5000));   /* the handle itself is fine */
    spc_detach(h);
    return 0;
}

static void cell_kill_before(spc_handle_t *owner)
{
    uint64_t t0 = sp_test_now_ms();
    pid_t pids[WORLD];
    cell_start(owner, before_rank, pids);
    take_n(up[0], WORLD, 'j');
    kill_and_reap(owner, pids[VICTIM]);
    release_survivors();
    sp_test_wait_all_ok(pids, VICTIM, 30000);
    pipes_close();
    after_cell(owner, "kill before", t0);
}

/* ------------------------------------------------------------ kill after an op */

static int after_rank(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_group_t world;
    spc_handle_t *h = join(sh->job, WORLD, rank, &world);
    double *buf = spc_alloc(h, 4 * N * sizeof(double));
    double *send = buf, *r0 = buf + N, *r1 = buf + 2 * N, *r2 = buf + 3 * N;

    fill(send, 0, rank);
    CHECK_OK(h, spc_allreduce(h, world, send, r0, N, SPC_F64, SPC_SUM, 20000));
    check_sum(r0, 0, WORLD);

    /* The second all-reduce reads a separate send buffer: the first is reused
     * for the third. */
    double *send1 = spc_alloc(h, N * sizeof(double));
    fill(send1, 1, rank);
    spc_request_t *req;
    CHECK_OK(h, spc_iallreduce(h, world, send1, r1, N, SPC_F64, SPC_SUM, &req));
    if (rank == VICTIM) {
        put(up[1], 'v');        /* submitted, never reaped */
        block_until_killed();
    }
    CHECK_OK(h, spc_wait(req, 20000));
    spc_request_release(req);
    check_sum(r1, 1, WORLD);
    put(up[1], 'd');
    take(down[0]);   /* the victim is gone */

    /* Nothing delivered was lost when spd let the victim's memory go. */
    check_sum(r0, 0, WORLD);
    check_sum(r1, 1, WORLD);
    fill(send, 2, rank);
    expect_peer_lost(h, world, send, r2);
    spc_detach(h);
    return 0;
}

static void cell_kill_after(spc_handle_t *owner)
{
    uint64_t t0 = sp_test_now_ms();
    pid_t pids[WORLD];
    cell_start(owner, after_rank, pids);
    take_roles('v', 'd');
    kill_and_reap(owner, pids[VICTIM]);
    release_survivors();
    sp_test_wait_all_ok(pids, VICTIM, 30000);
    pipes_close();
    after_cell(owner, "kill after", t0);
}

/* ------------------------------------------------------------ exit without detaching */

static int exit_rank(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_group_t world;
    spc_handle_t *h = join(sh->job, WORLD, rank, &world);
    double *send = spc_alloc(h, 2 * N * sizeof(double)), *recv = send + N;
    if (rank == VICTIM) {
        put(up[1], 'j');
        take(down[0]);
        exit(0);   /* as a program returning from main: no spc_detach */
    }
    fill(send, 0, rank);
    set_untouched(recv);
    spc_request_t *req;
    CHECK_OK(h, spc_iallreduce(h, world, send, recv, N, SPC_F64, SPC_SUM, &req));
    put(up[1], 'w');
    uint64_t t0 = sp_test_now_ms();
    CHECK_ST(h, spc_wait(req, 20000), SPC_ERR_PEER_LOST);
    CHECK(sp_test_now_ms() - t0 < 10000);
    CHECK_CONTAINS(spc_request_detail(req), "rank 2 (pid");
    spc_request_release(req);
    check_untouched(recv);
    spc_detach(h);
    return 0;
}

static void cell_exit(spc_handle_t *owner)
{
    uint64_t t0 = sp_test_now_ms();
    pid_t pids[WORLD];
    cell_start(owner, exit_rank, pids);
    take_roles('j', 'w');
    /* Both survivors' all-reduces are in spd's hands before the victim leaves. */
    CHECK(sp_test_wait_status(owner, "ops_inflight", 2, 10000));
    put(down[1], 'g');
    CHECK_EQ(sp_test_wait(pids[VICTIM], 10000), 0);
    sp_test_wait_all_ok(pids, VICTIM, 30000);
    pipes_close();
    after_cell(owner, "exit", t0);
}

/* ------------------------------------------------------------ a new process in a joining job */

static int joining_victim(void *arg)
{
    (void)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    put(up[1], 'a');
    spc_job_join(h, sh->job, WORLD, VICTIM, 60000, &world);   /* killed in here */
    return 1;
}

static void cell_rejoin(spc_handle_t *owner)
{
    uint64_t t0 = sp_test_now_ms();
    CHECK_OK(owner, spc_job_create(owner, sh->job, sizeof sh->job));
    pipes_open();
    pid_t victim = sp_test_fork(joining_victim, NULL);
    take(up[0]);
    CHECK(sp_test_wait_job_joined(owner, sh->job, 1, 10000));
    kill_and_reap(owner, victim);
    CHECK(sp_test_wait_job_joined(owner, sh->job, 0, 0));   /* the slot is free again */

    /* The replacement first, then the rest: the job completes with it. */
    pid_t pids[WORLD];
    fork_ok_ranks(pids, sh->job, WORLD, VICTIM, WORLD);
    fork_ok_ranks(pids, sh->job, WORLD, 0, VICTIM);
    sp_test_wait_all_ok(pids, WORLD, 30000);
    pipes_close();
    after_cell(owner, "rejoin", t0);
}

/* ------------------------------------------------------------ a new process after the start */

static int late_replacement(void *arg)
{
    (void)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_ST(h, spc_job_join(h, sh->job, WORLD, VICTIM, 20000, &world), SPC_ERR_BUSY);
    /* Its ranks have all left by now, so the job has ended (while one stays,
     * "has already started": the soak meets that one). */
    CHECK_CONTAINS(spc_last_error(h), "has ended (every rank left); create a new job");
    put(up[1], 'r');
    take(down[0]);   /* job2 exists */
    /* The refused join left the handle as it was: it joins the new job. */
    CHECK_OK(h, spc_job_join(h, sh->job2, WORLD, VICTIM, 20000, &world));
    double *x = spc_alloc(h, N * sizeof *x);
    fill(x, 0, VICTIM);
    CHECK_OK(h, spc_allreduce(h, world, x, x, N, SPC_F64, SPC_SUM, 20000));
    check_sum(x, 0, WORLD);
    spc_detach(h);
    return 0;
}

/* Runs after cell_kill_before, whose job lost its rank 2 after the start. */
static void cell_too_late(spc_handle_t *owner)
{
    uint64_t t0 = sp_test_now_ms();
    pipes_open();
    pid_t pids[WORLD];
    pids[VICTIM] = sp_test_fork(late_replacement, NULL);
    take(up[0]);
    CHECK_OK(owner, spc_job_create(owner, sh->job2, sizeof sh->job2));
    put(down[1], 'g');
    fork_ok_ranks(pids, sh->job2, WORLD, 0, VICTIM);
    sp_test_wait_all_ok(pids, WORLD, 30000);
    pipes_close();
    after_cell(owner, "too late", t0);
}

/* ------------------------------------------------------------ spd killed and started again */

static int restart_rank(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_group_t world;
    spc_handle_t *h = join(sh->job, 2, rank, &world);
    double *x = spc_alloc(h, N * sizeof *x);
    if (rank == 0) {
        fill(x, 0, rank);
        uint64_t t0 = sp_test_now_ms();
        CHECK_ST(h, spc_allreduce(h, world, x, x, N, SPC_F64, SPC_SUM, 20000), SPC_ERR_DAEMON_LOST);
        CHECK(sp_test_now_ms() - t0 < 10000);
    } else {
        /* Asks until spd is gone: a "go" on the pipe both ranks read could be
         * taken by rank 0, past its own loss, and send it on before spd is back. */
        put(up[1], 'j');
        spc_status_t st;
        uint64_t deadline = sp_test_now_ms() + 20000;
        while ((st = spc_noop(h, 5000)) == SPC_OK && sp_test_now_ms() < deadline)
            usleep(1000);
        CHECK_ST(h, st, SPC_ERR_DAEMON_LOST);
    }
    CHECK_CONTAINS(spc_last_error(h), "spd closed the connection");
    spc_detach(h);

    /* The same process, attached to the new spd on the same socket. */
    put(up[1], 'l');
    take(down[0]);
    struct ok_rank a = { sh->job2, 2, rank };
    return ok_rank_main(&a);
}

static spc_handle_t *cell_spd_restart(spc_handle_t *owner)
{
    uint64_t t0 = sp_test_now_ms();
    pipes_open();
    CHECK_OK(owner, spc_job_create(owner, sh->job, sizeof sh->job));
    pid_t pids[2];
    for (int r = 0; r < 2; r++)
        pids[r] = sp_test_fork(restart_rank, (void *)(intptr_t)r);
    take(up[0]);
    CHECK(sp_test_wait_status(owner, "ops_inflight", 1, 10000));
    CHECK_EQ(kill(d.pid, SIGKILL), 0);
    CHECK_EQ(sp_test_wait(d.pid, 5000), -SIGKILL);
    d.pid = 0;
    spc_detach(owner);
    take_n(up[0], 2, 'l');

    /* The socket file is still there, with nobody behind it. */
    CHECK(access(d.sock, F_OK) == 0);
    sp_test_daemon_restart(&d, NULL);
    char out[256];
    CHECK_EQ(sp_test_run(out, sizeof out, "grep -c 'removing stale socket' %s", d.log), 0);
    owner = sp_test_attach();
    CHECK_OK(owner, spc_job_create(owner, sh->job2, sizeof sh->job2));
    put(down[1], 'g');
    put(down[1], 'g');
    sp_test_wait_all_ok(pids, 2, 30000);
    pipes_close();
    after_cell(owner, "spd restart", t0);
    return owner;
}

int main(void)
{
    sh = sp_test_shared(sizeof *sh);
    /* Every cell's clients go down with what they meet, spd included. */
    setenv("SPC_RECONNECT_MS", "0", 1);
    sp_test_daemon_start(&d, NULL);
    spc_handle_t *owner = sp_test_attach();

    cell_kill_before(owner);
    cell_too_late(owner);
    cell_kill_after(owner);
    cell_exit(owner);
    cell_rejoin(owner);
    owner = cell_spd_restart(owner);

    spc_detach(owner);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("lifecycle: ok\n");
    return 0;
}
