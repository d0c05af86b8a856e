/*
 * peer_restart_keep_bytes: the copies a daemon keeps for a peer's restart are
 * bounded in all; a restart that needs a copy the bound turned away fails
 * that collective, and that one only; and a copy is not held past the last
 * two collectives of its group, kept or not, so that the bound does not leave
 * a job only its first copies.
 *
 * Two daemons on loopback, two ranks each, with a grace for restarts and the
 * bound at KEEP_BYTES, which holds any one message of these jobs but not two
 * of the largest. Two jobs, one after the other:
 *
 *   past  every rank loops over all-reduces on the world, the SP group and
 *         its ulysses and ring groups of a 2 x 2 mesh, each result checked
 *         against references computed here, while the test reads both
 *         daemons' `spctl status`: their kept bytes never pass the bound, and
 *         messages are not kept (node-0's metrics say the same). Then the
 *         restart lands where node-1 needs node-0's copy: node-1's ranks
 *         submit an all-reduce on the SP group, and once node-0 has their
 *         message (spctl ops) node-1 is SIGKILLed. node-0's ranks submit
 *         theirs; node-0 completes the collective with both nodes' inputs
 *         while it waits for node-1, and its message for node-1, which fits
 *         the bound alone but not beside the copies node-0 keeps, is not kept
 *         (node-0's count goes up by one). node-1 comes back, its ranks submit
 *         the all-reduce again and fail with SPC_ERR_RESTARTED and node-0's
 *         reason, the only op that fails; every rank's next ops run on both
 *         daemons and are right, and node-0, the survivor, served throughout
 *         (the same process, every op of its ranks right). As the job
 *         ends, its copies go: both daemons keep 0 bytes.
 *   fits  the world alone: of its all-reduces every other one is kept (one
 *         fits, two do not, and the copy two collectives back goes as each is
 *         sent). The same restart at one that is kept: node-1's ranks run it
 *         again from node-0's copy, right; 0 bytes kept after.
 *
 * The bound is not the option's least, 0, which keeps nothing: there no
 * message passes it by the copies of other groups. */
#include <signal.h>

#include "sp_test.h"

#define GRACE_MS   10000
#define PER        2
#define P          (2 * PER)
#define N          4096                       /* doubles per rank in each all-reduce: 32 KiB */
#define KEEP_BYTES (96 << 10)                 /* any one message fits (two ranks' inputs at most), two groups' not */
#define NGROUPS    4
#define LOAD       40                          /* iterations before the restart */
#define AFTER      10                          /* and after it */
#define WAIT_MS    60000

static sp_test_daemon_t nodes[2];
static char job_id[SPC_JOB_ID_MAX];

typedef struct rank_report {
    volatile int at_restart;   /* its load loop is done; node-0's ranks then wait for go */
    volatile int restart_done; /* node-0's: its restart op completed, right */
    volatile int done;
    uint32_t     resumes;
} rank_report_t;

static struct shared {
    rank_report_t r[P];
    volatile int  go;          /* node-0's ranks may submit the restart op */
    volatile int  go_on;       /* node-0's ranks may go on past it */
    char          why[P][256]; /* node-1's ranks: the restart op's failure */
} *sh;

/* Integers in doubles: every sum below is exact, in any order. */
static double val(int it, int rank, int i, int salt)
{
    return (double)(((unsigned)it * 131u + (unsigned)rank * 17u + (unsigned)i * 7u + (unsigned)salt * 1009u) % 1000u);
}

/* An all-reduce over group g, whose members are members[0..size), checked. */
static spc_status_t allreduce(spc_handle_t *h, spc_group_t g, const int32_t *members, uint32_t size, int it,
                              int rank, int salt, double *send, double *recv)
{
    for (int i = 0; i < N; i++) {
        send[i] = val(it, rank, i, salt);
        recv[i] = -1;
    }
    spc_status_t st = spc_allreduce(h, g, send, recv, N, SPC_F64, SPC_SUM, WAIT_MS);
    if (st != SPC_OK)
        return st;
    for (int i = 0; i < N; i++) {
        double want = 0;
        for (uint32_t k = 0; k < size; k++)
            want += val(it, members[k], i, salt);
        if (recv[i] != want)
            SP_FAIL("iter %d rank %d group %u: all-reduce [%d] is %g, expected %g", it, rank, g, i, recv[i], want);
    }
    return SPC_OK;
}

/* A job's ops, and what its restart must come to. */
typedef struct scenario {
    const char *name;
    int         ngroups;   /* NGROUPS: the world, SP, ulysses and ring groups; 1: the world alone */
    int         load;      /* iterations before the restart op */
    int         group;     /* the restart op's group (an index in the groups) */
    bool        kept;      /* node-0 keeps its copy for it: node-1's ranks run it again from that copy */
} scenario_t;

