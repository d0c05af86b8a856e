/*
 * What the metrics cost a Prometheus server with the defaults: the same
 * series whether spd holds one job or fifty, under a fixed bound, and no
 * series per peer; metrics_per_group and metrics_per_peer add them back.
 * Two daemons on loopback: each counts the other up, and the heartbeats'
 * round trips fill the histogram.
 */
#include "sp_test.h"

#define JOBS    50
/* Every family the defaults show, op kinds and refusal reasons included, with
 * room for the failure statuses a run may see: far from the 36 series per
 * (group, op) that one job once cost. */
#define DEFAULT_SERIES_MAX 400

static char text[1 << 20];

/* Samples in the exposition: its lines that are not comments. */
static int series_count(const char *sock)
{
    CHECK_EQ(sp_test_run(text, sizeof text, "%s --socket %s metrics", sp_test_spctl_bin(), sock), 0);
    int n = 0;
    for (const char *l = text; *l != '\0'; l = strchr(l, '\n') + 1)
        n += l[0] != '#';
    return n;
}

static double value(const char *series)
{
    size_t n = strlen(series);
    for (const char *l = text; *l != '\0'; l = strchr(l, '\n') + 1)
        if (strncmp(l, series, n) == 0 && l[n] == ' ')
            return strtod(l + n + 1, NULL);
    SP_FAIL("no series %s in the metrics", series);
}

/* A job of one rank per handle, each with an all-reduce done; returns how many handles. */
static int open_jobs(spc_handle_t **h, int n)
{
    for (int i = 0; i < n; i++) {
        char id[SPC_JOB_ID_MAX];
        spc_group_t world;
        h[i] = sp_test_attach();
        CHECK_OK(h[i], spc_job_create(h[i], id, sizeof id));
        CHECK_OK(h[i], spc_job_join(h[i], id, 1, 0, 10000, &world));
        float *x = spc_alloc(h[i], 16 * sizeof *x);
        CHECK(x != NULL);
        for (int k = 0; k < 16; k++)
            x[k] = (float)k;
        CHECK_OK(h[i], spc_allreduce(h[i], world, x, x, 16, SPC_F32, SPC_SUM, 10000));
        CHECK_EQ(x[15], 15.0f);   /* one rank: the sum is its own */
    }
    return n;
}

static void close_jobs(spc_handle_t **h, int n)
{
    for (int i = 0; i < n; i++)
        spc_detach(h[i]);
}

/* One job and fifty cost the same series; with metrics_per_group each adds its own. */
static void jobs_bounded(void)
{
    static spc_handle_t *h[JOBS];
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    open_jobs(h, 1);
    int one = series_count(d.sock);
    CHECK_EQ(value("spd_jobs"), 1);
    open_jobs(h + 1, JOBS - 1);
    int fifty = series_count(d.sock);
    CHECK_EQ(value("spd_jobs"), JOBS);
    CHECK_EQ(value("spd_ops_total{op=\"allreduce\"}"), JOBS);
    CHECK(strstr(text, "job_id=") == NULL);
    printf("default metrics: %d series with 1 job, %d with %d\n", one, fifty, JOBS);
    CHECK_EQ(fifty, one);
    CHECK(fifty <= DEFAULT_SERIES_MAX);
    close_jobs(h, JOBS);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);

    const char *per_group[] = { "--set", "metrics_per_group=1", NULL };
    sp_test_daemon_start(&d, per_group);
    open_jobs(h, JOBS);
    int grouped = series_count(d.sock);
    printf("metrics_per_group 1: %d series with %d jobs\n", grouped, JOBS);
    /* Each job's world group: ops, bytes, 12 bounds, +Inf, sum and count of its all-reduces. */
    CHECK(grouped >= one + JOBS * 17);
    close_jobs(h, JOBS);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
}

/* Two daemons: counts and round trips by default, each peer by name on demand. */
static void peers_counted(void)
{
    char dir[64] = "/tmp/spd-mbound-XXXXXX", secret[128], peers[64], series[128];
    CHECK(mkdtemp(dir) != NULL);
    sp_test_secret_file(dir, "secret", "correct horse battery staple 42\n", secret, sizeof secret);
    sp_test_daemon_t a, b;
    sp_test_node_start(&a, "node-a", secret, "127.0.0.1:0", "", 5000);
    snprintf(peers, sizeof peers, "127.0.0.1:%d", sp_test_node_port(&a));
    setenv("SPD_METRICS_PER_PEER", "1", 1);   /* b only */
    sp_test_node_start(&b, "node-b", secret, "", peers, 5000);
    unsetenv("SPD_METRICS_PER_PEER");
    char rec[2048];
    sp_test_peer_wait(&a, "node-b", "up", 10000, rec, sizeof rec);
    sp_test_peer_wait(&b, "node-a", "up", 10000, rec, sizeof rec);

    /* Heartbeats go every 50 ms: a few round trips come soon. */
    uint64_t deadline = sp_test_now_ms() + 10000;
    do {
        series_count(a.sock);
    } while (value("spd_peer_rtt_seconds_count") < 3 && sp_test_now_ms() < deadline);
    CHECK(value("spd_peer_rtt_seconds_count") >= 3);
    CHECK(value("spd_peer_rtt_seconds_sum") > 0);
    CHECK_EQ(value("spd_peers{state=\"up\"}"), 1);
    CHECK_EQ(value("spd_peers{state=\"down\"}"), 0);
    CHECK(strstr(text, "spd_peer_up") == NULL && strstr(text, "node-b") == NULL);

    series_count(b.sock);
    CHECK_EQ(value("spd_peers{state=\"up\"}"), 1);
    CHECK_EQ(value("spd_peer_up{node=\"node-a\"}"), 1);
    snprintf(series, sizeof series, "spd_peer_last_rtt_seconds{node=\"node-a\"}");
    deadline = sp_test_now_ms() + 10000;
    while (strstr(text, series) == NULL && sp_test_now_ms() < deadline)
        series_count(b.sock);
    CHECK(value(series) > 0 && value(series) < 5);

    /* a goes: b counts it down. */
    CHECK_EQ(sp_test_daemon_stop(&a), 0);
    sp_test_daemon_cleanup(&a);
    sp_test_peer_wait(&b, "node-a", "down", 10000, rec, sizeof rec);
    series_count(b.sock);
    CHECK_EQ(value("spd_peers{state=\"up\"}"), 0);
    CHECK_EQ(value("spd_peers{state=\"down\"}"), 1);
    CHECK_EQ(value("spd_peer_up{node=\"node-a\"}"), 0);
    CHECK_EQ(sp_test_daemon_stop(&b), 0);
    sp_test_daemon_cleanup(&b);
    sp_test_run(text, sizeof text, "rm -rf %s", dir);
}

int main(void)
{
    jobs_bounded();
    peers_counted();
    printf("metrics_bounded: ok\n");
    return 0;
}
