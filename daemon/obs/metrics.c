/*
 * metrics.c — the Prometheus text exposition (format 0.0.4) of spd's state.
 *
 * Families, in this order: the daemon (info, start time, sessions against
 * max_clients, refused attaches by reason, clients, jobs, arenas, ops in
 * flight, draining), the process (memory, descriptors, CPU, by the names
 * Prometheus' client libraries use), GPUs (imports, streams, tasks, device
 * ops across daemons held through a peer's restart), peers
 * (counts up and down, heartbeat round trips, refused links), the op counters
 * since spd started (by op kind: ops, failures by status, bytes, the duration
 * histogram). Every family is one HELP, one TYPE, then all its samples.
 *
 * What the defaults show is bounded by the code, not by the load: no label
 * takes a value from a job or a peer. Two options add series that grow:
 * metrics_per_group, the op families per group of every live job (labels
 * job_id, group, group_kind, op; only the kinds a group ran, failures only
 * the statuses seen), and metrics_per_peer, spd_peer_up and the last round
 * trip per peer node. The daemon-wide families show every op kind.
 *
 * What is read from the engine is copied under its lock; the text is written
 * with the lock dropped.
 */
#include "obs/metrics.h"

#include <inttypes.h>
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "cluster/net.h"
#include "cluster/sp_nccl.h"
#include "sp_msg.h"
#include "version.h"
#include "core/client.h"
#include "core/engine.h"
#include "core/job.h"
#include "gpu/stream.h"

/* The job id as a label: node:token with the token cut (metrics.h says why). */
#define JOB_TOKEN_SHOWN 16

/* Labels of one series, escaped, without braces: `a="x",b="y"`. */
typedef struct labels {
    char   s[768];
    size_t n;
} labels_t;

/* Appends name="value", escaping backslash, double quote and newline as the format asks. */
static void lab(labels_t *l, const char *name, const char *v)
{
    char *p = l->s + l->n, *end = l->s + sizeof l->s - 4;   /* room for `"` and the NUL */
    p += snprintf(p, (size_t)(end - p), "%s%s=\"", l->n ? "," : "", name);
    for (; *v != '\0' && p < end - 1; v++) {
        if (*v == '\\' || *v == '"' || *v == '\n') {
            *p++ = '\\';
            *p++ = *v == '\n' ? 'n' : *v;
        } else {
            *p++ = *v;
        }
    }
    *p++ = '"';
    *p = '\0';
    l->n = (size_t)(p - l->s);
}

static labels_t group_labels(const sp_stats_copy_t *c, unsigned k)
{
    labels_t l = { .n = 0 };
    char job[SP_JOB_ID_MAX], id[16];
    const char *colon = strrchr(c->job, ':');
    if (colon != NULL && strlen(colon + 1) > JOB_TOKEN_SHOWN)
        snprintf(job, sizeof job, "%.*s", (int)(colon + 1 - c->job) + JOB_TOKEN_SHOWN, c->job);
    else
        snprintf(job, sizeof job, "%s", c->job);
    snprintf(id, sizeof id, "%u", c->group_id);
    lab(&l, "job_id", job);
    lab(&l, "group", id);
    lab(&l, "group_kind", c->kind);
    lab(&l, "op", sp_stats_kind_name(k));
    return l;
}

static labels_t op_labels(unsigned k)
{
    labels_t l = { .n = 0 };
    lab(&l, "op", sp_stats_kind_name(k));
    return l;
}

