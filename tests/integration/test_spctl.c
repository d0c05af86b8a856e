/* spctl against a real daemon: text and JSON, every command, and its errors;
 * its command line (flags before or after the command, refusals with exit 2,
 * --version); `top` over a 2-rank job that runs all-reduces and then leaves
 * one waiting. (jobs, mesh and ops with meshes and ops in flight: test_mesh,
 * test_sp_failures.) */
#include <math.h>
#include <stdint.h>
#include <unistd.h>

#include "sp_test.h"
#include "version.h"

static char job_id[SPC_JOB_ID_MAX];
static int ready[2], done[2];   /* holder → parent, parent → holder */

static int rank_holder(void *arg)
{
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, 1, 0, 10000, &world));
    static char buf[4096];
    spc_region_t r;
    CHECK_OK(h, spc_register(h, buf, sizeof buf, &r));
    CHECK(write(ready[1], "x", 1) == 1);
    char c;
    CHECK(read(done[0], &c, 1) == 1);   /* hold until the parent is done looking */
    spc_detach(h);
    return 0;
}

/* The top job: both ranks all-reduce AR_COUNT doubles until told to stop, then
 * rank 0 submits one more and waits while rank 1 holds back until told to go.
 * The first element carries each rank's view of the stop flag, so that both
 * leave the loop after the same all-reduce. */
#define AR_COUNT 1024
struct top_job {
    volatile int stop, go, loops;
};
static struct top_job *tj;
static char top_job_id[SPC_JOB_ID_MAX];

static int top_rank(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, top_job_id, 2, (uint32_t)rank, 10000, &world));
    double *x = spc_alloc(h, AR_COUNT * sizeof *x);
    CHECK(x != NULL);
    do {
        x[0] = __atomic_load_n(&tj->stop, __ATOMIC_ACQUIRE);
        for (int i = 1; i < AR_COUNT; i++)
            x[i] = rank + 1;
        CHECK_OK(h, spc_allreduce(h, world, x, x, AR_COUNT, SPC_F64, SPC_SUM, 10000));
        CHECK(x[1] == 3.0 && x[AR_COUNT - 1] == 3.0);
        if (rank == 0)
            __atomic_add_fetch(&tj->loops, 1, __ATOMIC_RELEASE);
    } while (x[0] == 0);
    if (rank == 1)
        while (!__atomic_load_n(&tj->go, __ATOMIC_ACQUIRE))
            usleep(1000);
    for (int i = 0; i < AR_COUNT; i++)
        x[i] = rank + 1;
    CHECK_OK(h, spc_allreduce(h, world, x, x, AR_COUNT, SPC_F64, SPC_SUM, 10000));
    CHECK(x[0] == 3.0);
    spc_detach(h);
    return 0;
}

/* `spctl top`: rates that add up while ops run, the op that waits with the rank
 * it waits for, and an end on SIGINT. */
static void check_top(const char *spctl)
{
    char out[16384], rec[4096], needle[256];
    tj = sp_test_shared(sizeof *tj);
    spc_handle_t *owner = sp_test_attach();
    CHECK_OK(owner, spc_job_create(owner, top_job_id, sizeof top_job_id));
    pid_t ranks[2];
    for (int r = 0; r < 2; r++)
        ranks[r] = sp_test_fork(top_rank, (void *)(intptr_t)r);
    while (__atomic_load_n(&tj->loops, __ATOMIC_ACQUIRE) < 10)
        usleep(1000);

    /* Two refreshes, a JSON line each: the group moved bytes of whole ops, 2 ranks x
     * AR_COUNT doubles each, and the daemon as much as its only group. */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s top --count 2 --json --interval 0.5 %s", spctl, top_job_id), 0);
    char *second = strchr(out, '\n');
    CHECK(second != NULL && strchr(second + 1, '\n') == out + strlen(out) - 1);
    CHECK(strncmp(out, "{\"refresh\":1,", 13) == 0 && strncmp(second + 1, "{\"refresh\":2,", 13) == 0);
    snprintf(needle, sizeof needle, "\"job\":\"%s\",\"group\":", top_job_id);
    CHECK(sp_test_json_record(out, second, needle, rec, sizeof rec));
    long long ops = sp_test_json_int(rec, "ops"), bytes = sp_test_json_int(rec, "bytes");
    CHECK(ops > 0);
    CHECK_EQ(bytes, ops * 2 * AR_COUNT * (long long)sizeof(double));
    CHECK_EQ(sp_test_json_int(rec, "size"), 2);
    double dt = sp_test_json_double(second + 1, "interval_s");
    CHECK(dt >= 0.5 && dt < 5);
    CHECK(fabs(sp_test_json_double(rec, "ops_per_s") - (double)ops / dt) <= 1e-4 * (double)ops / dt);
    CHECK_EQ(sp_test_json_int(second + 1, "ops"), ops);
    CHECK_CONTAINS(second, "\"waiting\":[");

    /* Rank 0 waits in an all-reduce for rank 1: shown with the rank missing. */
    __atomic_store_n(&tj->stop, 1, __ATOMIC_RELEASE);
    bool seen = false;
    for (uint64_t end = sp_test_now_ms() + 10000; !seen && sp_test_now_ms() < end;) {
        CHECK_EQ(sp_test_run(out, sizeof out, "%s top %s --interval=0.05 --count 1", spctl, top_job_id), 0);
        seen = strstr(out, "1 of 2 arrived") != NULL;
    }
    CHECK(seen);
    CHECK_CONTAINS(out, "waiting for ranks:");
    CHECK_CONTAINS(out, "allreduce #");
    CHECK_CONTAINS(out, "missing 1\n");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json top --count 1 --interval 0.05", spctl), 0);
    CHECK(sp_test_json_record(out, strstr(out, "\"waiting\":["), "\"missing_ranks\":", rec, sizeof rec));
    char missing[64];
    sp_test_json_str(rec, "missing_ranks", missing, sizeof missing);
    CHECK_STREQ(missing, "1");
    __atomic_store_n(&tj->go, 1, __ATOMIC_RELEASE);
    sp_test_wait_all_ok(ranks, 2, 20000);
    spc_detach(owner);

    /* Until interrupted: SIGINT ends it, exit 0, after the frames so far. Sent to
     * spctl alone (--foreground): timeout otherwise sends it to its process group
     * as well, and under LeakSanitizer that second SIGINT can land in the leak
     * check spctl runs as it exits, which then never ends. */
    CHECK_EQ(sp_test_run(out, sizeof out, "timeout --foreground --preserve-status -s INT 1.5 %s top --interval 0.1",
                         spctl), 0);
    CHECK_CONTAINS(out, "refresh 1,");
    CHECK_CONTAINS(out, "daemon: ");
}