static const scenario_t *sc;   /* the job's, as its ranks are forked */

static int rank_main(void *arg)
{
    int rank = (int)(intptr_t)arg, node = rank / PER;
    rank_report_t *rep = &sh->r[rank];
    setenv("SPC_SOCKET", nodes[node].sock, 1);
    spc_handle_t *h = sp_test_attach();
    spc_group_t groups[NGROUPS];
    uint32_t sizes[NGROUPS] = { P };
    CHECK_OK(h, spc_job_join(h, job_id, P, (uint32_t)rank, 20000, &groups[0]));
    if (sc->ngroups > 1) {
        spc_mesh_spec_t spec = SPC_MESH_SPEC_INIT;
        spec.sp = P;
        spec.ulysses = 2;
        spec.ring = 2;
        spec.heads = 4;
        spc_mesh_t m;
        CHECK_OK(h, spc_mesh_create(h, &spec, &m));
        groups[1] = m.sp_group, groups[2] = m.ulysses_group, groups[3] = m.ring_group;
        sizes[1] = m.sp, sizes[2] = m.ulysses, sizes[3] = m.ring;
    }

    /* Each group's members, asked over the group itself: the references do
     * not trust placement. */
    double *send = spc_alloc(h, N * sizeof(double)), *recv = spc_alloc(h, N * sizeof(double));
    int32_t *me = spc_alloc(h, sizeof *me), *members[NGROUPS];
    CHECK(send && recv && me);
    *me = rank;
    for (int g = 0; g < sc->ngroups; g++) {
        members[g] = spc_alloc(h, sizes[g] * sizeof(int32_t));
        CHECK(members[g] != NULL);
        CHECK_OK(h, spc_allgather(h, groups[g], me, members[g], 1, SPC_I32, WAIT_MS));
    }

    for (int it = 0; it < sc->load; it++)
        for (int g = 0; g < sc->ngroups; g++)
            CHECK_OK(h, allreduce(h, groups[g], members[g], sizes[g], it, rank, g, send, recv));
    rep->at_restart = 1;

    /* The restart op: node-1's ranks first; node-0's once node-1 is gone. */
    int g = sc->group;
    if (node == 0) {
        while (!sh->go)
            usleep(1000);
        CHECK_OK(h, allreduce(h, groups[g], members[g], sizes[g], sc->load, rank, 9, send, recv));
        rep->restart_done = 1;
        while (!sh->go_on)
            usleep(1000);
    } else if (sc->kept) {
        CHECK_OK(h, allreduce(h, groups[g], members[g], sizes[g], sc->load, rank, 9, send, recv));
    } else {
        spc_status_t st = allreduce(h, groups[g], members[g], sizes[g], sc->load, rank, 9, send, recv);
        CHECK_EQ(st, SPC_ERR_RESTARTED);
        snprintf(sh->why[rank], sizeof sh->why[rank], "%s", spc_last_error(h));
    }

    for (int it = sc->load + 1; it <= sc->load + AFTER; it++)
        for (int k = 0; k < sc->ngroups; k++)
            CHECK_OK(h, allreduce(h, groups[k], members[k], sizes[k], it, rank, k, send, recv));

    spc_resume_info_t info = SPC_RESUME_INFO_INIT;
    CHECK_OK(h, spc_resume_info(h, &info));
    rep->resumes = info.resumes;
    rep->done = 1;
    spc_detach(h);
    return 0;
}

/* ================================================================ the daemons' counts */

typedef struct kept {
    int64_t bytes, not_kept;
} kept_t;

static kept_t kept_read(spc_handle_t *h)
{
    kept_t k = { sp_test_status_int(h, "peer_restart_kept_bytes"), sp_test_status_int(h, "peer_restart_not_kept") };
    CHECK(k.bytes >= 0 && k.not_kept >= 0);
    if (k.bytes > KEEP_BYTES)
        SP_FAIL("a daemon keeps %" PRId64 " bytes of copies, past peer_restart_keep_bytes (%d)", k.bytes, KEEP_BYTES);
    return k;
}

/* A series of h's daemon's metrics (spctl metrics: the text /metrics serves). */
static int64_t metric(spc_handle_t *h, const char *series)
{
    spc_query_result_t *q;
    CHECK_OK(h, spc_query(h, "metrics", NULL, &q));
    long f = spc_query_find(q, 0, "text");
    CHECK(f >= 0);
    char line[128];
    snprintf(line, sizeof line, "\n%s ", series);
    const char *at = strstr(spc_query_str(q, 0, (size_t)f), line);
    if (at == NULL)
        SP_FAIL("no series %s in the metrics", series);
    int64_t v = strtoll(at + strlen(line), NULL, 10);
    spc_query_free(q);
    return v;
}

