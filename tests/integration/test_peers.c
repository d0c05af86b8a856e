/*
 * Daemons linked over TCP on loopback, each its own node: the links
 * authenticate with the cluster secret and stay up on heartbeats; a stopped
 * peer is marked down when it goes silent and comes back when it wakes; a
 * killed one is marked down at once and a restarted one is taken back; a
 * daemon with the wrong secret, garbage on the port and a silent connection
 * are refused while the daemon keeps serving; two daemons that dial each
 * other keep both links; a secret file others can read,
 * or none at all, stops spd from starting.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "sp_test.h"

/* Long enough that a loaded machine (parallel tests, compilers) does not starve a
 * daemon's loop past it; short enough that SIGSTOP is noticed in a blink. */
#define PEER_TIMEOUT_MS 1500
#define STR(x)  STR_(x)
#define STR_(x) #x

static char dir[64];

/* The JSON record of `node` in `spctl peers` of daemon d; false when absent. */
static bool peer_record(const sp_test_daemon_t *d, const char *node, char *rec, size_t len)
{
    static char out[65536];
    char needle[96];
    if (sp_test_run(out, sizeof out, "%s --socket %s --json peers", sp_test_spctl_bin(), d->sock) != 0)
        return false;
    snprintf(needle, sizeof needle, "\"node\":\"%s\"", node);
    return sp_test_json_record(out, out, needle, rec, len);
}

/* A TCP port nothing listens on now (the kernel's pick, let go again). */
static int free_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = { .sin_family = AF_INET };
    sa.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof sa;
    CHECK(fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    CHECK(getsockname(fd, (struct sockaddr *)&sa, &len) == 0);
    close(fd);
    return ntohs(sa.sin_port);
}

