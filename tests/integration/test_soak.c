/*
 * Soak: 4 rank processes run mixed ops of random sizes (all-reduce, all-to-all,
 * shift, all-gather, broadcast, barrier; arena and registered memory) against
 * one spd, job after job. In some jobs one rank is SIGKILLed at a random
 * moment; the others must see their ops fail with PEER_LOST (or their job's
 * error) and nothing else, then every rank attaches again for the next job.
 * Every completed op's result is checked against a reference computed here.
 *
 * Bounded by ops and time: SP_SOAK_OPS (default 100000 ops over all ranks) and
 * SP_SOAK_SECONDS (default 60). Prints spd's RSS and open descriptors at the
 * start and the end, and ops completed, failed as expected, and failed
 * otherwise; fails if descriptors grew, RSS grew by more than 32 MiB, an op
 * failed unexpectedly or a result was wrong.
 *
 *   SP_SOAK_OPS=400000 SP_SOAK_SECONDS=600 build/tests/test_soak   # 4 clients x 100,000
 */
#include <dirent.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sp_test.h"

#define RANKS 4

/* Sanitizers keep freed memory in quarantine: RSS says nothing there, and their
 * leak check at spd's exit (sp_test_daemon_stop wants exit 0) says more. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define CHECK_RSS 0
#else
#define CHECK_RSS 1
#endif

struct tally {
    uint64_t ok, expected_fail, wrong;
    char     first_wrong[256];
};
static struct tally *tallies;   /* [RANKS], shared with the ranks */
static volatile int *joined;    /* ranks of the current job that joined */
/* Rank 0 creates each job, as a launcher's rank 0 does, and hands the id over
 * here; a job held by a long-lived creator would outlive its ranks. */
static char *shared_job_id;

