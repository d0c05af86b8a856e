/* Attaching: defaults and parameters, control-only handles, the no-op round trip,
 * and the refusals (no daemon, bad params, wrong protocol, limits). */
#include <signal.h>
#include <unistd.h>

#include "sp_test.h"

static void test_no_daemon(void)
{
    spc_attach_params_t p = { .struct_size = sizeof p, .socket_path = "/tmp/spd-no-such-dir/spd.sock" };
    spc_handle_t *h = (spc_handle_t *)0x1;
    CHECK_ST(NULL, spc_attach(&p, &h), SPC_ERR_CONNECT);
    CHECK(h == (spc_handle_t *)0x1);                     /* untouched on failure */
    CHECK_CONTAINS(spc_last_error(NULL), "/tmp/spd-no-such-dir/spd.sock");
    p.struct_size = sizeof p + 64;
    CHECK_ST(NULL, spc_attach(&p, &h), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(NULL), "struct_size");
}

static void test_attach_basics(const sp_test_daemon_t *d)
{
    spc_attach_params_t p = { .struct_size = sizeof p, .name = "attach-test", .arena_bytes = 4 << 20,
                              .sq_entries = 20 };
    spc_handle_t *h;
    CHECK_OK(NULL, spc_attach(&p, &h));
    CHECK_STREQ(spc_socket_path(h), d->sock);
    CHECK_EQ(spc_daemon_pid(h), d->pid);
    uint64_t size, used;
    spc_arena_usage(h, &size, &used);
    CHECK_EQ(size, 4 << 20);
    CHECK_EQ(used, 0);

    /* The no-op round trip, many times, and a burst in flight at once. */
    for (int i = 0; i < 10000; i++)
        CHECK_OK(h, spc_noop(h, 5000));
    spc_request_t *reqs[32];   /* sq_entries 20 rounds up to 32 */
    for (int i = 0; i < 32; i++)
        CHECK_OK(h, spc_inoop(h, &reqs[i]));
    for (int i = 31; i >= 0; i--) {
        CHECK_OK(h, spc_wait(reqs[i], 5000));
        CHECK_OK(h, spc_wait(reqs[i], 0));          /* the final status is repeatable */
        spc_request_release(reqs[i]);
    }
    CHECK_EQ(spc_inflight(h), 0);

    /* A request released before it completes is reclaimed when it does. Every
     * 16th is waited for, which keeps the submission ring from filling. */
    for (int round = 0; round < 200; round++) {
        spc_request_t *r;
        CHECK_OK(h, spc_inoop(h, &r));
        if (round % 16 == 15)
            CHECK_OK(h, spc_wait(r, 5000));
        spc_request_release(r);
    }
    CHECK_OK(h, spc_noop(h, 5000));
    CHECK_EQ(spc_inflight(h), 0);

    /* Arena allocations come back when freed. */
    void *a = spc_alloc(h, 3 << 20);
    CHECK(a != NULL);
    CHECK(spc_alloc(h, 2 << 20) == NULL);
    CHECK_CONTAINS(spc_last_error(h), "arena full");
    spc_free(h, a);
    CHECK(spc_alloc(h, 4 << 20) != NULL);
    spc_detach(h);
    spc_detach(NULL);
}

static void test_control_only(void)
{
    spc_attach_params_t p = { .struct_size = sizeof p, .flags = SPC_ATTACH_CONTROL_ONLY };
    spc_handle_t *h;
    spc_request_t *r;
    CHECK_OK(NULL, spc_attach(&p, &h));
    CHECK_ST(h, spc_inoop(h, &r), SPC_ERR_INVALID_ARG);
    CHECK(spc_alloc(h, 64) == NULL);
    spc_query_result_t *q;
    CHECK_OK(h, spc_query(h, "status", NULL, &q));
    CHECK_EQ(spc_query_records(q), 1);
    long f = spc_query_find(q, 0, "version");
    CHECK(f >= 0);
    CHECK_STREQ(spc_query_str(q, 0, (size_t)f), spc_daemon_version(h));
    spc_query_free(q);
    CHECK_ST(h, spc_query(h, "nonsense", NULL, &q), SPC_ERR_NOT_FOUND);
    CHECK_CONTAINS(spc_last_error(h), "unknown topic");
    spc_detach(h);
}

static void test_limits(const sp_test_daemon_t *d)
{
    /* An arena over max_arena_bytes is refused with the reason. */
    spc_attach_params_t p = { .struct_size = sizeof p, .arena_bytes = 1ull << 50 };
    spc_handle_t *h;
    CHECK_ST(NULL, spc_attach(&p, &h), SPC_ERR_LIMIT);
    CHECK_CONTAINS(spc_last_error(NULL), "max_arena_bytes");

    /* A client speaking another protocol version hears why. */
    int fd = sp_test_raw_connect(d->sock);
    Spd__Msg m = SPD__MSG__INIT;
    Spd__Hello hello = SPD__HELLO__INIT;
    hello.protocol = 99;
    m.seq = 1;
    m.body_case = SPD__MSG__BODY_HELLO;
    m.hello = &hello;
    sp_test_raw_send_msg(fd, &m);
    Spd__Msg *r = sp_test_raw_recv(fd, 5000, NULL);
    CHECK(r != NULL && r->body_case == SPD__MSG__BODY_ERROR);
    CHECK_EQ(r->error->status, SPC_ERR_PROTOCOL);
    CHECK_CONTAINS(r->error->detail, "client speaks protocol 99");
    sp_msg_free(r);
    bool eof;
    CHECK(sp_test_raw_recv(fd, 5000, &eof) == NULL && eof);
    close(fd);
}

/* max_clients: the one over the limit is refused with the reason, the others go on. */
static void test_max_clients(void)
{
    sp_test_daemon_t d;
    const char *args[] = { "--set", "max_clients=2", NULL };
    sp_test_daemon_start(&d, args);
    spc_handle_t *a = sp_test_attach(), *b = sp_test_attach(), *c;
    CHECK_ST(NULL, spc_attach(NULL, &c), SPC_ERR_LIMIT);
    CHECK_CONTAINS(spc_last_error(NULL), "max_clients");
    CHECK_OK(a, spc_noop(a, 5000));
    spc_detach(b);
    /* The slot is free again once the daemon has seen b go: retry until it has. */
    spc_status_t st = SPC_ERR_LIMIT;
    for (uint64_t end = sp_test_now_ms() + 5000; st == SPC_ERR_LIMIT && sp_test_now_ms() < end;)
        st = spc_attach(NULL, &c);
    CHECK_OK(NULL, st);
    CHECK_OK(c, spc_noop(c, 5000));
    spc_detach(c);
    spc_detach(a);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
}

/* A client that attaches while the progress thread sleeps is heard at once: its
 * first submission wakes it. With a 10 s idle sleep, a lost wake-up
 * would leave the no-op waiting out the sleep and this 3 s wait would fail. */
static void test_wake_after_attach_while_asleep(void)
{
    sp_test_daemon_t d;
    const char *args[] = { "--set", "progress_sleep_ms=10000", NULL };
    sp_test_daemon_start(&d, args);
    for (int i = 0; i < 3; i++) {
        spc_handle_t *h = sp_test_attach();
        CHECK_OK(h, spc_noop(h, 3000));
        spc_detach(h);
    }
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
}

int main(void)
{
    sp_test_daemon_t d;
    test_no_daemon();
    sp_test_daemon_start(&d, NULL);
    test_attach_basics(&d);
    test_control_only();
    test_limits(&d);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    test_max_clients();
    test_wake_after_attach_while_asleep();
    printf("attach: ok\n");
    return 0;
}
