/*
 * Operating the daemon: the service-manager handshake (READY, WATCHDOG,
 * STOPPING) on a notify socket, where each option's value came from, SIGHUP
 * reopening the log and applying a new op_timeout_ms to the next op, SIGTERM
 * draining with an op in flight and exiting 0, a second spd refusing a socket
 * already served, and the command line.
 */
#include <inttypes.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sp_test.h"

static const char *config_value(spc_handle_t *h, const char *name, char *source, size_t len)
{
    static char value[256];
    spc_query_result_t *q;
    CHECK_OK(h, spc_query(h, "config", name, &q));
    CHECK_EQ(spc_query_records(q), 1);
    snprintf(value, sizeof value, "%s", spc_query_str(q, 0, (size_t)spc_query_find(q, 0, "value")));
    snprintf(source, len, "%s", spc_query_str(q, 0, (size_t)spc_query_find(q, 0, "source")));
    spc_query_free(q);
    return value;
}

static char job_id[SPC_JOB_ID_MAX];

static int rank_draining(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, 2, (uint32_t)rank, 20000, &world));
    if (rank == 1) {
        pause();   /* never arrives */
        return 1;
    }
    uint64_t t0 = sp_test_now_ms();
    CHECK_ST(h, spc_barrier(h, world, 30000), SPC_ERR_SHUTTING_DOWN);
    uint64_t took = sp_test_now_ms() - t0;
    CHECK_CONTAINS(spc_last_error(h), "shutting down");
    CHECK(took < 10000);
    spc_detach(h);
    return 0;
}

/* Rank 0 waits at a barrier rank 1 never reaches: the match deadline is spd's
 * op_timeout_ms, as the last SIGHUP set it. */
static int rank_timing_out(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, 2, (uint32_t)rank, 20000, &world));
    if (rank == 1) {
        pause();
        return 1;
    }
    uint64_t t0 = sp_test_now_ms();
    CHECK_ST(h, spc_barrier(h, world, 20000), SPC_ERR_TIMEOUT);
    uint64_t took = sp_test_now_ms() - t0;
    CHECK_CONTAINS(spc_last_error(h), "rank 1");
    printf("barrier timed out after %" PRIu64 " ms (op_timeout_ms 300 since SIGHUP; 60000 at start)\n", took);
    CHECK(took >= 250 && took < 5000);
    spc_detach(h);
    return 0;
}

static bool file_contains(const char *path, const char *needle)
{
    char out[64];
    return sp_test_run(out, sizeof out, "grep -q '%s' %s 2>/dev/null", needle, path) == 0;
}

