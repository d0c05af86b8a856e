/*
 * Named jobs across daemons: the ranks of one launch on two daemons linked as
 * peers (node-0 and node-1 on loopback) each call spc_init_from_env with
 * torchrun's variables and nothing else; no id passes between them.
 *
 *   - 4 ranks, 2 on each daemon, all-reduce and all-gather right, against sums
 *     computed here; the job's home is node-0, where rank 0 joined, and lists
 *     both nodes; rank 0 joining first, then last (the others wait in lookups,
 *     which spctl status counts as name_lookups, and the metrics as
 *     spd_name_lookups), in much less than name_lookup_ms: the home says so;
 *   - a second launch of a name while the first runs is refused on the daemon
 *     that holds it and on one that does not, naming the launch that holds it
 *     and, across daemons, its node;
 *   - past max_name_lookups a named join that would wait for its home is
 *     refused, naming the option;
 *   - a process of another uid under the same name joins its own name, not
 *     this one: no daemon is that name's home and its join times out saying
 *     so, while the root's job completes without it;
 *   - a name whose rank 0 joined on two daemons that cannot see each other
 *     (node-2 links to node-1 only): a rank joining on node-1 is refused,
 *     naming both homes, rather than joining half a job;
 *   - both daemons keep serving after each refusal.
 *
 * The other uid switches with setresuid, which needs root; without root that
 * part is left out, said on stderr.
 */
#include <grp.h>
#include <math.h>
#include <unistd.h>

#include "sp_test.h"

#define OTHER_UID  60001u
#define SHARED_GID 65534u

static sp_test_daemon_t nodes[3];
static char job_dir[64] = "/tmp/spd-named-nodes-XXXXXX";

typedef struct shared {
    volatile int release;   /* ranks that hold a job may leave */
} shared_t;

static shared_t *sh;

/* One rank of a launch: where it runs and what its launcher's variables say. */
typedef struct rank_arg {
    int          node;           /* the daemon it attaches to */
    unsigned     rank, world, local_world;
    const char  *run_id, *port;  /* TORCHELASTIC_RUN_ID and MASTER_PORT: the launch */
    const char  *spc_job;        /* NULL: the job is named after the run id */
    uid_t        uid;            /* 0: stays root */
    int          timeout_ms;
    spc_status_t expect;
    const char  *detail;         /* a refusal's, or the timeout's */
    bool         hold;           /* stays in the job until sh->release */
} rank_arg_t;

static double value(unsigned rank, int i)
{
    return sin(0.29 * i + rank) * pow(10.0, (double)rank - 1.5);
}

static void set_u(const char *name, unsigned v)
{
    char s[16];
    snprintf(s, sizeof s, "%u", v);
    CHECK_EQ(setenv(name, s, 1), 0);
}

static void torchrun_env(const rank_arg_t *a)
{
    set_u("RANK", a->rank);
    set_u("WORLD_SIZE", a->world);
    set_u("LOCAL_RANK", a->rank % a->local_world);
    set_u("LOCAL_WORLD_SIZE", a->local_world);
    set_u("GROUP_WORLD_SIZE", a->world / a->local_world);
    CHECK_EQ(setenv("TORCHELASTIC_RUN_ID", a->run_id, 1), 0);
    CHECK_EQ(setenv("TORCHELASTIC_RESTART_COUNT", "0", 1), 0);
    CHECK_EQ(setenv("MASTER_ADDR", "127.0.0.1", 1), 0);
    CHECK_EQ(setenv("MASTER_PORT", a->port != NULL ? a->port : "29500", 1), 0);
    if (a->spc_job != NULL)
        CHECK_EQ(setenv("SPC_JOB", a->spc_job, 1), 0);
    else
        unsetenv("SPC_JOB");
}

