/*
 * A job over two daemons on loopback (two ranks each), node-0 its root, both
 * waiting peer_restart_grace_ms for a peer whose link drops:
 *
 *   relink   every rank loops over all-to-alls and all-reduces (into another
 *            buffer) on the world and shifts on its ring of a 2 x 2 mesh,
 *            each result checked against references computed here;
 *            node-1's spd is SIGKILLed mid-loop and started again on the same
 *            socket. Its ranks come back to it with their tickets, it claims
 *            the job back from node-0 (PeerJoin with resume), and every rank
 *            finishes with every result right. A collective node-0 had
 *            completed for its ranks but node-1 had not runs again on node-1
 *            from the copy node-0 kept of its message. Prints how long ranks
 *            stalled, how many ops they submitted again, and how many
 *            collectives ran again from a kept copy.
 *   root     the same with node-0, the job's root, SIGKILLed and started
 *            again on its socket and peer port: it rebuilds the job as its
 *            root, and node-1 takes it back from it.
 *   upgrade  the same with node-1 stopped for a restart (SIGUSR2: exit 75,
 *            nothing drained, as an upgrade by handover stops it).
 *   forged   while node-1 is down, a cluster member (it holds the secret)
 *            claims the job under another node's name, and then under
 *            node-1's with a nonce of its own: both refused and logged, and
 *            node-0 keeps waiting for node-1.
 *   held     both daemons held (SIGSTOP) mid-loop past peer_timeout_ms, as
 *            a machine held as a whole: neither counts that time as its
 *            peer's silence, the link stays up and every rank finishes with
 *            every result right.
 *   waited   node-1 SIGKILLed, and node-0 held (SIGSTOP) until past the
 *            grace while node-1 starts again and claims the job: node-0,
 *            let go, does not count the time it was held, and takes the job
 *            back; every rank finishes with every result right.
 *   late     node-1 is SIGKILLed again and comes back after the grace: node-0's
 *            ranks fail naming node-1, node-0 refuses the claim (it waits no
 *            more), and node-1's ranks fail with SPC_ERR_PEER_LOST saying so.
 *   alone    node-1 is SIGKILLed again and started without peers: it takes its
 *            ranks over, and they fail at once with SPC_ERR_PEER_LOST saying
 *            that no daemon can take the job back; node-0's fail at the grace.
 */
#include <poll.h>
#include <signal.h>
#include <sodium.h>
#include <ucp/api/ucp.h>

#include "cluster/peer_auth.h"
#include "sp_frame.h"
#include "sp_test.h"
#include "sp_test_peer.h"

#define GRACE_MS 6000
#define PER      2
#define P        (2 * PER)
#define SL       8              /* rows per rank */
#define S        (SL * P)
#define H        8
#define HL       (H / P)
#define D        16
#define N        1024           /* doubles per all-reduce */
#define ITERS    300
#define KILL_AT  100
#define WAIT_MS  60000
#define PEER_TIMEOUT_MS 5000    /* spd's default peer_timeout_ms */
#define SECRET   "two nodes share this secret, 2026"

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
    volatile int  late;         /* the ranks run until their op fails (late, alone) */
    char          why1[128];    /* what node-1's ranks' failure must say */
} *sh;

/* ================================================================ references */

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

