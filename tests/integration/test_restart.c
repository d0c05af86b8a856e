/*
 * spd restarted under running jobs: a new spd takes the clients of the old one
 * over, with their arenas, jobs and ops in flight (docs/architecture.md,
 * "Restarting spd under running jobs"). Real spd processes, real rank processes.
 *
 *   kill       4 ranks loop over an all-to-all (seq->head), a ring shift, an
 *              all-reduce and an all-reduce in place, each result checked
 *              against a reference computed here; spd is SIGKILLed mid-loop
 *              and started again. Every result is right, but an all-reduce in
 *              place that the old spd may have run in part, which fails with
 *              SPC_ERR_RESTARTED ("not retried (in place)") on every rank; the
 *              job finishes. Prints how long the ranks stalled and how many
 *              ops went again.
 *   upgrade    the same, spd stopped with SIGUSR2 (exit 75), which drains
 *              nothing, then started again.
 *   lost completions   spd killed as it posted a collective's completions,
 *              played by ranks that take the entries it posted off their own
 *              completion ring before it comes back: an all-reduce in place
 *              that every rank brings back as taken fails with
 *              SPC_ERR_RESTARTED on both ("not retried (in place)"), its
 *              buffers not read; one that a rank had not submitted runs, right;
 *              a barrier one rank saw complete and the other did not fails on
 *              the other, naming the first; the next ops of both run.
 *   mesh       4 ranks on a mesh (2 x 2: Ulysses and ring groups) loop over
 *              all-reduces on their Ulysses group and shifts on their ring
 *              group; spd is SIGKILLed mid-loop and started again: the groups
 *              come back with their members, every result is right.
 *   refused    a client with reconnecting off hears SPC_ERR_DAEMON_LOST at
 *              once; beside it a job of two ranks goes on with right results.
 *   squat      (root) during the restart a stranger of another uid claims a
 *              job's place with the job's own ticket, and with a ticket forged
 *              to name it: both refused with SPC_ERR_PERMISSION before spd
 *              looks at what they brought; the job's own rank then comes back.
 */
#include <grp.h>
#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <sys/prctl.h>
#include <sys/wait.h>

#include "sp_shm.h"
#include "sp_test.h"

#define P       4
#define SL      16            /* rows per rank */
#define S       (SL * P)
#define H       8             /* heads; H / P per rank after seq->head */
#define HL      (H / P)
#define D       16
#define N       4096          /* doubles per shift and all-reduce */
#define ITERS   400
#define WAIT_MS 60000

#include "sp_loop_refs.h"

static sp_test_daemon_t d;

typedef struct rank_report {
    volatile int iter;          /* the iteration it is in */
    volatile int done;
    uint64_t     max_op_ms;     /* its longest iteration: the stall across the restart */
    uint32_t     resumes;
    uint64_t     replayed, retried;
    uint32_t     not_retried;   /* all-reduces in place that failed with SPC_ERR_RESTARTED */
} rank_report_t;

static struct shared {
    char          name[32];
    rank_report_t r[P];
    uint8_t       ticket[4096]; /* squat: the job's ticket, as its rank 1 got it */
    size_t        ticket_len;
    volatile int  ticket_ready, stranger_done, victim_back;
    volatile int  stop;         /* refused: the job beside may end (1) */
} *sh;

/* ================================================================ the loop */

