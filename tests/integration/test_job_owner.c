/*
 * Users that share spd through allow_group do not share their jobs. User A
 * (uid 60001) and user B (uid 60002), both in the allowed group, attach to one
 * spd that runs as root:
 *
 *   - A's job is not in B's answers to any query (jobs, clients, mesh, ops,
 *     stats, history, metrics), while the operator (root) sees it everywhere;
 *   - B cannot join A's assembling job: SPC_ERR_PERMISSION naming the owner,
 *     logged by spd; the job is not disturbed, A's ranks complete it and A's
 *     all-reduce is right;
 *   - with A's explicit grant, B joins and reduces with A;
 *   - across daemons the root decides: B joining on another node is refused the
 *     same way; once A's first rank there is in, that node knows whose the job
 *     is and refuses B itself; A's ranks complete the job, and that node shows
 *     it to A and not to B;
 *   - spd keeps serving.
 *
 * The users are children that switch uid (setresuid), which needs root, else
 * the test is skipped (77).
 */
#include <grp.h>
#include <unistd.h>

#include "sp_test.h"

#define USER_A 60001u
#define USER_B 60002u
#define SHARED_GID 65534u

typedef struct shared {
    char         job[SPC_JOB_ID_MAX];
    volatile int created;        /* the job id is in `job` */
    volatile int reduced;        /* ranks of A whose all-reduce came out right */
    volatile int release;        /* A's ranks may leave */
} shared_t;

/* Set before the ranks are forked: the job's size, and where rank r > 0 and
 * user B attach (another daemon's socket in the cluster case; NULL: spd's). */
static int world = 2;
static const char *elsewhere;

static shared_t *sh;

static void wait_flag(volatile int *flag, int want)
{
    uint64_t deadline = sp_test_now_ms() + 20000;
    while (*flag < want) {
        if (sp_test_now_ms() > deadline)
            SP_FAIL("waited 20 s for a flag to reach %d (it is %d)", want, *flag);
        usleep(2000);
    }
}

/* The token's first 16 hex digits: in a whole id and in a metrics label alike. */
static const char *token_of(const char *job)
{
    static char t[17];
    const char *colon = strrchr(job, ':');
    CHECK(colon != NULL);
    snprintf(t, sizeof t, "%s", colon + 1);
    return t;
}

/* Whether any string field of a topic's answer mentions the needle. */
static bool query_mentions(spc_handle_t *h, const char *topic, const char *needle)
{
    spc_query_result_t *r;
    CHECK_OK(h, spc_query(h, topic, "", &r));
    bool found = false;
    for (size_t i = 0; i < spc_query_records(r) && !found; i++)
        for (size_t f = 0; f < spc_query_fields(r, i) && !found; f++)
            found = spc_query_kind(r, i, f) == SPC_VALUE_STRING && strstr(spc_query_str(r, i, f), needle) != NULL;
    spc_query_free(r);
    return found;
}

static const char *const all_topics[] = { "jobs", "clients", "mesh", "ops", "stats", "history", "metrics", NULL };

/* The owner_uid `spctl jobs` shows for the job, -2 when it shows no such job. */
static int64_t listed_owner(spc_handle_t *h, const char *job)
{
    spc_query_result_t *r;
    CHECK_OK(h, spc_query(h, "jobs", "", &r));
    int64_t owner = -2;
    for (size_t i = 0; i < spc_query_records(r); i++)
        if (strcmp(spc_query_str(r, i, (size_t)spc_query_find(r, i, "id")), job) == 0)
            owner = spc_query_int(r, i, (size_t)spc_query_find(r, i, "owner_uid"));
    spc_query_free(r);
    return owner;
}

/* A's rank: rank 0 creates the job (granting `grant` if not 0), both join and
 * all-reduce their rank + 1, then stay until released so that the job is
 * live while B looks for it. */
