/*
 * Peers at fleet scale, with daemons on loopback:
 *   - a peer that is not there is dialled ever less often (a backoff that
 *     doubles to peer_redial_max_ms, jittered), and is linked soon after it
 *     comes up;
 *   - the cluster secret rotates without a restart and without dropping a
 *     link: every daemon takes the new secret as its next one, then as its
 *     current one (the old as next), then lets the old go. Links made in
 *     between, between daemons on either side of the swap, authenticate and
 *     carry a job's data (an all-reduce checked on both ranks); a daemon that
 *     holds only the old secret is refused at the end, one with the new is
 *     taken.
 */
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include "sp_test.h"

#define S1 "the first cluster secret, 2026\n"
#define S2 "the second cluster secret, 2027\n"

static char dir[64];
static char out[65536];

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

/* The record whose field `needle` matches in daemon d's spctl peers; the test fails without one. */
static void peer_rec(const sp_test_daemon_t *d, const char *needle, char *rec, size_t len)
{
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s --json peers", sp_test_spctl_bin(), d->sock), 0);
    if (!sp_test_json_record(out, out, needle, rec, len))
        SP_FAIL("no peer with %s: %s", needle, out);
}

static void status_str(const sp_test_daemon_t *d, const char *key, char *v, size_t len)
{
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s --json status", sp_test_spctl_bin(), d->sock), 0);
    sp_test_json_str(out, key, v, len);
}

/* ================================================================ backoff */

/* Dials of a dead peer in `ms` since its first, at most or at least: each wait
 * of the backoff (redial_delay_ns with heartbeats of 50 ms and
 * peer_redial_max_ms 800) is 25-50, 50-100, 100-200, 200-400 ms, then 400-800
 * ms each, and is looked at on a heartbeat, so a tick (50 ms) late at most. */
static long long dials_within(double ms, bool most)
{
    static const double shortest[] = { 25, 50, 100, 200, 400 }, longest[] = { 100, 150, 250, 450, 850 };
    const double *wait = most ? shortest : longest;
    long long n = 1;
    for (double t = 0; t + wait[n - 1 < 4 ? n - 1 : 4] <= ms; n++)
        t += wait[n - 1 < 4 ? n - 1 : 4];
    return n;
}

/* The dead peer's record, down, at about `at_ms` after t0, with the dials it counts
 * checked against the backoff over the time that really passed: the test may
 * read it late, and spd dialled first between `start` and t0. */
static long long dials_at(sp_test_daemon_t *x, const char *needle, uint64_t start, uint64_t t0, uint64_t at_ms,
                          char *rec, size_t cap)
{
    while (sp_test_now_ms() - t0 < at_ms)
        usleep(50000);
    /* Between a dial and its refusal the record says "connecting"; read it down. */
    uint64_t before, after;
    do {
        before = sp_test_now_ms();
        peer_rec(x, needle, rec, cap);
        after = sp_test_now_ms();
    } while (strstr(rec, "\"state\":\"down\"") == NULL && after - t0 < at_ms + 1000 && usleep(5000) == 0);
    long long dials = sp_test_json_int(rec, "dials");
    long long most = dials_within((double)(after - start), true), least = dials_within((double)(before - t0), false);
    printf("dials of a dead peer: %lld in %.2f s (the backoff: %lld to %lld; every heartbeat: %llu)\n", dials,
           (double)(before - t0) / 1e3, least, most, (unsigned long long)(after - start) / 50);
    CHECK(dials <= most);
    CHECK(dials >= least - 1);   /* less one: its first dial may come just after t0 */
    return dials;
}

