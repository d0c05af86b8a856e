/*
 * Mixed versions: clients and spd each speak a range of protocols and take
 * the highest both speak (proto/sp_msg.h).
 *
 *   - A hello of the previous wire (protocol 1 alone, as libraries from
 *     before ranges send it) gets protocol 1 and the segment layout 4 that
 *     such a library checks for, and a no-op written into that layout's
 *     rings, byte by byte as such a library did, completes; one that offers
 *     nothing spd speaks is refused with both ranges named, and counted.
 *   - Ranks that speak only protocol 1 (SPC_PROTOCOL_MAX=1: every op written
 *     in layout 4's 1 KiB argument slots), alone and beside ranks of today's
 *     protocol in the same job, run all-reduces and 4-tensor all-to-alls
 *     whose every element is checked against a reference computed here; a
 *     5-tensor all-to-all, which protocol 1 cannot carry, is refused before
 *     it leaves the client, saying why.
 *   - The reverse: today's library against an spd that serves protocol 1
 *     only (protocol_max 1) speaks protocol 1 and gets the same results; and
 *     against an spd from before ranges that gave layout 5 under protocol 1
 *     (played here by the test) it takes the layout the header names.
 *   - spctl status, spctl clients and the metrics (spd_info,
 *     spd_sessions_by_protocol) say what is served and what each chose.
 *   - Daemons: a PeerHello names a range too. One of peer protocol 2 alone
 *     (whose data path spd no longer serves) is refused naming both ranges;
 *     one whose range reaches past spd's is taken at spd's highest; two
 *     daemons on loopback link at it, and spctl peers says so.
 */
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "sp_test.h"

#include "sp_msg.h"
#include "sp_shm.h"

#define T       4      /* tensors of the all-to-all: protocol 1's most */
#define H       2      /* heads per tensor */
#define D       3
#define S       4      /* global rows; 2 per rank */
#define P       2
#define SLOC    (S / P)

static char out[65536];

/* The send element of rank r, tensor t, local row s, head h, dim d: distinct and exact in fp32. */
static float send_value(int r, int t, int s, int h, int d)
{
    return (float)(r * 1000 + t * 100 + s * 10 + h * 3 + d);
}

/* One rank: all-reduces, then a 4-tensor seq->head all-to-all, each checked;
 * with old_wire, the 5-tensor one that its protocol cannot carry. */
static int rank_ops(spc_handle_t *h, spc_group_t world, int rank, bool old_wire)
{
    float *x = spc_alloc(h, 64 * sizeof *x);
    CHECK(x != NULL);
    for (int i = 0; i < 64; i++)
        x[i] = (float)(rank * 64 + i);
    CHECK_OK(h, spc_allreduce(h, world, x, x, 64, SPC_F32, SPC_SUM, 10000));
    for (int i = 0; i < 64; i++)
        CHECK_EQ(x[i], (float)(64 + 2 * i));   /* rank 0's i plus rank 1's 64 + i */

    spc_alltoall_desc_t d = SPC_ALLTOALL_DESC_INIT;
    d.group = world;
    d.dtype = SPC_F32;
    d.direction = SPC_SEQ_TO_HEAD;
    d.layout = SPC_LAYOUT_BSHD;
    d.batch = 1;
    d.seq_len = S;
    d.ntensors = T;
    float *send[T + 1], *recv[T + 1];
    for (int t = 0; t <= T; t++) {
        send[t] = spc_alloc(h, SLOC * H * D * sizeof(float));
        recv[t] = spc_alloc(h, S * (H / P) * D * sizeof(float));
        CHECK(send[t] != NULL && recv[t] != NULL);
        for (int s = 0; s < SLOC; s++)
            for (int hh = 0; hh < H; hh++)
                for (int dd = 0; dd < D; dd++)
                    send[t][(s * H + hh) * D + dd] = send_value(rank, t, s, hh, dd);
        memset(recv[t], 0xff, S * (H / P) * D * sizeof(float));
        spc_a2a_tensor_t *a = t < 4 ? &d.tensors[t] : &d.more_tensors[t - 4];
        *a = (spc_a2a_tensor_t){ .send = send[t], .recv = recv[t], .heads = H, .head_dim = D, .kind = SPC_HEADS_Q };
    }
    CHECK_OK(h, spc_alltoall(h, &d, 10000));
    /* Rank p holds head p of every global row; row g came from rank g / SLOC's local row g % SLOC. */
    for (int t = 0; t < T; t++)
        for (int g = 0; g < S; g++)
            for (int dd = 0; dd < D; dd++)
                CHECK_EQ(recv[t][g * D + dd], send_value(g / SLOC, t, g % SLOC, rank, dd));
    if (old_wire) {
        d.ntensors = T + 1;
        CHECK_ST(h, spc_alltoall(h, &d, 10000), SPC_ERR_INVALID_ARG);
        CHECK_CONTAINS(spc_last_error(h), "(protocol 1, layout 4) holds 8 per op");
    }
    CHECK_OK(h, spc_barrier(h, world, 10000));
    return 0;
}