static int loop_rank(void *arg)
{
    int rank = (int)(intptr_t)arg;
    rank_report_t *rep = &sh->r[rank];
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join_named(h, sh->name, "restart-test", P, (uint32_t)rank, 20000, &world));

    double *a2a_send = spc_alloc(h, SL * H * D * sizeof(double));
    double *a2a_recv = spc_alloc(h, S * HL * D * sizeof(double));
    double *sh_send = spc_alloc(h, N * sizeof(double)), *sh_recv = spc_alloc(h, N * sizeof(double));
    double *ar_send = spc_alloc(h, N * sizeof(double)), *ar_recv = spc_alloc(h, N * sizeof(double));
    double *inplace = spc_alloc(h, N * sizeof(double));
    CHECK(a2a_send && a2a_recv && sh_send && sh_recv && ar_send && ar_recv && inplace);

    for (int it = 0; it < ITERS; it++) {
        rep->iter = it;
        a2a_fill(it, rank, a2a_send);
        for (int i = 0; i < N; i++) {
            sh_send[i] = val(it, rank, i, 5);
            ar_send[i] = val(it, rank, i, 7);
            inplace[i] = val(it, rank, i, 11);
        }
        uint64_t t0 = sp_test_now_ms();

        spc_alltoall_desc_t a = a2a_desc(world, a2a_send, a2a_recv);
        CHECK_OK(h, spc_alltoall(h, &a, WAIT_MS));
        check_a2a(it, rank, a2a_recv);

        spc_shift_desc_t s = SPC_SHIFT_DESC_INIT;
        s.group = world;
        s.ntensors = 1;
        s.tensors[0].send = sh_send;
        s.tensors[0].recv = sh_recv;
        s.tensors[0].bytes = N * sizeof(double);
        CHECK_OK(h, spc_shift(h, &s, WAIT_MS));
        for (int i = 0; i < N; i++)
            if (sh_recv[i] != val(it, (rank + P - 1) % P, i, 5))
                SP_FAIL("iter %d rank %d: shift [%d] is %g, expected %g", it, rank, i, sh_recv[i],
                        val(it, (rank + P - 1) % P, i, 5));

        CHECK_OK(h, spc_allreduce(h, world, ar_send, ar_recv, N, SPC_F64, SPC_SUM, WAIT_MS));
        check_sum(it, rank, ar_recv, 7, "all-reduce");

        spc_status_t st = spc_allreduce(h, world, inplace, inplace, N, SPC_F64, SPC_SUM, WAIT_MS);
        if (st == SPC_ERR_RESTARTED) {
            /* The old spd may have written part of it: the buffer is not checked. */
            CHECK_CONTAINS(spc_last_error(h), "not retried (in place)");
            rep->not_retried++;
        } else {
            CHECK_OK(h, st);
            check_sum(it, rank, inplace, 11, "all-reduce in place");
        }
        uint64_t dt = sp_test_now_ms() - t0;
        if (dt > rep->max_op_ms)
            rep->max_op_ms = dt;
    }
    spc_resume_info_t info = SPC_RESUME_INFO_INIT;
    CHECK_OK(h, spc_resume_info(h, &info));
    rep->resumes = info.resumes;
    rep->replayed = info.replayed;
    rep->retried = info.retried;
    rep->done = 1;
    spc_detach(h);
    return 0;
}

static void wait_iters(int want)
{
    uint64_t deadline = sp_test_now_ms() + 30000;
    for (int r = 0; r < P; r++)
        while (sh->r[r].iter < want) {
            if (sp_test_now_ms() > deadline)
                SP_FAIL("rank %d is at iteration %d after 30 s; waiting for %d", r, sh->r[r].iter, want);
            usleep(1000);
        }
}

/* Runs the loop on P ranks and stops spd under it with `sig` mid-loop, then
 * starts it again. */
static void cell_loop(const char *cell, int sig, int exit_want)
{
    memset(sh->r, 0, sizeof sh->r);
    snprintf(sh->name, sizeof sh->name, "restart-%s", cell);
    pid_t pids[P];
    for (int r = 0; r < P; r++)
        pids[r] = sp_test_fork(loop_rank, (void *)(intptr_t)r);
    wait_iters(ITERS / 4);
    uint64_t t0 = sp_test_now_ms();
    CHECK_EQ(kill(d.pid, sig), 0);
    CHECK_EQ(sp_test_wait(d.pid, 10000), exit_want);
    d.pid = 0;
    sp_test_daemon_restart(&d, NULL);
    uint64_t up_ms = sp_test_now_ms() - t0;
    sp_test_wait_all_ok(pids, P, 120000);
    /* spd counts what it took over (spctl status, spd_clients_resumed_total). */
    spc_handle_t *q = sp_test_attach();
    CHECK_EQ(sp_test_status_int(q, "clients_resumed"), P);
    spc_detach(q);

    uint64_t stall = 0, replayed = 0, retried = 0;
    uint32_t not_retried = 0;
    for (int r = 0; r < P; r++) {
        CHECK_EQ(sh->r[r].done, 1);
        CHECK_EQ(sh->r[r].resumes, 1);
        stall = sh->r[r].max_op_ms > stall ? sh->r[r].max_op_ms : stall;
        replayed += sh->r[r].replayed;
        retried += sh->r[r].retried;
        not_retried += sh->r[r].not_retried;
    }
    /* Every rank or none: one collective, one outcome. */
    CHECK(not_retried % P == 0);
    printf("%s: spd back in %" PRIu64 " ms; ranks stalled at most %" PRIu64 " ms; %" PRIu64 " ops submitted again, "
           "%" PRIu64 " of them taken by the old spd; %u all-reduce in place not retried; %d iterations right\n",
           cell, up_ms, stall, replayed, retried, not_retried / P, ITERS);
}

