/*
 * Named jobs (spc_job_join_named): the ranks of a launch all join one name and
 * nobody creates the job or hands an id around.
 *
 *   - four ranks join "train" and all-reduce right; the job ends with them;
 *   - a second launch that reuses a name while the first is assembling is
 *     refused naming the first (its launch id and ranks), as are a world size
 *     that differs, a rank that joins twice, and any join once the job started;
 *     the first launch is not disturbed, and the name is free once it ended;
 *   - hostile names and launch ids (too long, bytes outside the alphabet, a
 *     name and an id at once), from the library and as raw requests, are
 *     refused with the reason; past max_named_jobs_per_user a user's next
 *     name is refused naming the option; another user's job of the same name
 *     is its own, never a squat of this one; an id join cannot reach a named
 *     job; spd keeps serving throughout.
 *
 * The other user is a child that switches uid (setresuid), which needs root;
 * without it that case is skipped and says so.
 */
#include <grp.h>
#include <unistd.h>

#include "sp_test.h"

#define MAX_NAMED 3
#define OTHER_UID 60001u
#define SHARED_GID 65534u

/* One rank of a launch: what it joins, and the status its join must get. */
typedef struct rank_arg {
    const char  *name, *launch;
    uint32_t     world, rank;
    spc_status_t expect;
    uid_t        uid;          /* 0: stay root */
} rank_arg_t;

/* Joins, then all-reduces rank + 1 over the world: the sum is w(w+1)/2. */
static int rank_main(void *p)
{
    const rank_arg_t *a = p;
    spc_group_t world;
    if (a->uid != 0)
        sp_test_become(a->uid, SHARED_GID);
    spc_handle_t *h = sp_test_attach();
    CHECK_ST(h, spc_job_join_named(h, a->name, a->launch, a->world, a->rank, 20000, &world), a->expect);
    if (a->expect == SPC_OK) {
        double *x = spc_alloc(h, sizeof *x);
        *x = a->rank + 1;
        CHECK_OK(h, spc_allreduce(h, world, x, x, 1, SPC_F64, SPC_SUM, 10000));
        CHECK_EQ(*x, a->world * (a->world + 1) / 2.0);
    }
    spc_detach(h);
    return 0;
}

static rank_arg_t ranks[16];
static int nranks;

static pid_t start_rank(const char *name, const char *launch, uint32_t world, uint32_t rank, uid_t uid)
{
    rank_arg_t *a = &ranks[nranks++ % 16];
    *a = (rank_arg_t){ name, launch, world, rank, SPC_OK, uid };
    return sp_test_fork(rank_main, a);
}

static char *id_of(const char *name)
{
    static char id[SPC_JOB_ID_MAX];
    snprintf(id, sizeof id, "%u/%s", (unsigned)getuid(), name);
    return id;
}

static void test_launch(spc_handle_t *obs)
{
    pid_t pids[4];
    for (uint32_t r = 0; r < 4; r++)
        pids[r] = start_rank("train", "run-1", 4, r, 0);
    sp_test_wait_all_ok(pids, 4, 30000);
    CHECK(sp_test_wait_status(obs, "jobs", 0, 5000));
}

/* The launch id that spctl jobs shows for a job, "" when it shows none. */
static void launch_shown(spc_handle_t *h, const char *id, char *out, size_t len)
{
    spc_query_result_t *r;
    out[0] = '\0';
    CHECK_OK(h, spc_query(h, "jobs", "", &r));
    for (size_t i = 0; i < spc_query_records(r); i++)
        if (strcmp(spc_query_str(r, i, (size_t)spc_query_find(r, i, "id")), id) == 0)
            snprintf(out, len, "%s", spc_query_str(r, i, (size_t)spc_query_find(r, i, "launch")));
    spc_query_free(r);
}