/* The rank: joins through spc_init_from_env, then all-reduces and all-gathers. */
static int rank_main(void *p)
{
    const rank_arg_t *a = p;
    spc_launch_t l = SPC_LAUNCH_INIT;
    spc_handle_t *h = NULL;

    if (a->uid != 0)
        sp_test_become(a->uid, SHARED_GID);
    setenv("SPC_SOCKET", nodes[a->node].sock, 1);
    torchrun_env(a);
    spc_status_t st = spc_init_from_env(NULL, a->timeout_ms ? a->timeout_ms : 20000, &l, &h);
    if (st != a->expect)
        SP_FAIL("rank %u on node-%d: %s, expected %s (%s)", a->rank, a->node, spc_status_name(st),
                spc_status_name(a->expect), spc_last_error(NULL));
    if (st != SPC_OK) {
        CHECK_CONTAINS(spc_last_error(NULL), a->detail);
        CHECK(h == NULL);
        return 0;
    }
    CHECK_EQ(l.rank, a->rank);
    CHECK_EQ(l.world_size, a->world);

    enum { N = 257 };
    double *x = spc_alloc(h, N * sizeof *x);
    for (int i = 0; i < N; i++)
        x[i] = value(a->rank, i);
    CHECK_OK(h, spc_allreduce(h, l.world, x, x, N, SPC_F64, SPC_SUM, 20000));
    for (int i = 0; i < N; i++) {
        double want = value(0, i);   /* summed in rank order, as spd promises */
        for (unsigned r = 1; r < a->world; r++)
            want += value(r, i);
        if (memcmp(&x[i], &want, sizeof want) != 0)
            SP_FAIL("rank %u: all-reduce element %d is %.17g, not %.17g", a->rank, i, x[i], want);
    }
    int32_t *mine = spc_alloc(h, 2 * sizeof *mine), *all = spc_alloc(h, a->world * 2 * sizeof *all);
    mine[0] = (int32_t)a->rank * 10;
    mine[1] = a->node;
    CHECK_OK(h, spc_allgather(h, l.world, mine, all, 2, SPC_I32, 20000));
    for (unsigned r = 0; r < a->world; r++)
        CHECK_EQ(all[2 * r], (int32_t)r * 10);
    if (a->hold)
        while (!sh->release)
            usleep(2000);
    spc_detach(h);
    return 0;
}

/* spctl's answer on daemon d to `what` (--json). */
static const char *spctl(const sp_test_daemon_t *d, const char *what)
{
    static char out[65536];
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s --json %s", sp_test_spctl_bin(), d->sock, what), 0);
    return out;
}

/* Waits until daemon d counts `want` named joins waiting for their home. */
static void wait_lookups(const sp_test_daemon_t *d, long long want)
{
    uint64_t deadline = sp_test_now_ms() + 10000;
    long long n;
    while ((n = sp_test_json_int(spctl(d, "status"), "name_lookups")) != want) {
        if (sp_test_now_ms() > deadline)
            SP_FAIL("%s: %lld named joins wait for their home, not %lld", d->sock, n, want);
        usleep(10000);
    }
}

/* Waits until daemon d lists job `id` with `joined` ranks joined there. */
static void wait_joined(const sp_test_daemon_t *d, const char *id, int joined)
{
    setenv("SPC_SOCKET", d->sock, 1);
    spc_handle_t *obs = sp_test_attach();
    CHECK(sp_test_wait_job_joined(obs, id, joined, 10000));
    spc_detach(obs);
}

/* Four ranks, two on each daemon; rank 0 forked first or last. */
static void four_ranks(const char *run_id, bool rank0_last)
{
    rank_arg_t a[4];
    pid_t pids[4];
    uint64_t start = sp_test_now_ms();
    for (unsigned r = 0; r < 4; r++)
        a[r] = (rank_arg_t){ .node = (int)(r / 2), .rank = r, .world = 4, .local_world = 2, .run_id = run_id };
    for (unsigned k = 0; k < 4; k++) {
        unsigned r = rank0_last ? (k + 1) % 4 : k;
        if (rank0_last && r == 0) {
            /* Ranks 1, 2 and 3 wait for a home: one on node-0, two on node-1. */
            wait_lookups(&nodes[0], 1);
            wait_lookups(&nodes[1], 2);
            static char metrics[65536];
            CHECK_EQ(sp_test_run(metrics, sizeof metrics, "%s --socket %s metrics", sp_test_spctl_bin(),
                                 nodes[1].sock), 0);
            CHECK_CONTAINS(metrics, "\nspd_name_lookups 2\n");
            start = sp_test_now_ms();
        }
        pids[r] = sp_test_fork(rank_main, &a[r]);
    }
    sp_test_wait_all_ok(pids, 4, 40000);
    /* Ranks that heard "not here" before rank 0 came ask again when its spd
     * says it is the home, not a round (name_lookup_ms, 10 s here) later. */
    uint64_t took = sp_test_now_ms() - start;
    if (took >= 5000)
        SP_FAIL("rank 0 %s: the launch took %llu ms to join and run", rank0_last ? "last" : "first",
                (unsigned long long)took);
}