/* ================================================================ lost completions */

#define SQ_SMALL 64   /* the segment's size, so that the test finds its completion ring */

/* The completion ring of h's segment, found from its arena's first allocation
 * (offset 0) through the layout both sides compute. */
static struct sp_ring *cq_of(spc_handle_t *h, void *first_alloc)
{
    uint64_t arena_bytes;
    struct sp_seg_hdr want;
    spc_arena_usage(h, &arena_bytes, NULL);
    sp_seg_layout(&want, SP_SEG_VERSION, SQ_SMALL, arena_bytes);
    uint8_t *base = (uint8_t *)first_alloc - want.arena_off;
    CHECK(((struct sp_seg_hdr *)base)->magic == SP_SEG_MAGIC);
    return (struct sp_ring *)(base + want.cq_off);
}

/* Waits for spd to post n more completions on cq than at `from`. */
static void cq_wait_posted(struct sp_ring *cq, uint32_t from, uint32_t n)
{
    uint64_t deadline = sp_test_now_ms() + 20000;
    while (atomic_load(&cq->tail) - from < n) {
        if (sp_test_now_ms() > deadline)
            SP_FAIL("spd posted no completion in 20 s");
        usleep(100);
    }
}

static struct shared_lost {
    volatile int posted[2];    /* the step each rank reached: its completions are on its ring */
    volatile int killed;       /* the step whose spd was killed */
} *shl;

static void step_wait(volatile int *flag, int want)
{
    uint64_t deadline = sp_test_now_ms() + 30000;
    while (*flag < want) {
        if (sp_test_now_ms() > deadline)
            SP_FAIL("waited 30 s for step %d (at %d)", want, *flag);
        usleep(500);
    }
}