/* A rank of job `shared->job` that speaks up to protocol `max` (0: all of today's). */
typedef struct ranks {
    char job[SPC_JOB_ID_MAX];
    int  max[P];
    int  chose[P];
} ranks_t;
static ranks_t *shared;

static int rank_main(void *arg)
{
    int rank = (int)(intptr_t)arg;
    if (shared->max[rank] != 0) {
        char v[8];
        snprintf(v, sizeof v, "%d", shared->max[rank]);
        setenv("SPC_PROTOCOL_MAX", v, 1);
    } else {
        unsetenv("SPC_PROTOCOL_MAX");
    }
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, shared->job, P, (uint32_t)rank, 10000, &world));
    /* What spd says this client chose. */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json clients", sp_test_spctl_bin()), 0);
    char needle[32], rec[2048];
    snprintf(needle, sizeof needle, "\"pid\":%d,", (int)getpid());
    CHECK(sp_test_json_record(out, out, needle, rec, sizeof rec));
    shared->chose[rank] = (int)sp_test_json_int(rec, "protocol");
    int rc = rank_ops(h, world, rank, shared->chose[rank] == 1);
    spc_detach(h);
    return rc;
}

/* One job of P ranks speaking up to max0 and max1; returns when both are done. */
static void run_job(int max0, int max1)
{
    spc_handle_t *creator = sp_test_attach();
    CHECK_OK(creator, spc_job_create(creator, shared->job, sizeof shared->job));
    shared->max[0] = max0;
    shared->max[1] = max1;
    pid_t pids[P];
    for (int r = 0; r < P; r++)
        pids[r] = sp_test_fork(rank_main, (void *)(intptr_t)r);
    sp_test_wait_all_ok(pids, P, 30000);
    spc_detach(creator);
}

/* A hello as a library from before ranges sends it: protocol 1 alone. */
static void old_hello(const char *sock, uint32_t protocol, uint32_t protocol_max, Spd__Msg **rep_p)
{
    int fd = sp_test_raw_connect(sock);
    Spd__Msg m = SPD__MSG__INIT;
    Spd__Hello hl = SPD__HELLO__INIT;
    hl.protocol = protocol;
    hl.protocol_max = protocol_max;
    hl.role = SPD__HELLO__ROLE__CONTROL;
    hl.name = "old-wire";
    m.seq = 1;
    m.body_case = SPD__MSG__BODY_HELLO;
    m.hello = &hl;
    sp_test_raw_send_msg(fd, &m);
    *rep_p = sp_test_raw_recv(fd, 5000, NULL);
    CHECK(*rep_p != NULL);
    close(fd);
}

static double metric(const char *series)
{
    CHECK_EQ(sp_test_run(out, sizeof out, "%s metrics", sp_test_spctl_bin()), 0);
    const char *l = strstr(out, series);
    if (l == NULL)
        SP_FAIL("no series %s in the metrics", series);
    return strtod(l + strlen(series), NULL);
}

