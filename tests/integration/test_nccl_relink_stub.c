/*
 * Device ops across daemons through a peer daemon's restart: two spd_stub
 * daemons on loopback, each a node, on the stand-in driver (tests/stubcuda)
 * and the stand-in NCCL (tests/stubnccl); a job of four ranks, two on each,
 * node-0 its root, both daemons waiting peer_restart_grace_ms for a peer
 * whose link drops. Every rank loops over an all-to-all (seq->head), an
 * all-reduce into another buffer and a cyclic shift on the world, all on
 * stand-in device memory and so all through NCCL communicators, each result
 * checked against references computed here:
 *
 *   relink   at iteration STALL_AT every rank runs the all-reduce in its CUDA
 *            stream's order, node-0's streams held up by a stand-in kernel
 *            (STALL_MS) before it, so node-0's lane waits for their ready
 *            while node-1's waits in the exchange; node-1's spd is then
 *            SIGKILLed and started again on its socket. node-0 aborts the
 *            communicator with node-1 and holds the op (its lane drains as
 *            the ready comes; no done is written); node-1's ranks come back
 *            and replay it from their streams; once node-1 has taken the job
 *            back, both make a new communicator at the held op's number, and
 *            every rank finishes with every result right. Prints how long
 *            ranks stalled, how many ops they submitted again, and how many
 *            ops node-0 held and ran again; node-0's status counts the one
 *            op it held, run again.
 *   upgrade  the same with node-1 stopped for a restart (SIGUSR2: exit 75,
 *            nothing drained) during the held-up all-reduce: node-1 lets the
 *            op whose exchange is under way finish before it exits, so no
 *            rank replays an op the other daemon is past, and node-0 holds
 *            none.
 *   late     node-1 is SIGKILLed again in the held-up all-reduce and comes
 *            back after the grace: node-0's ranks fail with SPC_ERR_PEER_LOST
 *            naming node-1 once the grace has passed, and node-1's with
 *            SPC_ERR_PEER_LOST saying that node-0 did not take the job back;
 *            node-0's status counts the op it held as failed, not run again,
 *            and its /metrics read as its status.
 */
#include <signal.h>
#include <unistd.h>

#include "sp_stub_regions.h"

#define GRACE_MS 8000
#define PER      2
#define P        (2 * PER)
#define SL       8              /* rows per rank */
#define S        (SL * P)
#define H        8
#define HL       (H / P)
#define D        16
#define N        (64 * 1024)    /* doubles per all-reduce: 512 KiB, long enough to be killed under */
#define ITERS    120
#define STALL_AT 40
#define STALL_MS 1500           /* node-0's streams held up before the all-reduce of STALL_AT */
#define WAIT_MS  60000

#include "sp_loop_refs.h"

static sp_test_daemon_t nodes[2];
static char job_id[SPC_JOB_ID_MAX];

typedef struct rank_report {
    volatile int iter;
    volatile int done;
    uint64_t     max_iter_ms;   /* its longest iteration: the stall across the restart */
    uint64_t     replayed, retried;
    uint32_t     resumes;
    uint64_t     failed_ms;     /* late: when its op failed */
} rank_report_t;

static struct shared {
    rank_report_t r[P];
    volatile int  stall_at;     /* the iteration whose all-reduce goes in stream order, held up on node-0 */
    volatile int  late;         /* the ranks run until their op fails */
    char          why1[128];    /* what node-1's ranks' failure must say */
} *sh;

/* ================================================================ references */

static void check_shift(int it, int rank, const double *x)
{
    int pred = (rank + P - 1) % P;
    for (int i = 0; i < N; i++)
        if (x[i] != val(it, pred, i, 11))
            SP_FAIL("iter %d rank %d: shift [%d] is %g, expected %g (from rank %d)", it, rank, i, x[i],
                    val(it, pred, i, 11), pred);
}

/* late: whether the op failed as it must (then the rank stops). */
static bool late_failed(spc_handle_t *h, int rank, spc_status_t st)
{
    if (!sh->late || st == SPC_OK)
        return false;
    sh->r[rank].failed_ms = sp_test_now_ms();
    CHECK_EQ(st, SPC_ERR_PEER_LOST);
    if (rank / PER == 0)
        CHECK_CONTAINS(spc_last_error(h), "node node-1 lost");
    else
        CHECK_CONTAINS(spc_last_error(h), sh->why1);
    printf("rank %d failed: %s\n", rank, spc_last_error(h));
    return true;
}

/* ================================================================ the ranks */

static void gpu_bind(int gpu)
{
    void *ctx;
    CHECK_EQ(cuDevicePrimaryCtxRetain(&ctx, gpu), STUB_SUCCESS);
    CHECK_EQ(cuCtxSetCurrent(ctx), STUB_SUCCESS);
}