static void test_one_job(void)
{
    char id[SPC_JOB_ID_MAX];
    rank_arg_t a[4];
    pid_t pids[4];

    four_ranks("first0", false);
    four_ranks("last0", true);

    /* While a job runs, the home lists both nodes, the home first. */
    sh->release = 0;
    for (unsigned r = 0; r < 4; r++) {
        a[r] = (rank_arg_t){ .node = (int)(r / 2), .rank = r, .world = 4, .local_world = 2, .run_id = "held",
                             .hold = true };
        pids[r] = sp_test_fork(rank_main, &a[r]);
    }
    snprintf(id, sizeof id, "%u/torchrun-held", (unsigned)getuid());
    wait_joined(&nodes[1], id, 4);   /* node-1 counts every rank once the home said the world is complete */
    const char *jobs = spctl(&nodes[0], "jobs");
    CHECK_CONTAINS(jobs, id);
    CHECK_CONTAINS(jobs, "\"nodes\":\"node-0,node-1\"");

    /* Another launch of the same name (another MASTER_PORT) on either daemon. */
    rank_arg_t again = { .node = 1, .rank = 0, .world = 4, .local_world = 2, .run_id = "held", .port = "29501",
                         .expect = SPC_ERR_BUSY, .detail = "is held by another launch (held.0@127.0.0.1:29500" };
    pid_t p = sp_test_fork(rank_main, &again);
    sp_test_wait_all_ok(&p, 1, 20000);
    again.node = 0;
    again.rank = 3;
    p = sp_test_fork(rank_main, &again);
    sp_test_wait_all_ok(&p, 1, 20000);
    sh->release = 1;
    sp_test_wait_all_ok(pids, 4, 40000);
}

/* A launch wholly on node-0 holds a name; another launch of it joins on node-1,
 * which holds nothing of it and learns from node-0 that it is taken. */
static void test_reuse_elsewhere(void)
{
    rank_arg_t a[2];
    pid_t pids[2];
    char id[SPC_JOB_ID_MAX];

    sh->release = 0;
    for (unsigned r = 0; r < 2; r++) {
        a[r] = (rank_arg_t){ .node = 0, .rank = r, .world = 2, .local_world = 2, .run_id = "solo-a",
                             .spc_job = "solo", .hold = true };
        pids[r] = sp_test_fork(rank_main, &a[r]);
    }
    snprintf(id, sizeof id, "%u/solo", (unsigned)getuid());
    wait_joined(&nodes[0], id, 2);
    rank_arg_t other = { .node = 1, .rank = 1, .world = 2, .local_world = 1, .run_id = "solo-b", .spc_job = "solo",
                         .expect = SPC_ERR_BUSY, .detail = "is held by another launch (solo-a.0@127.0.0.1:29500" };
    pid_t p = sp_test_fork(rank_main, &other);
    sp_test_wait_all_ok(&p, 1, 20000);
    other.detail = ") on node node-0; this rank's launch is solo-b.0@127.0.0.1:29500";
    p = sp_test_fork(rank_main, &other);
    sp_test_wait_all_ok(&p, 1, 20000);
    sh->release = 1;
    sp_test_wait_all_ok(pids, 2, 20000);
}

/* node-1 lets 3 named joins wait for a home at once (max_name_lookups): the
 * fourth is refused, saying so, and the three time out as rank 0 never comes. */
static void test_lookup_limit(void)
{
    rank_arg_t a[4];
    pid_t pids[3];
    for (unsigned r = 0; r < 4; r++)
        a[r] = (rank_arg_t){ .node = 1, .rank = r + 1, .world = 5, .local_world = 1, .run_id = "crowd",
                             .timeout_ms = 2000, .expect = SPC_ERR_TIMEOUT,
                             .detail = "no daemon is the home of job" };
    for (unsigned r = 0; r < 3; r++)
        pids[r] = sp_test_fork(rank_main, &a[r]);
    wait_lookups(&nodes[1], 3);
    a[3].expect = SPC_ERR_LIMIT;
    a[3].detail = "3 named joins already wait to learn which daemon is their job's home (max_name_lookups)";
    pid_t p = sp_test_fork(rank_main, &a[3]);
    sp_test_wait_all_ok(&p, 1, 10000);
    sp_test_wait_all_ok(pids, 3, 10000);
    wait_lookups(&nodes[1], 0);
}

/* Another user under the same name and launch claims rank 3 first. */
static void test_other_uid(void)
{
    if (geteuid() != 0) {
        fprintf(stderr, "left out: another uid's rank needs root to switch uid\n");
        return;
    }
    rank_arg_t a[4];
    pid_t pids[4];
    char id[SPC_JOB_ID_MAX];
    for (unsigned r = 0; r < 4; r++)
        a[r] = (rank_arg_t){ .node = (int)(r / 2), .rank = r, .world = 4, .local_world = 2, .run_id = "mine" };
    for (unsigned r = 0; r < 3; r++)
        pids[r] = sp_test_fork(rank_main, &a[r]);
    snprintf(id, sizeof id, "%u/torchrun-mine", (unsigned)getuid());
    wait_joined(&nodes[1], id, 1);
    rank_arg_t stranger = a[3];
    stranger.uid = OTHER_UID;
    stranger.timeout_ms = 1500;
    stranger.expect = SPC_ERR_TIMEOUT;
    char detail[96];
    snprintf(detail, sizeof detail, "no daemon is the home of job %u/torchrun-mine yet", OTHER_UID);
    stranger.detail = detail;
    pid_t p = sp_test_fork(rank_main, &stranger);
    sp_test_wait_all_ok(&p, 1, 20000);
    pids[3] = sp_test_fork(rank_main, &a[3]);
    sp_test_wait_all_ok(pids, 4, 40000);
}