/* The command line: flags anywhere, refusals with the usage and exit 2. */
static void check_command_line(const char *spctl)
{
    char out[16384];
    CHECK_EQ(sp_test_run(out, sizeof out, "%s status --json", spctl), 0);
    CHECK(out[0] == '{');
    CHECK_CONTAINS(out, "\"uptime_s\":");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s clients --json --socket \"$SPC_SOCKET\"", spctl), 0);
    CHECK(out[0] == '[');
    CHECK_EQ(sp_test_run(out, sizeof out, "%s config --socket=\"$SPC_SOCKET\" get --json op_timeout_ms", spctl), 0);
    CHECK_CONTAINS(out, "\"name\":\"op_timeout_ms\",\"value\":\"60000\"");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s topo --json", spctl), 0);
    CHECK(out[0] == '{');
    /* A flag after the command means what it means before: the socket too. */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s status --socket /tmp/spd-none/x.sock 2>&1", spctl), 1);
    CHECK_CONTAINS(out, "SPC_ERR_CONNECT");

    static const char *const refused[][2] = {
        { "status --bogus", "unknown option '--bogus'" },
        { "--bogus status", "unknown option '--bogus'" },
        { "status extra", "unexpected argument 'extra'" },
        { "metrics --json x", "unexpected argument 'x'" },
        { "jobs a b", "unexpected argument 'b'" },
        { "config get", "config takes 'get NAME' or 'dump'" },
        { "config dump more", "config takes 'get NAME' or 'dump'" },
        { "config set x 1", "config takes 'get NAME' or 'dump'" },
        { "status --history", "--history is an option of ops" },
        { "ops --count 3", "--count and --interval are options of top" },
        { "top --count 0", "--count needs a whole number of refreshes, at least 1, not '0'" },
        { "top --interval soon", "--interval needs seconds between 0.01 and 3600, not 'soon'" },
        { "status --socket", "--socket needs a value" },
        { "", "no command" },
        { "frobnicate", "unknown command 'frobnicate'" },
    };
    for (size_t i = 0; i < sizeof refused / sizeof refused[0]; i++) {
        CHECK_EQ(sp_test_run(out, sizeof out, "%s %s 2>&1", spctl, refused[i][0]), 2);
        CHECK_CONTAINS(out, refused[i][1]);
        CHECK_CONTAINS(out, "Usage: spctl");
    }
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --version", spctl), 0);
    CHECK_STREQ(out, "spctl " SPD_VERSION "\n");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s status --version", spctl), 0);
    CHECK_STREQ(out, "spctl " SPD_VERSION "\n");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --version", sp_test_spd_bin()), 0);
    CHECK_STREQ(out, "spd " SPD_VERSION "\n");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --bogus 2>&1", sp_test_spd_bin()), 2);
    CHECK_CONTAINS(out, "unknown argument '--bogus'");
    CHECK_CONTAINS(out, "Usage: spd");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --dump-config --config 2>&1", sp_test_spd_bin()), 2);
    CHECK_CONTAINS(out, "--config needs a file");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s status help 2>&1", spctl), 2);
    /* plan reads its own flags: --json after it is plan's. */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s plan --nodes 1 --gpus-per-node 2 --heads 8 --json", spctl), 0);
    CHECK(out[0] == '{');
}

