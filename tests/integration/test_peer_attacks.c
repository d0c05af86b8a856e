/*
 * Attacks on the links between daemons, performed against real daemons on
 * loopback, each of which must fail with a logged refusal while the daemons
 * keep serving:
 *
 *   relay      a host without the secret dials two daemons and relays each
 *              one's frames to the other, so that each signs for it;
 *   claimant   a second daemon under a node name that is already linked;
 *   big frame  a stranger announces a 1 MiB frame before authenticating;
 *   flood      connections from one address beyond peer_max_pending_per_addr,
 *              and, under a low RLIMIT_NOFILE, beyond fd_reserve;
 *   forgery    a member of the cluster (it holds the secret) sends data-path
 *              messages in another node's name, and messages numbered far
 *              ahead in its own;
 *   names      a member answers a daemon's question about a named job's home
 *              with lies: another round, another uid, a home no job can be,
 *              a second answer, unasked news of a home; asks about a
 *              malformed name; and forwards
 *              joins of a named job in another uid's name, or another launch's.
 */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <sodium.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <ucp/api/ucp.h>

#include "cluster/net_wire.h"
#include "cluster/peer.h"
#include "sp_frame.h"
#include "sp_test.h"
#include "sp_test_peer.h"

#define SECRET      "the test cluster's shared secret"   /* sp_test_start's, as spd reads it */
#define NET_AM_ID   1

static char rec[4096], out[65536];

/* ================================================================ relay */

/*
 * Dials both daemons and relays every frame of one to the other for a while:
 * each daemon talks to the other through a host that has no secret. Nothing
 * either daemon sends may let it in: no link of it comes up, and neither says
 * where its data goes.
 */
static void attack_relay(const sp_test_daemon_t *a, int port_a, const sp_test_daemon_t *b, int port_b)
{
    static sp_test_frames_t sa, sb;
    static uint8_t frame[1 << 16];
    size_t flen;
    sa = (sp_test_frames_t){ .fd = sp_test_tcp_connect(NULL, port_a) };
    sb = (sp_test_frames_t){ .fd = sp_test_tcp_connect(NULL, port_b) };
    int proofs = 0, addresses = 0;
    for (uint64_t end = sp_test_now_ms() + 1500; sp_test_now_ms() < end;) {
        sp_test_frames_t *pair[2][2] = { { &sa, &sb }, { &sb, &sa } };
        for (int k = 0; k < 2; k++) {
            Spd__Msg *m = sp_test_next_frame(pair[k][0], 20, frame, &flen);
            if (m == NULL)
                continue;
            if (m->body_case == SPD__MSG__BODY_PEER_HELLO && m->peer_hello->base.n_unknown_fields > 0)
                addresses++;   /* an older spd put its UCP worker address here */
            if (m->body_case == SPD__MSG__BODY_PEER_AUTH) {
                proofs++;
                addresses += m->peer_auth->ucx_address.len > 0;
            }
            sp_msg_free(m);
            if (!pair[k][1]->eof)
                (void)!write(pair[k][1]->fd, frame, flen);
        }
    }
    CHECK_EQ(proofs, 0);      /* both are acceptors here: neither signs before the dialer does */
    CHECK_EQ(addresses, 0);
    /* Neither took the other's name through the relay: each has one link up
     * to the other, the real one. */
    CHECK_EQ(sp_test_peer_links_up(a, "node-1"), 1);
    CHECK_EQ(sp_test_peer_links_up(b, "node-0"), 1);
    close(sa.fd);
    close(sb.fd);
    printf("relay: no proof and no address went to the relay; no link came up through it\n");
}

/* ================================================================ an insider's link */