static int lost_rank(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_attach_params_t p = SPC_ATTACH_PARAMS_INIT;
    p.sq_entries = SQ_SMALL;
    spc_handle_t *h;
    CHECK_OK(NULL, spc_attach(&p, &h));
    spc_group_t world;
    CHECK_OK(h, spc_job_join_named(h, "lost", "restart-test", 2, (uint32_t)rank, 20000, &world));
    double *x = spc_alloc(h, N * sizeof(double));
    struct sp_ring *cq = cq_of(h, x);
    spc_request_t *r;

    /* 1: both submit an all-reduce in place; spd runs it and posts both
     * completions, then dies; both rings lose them. Both bring it back as
     * taken and aliased: it fails, and the buffer is not read. */
    for (int i = 0; i < N; i++)
        x[i] = val(1, rank, i, 17);
    uint32_t tail = atomic_load(&cq->tail);
    CHECK_OK(h, spc_iallreduce(h, world, x, x, N, SPC_F64, SPC_SUM, &r));
    cq_wait_posted(cq, tail, 1);
    shl->posted[rank] = 1;
    step_wait(&shl->killed, 1);
    atomic_store(&cq->tail, tail);
    CHECK_ST(h, spc_wait(r, WAIT_MS), SPC_ERR_RESTARTED);
    CHECK_CONTAINS(spc_last_error(h), "not retried (in place)");
    spc_request_release(r);

    /* 2: rank 0 submits an all-reduce in place, which spd takes, and rank 1
     * has not when spd dies: it never ran, so it runs now, right. */
    for (int i = 0; i < N; i++)
        x[i] = val(2, rank, i, 17);
    if (rank == 0) {
        CHECK_OK(h, spc_iallreduce(h, world, x, x, N, SPC_F64, SPC_SUM, &r));
        shl->posted[rank] = 2;
        step_wait(&shl->killed, 2);
        CHECK_OK(h, spc_wait(r, WAIT_MS));
        spc_request_release(r);
    } else {
        shl->posted[rank] = 2;
        step_wait(&shl->killed, 2);
        CHECK_OK(h, spc_allreduce(h, world, x, x, N, SPC_F64, SPC_SUM, WAIT_MS));
    }
    for (int i = 0; i < N; i++)
        if (x[i] != val(2, 0, i, 17) + val(2, 1, i, 17))
            SP_FAIL("rank %d: all-reduce in place [%d] is %g", rank, i, x[i]);

    /* 3: a barrier completes on both, and rank 1's ring loses it: rank 1
     * brings it back, rank 0 does not. It fails on rank 1, naming rank 0, and
     * the next barrier of both runs. */
    tail = atomic_load(&cq->tail);
    CHECK_OK(h, spc_ibarrier(h, world, &r));
    cq_wait_posted(cq, tail, 1);
    if (rank == 0) {
        CHECK_OK(h, spc_wait(r, WAIT_MS));
        spc_request_release(r);
    }
    shl->posted[rank] = 3;
    step_wait(&shl->killed, 3);
    if (rank == 1) {
        atomic_store(&cq->tail, tail);
        CHECK_ST(h, spc_wait(r, WAIT_MS), SPC_ERR_RESTARTED);
        CHECK_CONTAINS(spc_last_error(h), "rank 0 saw it complete and this rank did not");
        spc_request_release(r);
    }
    CHECK_OK(h, spc_barrier(h, world, WAIT_MS));
    spc_resume_info_t info = SPC_RESUME_INFO_INIT;
    CHECK_OK(h, spc_resume_info(h, &info));
    CHECK_EQ(info.resumes, 3);
    spc_detach(h);
    return 0;
}

static void kill_restart(void)
{
    CHECK_EQ(kill(d.pid, SIGKILL), 0);
    CHECK_EQ(sp_test_wait(d.pid, 10000), -SIGKILL);
    d.pid = 0;
    sp_test_daemon_restart(&d, NULL);
}

static void cell_lost_completions(void)
{
    shl = sp_test_shared(sizeof *shl);
    spc_handle_t *owner = sp_test_attach();
    pid_t pids[2];
    for (int r = 0; r < 2; r++)
        pids[r] = sp_test_fork(lost_rank, (void *)(intptr_t)r);
    for (int step = 1; step <= 3; step++) {
        step_wait(&shl->posted[0], step);
        step_wait(&shl->posted[1], step);
        if (step == 2)   /* rank 0's op is spd's, waiting for rank 1's */
            CHECK(sp_test_wait_status(owner, "ops_inflight", 1, 20000));
        spc_detach(owner);
        kill_restart();
        owner = sp_test_attach();
        shl->killed = step;
    }
    sp_test_wait_all_ok(pids, 2, 60000);
    spc_detach(owner);
    printf("lost completions: in place, taken by every rank: RESTARTED; taken by one: ran right; seen complete "
           "by one rank only: RESTARTED naming it; the next ops ran\n");
}

/* ================================================================ refused */

static int others_rank(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join_named(h, "others", "restart-test", 2, (uint32_t)rank, 20000, &world));
    double *x = spc_alloc(h, (N + 1) * sizeof(double)), *y = spc_alloc(h, (N + 1) * sizeof(double));
    /* Until told to stop: rank 0 reads the word and passes it in the sum's
     * last element, so both ranks leave after the same iteration. */
    y[N] = 0;
    for (int it = 0; y[N] == 0; it++) {
        sh->r[rank].iter = it;
        for (int i = 0; i < N; i++)
            x[i] = val(it, rank, i, 13);
        x[N] = rank == 0 && sh->stop != 0;
        CHECK_OK(h, spc_allreduce(h, world, x, y, N + 1, SPC_F64, SPC_SUM, WAIT_MS));
        for (int i = 0; i < N; i++)
            if (y[i] != val(it, 0, i, 13) + val(it, 1, i, 13))
                SP_FAIL("iter %d rank %d: [%d] is %g", it, rank, i, y[i]);
    }
    spc_resume_info_t info = SPC_RESUME_INFO_INIT;
    CHECK_OK(h, spc_resume_info(h, &info));
    CHECK_EQ(info.resumes, 1);
    spc_detach(h);
    return 0;
}