static uint64_t rnd(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static void wrong(struct tally *t, const char *what, spc_handle_t *h, spc_status_t st)
{
    if (t->wrong++ == 0)
        snprintf(t->first_wrong, sizeof t->first_wrong, "%s: %s (%s)", what, spc_status_name(st),
                 h ? spc_last_error(h) : "");
}

struct job_arg {
    int      rank;
    int      ops;      /* this rank's share of the job's ops */
    uint64_t seed;     /* the same on every rank: every rank draws the same op sequence */
    bool     victim;   /* a rank of this job will be killed */
};

/* In a job where a rank dies, the others' ops fail with the group's loss (or a
 * peer's refusal naming it); in any other job nothing may fail. */
static bool expected_failure(const struct job_arg *a, spc_status_t st)
{
    return a->victim && (st == SPC_ERR_PEER_LOST || st == SPC_ERR_PEER_REFUSED);
}

static int rank_main(void *arg)
{
    struct job_arg *a = arg;
    struct tally *t = &tallies[a->rank];
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    char job_id[SPC_JOB_ID_MAX];
    if (a->rank == 0) {
        CHECK_OK(h, spc_job_create(h, job_id, sizeof job_id));
        memcpy(shared_job_id, job_id, sizeof job_id);
        __atomic_store_n(&joined[1], 1, __ATOMIC_SEQ_CST);   /* the id is there */
    } else {
        uint64_t until = sp_test_now_ms() + 20000;
        while (!__atomic_load_n(&joined[1], __ATOMIC_SEQ_CST) && sp_test_now_ms() < until)
            usleep(200);
        memcpy(job_id, shared_job_id, sizeof job_id);
    }
    spc_status_t st = spc_job_join(h, job_id, RANKS, (uint32_t)a->rank, 20000, &world);
    if (st != SPC_OK) {
        wrong(t, "join", h, st);
        spc_detach(h);
        return 0;
    }
    __atomic_add_fetch(joined, 1, __ATOMIC_SEQ_CST);
    static double reg[RANKS * 4096];   /* registered memory: the other path */
    spc_region_t r;
    CHECK_OK(h, spc_register(h, reg, sizeof reg, &r));
    uint64_t s = a->seed;
    for (int i = 0; i < a->ops; i++) {
        unsigned kind = (unsigned)(rnd(&s) % 6);
        uint32_t n = 1 + (uint32_t)(rnd(&s) % 4096);
        bool use_reg = rnd(&s) % 4 == 0;
        if (use_reg && kind == 1 && n > 512)
            n = 512;    /* the gathered output goes at reg + 2048 */
        if (use_reg && kind == 3 && n > 2048)
            n = 2048;   /* the shifted-in copy goes at reg + 2048 */
        double *x = use_reg ? reg : spc_alloc(h, (size_t)RANKS * n * sizeof *x);
        if (x == NULL)
            SP_FAIL("arena full at op %d", i);
        for (uint32_t k = 0; k < n; k++)
            x[k] = a->rank + 1 + k % 5;
        const char *what = "?";
        double want = 0;
        double *got = x;
        uint32_t at = n - 1;
        switch (kind) {
        case 0:
            what = "allreduce";
            st = spc_allreduce(h, world, x, x, n, SPC_F64, SPC_SUM, 10000);
            want = RANKS * (at % 5) + RANKS * (RANKS + 1) / 2.0;
            break;
        case 1: {
            what = "allgather";
            double *out = use_reg ? reg + 2048 : spc_alloc(h, (size_t)RANKS * n * sizeof *out);
            st = spc_allgather(h, world, x, out, n, SPC_F64, 10000);
            got = out + (size_t)(RANKS - 1) * n;
            want = RANKS + at % 5;
            if (!use_reg) {
                if (st == SPC_OK && got[at] != want)
                    wrong(t, what, h, st);
                spc_free(h, out);
                got = NULL;
            }
            break;
        }
        case 2:
            what = "broadcast";
            st = spc_broadcast(h, world, x, n, SPC_F64, 1, 10000);
            want = 2 + at % 5;
            break;
        case 3: {
            what = "shift";
            double *out = use_reg ? reg + 2048 : spc_alloc(h, (size_t)n * sizeof *out);
            spc_shift_desc_t d = { .struct_size = sizeof d, .group = world, .channel = (uint32_t)(rnd(&s) % 2),
                                   .ntensors = 1 };
            d.tensors[0].send = x;
            d.tensors[0].recv = out;
            d.tensors[0].bytes = (uint64_t)n * sizeof *x;
            st = spc_shift(h, &d, 10000);
            want = (a->rank + RANKS - 1) % RANKS + 1 + at % 5;
            got = out;
            if (!use_reg) {
                if (st == SPC_OK && got[at] != want)
                    wrong(t, what, h, st);
                spc_free(h, out);
                got = NULL;
            }
            break;
        }
        case 4:
            what = "barrier";
            st = spc_barrier(h, world, 10000);
            got = NULL;
            break;
        default:
            what = "noop";
            st = spc_noop(h, 10000);
            got = NULL;
            break;
        }
        if (st == SPC_OK) {
            t->ok++;
            if (got != NULL && got[at] != want) {
                char w[96];
                snprintf(w, sizeof w, "%s of %u (%s): element %u is %g, want %g", what, n,
                         use_reg ? "registered" : "arena", at, got[at], want);
                wrong(t, w, NULL, st);
            }
        } else if (expected_failure(a, st)) {
            t->expected_fail++;
        } else {
            wrong(t, what, h, st);
        }
        if (!use_reg)
            spc_free(h, x);
        if (st != SPC_OK)
            break;   /* the group is broken: this job is over for this rank */
    }
    spc_detach(h);
    return 0;
}

static long rss_kib(pid_t pid)
{
    char path[64], line[256];
    long kib = -1;
    snprintf(path, sizeof path, "/proc/%d/status", (int)pid);
    FILE *f = fopen(path, "r");
    if (f == NULL)
        return -1;
    while (fgets(line, sizeof line, f) != NULL)
        if (sscanf(line, "VmRSS: %ld kB", &kib) == 1)
            break;
    fclose(f);
    return kib;
}

static int open_fds(pid_t pid)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
    DIR *d = opendir(path);
    if (d == NULL)
        return -1;
    int n = 0;
    for (struct dirent *e; (e = readdir(d)) != NULL;)
        n += e->d_name[0] != '.';
    closedir(d);
    return n;
}