static int rank_main(void *arg)
{
    int rank = (int)(intptr_t)arg;
    rank_report_t *rep = &sh->r[rank];
    setenv("SPC_SOCKET", nodes[rank / PER].sock, 1);
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, P, (uint32_t)rank, 20000, &world));

    double *a2a_send = spc_alloc(h, SL * H * D * sizeof(double));
    double *a2a_recv = spc_alloc(h, S * HL * D * sizeof(double));
    double *ar_send = spc_alloc(h, N * sizeof(double)), *ar_recv = spc_alloc(h, N * sizeof(double));
    CHECK(a2a_send && a2a_recv && ar_send && ar_recv);

    /* A 2 x 2 mesh: its groups come back too. Who is on this rank's ring is
     * asked over the ring itself, so the check below does not trust placement. */
    spc_mesh_spec_t spec = SPC_MESH_SPEC_INIT;
    spec.sp = P;
    spec.ulysses = 2;
    spec.ring = 2;
    spec.heads = 4;
    spc_mesh_t m;
    CHECK_OK(h, spc_mesh_create(h, &spec, &m));
    int32_t *me = spc_alloc(h, sizeof *me), *ring_ranks = spc_alloc(h, m.ring * sizeof(int32_t));
    *me = rank;
    CHECK_OK(h, spc_allgather(h, m.ring_group, me, ring_ranks, 1, SPC_I32, WAIT_MS));
    int pred = ring_ranks[(m.ring_rank + m.ring - 1) % m.ring];

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
        st = spc_allreduce(h, world, ar_send, ar_recv, N, SPC_F64, SPC_SUM, WAIT_MS);
        if (late_failed(h, rank, st))
            break;
        CHECK_OK(h, st);
        check_sum(it, rank, ar_recv, 7, "all-reduce");
        spc_shift_desc_t sd = SPC_SHIFT_DESC_INIT;
        sd.group = m.ring_group;
        sd.ntensors = 1;
        sd.tensors[0].send = ar_send;
        sd.tensors[0].recv = ar_recv;
        sd.tensors[0].bytes = N * sizeof(double);
        st = spc_shift(h, &sd, WAIT_MS);
        if (late_failed(h, rank, st))
            break;
        CHECK_OK(h, st);
        for (int i = 0; i < N; i++)
            if (ar_recv[i] != val(it, pred, i, 7))
                SP_FAIL("iter %d rank %d: ring shift [%d] is %g, expected %g (from rank %d)", it, rank, i, ar_recv[i],
                        val(it, pred, i, 7), pred);
        uint64_t dt = sp_test_now_ms() - t0;
        if (dt > rep->max_iter_ms)
            rep->max_iter_ms = dt;
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

/* ================================================================ a claim by hand */

/* Links to node-0 as `node`, a member of the cluster. */
static void insider_link(sp_test_insider_t *x, const char *node, int port)
{
    char rec[2048];
    sp_test_insider_link(x, SECRET, node, port);
    sp_test_peer_wait(&nodes[0], node, "up", 10000, rec, sizeof rec);
}

/* Claims the job back from node-0 with a nonce of its own, every other field
 * the job's; returns node-0's answer's status, its detail in detail. */
static int32_t claim(sp_test_insider_t *x, char *detail, size_t len)
{
    static uint8_t frame[1 << 16];
    size_t flen;
    uint8_t nonce[16];
    randombytes_buf(nonce, sizeof nonce);
    char *where[P] = { "node-0", "node-0", "node-1", "node-1" };
    Spd__Msg m = SPD__MSG__INIT;
    Spd__PeerJoin j = SPD__PEER_JOIN__INIT;
    j.resume = true;
    j.job_id = job_id;
    j.launch = "";
    j.world_size = P;
    j.uid = (uint32_t)getuid();
    j.nonce = (ProtobufCBinaryData){ sizeof nonce, nonce };
    j.rank_node = where;
    j.n_rank_node = P;
    m.body_case = SPD__MSG__BODY_PEER_JOIN;
    m.peer_join = &j;
    sp_test_send_msg(x->s.fd, &m, NULL, NULL);
    for (uint64_t end = sp_test_now_ms() + 5000; sp_test_now_ms() < end;) {
        Spd__Msg *r = sp_test_next_frame(&x->s, 1000, frame, &flen);
        if (r == NULL || r->body_case != SPD__MSG__BODY_PEER_JOIN_REP) {
            sp_msg_free(r);
            continue;
        }
        CHECK(r->peer_join_rep->resume);
        CHECK_STREQ(r->peer_join_rep->job_id, job_id);
        int32_t st = r->peer_join_rep->status;
        snprintf(detail, len, "%s", r->peer_join_rep->detail);
        sp_msg_free(r);
        return st;
    }
    SP_FAIL("node-0 did not answer the claim");
}