static int a_rank(int rank, uid_t grant)
{
    sp_test_become(USER_A, SHARED_GID);
    if (rank > 0 && elsewhere != NULL)
        setenv("SPC_SOCKET", elsewhere, 1);
    spc_handle_t *h = sp_test_attach();
    if (rank == 0) {
        uint32_t uids[] = { grant };
        spc_job_params_t p = { .struct_size = sizeof p, .allow_uids = uids, .nallow_uids = grant != 0 };
        CHECK_OK(h, spc_job_create_with(h, &p, sh->job, sizeof sh->job));
        sh->created = 1;
    } else {
        wait_flag(&sh->created, 1);
    }
    spc_group_t g;
    CHECK_OK(h, spc_job_join(h, sh->job, (uint32_t)world, (uint32_t)rank, 20000, &g));
    double *x = spc_alloc(h, sizeof *x);
    *x = rank + 1;
    CHECK_OK(h, spc_allreduce(h, g, x, x, 1, SPC_F64, SPC_SUM, 10000));
    CHECK_EQ(*x, world * (world + 1) / 2);
    CHECK_EQ(listed_owner(h, sh->job), USER_A);   /* its owner sees it, here and on a mirror */
    __atomic_add_fetch(&sh->reduced, 1, __ATOMIC_SEQ_CST);
    wait_flag(&sh->release, 1);
    spc_detach(h);
    return 0;
}

static int a_rank0(void *arg) { return a_rank(0, (uid_t)(uintptr_t)arg); }
static int a_rank_n(void *arg) { return a_rank((int)(intptr_t)arg, 0); }

/* B tries rank `arg` of A's assembling job: it sees no trace of the job and is
 * refused, by the root ("root node node-0: ...") when the daemon B is on has
 * not heard whose the job is yet. */
static int b_intrudes(void *arg)
{
    int rank = (int)(intptr_t)arg;
    sp_test_become(USER_B, SHARED_GID);
    if (elsewhere != NULL)
        setenv("SPC_SOCKET", elsewhere, 1);
    spc_handle_t *h = sp_test_attach();
    spc_query_result_t *r;
    CHECK_OK(h, spc_query(h, "jobs", "", &r));
    CHECK_EQ(spc_query_records(r), 0);
    spc_query_free(r);
    CHECK_ST(h, spc_query(h, "jobs", sh->job, &r), SPC_ERR_NOT_FOUND);

    spc_group_t g;
    CHECK_ST(h, spc_job_join(h, sh->job, (uint32_t)world, (uint32_t)rank, 5000, &g), SPC_ERR_PERMISSION);
    char want[256];
    snprintf(want, sizeof want, "%sjob %s belongs to uid %u; uid %u may not join it",
             elsewhere != NULL && rank == 1 ? "root node node-0: " : "", sh->job, USER_A, USER_B);
    CHECK_CONTAINS(spc_last_error(h), want);
    if (elsewhere != NULL && rank > 1 && strstr(spc_last_error(h), "root node") != NULL)
        SP_FAIL("the daemon that knows whose the job is asked the root: %s", spc_last_error(h));
    /* Refused, B's handle is as good as before: it runs a job of its own. */
    char mine[SPC_JOB_ID_MAX];
    CHECK_OK(h, spc_job_create(h, mine, sizeof mine));
    CHECK_OK(h, spc_job_join(h, mine, 1, 0, 5000, &g));
    CHECK_OK(h, spc_barrier(h, g, 5000));
    spc_detach(h);
    return 0;
}

/* B looks for A's live, complete job in every answer spd (at `arg`) gives. */
static int b_looks(void *arg)
{
    const char *sock = arg;
    sp_test_become(USER_B, SHARED_GID);
    if (sock != NULL)
        setenv("SPC_SOCKET", sock, 1);
    spc_handle_t *h = sp_test_attach();
    for (int i = 0; all_topics[i] != NULL; i++)
        if (query_mentions(h, all_topics[i], token_of(sh->job)))
            SP_FAIL("user B's '%s' names user A's job %s", all_topics[i], sh->job);
    const char *named[] = { "jobs", "mesh", "ops", "stats", "history" };
    for (size_t i = 0; i < sizeof named / sizeof named[0]; i++) {
        spc_query_result_t *r;
        CHECK_ST(h, spc_query(h, named[i], sh->job, &r), SPC_ERR_NOT_FOUND);
    }
    spc_detach(h);
    return 0;
}