static void sleep_run(void *arg)
{
    usleep((useconds_t)(intptr_t)arg * 1000);
}

/* The all-reduce in the order of stream s (cs its CUDA stream), node-0's
 * ranks' streams held up first: ops after it on the stream see its result. */
static spc_status_t allreduce_in_stream(spc_handle_t *h, spc_group_t world, int rank, void *cs, spc_stream_t *s,
                                        const double *x, double *y)
{
    if (rank / PER == 0)
        CHECK_EQ(cuLaunchHostFunc(cs, sleep_run, (void *)(intptr_t)STALL_MS), STUB_SUCCESS);
    CHECK_OK(h, spc_set_stream(h, s));
    spc_status_t st = spc_allreduce(h, world, x, y, N, SPC_F64, SPC_SUM, WAIT_MS);   /* enqueued */
    CHECK_OK(h, spc_set_stream(h, NULL));
    return st != SPC_OK ? st : spc_stream_synchronize(s);
}

static int rank_main(void *arg)
{
    int rank = (int)(intptr_t)arg;
    rank_report_t *rep = &sh->r[rank];
    setenv("SPC_SOCKET", nodes[rank / PER].sock, 1);
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, P, (uint32_t)rank, 20000, &world));
    gpu_bind(0);

    spc_region_t r[5];
    double *a2a_send = dev_put(h, NULL, SL * H * D * sizeof(double), &r[0]);
    double *a2a_recv = dev_put(h, NULL, S * HL * D * sizeof(double), &r[1]);
    double *ar_send = dev_put(h, NULL, N * sizeof(double), &r[2]);
    double *ar_recv = dev_put(h, NULL, N * sizeof(double), &r[3]);
    double *sh_recv = dev_put(h, NULL, N * sizeof(double), &r[4]);
    void *cs;
    spc_stream_t *s;
    CHECK_EQ(cuStreamCreate(&cs, 1), STUB_SUCCESS);
    CHECK_OK(h, spc_stream_create(h, cs, &s));

    for (int it = 0; sh->late || it < ITERS; it++) {
        rep->iter = it;
        a2a_fill(it, rank, a2a_send);
        for (int i = 0; i < N; i++)
            ar_send[i] = val(it, rank, i, 7);
        uint64_t t0 = sp_test_now_ms();

        spc_alltoall_desc_t a = a2a_desc(world, a2a_send, a2a_recv);
        spc_status_t st = spc_alltoall(h, &a, WAIT_MS);
        if (late_failed(h, rank, st))
            break;
        CHECK_OK(h, st);
        check_a2a(it, rank, a2a_recv);
        if (it == sh->stall_at)
            st = allreduce_in_stream(h, world, rank, cs, s, ar_send, ar_recv);
        else
            st = spc_allreduce(h, world, ar_send, ar_recv, N, SPC_F64, SPC_SUM, WAIT_MS);
        if (late_failed(h, rank, st))
            break;
        CHECK_OK(h, st);
        check_sum(it, rank, ar_recv, 7, "all-reduce");
        /* The shift's send, written after the all-reduce read it. */
        for (int i = 0; i < N; i++)
            ar_send[i] = val(it, rank, i, 11);
        spc_shift_desc_t sd = SPC_SHIFT_DESC_INIT;
        sd.group = world;
        sd.ntensors = 1;
        sd.tensors[0].send = ar_send;
        sd.tensors[0].recv = sh_recv;
        sd.tensors[0].bytes = N * sizeof(double);
        st = spc_shift(h, &sd, WAIT_MS);
        if (late_failed(h, rank, st))
            break;
        CHECK_OK(h, st);
        check_shift(it, rank, sh_recv);
        uint64_t dt = sp_test_now_ms() - t0;
        if (dt > rep->max_iter_ms)
            rep->max_iter_ms = dt;
    }
    if (!sh->late)
        CHECK_OK(h, spc_stream_destroy(s));
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
    uint64_t deadline = sp_test_now_ms() + 60000;
    for (int r = 0; r < P; r++)
        while (sh->r[r].iter < want) {
            if (sp_test_now_ms() > deadline)
                SP_FAIL("rank %d is at iteration %d after 60 s; waiting for %d", r, sh->r[r].iter, want);
            usleep(1000);
        }
}

/* ================================================================ the scenarios */

/* Once every rank is in the held-up all-reduce and node-0 has it with NCCL
 * (its lane waiting for its ranks' ready): the moment to stop node-1, well
 * within STALL_MS. */