/* node-2 links to node-1 only: rank 0 of one launch joins on node-0 and on
 * node-2, and each makes the job, seeing no other home. A rank on node-1,
 * which sees both, is refused. */
static void test_two_homes(const char *secret, int port1)
{
    char peers[64], rec[2048], id[SPC_JOB_ID_MAX];
    snprintf(peers, sizeof peers, "127.0.0.1:%d", port1);
    sp_test_node_start(&nodes[2], "node-2", secret, "", peers, 5000);
    sp_test_peer_wait(&nodes[1], "node-2", "up", 10000, rec, sizeof rec);
    sp_test_peer_wait(&nodes[2], "node-1", "up", 10000, rec, sizeof rec);

    snprintf(id, sizeof id, "%u/split", (unsigned)getuid());
    rank_arg_t zero = { .node = 0, .rank = 0, .world = 3, .local_world = 1, .run_id = "split", .spc_job = "split",
                        .timeout_ms = 3000, .expect = SPC_ERR_TIMEOUT, .detail = "have not joined job" };
    pid_t pids[2];
    pids[0] = sp_test_fork(rank_main, &zero);
    wait_joined(&nodes[0], id, 1);
    zero.node = 2;
    pids[1] = sp_test_fork(rank_main, &zero);
    wait_joined(&nodes[2], id, 1);
    rank_arg_t one = { .node = 1, .rank = 1, .world = 3, .local_world = 1, .run_id = "split", .spc_job = "split",
                       .expect = SPC_ERR_BUSY, .detail = "two homes, node node-" };
    pid_t p = sp_test_fork(rank_main, &one);
    sp_test_wait_all_ok(&p, 1, 20000);
    sp_test_wait_all_ok(pids, 2, 20000);
    CHECK_EQ(sp_test_daemon_stop(&nodes[2]), 0);
}

static void serving(int node)
{
    setenv("SPC_SOCKET", nodes[node].sock, 1);
    sp_test_daemon_serves();
}

int main(void)
{
    char secret[192], peers[64], rec[2048], a[6][256];
    CHECK(mkdtemp(job_dir) != NULL);
    sp_test_secret_file(job_dir, "secret", "the named nodes' shared secret\n", secret, sizeof secret);
    sh = sp_test_shared(sizeof *sh);

    /* node-1 dials node-0; both admit the shared group, for the other uid. */
    peers[0] = '\0';
    for (int i = 0; i < 2; i++) {
        snprintf(a[0], sizeof a[0], "node_name=node-%d", i);
        snprintf(a[1], sizeof a[1], "cluster_secret_file=%s", secret);
        snprintf(a[2], sizeof a[2], "peers=%s", peers);
        const char *args[] = { "--set", a[0], "--set", a[1], "--set", "peer_listen=127.0.0.1:0", "--set", a[2],
                               "--set", "peer_heartbeat_ms=50", "--set", "allow_group=65534",
                               "--set", "name_lookup_ms=10000", "--set", "max_name_lookups=3", NULL };
        sp_test_daemon_start(&nodes[i], args);
        snprintf(peers, sizeof peers, "127.0.0.1:%d", sp_test_node_port(&nodes[i]));
    }
    int port1 = sp_test_node_port(&nodes[1]);
    sp_test_peer_wait(&nodes[0], "node-1", "up", 10000, rec, sizeof rec);
    sp_test_peer_wait(&nodes[1], "node-0", "up", 10000, rec, sizeof rec);

    test_one_job();
    test_reuse_elsewhere();
    test_lookup_limit();
    serving(0);
    serving(1);
    test_other_uid();
    test_two_homes(secret, port1);
    for (int i = 0; i < 2; i++) {
        CHECK_EQ(sp_test_json_int(spctl(&nodes[i], "status"), "name_lookups"), 0);
        serving(i);
    }
    for (int i = 1; i >= 0; i--)
        CHECK_EQ(sp_test_daemon_stop(&nodes[i]), 0);
    for (int i = 0; i < 3; i++)
        sp_test_daemon_cleanup(&nodes[i]);
    char out[256];
    sp_test_run(out, sizeof out, "rm -rf %s", job_dir);
    return 0;
}
