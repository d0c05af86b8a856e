/*
 * peers_dns: every address behind a name is a peer, as a Kubernetes headless
 * Service gives one address per pod. The test runs in a mount namespace of
 * its own with its own /etc/hosts, where spd-peers.test names several
 * loopback addresses (127.0.0.2, .3, ...), each a daemon listening on the
 * same port, as pods do:
 *   - the dialler links with every daemon behind the name, and one address
 *     with nothing behind it stays down;
 *   - the name changes (an address goes, another comes): at the next
 *     resolution the link to the one gone closes and the new one links;
 *   - peers_dns_max bounds the peers taken from names;
 *   - the daemon's own address among the name's is found at its first hello
 *     and not dialled again.
 * Needs CAP_SYS_ADMIN (a mount namespace): skipped (77) otherwise.
 */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/socket.h>

#include "sp_test.h"

#define NAME "spd-peers.test"

static char dir[64], hosts[128], out[65536];
static int port;

static void hosts_write(const char *const *ips)
{
    FILE *f = fopen(hosts, "w");   /* in place: the bind mount holds this inode */
    CHECK(f != NULL);
    fprintf(f, "127.0.0.1 localhost\n");
    for (; *ips != NULL; ips++)
        fprintf(f, "%s %s\n", *ips, NAME);
    CHECK(fclose(f) == 0);
}

/* A port free on 127.0.0.2 to .6 alike (the kernel's pick on 127.0.0.2). */
static int pick_port(void)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in sa = { .sin_family = AF_INET };
    inet_pton(AF_INET, "127.0.0.2", &sa.sin_addr);
    socklen_t len = sizeof sa;
    CHECK(fd >= 0 && bind(fd, (struct sockaddr *)&sa, sizeof sa) == 0);
    CHECK(getsockname(fd, (struct sockaddr *)&sa, &len) == 0);
    close(fd);
    return ntohs(sa.sin_port);
}

static void node_at(sp_test_daemon_t *d, const char *node, const char *secret, const char *ip, const char *peers_dns)
{
    char listen[64];
    snprintf(listen, sizeof listen, "%s:%d", ip, port);
    if (peers_dns != NULL)
        setenv("SPD_PEERS_DNS", peers_dns, 1);
    sp_test_node_start(d, node, secret, ip != NULL ? listen : "", "", 5000);
    unsetenv("SPD_PEERS_DNS");
}

/* Daemon d's outbound peers from names: how many, and the record of `addr` in rec ("" when absent). */
static int dns_peers(const sp_test_daemon_t *d, const char *ip, char *rec, size_t len)
{
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s --json peers", sp_test_spctl_bin(), d->sock), 0);
    int n = 0;
    for (const char *s = strstr(out, "\"dns_name\":\"" NAME "\""); s != NULL;
         s = strstr(s + 1, "\"dns_name\":\"" NAME "\""))
        n++;
    char needle[64];
    snprintf(needle, sizeof needle, "\"addr\":\"%s:%d\"", ip, port);
    rec[0] = '\0';
    if (ip != NULL)
        sp_test_json_record(out, out, needle, rec, len);
    return n;
}