static void backoff(void)
{
    char secret[128], peers[64], needle[64], rec[2048];
    int port = free_port();
    sp_test_secret_file(dir, "secret", S1, secret, sizeof secret);
    snprintf(peers, sizeof peers, "127.0.0.1:%d", port);
    snprintf(needle, sizeof needle, "\"addr\":\"127.0.0.1:%d\"", port);
    setenv("SPD_PEER_REDIAL_MAX_MS", "800", 1);
    sp_test_daemon_t x, y;
    uint64_t start = sp_test_now_ms();
    sp_test_node_start(&x, "node-x", secret, "", peers, 5000);   /* heartbeats every 50 ms */
    unsetenv("SPD_PEER_REDIAL_MAX_MS");
    uint64_t t0 = sp_test_now_ms();

    long long at2 = dials_at(&x, needle, start, t0, 2000, rec, sizeof rec);
    long long at4 = dials_at(&x, needle, start, t0, 4000, rec, sizeof rec);
    double redial = sp_test_json_double(rec, "redial_s");
    printf("next dial in %.3f s\n", redial);
    CHECK(at4 > at2);
    CHECK(redial >= 0 && redial <= 0.8);
    CHECK_CONTAINS(rec, "\"state\":\"down\"");

    /* It comes up: linked within the longest wait. */
    char listen[64];
    snprintf(listen, sizeof listen, "127.0.0.1:%d", port);
    sp_test_node_start(&y, "node-y", secret, listen, "", 5000);
    uint64_t up0 = sp_test_now_ms();
    sp_test_peer_wait(&x, "node-y", "up", 5000, rec, sizeof rec);
    printf("linked %llu ms after the peer came up\n", (unsigned long long)(sp_test_now_ms() - up0));
    CHECK(sp_test_now_ms() - up0 < 2000);
    CHECK_EQ(sp_test_daemon_stop(&x), 0);
    CHECK_EQ(sp_test_daemon_stop(&y), 0);
    sp_test_daemon_cleanup(&x);
    sp_test_daemon_cleanup(&y);
}

/* ================================================================ rotation */

/* Replaces a secret file as a secret store would: a new file renamed over the old. */
static void put_secret(const char *path, const char *secret)
{
    char tmp[256];
    snprintf(tmp, sizeof tmp, "%s.new", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    CHECK(fd >= 0);
    CHECK(write(fd, secret, strlen(secret)) == (ssize_t)strlen(secret));
    close(fd);
    CHECK(rename(tmp, path) == 0);
}

typedef struct node {
    sp_test_daemon_t d;
    char cur[128], next[128];
} node_t;

/* A daemon with its own two secret files, the next one absent when next_secret is NULL. */
static void node_start(node_t *n, const char *name, const char *cur_secret, const char *next_secret,
                       const char *listen, const char *peers)
{
    char f[64];
    snprintf(f, sizeof f, "%s-cur", name);
    sp_test_secret_file(dir, f, cur_secret, n->cur, sizeof n->cur);
    snprintf(n->next, sizeof n->next, "%s/%s-next", dir, name);
    if (next_secret != NULL)
        put_secret(n->next, next_secret);
    setenv("SPD_CLUSTER_SECRET_NEXT_FILE", n->next, 1);
    sp_test_node_start(&n->d, name, n->cur, listen, peers, 5000);
    unsetenv("SPD_CLUSTER_SECRET_NEXT_FILE");
}

/* Waits until daemon d names its secrets (cur, next) as `cur` and `next` do ("" for none). */
static void secrets_wait(const node_t *n, const char *cur, const char *next)
{
    char c[32], x[32];
    uint64_t deadline = sp_test_now_ms() + 5000;
    do {
        status_str(&n->d, "cluster_secret_id", c, sizeof c);
        status_str(&n->d, "cluster_secret_next_id", x, sizeof x);
        if (strcmp(c, cur) == 0 && strcmp(x, next) == 0)
            return;
        usleep(20000);
    } while (sp_test_now_ms() < deadline);
    SP_FAIL("%s holds secrets %s and %s, not %s and %s", n->d.sock, c, x, cur, next);
}

static struct shared {
    char job[SPC_JOB_ID_MAX];
    char sock[2][192];
} *sh;

static int rank_main(void *arg)
{
    int rank = (int)(intptr_t)arg;
    setenv("SPC_SOCKET", sh->sock[rank], 1);
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, sh->job, 2, (uint32_t)rank, 20000, &world));
    double *x = spc_alloc(h, 1024 * sizeof *x);
    CHECK(x != NULL);
    for (int i = 0; i < 1024; i++)
        x[i] = rank == 0 ? i : 0.5 * i;
    CHECK_OK(h, spc_allreduce(h, world, x, x, 1024, SPC_F64, SPC_SUM, 20000));
    for (int i = 0; i < 1024; i++)
        CHECK_EQ(x[i], 1.5 * i);
    spc_detach(h);
    return 0;
}