static void wait_stalled(void)
{
    char out[16384];
    wait_iters(STALL_AT);
    uint64_t deadline = sp_test_now_ms() + STALL_MS / 2;
    do
        sp_test_node_status(&nodes[0], out, sizeof out);
    while (sp_test_json_int(out, "nccl_ops_inflight") == 0 && sp_test_now_ms() < deadline);
    CHECK(sp_test_json_int(out, "nccl_ops_inflight") > 0);
}

/* What node-0's status counts of device ops held through node-1's restarts:
 * held, run again, failed while held. */
typedef struct held_counts {
    long long held, rerun, failed;
} held_counts_t;

static held_counts_t held_counts(void)
{
    char out[16384];
    sp_test_node_status(&nodes[0], out, sizeof out);
    return (held_counts_t){ sp_test_json_int(out, "nccl_ops_held"), sp_test_json_int(out, "nccl_ops_rerun"),
                            sp_test_json_int(out, "nccl_ops_held_failed") };
}

/* node-0's counts since `was`: held, run again and failed as asked. */
static held_counts_t check_held(const char *what, held_counts_t was, long long held, long long rerun,
                                long long failed)
{
    held_counts_t now = held_counts();
    printf("%s: node-0's status: %lld ops held, %lld run again, %lld failed while held\n", what, now.held - was.held,
           now.rerun - was.rerun, now.failed - was.failed);
    CHECK_EQ(now.held - was.held, held);
    CHECK_EQ(now.rerun - was.rerun, rerun);
    CHECK_EQ(now.failed - was.failed, failed);
    return now;
}

/* node-0's /metrics count as its status does. */
static void check_held_metrics(held_counts_t k)
{
    static char text[1 << 17];
    char line[96];
    CHECK_EQ(sp_test_run(text, sizeof text, "%s --socket %s metrics", sp_test_spctl_bin(), nodes[0].sock), 0);
    snprintf(line, sizeof line, "\nspd_nccl_ops_held_total %lld\n", k.held);
    CHECK_CONTAINS(text, line);
    snprintf(line, sizeof line, "\nspd_nccl_ops_rerun_total %lld\n", k.rerun);
    CHECK_CONTAINS(text, line);
    snprintf(line, sizeof line, "\nspd_nccl_ops_held_failed_total %lld\n", k.failed);
    CHECK_CONTAINS(text, line);
}

/* Waits for the ranks of a job whose node-1 restarted `back_ms` after it
 * stopped, and checks and prints what it cost them and what node-0 held. */
static int relink_report(const char *what, const pid_t *pids, uint64_t back_ms, int held_before)
{
    sp_test_wait_all_ok(pids, P, 180000);
    uint64_t stall = 0, replayed = 0, retried = 0;
    for (int r = 0; r < P; r++) {
        const rank_report_t *rp = &sh->r[r];
        CHECK(rp->done);
        CHECK_EQ(rp->resumes, r / PER == 1 ? 1u : 0u);
        stall = rp->max_iter_ms > stall ? rp->max_iter_ms : stall;
        replayed += rp->replayed;
        retried += rp->retried;
        printf("%s: rank %d: longest iteration %" PRIu64 " ms, %" PRIu64 " ops submitted again (%" PRIu64
               " taken before)\n", what, r, rp->max_iter_ms, rp->replayed, rp->retried);
    }
    int held = sp_test_log_count(&nodes[0], "runs again on a new communicator") - held_before;
    printf("%s: node-1 back %" PRIu64 " ms after it stopped; ranks stalled up to %" PRIu64 " ms (%d of it node-0's "
           "streams held up before the op); %" PRIu64
           " ops submitted again to node-1 (%" PRIu64 " taken by the spd before); %d ops held on node-0 ran again on "
           "a new communicator; %d iterations of device all-to-all, all-reduce and shift across daemons, every "
           "result right\n", what, back_ms, stall, STALL_MS, replayed, retried, held, ITERS);
    CHECK(stall < GRACE_MS);
    return held;
}

static spc_handle_t *start_job(pid_t *pids)
{
    setenv("SPC_SOCKET", nodes[0].sock, 1);
    spc_handle_t *owner = sp_test_attach();
    CHECK_OK(owner, spc_job_create(owner, job_id, sizeof job_id));
    memset(sh->r, 0, sizeof sh->r);
    for (int r = 0; r < P; r++)
        pids[r] = sp_test_fork(rank_main, (void *)(intptr_t)r);
    return owner;
}

static void kill_node1(void)
{
    CHECK_EQ(kill(nodes[1].pid, SIGKILL), 0);
    CHECK_EQ(sp_test_wait(nodes[1].pid, 5000), -SIGKILL);
    nodes[1].pid = 0;
}