/* Polls the ops node-0 waits on until the job's collective on a group of
 * `kind` has node-1's ranks in: node-0 holds node-1's message for it. */
static void wait_arrived(spc_handle_t *h, const char *kind)
{
    for (uint64_t end = sp_test_now_ms() + 10000; sp_test_now_ms() < end; usleep(1000)) {
        spc_query_result_t *q;
        CHECK_OK(h, spc_query(h, "ops", job_id, &q));
        for (size_t r = 0; r < spc_query_records(q); r++) {
            long k = spc_query_find(q, r, "kind"), arrived = spc_query_find(q, r, "arrived");
            CHECK(k >= 0 && arrived >= 0);
            if (strcmp(spc_query_str(q, r, (size_t)k), kind) == 0 && spc_query_int(q, r, (size_t)arrived) == PER) {
                spc_query_free(q);
                return;
            }
        }
        spc_query_free(q);
    }
    SP_FAIL("node-0 never had node-1's ranks in the %s group's all-reduce", kind);
}

/* Polls `spctl jobs` on h until the job waits for node-1. */
static void wait_waiting_for(spc_handle_t *h, const char *node)
{
    for (uint64_t end = sp_test_now_ms() + 10000; sp_test_now_ms() < end; usleep(1000)) {
        spc_query_result_t *q;
        CHECK_OK(h, spc_query(h, "jobs", job_id, &q));
        long f = spc_query_find(q, 0, "waiting_for");
        CHECK(f >= 0);
        bool waits = strcmp(spc_query_str(q, 0, (size_t)f), node) == 0;
        spc_query_free(q);
        if (waits)
            return;
    }
    SP_FAIL("node-0's job never waited for %s", node);
}

static const char *const *args[2];

/* Runs scenario s's job to its end, checking its ranks, both daemons' counts
 * and node-0's throughout. */
static void run(const scenario_t *s)
{
    static const char *const kinds[NGROUPS] = { "world", "sp", "ulysses", "ring" };
    memset(sh, 0, sizeof *sh);
    sc = s;
    pid_t survivor = nodes[0].pid;
    setenv("SPC_SOCKET", nodes[0].sock, 1);
    spc_handle_t *h0 = sp_test_attach(), *owner = sp_test_attach();
    CHECK_OK(owner, spc_job_create(owner, job_id, sizeof job_id));
    setenv("SPC_SOCKET", nodes[1].sock, 1);
    spc_handle_t *h1 = sp_test_attach();
    kept_t start[2] = { kept_read(h0), kept_read(h1) };
    pid_t pids[P];
    for (int r = 0; r < P; r++)
        pids[r] = sp_test_fork(rank_main, (void *)(intptr_t)r);

    /* The load: both daemons' kept bytes, as often as they can be read. */
    int64_t most[2] = { 0, 0 };
    uint64_t samples = 0;
    for (int all = 0; !all; samples++) {
        kept_t k0 = kept_read(h0), k1 = kept_read(h1);
        most[0] = k0.bytes > most[0] ? k0.bytes : most[0];
        most[1] = k1.bytes > most[1] ? k1.bytes : most[1];
        all = 1;
        for (int r = 0; r < P; r++)
            all &= sh->r[r].at_restart;
    }
    kept_t load[2] = { kept_read(h0), kept_read(h1) };
    for (int i = 0; i < 2; i++) {
        int64_t not_kept = load[i].not_kept - start[i].not_kept;
        CHECK(most[i] > 0);
        if (s->ngroups > 1)
            CHECK(not_kept > 0);
        else   /* one world message fits, two do not: as each is sent, the copy two back goes, kept or not */
            CHECK_EQ(not_kept, s->load / 2);
        printf("%s: load: node-%d kept at most %" PRId64 " bytes of %d (%" PRIu64 " samples), %" PRId64
               " messages not kept\n", s->name, i, most[i], KEEP_BYTES, samples, not_kept);
    }
    spc_detach(h1);
    /* node-0 sends nothing more until its ranks go on: its metrics say the same. */
    CHECK_EQ(metric(h0, "spd_peer_restart_kept_bytes"), load[0].bytes);
    CHECK_EQ(metric(h0, "spd_peer_restart_not_kept_total"), load[0].not_kept);

    /* The restart, where node-1 needs node-0's copy. */
    wait_arrived(h0, kinds[s->group]);
    CHECK_EQ(kill(nodes[1].pid, SIGKILL), 0);
    CHECK_EQ(sp_test_wait(nodes[1].pid, 5000), -SIGKILL);
    nodes[1].pid = 0;
    wait_waiting_for(h0, "node-1");
    kept_t before = kept_read(h0);
    /* Past the bound, the message node-0 is about to keep fits alone but not beside what it keeps. */
    if (!s->kept)
        CHECK(before.bytes + PER * N * (int64_t)sizeof(double) > KEEP_BYTES);
    sh->go = 1;
    for (int r = 0; r < PER; r++)
        for (uint64_t end = sp_test_now_ms() + 10000; !sh->r[r].restart_done;) {
            if (sp_test_now_ms() > end)
                SP_FAIL("rank %d's all-reduce did not complete on node-0 while node-1 was down", r);
            usleep(1000);
        }
    kept_t after = kept_read(h0);
    CHECK_EQ(after.not_kept, before.not_kept + (s->kept ? 0 : 1));
    printf("%s: restart: node-0 kept %" PRId64 " bytes; its message for the all-reduce node-1 lost (%d bytes of "
           "inputs) %s\n", s->name, before.bytes, (int)(PER * N * sizeof(double)), s->kept ? "kept" : "not kept");

    sp_test_daemon_restart(&nodes[1], args[1]);
    sh->go_on = 1;
    sp_test_wait_all_ok(pids, P, 120000);
    for (int r = 0; r < P; r++)
        CHECK_EQ(sh->r[r].resumes, r / PER == 1 ? 1u : 0u);
    for (int r = PER; r < P && !s->kept; r++) {
        CHECK_CONTAINS(sh->why[r], "completed on node node-0, not on node node-1, when a spd restarted");
        CHECK_CONTAINS(sh->why[r], "so it cannot run again");
        printf("%s: restart: rank %d: SPC_ERR_RESTARTED: %s\n", s->name, r, sh->why[r]);
    }
    if (s->kept)
        printf("%s: restart: node-1's ranks ran it again from node-0's copy, right\n", s->name);

    /* node-0 served throughout: the same process, every op of its ranks right. */
    CHECK_EQ(nodes[0].pid, survivor);
    CHECK_EQ(sp_test_status_int(h0, "pid"), survivor);
    setenv("SPC_SOCKET", nodes[1].sock, 1);
    h1 = sp_test_attach();
    kept_read(h0);   /* both within the bound after the restart too */
    kept_read(h1);
    printf("%s: after: %d iterations on both daemons, every result right\n", s->name, AFTER);
    spc_detach(owner);
    CHECK(sp_test_wait_status(h0, "jobs", 0, 10000));
    CHECK(sp_test_wait_status(h1, "jobs", 0, 10000));
    /* The copies went with the job's groups. */
    CHECK_EQ(kept_read(h0).bytes, 0);
    CHECK_EQ(kept_read(h1).bytes, 0);
    spc_detach(h1);
    spc_detach(h0);
}

