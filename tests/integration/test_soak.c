/*
 * Soak: 4 rank processes run mixed ops of random sizes (all-reduce, shift on
 * two channels, all-gather, broadcast, barrier, no-op; arena and registered
 * memory) against one spd, round after round. Every completed op's result is
 * checked against a reference computed here. A round is one job, or two when
 * its processes detach and attach a new handle to run the next; in turn it
 * has no fault, or one of these:
 *
 *   joining  a rank is SIGKILLed while it waits in its join (another rank
 *            holds back so that the job cannot start); a new process attaches
 *            and joins the same job as the same rank, and the job then runs
 *            with nothing allowed to fail;
 *   running  a rank is SIGKILLed once all have joined; the others' ops fail
 *            with PEER_LOST (or a peer's refusal naming it) and nothing else;
 *            a new process attaches and its join of the started job is refused
 *            (BUSY, "create a new job") while the survivors still hold it;
 *            then the survivors, on new handles, and the new process restart
 *            the work as a new job, where nothing may fail.
 *
 * Some processes leave at the end without spc_detach, as a crashed or careless
 * client does; spd sees the connection close.
 *
 * Bounded by ops and time: SP_SOAK_OPS (default 100000 ops over all ranks) and
 * SP_SOAK_SECONDS (default 60). SP_SOAK_SEED picks the plan (which ranks die and
 * when, who comes late, op kinds and sizes, rounds); the seed is printed first
 * and, given again, repeats the plan, though not the scheduling. Prints spd's
 * RSS and open descriptors after the first round and at the end, and counts of
 * jobs, kills, reattaches of each kind, ops completed, failed as expected and
 * wrong; fails if descriptors grew, RSS grew by more than 32 MiB, an op failed
 * unexpectedly or a result was wrong.
 *
 *   SP_SOAK_OPS=400000 SP_SOAK_SECONDS=600 build/tests/test_soak   # 4 clients x 100,000
 */
#include <dirent.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "sp_test.h"

#define RANKS 4
#define JOIN_TIMEOUT_MS 20000

/* Sanitizers keep freed memory in quarantine: RSS says nothing there, and their
 * leak check at spd's exit (sp_test_daemon_stop wants exit 0) says more. */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define CHECK_RSS 0
#else
#define CHECK_RSS 1
#endif

enum fault { FAULT_NONE, FAULT_JOINING, FAULT_RUNNING };

/* One round, decided by the parent before it forks; the processes inherit it. */
static struct plan {
    enum fault fault;            /* in the round's first job */
    int        rounds;           /* jobs in the round: 1, or 2 with new handles for the second */
    int        ops[2];           /* each rank's ops in each job */
    uint64_t   seed[2];          /* each job's op sequence, the same on every rank */
    int        victim;           /* the rank killed */
    int        latecomer;        /* FAULT_JOINING: joins only once the victim is replaced */
    unsigned   leave_attached;   /* ranks (bit r) whose process ends without spc_detach */
} plan;

/* What a round's processes tell each other and the parent (shared memory). */
struct board {
    char job_id[2][SPC_JOB_ID_MAX];
    int  id_ready[2];     /* rank 0 made job k and wrote its id */
    int  joined[2];       /* ranks whose join of job k returned */
    int  latecomer_go;
    int  refused;         /* FAULT_RUNNING: the new process was refused the started job */
};
static struct board *board;

/* Per rank, written by the one process playing it at a time; read by the parent. */
struct tally {
    uint64_t ok, expected_fail, wrong;
    uint64_t replaced;        /* joined a joining job in place of a killed rank */
    uint64_t refused;         /* refused a started job, as a killed rank's replacement */
    uint64_t reattached;      /* a new handle in the same process, for the next job */
    uint64_t left_attached;   /* ended without spc_detach */
    char     first_wrong[256];
};
static struct tally *tallies;   /* [RANKS] */

