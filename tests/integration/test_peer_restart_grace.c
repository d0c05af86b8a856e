/*
 * A job over two daemons on loopback (two ranks each) whose daemons wait
 * peer_restart_grace_ms for a peer whose link dropped. node-1 is SIGKILLed
 * while node-0's rank 0 waits in an all-reduce (rank 1 joins it within the
 * grace), and started again at once:
 *  - node-0's ranks do not fail before the grace has passed, and then fail with
 *    SPC_ERR_PEER_LOST naming node-1 (its ranks were killed with it and never
 *    came back: test_peer_relink has them come back);
 *  - a job over both daemons that formed with node-1 back, within the grace,
 *    runs all-reduces across its end, each checked against the sum computed
 *    here: the wait covers only the jobs that were complete when the link went;
 *  - afterwards both daemons serve a new job over both.
 */
#include <signal.h>

#include "sp_test.h"

#define GRACE_MS 4000
#define PER      2
#define RANKS    (2 * PER)

static sp_test_daemon_t nodes[2];
static char job_id[SPC_JOB_ID_MAX];
static const char *grace_arg = "peer_restart_grace_ms=4000";

typedef struct shared {
    uint64_t killed_ms;     /* when the parent SIGKILLed node-1 */
    uint64_t failed_ms[RANKS];
    int      loops;         /* all-reduces rank 0 of a LOOP job ran, the last one's included */
} shared_t;

static shared_t *sh;

enum { WAIT_FOR_LOSS, SLEEP, LOOP };

typedef struct rank_arg {
    int      rank;
    int      scenario;
    uint64_t until_ms;      /* LOOP: all-reduces until then */
} rank_arg_t;

/* The sum every rank's all-reduce #i must give: inputs r * 1000 + i + 1. */
static int64_t expected(int i)
{
    int64_t s = 0;
    for (int r = 0; r < RANKS; r++)
        s += r * 1000 + i + 1;
    return s;
}

static int rank_main(void *p)
{
    const rank_arg_t *ra = p;
    setenv("SPC_SOCKET", nodes[ra->rank / PER].sock, 1);
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, RANKS, (uint32_t)ra->rank, 20000, &world));
    int64_t *x = spc_alloc(h, sizeof *x);
    if (ra->scenario == WAIT_FOR_LOSS) {
        /* Rank 1 submits within the grace: node-0 then has the op of both its
         * ranks, and sends node-1 nothing for the job. */
        if (ra->rank == 1) {
            while (__atomic_load_n(&sh->killed_ms, __ATOMIC_ACQUIRE) == 0)
                usleep(1000);
            usleep(300000);
        }
        spc_status_t st = spc_allreduce(h, world, x, x, 1, SPC_I64, SPC_SUM, 30000);
        sh->failed_ms[ra->rank] = sp_test_now_ms();
        if (st != SPC_ERR_PEER_LOST)
            SP_FAIL("rank %d: %s, expected SPC_ERR_PEER_LOST (%s)", ra->rank, spc_status_name(st), spc_last_error(h));
        CHECK_CONTAINS(spc_last_error(h), "node node-1 lost");
        /* The group stays broken: a later op fails at once. */
        uint64_t t0 = sp_test_now_ms();
        CHECK_ST(h, spc_allreduce(h, world, x, x, 1, SPC_I64, SPC_SUM, 30000), SPC_ERR_PEER_LOST);
        CHECK(sp_test_now_ms() - t0 < 2000);
    } else if (ra->scenario == LOOP) {
        /* Every rank runs the same count: rank 0 decides when to stop, and says
         * so in the all-reduce (a negative input ends the loop). */
        for (int i = 0;; i++) {
            bool last = ra->rank == 0 && sp_test_now_ms() >= ra->until_ms;
            *x = last ? -1000000000 : ra->rank * 1000 + i + 1;
            CHECK_OK(h, spc_allreduce(h, world, x, x, 1, SPC_I64, SPC_SUM, 20000));
            if (*x < 0) {
                if (ra->rank == 0)
                    sh->loops = i + 1;
                break;
            }
            CHECK_EQ(*x, expected(i));
        }
    } else {
        pause();   /* killed with its daemon's loss */
    }
    spc_detach(h);
    return 0;
}

/* Makes a job on node-0 and forks its ranks; the creator stays attached until
 * the caller detaches the handle returned. */
static spc_handle_t *start_job(pid_t *pids, const int *scenario, uint64_t until_ms)
{
    setenv("SPC_SOCKET", nodes[0].sock, 1);
    spc_handle_t *owner = sp_test_attach();
    CHECK_OK(owner, spc_job_create(owner, job_id, sizeof job_id));
    for (int r = 0; r < RANKS; r++) {
        rank_arg_t ra = { r, scenario[r], until_ms };
        pids[r] = sp_test_fork(rank_main, &ra);
    }
    return owner;
}

/* node-0's `spctl jobs` record of job, in rec. */
static void job_record(const char *job, char *rec, size_t len)
{
    static char out[16384];
    char needle[SPC_JOB_ID_MAX + 16];
    snprintf(needle, sizeof needle, "\"%s\"", job);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s --json jobs", sp_test_spctl_bin(), nodes[0].sock), 0);
    CHECK(sp_test_json_record(out, out, needle, rec, len));
}

static void wait_complete(const char *job)
{
    char out[16384], needle[SPC_JOB_ID_MAX + 16], rec[2048];
    snprintf(needle, sizeof needle, "\"%s\"", job);
    uint64_t deadline = sp_test_now_ms() + 10000;
    for (;;) {
        CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s --json jobs", sp_test_spctl_bin(), nodes[0].sock), 0);
        if (sp_test_json_record(out, out, needle, rec, sizeof rec) && sp_test_json_int(rec, "complete") == 1)
            return;
        CHECK(sp_test_now_ms() < deadline);
        usleep(20000);
    }
}