int main(void)
{
    if (unshare(CLONE_NEWNS) != 0) {
        printf("skipped: a mount namespace of its own (for its own /etc/hosts) needs CAP_SYS_ADMIN\n");
        return 77;
    }
    CHECK(mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) == 0);
    snprintf(dir, sizeof dir, "/tmp/spd-dns-XXXXXX");
    CHECK(mkdtemp(dir) != NULL);
    snprintf(hosts, sizeof hosts, "%s/hosts", dir);
    const char *first[] = { "127.0.0.2", "127.0.0.3", "127.0.0.4", NULL };
    hosts_write(first);
    CHECK(mount(hosts, "/etc/hosts", NULL, MS_BIND, NULL) == 0);
    port = pick_port();

    char secret[128], rec[2048], names[96];
    sp_test_secret_file(dir, "secret", "correct horse battery staple 42\n", secret, sizeof secret);
    snprintf(names, sizeof names, "%s:%d", NAME, port);
    sp_test_daemon_t a, b, c, d, e;
    node_at(&b, "node-b", secret, "127.0.0.2", NULL);
    node_at(&c, "node-c", secret, "127.0.0.3", NULL);   /* nothing at 127.0.0.4 */
    setenv("SPD_PEERS_DNS_INTERVAL_MS", "200", 1);
    node_at(&a, "node-a", secret, NULL, names);

    /* Every address behind the name is dialled. */
    sp_test_peer_wait(&a, "node-b", "up", 10000, rec, sizeof rec);
    sp_test_peer_wait(&a, "node-c", "up", 10000, rec, sizeof rec);
    /* Nothing listens at 127.0.0.4: its record goes down and connecting in turn as it is
     * redialled, so wait to see it down with the reason. */
    uint64_t deadline = sp_test_now_ms() + 10000;
    while (dns_peers(&a, "127.0.0.4", rec, sizeof rec) != 3 || strstr(rec, "\"state\":\"down\"") == NULL) {
        CHECK(sp_test_now_ms() < deadline);
        usleep(20000);
    }
    CHECK_CONTAINS(rec, "connect");

    /* The name changes: 127.0.0.3 goes, 127.0.0.5 comes. */
    node_at(&d, "node-d", secret, "127.0.0.5", NULL);
    const char *second[] = { "127.0.0.2", "127.0.0.4", "127.0.0.5", NULL };
    hosts_write(second);
    sp_test_peer_wait(&a, "node-d", "up", 10000, rec, sizeof rec);
    deadline = sp_test_now_ms() + 10000;
    while (dns_peers(&a, "127.0.0.3", rec, sizeof rec) != 3 || rec[0] != '\0') {
        CHECK(sp_test_now_ms() < deadline);
        usleep(50000);
    }
    sp_test_peer_wait(&c, "node-a", "down", 10000, rec, sizeof rec);   /* its link closed */
    CHECK_EQ(sp_test_peer_links_up(&a, "node-b"), 1);                  /* the others stayed */
    CHECK_EQ(sp_test_daemon_stop(&a), 0);
    sp_test_daemon_cleanup(&a);

    /* peers_dns_max: at most that many from names. */
    setenv("SPD_PEERS_DNS_MAX", "2", 1);
    node_at(&a, "node-a", secret, NULL, names);
    unsetenv("SPD_PEERS_DNS_MAX");
    deadline = sp_test_now_ms() + 10000;
    while (dns_peers(&a, NULL, rec, sizeof rec) < 2)
        CHECK(sp_test_now_ms() < deadline);
    usleep(500000);   /* two more resolutions add nothing */
    CHECK_EQ(dns_peers(&a, NULL, rec, sizeof rec), 2);
    CHECK_EQ(sp_test_daemon_stop(&a), 0);
    sp_test_daemon_cleanup(&a);

    /* A daemon behind the name itself finds its own address and lets it be. */
    const char *third[] = { "127.0.0.2", "127.0.0.6", NULL };
    hosts_write(third);
    node_at(&e, "node-e", secret, "127.0.0.6", names);
    sp_test_peer_wait(&e, "node-b", "up", 10000, rec, sizeof rec);
    deadline = sp_test_now_ms() + 10000;
    do {
        dns_peers(&e, "127.0.0.6", rec, sizeof rec);
        CHECK(sp_test_now_ms() < deadline);
    } while (strstr(rec, "this daemon itself") == NULL);
    long long dials = sp_test_json_int(rec, "dials");
    usleep(600000);
    dns_peers(&e, "127.0.0.6", rec, sizeof rec);
    CHECK_EQ(sp_test_json_int(rec, "dials"), dials);
    unsetenv("SPD_PEERS_DNS_INTERVAL_MS");

    sp_test_daemon_t *all[] = { &e, &d, &c, &b };
    for (int i = 0; i < 4; i++) {
        CHECK_EQ(sp_test_daemon_stop(all[i]), 0);
        sp_test_daemon_cleanup(all[i]);
    }
    umount(hosts);
    sp_test_run(out, sizeof out, "rm -rf %s", dir);
    printf("peers_dns: ok\n");
    return 0;
}