static bool replacing;   /* this process replaces a killed rank */

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

static bool wait_flag(int *flag, int timeout_ms)
{
    uint64_t until = sp_test_now_ms() + (uint64_t)timeout_ms;
    while (!__atomic_load_n(flag, __ATOMIC_ACQUIRE)) {
        if (sp_test_now_ms() >= until)
            return false;
        usleep(200);   /* another process's flag: nothing to block on */
    }
    return true;
}

/* In a job where a rank dies, the others' ops fail with the group's loss (or a
 * peer's refusal naming it); in any other job nothing may fail. */
static bool expected_failure(int job, spc_status_t st)
{
    return job == 0 && plan.fault == FAULT_RUNNING && (st == SPC_ERR_PEER_LOST || st == SPC_ERR_PEER_REFUSED);
}

/* Runs job k's op sequence on world, checking each result. */
static void run_ops(spc_handle_t *h, spc_group_t world, int rank, int job)
{
    struct tally *t = &tallies[rank];
    static double reg[RANKS * 4096];   /* registered memory: the other path */
    spc_region_t r;
    CHECK_OK(h, spc_register(h, reg, sizeof reg, &r));
    uint64_t s = plan.seed[job];
    spc_status_t st;
    for (int i = 0; i < plan.ops[job]; i++) {
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
            x[k] = rank + 1 + k % 5;
        const char *what = "?";
        double want = 0;
        double *got = x;
        uint32_t at = n - 1;
        double *scratch = NULL;   /* an arena output other than x */
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
            if (!use_reg)
                scratch = out;   /* checked below, then freed */
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
            want = (rank + RANKS - 1) % RANKS + 1 + at % 5;
            got = out;
            if (!use_reg)
                scratch = out;   /* checked below, then freed */
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
        } else if (expected_failure(job, st)) {
            t->expected_fail++;
        } else {
            wrong(t, what, h, st);
        }
        if (scratch != NULL)
            spc_free(h, scratch);
        if (!use_reg)
            spc_free(h, x);
        if (st != SPC_OK)
            break;   /* the group is broken: this job is over for this rank */
    }
}

/* Rank 0 creates each job, as a launcher's rank 0 does, and the others wait
 * for its id: a job held by a long-lived creator would outlive its ranks. A
 * process that replaces rank 0 in a joining job finds the id already out. */
static void job_id_get(spc_handle_t *h, int rank, int job, char id[SPC_JOB_ID_MAX])
{
    if (rank == 0 && !__atomic_load_n(&board->id_ready[job], __ATOMIC_ACQUIRE)) {
        CHECK_OK(h, spc_job_create(h, board->job_id[job], SPC_JOB_ID_MAX));
        __atomic_store_n(&board->id_ready[job], 1, __ATOMIC_RELEASE);   /* publishes the id */
    }
    if (!wait_flag(&board->id_ready[job], JOIN_TIMEOUT_MS))
        SP_FAIL("rank %d: no id for job %d of the round", rank, job);
    memcpy(id, board->job_id[job], SPC_JOB_ID_MAX);
}

static bool join(spc_handle_t *h, int rank, int job, spc_group_t *world_p)
{
    struct tally *t = &tallies[rank];
    char id[SPC_JOB_ID_MAX];
    job_id_get(h, rank, job, id);
    if (job == 0 && plan.fault == FAULT_JOINING && rank == plan.latecomer &&
        !wait_flag(&board->latecomer_go, JOIN_TIMEOUT_MS))
        wrong(t, "latecomer never released", NULL, SPC_OK);
    spc_status_t st = spc_job_join(h, id, RANKS, (uint32_t)rank, JOIN_TIMEOUT_MS, world_p);
    if (st != SPC_OK) {
        wrong(t, replacing && job == 0 ? "join in place of a killed rank" : "join", h, st);
        return false;
    }
    if (replacing && job == 0)
        t->replaced++;
    __atomic_add_fetch(&board->joined[job], 1, __ATOMIC_SEQ_CST);
    return true;
}