int main(void)
{
    sp_test_daemon_t d;
    char out[16384], cmd[512];
    sp_test_daemon_start(&d, NULL);
    const char *spctl = sp_test_spctl_bin();

    CHECK_EQ(sp_test_run(out, sizeof out, "%s status", spctl), 0);
    CHECK_CONTAINS(out, "version");
    CHECK_CONTAINS(out, "uptime_s");
    CHECK_CONTAINS(out, "transport_shm     active");
    CHECK_CONTAINS(out, "gpus");
    snprintf(cmd, sizeof cmd, "\"pid\":%d", (int)d.pid);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json status", spctl), 0);
    CHECK(out[0] == '{');
    CHECK_CONTAINS(out, cmd);
    CHECK_CONTAINS(out, "\"clients\":0");

    /* A client in a job, with a registration, shows up. */
    spc_handle_t *owner = sp_test_attach();
    CHECK_OK(owner, spc_job_create(owner, job_id, sizeof job_id));
    CHECK(pipe(ready) == 0 && pipe(done) == 0);
    pid_t holder = sp_test_fork(rank_holder, NULL);
    char c;
    CHECK(read(ready[0], &c, 1) == 1);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s clients", spctl), 0);
    snprintf(cmd, sizeof cmd, "%d", (int)holder);
    CHECK_CONTAINS(out, cmd);
    CHECK_CONTAINS(out, job_id);
    CHECK_CONTAINS(out, "INFLIGHT");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json clients", spctl), 0);
    CHECK(out[0] == '[');
    snprintf(cmd, sizeof cmd, "\"pid\":%d", (int)holder);
    CHECK_CONTAINS(out, cmd);
    CHECK_CONTAINS(out, "\"regions\":1");
    CHECK_CONTAINS(out, "\"rank\":0");

    /* The job: one rank, joined, complete, nothing in flight, no mesh. */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json jobs", spctl), 0);
    snprintf(cmd, sizeof cmd, "[{\"id\":\"%s\",\"world_size\":1,\"joined\":1,\"complete\":1,", job_id);
    CHECK_CONTAINS(out, cmd);
    CHECK_CONTAINS(out, "\"groups\":1,\"meshes\":0,\"ops_pending\":0,\"nodes\":\"");   /* this node alone */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s jobs %s", spctl, job_id), 0);
    CHECK_CONTAINS(out, "WORLD  JOINED COMPLETE");
    CHECK_CONTAINS(out, job_id);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s mesh %s", spctl, job_id), 0);
    CHECK_CONTAINS(out, "(no meshes)");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json ops %s", spctl, job_id), 0);
    CHECK_STREQ(out, "[]\n");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s ops", spctl), 0);
    CHECK_CONTAINS(out, "(no ops in flight)");
    CHECK(write(done[1], "x", 1) == 1);
    CHECK_EQ(sp_test_wait(holder, 10000), 0);

    CHECK_EQ(sp_test_run(out, sizeof out, "%s config get op_timeout_ms", spctl), 0);
    CHECK_CONTAINS(out, "op_timeout_ms 60000");
    CHECK_CONTAINS(out, "source: default");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json config get log_level", spctl), 0);
    CHECK_CONTAINS(out, "\"name\":\"log_level\",\"value\":\"debug\"");
    CHECK_CONTAINS(out, "\"source\":\"set\"");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s config dump", spctl), 0);
    CHECK_CONTAINS(out, "max_frame_bytes");
    CHECK_CONTAINS(out, "drain_timeout_ms");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json config dump", spctl), 0);
    CHECK(out[0] == '[');

    /* Errors: unknown option, no daemon, bad usage. */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s config get nope 2>&1", spctl), 1);
    CHECK_CONTAINS(out, "no option 'nope'");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket /tmp/spd-none/x.sock status 2>&1", spctl), 1);
    CHECK_CONTAINS(out, "SPC_ERR_CONNECT");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --help", spctl), 0);
    CHECK_CONTAINS(out, "  jobs [JOB_ID]");
    CHECK_CONTAINS(out, "  mesh [JOB_ID]");
    CHECK_CONTAINS(out, "  ops [JOB_ID]");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s ops no-such-job 2>&1", spctl), 1);
    CHECK_CONTAINS(out, "SPC_ERR_NOT_FOUND: no job 'no-such-job' on this daemon");

    /* With no job at all (the holder left, the owner is about to). */
    spc_detach(owner);
    owner = NULL;
    bool gone = false;
    for (uint64_t end = sp_test_now_ms() + 10000; !gone && sp_test_now_ms() < end;) {
        CHECK_EQ(sp_test_run(out, sizeof out, "%s jobs", spctl), 0);
        gone = strstr(out, "(no jobs)") != NULL;
        if (!gone)
            usleep(5000);
    }
    CHECK(gone);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json jobs", spctl), 0);
    CHECK_STREQ(out, "[]\n");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json mesh", spctl), 0);
    CHECK_STREQ(out, "[]\n");

    spc_detach(owner);   /* accepts NULL */
    check_command_line(spctl);
    check_top(spctl);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("spctl: ok\n");
    return 0;
}