static void test_two_launches(spc_handle_t *obs)
{
    spc_group_t world;
    char shown[SPC_JOB_LAUNCH_MAX];
    pid_t a[3];
    a[0] = start_rank("shared", "A", 3, 0, 0);
    a[1] = start_rank("shared", "A", 3, 1, 0);
    CHECK(sp_test_wait_job_joined(obs, id_of("shared"), 2, 10000));
    launch_shown(obs, id_of("shared"), shown, sizeof shown);
    CHECK_STREQ(shown, "A");

    spc_handle_t *h = sp_test_attach();
    CHECK_ST(h, spc_job_join_named(h, "shared", "B", 3, 0, 1000, &world), SPC_ERR_BUSY);
    CHECK_CONTAINS(spc_last_error(h), "is held by another launch (A, 2 of 3 ranks joined");
    CHECK_CONTAINS(spc_last_error(h), "this rank's launch is B");
    CHECK_ST(h, spc_job_join_named(h, "shared", "A", 4, 2, 1000, &world), SPC_ERR_MISMATCH);
    CHECK_CONTAINS(spc_last_error(h), "has 3 ranks; this rank says 4");
    CHECK_ST(h, spc_job_join_named(h, "shared", "A", 3, 1, 1000, &world), SPC_ERR_BUSY);
    CHECK_CONTAINS(spc_last_error(h), "rank 1 of job");
    CHECK_CONTAINS(spc_last_error(h), "is already taken by pid");
    /* None of that touched the job: its third rank completes it. */
    CHECK(sp_test_wait_job_joined(obs, id_of("shared"), 2, 1000));
    a[2] = start_rank("shared", "A", 3, 2, 0);
    sp_test_wait_all_ok(a, 3, 30000);
    CHECK(sp_test_wait_status(obs, "jobs", 0, 5000));

    /* Ended, the name is the next launch's. */
    pid_t b[2] = { start_rank("shared", "B", 2, 0, 0), start_rank("shared", "B", 2, 1, 0) };
    sp_test_wait_all_ok(b, 2, 30000);
    spc_detach(h);
}

/* A started job takes no more joins, of its launch or another. */
static int started_main(void *p)
{
    (void)p;
    spc_group_t world;
    spc_handle_t *h = sp_test_attach();
    CHECK_OK(h, spc_job_join_named(h, "solo", "S", 1, 0, 5000, &world));
    spc_handle_t *again = sp_test_attach();
    CHECK_ST(again, spc_job_join_named(again, "solo", "S", 1, 0, 1000, &world), SPC_ERR_BUSY);
    CHECK_CONTAINS(spc_last_error(again), "has started with all its 1 ranks");
    /* And an id join does not reach a named job, whose launch it could not check. */
    CHECK_ST(again, spc_job_join(again, id_of("solo"), 1, 0, 1000, &world), SPC_ERR_NOT_FOUND);
    spc_detach(again);
    spc_detach(h);
    return 0;
}

static void test_started(void)
{
    pid_t p = sp_test_fork(started_main, NULL);
    sp_test_wait_all_ok(&p, 1, 20000);
}

static void test_bad_names(void)
{
    spc_group_t world;
    char longname[SPC_JOB_NAME_MAX + 1], longlaunch[SPC_JOB_LAUNCH_MAX + 1];
    memset(longname, 'a', SPC_JOB_NAME_MAX);
    longname[SPC_JOB_NAME_MAX] = '\0';
    memset(longlaunch, 'l', SPC_JOB_LAUNCH_MAX);
    longlaunch[SPC_JOB_LAUNCH_MAX] = '\0';
    static const struct {
        const char *name, *launch, *why;
    } bad[] = {
        { "", "L", "job name '' is empty" },
        { "a b", "L", "job name 'a' holds byte 0x20 at 1" },
        { ".hidden", "L", "does not begin with a letter or a digit" },
        { "../etc", "L", "holds byte 0x2f at 2" },
        { "x\ny", "L", "job name 'x' holds byte 0x0a at 1" },
        { "ok", "has space", "launch id 'has' holds byte 0x20 at 3" },
    };
    spc_handle_t *h = sp_test_attach();
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        CHECK_ST(h, spc_job_join_named(h, bad[i].name, bad[i].launch, 2, 0, 1000, &world), SPC_ERR_INVALID_ARG);
        CHECK_CONTAINS(spc_last_error(h), bad[i].why);
    }
    CHECK_ST(h, spc_job_join_named(h, longname, "L", 2, 0, 1000, &world), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(h), "is longer than 63 bytes");
    CHECK_ST(h, spc_job_join_named(h, "ok", longlaunch, 2, 0, 1000, &world), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(h), "is longer than 127 bytes");
    CHECK_OK(h, spc_noop(h, 5000));
    spc_detach(h);
}