/*
 * The jobs of one rank process from job `job` on, h attached for it:
 *  - joins and runs the job's ops;
 *  - after a kill in a started job, holds that job until the killed rank's
 *    replacement has been refused it (a job nobody holds ends, and the refusal
 *    is what is checked, not a missing job);
 *  - between jobs, detaches and attaches a new handle;
 *  - after the last, detaches, or leaves attached when the plan says so.
 */
static int rank_jobs(int rank, int job, spc_handle_t *h)
{
    struct tally *t = &tallies[rank];
    for (;; job++) {
        spc_group_t world;
        if (join(h, rank, job, &world))
            run_ops(h, world, rank, job);
        if (job == 0 && plan.fault == FAULT_RUNNING && !wait_flag(&board->refused, JOIN_TIMEOUT_MS))
            wrong(t, "no replacement came for the killed rank", NULL, SPC_OK);
        if (job + 1 == plan.rounds)
            break;
        spc_detach(h);
        h = sp_test_attach();
        t->reattached++;
    }
    if (plan.leave_attached & (1u << rank)) {
        t->left_attached++;
        return 0;   /* spd learns from the closed connection */
    }
    spc_detach(h);
    return 0;
}

static int rank_main(void *arg)
{
    return rank_jobs(*(const int *)arg, 0, sp_test_attach());
}

/* A killed rank of a started job comes back: the job must refuse it, and the
 * process goes on in the job that restarts the work. */
static void join_started(spc_handle_t *h, int rank)
{
    struct tally *t = &tallies[rank];
    spc_group_t world;
    spc_status_t st = spc_job_join(h, board->job_id[0], RANKS, (uint32_t)rank, JOIN_TIMEOUT_MS, &world);
    if (st == SPC_ERR_BUSY && strstr(spc_last_error(h), "create a new job") != NULL)
        t->refused++;
    else
        wrong(t, "join of a started job by a killed rank's replacement", h, st);
    __atomic_store_n(&board->refused, 1, __ATOMIC_RELEASE);   /* the survivors may let go of it */
}

/* A new process for a killed rank: it rejoins the same job while that job is
 * still joining, or is refused a started one and joins its restart. */
static int replacement_main(void *arg)
{
    int rank = *(const int *)arg;
    spc_handle_t *h = sp_test_attach();
    replacing = true;
    if (plan.fault == FAULT_JOINING)
        return rank_jobs(rank, 0, h);
    join_started(h, rank);
    return rank_jobs(rank, 1, h);
}

static int rank_ids[RANKS] = { 0, 1, 2, 3 };

static void plan_round(uint64_t *seed, uint64_t round)
{
    /* The first round warms spd up before its baseline; then the faults take
     * turns, so that a short run has each at least once. */
    static const enum fault turn[3] = { FAULT_NONE, FAULT_JOINING, FAULT_RUNNING };
    plan.fault = round == 0 ? FAULT_NONE : turn[round % 3];
    plan.rounds = plan.fault == FAULT_RUNNING || (round > 0 && rnd(seed) % 2) ? 2 : 1;
    for (int k = 0; k < 2; k++) {
        plan.ops[k] = 50 + (int)(rnd(seed) % 400);
        plan.seed[k] = rnd(seed) | 1;
    }
    plan.victim = (int)(rnd(seed) % RANKS);
    plan.latecomer = (plan.victim + 1 + (int)(rnd(seed) % (RANKS - 1))) % RANKS;
    plan.leave_attached = round == 0 ? 0 : (unsigned)(rnd(seed) & rnd(seed)) % (1u << RANKS);   /* each 1 in 4 */
}

static void kill_victim(pid_t *pids)
{
    kill(pids[plan.victim], SIGKILL);
    int rc = sp_test_wait(pids[plan.victim], 20000);
    if (rc != -SIGKILL)
        SP_FAIL("rank %d, to be killed, ended with %d", plan.victim, rc);
    pids[plan.victim] = -1;
}