/* ================================================================ the scenarios */

static void kill_node(int i)
{
    CHECK_EQ(kill(nodes[i].pid, SIGKILL), 0);
    CHECK_EQ(sp_test_wait(nodes[i].pid, 5000), -SIGKILL);
    nodes[i].pid = 0;
}

/* Waits for the ranks of a job whose node `killed` restarted `back_ms` after
 * its kill, and checks and prints what it cost them. */
static void relink_report(const char *what, const pid_t *pids, int killed, uint64_t back_ms)
{
    char out[64];
    sp_test_wait_all_ok(pids, P, 120000);
    uint64_t stall = 0, replayed = 0, retried = 0;
    for (int r = 0; r < P; r++) {
        const rank_report_t *rp = &sh->r[r];
        CHECK(rp->done);
        CHECK_EQ(rp->resumes, r / PER == killed ? 1u : 0u);
        stall = rp->max_iter_ms > stall ? rp->max_iter_ms : stall;
        replayed += rp->replayed;
        retried += rp->retried;
        printf("%s: rank %d: longest iteration %" PRIu64 " ms, %" PRIu64 " ops submitted again (%" PRIu64
               " taken before)\n", what, r, rp->max_iter_ms, rp->replayed, rp->retried);
    }
    CHECK_EQ(sp_test_run(out, sizeof out, "grep -c 'sent again from the copy kept' %s || true",
                         nodes[1 - killed].log), 0);
    printf("%s: node-%d back %" PRIu64 " ms after its kill; ranks stalled up to %" PRIu64 " ms; %" PRIu64
           " ops submitted again (%" PRIu64 " taken by the spd before); %d collectives in all ran again on node-%d "
           "from node-%d's kept copy; %d iterations, every result right\n", what, killed, back_ms, stall, replayed,
           retried, atoi(out), killed, 1 - killed, ITERS);
    CHECK(stall < GRACE_MS);
}