int main(void)
{
    char dir[64] = "/tmp/spd-keep-XXXXXX", secret[128], rec[2048], out[256];
    CHECK(mkdtemp(dir) != NULL);
    sp_test_secret_file(dir, "secret", "two nodes share this secret, keep\n", secret, sizeof secret);
    sh = sp_test_shared(sizeof *sh);
    setenv("SPC_RECONNECT_MS", "20000", 1);

    char a[2][256], grace[64], keep[64];
    snprintf(a[0], sizeof a[0], "cluster_secret_file=%s", secret);
    snprintf(grace, sizeof grace, "peer_restart_grace_ms=%d", GRACE_MS);
    snprintf(keep, sizeof keep, "peer_restart_keep_bytes=%d", KEEP_BYTES);
    const char *args0[] = { "--set", "node_name=node-0", "--set", a[0], "--set", "peer_listen=127.0.0.1:0",
                            "--set", "peer_heartbeat_ms=50", "--set", grace, "--set", keep, NULL };
    sp_test_daemon_start(&nodes[0], args0);
    snprintf(a[1], sizeof a[1], "peers=127.0.0.1:%d", sp_test_node_port(&nodes[0]));
    const char *args1[] = { "--set", "node_name=node-1", "--set", a[0], "--set", a[1],
                            "--set", "peer_heartbeat_ms=50", "--set", grace, "--set", keep, NULL };
    sp_test_daemon_start(&nodes[1], args1);
    args[0] = args0;
    args[1] = args1;
    sp_test_peer_wait(&nodes[0], "node-1", "up", 10000, rec, sizeof rec);

    /* past: four groups' copies pass the bound; the restart op's, on the SP group, is turned away. */
    run(&(scenario_t){ .name = "past", .ngroups = NGROUPS, .load = LOAD, .group = 1, .kept = false });
    /* fits: the world alone, one message of which fits: the restart op's is kept, as the copy two back gives way. */
    run(&(scenario_t){ .name = "fits", .ngroups = 1, .load = 4, .group = 0, .kept = true });

    sp_test_node_pair_stop(nodes);
    sp_test_run(out, sizeof out, "rm -rf %s", dir);
    printf("peer_keep_bytes: ok\n");
    return 0;
}