/* Kills the victim while it waits in its join, and replaces it once spd has
 * let go of its slot (before that, its rank is still taken). */
static pid_t kill_joining(spc_handle_t *q, pid_t *pids, uint64_t *seed)
{
    if (!wait_flag(&board->id_ready[0], JOIN_TIMEOUT_MS))
        SP_FAIL("rank 0 made no job");
    const char *id = board->job_id[0];
    if (!sp_test_wait_job_joined(q, id, RANKS - 1, JOIN_TIMEOUT_MS))
        SP_FAIL("job %s: the ranks but the latecomer did not all join", id);
    usleep((useconds_t)(rnd(seed) % 3000));
    kill_victim(pids);
    if (!sp_test_wait_job_joined(q, id, RANKS - 2, 10000))
        SP_FAIL("job %s: rank %d's slot was not freed after its process died", id, plan.victim);
    pid_t repl = sp_test_fork(replacement_main, &rank_ids[plan.victim]);
    __atomic_store_n(&board->latecomer_go, 1, __ATOMIC_RELEASE);
    return repl;
}

/* Kills the victim at a random moment once all have joined; its replacement
 * comes at once. */
static pid_t kill_running(pid_t *pids, uint64_t *seed)
{
    uint64_t until = sp_test_now_ms() + JOIN_TIMEOUT_MS;
    while (__atomic_load_n(&board->joined[0], __ATOMIC_SEQ_CST) < RANKS && sp_test_now_ms() < until)
        usleep(1000);
    usleep((useconds_t)(rnd(seed) % 30000));
    kill_victim(pids);
    return sp_test_fork(replacement_main, &rank_ids[plan.victim]);
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

static uint64_t seed_from_env(void)
{
    const char *e = getenv("SP_SOAK_SEED");
    uint64_t seed;
    if (e != NULL) {
        seed = strtoull(e, NULL, 0);
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        seed = ((uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec) ^ ((uint64_t)getpid() << 32);
    }
    return seed != 0 ? seed : 0x9E3779B97F4A7C15ull;   /* xorshift never leaves 0 */
}

static struct tally tally_sum(void)
{
    struct tally sum = { 0 };
    for (int r = 0; r < RANKS; r++) {
        const struct tally *t = &tallies[r];
        sum.ok += t->ok;
        sum.expected_fail += t->expected_fail;
        sum.replaced += t->replaced;
        sum.refused += t->refused;
        sum.reattached += t->reattached;
        sum.left_attached += t->left_attached;
        if (t->wrong > 0 && sum.wrong == 0)
            snprintf(sum.first_wrong, sizeof sum.first_wrong, "%s", t->first_wrong);
        sum.wrong += t->wrong;
    }
    return sum;
}

int main(void)
{
    const char *e;
    uint64_t target = (e = getenv("SP_SOAK_OPS")) ? strtoull(e, NULL, 10) : 100000;
    uint64_t seconds = (e = getenv("SP_SOAK_SECONDS")) ? strtoull(e, NULL, 10) : 60;
    uint64_t seed = seed_from_env();
    printf("soak: seed %#" PRIx64 " (SP_SOAK_SEED=%#" PRIx64 " repeats the plan)\n", seed, seed);
    tallies = sp_test_shared(RANKS * sizeof *tallies);
    board = sp_test_shared(sizeof *board);

    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    spc_handle_t *q = sp_test_attach();
    uint64_t rounds = 0, jobs = 0, kills_joining = 0, kills_running = 0;
    long rss0 = 0;
    int fds0 = 0;
    uint64_t start = sp_test_now_ms();
    for (;; rounds++) {
        struct tally sum = tally_sum();
        if (rounds == 1) {
            /* The baseline once the first round's clients are all released. */
            if (!sp_test_wait_status(q, "clients", 1, 10000))
                SP_FAIL("the first round's clients remain");
            rss0 = (long)sp_test_proc_kib(d.pid, "VmRSS");
            fds0 = open_fds(d.pid);
        }
        if (rounds > 2 && (sum.ok + sum.expected_fail >= target || sp_test_now_ms() - start > seconds * 1000))
            break;
        plan_round(&seed, rounds);
        memset(board, 0, sizeof *board);
        pid_t pids[RANKS], repl = -1;
        for (int r = 0; r < RANKS; r++)
            pids[r] = sp_test_fork(rank_main, &rank_ids[r]);
        if (plan.fault == FAULT_JOINING) {
            repl = kill_joining(q, pids, &seed);
            kills_joining++;
        } else if (plan.fault == FAULT_RUNNING) {
            repl = kill_running(pids, &seed);
            kills_running++;
        }
        for (int r = 0; r < RANKS; r++) {
            int rc = pids[r] < 0 ? 0 : sp_test_wait(pids[r], 60000);
            if (rc != 0)
                SP_FAIL("round %" PRIu64 ": rank %d ended with %d", rounds, r, rc);
        }
        int rc = repl < 0 ? 0 : sp_test_wait(repl, 60000);
        if (rc != 0)
            SP_FAIL("round %" PRIu64 ": the replacement of rank %d ended with %d", rounds, plan.victim, rc);
        jobs += (uint64_t)plan.rounds;
    }
    /* Every client gone: what spd holds now is what it keeps. */
    if (!sp_test_wait_status(q, "clients", 1, 10000) || !sp_test_wait_status(q, "jobs", 0, 10000))
        SP_FAIL("clients or jobs remain after every rank left");
    long rss1 = (long)sp_test_proc_kib(d.pid, "VmRSS");
    int fds1 = open_fds(d.pid);
    for (int i = 0; i < 200 && fds1 > fds0; i++) {   /* a closing session's handles go a loop turn later */
        usleep(10000);
        fds1 = open_fds(d.pid);
    }
    struct tally sum = tally_sum();
    printf("soak: %" PRIu64 " rounds, %" PRIu64 " jobs, %.1f s; kills: %" PRIu64 " while joining, %" PRIu64
           " in a started job\n",
           rounds, jobs, (sp_test_now_ms() - start) / 1000.0, kills_joining, kills_running);
    printf("reattaches: %" PRIu64 " new processes joined in place of a killed rank, %" PRIu64
           " were refused a started job and joined its restart, %" PRIu64 " new handles in the same process; %"
           PRIu64 " processes ended without detaching\n",
           sum.replaced, sum.refused, sum.reattached, sum.left_attached);
    printf("ops: %" PRIu64 " completed, %" PRIu64 " failed as expected (a rank lost), %" PRIu64 " wrong\n", sum.ok,
           sum.expected_fail, sum.wrong);
    printf("spd after the first round: RSS %ld KiB, %d fds; at the end: RSS %ld KiB, %d fds\n", rss0, fds0, rss1,
           fds1);
    fflush(stdout);   /* the figures before any failure's reason */
    if (sum.wrong > 0)
        SP_FAIL("%" PRIu64 " ops or joins failed unexpectedly or gave wrong results; the first: %s", sum.wrong,
                sum.first_wrong);
    CHECK(sum.ok > 0 && kills_joining > 0 && kills_running > 0 && sum.reattached > 0);
    CHECK_EQ(sum.replaced, kills_joining);
    CHECK_EQ(sum.refused, kills_running);
    if (fds1 > fds0)
        SP_FAIL("spd holds %d descriptors, %d after the first round", fds1, fds0);
    if (CHECK_RSS && rss1 - rss0 > 32 * 1024)
        SP_FAIL("spd's RSS grew by %ld KiB", rss1 - rss0);
    spc_detach(q);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    return 0;
}