/* Sends one active message as a daemon would, and waits until it is gone. */
static void insider_send(sp_test_insider_t *x, const sp_wire_hdr_t *h, const void *payload, size_t len)
{
    ucp_request_param_t p = { .op_attr_mask = 0 };
    void *req = ucp_am_send_nbx(x->ep, NET_AM_ID, h, sizeof *h, payload, len, &p);
    CHECK(!UCS_PTR_IS_ERR(req));
    if (req != NULL) {
        uint64_t end = sp_test_now_ms() + 10000;
        while (ucp_request_check_status(req) == UCS_INPROGRESS && sp_test_now_ms() < end)
            ucp_worker_progress(x->worker);
        CHECK(ucp_request_check_status(req) != UCS_INPROGRESS);
        ucp_request_free(req);
    }
    for (int i = 0; i < 1000; i++)
        ucp_worker_progress(x->worker);
}

static sp_wire_hdr_t wire_hdr(const char *from, uint64_t incarnation, uint64_t msgno)
{
    sp_wire_hdr_t h;
    memset(&h, 0, sizeof h);
    h.magic = SP_WIRE_MAGIC;
    h.kind = SP_WIRE_RANK_LOST;
    snprintf(h.from, sizeof h.from, "%s", from);
    snprintf(h.job, sizeof h.job, "no-such-job");
    h.incarnation = incarnation;
    h.msgno = msgno;
    h.rank = 0;
    return h;
}

/* ================================================================ a job across the two nodes */

#define AR_COUNT 4096

static int allreduce_rank(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    (void)arg;
    float *x = spc_alloc(h, AR_COUNT * sizeof *x);
    CHECK(x != NULL);
    for (int i = 0; i < AR_COUNT; i++)
        x[i] = (float)(rank + 1) * (float)(i % 97);
    CHECK_OK(h, spc_allreduce(h, world, x, x, AR_COUNT, SPC_F32, SPC_SUM, 10000));
    float want = 0;
    for (int r = 0; r < nranks; r++)
        want += (float)(r + 1);
    for (int i = 0; i < AR_COUNT; i++)
        CHECK(x[i] == want * (float)(i % 97));
    spc_free(h, x);
    return 0;
}

static void attack_forgery(const sp_test_daemon_t *d0, int port0)
{
    sp_test_insider_t x = { 0 };
    sp_test_insider_link(&x, SECRET, "node-x", port0);
    sp_test_peer_wait(d0, "node-x", "up", 10000, rec, sizeof rec);

    /* In node-1's name, under a run of node-1's that never was: on a data
     * path that believes its headers, this empties node-1's inbox and every
     * later op across the two nodes waits for messages it will never take. */
    uint8_t key[SP_PEER_KEY_BYTES];
    sp_wire_hdr_t h = wire_hdr("node-1", 0x5eedull, 0);
    sp_peer_data_key((const uint8_t *)SECRET, strlen(SECRET), "node-x", x.incarnation, "node-0",
                     x.their_incarnation, key);
    sp_net_header_seal(&h, 4, key);   /* the best it can do: its own key */
    insider_send(&x, &h, "lost", 4);
    /* Without any MAC, 200 numbered far ahead, each claiming 1 MiB. */
    static uint8_t mib[1 << 20];
    for (uint64_t k = 0; k < 200; k++) {
        h = wire_hdr("node-1", 0x5eedull, 1000000 + k);
        insider_send(&x, &h, mib, sizeof mib);
    }
    spc_handle_t *hd = sp_test_attach();
    uint64_t end = sp_test_now_ms() + 5000;
    while (sp_test_status_int(hd, "peer_messages_dropped") < 201 && sp_test_now_ms() < end)
        usleep(20000);
    CHECK(sp_test_status_int(hd, "peer_messages_dropped") >= 201);
    /* node-1's stream goes on untouched. */
    sp_test_run_job(2, allreduce_rank, NULL);
    printf("forgery: 201 messages in node-1's name dropped; a job across node-0 and node-1 still runs\n");

    /* In its own name, sealed right, but numbered far past the window: its
     * link is dropped, saying why. */
    h = wire_hdr("node-x", x.incarnation, 1u << 30);
    sp_net_header_seal(&h, 4, key);
    insider_send(&x, &h, "lost", 4);
    sp_test_peer_wait(d0, "node-x", "down", 10000, rec, sizeof rec);
    char why[256];
    sp_test_json_str(rec, "why", why, sizeof why);
    CHECK_CONTAINS(why, "peer_inbox_msgs");
    sp_test_run_job(2, allreduce_rank, NULL);
    printf("overrun: node-x's link dropped (%s); node-0 and node-1 still run jobs\n", why);
    spc_detach(hd);

    sp_test_insider_close(&x);
}