/* A client with reconnecting off: it is not taken over. */
static int refused_client(void *arg)
{
    (void)arg;
    spc_attach_params_t p = SPC_ATTACH_PARAMS_INIT;
    p.reconnect_ms = -1;
    spc_handle_t *h;
    CHECK_OK(NULL, spc_attach(&p, &h));
    spc_group_t world;
    CHECK_OK(h, spc_job_join_named(h, "no-reconnect", "restart-test", 1, 0, 20000, &world));
    sh->r[2].iter = sh->r[3].iter = 1;
    while (sh->r[2].done == 0)   /* spd is killed meanwhile */
        usleep(1000);
    uint64_t t0 = sp_test_now_ms();
    CHECK_ST(h, spc_barrier(h, world, WAIT_MS), SPC_ERR_DAEMON_LOST);
    CHECK(sp_test_now_ms() - t0 < 2000);   /* at once, not after a wait for another spd */
    CHECK_CONTAINS(spc_last_error(h), "spd closed the connection");
    spc_detach(h);
    return 0;
}

/* ================================================================ mesh */

static int mesh_rank(void *arg)
{
    int rank = (int)(intptr_t)arg;
    rank_report_t *rep = &sh->r[rank];
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join_named(h, "meshed", "restart-test", P, (uint32_t)rank, 20000, &world));
    spc_mesh_spec_t spec = SPC_MESH_SPEC_INIT;
    spec.sp = P;
    spec.ulysses = 2;
    spec.ring = 2;
    spec.heads = 4;
    spc_mesh_t m;
    CHECK_OK(h, spc_mesh_create(h, &spec, &m));
    CHECK(m.ulysses == 2 && m.ring == 2 && m.dp == 1);
    /* Ranks that cannot be told apart by where they run keep rank order (spclient.h). */
    uint32_t pred = ((m.ring_rank + m.ring - 1) % m.ring) * m.ulysses + m.ulysses_rank;
    double *x = spc_alloc(h, N * sizeof(double)), *y = spc_alloc(h, N * sizeof(double));
    for (int it = 0; it < ITERS; it++) {
        rep->iter = it;
        for (int i = 0; i < N; i++)
            x[i] = val(it, rank, i, 19);
        CHECK_OK(h, spc_allreduce(h, m.ulysses_group, x, y, N, SPC_F64, SPC_SUM, WAIT_MS));
        for (int i = 0; i < N; i++) {
            double want = 0;
            for (uint32_t j = 0; j < m.ulysses; j++)
                want += val(it, (int)(m.ring_rank * m.ulysses + j), i, 19);
            if (y[i] != want)
                SP_FAIL("iter %d rank %d: Ulysses all-reduce [%d] is %g, expected %g", it, rank, i, y[i], want);
        }
        spc_shift_desc_t s = SPC_SHIFT_DESC_INIT;
        s.group = m.ring_group;
        s.ntensors = 1;
        s.tensors[0].send = x;
        s.tensors[0].recv = y;
        s.tensors[0].bytes = N * sizeof(double);
        CHECK_OK(h, spc_shift(h, &s, WAIT_MS));
        for (int i = 0; i < N; i++)
            if (y[i] != val(it, (int)pred, i, 19))
                SP_FAIL("iter %d rank %d: ring shift [%d] is %g, expected %g", it, rank, i, y[i],
                        val(it, (int)pred, i, 19));
    }
    spc_resume_info_t info = SPC_RESUME_INFO_INIT;
    CHECK_OK(h, spc_resume_info(h, &info));
    rep->resumes = info.resumes;
    rep->done = 1;
    spc_detach(h);
    return 0;
}

static void cell_mesh(void)
{
    memset(sh->r, 0, sizeof sh->r);
    pid_t pids[P];
    for (int r = 0; r < P; r++)
        pids[r] = sp_test_fork(mesh_rank, (void *)(intptr_t)r);
    wait_iters(ITERS / 4);
    kill_restart();
    sp_test_wait_all_ok(pids, P, 120000);
    for (int r = 0; r < P; r++)
        CHECK_EQ(sh->r[r].resumes, 1);
    printf("mesh: Ulysses and ring groups of a 2 x 2 mesh taken over; %d iterations right\n", ITERS);
}