/* What spd answers a raw named join (the library's own checks bypassed). */
static void raw_join(int fd, const char *job_id, const char *name, const char *launch, const char *why)
{
    static uint32_t seq = 10;
    Spd__Msg m = SPD__MSG__INIT;
    Spd__JobJoinReq r = SPD__JOB_JOIN_REQ__INIT;
    r.job_id = (char *)job_id;
    r.name = (char *)name;
    r.launch = (char *)launch;
    r.world_size = 2;
    r.timeout_ms = 1000;
    m.seq = ++seq;
    m.body_case = SPD__MSG__BODY_JOB_JOIN_REQ;
    m.job_join_req = &r;
    sp_test_raw_send_msg(fd, &m);
    Spd__Msg *rep = sp_test_raw_recv(fd, 5000, NULL);
    CHECK(rep != NULL);
    CHECK_EQ(rep->body_case, SPD__MSG__BODY_ERROR);
    CHECK_EQ(rep->error->status, SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(rep->error->detail, why);
    sp_msg_free(rep);
}

static bool log_has(const sp_test_daemon_t *d, const char *needle)
{
    char out[64];
    return sp_test_run(out, sizeof out, "grep -q '%s' %s", needle, d->log) == 0;
}

static void test_raw_abuse(const sp_test_daemon_t *d)
{
    char huge[4096];
    memset(huge, 'n', sizeof huge - 1);
    huge[sizeof huge - 1] = '\0';
    int fd = sp_test_raw_connect(d->sock);
    sp_test_raw_hello(fd, SPD__HELLO__ROLE__CLIENT);
    raw_join(fd, "", huge, "L", "is longer than 63 bytes");
    raw_join(fd, "", "tab\tname", "L", "job name 'tab' holds byte 0x09 at 3");
    raw_join(fd, "", "ok", huge, "is longer than 127 bytes");
    raw_join(fd, "", "ok", "semi;colon", "launch id 'semi' holds byte 0x3b at 4");
    /* Nothing past the first bad byte reaches the log: a line break there cannot forge a line. */
    raw_join(fd, "", "x\n2026-11-27T00:00:00Z forged", "L", "job name 'x' holds byte 0x0a at 1");
    raw_join(fd, "0/ok", "ok", "L", "a job id or a job name, not both");
    close(fd);
    CHECK(log_has(d, "refused: job name .x. holds byte 0x0a at 1"));
    CHECK(!log_has(d, "forged"));
    sp_test_daemon_serves();
}

/* Past the limit a user is refused; another user's names are its own. */
static void test_limit_and_users(const sp_test_daemon_t *d, spc_handle_t *obs)
{
    static const char *const names[MAX_NAMED] = { "n0", "n1", "n2" };
    pid_t first[MAX_NAMED], second[MAX_NAMED];
    spc_group_t world;
    for (int i = 0; i < MAX_NAMED; i++)
        first[i] = start_rank(names[i], "L", 2, 0, 0);
    CHECK(sp_test_wait_status(obs, "jobs", MAX_NAMED, 10000));
    spc_handle_t *h = sp_test_attach();
    CHECK_ST(h, spc_job_join_named(h, "n3", "L", 2, 0, 1000, &world), SPC_ERR_LIMIT);
    CHECK_CONTAINS(spc_last_error(h), "already holds 3 named jobs (max_named_jobs_per_user)");
    CHECK(log_has(d, "refused: uid 0 already holds 3 named jobs"));
    spc_detach(h);

    if (getuid() == 0) {
        /* The other user's "n0" is not root's: its two ranks make their own job,
         * root's limit is not theirs, and root's "n0" still waits for its rank 1. */
        pid_t other[2] = { start_rank("n0", "X", 2, 0, OTHER_UID), start_rank("n0", "X", 2, 1, OTHER_UID) };
        sp_test_wait_all_ok(other, 2, 30000);
        CHECK(sp_test_wait_job_joined(obs, id_of("n0"), 1, 1000));
    } else {
        printf("skipped: another user's job of the same name (switching uid needs root)\n");
    }
    for (int i = 0; i < MAX_NAMED; i++)
        second[i] = start_rank(names[i], "L", 2, 1, 0);
    sp_test_wait_all_ok(first, MAX_NAMED, 30000);
    sp_test_wait_all_ok(second, MAX_NAMED, 30000);
    CHECK(sp_test_wait_status(obs, "jobs", 0, 5000));
    sp_test_daemon_serves();
}

int main(void)
{
    sp_test_daemon_t d;
    char limit[64];
    snprintf(limit, sizeof limit, "max_named_jobs_per_user=%d", MAX_NAMED);
    /* The other user attaches through allow_group, which a daemon not run as root cannot grant. */
    const char *args[] = { "--set", limit, getuid() == 0 ? "--set" : NULL, "allow_group=65534", NULL };
    sp_test_daemon_start(&d, args);
    spc_handle_t *obs = sp_test_attach();

    test_launch(obs);
    test_two_launches(obs);
    test_started();
    test_bad_names();
    test_raw_abuse(&d);
    test_limit_and_users(&d, obs);

    spc_detach(obs);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    return 0;
}