int main(void)
{
    char good[128], bad[128], open_[128], rec[2048], out[8192], why[256];
    snprintf(dir, sizeof dir, "/tmp/spd-peers-XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    sp_test_secret_file(dir, "secret", "correct horse battery staple 42\n", good, sizeof good);
    sp_test_secret_file(dir, "other", "some other cluster's secret 1234\n", bad, sizeof bad);
    sp_test_secret_file(dir, "open", "correct horse battery staple 42\n", open_, sizeof open_);
    CHECK(chmod(open_, 0644) == 0);

    /* A listens; B dials it with the same secret. */
    sp_test_daemon_t a, b, c, b2;
    sp_test_node_start(&a, "node-a", good, "127.0.0.1:0", "", PEER_TIMEOUT_MS);
    int port = sp_test_node_port(&a);
    CHECK(port > 0);
    char peers[64];
    snprintf(peers, sizeof peers, "127.0.0.1:%d", port);
    sp_test_node_start(&b, "node-b", good, "", peers, PEER_TIMEOUT_MS);
    sp_test_peer_wait(&a, "node-b", "up", 10000, rec, sizeof rec);
    sp_test_peer_wait(&b, "node-a", "up", 10000, rec, sizeof rec);
    /* Heartbeats flow: B measures a round trip to A. */
    uint64_t deadline = sp_test_now_ms() + 5000;
    while (peer_record(&b, "node-a", rec, sizeof rec) && sp_test_json_double(rec, "rtt_us") <= 0 &&
           sp_test_now_ms() < deadline)
        usleep(20000);
    CHECK(sp_test_json_double(rec, "rtt_us") > 0);
    sp_test_json_str(rec, "direction", why, sizeof why);
    CHECK_STREQ(why, "out");

    /* C holds another secret: refused at both ends, with the reason; B stays up. */
    sp_test_node_start(&c, "node-c", bad, "", peers, PEER_TIMEOUT_MS);
    sp_test_peer_wait(&c, "node-a", "refused", 10000, rec, sizeof rec);
    sp_test_json_str(rec, "why", why, sizeof why);
    CHECK_CONTAINS(why, "does not hold this cluster's secret");
    sp_test_peer_wait(&a, "node-c", "refused", 10000, rec, sizeof rec);
    sp_test_peer_wait(&a, "node-b", "up", 10000, rec, sizeof rec);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s --json status", sp_test_spctl_bin(), a.sock), 0);
    CHECK(sp_test_json_int(out, "peers_refused") >= 1);
    CHECK_EQ(sp_test_json_int(out, "peers_up"), 1);   /* node-b; the refused node-c is not a peer */
    CHECK_EQ(sp_test_daemon_stop(&c), 0);

    /* Garbage on the peer port is refused at once; a connection that never
     * speaks is closed when authentication times out (5 s). */
    long ms = sp_test_tcp_closed_after(NULL, port, "GET / HTTP/1.0\r\n\r\n", 18, 3000);
    CHECK(ms >= 0);
    ms = sp_test_tcp_closed_after(NULL, port, NULL, 0, 9000);
    CHECK(ms >= 4000);
    sp_test_peer_wait(&a, "node-b", "up", 10000, rec, sizeof rec);
    spc_handle_t *h;
    spc_attach_params_t p = { .struct_size = sizeof p, .socket_path = a.sock };
    CHECK_OK(NULL, spc_attach(&p, &h));                 /* A still serves clients */
    spc_detach(h);

    /* B stopped: silent, so A marks it down after peer_timeout_ms; woken, it is back. */
    CHECK(kill(b.pid, SIGSTOP) == 0);
    sp_test_peer_wait(&a, "node-b", "down", 5000, rec, sizeof rec);
    sp_test_json_str(rec, "why", why, sizeof why);
    CHECK_CONTAINS(why, "nothing heard for " STR(PEER_TIMEOUT_MS) " ms");
    CHECK(kill(b.pid, SIGCONT) == 0);
    sp_test_peer_wait(&a, "node-b", "up", 10000, rec, sizeof rec);

    /* B killed: its link closes, A says so at once; a new B is taken back. */
    CHECK(kill(b.pid, SIGKILL) == 0);
    CHECK_EQ(sp_test_wait(b.pid, 5000), -SIGKILL);
    b.pid = 0;
    sp_test_peer_wait(&a, "node-b", "down", 2000, rec, sizeof rec);
    sp_test_json_str(rec, "why", why, sizeof why);
    CHECK_CONTAINS(why, "closed the link");
    sp_test_node_start(&b2, "node-b", good, "", peers, PEER_TIMEOUT_MS);
    sp_test_peer_wait(&a, "node-b", "up", 10000, rec, sizeof rec);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s peers", sp_test_spctl_bin(), a.sock), 0);
    CHECK_CONTAINS(out, "node-b");
    CHECK(strstr(strstr(out, "node-b") + 1, "node-b") == NULL);   /* one record per node */

    /* Two daemons that each dial the other (every daemon lists the others in
     * `peers`): the dialled and the accepted link between the same two runs
     * are one daemon, so both come up and stay up; neither is a second claimant. */
    int pm = free_port(), pn = free_port();
    char lm[64], ln[64], dm[64], dn[64];
    snprintf(lm, sizeof lm, "127.0.0.1:%d", pm);
    snprintf(ln, sizeof ln, "127.0.0.1:%d", pn);
    sp_test_daemon_t m, n;
    sp_test_node_start(&m, "node-m", good, lm, ln, PEER_TIMEOUT_MS);
    sp_test_node_start(&n, "node-n", good, ln, lm, PEER_TIMEOUT_MS);
    snprintf(dm, sizeof dm, "node-m");
    snprintf(dn, sizeof dn, "node-n");
    for (uint64_t end = sp_test_now_ms() + 10000; sp_test_now_ms() < end;) {
        if (sp_test_peer_links_up(&m, dn) == 2 && sp_test_peer_links_up(&n, dm) == 2)
            break;
        usleep(20000);
    }
    CHECK_EQ(sp_test_peer_links_up(&m, dn), 2);
    CHECK_EQ(sp_test_peer_links_up(&n, dm), 2);
    usleep(300 * 1000);   /* six heartbeats: nothing flaps */
    CHECK_EQ(sp_test_peer_links_up(&m, dn), 2);
    CHECK_EQ(sp_test_peer_links_up(&n, dm), 2);
    CHECK(sp_test_run(out, sizeof out, "grep -c 'claims its name' %s %s", m.log, n.log) != 0);   /* none */
    CHECK_EQ(sp_test_daemon_stop(&m), 0);
    CHECK_EQ(sp_test_daemon_stop(&n), 0);
    sp_test_daemon_cleanup(&m);
    sp_test_daemon_cleanup(&n);

    /* Secrets others can read, and peers without a secret, stop spd at once. */
    CHECK(sp_test_run(out, sizeof out, "%s --set socket=%s/x.sock --set peers=%s --set cluster_secret_file=%s 2>&1",
                      sp_test_spd_bin(), dir, peers, open_) != 0);
    CHECK_CONTAINS(out, "chmod 600");
    CHECK(sp_test_run(out, sizeof out, "%s --set socket=%s/y.sock --set peer_listen=127.0.0.1:0 2>&1",
                      sp_test_spd_bin(), dir) != 0);
    CHECK_CONTAINS(out, "need cluster_secret_file");

    CHECK_EQ(sp_test_daemon_stop(&b2), 0);
    CHECK_EQ(sp_test_daemon_stop(&a), 0);
    sp_test_daemon_cleanup(&b2);
    sp_test_daemon_cleanup(&c);
    sp_test_daemon_cleanup(&b);
    sp_test_daemon_cleanup(&a);
    sp_test_run(out, sizeof out, "rm -rf %s", dir);
    return 0;
}