/* Lines of node i's log that match the extended regular expression re. */
/* Waits for a job's ranks that no restart touched; all finish right. */
static void steady_report(const char *what, const pid_t *pids)
{
    sp_test_wait_all_ok(pids, P, 120000);
    for (int r = 0; r < P; r++) {
        CHECK(sh->r[r].done);
        CHECK_EQ(sh->r[r].resumes, 0u);
    }
    printf("%s: %d iterations, every result right\n", what, ITERS);
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

int main(void)
{
    char dir[64] = "/tmp/spd-relink-XXXXXX", secret[128], rec[2048], out[256], detail[512];
    CHECK(mkdtemp(dir) != NULL);
    sp_test_secret_file(dir, "secret", SECRET "\n", secret, sizeof secret);
    sh = sp_test_shared(sizeof *sh);
    setenv("SPC_RECONNECT_MS", "20000", 1);   /* late: past the grace */

    char a[2][256], grace[64];
    snprintf(a[0], sizeof a[0], "cluster_secret_file=%s", secret);
    snprintf(grace, sizeof grace, "peer_restart_grace_ms=%d", GRACE_MS);
    const char *args0[] = { "--set", "node_name=node-0", "--set", a[0], "--set", "peer_listen=127.0.0.1:0",
                            "--set", "peer_heartbeat_ms=50", "--set", grace, NULL };
    sp_test_daemon_start(&nodes[0], args0);
    int port0 = sp_test_node_port(&nodes[0]);
    snprintf(a[1], sizeof a[1], "peers=127.0.0.1:%d", port0);
    const char *args1[] = { "--set", "node_name=node-1", "--set", a[0], "--set", a[1],
                            "--set", "peer_heartbeat_ms=50", "--set", grace, NULL };
    sp_test_daemon_start(&nodes[1], args1);
    sp_test_peer_wait(&nodes[0], "node-1", "up", 10000, rec, sizeof rec);

    /* relink, with forged claims while node-1 is down. */
    pid_t pids[P];
    spc_handle_t *owner = start_job(pids);
    wait_iters(KILL_AT);
    uint64_t killed = sp_test_now_ms();
    kill_node(1);
    sp_test_peer_wait(&nodes[0], "node-1", "down", 10000, rec, sizeof rec);

    sp_test_insider_t x;
    insider_link(&x, "node-x", port0);
    CHECK_EQ(claim(&x, detail, sizeof detail), SPC_ERR_PERMISSION);
    CHECK_CONTAINS(detail, "has no ranks on node node-x");
    printf("forged: a claim from node-x refused: %s\n", detail);
    sp_test_insider_close(&x);
    insider_link(&x, "node-1", port0);
    CHECK_EQ(claim(&x, detail, sizeof detail), SPC_ERR_PERMISSION);
    CHECK_CONTAINS(detail, "the relink's nonce is not the job's");
    printf("forged: a claim from node-1 with another nonce refused: %s\n", detail);
    sp_test_insider_close(&x);
    sp_test_peer_wait(&nodes[0], "node-1", "down", 10000, rec, sizeof rec);
    CHECK_EQ(sp_test_run(out, sizeof out, "grep -c 'relink of job .* refused' %s", nodes[0].log), 0);
    CHECK_EQ(atoi(out), 2);

    sp_test_daemon_restart(&nodes[1], args1);
    relink_report("relink", pids, 1, sp_test_now_ms() - killed);
    spc_detach(owner);

    /* root: node-0 comes back on its socket and its peer port, which node-1 dials. */
    char listen0[64];
    snprintf(listen0, sizeof listen0, "peer_listen=127.0.0.1:%d", port0);
    const char *args0_again[] = { "--set", "node_name=node-0", "--set", a[0], "--set", listen0,
                                  "--set", "peer_heartbeat_ms=50", "--set", grace, NULL };
    owner = start_job(pids);
    wait_iters(KILL_AT);
    killed = sp_test_now_ms();
    kill_node(0);
    sp_test_daemon_restart(&nodes[0], args0_again);
    relink_report("root", pids, 0, sp_test_now_ms() - killed);
    spc_detach(owner);   /* it goes to the new node-0 too, holding no job */

    /* upgrade: node-1 stopped for a restart (SIGUSR2: exit 75, nothing drained), then started again. */
    owner = start_job(pids);
    wait_iters(KILL_AT);
    killed = sp_test_now_ms();
    CHECK_EQ(kill(nodes[1].pid, SIGUSR2), 0);
    CHECK_EQ(sp_test_wait(nodes[1].pid, 10000), 75);
    nodes[1].pid = 0;
    sp_test_daemon_restart(&nodes[1], args1);
    relink_report("upgrade", pids, 1, sp_test_now_ms() - killed);
    spc_detach(owner);

    /* held: both daemons held past peer_timeout_ms; neither calls the other silent. */
    int downs[2] = { sp_test_log_count(&nodes[0], "peer node-1 .* down"), sp_test_log_count(&nodes[1], "peer node-0 .* down") };
    owner = start_job(pids);
    wait_iters(KILL_AT);
    for (int i = 0; i < 2; i++)
        CHECK_EQ(kill(nodes[i].pid, SIGSTOP), 0);
    usleep((PEER_TIMEOUT_MS + 1000) * 1000);
    for (int i = 0; i < 2; i++)
        CHECK_EQ(kill(nodes[i].pid, SIGCONT), 0);
    steady_report("held", pids);
    CHECK_EQ(sp_test_log_count(&nodes[0], "peer node-1 .* down"), downs[0]);
    CHECK_EQ(sp_test_log_count(&nodes[1], "peer node-0 .* down"), downs[1]);
    CHECK(sp_test_log_count(&nodes[0], "spd did not run for") >= 1 && sp_test_log_count(&nodes[1], "spd did not run for") >= 1);
    spc_detach(owner);

    /* waited: node-0 held across its grace for node-1, which comes back meanwhile
     * (its own wait for node-0 to take the job back is longer). */
    char long_grace[64];
    snprintf(long_grace, sizeof long_grace, "peer_restart_grace_ms=%d", 4 * GRACE_MS);
    const char *args1_long[] = { "--set", "node_name=node-1", "--set", a[0], "--set", a[1],
                                 "--set", "peer_heartbeat_ms=50", "--set", long_grace, NULL };
    int refused = sp_test_log_count(&nodes[0], "relink of job .* refused");
    owner = start_job(pids);
    wait_iters(KILL_AT);
    killed = sp_test_now_ms();
    kill_node(1);
    sp_test_peer_wait(&nodes[0], "node-1", "down", 10000, rec, sizeof rec);
    CHECK_EQ(kill(nodes[0].pid, SIGSTOP), 0);
    sp_test_daemon_restart(&nodes[1], args1_long);
    while (sp_test_now_ms() - killed < GRACE_MS + 1000)
        usleep(10000);
    CHECK_EQ(kill(nodes[0].pid, SIGCONT), 0);
    uint64_t let_go = sp_test_now_ms() - killed;
    sp_test_wait_all_ok(pids, P, 120000);
    for (int r = 0; r < P; r++)
        CHECK_EQ(sh->r[r].resumes, r / PER == 1 ? 1u : 0u);
    CHECK_EQ(sp_test_log_count(&nodes[0], "relink of job .* refused"), refused);
    printf("waited: node-0 held %" PRIu64 " ms from node-1's kill, past the %d ms grace; node-1 back meanwhile, "
           "taken back; %d iterations, every result right\n", let_go, GRACE_MS, ITERS);
    spc_detach(owner);

    /* late: node-1 back after the grace. */
    sh->late = 1;
    snprintf(sh->why1, sizeof sh->why1, "did not take the job back after this node's spd restarted: job");
    owner = start_job(pids);
    wait_iters(20);
    killed = sp_test_now_ms();
    kill_node(1);
    for (int r = 0; r < PER; r++)
        CHECK_EQ(sp_test_wait(pids[r], GRACE_MS + 10000), 0);
    for (int r = 0; r < PER; r++)
        CHECK(sh->r[r].failed_ms - killed >= GRACE_MS - 100);
    sp_test_daemon_restart(&nodes[1], args1);
    for (int r = PER; r < P; r++)
        CHECK_EQ(sp_test_wait(pids[r], 20000), 0);
    CHECK_EQ(sp_test_run(out, sizeof out, "grep -c 'relink of job .* refused: job .* does not wait for node node-1' %s",
                         nodes[0].log), 0);
    CHECK_EQ(atoi(out), 1);
    spc_detach(owner);

    /* alone: node-1 back without peers. */
    snprintf(sh->why1, sizeof sh->why1, "this spd has no peers (peer_listen, peers), so no daemon can take the job back");
    owner = start_job(pids);
    wait_iters(20);
    killed = sp_test_now_ms();
    kill_node(1);
    const char *alone[] = { "--set", "node_name=node-1", "--set", grace, NULL };
    sp_test_daemon_restart(&nodes[1], alone);
    for (int r = PER; r < P; r++)
        CHECK_EQ(sp_test_wait(pids[r], 20000), 0);
    for (int r = PER; r < P; r++)
        CHECK(sh->r[r].failed_ms - killed < GRACE_MS);
    for (int r = 0; r < PER; r++)
        CHECK_EQ(sp_test_wait(pids[r], GRACE_MS + 10000), 0);
    spc_detach(owner);

    sp_test_node_pair_stop(nodes);
    sp_test_run(out, sizeof out, "rm -rf %s", dir);
    printf("peer_relink: ok\n");
    return 0;
}