/* B joins a job whose creator granted it, and reduces with A. */
static int b_granted(void *arg)
{
    (void)arg;
    sp_test_become(USER_B, SHARED_GID);
    spc_handle_t *h = sp_test_attach();
    wait_flag(&sh->created, 1);
    CHECK_EQ(listed_owner(h, sh->job), USER_A);   /* a grant shows the job too */
    spc_group_t g;
    CHECK_OK(h, spc_job_join(h, sh->job, 2, 1, 20000, &g));
    double *x = spc_alloc(h, sizeof *x);
    *x = 2;
    CHECK_OK(h, spc_allreduce(h, g, x, x, 1, SPC_F64, SPC_SUM, 10000));
    CHECK_EQ(*x, 3);
    spc_detach(h);
    return 0;
}

static void log_has(const sp_test_daemon_t *d, const char *needle)
{
    char out[64];
    if (sp_test_run(out, sizeof out, "grep -F -q '%s' %s", needle, d->log) != 0)
        SP_FAIL("spd's log %s has no line with \"%s\"", d->log, needle);
}

/* A's job assembles; B is refused; A completes it; B sees none of it. One
 * daemon: world 2. Two (`mirror` the second, where ranks 1 and 2 attach):
 * world 3, B tries rank 1 before A's rank 1 is in, rank 2 after. */
static void isolation(const sp_test_daemon_t *root, const sp_test_daemon_t *mirror, spc_handle_t *op)
{
    memset(sh, 0, sizeof *sh);
    elsewhere = mirror != NULL ? mirror->sock : NULL;
    world = mirror != NULL ? 3 : 2;
    pid_t a[3];
    a[0] = sp_test_fork(a_rank0, NULL);
    wait_flag(&sh->created, 1);
    CHECK(sp_test_wait_job_joined(op, sh->job, 1, 10000));

    pid_t b = sp_test_fork(b_intrudes, (void *)(intptr_t)1);
    CHECK_EQ(sp_test_wait(b, 20000), 0);
    CHECK(sp_test_wait_job_joined(op, sh->job, 1, 0));   /* undisturbed: A's rank 0 alone */
    char line[256];
    snprintf(line, sizeof line, "(uid %u) refused: %sjob %s belongs to uid %u", USER_B,
             mirror != NULL ? "root node node-0: " : "", sh->job, USER_A);
    log_has(mirror != NULL ? mirror : root, line);

    for (int r = 1; r < world; r++) {
        a[r] = sp_test_fork(a_rank_n, (void *)(intptr_t)r);
        if (r + 1 == world)
            break;
        /* The mirror learns whose the job is with A's first rank there... */
        spc_attach_params_t p = { .struct_size = sizeof p, .socket_path = mirror->sock };
        spc_handle_t *mop;
        CHECK_OK(NULL, spc_attach(&p, &mop));
        uint64_t deadline = sp_test_now_ms() + 10000;
        while (listed_owner(mop, sh->job) != USER_A && sp_test_now_ms() < deadline)
            usleep(2000);
        CHECK_EQ(listed_owner(mop, sh->job), USER_A);
        spc_detach(mop);
        /* ...and from then on refuses B itself, before B holds a rank there. */
        b = sp_test_fork(b_intrudes, (void *)(intptr_t)(r + 1));
        CHECK_EQ(sp_test_wait(b, 20000), 0);
    }
    wait_flag(&sh->reduced, world);
    /* The operator sees A's job; B, on either daemon, does not. */
    CHECK_EQ(listed_owner(op, sh->job), USER_A);
    CHECK(query_mentions(op, "stats", token_of(sh->job)));
    CHECK(query_mentions(op, "metrics", token_of(sh->job)));
    b = sp_test_fork(b_looks, NULL);
    CHECK_EQ(sp_test_wait(b, 20000), 0);
    if (mirror != NULL) {
        b = sp_test_fork(b_looks, (void *)mirror->sock);
        CHECK_EQ(sp_test_wait(b, 20000), 0);
    }
    sh->release = 1;
    sp_test_wait_all_ok(a, world, 20000);
}