/* ================================================================ named jobs: lies about a name's home */

/* A rank of job "hostile" joins on node-0 while no daemon is its home: the
 * lies node-y tells about that name must not move it, refuse it or make it a
 * job; it waits, then times out saying no daemon is the home. */
static int hostile_rank(void *arg)
{
    (void)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_ST(h, spc_job_join_named(h, "hostile", "", 2, 1, 3000, &world), SPC_ERR_TIMEOUT);
    CHECK_CONTAINS(spc_last_error(h), "no daemon is the home of job");
    spc_detach(h);
    return 0;
}

/* The next frame of a kind from node-y's link, others (heartbeats) skipped. */
static Spd__Msg *next_of(sp_test_insider_t *x, Spd__Msg__BodyCase kind)
{
    static uint8_t frame[1 << 16];
    size_t flen;
    uint64_t end = sp_test_now_ms() + 5000;
    for (;;) {
        Spd__Msg *m = sp_test_next_frame(&x->s, 200, frame, &flen);
        if (m != NULL && m->body_case == kind)
            return m;
        if (m != NULL)
            sp_msg_free(m);
        CHECK(sp_test_now_ms() < end);
    }
}

static void send_name_rep(sp_test_insider_t *x, uint64_t round, uint32_t uid, const char *name, const char *launch,
                          uint32_t world, uint32_t joined)
{
    Spd__Msg m = SPD__MSG__INIT;
    Spd__PeerNameRep rep = SPD__PEER_NAME_REP__INIT;
    rep.round = round;
    rep.uid = uid;
    rep.name = (char *)name;
    rep.held = true;
    rep.launch = (char *)launch;
    rep.world_size = world;
    rep.joined = joined;
    m.body_case = SPD__MSG__BODY_PEER_NAME_REP;
    m.peer_name_rep = &rep;
    sp_test_send_msg(x->s.fd, &m, NULL, NULL);
}

static void send_name_query(sp_test_insider_t *x, uint64_t round, const char *name)
{
    Spd__Msg m = SPD__MSG__INIT;
    Spd__PeerNameQuery q = SPD__PEER_NAME_QUERY__INIT;
    q.round = round;
    q.uid = (uint32_t)getuid();
    q.name = (char *)name;
    m.body_case = SPD__MSG__BODY_PEER_NAME_QUERY;
    m.peer_name_query = &q;
    sp_test_send_msg(x->s.fd, &m, NULL, NULL);
}

/* Rank 0 of job "guarded" (launch g1) waits alone on node-0, its home. */
static int guarded_rank(void *arg)
{
    (void)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_ST(h, spc_job_join_named(h, "guarded", "g1", 2, 0, 4000, &world), SPC_ERR_TIMEOUT);
    CHECK_CONTAINS(spc_last_error(h), "ranks 1 (1 of 2) have not joined job");
    spc_detach(h);
    return 0;
}