int main(void)
{
    const char *e;
    uint64_t target = (e = getenv("SP_SOAK_OPS")) ? strtoull(e, NULL, 10) : 100000;
    uint64_t seconds = (e = getenv("SP_SOAK_SECONDS")) ? strtoull(e, NULL, 10) : 60;
    tallies = sp_test_shared(RANKS * sizeof *tallies);
    joined = sp_test_shared(2 * sizeof *joined);
    shared_job_id = sp_test_shared(SPC_JOB_ID_MAX);

    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    spc_handle_t *q = sp_test_attach();
    /* A first job warms spd up (threads, pools) before the baseline is taken. */
    uint64_t seed = 0x9E3779B97F4A7C15ull, kills = 0, jobs = 0;
    long rss0 = 0;
    int fds0 = 0;
    uint64_t start = sp_test_now_ms();
    for (;;) {
        uint64_t done = 0;
        for (int r = 0; r < RANKS; r++)
            done += tallies[r].ok + tallies[r].expected_fail;
        if (jobs == 1) {
            /* The baseline once the first job's clients are all released. */
            if (!sp_test_wait_status(q, "clients", 1, 10000))
                SP_FAIL("the first job's clients remain");
            rss0 = rss_kib(d.pid);
            fds0 = open_fds(d.pid);
        }
        if (jobs > 1 && (done >= target || sp_test_now_ms() - start > seconds * 1000))
            break;
        struct job_arg args[RANKS];
        pid_t pids[RANKS];
        int per_rank = 50 + (int)(rnd(&seed) % 400);
        uint64_t job_seed = rnd(&seed) | 1;
        /* Every third job after the first, one rank dies at a random moment once all joined. */
        int victim = jobs > 0 && jobs % 3 == 0 ? (int)(rnd(&seed) % RANKS) : -1;
        joined[0] = joined[1] = 0;
        for (int r = 0; r < RANKS; r++) {
            args[r] = (struct job_arg){ r, per_rank, job_seed, victim >= 0 };
            pids[r] = sp_test_fork(rank_main, &args[r]);
        }
        if (victim >= 0) {
            uint64_t until = sp_test_now_ms() + 20000;
            while (__atomic_load_n(joined, __ATOMIC_SEQ_CST) < RANKS && sp_test_now_ms() < until)
                usleep(1000);
            usleep((useconds_t)(rnd(&seed) % 30000));
            kill(pids[victim], SIGKILL);
            kills++;
        }
        for (int r = 0; r < RANKS; r++) {
            int rc = sp_test_wait(pids[r], 60000);
            if (r == victim && (rc == -SIGKILL || rc == 0))
                continue;
            if (rc != 0)
                SP_FAIL("job %" PRIu64 ": rank %d ended with %d", jobs, r, rc);
        }
        jobs++;
    }
    /* Every client gone: what spd holds now is what it keeps. */
    if (!sp_test_wait_status(q, "clients", 1, 10000) || !sp_test_wait_status(q, "jobs", 0, 10000))
        SP_FAIL("clients or jobs remain after every rank left");
    long rss1 = rss_kib(d.pid);
    int fds1 = open_fds(d.pid);
    for (int i = 0; i < 200 && fds1 > fds0; i++) {   /* a closing session's handles go a loop turn later */
        usleep(10000);
        fds1 = open_fds(d.pid);
    }
    uint64_t ok = 0, expected = 0, bad = 0;
    const char *first = NULL;
    for (int r = 0; r < RANKS; r++) {
        ok += tallies[r].ok;
        expected += tallies[r].expected_fail;
        bad += tallies[r].wrong;
        if (tallies[r].wrong && first == NULL)
            first = tallies[r].first_wrong;
    }
    printf("soak: %" PRIu64 " jobs, %" PRIu64 " kills, %.1f s: %" PRIu64 " ops completed, %" PRIu64
           " failed as expected (a rank lost), %" PRIu64 " wrong\n",
           jobs, kills, (sp_test_now_ms() - start) / 1000.0, ok, expected, bad);
    printf("spd after the first job: RSS %ld KiB, %d fds; at the end: RSS %ld KiB, %d fds\n", rss0, fds0, rss1,
           fds1);
    if (bad > 0)
        SP_FAIL("%" PRIu64 " ops failed unexpectedly or gave wrong results; the first: %s", bad, first);
    CHECK(ok > 0 && kills > 0);
    if (fds1 > fds0)
        SP_FAIL("spd holds %d descriptors, %d after the first job", fds1, fds0);
    if (CHECK_RSS && rss1 - rss0 > 32 * 1024)
        SP_FAIL("spd's RSS grew by %ld KiB", rss1 - rss0);
    spc_detach(q);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    return 0;
}