int main(void)
{
    char dir[64] = "/tmp/spd-nccl-relink-XXXXXX", secret[128], rec[2048], out[256];
    sp_test_use_stub_cuda(SP_STUB_CUDA_DIR);
    setenv("SP_TEST_SPD", SPD_STUB_BIN, 1);
    setenv("SPD_NCCL_LIBRARY", SP_STUB_NCCL_LIB, 1);
    unsetenv("SPD_STUB_CUDA_GPUS");
    CHECK(mkdtemp(dir) != NULL);
    sp_test_secret_file(dir, "secret", "two daemons, one stand-in GPU each, 2026\n", secret, sizeof secret);
    sh = sp_test_shared(sizeof *sh);
    setenv("SPC_RECONNECT_MS", "20000", 1);   /* late: past the grace */

    char a[2][256], grace[64];
    snprintf(a[0], sizeof a[0], "cluster_secret_file=%s", secret);
    snprintf(grace, sizeof grace, "peer_restart_grace_ms=%d", GRACE_MS);
    const char *args0[] = { "--set", "node_name=node-0", "--set", a[0], "--set", "peer_listen=127.0.0.1:0",
                            "--set", "peer_heartbeat_ms=50", "--set", grace, NULL };
    sp_test_daemon_start(&nodes[0], args0);
    snprintf(a[1], sizeof a[1], "peers=127.0.0.1:%d", sp_test_node_port(&nodes[0]));
    const char *args1[] = { "--set", "node_name=node-1", "--set", a[0], "--set", a[1],
                            "--set", "peer_heartbeat_ms=50", "--set", grace, NULL };
    sp_test_daemon_start(&nodes[1], args1);
    sp_test_peer_wait(&nodes[0], "node-1", "up", 10000, rec, sizeof rec);

    /* relink: node-1 SIGKILLed in the held-up all-reduce, started again. */
    pid_t pids[P];
    held_counts_t k = held_counts();
    CHECK(k.held == 0 && k.rerun == 0 && k.failed == 0);
    sh->stall_at = STALL_AT;
    spc_handle_t *owner = start_job(pids);
    wait_stalled();
    uint64_t stopped = sp_test_now_ms();
    kill_node1();
    sp_test_daemon_restart(&nodes[1], args1);
    CHECK_EQ(relink_report("relink", pids, sp_test_now_ms() - stopped, 0), 1);
    CHECK_EQ(sp_test_log_count(&nodes[0], "waits for node node-1 to take the job back, to run again"), 1);
    k = check_held("relink", k, 1, 1, 0);
    spc_detach(owner);

    /* upgrade: node-1 stopped for a restart (SIGUSR2: exit 75) in the held-up
     * all-reduce, which it finishes first; then started again. */
    int before = sp_test_log_count(&nodes[0], "runs again on a new communicator");
    owner = start_job(pids);
    wait_stalled();
    stopped = sp_test_now_ms();
    CHECK_EQ(kill(nodes[1].pid, SIGUSR2), 0);
    CHECK_EQ(sp_test_wait(nodes[1].pid, 10000), 75);   /* its finishing is bounded by 5 s (SP_NCCL_HALT_MS) */
    nodes[1].pid = 0;
    sp_test_daemon_restart(&nodes[1], args1);
    relink_report("upgrade", pids, sp_test_now_ms() - stopped, before);
    k = check_held("upgrade", k, 0, 0, 0);
    spc_detach(owner);

    /* late: node-1 SIGKILLed in the held-up all-reduce, back after the grace. */
    sh->late = 1;
    snprintf(sh->why1, sizeof sh->why1, "did not take the job back after this node's spd restarted: job");
    owner = start_job(pids);
    wait_stalled();
    stopped = sp_test_now_ms();
    kill_node1();
    for (int r = 0; r < PER; r++)
        CHECK_EQ(sp_test_wait(pids[r], GRACE_MS + 15000), 0);
    for (int r = 0; r < PER; r++)
        CHECK(sh->r[r].failed_ms - stopped >= GRACE_MS - 100);
    sp_test_daemon_restart(&nodes[1], args1);
    for (int r = PER; r < P; r++)
        CHECK_EQ(sp_test_wait(pids[r], 30000), 0);
    k = check_held("late", k, 1, 0, 1);
    check_held_metrics(k);
    spc_detach(owner);
    printf("late: node-1 back after the grace: node-0's ranks failed %" PRIu64 " ms after the kill (grace %d ms), "
           "node-1's when node-0 refused the job back\n", sh->r[0].failed_ms - stopped, GRACE_MS);

    sp_test_node_pair_stop(nodes);
    sp_test_run(out, sizeof out, "rm -rf %s", dir);
    printf("nccl_relink_stub: ok\n");
    return 0;
}