/* node-y forwards a join of job id to its home, as a daemon forwards its rank's. */
static const Spd__PeerJoinRep *forged_join(sp_test_insider_t *x, const char *id, uint32_t uid, const char *launch,
                                           Spd__Msg **rep_p)
{
    Spd__Msg m = SPD__MSG__INIT;
    Spd__PeerJoin j = SPD__PEER_JOIN__INIT;
    j.job_id = (char *)id;
    j.world_size = 2;
    j.rank = 1;
    j.pid = 4242;
    j.uid = uid;
    j.launch = (char *)launch;
    m.body_case = SPD__MSG__BODY_PEER_JOIN;
    m.peer_join = &j;
    sp_test_send_msg(x->s.fd, &m, NULL, NULL);
    *rep_p = next_of(x, SPD__MSG__BODY_PEER_JOIN_REP);
    CHECK_STREQ((*rep_p)->peer_join_rep->job_id, id);
    return (*rep_p)->peer_join_rep;
}

/* The home of a named job checks what a forwarded join claims: the uid must
 * be the job's owner's, the launch the job's. */
static void attack_forged_joins(sp_test_insider_t *x)
{
    char id[SPC_JOB_ID_MAX];
    snprintf(id, sizeof id, "%u/guarded", (unsigned)getuid());
    pid_t rank0 = sp_test_fork(guarded_rank, NULL);
    spc_handle_t *obs = sp_test_attach();
    CHECK(sp_test_wait_job_joined(obs, id, 1, 10000));
    Spd__Msg *m;
    const Spd__PeerJoinRep *rep = forged_join(x, id, (uint32_t)getuid() + 60001, "g1", &m);
    CHECK_EQ(rep->status, SPC_ERR_PERMISSION);
    CHECK_CONTAINS(rep->detail, "belongs to uid");
    sp_msg_free(m);
    rep = forged_join(x, id, (uint32_t)getuid(), "g2", &m);
    CHECK_EQ(rep->status, SPC_ERR_BUSY);
    CHECK_CONTAINS(rep->detail, "is held by another launch (g1, 1 of 2 ranks joined");
    sp_msg_free(m);
    CHECK(sp_test_wait_job_joined(obs, id, 1, 0));   /* neither took rank 1 */
    spc_detach(obs);
    CHECK_EQ(sp_test_wait(rank0, 10000), 0);
}

static void attack_names(const sp_test_daemon_t *d0, int port0)
{
    sp_test_insider_t x = { 0 };
    sp_test_insider_link(&x, SECRET, "node-y", port0);
    sp_test_peer_wait(d0, "node-y", "up", 10000, rec, sizeof rec);
    setenv("SPC_SOCKET", d0->sock, 1);
    pid_t rank = sp_test_fork(hostile_rank, NULL);

    Spd__Msg *q = next_of(&x, SPD__MSG__BODY_PEER_NAME_QUERY);
    uint64_t round = q->peer_name_query->round;
    uint32_t uid = q->peer_name_query->uid;
    CHECK_EQ(uid, (uint32_t)getuid());
    CHECK_STREQ(q->peer_name_query->name, "hostile");
    sp_msg_free(q);
    /* A round nobody asked, another uid's name, then a home that no job can be
     * (a launch with a space, more ranks joined than it has), then a second
     * answer to the same round that would take the rank elsewhere. */
    send_name_rep(&x, round + 1000, uid, "hostile", "", 2, 1);
    send_name_rep(&x, round, uid + 1, "hostile", "", 2, 1);
    send_name_rep(&x, round, uid, "hostile", "run 1", 2, 5);
    send_name_rep(&x, round, uid, "hostile", "", 2, 1);
    /* Unasked, that it just became the home: of a malformed name (left out),
     * and of this one, which only makes node-0 ask again. */
    send_name_rep(&x, 0, uid, "../etc", "", 2, 1);
    send_name_rep(&x, 0, uid, "hostile", "", 2, 1);
    /* Its own questions: a malformed name goes unanswered, a good one is
     * answered for what node-0 holds, which is no home of that name. */
    send_name_query(&x, 41, "../etc");
    send_name_query(&x, 42, "hostile");
    Spd__Msg *a = next_of(&x, SPD__MSG__BODY_PEER_NAME_REP);
    CHECK_EQ(a->peer_name_rep->round, 42u);
    CHECK(!a->peer_name_rep->held);
    sp_msg_free(a);
    CHECK_EQ(sp_test_wait(rank, 10000), 0);

    CHECK_EQ(sp_test_run(out, sizeof out, "cat %s", d0->log), 0);
    CHECK_CONTAINS(out, "node node-y: an answer to name round");
    CHECK_CONTAINS(out, "which no job can be: taken as not holding it");
    CHECK_CONTAINS(out, "node node-y: asks where a job lives by a name that");
    CHECK_CONTAINS(out, "node node-y: says it became the home of a job whose name");
    attack_forged_joins(&x);
    sp_test_run_job(2, allreduce_rank, NULL);
    printf("names: lies about job hostile's home left out, its rank timed out waiting; joins of job guarded "
           "forwarded for another uid or launch refused by its home; node-0 still runs jobs\n");

    sp_test_insider_close(&x);
}