static void family(FILE *f, const char *name, const char *type, const char *help)
{
    fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void sample(FILE *f, const char *name, const labels_t *l, uint64_t v)
{
    if (l != NULL && l->n > 0)
        fprintf(f, "%s{%s} %" PRIu64 "\n", name, l->s, v);
    else
        fprintf(f, "%s %" PRIu64 "\n", name, v);
}

/* ns as seconds, exactly: 1024 -> "0.000001024". */
static void seconds_text(uint64_t ns, char *buf, size_t len)
{
    int n = snprintf(buf, len, "%" PRIu64 ".%09" PRIu64, ns / 1000000000u, ns % 1000000000u);
    while (n > 2 && buf[n - 1] == '0' && buf[n - 2] != '.')
        buf[--n] = '\0';
}

/* Writes name{labels,extra} or name{extra}, without the value. */
static void series(FILE *f, const char *name, const labels_t *l, const char *extra)
{
    bool both = l->n > 0 && extra[0] != '\0';
    if (l->n == 0 && extra[0] == '\0')
        fprintf(f, "%s ", name);
    else
        fprintf(f, "%s{%s%s%s} ", name, l->s, both ? "," : "", extra);
}

/*
 * The buckets shown: every other bound of the engine's (stats.h), 2.048 us to
 * 8.6 s, then +Inf, so that a histogram costs 15 series rather than 35. Each
 * is the sum of the engine's buckets up to its bound: nothing is estimated.
 */
#define SHOWN_FIRST   1u    /* the engine's bucket of the first bound shown */
#define SHOWN_STEP    2u
#define SHOWN_BOUNDS  12u
_Static_assert(SHOWN_FIRST + (SHOWN_BOUNDS - 1) * SHOWN_STEP < SP_LAT_BUCKETS - 1, "the bounds shown are the engine's");

static void histogram(FILE *f, const char *name, const labels_t *l, const uint64_t lat[SP_LAT_BUCKETS],
                      uint64_t sum_ns)
{
    char bucket[96], le[64];
    uint64_t cum = 0;
    unsigned k = 0;
    snprintf(bucket, sizeof bucket, "%s_bucket", name);
    for (unsigned b = 0; b < SHOWN_BOUNDS; b++) {
        unsigned top = SHOWN_FIRST + b * SHOWN_STEP;
        for (; k <= top; k++)
            cum += lat[k];
        char bound[48];
        seconds_text(sp_stats_bucket_le_ns(top), bound, sizeof bound);
        snprintf(le, sizeof le, "le=\"%s\"", bound);
        series(f, bucket, l, le);
        fprintf(f, "%" PRIu64 "\n", cum);
    }
    for (; k < SP_LAT_BUCKETS; k++)
        cum += lat[k];
    series(f, bucket, l, "le=\"+Inf\"");
    fprintf(f, "%" PRIu64 "\n", cum);
    char sum[48];
    seconds_text(sum_ns, sum, sizeof sum);
    snprintf(bucket, sizeof bucket, "%s_sum", name);
    series(f, bucket, l, "");
    fprintf(f, "%s\n", sum);
    snprintf(bucket, sizeof bucket, "%s_count", name);
    series(f, bucket, l, "");
    fprintf(f, "%" PRIu64 "\n", cum);
}

/* ---------------------------------------------------------------- op families */

/* The four op families (ops, failures, bytes, durations): daemon-wide from
 * total[] by kind when total is not NULL, else per group of copies[n]. */
static void op_families(FILE *f, const char *prefix, const char *scope, const sp_opstats_t *total,
                        const sp_stats_copy_t *copies, size_t n)
{
    char name[64], help[256];
    bool group = total == NULL;
    size_t sets = group ? n : 1;

#define FOR_EACH_SERIES(body)                                                              \
    for (size_t i = 0; i < sets; i++) {                                                    \
        const sp_opstats_t *ops = group ? copies[i].op : total;                            \
        for (unsigned k = 0; k < SP_STATS_KINDS; k++) {                                    \
            const sp_opstats_t *s = &ops[k];                                               \
            if (s->ops == 0 && (group || k == SP_STATS_KINDS - 1))                         \
                continue;                                                                  \
            labels_t l = group ? group_labels(&copies[i], k) : op_labels(k);               \
            body                                                                           \
        }                                                                                  \
    }

    snprintf(name, sizeof name, "%s_ops_total", prefix);
    snprintf(help, sizeof help, "Ops ended %s, failed or not (a collective counts once).", scope);
    family(f, name, "counter", help);
    FOR_EACH_SERIES(sample(f, name, &l, s->ops);)

    snprintf(name, sizeof name, "%s_op_failures_total", prefix);
    snprintf(help, sizeof help, "Ops that failed %s, by status.", scope);
    family(f, name, "counter", help);
    FOR_EACH_SERIES(for (unsigned j = 0; j <= SP_STATUS_COUNT; j++) {
        if (s->failed_by[j] == 0)
            continue;
        labels_t ls = l;
        lab(&ls, "status", j < SP_STATUS_COUNT ? spc_status_name(sp_stats_status_of(j)) : "SPC_UNKNOWN_STATUS");
        sample(f, name, &ls, s->failed_by[j]);
    })

    snprintf(name, sizeof name, "%s_bytes_total", prefix);
    snprintf(help, sizeof help, "Bytes the successful ops wrote into ranks' buffers on this daemon, %s.", scope);
    family(f, name, "counter", help);
    FOR_EACH_SERIES(sample(f, name, &l, s->bytes);)

    snprintf(name, sizeof name, "%s_op_duration_seconds", prefix);
    snprintf(help, sizeof help, "Successful ops %s, from the first rank's arrival to completion.", scope);
    family(f, name, "histogram", help);
    FOR_EACH_SERIES(histogram(f, name, &l, s->lat, s->sum_ns);)
#undef FOR_EACH_SERIES
}

/* ---------------------------------------------------------------- peers */

/* The peer daemons, one entry per node (per address until its hello names
 * it): up when any of its links is, with that link's last round trip. */
typedef struct peer_nodes {
    struct peer_node {
        char     name[96];
        bool     named, up;
        double   rtt_us;      /* -1: none yet */
    } *node;
    size_t n, cap;
    bool   oom;
} peer_nodes_t;

static void peer_node(void *arg, const sp_peer_info_t *p)
{
    peer_nodes_t *pn = arg;
    bool named = p->node[0] != '\0', up = p->state == SP_PEER_UP;
    const char *name = named ? p->node : p->addr;
    if (pn->oom)
        return;
    for (size_t i = 0; i < pn->n; i++) {
        if (strcmp(pn->node[i].name, name) == 0) {
            if (up && !pn->node[i].up) {
                pn->node[i].up = true;
                pn->node[i].rtt_us = p->rtt_us;
            }
            return;
        }
    }
    if (pn->n == pn->cap) {
        size_t cap = pn->cap ? pn->cap * 2 : 8;
        struct peer_node *nn = realloc(pn->node, cap * sizeof *nn);
        if (nn == NULL) {
            pn->oom = true;
            return;
        }
        pn->node = nn;
        pn->cap = cap;
    }
    struct peer_node *e = &pn->node[pn->n++];
    snprintf(e->name, sizeof e->name, "%s", name);
    e->named = named;
    e->up = up;
    e->rtt_us = up ? p->rtt_us : -1;
}

/* The data path's counts, read under the engine lock. */
typedef struct net_counts {
    uint64_t dropped, kept_bytes, not_kept;
} net_counts_t;

static void peer_families(FILE *f, const sp_metrics_source_t *src, const peer_nodes_t *pn, const net_counts_t *net)
{
    const sp_peers_t *ps = src->peers;
    uint64_t up = 0;
    for (size_t i = 0; i < pn->n; i++)
        up += pn->node[i].up;
    family(f, "spd_peers", "gauge",
           "Peer daemons, by node (by address until one says its name), with a link up and without.");
    labels_t l = { .n = 0 };
    lab(&l, "state", "up");
    sample(f, "spd_peers", &l, up);
    l.n = 0;
    lab(&l, "state", "down");
    sample(f, "spd_peers", &l, pn->n - up);
    family(f, "spd_peer_rtt_seconds", "histogram", "Heartbeat round trips to the peer daemons, every link's.");
    labels_t none = { .n = 0 };
    histogram(f, "spd_peer_rtt_seconds", &none, ps->rtt_lat, ps->rtt_sum_ns);
    if (src->cfg->metrics_per_peer) {
        family(f, "spd_peer_up", "gauge", "1 while a link to the peer daemon is up, by node (metrics_per_peer).");
        for (size_t i = 0; i < pn->n; i++) {
            if (!pn->node[i].named)
                continue;
            l.n = 0;
            lab(&l, "node", pn->node[i].name);
            sample(f, "spd_peer_up", &l, pn->node[i].up ? 1 : 0);
        }
        family(f, "spd_peer_last_rtt_seconds", "gauge",
               "The last heartbeat round trip to each peer node that is up (metrics_per_peer).");
        for (size_t i = 0; i < pn->n; i++) {
            if (!pn->node[i].named || pn->node[i].rtt_us < 0)
                continue;
            l.n = 0;
            lab(&l, "node", pn->node[i].name);
            fprintf(f, "spd_peer_last_rtt_seconds{%s} %.9f\n", l.s, pn->node[i].rtt_us / 1e6);
        }
    }
    family(f, "spd_name_lookups", "gauge",
           "Named joins waiting to learn which daemon is their job's home (rank 0 not joined yet), against "
           "max_name_lookups.");
    sample(f, "spd_name_lookups", NULL, *src->name_lookups);
    family(f, "spd_peer_refused_total", "counter", "Inbound peer links that failed authentication.");
    sample(f, "spd_peer_refused_total", NULL, ps->refused_in);
    family(f, "spd_peer_closed_at_accept_total", "counter",
           "Inbound peer links closed at once: peer_max_pending, peer_max_pending_per_addr or fd_reserve.");
    sample(f, "spd_peer_closed_at_accept_total", NULL, ps->closed_at_accept);
    family(f, "spd_peer_messages_dropped_total", "counter",
           "Data-path messages dropped unread: no authenticated link, another run, a bad MAC, a replay or an "
           "overrun.");
    sample(f, "spd_peer_messages_dropped_total", NULL, net->dropped);
    family(f, "spd_peer_restart_kept_bytes", "gauge",
           "Copies of messages to other daemons kept for a peer's restart, against peer_restart_keep_bytes.");
    sample(f, "spd_peer_restart_kept_bytes", NULL, net->kept_bytes);
    family(f, "spd_peer_restart_not_kept_total", "counter",
           "Messages to other daemons not kept for a peer's restart: past peer_restart_keep_bytes, or out of "
           "memory. A restart that needs one fails its collective.");
    sample(f, "spd_peer_restart_not_kept_total", NULL, net->not_kept);
}

/* ---------------------------------------------------------------- the process */

/* The families of Prometheus' process collector, read from /proc and the
 * kernel; one that cannot be read is left out rather than shown as 0. */
static void process_families(FILE *f, double start_s)
{
    FILE *statm = fopen("/proc/self/statm", "re");
    unsigned long long pages_virt, pages_rss;
    if (statm != NULL && fscanf(statm, "%llu %llu", &pages_virt, &pages_rss) == 2) {
        uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
        family(f, "process_virtual_memory_bytes", "gauge", "Virtual memory size in bytes.");
        sample(f, "process_virtual_memory_bytes", NULL, pages_virt * page);
        family(f, "process_resident_memory_bytes", "gauge", "Resident memory size in bytes.");
        sample(f, "process_resident_memory_bytes", NULL, pages_rss * page);
    }
    if (statm != NULL)
        fclose(statm);
    DIR *fds = opendir("/proc/self/fd");
    if (fds != NULL) {
        uint64_t n = 0;
        for (struct dirent *d; (d = readdir(fds)) != NULL;)
            n += d->d_name[0] != '.';
        closedir(fds);
        family(f, "process_open_fds", "gauge", "Number of open file descriptors.");
        sample(f, "process_open_fds", NULL, n - 1);   /* not the one reading the folder */
    }
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
        family(f, "process_max_fds", "gauge", "Maximum number of open file descriptors.");
        sample(f, "process_max_fds", NULL, (uint64_t)rl.rlim_cur);
    }
    struct rusage ru;
    if (getrusage(RUSAGE_SELF, &ru) == 0) {
        double cpu = (double)(ru.ru_utime.tv_sec + ru.ru_stime.tv_sec) +
                     (double)(ru.ru_utime.tv_usec + ru.ru_stime.tv_usec) / 1e6;
        family(f, "process_cpu_seconds_total", "counter", "Total user and system CPU time spent in seconds.");
        fprintf(f, "process_cpu_seconds_total %.6f\n", cpu);
    }
    family(f, "process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.");
    fprintf(f, "process_start_time_seconds %.3f\n", start_s);
}