/* A PeerHello of protocols [lo, hi] to daemon d's peer port; returns what d answers to it
 * (NULL: nothing within a second), after checking the hello d sent first. */
static Spd__Msg *peer_hello(const sp_test_daemon_t *d, uint32_t lo, uint32_t hi, int *fd_p)
{
    int fd = sp_test_tcp_connect(NULL, sp_test_node_port(d));
    Spd__Msg *theirs = sp_test_raw_recv(fd, 5000, NULL);
    CHECK(theirs != NULL && theirs->body_case == SPD__MSG__BODY_PEER_HELLO);
    CHECK_EQ(theirs->peer_hello->protocol, SP_PEER_PROTOCOL_MIN);
    CHECK_EQ(theirs->peer_hello->protocol_max, SP_PEER_PROTOCOL_VERSION);
    sp_msg_free(theirs);
    uint8_t nonce[32];
    memset(nonce, 7, sizeof nonce);
    Spd__Msg m = SPD__MSG__INIT;
    Spd__PeerHello ph = SPD__PEER_HELLO__INIT;
    ph.protocol = lo;
    ph.protocol_max = hi;
    ph.node = "node-old";
    ph.nonce = (ProtobufCBinaryData){ sizeof nonce, nonce };
    ph.version = "0.0.9";
    m.body_case = SPD__MSG__BODY_PEER_HELLO;
    m.peer_hello = &ph;
    sp_test_raw_send_msg(fd, &m);
    *fd_p = fd;
    return sp_test_raw_recv(fd, 1000, NULL);
}

static void peers_negotiate(void)
{
    char dir[64] = "/tmp/spd-versions-XXXXXX", secret[128], peers[64], rec[2048];
    CHECK(mkdtemp(dir) != NULL);
    sp_test_secret_file(dir, "secret", "correct horse battery staple 42\n", secret, sizeof secret);
    sp_test_daemon_t a, b;
    sp_test_node_start(&a, "node-a", secret, "127.0.0.1:0", "", 5000);

    /* A daemon of peer protocol 2 alone: refused, both ranges named. */
    int fd;
    Spd__Msg *r = peer_hello(&a, 2, 0, &fd);
    CHECK(r != NULL && r->body_case == SPD__MSG__BODY_ERROR);
    CHECK_EQ(r->error->status, SPC_ERR_PROTOCOL);
    CHECK_CONTAINS(r->error->detail, "peer (spd 0.0.9) speaks peer protocols 2 to 2, this spd");
    CHECK_CONTAINS(r->error->detail, " 3 to 3: upgrade the peer's spd");
    sp_msg_free(r);
    close(fd);
    /* Counted, and in the refusing daemon's log with both ranges. */
    char status[16384], grep[512];
    CHECK_EQ(sp_test_run(status, sizeof status, "%s --socket %s --json status", sp_test_spctl_bin(), a.sock), 0);
    CHECK_EQ(sp_test_json_int(status, "peers_refused"), 1);
    CHECK_EQ(sp_test_run(grep, sizeof grep, "grep -c 'speaks peer protocols 2 to 2, this spd .* 3 to 3' %s", a.log), 0);
    /* A newer one whose range includes ours: taken; spd waits for its proof. */
    r = peer_hello(&a, SP_PEER_PROTOCOL_VERSION, SP_PEER_PROTOCOL_VERSION + 5, &fd);
    CHECK(r == NULL);
    close(fd);

    /* Two daemons link at the highest both speak. */
    snprintf(peers, sizeof peers, "127.0.0.1:%d", sp_test_node_port(&a));
    sp_test_node_start(&b, "node-b", secret, "", peers, 5000);
    sp_test_peer_wait(&b, "node-a", "up", 10000, rec, sizeof rec);
    CHECK_EQ(sp_test_json_int(rec, "protocol"), SP_PEER_PROTOCOL_VERSION);
    sp_test_peer_wait(&a, "node-b", "up", 10000, rec, sizeof rec);
    CHECK_EQ(sp_test_json_int(rec, "protocol"), SP_PEER_PROTOCOL_VERSION);
    CHECK_EQ(sp_test_daemon_stop(&b), 0);
    CHECK_EQ(sp_test_daemon_stop(&a), 0);
    sp_test_daemon_cleanup(&b);
    sp_test_daemon_cleanup(&a);
    sp_test_run(out, sizeof out, "rm -rf %s", dir);
}

