/*
 * Sessions that hold a place without using it. Control sessions that say
 * hello and then nothing fill max_clients: after session_idle_ms each is told
 * why and closed, and a trainer attaches; an attached trainer that waits
 * longer than that for its job is never closed. A refused hello (a ring or an
 * arena over the limits) gets its reason and then the end of the connection,
 * rather than a session left open.
 */
#include <sys/socket.h>

#include "sp_test.h"

#define MAX_CLIENTS 4
#define IDLE_MS     500

static char job_id[SPC_JOB_ID_MAX];

static bool log_has(const sp_test_daemon_t *d, const char *needle)
{
    char out[64];
    return sp_test_run(out, sizeof out, "grep -q '%s' %s", needle, d->log) == 0;
}

/* Reads the daemon's closing Error on fd, then EOF. */
static void expect_closed(int fd, spc_status_t status, const char *detail)
{
    bool eof = false;
    Spd__Msg *m = sp_test_raw_recv(fd, 5000, &eof);
    CHECK(m != NULL);
    CHECK_EQ(m->body_case, SPD__MSG__BODY_ERROR);
    CHECK_EQ(m->error->status, status);
    CHECK_CONTAINS(m->error->detail, detail);
    sp_msg_free(m);
    CHECK(sp_test_raw_recv(fd, 5000, &eof) == NULL);
    CHECK(eof);
}

/* MAX_CLIENTS idle control sessions lock trainers out only until they time out. */
static void test_idle_control(const sp_test_daemon_t *d)
{
    int fds[MAX_CLIENTS];
    for (int i = 0; i < MAX_CLIENTS; i++) {
        fds[i] = sp_test_raw_connect(d->sock);
        sp_test_raw_hello(fds[i], SPD__HELLO__ROLE__CONTROL);
    }
    spc_handle_t *h;
    CHECK_ST(NULL, spc_attach(NULL, &h), SPC_ERR_LIMIT);
    CHECK_CONTAINS(spc_last_error(NULL), "max_clients");

    uint64_t t0 = sp_test_now_ms();
    for (int i = 0; i < MAX_CLIENTS; i++) {
        expect_closed(fds[i], SPC_ERR_TIMEOUT, "session_idle_ms");
        close(fds[i]);
    }
    uint64_t took = sp_test_now_ms() - t0;
    CHECK(took < 5000);
    CHECK(log_has(d, "control session sent nothing for 500 ms (session_idle_ms); attach again; closing"));
    h = sp_test_attach();
    CHECK_OK(h, spc_noop(h, 5000));
    spc_detach(h);
}

/* Rank 0 joins at once and waits well past session_idle_ms for rank 1. */
static int rank_waits(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, 2, (uint32_t)rank, 20000, &world));
    CHECK_OK(h, spc_barrier(h, world, 20000));
    spc_detach(h);
    return 0;
}

static void test_trainer_waits(void)
{
    spc_handle_t *creator = sp_test_attach();
    CHECK_OK(creator, spc_job_create(creator, job_id, sizeof job_id));
    pid_t pids[2];
    pids[0] = sp_test_fork(rank_waits, (void *)(intptr_t)0);
    CHECK(sp_test_wait_job_joined(creator, job_id, 1, 10000));
    /* The point of the test is the wait: three idle periods with rank 0 in its join. */
    usleep(3 * IDLE_MS * 1000);
    pids[1] = sp_test_fork(rank_waits, (void *)(intptr_t)1);
    sp_test_wait_all_ok(pids, 2, 30000);
    spc_detach(creator);
}

/* Sends a client Hello asking for sq_entries and arena_bytes. */
static int hello(const sp_test_daemon_t *d, uint32_t sq_entries, uint64_t arena_bytes)
{
    int fd = sp_test_raw_connect(d->sock);
    Spd__Msg m = SPD__MSG__INIT;
    Spd__Hello hl = SPD__HELLO__INIT;
    hl.protocol = SP_PROTOCOL_VERSION;
    hl.role = SPD__HELLO__ROLE__CLIENT;
    hl.name = "refused";
    hl.sq_entries = sq_entries;
    hl.arena_bytes = arena_bytes;
    m.seq = 1;
    m.body_case = SPD__MSG__BODY_HELLO;
    m.hello = &hl;
    sp_test_raw_send_msg(fd, &m);
    return fd;
}

/* A refused hello ends the connection; a second hello on it gets nothing. */
static void test_refused_hello(const sp_test_daemon_t *d)
{
    bool eof = false;
    int fd = hello(d, 1u << 20, 0);
    Spd__Msg *m = sp_test_raw_recv(fd, 5000, &eof);
    CHECK(m != NULL);
    CHECK_EQ(m->body_case, SPD__MSG__BODY_ERROR);
    CHECK_EQ(m->error->status, SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(m->error->detail, "sq_entries 1048576 exceeds");
    sp_msg_free(m);
    CHECK(sp_test_raw_recv(fd, 3000, &eof) == NULL);
    CHECK(eof);
    close(fd);

    fd = hello(d, 0, 1ull << 40);
    m = sp_test_raw_recv(fd, 5000, &eof);
    CHECK(m != NULL);
    CHECK_EQ(m->body_case, SPD__MSG__BODY_ERROR);
    CHECK_EQ(m->error->status, SPC_ERR_LIMIT);
    CHECK_CONTAINS(m->error->detail, "max_arena_bytes");
    sp_msg_free(m);
    CHECK(sp_test_raw_recv(fd, 3000, &eof) == NULL);
    CHECK(eof);
    close(fd);
    CHECK(log_has(d, "refusing pid .*: arena of 1099511627776 bytes exceeds max_arena_bytes"));

    /* Neither holds a place: every one of max_clients is still free. */
    spc_handle_t *hs[MAX_CLIENTS];
    for (int i = 0; i < MAX_CLIENTS; i++)
        hs[i] = sp_test_attach();
    for (int i = 0; i < MAX_CLIENTS; i++)
        spc_detach(hs[i]);
}

int main(void)
{
    sp_test_daemon_t d;
    char max_clients[32], idle[32];
    snprintf(max_clients, sizeof max_clients, "max_clients=%d", MAX_CLIENTS);
    snprintf(idle, sizeof idle, "session_idle_ms=%d", IDLE_MS);
    const char *args[] = { "--set", max_clients, "--set", idle, "--set", "max_arena_bytes=1G", NULL };
    sp_test_daemon_start(&d, args);

    test_refused_hello(&d);
    test_idle_control(&d);
    test_trainer_waits();
    sp_test_daemon_serves();

    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    return 0;
}