/* ================================================================ strangers */

static void attack_big_frame(int port)
{
    uint8_t hdr[SP_FRAME_HDR_BYTES] = { 'S', 'P', SP_WIRE_VERSION, 0, 0, 0, 0x10, 0 };   /* 1 MiB */
    long ms = sp_test_tcp_closed_after(NULL, port, hdr, sizeof hdr, 4000);
    CHECK(ms >= 0 && ms < 2000);
    printf("big frame: a 1 MiB frame before authentication closed after %ld ms\n", ms);
}

/* Opens n connections from from_ip and returns how many the daemon closed
 * within a second; the rest stay open in fds. */
static int flood(const char *from_ip, int port, int n, int *fds)
{
    for (int i = 0; i < n; i++) {
        fds[i] = sp_test_tcp_connect(from_ip, port);
        CHECK(fcntl(fds[i], F_SETFL, O_NONBLOCK) == 0);
    }
    int closed = 0;
    uint64_t end = sp_test_now_ms() + 1000;
    while (sp_test_now_ms() < end) {
        for (int i = 0; i < n; i++) {
            struct pollfd p = { .fd = fds[i], .events = POLLIN };
            char buf[4096];
            if (fds[i] < 0 || poll(&p, 1, 0) != 1)
                continue;
            ssize_t r;
            while ((r = read(fds[i], buf, sizeof buf)) > 0) {}   /* a hello, then EOF */
            if (r == 0 || (r < 0 && errno != EAGAIN)) {
                close(fds[i]);
                fds[i] = -1;
                closed++;
            }
        }
        usleep(10000);
    }
    return closed;
}

static void unflood(int *fds, int n)
{
    for (int i = 0; i < n; i++)
        if (fds[i] >= 0)
            close(fds[i]);
}