int main(void)
{
    char dir[64] = "/tmp/spd-grace-XXXXXX", secret[128], rec[2048], out[256];
    CHECK(mkdtemp(dir) != NULL);
    sp_test_secret_file(dir, "secret", "two nodes share this secret, 2026\n", secret, sizeof secret);
    sh = sp_test_shared(sizeof *sh);

    /* node-0 listens; node-1 dials it, and dials it again when restarted. */
    char a[4][256];
    snprintf(a[0], sizeof a[0], "cluster_secret_file=%s", secret);
    const char *args0[] = { "--set", "node_name=node-0", "--set", a[0], "--set", "peer_listen=127.0.0.1:0",
                            "--set", "peer_heartbeat_ms=50", "--set", grace_arg, NULL };
    sp_test_daemon_start(&nodes[0], args0);
    snprintf(a[1], sizeof a[1], "peers=127.0.0.1:%d", sp_test_node_port(&nodes[0]));
    const char *args1[] = { "--set", "node_name=node-1", "--set", a[0], "--set", a[1],
                            "--set", "peer_heartbeat_ms=50", "--set", grace_arg, NULL };
    sp_test_daemon_start(&nodes[1], args1);
    sp_test_peer_wait(&nodes[0], "node-1", "up", 10000, rec, sizeof rec);
    sp_test_peer_wait(&nodes[1], "node-0", "up", 10000, rec, sizeof rec);

    /* node-0's ranks wait in an all-reduce that node-1's never submit. */
    pid_t pids[RANKS], loop[RANKS];
    int scen[RANKS];
    for (int r = 0; r < RANKS; r++)
        scen[r] = r / PER == 1 ? SLEEP : WAIT_FOR_LOSS;
    spc_handle_t *owner = start_job(pids, scen, 0);
    char waited[SPC_JOB_ID_MAX];
    snprintf(waited, sizeof waited, "%s", job_id);
    wait_complete(waited);
    usleep(200000);   /* rank 0 into its all-reduce */

    CHECK_EQ(kill(nodes[1].pid, SIGKILL), 0);
    __atomic_store_n(&sh->killed_ms, sp_test_now_ms(), __ATOMIC_RELEASE);
    CHECK_EQ(sp_test_wait(nodes[1].pid, 5000), -SIGKILL);
    nodes[1].pid = 0;
    for (int r = PER; r < RANKS; r++) {
        kill(pids[r], SIGKILL);
        sp_test_wait(pids[r], 5000);
    }
    sp_test_daemon_restart(&nodes[1], args1);
    sp_test_peer_wait(&nodes[0], "node-1", "up", 10000, rec, sizeof rec);
    uint64_t back_ms = sp_test_now_ms() - sh->killed_ms;
    CHECK(back_ms < GRACE_MS - 1000);   /* room for the job below to form within the grace */
    /* spctl jobs says what the job waits for, and how much longer. */
    char waiting[64], text[16384];
    job_record(waited, rec, sizeof rec);
    sp_test_json_str(rec, "waiting_for", waiting, sizeof waiting);
    CHECK(strcmp(waiting, "node-1") == 0);
    long long left = sp_test_json_int(rec, "waiting_left_ms");
    CHECK(left > 0 && left <= GRACE_MS);
    CHECK_EQ(sp_test_run(text, sizeof text, "%s --socket %s jobs", sp_test_spctl_bin(), nodes[0].sock), 0);
    CHECK_CONTAINS(text, "waiting for node node-1 to come back");

    /* A job over both, formed with node-1 back, loops across the grace's end. */
    for (int r = 0; r < RANKS; r++)
        scen[r] = LOOP;
    spc_handle_t *owner2 = start_job(loop, scen, sh->killed_ms + GRACE_MS + 1000);

    /* node-0's ranks fail once the grace has passed, not before. */
    for (int r = 0; r < PER; r++)
        CHECK_EQ(sp_test_wait(pids[r], GRACE_MS + 10000), 0);
    for (int r = 0; r < PER; r++) {
        uint64_t after = sh->failed_ms[r] - sh->killed_ms;
        printf("rank %d failed %" PRIu64 " ms after node-1's kill (grace %d ms, node-1 back after %" PRIu64 " ms)\n",
               r, after, GRACE_MS, back_ms);
        CHECK(after >= GRACE_MS - 100 && after < GRACE_MS + 5000);
    }
    job_record(waited, rec, sizeof rec);   /* its creator holds it: listed, waiting no more */
    sp_test_json_str(rec, "waiting_for", waiting, sizeof waiting);
    CHECK(waiting[0] == '\0');
    spc_detach(owner);
    sp_test_wait_all_ok(loop, RANKS, 30000);
    spc_detach(owner2);
    printf("the job formed within the grace ran %d all-reduces across its end\n", sh->loops);
    CHECK(sh->loops > 1);

    /* Both serve a new job over both. */
    for (int r = 0; r < RANKS; r++)
        scen[r] = LOOP;
    owner = start_job(loop, scen, sp_test_now_ms() + 500);
    sp_test_wait_all_ok(loop, RANKS, 30000);
    spc_detach(owner);

    CHECK_EQ(sp_test_daemon_stop(&nodes[1]), 0);
    CHECK_EQ(sp_test_daemon_stop(&nodes[0]), 0);
    for (int i = 0; i < 2; i++)
        sp_test_daemon_cleanup(&nodes[i]);
    sp_test_run(out, sizeof out, "rm -rf %s", dir);
    printf("peer_restart_grace: ok\n");
    return 0;
}