static void cell_refused(void)
{
    memset(sh->r, 0, sizeof sh->r);
    sh->stop = 0;
    pid_t pids[3];
    for (int r = 0; r < 2; r++)
        pids[r] = sp_test_fork(others_rank, (void *)(intptr_t)r);
    pids[2] = sp_test_fork(refused_client, NULL);
    wait_iters(1);   /* ranks 0 and 1 looping, the client ready */
    CHECK_EQ(kill(d.pid, SIGKILL), 0);
    CHECK_EQ(sp_test_wait(d.pid, 10000), -SIGKILL);
    d.pid = 0;
    sp_test_daemon_restart(&d, NULL);
    sh->r[2].done = 1;
    int at = sh->r[0].iter > sh->r[1].iter ? sh->r[0].iter : sh->r[1].iter;
    for (int r = 0; r < 2; r++)
        while (sh->r[r].iter < at + 20)
            usleep(1000);
    sh->stop = 1;
    sp_test_wait_all_ok(pids, 3, 120000);
    printf("refused: reconnecting off: DAEMON_LOST at once; the job beside it went on\n");
}

/* ================================================================ squat (root) */

#define USER_A 60001u
#define USER_B 60002u
#define SHARED_GID 65534u

static const char *const allow[] = { "--set", "allow_group=65534", NULL };

static void become(uid_t uid)
{
    sp_test_become(uid, SHARED_GID);
    /* As a trainer started as that user is: a uid change clears it, and spd
     * takes a descriptor only from a process it may reach. */
    CHECK_EQ(prctl(PR_SET_DUMPABLE, 1, 0, 0, 0), 0);
}

static void wait_flag(volatile int *flag)
{
    uint64_t deadline = sp_test_now_ms() + 30000;
    while (*flag == 0) {
        if (sp_test_now_ms() > deadline)
            SP_FAIL("waited 30 s for a flag");
        usleep(1000);
    }
}

/* Rank 0 of A's job, through libspclient: it comes back once the stranger failed. */
static int victim(void *arg)
{
    (void)arg;
    become(USER_A);
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join_named(h, "victim", "restart-test", 2, 0, 20000, &world));
    wait_flag(&sh->stranger_done);
    /* Its first call finds spd gone and comes back to the new one. */
    CHECK_OK(h, spc_noop(h, WAIT_MS));
    spc_resume_info_t info = SPC_RESUME_INFO_INIT;
    CHECK_OK(h, spc_resume_info(h, &info));
    CHECK_EQ(info.resumes, 1);
    sh->victim_back = 1;
    spc_detach(h);
    return 0;
}

/* Rank 1 of A's job, speaking the protocol itself: it keeps the ticket its join
 * got, for the stranger to present. */
static int ticket_holder(void *arg)
{
    (void)arg;
    become(USER_A);
    int fd = sp_test_raw_connect(d.sock);
    sp_test_raw_hello(fd, SPD__HELLO__ROLE__CLIENT);
    Spd__Msg m = SPD__MSG__INIT;
    Spd__JobJoinReq j = SPD__JOB_JOIN_REQ__INIT;
    j.name = "victim";
    j.launch = "restart-test";
    j.world_size = 2;
    j.rank = 1;
    j.timeout_ms = 20000;
    m.seq = 2;
    m.body_case = SPD__MSG__BODY_JOB_JOIN_REQ;
    m.job_join_req = &j;
    sp_test_raw_send_msg(fd, &m);
    Spd__Msg *r = sp_test_raw_recv(fd, 25000, NULL);
    CHECK(r != NULL && r->body_case == SPD__MSG__BODY_JOB_JOIN_REP);
    CHECK(r->job_join_rep->resume_ticket.len > 0 && r->job_join_rep->resume_ticket.len <= sizeof sh->ticket);
    memcpy(sh->ticket, r->job_join_rep->resume_ticket.data, r->job_join_rep->resume_ticket.len);
    sh->ticket_len = r->job_join_rep->resume_ticket.len;
    sp_msg_free(r);
    sh->ticket_ready = 1;
    wait_flag(&sh->victim_back);
    close(fd);
    return 0;
}