int main(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    CHECK(sodium_init() >= 0);
    sp_test_daemon_t d0;
    char *args[] = { "test", "--nodes", "2", NULL };
    CHECK_EQ(sp_test_start(&d0, 3, args), 2);
    int port0 = sp_test_node_port(&d0);
    const sp_test_daemon_t *d1 = sp_test_cluster_daemon(1);
    int port1 = sp_test_node_port(d1);
    sp_test_run_job(2, allreduce_rank, NULL);

    attack_relay(&d0, port0, d1, port1);
    attack_forgery(&d0, port0);
    attack_names(&d0, port0);
    attack_big_frame(port0);

    /* A second daemon named node-1, holding the secret, dials node-0 while
     * the first is up: refused, and the first is kept. */
    sp_test_daemon_t twin;
    char peers[64];
    snprintf(peers, sizeof peers, "127.0.0.1:%d", port0);
    sp_test_node_start(&twin, "node-1", sp_test_cluster_secret(), "", peers, 10000);
    setenv("SPC_SOCKET", d0.sock, 1);   /* the jobs stay on node-0 */
    sp_test_peer_wait(&twin, "node-0", "refused", 10000, rec, sizeof rec);
    char why[256];
    sp_test_json_str(rec, "why", why, sizeof why);
    CHECK_CONTAINS(why, "a second daemon claims its name");
    CHECK_EQ(sp_test_peer_links_up(&d0, "node-1"), 1);
    CHECK_EQ(sp_test_daemon_stop(&twin), 0);
    sp_test_daemon_cleanup(&twin);
    sp_test_run_job(2, allreduce_rank, NULL);
    printf("claimant: a second node-1 refused (%s); the first kept\n", why);

    /* Strangers from one address: peer_max_pending_per_addr (8) authenticate
     * at once, the rest are closed at accept, costing spd next to nothing. */
    enum { FLOOD = 300 };
    static int fds[FLOOD];
    int64_t rss0 = sp_test_proc_kib(d0.pid, "VmRSS");
    int closed = flood("127.0.0.2", port0, FLOOD, fds);
    int64_t grew = sp_test_proc_kib(d0.pid, "VmRSS") - rss0;
    CHECK(closed >= FLOOD - 8);   /* all of them when connecting took longer than the 5 s authentication window */
    CHECK(grew < 16 * 1024);
    spc_handle_t *h = sp_test_attach();
    CHECK(sp_test_status_int(h, "peers_closed_at_accept") >= FLOOD - 8);
    spc_detach(h);
    sp_test_run_job(2, allreduce_rank, NULL);   /* node-1 (from 127.0.0.1) keeps its link */
    unflood(fds, FLOOD);
    printf("flood: %d of %d connections from 127.0.0.2 closed at accept; spd grew %" PRId64 " KiB\n", closed,
           FLOOD, grew);

    /* Under RLIMIT_NOFILE 256, with the pending caps out of the way, strangers
     * take descriptors only down to fd_reserve (64): clients still attach. */
    struct rlimit old, low;
    CHECK(getrlimit(RLIMIT_NOFILE, &old) == 0);
    low = old;
    low.rlim_cur = 256;
    CHECK(setrlimit(RLIMIT_NOFILE, &low) == 0);
    setenv("SPD_PEER_MAX_PENDING", "10000", 1);
    setenv("SPD_PEER_MAX_PENDING_PER_ADDR", "10000", 1);
    sp_test_daemon_t lone;
    sp_test_node_start(&lone, "node-lone", sp_test_cluster_secret(), "127.0.0.1:0", "", 10000);
    setenv("SPC_SOCKET", d0.sock, 1);
    unsetenv("SPD_PEER_MAX_PENDING");
    unsetenv("SPD_PEER_MAX_PENDING_PER_ADDR");
    CHECK(setrlimit(RLIMIT_NOFILE, &old) == 0);
    flood("127.0.0.2", sp_test_node_port(&lone), FLOOD, fds);
    /* Counted by spd: links that time out authenticating (a slow machine) are not among them. */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s --json status", sp_test_spctl_bin(), lone.sock), 0);
    closed = (int)sp_test_json_int(out, "peers_closed_at_accept");
    CHECK(closed > 0 && closed < FLOOD - 100);   /* the reserve, not a cap, stopped them */
    spc_attach_params_t p = { .struct_size = sizeof p, .socket_path = lone.sock };
    CHECK_OK(NULL, spc_attach(&p, &h));
    spc_detach(h);
    unflood(fds, FLOOD);
    CHECK_EQ(sp_test_daemon_stop(&lone), 0);
    sp_test_daemon_cleanup(&lone);
    printf("descriptors: %d of %d connections closed at accept under RLIMIT_NOFILE 256; spctl and clients "
           "still attach\n", closed, FLOOD);

    CHECK_EQ(sp_test_daemon_stop(&d0), 0);
    CHECK_EQ(sp_test_cluster_stop(), 0);
    sp_test_daemon_cleanup(&d0);
    printf("ok\n");
    return 0;
}