/* A job of a rank on each of two daemons: their link's data keys agree. */
static void job_across(const node_t *root, const node_t *other)
{
    setenv("SPC_SOCKET", root->d.sock, 1);
    spc_handle_t *creator = sp_test_attach();
    CHECK_OK(creator, spc_job_create(creator, sh->job, sizeof sh->job));
    snprintf(sh->sock[0], sizeof sh->sock[0], "%s", root->d.sock);
    snprintf(sh->sock[1], sizeof sh->sock[1], "%s", other->d.sock);
    pid_t p[2] = { sp_test_fork(rank_main, (void *)0), sp_test_fork(rank_main, (void *)1) };
    sp_test_wait_all_ok(p, 2, 40000);
    spc_detach(creator);
}

static void rotation(void)
{
    node_t a, b, c, d, e;
    char peers[64], rec[2048], id1[32], id2[32];
    node_start(&a, "node-a", S1, NULL, "127.0.0.1:0", "");
    snprintf(peers, sizeof peers, "127.0.0.1:%d", sp_test_node_port(&a.d));
    node_start(&b, "node-b", S1, NULL, "", peers);
    sp_test_peer_wait(&a.d, "node-b", "up", 10000, rec, sizeof rec);
    sp_test_peer_wait(&b.d, "node-a", "up", 10000, rec, sizeof rec);
    uint64_t t0 = sp_test_now_ms();
    status_str(&a.d, "cluster_secret_id", id1, sizeof id1);

    /* 1. Every daemon learns the new secret as its next one. */
    put_secret(a.next, S2);
    put_secret(b.next, S2);
    status_str(&a.d, "cluster_secret_next_id", id2, sizeof id2);
    for (int i = 0; i < 250 && id2[0] == '\0'; i++) {
        usleep(20000);
        status_str(&a.d, "cluster_secret_next_id", id2, sizeof id2);
    }
    CHECK(id2[0] != '\0' && strcmp(id1, id2) != 0);
    secrets_wait(&b, id1, id2);

    /* 2. b swaps: it proves itself with the new secret, still takes the old. */
    put_secret(b.cur, S2);
    put_secret(b.next, S1);
    secrets_wait(&b, id2, id1);
    /* A daemon on b's side of the swap links with a, which has not swapped, and carries data. */
    node_start(&c, "node-c", S2, S1, "", peers);
    sp_test_peer_wait(&c.d, "node-a", "up", 10000, rec, sizeof rec);
    sp_test_peer_wait(&a.d, "node-c", "up", 10000, rec, sizeof rec);
    job_across(&a, &c);

    /* 3. a swaps too; 4. both let the old secret go. */
    put_secret(a.cur, S2);
    put_secret(a.next, S1);
    secrets_wait(&a, id2, id1);
    CHECK(unlink(a.next) == 0);
    put_secret(b.next, "");
    secrets_wait(&a, id2, "");
    secrets_wait(&b, id2, "");

    /* The link of a and b never dropped: up since before the rotation. The
     * rotation's length is read before the record, so that a test descheduled
     * between the two cannot count time the record's since_s does not hold. */
    double rotated_s = (double)(sp_test_now_ms() - t0) / 1e3;
    peer_rec(&a.d, "\"node\":\"node-b\"", rec, sizeof rec);
    CHECK_CONTAINS(rec, "\"state\":\"up\"");
    double up_s = sp_test_json_double(rec, "since_s");
    printf("link a-b up for %.2f s across a rotation of %.2f s\n", up_s, rotated_s);
    CHECK(up_s >= rotated_s);
    CHECK_EQ(sp_test_peer_links_up(&b.d, "node-a"), 1);
    job_across(&a, &b);

    /* Only the old secret: refused now. The new one alone: taken. */
    node_start(&d, "node-d", S1, NULL, "", peers);
    sp_test_peer_wait(&d.d, "node-a", "refused", 10000, rec, sizeof rec);
    node_start(&e, "node-e", S2, NULL, "", peers);
    sp_test_peer_wait(&e.d, "node-a", "up", 10000, rec, sizeof rec);

    node_t *all[] = { &e, &d, &c, &b, &a };
    for (int i = 0; i < 5; i++) {
        CHECK_EQ(sp_test_daemon_stop(&all[i]->d), 0);
        sp_test_daemon_cleanup(&all[i]->d);
    }
}

int main(void)
{
    snprintf(dir, sizeof dir, "/tmp/spd-pscale-XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    sh = sp_test_shared(sizeof *sh);
    backoff();
    rotation();
    sp_test_run(out, sizeof out, "rm -rf %s", dir);
    printf("peers_scale: ok\n");
    return 0;
}