/* Plays a library from before layout 5: its hello (protocol 1 alone), the
 * segment it checks, a no-op through its rings. */
static void client_before_layout5(const char *sock)
{
    int fd = sp_test_raw_connect(sock);
    Spd__Msg m = SPD__MSG__INIT;
    Spd__Hello hl = SPD__HELLO__INIT;
    hl.protocol = 1;
    hl.role = SPD__HELLO__ROLE__CLIENT;
    hl.name = "layout-4";
    m.seq = 1;
    m.body_case = SPD__MSG__BODY_HELLO;
    m.hello = &hl;
    sp_test_raw_send_msg(fd, &m);

    static uint8_t buf[4096];
    union {
        struct cmsghdr hdr;
        char space[CMSG_SPACE(2 * sizeof(int))];
    } ctl;
    struct iovec iov = { buf, sizeof buf };
    struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.space, .msg_controllen = sizeof ctl };
    ssize_t n = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC);   /* the welcome comes in one sendmsg with its descriptors */
    CHECK(n > 0);
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    CHECK(c != NULL && c->cmsg_type == SCM_RIGHTS && c->cmsg_len == CMSG_LEN(2 * sizeof(int)));
    int fds[2];
    memcpy(fds, CMSG_DATA(c), sizeof fds);
    sp_frame_t f;
    CHECK_EQ(sp_frame_parse(buf, (size_t)n, sizeof buf, &f), SP_FRAME_OK);
    Spd__Msg *r = sp_msg_decode(&f);
    CHECK(r != NULL && r->body_case == SPD__MSG__BODY_WELCOME);
    CHECK_EQ(r->welcome->protocol, 1);
    uint64_t seg_bytes = r->welcome->segment_bytes;
    sp_msg_free(r);

    void *seg = mmap(NULL, seg_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
    CHECK(seg != MAP_FAILED);
    struct sp_seg_hdr hdr, want;
    memcpy(&hdr, seg, sizeof hdr);
    CHECK_EQ(hdr.version, 4);
    sp_seg_layout(&want, 4, hdr.sq_entries, hdr.arena_bytes);
    want.client_id = hdr.client_id;
    CHECK(memcmp(&want, &hdr, sizeof hdr) == 0 && want.segment_bytes == seg_bytes);
    CHECK_EQ(hdr.sq_args_off + (uint64_t)hdr.sq_entries * 1024 <= hdr.cq_off, 1);   /* 1 KiB slots */

    struct sp_seg_view v;
    sp_seg_view_init(&v, seg, &hdr);
    v.sqes[0] = (struct sp_sqe){ .opcode = SP_OP_NOOP, .user_data = 0x4444 };
    sp_store_release(&v.sq->tail, 1);
    uint64_t one = 1;
    CHECK(write(fds[1], &one, sizeof one) == sizeof one);   /* wake the progress thread */
    uint64_t deadline = sp_test_now_ms() + 5000;
    while (sp_load_acquire(&v.cq->tail) == 0)
        CHECK(sp_test_now_ms() < deadline);
    CHECK_EQ(v.cqes[0].user_data, 0x4444);
    CHECK_EQ(v.cqes[0].status, SPC_OK);
    munmap(seg, seg_bytes);
    close(fds[0]);
    close(fds[1]);
    close(fd);
}