int main(void)
{
    sp_test_daemon_t d;
    char conf[256], set_conf[300], src[32], out[8192];

    /* ---- the command line alone ---- */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --version", sp_test_spd_bin()), 0);
    CHECK_CONTAINS(out, "spd ");
    CHECK_EQ(sp_test_run(out, sizeof out, "env -i %s --dump-config", sp_test_spd_bin()), 0);
    CHECK_CONTAINS(out, "op_timeout_ms 60000");
    CHECK_CONTAINS(out, "# How long an operation waits");
    CHECK_EQ(sp_test_run(out, sizeof out, "env -i SPD_SQ_ENTRIES=64 %s --set max_clients=9 --dump-config",
                         sp_test_spd_bin()), 0);
    CHECK_CONTAINS(out, "sq_entries 64");
    CHECK_CONTAINS(out, "max_clients 9");
    CHECK(sp_test_run(out, sizeof out, "%s --set bogus=1 2>&1", sp_test_spd_bin()) != 0);
    CHECK_CONTAINS(out, "unknown option 'bogus'");
    CHECK(sp_test_run(out, sizeof out, "SPD_LOG_LEVEL=loud %s 2>&1", sp_test_spd_bin()) != 0);
    CHECK_CONTAINS(out, "SPD_LOG_LEVEL");

    /* ---- a daemon with a file, the environment, --set and a watchdog ---- */
    snprintf(conf, sizeof conf, "/tmp/spd-ops-conf-%d", (int)getpid());
    FILE *f = fopen(conf, "w");
    fprintf(f, "node_name \"test-node\"\nop_timeout_ms 1000\ndrain_timeout_ms 100\n");
    fclose(f);
    snprintf(set_conf, sizeof set_conf, "--config=%s", conf);
    setenv("SPD_OP_TIMEOUT_MS", "4321", 1);
    setenv("WATCHDOG_USEC", "200000", 1);
    const char *args[] = { set_conf, "--set", "drain_timeout_ms=700", NULL };
    sp_test_daemon_start(&d, args);
    unsetenv("SPD_OP_TIMEOUT_MS");
    unsetenv("WATCHDOG_USEC");

    CHECK(sp_test_notify_wait(&d, "WATCHDOG=1", 3000));

    spc_handle_t *h = sp_test_attach();
    CHECK_STREQ(config_value(h, "op_timeout_ms", src, sizeof src), "4321");
    CHECK_STREQ(src, "env");                 /* environment beats the file */
    CHECK_STREQ(config_value(h, "drain_timeout_ms", src, sizeof src), "700");
    CHECK_STREQ(src, "set");                 /* --set beats both */
    CHECK_STREQ(config_value(h, "node_name", src, sizeof src), "test-node");
    CHECK_STREQ(src, "file");
    CHECK_STREQ(config_value(h, "max_clients", src, sizeof src), "256");
    CHECK_STREQ(src, "default");
    spc_query_result_t *q;
    CHECK_OK(h, spc_query(h, "status", NULL, &q));
    CHECK_STREQ(spc_query_str(q, 0, (size_t)spc_query_find(q, 0, "node")), "test-node");
    CHECK_STREQ(spc_query_str(q, 0, (size_t)spc_query_find(q, 0, "config_file")), conf);
    spc_query_free(q);

    /* The socket's directory is private. */
    char dir[256];
    snprintf(dir, sizeof dir, "%s/run", d.dir);
    struct stat st;
    CHECK_EQ(stat(dir, &st), 0);
    CHECK_EQ(st.st_mode & 0777, 0700);
    CHECK_EQ(stat(d.sock, &st), 0);
    CHECK_EQ(st.st_mode & 0777, 0600);

    /* A second spd on the same socket refuses and leaves the first alone. */
    CHECK(sp_test_run(out, sizeof out, "%s --set socket=%s 2>&1", sp_test_spd_bin(), d.sock) != 0);
    CHECK_CONTAINS(out, "another spd is already serving");
    CHECK_OK(h, spc_noop(h, 5000));

    /* SIGHUP: the log moves away, spd writes a fresh one. */
    char moved[256];
    snprintf(moved, sizeof moved, "%s.1", d.log);
    CHECK_EQ(rename(d.log, moved), 0);
    CHECK_EQ(kill(d.pid, SIGHUP), 0);
    bool reopened = false;
    for (uint64_t end = sp_test_now_ms() + 5000; !reopened && sp_test_now_ms() < end;)
        reopened = file_contains(d.log, "SIGHUP: log reopened");
    CHECK(reopened);

    /* SIGTERM with an op in flight: STOPPING=1, no new clients, the op fails with
     * SHUTTING_DOWN after drain_timeout_ms, and spd exits 0. */
    CHECK_OK(h, spc_job_create(h, job_id, sizeof job_id));
    pid_t pids[2] = { sp_test_fork(rank_draining, (void *)0), sp_test_fork(rank_draining, (void *)1) };
    CHECK(sp_test_wait_status(h, "ops_inflight", 1, 20000));
    CHECK_EQ(kill(d.pid, SIGTERM), 0);
    CHECK(sp_test_notify_wait(&d, "STOPPING=1", 5000));
    spc_handle_t *late;
    CHECK(spc_attach(NULL, &late) != SPC_OK);   /* the socket is gone while draining */
    CHECK_EQ(sp_test_wait(pids[0], 20000), 0);
    kill(pids[1], SIGKILL);
    sp_test_wait(pids[1], 5000);
    CHECK_EQ(sp_test_wait(d.pid, 20000), 0);
    d.pid = 0;
    CHECK(access(d.sock, F_OK) != 0);            /* socket removed */
    CHECK(file_contains(d.log, "drain timeout"));
    spc_detach(h);
    sp_test_daemon_cleanup(&d);
    unlink(conf);

    /* SIGHUP applies a new op_timeout_ms: the next op's deadline is the new one. */
    snprintf(conf, sizeof conf, "/tmp/spd-ops-reload-%d", (int)getpid());
    f = fopen(conf, "w");
    fprintf(f, "op_timeout_ms 60000\n");
    fclose(f);
    snprintf(set_conf, sizeof set_conf, "--config=%s", conf);
    const char *reload_args[] = { set_conf, NULL };
    sp_test_daemon_start(&d, reload_args);
    h = sp_test_attach();
    CHECK_STREQ(config_value(h, "op_timeout_ms", src, sizeof src), "60000");
    f = fopen(conf, "w");
    fprintf(f, "op_timeout_ms 300\n");
    fclose(f);
    CHECK_EQ(kill(d.pid, SIGHUP), 0);
    bool applied = false;
    for (uint64_t end = sp_test_now_ms() + 5000; !applied && sp_test_now_ms() < end;)
        applied = strcmp(config_value(h, "op_timeout_ms", src, sizeof src), "300") == 0;
    CHECK(applied);
    CHECK_STREQ(src, "file");
    CHECK_OK(h, spc_job_create(h, job_id, sizeof job_id));
    pid_t tpids[2] = { sp_test_fork(rank_timing_out, (void *)0), sp_test_fork(rank_timing_out, (void *)1) };
    CHECK_EQ(sp_test_wait(tpids[0], 20000), 0);
    kill(tpids[1], SIGKILL);
    sp_test_wait(tpids[1], 5000);
    spc_detach(h);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    unlink(conf);

    /* An idle daemon stops at once on SIGTERM, exit 0. */
    sp_test_daemon_start(&d, NULL);
    uint64_t t0 = sp_test_now_ms();
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    CHECK(sp_test_now_ms() - t0 < 5000);
    sp_test_daemon_cleanup(&d);
    printf("daemon_ops: ok\n");
    return 0;
}
