/* spctl against a real daemon: text and JSON, every command, and its errors.
 * (jobs, mesh and ops with meshes and ops in flight: test_mesh, test_sp_failures.) */
#include <unistd.h>

#include "sp_test.h"

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
    CHECK_EQ(sp_test_run(out, sizeof out, "%s frobnicate 2>&1", spctl), 2);
    CHECK_CONTAINS(out, "usage");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s ops a b 2>&1", spctl), 2);
    CHECK_CONTAINS(out, "usage");
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
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("spctl: ok\n");
    return 0;
}