/* A client that attaches to the socket at arg and leaves: attached, or not. */
static int attach_only(void *arg)
{
    spc_attach_params_t p = SPC_ATTACH_PARAMS_INIT;
    p.socket_path = arg;
    spc_handle_t *h;
    if (spc_attach(&p, &h) != SPC_OK)
        SP_FAIL("attach to an spd from before ranges: %s", spc_last_error(NULL));
    return 0;   /* no detach: the played spd answers nothing more */
}

/* Plays an spd from before ranges: it answers any hello of protocol 1 with
 * protocol 1 and a segment of layout 5, and today's library takes it. */
static void spd_before_ranges(void)
{
    char path[108];
    snprintf(path, sizeof path, "/tmp/spd-before-ranges-%d.sock", (int)getpid());
    unlink(path);
    int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", path);
    CHECK(lfd >= 0 && bind(lfd, (struct sockaddr *)&sa, sizeof sa) == 0 && listen(lfd, 1) == 0);
    pid_t child = sp_test_fork(attach_only, path);
    int fd = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
    CHECK(fd >= 0);
    Spd__Msg *req = sp_test_raw_recv(fd, 5000, NULL);
    CHECK(req != NULL && req->body_case == SPD__MSG__BODY_HELLO);
    CHECK_EQ(req->hello->protocol, SP_PROTOCOL_MIN);   /* what such an spd checks */
    CHECK_EQ(req->hello->protocol_max, SP_PROTOCOL_VERSION);
    sp_msg_free(req);

    struct sp_seg_hdr hdr;
    sp_seg_layout(&hdr, 5, 256, 1u << 20);
    hdr.client_id = 1;
    int seg = memfd_create("before-ranges", MFD_CLOEXEC);
    CHECK(seg >= 0 && ftruncate(seg, (off_t)hdr.segment_bytes) == 0);
    CHECK(pwrite(seg, &hdr, sizeof hdr, 0) == (ssize_t)sizeof hdr);
    int wake = eventfd(0, EFD_CLOEXEC);
    Spd__Msg m = SPD__MSG__INIT;
    Spd__Welcome w = SPD__WELCOME__INIT;
    w.protocol = 1;
    w.version = "0.1.0-before-ranges";
    w.client_id = 1;
    w.daemon_pid = getpid();
    w.node = "old";
    w.segment_bytes = hdr.segment_bytes;
    m.seq = 1;
    m.body_case = SPD__MSG__BODY_WELCOME;
    m.welcome = &w;
    uint8_t *buf;
    size_t len;
    CHECK(sp_msg_encode(&m, &buf, &len) == 0);
    struct iovec iov = { buf, len };
    union {
        struct cmsghdr hdr;
        char space[CMSG_SPACE(2 * sizeof(int))];
    } ctl;
    memset(&ctl, 0, sizeof ctl);
    struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.space, .msg_controllen = sizeof ctl };
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(2 * sizeof(int));
    int fds[2] = { seg, wake };
    memcpy(CMSG_DATA(c), fds, sizeof fds);
    CHECK(sendmsg(fd, &mh, MSG_NOSIGNAL) == (ssize_t)len);
    free(buf);
    CHECK_EQ(sp_test_wait(child, 10000), 0);
    close(seg);
    close(wake);
    close(fd);
    close(lfd);
    unlink(path);
}