static void granted(spc_handle_t *op)
{
    memset(sh, 0, sizeof *sh);
    elsewhere = NULL;
    world = 2;
    pid_t p[2];
    p[0] = sp_test_fork(a_rank0, (void *)(uintptr_t)USER_B);
    p[1] = sp_test_fork(b_granted, NULL);
    wait_flag(&sh->reduced, 1);
    sh->release = 1;
    sp_test_wait_all_ok(p, 2, 20000);
    CHECK(sp_test_wait_job_joined(op, sh->job, -1, 10000));
}

/* metrics_per_group: the metrics name the job only through its groups' series. */
static const char *const allow[] = { "--set", "allow_group=65534", "--set", "metrics_per_group=1", NULL };

/* Two daemons on loopback, both admitting the shared group; node-0 is d0. */
static void cluster_start(sp_test_daemon_t *d0, sp_test_daemon_t *d1, char *dir, size_t dirlen)
{
    char secret[192], a[3][256], peers[64] = "";
    snprintf(dir, dirlen, "/tmp/spd-owner-XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    sp_test_secret_file(dir, "secret", "the owner test's cluster secret\n", secret, sizeof secret);
    sp_test_daemon_t *d[2] = { d0, d1 };
    for (int i = 0; i < 2; i++) {
        snprintf(a[0], sizeof a[0], "node_name=node-%d", i);
        snprintf(a[1], sizeof a[1], "cluster_secret_file=%s", secret);
        snprintf(a[2], sizeof a[2], "peers=%s", peers);
        const char *args[] = { "--set", a[0], "--set", a[1], "--set", "peer_listen=127.0.0.1:0", "--set", a[2],
                               "--set", "peer_heartbeat_ms=50", "--set", "allow_group=65534",
                               "--set", "metrics_per_group=1", NULL };
        sp_test_daemon_start(d[i], args);
        snprintf(peers, sizeof peers, "127.0.0.1:%d", sp_test_node_port(d[i]));
    }
    char rec[2048];
    sp_test_peer_wait(d1, "node-0", "up", 10000, rec, sizeof rec);
    setenv("SPC_SOCKET", d0->sock, 1);
}

int main(void)
{
    if (geteuid() != 0) {
        fprintf(stderr, "skipped: needs root to run clients as other users\n");
        return SP_TEST_SKIP;
    }
    sh = sp_test_shared(sizeof *sh);
    sp_test_daemon_t d, d1;

    sp_test_daemon_start(&d, allow);
    spc_handle_t *op = sp_test_attach();   /* root: the operator */
    isolation(&d, NULL, op);
    granted(op);
    spc_detach(op);
    sp_test_daemon_serves();
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);

    char dir[64], out[256];
    cluster_start(&d, &d1, dir, sizeof dir);
    op = sp_test_attach();
    isolation(&d, &d1, op);
    log_has(&d, "uid 60002) refused: job ");   /* the root too, naming the node and the rank's uid */
    spc_detach(op);
    sp_test_daemon_serves();
    CHECK_EQ(sp_test_daemon_stop(&d1), 0);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d1);
    sp_test_daemon_cleanup(&d);
    sp_test_run(out, sizeof out, "rm -rf %s", dir);
    printf("job_owner: ok\n");
    return 0;
}
