/*
 * Replies a client leaves unread: a control session floods spd with status
 * queries and reads nothing. Past reply_pause_bytes spd stops reading it, so
 * its memory stays flat while others are served, and the client still gets
 * every answer once it reads; past max_reply_bytes (here with the pause at the
 * same size, where the drop comes first) the session is dropped, the reason
 * logged.
 */
#include <errno.h>
#include <poll.h>
#include <sys/socket.h>

#include "sp_test.h"

#define FLOOD_MS 2000

static bool log_has(const sp_test_daemon_t *d, const char *needle)
{
    char out[64];
    return sp_test_run(out, sizeof out, "grep -q '%s' %s", needle, d->log) == 0;
}

/* A buffer of n "status" queries, each frame `*frame_p` bytes. */
static uint8_t *queries(size_t n, size_t *frame_p)
{
    Spd__Msg m = SPD__MSG__INIT;
    Spd__QueryReq q = SPD__QUERY_REQ__INIT;
    q.topic = "status";
    q.arg = "";
    m.seq = 7;
    m.body_case = SPD__MSG__BODY_QUERY_REQ;
    m.query_req = &q;
    uint8_t *one;
    size_t len;
    CHECK_EQ(sp_msg_encode(&m, &one, &len), 0);
    uint8_t *buf = malloc(n * len);
    CHECK(buf != NULL);
    for (size_t i = 0; i < n; i++)
        memcpy(buf + i * len, one, len);
    free(one);
    *frame_p = len;
    return buf;
}

/* Sends from buf for FLOOD_MS without reading, as fast as spd takes it.
 * Returns the bytes sent; *dropped_p says the connection broke. */
static size_t flood(int fd, const uint8_t *buf, size_t len, bool *dropped_p)
{
    size_t sent = 0;
    uint64_t end = sp_test_now_ms() + FLOOD_MS;
    *dropped_p = false;
    while (sent < len && sp_test_now_ms() < end) {
        struct pollfd p = { .fd = fd, .events = POLLOUT };
        if (poll(&p, 1, 50) <= 0)
            continue;
        ssize_t n = send(fd, buf + sent, len - sent, MSG_DONTWAIT | MSG_NOSIGNAL);
        if (n < 0 && (errno == EAGAIN || errno == EINTR))
            continue;
        if (n <= 0) {
            *dropped_p = true;
            break;
        }
        sent += (size_t)n;
    }
    return sent;
}

/* Reads replies (and sends the rest of the last partial frame) until `want`
 * status answers came; returns how many did before EOF or the deadline. */
static size_t read_replies(int fd, const uint8_t *rest, size_t restlen, size_t want, int timeout_ms)
{
    static uint8_t buf[1 << 20];
    size_t len = 0, got = 0;
    uint64_t deadline = sp_test_now_ms() + (uint64_t)timeout_ms;
    while (got < want && sp_test_now_ms() < deadline) {
        struct pollfd p = { .fd = fd, .events = POLLIN | (restlen ? POLLOUT : 0) };
        if (poll(&p, 1, 100) <= 0)
            continue;
        if ((p.revents & POLLOUT) && restlen > 0) {
            ssize_t n = send(fd, rest, restlen, MSG_DONTWAIT | MSG_NOSIGNAL);
            if (n > 0) {
                rest += n;
                restlen -= (size_t)n;
            }
        }
        if (!(p.revents & (POLLIN | POLLHUP | POLLERR)))
            continue;
        ssize_t n = recv(fd, buf + len, sizeof buf - len, MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR))
            break;
        if (n < 0)
            continue;
        len += (size_t)n;
        size_t off = 0;
        sp_frame_t f;
        while (sp_frame_parse(buf + off, len - off, sizeof buf, &f) == SP_FRAME_OK) {
            Spd__Msg *m = sp_msg_decode(&f);
            CHECK(m != NULL);
            CHECK_EQ(m->body_case, SPD__MSG__BODY_QUERY_REP);
            sp_msg_free(m);
            off += f.frame_bytes;
            got++;
        }
        memmove(buf, buf + off, len - off);
        len -= off;
    }
    return got;
}

/* Past reply_pause_bytes: spd stops reading, stays small, answers everything later. */
static void test_pause(void)
{
    sp_test_daemon_t d;
    const char *args[] = { "--set", "reply_pause_bytes=64K", "--set", "session_idle_ms=60000", "--set",
                           "log_level=info", NULL };
    sp_test_daemon_start(&d, args);

    size_t frame, n = 4u << 20;   /* far more than FLOOD_MS lets through when spd stops reading */
    uint8_t *buf = queries(n, &frame);
    int fd = sp_test_raw_connect(d.sock);
    sp_test_raw_hello(fd, SPD__HELLO__ROLE__CONTROL);
    int64_t before = sp_test_proc_kib(d.pid, "VmRSS");
    bool dropped;
    size_t sent = flood(fd, buf, n * frame, &dropped);
    int64_t grown = sp_test_proc_kib(d.pid, "VmRSS") - before;
    fprintf(stderr, "flood: %zu queries sent in %d ms unread; spd grew by %" PRId64 " KiB\n", sent / frame,
            FLOOD_MS, grown);
    CHECK(!dropped);
    CHECK(grown < 16 * 1024);

    /* Others are served meanwhile. */
    spc_handle_t *h = sp_test_attach();
    CHECK_EQ(sp_test_status_int(h, "control_sessions"), 1);
    spc_detach(h);
    sp_test_daemon_serves();

    /* Nothing was lost: every query sent is answered once the client reads. */
    size_t whole = sent / frame, partial = sent % frame;
    size_t want = whole + (partial ? 1 : 0);
    size_t got = read_replies(fd, buf + sent, partial ? frame - partial : 0, want, 30000);
    CHECK_EQ(got, want);
    close(fd);
    free(buf);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
}

/* Past max_reply_bytes: the session is dropped with the reason logged. */
static void test_drop(void)
{
    sp_test_daemon_t d;
    /* A pause above the limit is refused as a configuration that disagrees. */
    const char *args[] = { "--set", "reply_pause_bytes=256K", "--set", "max_reply_bytes=256K", "--set",
                           "log_level=info", NULL };
    sp_test_daemon_start(&d, args);

    size_t frame, n = 4u << 20;
    uint8_t *buf = queries(n, &frame);
    int fd = sp_test_raw_connect(d.sock);
    sp_test_raw_hello(fd, SPD__HELLO__ROLE__CONTROL);
    int64_t before = sp_test_proc_kib(d.pid, "VmRSS");
    bool dropped;
    flood(fd, buf, n * frame, &dropped);
    int64_t grown = sp_test_proc_kib(d.pid, "VmRSS") - before;
    fprintf(stderr, "flood against max_reply_bytes: spd grew by %" PRId64 " KiB\n", grown);
    /* What spd had sent before it gave up is still readable; then EOF. */
    read_replies(fd, NULL, 0, SIZE_MAX, 5000);
    bool eof = false;
    CHECK(sp_test_raw_recv(fd, 5000, &eof) == NULL);
    CHECK(eof);
    CHECK(log_has(&d, "over max_reply_bytes (262144); disconnecting"));
    CHECK(grown < 16 * 1024);
    close(fd);
    free(buf);

    sp_test_daemon_serves();
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
}

int main(void)
{
    test_pause();
    test_drop();
    return 0;
}