int main(void)
{
    shared = sp_test_shared(sizeof *shared);
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);

    /* What is served. */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json status", sp_test_spctl_bin()), 0);
    CHECK_EQ(sp_test_json_int(out, "protocol_min"), SP_PROTOCOL_MIN);
    CHECK_EQ(sp_test_json_int(out, "protocol"), SP_PROTOCOL_VERSION);
    CHECK_EQ(sp_test_json_int(out, "peer_protocol_min"), SP_PEER_PROTOCOL_MIN);
    CHECK_EQ(sp_test_json_int(out, "peer_protocol"), SP_PEER_PROTOCOL_VERSION);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s metrics", sp_test_spctl_bin()), 0);
    CHECK_CONTAINS(out, ",protocol_min=\"1\",protocol_max=\"2\",peer_protocol_min=\"3\",peer_protocol_max=\"3\"} 1\n");

    /* The previous wire's hello: protocol 1, no range. */
    Spd__Msg *rep;
    old_hello(d.sock, 1, 0, &rep);
    CHECK_EQ(rep->body_case, SPD__MSG__BODY_WELCOME);
    CHECK_EQ(rep->welcome->protocol, 1);
    sp_msg_free(rep);
    /* A range above spd's: refused, naming both, and counted. */
    old_hello(d.sock, 3, 4, &rep);
    CHECK_EQ(rep->body_case, SPD__MSG__BODY_ERROR);
    CHECK_EQ(rep->error->status, SPC_ERR_PROTOCOL);
    CHECK_CONTAINS(rep->error->detail, "client speaks protocols 3 to 4, spd");
    CHECK_CONTAINS(rep->error->detail, "speaks 1 to 2");
    sp_msg_free(rep);
    CHECK_EQ(metric("spd_attach_refused_total{reason=\"protocol\"} "), 1);

    client_before_layout5(d.sock);
    uint64_t gone = sp_test_now_ms() + 5000;   /* its session closes before the counts below */
    do
        CHECK_EQ(sp_test_run(out, sizeof out, "%s --json status", sp_test_spctl_bin()), 0);
    while ((sp_test_json_int(out, "clients") != 0 || sp_test_json_int(out, "protocol1_sessions") != 0) &&
           sp_test_now_ms() < gone);

    /* A client of protocol 1 gets segment layout 4: its smaller argument slots. */
    setenv("SPC_PROTOCOL_MAX", "1", 1);
    spc_handle_t *h = sp_test_attach();
    unsetenv("SPC_PROTOCOL_MAX");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json clients", sp_test_spctl_bin()), 0);
    CHECK_EQ(sp_test_json_int(out, "protocol"), 1);
    struct sp_seg_hdr v4;
    sp_seg_layout(&v4, 4, 256, (uint64_t)sp_test_json_int(out, "arena_bytes"));   /* sq_entries' default */
    CHECK_EQ(sp_test_json_int(out, "segment_bytes"), (long long)v4.segment_bytes);
    CHECK_EQ(metric("spd_sessions_by_protocol{protocol=\"1\"} "), 1);
    CHECK_EQ(metric("spd_sessions_by_protocol{protocol=\"2\"} "), 1);   /* this spctl */
    spc_detach(h);

    /* Jobs: both ranks on the previous wire, then one of each. */
    run_job(1, 1);
    CHECK_EQ(shared->chose[0], 1);
    CHECK_EQ(shared->chose[1], 1);
    run_job(1, 0);
    CHECK_EQ(shared->chose[0], 1);
    CHECK_EQ(shared->chose[1], SP_PROTOCOL_VERSION);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);

    /* The reverse: today's library, an spd that serves the previous protocol only. */
    const char *old_spd[] = { "--set", "protocol_max=1", NULL };
    sp_test_daemon_start(&d, old_spd);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json status", sp_test_spctl_bin()), 0);
    CHECK_EQ(sp_test_json_int(out, "protocol"), 1);
    CHECK_EQ(sp_test_json_int(out, "protocol1_sessions"), 1);   /* spctl itself */
    old_hello(d.sock, 2, 0, &rep);   /* a client of today's protocol alone */
    CHECK_EQ(rep->body_case, SPD__MSG__BODY_ERROR);
    CHECK_CONTAINS(rep->error->detail, "client speaks protocol 2, spd");
    CHECK_CONTAINS(rep->error->detail, "speaks 1 to 1");
    sp_msg_free(rep);
    run_job(0, 0);
    CHECK_EQ(shared->chose[0], 1);
    CHECK_EQ(shared->chose[1], 1);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);

    spd_before_ranges();
    peers_negotiate();
    printf("versions: ok\n");
    return 0;
}