/* ---------------------------------------------------------------- the text */

/* The wall-clock time the server started: now less its monotonic age, worked
 * out once so that every rendering says the same (spd has one server). */
static double start_time_s(const sp_metrics_source_t *src)
{
    static double start;
    if (start == 0.0) {
        struct timespec rt;
        clock_gettime(CLOCK_REALTIME, &rt);
        start = (double)rt.tv_sec + (double)rt.tv_nsec / 1e9 - (double)(sp_now_ns() - src->started_ns) / 1e9;
    }
    return start;
}

int sp_metrics_render(const sp_metrics_source_t *src, const sp_viewer_t *viewer, char **text_p, size_t *len_p)
{
    sp_engine_t *eng = src->eng;
    sp_opstats_t total[SP_STATS_KINDS];
    sp_stats_copy_t *copies = NULL;
    size_t ncopies = 0;
    bool found;

    pthread_mutex_lock(&eng->lock);
    uint64_t clients = eng->nclients, jobs = eng->njobs, inflight = sp_engine_inflight_locked(eng), arenas = 0;
    uint64_t resumed = eng->clients_resumed;
    for (const sp_client_t *c = eng->clients; c != NULL; c = c->next)
        arenas += c->layout.arena_bytes;
    sp_gpu_counts_t gpu = sp_gpu_counts(eng);
    net_counts_t net = { .dropped = sp_net_dropped(eng) };
    sp_net_kept_counts(eng, &net.kept_bytes, &net.not_kept);
    bool draining = atomic_load(&eng->draining);
    /* The groups' records are copied only to be shown. */
    int rc = 0;
    if (src->cfg->metrics_per_group)
        rc = sp_stats_copy(eng, NULL, viewer, false, total, &copies, &ncopies, &found);
    else
        memcpy(total, eng->stats.total, sizeof total);
    pthread_mutex_unlock(&eng->lock);
    if (rc != 0)
        return -1;

    sp_nccl_counts_t nccl = sp_nccl_counts(eng);
    peer_nodes_t pn = { 0 };
    sp_peers_foreach(src->peers, peer_node, &pn);

    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (f == NULL || pn.oom) {
        if (f != NULL)
            fclose(f);
        free(text);
        free(pn.node);
        sp_stats_copies_free(copies, ncopies);
        return -1;
    }

    /* The daemon. */
    labels_t l = { .n = 0 };
    lab(&l, "node", eng->node);
    lab(&l, "version", SPD_VERSION);
    char num[4][12];
    snprintf(num[0], sizeof num[0], "%u", SP_PROTOCOL_MIN);
    snprintf(num[1], sizeof num[1], "%u", src->protocol_max);
    snprintf(num[2], sizeof num[2], "%u", SP_PEER_PROTOCOL_MIN);
    snprintf(num[3], sizeof num[3], "%u", SP_PEER_PROTOCOL_VERSION);
    lab(&l, "protocol_min", num[0]);
    lab(&l, "protocol_max", num[1]);
    lab(&l, "peer_protocol_min", num[2]);
    lab(&l, "peer_protocol_max", num[3]);
    family(f, "spd_info", "gauge",
           "The running spd: its node name, version and the protocols it serves, to clients and to peers "
           "(always 1).");
    sample(f, "spd_info", &l, 1);
    family(f, "spd_start_time_seconds", "gauge", "When spd started, in seconds since the Unix epoch.");
    fprintf(f, "spd_start_time_seconds %.3f\n", start_time_s(src));
    family(f, "spd_sessions", "gauge", "Sessions open: trainer processes and spctl, against spd_sessions_max.");
    sample(f, "spd_sessions", NULL, *src->sessions);
    family(f, "spd_sessions_by_protocol", "gauge", "Sessions open, by the protocol their hello chose.");
    for (uint32_t p = SP_PROTOCOL_MIN; p <= SP_PROTOCOL_VERSION; p++) {
        l.n = 0;
        snprintf(num[0], sizeof num[0], "%u", p);
        lab(&l, "protocol", num[0]);
        sample(f, "spd_sessions_by_protocol", &l, src->by_protocol[p]);
    }
    family(f, "spd_sessions_max", "gauge", "Most sessions at a time (max_clients); more are refused.");
    sample(f, "spd_sessions_max", NULL, (uint64_t)src->cfg->max_clients);
    family(f, "spd_attach_refused_total", "counter",
           "Sessions refused at their hello, by reason: user (credentials, allow_group), limit (max_clients), "
           "protocol (none in common), draining, request (ring or arena size, a pid that cannot be watched), "
           "resume (a client of the spd before not taken over: its ticket, uid or segment).");
    static const char *const reasons[SP_REFUSED_REASONS] = {
        [SP_REFUSED_USER] = "user", [SP_REFUSED_LIMIT] = "limit", [SP_REFUSED_PROTOCOL] = "protocol",
        [SP_REFUSED_DRAINING] = "draining", [SP_REFUSED_REQUEST] = "request", [SP_REFUSED_RESUME] = "resume",
    };
    for (unsigned r = 0; r < SP_REFUSED_REASONS; r++) {
        l.n = 0;
        lab(&l, "reason", reasons[r]);
        sample(f, "spd_attach_refused_total", &l, src->refused[r]);
    }
    family(f, "spd_clients", "gauge", "Trainer processes attached (spctl sessions not included).");
    sample(f, "spd_clients", NULL, clients);
    family(f, "spd_clients_resumed_total", "counter",
           "Clients of the spd before this one that it took over, with their jobs and ops in flight.");
    sample(f, "spd_clients_resumed_total", NULL, resumed);
    family(f, "spd_arena_bytes", "gauge",
           "Shared arenas of the attached trainer processes, as sized (a page takes memory once touched).");
    sample(f, "spd_arena_bytes", NULL, arenas);
    family(f, "spd_jobs", "gauge", "Jobs this daemon knows.");
    sample(f, "spd_jobs", NULL, jobs);
    family(f, "spd_ops_inflight", "gauge", "Requests taken from the rings and not yet completed.");
    sample(f, "spd_ops_inflight", NULL, inflight);
    family(f, "spd_draining", "gauge", "1 while spd drains (SIGTERM) before it exits.");
    sample(f, "spd_draining", NULL, draining ? 1 : 0);

    /* The process. */
    process_families(f, start_time_s(src));

    /* GPUs. */
    family(f, "spd_gpus", "gauge", "GPUs spd found (0 when it could not look).");
    sample(f, "spd_gpus", NULL, src->devices->gpu_count > 0 ? (uint64_t)src->devices->gpu_count : 0);
    family(f, "spd_gpu_imports", "gauge", "Clients' GPU allocations open in spd now.");
    sample(f, "spd_gpu_imports", NULL, gpu.imports);
    family(f, "spd_gpu_imports_opened_total", "counter", "Clients' GPU allocations opened in spd.");
    sample(f, "spd_gpu_imports_opened_total", NULL, gpu.imports_total);
    family(f, "spd_gpu_reimports_total", "counter",
           "GPU allocations opened again because their address came back with another buffer.");
    sample(f, "spd_gpu_reimports_total", NULL, gpu.reimports);
    family(f, "spd_gpu_streams", "gauge", "Clients' GPU streams open (stream order).");
    sample(f, "spd_gpu_streams", NULL, gpu.streams);
    family(f, "spd_gpu_stream_ops_total", "counter", "Ops started in stream order.");
    sample(f, "spd_gpu_stream_ops_total", NULL, gpu.stream_ops);
    family(f, "spd_gpu_stream_timeouts_total", "counter", "Ops given up because a rank's stream missed their timeout.");
    sample(f, "spd_gpu_stream_timeouts_total", NULL, gpu.stream_timeouts);
    family(f, "spd_gpu_multi_ops_total", "counter", "Device ops run on several GPUs of the node (one rank per GPU).");
    sample(f, "spd_gpu_multi_ops_total", NULL, gpu.multi_ops);
    family(f, "spd_gpu_staged_ops_total", "counter",
           "Of those, ops that staged an input through host memory (GPUs without peer access).");
    sample(f, "spd_gpu_staged_ops_total", NULL, gpu.staged_ops);
    family(f, "spd_gpu_tasks", "gauge", "Device ops on a GPU, or waiting for their turn in stream order.");
    sample(f, "spd_gpu_tasks", NULL, gpu.tasks);
    family(f, "spd_gpu_lanes", "gauge",
           "spd's streams on the GPUs: one per client CUDA stream and per NCCL communicator.");
    sample(f, "spd_gpu_lanes", NULL, gpu.lanes);
    family(f, "spd_gpu_lanes_refused_total", "counter",
           "Streams refused because their GPU had gpu_lanes_max (or as many as its hardware queues).");
    sample(f, "spd_gpu_lanes_refused_total", NULL, gpu.lanes_refused);
    family(f, "spd_gpus_failed", "gauge",
           "GPUs out of service until spd restarts: their context failed (spctl status says why).");
    sample(f, "spd_gpus_failed", NULL, gpu.gpus_failed);
    family(f, "spd_nccl_ops_held_total", "counter",
           "Device ops across daemons held as a peer daemon restarted (peer_restart_grace_ms), to run again once it "
           "takes the job back.");
    sample(f, "spd_nccl_ops_held_total", NULL, nccl.held);
    family(f, "spd_nccl_ops_rerun_total", "counter", "Held device ops run again on a new NCCL communicator.");
    sample(f, "spd_nccl_ops_rerun_total", NULL, nccl.rerun);
    family(f, "spd_nccl_ops_held_failed_total", "counter",
           "Held device ops that failed: the grace passed, the job was not taken back, their deadline passed, or "
           "spd stopped.");
    sample(f, "spd_nccl_ops_held_failed_total", NULL, nccl.held_failed);

    peer_families(f, src, &pn, &net);

    /* Ops. */
    op_families(f, "spd", "since spd started", total, NULL, 0);
    if (src->cfg->metrics_per_group)
        op_families(f, "spd_group", "on the group", NULL, copies, ncopies);

    free(pn.node);
    sp_stats_copies_free(copies, ncopies);
    if (fclose(f) != 0) {
        free(text);
        return -1;
    }
    *text_p = text;
    *len_p = len;
    return 0;
}