/* A Resume hello with `ticket` as rank `rank`, from this process: the answer. */
static Spd__Msg *claim(const uint8_t *ticket, size_t len, uint32_t rank)
{
    int fd = sp_test_raw_connect(d.sock);
    Spd__Msg m = SPD__MSG__INIT;
    Spd__Hello hello = SPD__HELLO__INIT;
    Spd__Resume rs = SPD__RESUME__INIT;
    rs.seg_fd = 0;          /* its stdin: whatever it is, spd must not get as far as taking it */
    rs.ticket.data = (uint8_t *)ticket;
    rs.ticket.len = len;
    rs.rank = rank;
    hello.protocol = SP_PROTOCOL_VERSION;
    hello.role = SPD__HELLO__ROLE__CLIENT;
    hello.name = "stranger";
    hello.resume = &rs;
    m.seq = 1;
    m.body_case = SPD__MSG__BODY_HELLO;
    m.hello = &hello;
    sp_test_raw_send_msg(fd, &m);
    Spd__Msg *r = sp_test_raw_recv(fd, 5000, NULL);
    CHECK(r != NULL);
    close(fd);
    return r;
}

static int stranger(void *arg)
{
    (void)arg;
    become(USER_B);
    /* The job's own ticket: the MAC checks, the uid does not. */
    Spd__Msg *r = claim(sh->ticket, sh->ticket_len, 1);
    CHECK_EQ(r->body_case, SPD__MSG__BODY_ERROR);
    CHECK_EQ(r->error->status, SPC_ERR_PERMISSION);
    CHECK_CONTAINS(r->error->detail, "belongs to uid 60001; uid 60002 may not join it");
    sp_msg_free(r);
    /* The ticket rewritten to name B as the owner (its third 32-bit word). */
    uint8_t forged[sizeof sh->ticket];
    memcpy(forged, sh->ticket, sh->ticket_len);
    uint32_t b = USER_B;
    memcpy(forged + 8, &b, sizeof b);
    r = claim(forged, sh->ticket_len, 1);
    CHECK_EQ(r->body_case, SPD__MSG__BODY_ERROR);
    CHECK_EQ(r->error->status, SPC_ERR_PERMISSION);
    CHECK_CONTAINS(r->error->detail, "not issued by this node's spd");
    sp_msg_free(r);
    return 0;
}

static void cell_squat(void)
{
    sp_test_daemon_start(&d, allow);
    pid_t v = sp_test_fork(victim, NULL);
    pid_t t = sp_test_fork(ticket_holder, NULL);
    wait_flag(&sh->ticket_ready);
    CHECK_EQ(kill(d.pid, SIGKILL), 0);
    CHECK_EQ(sp_test_wait(d.pid, 10000), -SIGKILL);
    d.pid = 0;
    sp_test_daemon_restart(&d, allow);
    pid_t s = sp_test_fork(stranger, NULL);
    CHECK_EQ(sp_test_wait(s, 30000), 0);
    sh->stranger_done = 1;
    CHECK_EQ(sp_test_wait(v, 60000), 0);
    CHECK_EQ(sp_test_wait(t, 10000), 0);
    char out[256];
    CHECK_EQ(sp_test_run(out, sizeof out, "grep -c 'belongs to uid 60001; uid 60002 may not join it' %s", d.log), 0);
    sp_test_daemon_serves();
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("squat: a stranger's claims with the job's ticket and a forged one refused; the job's rank came back\n");
}

int main(void)
{
    sh = sp_test_shared(sizeof *sh);
    sp_test_daemon_start(&d, NULL);

    cell_loop("kill", SIGKILL, -SIGKILL);
    cell_loop("upgrade", SIGUSR2, 75);
    cell_lost_completions();
    cell_mesh();
    cell_refused();
    sp_test_daemon_serves();
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);

    if (geteuid() == 0)
        cell_squat();
    else
        printf("squat: skipped (needs root to run processes of two uids)\n");
    printf("restart: ok\n");
    return 0;
}
