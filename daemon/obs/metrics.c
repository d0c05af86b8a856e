/*
 * metrics.c — the Prometheus text exposition (format 0.0.4) of spd's state.
 *
 * Families, in this order: the daemon (info, start time, clients, jobs, ops in
 * flight, draining), GPUs (imports, streams, tasks), peers (spd_peer_up per
 * node, refused links), the op counters since spd started (by op kind: ops,
 * failures by status, bytes, the duration histogram), then the same per group
 * of every live job (labels job_id, group, group_kind, op). Every family is one
 * HELP, one TYPE, then all its samples. The daemon-wide families show every op
 * kind; the per-group ones only the kinds a group ran; failures only the
 * statuses seen.
 *
 * What is read from the engine is copied under its lock; the text is written
 * with the lock dropped.
 */
#include "obs/metrics.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cluster/net.h"
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

static void histogram(FILE *f, const char *name, const labels_t *l, const sp_opstats_t *s)
{
    char le[48];
    uint64_t cum = 0;
    for (unsigned k = 0; k < SP_LAT_BUCKETS; k++) {
        cum += s->lat[k];
        if (k == SP_LAT_BUCKETS - 1)
            snprintf(le, sizeof le, "+Inf");
        else
            seconds_text(sp_stats_bucket_le_ns(k), le, sizeof le);
        fprintf(f, "%s_bucket{%s%sle=\"%s\"} %" PRIu64 "\n", name, l->s, l->n ? "," : "", le, cum);
    }
    char sum[48];
    seconds_text(s->sum_ns, sum, sizeof sum);
    fprintf(f, "%s_sum{%s} %s\n%s_count{%s} %" PRIu64 "\n", name, l->s, sum, name, l->s, cum);
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
    FOR_EACH_SERIES(histogram(f, name, &l, s);)
#undef FOR_EACH_SERIES
}

/* ---------------------------------------------------------------- peers */

typedef struct peer_nodes {
    char   (*name)[64];
    size_t n, cap;
    bool   oom;
} peer_nodes_t;

static void peer_node(void *arg, const sp_peer_info_t *p)
{
    peer_nodes_t *pn = arg;
    if (p->node[0] == '\0' || pn->oom)
        return;   /* its hello has not come: no name yet */
    for (size_t i = 0; i < pn->n; i++)
        if (strcmp(pn->name[i], p->node) == 0)
            return;
    if (pn->n == pn->cap) {
        size_t cap = pn->cap ? pn->cap * 2 : 8;
        char(*nn)[64] = realloc(pn->name, cap * sizeof *nn);
        if (nn == NULL) {
            pn->oom = true;
            return;
        }
        pn->name = nn;
        pn->cap = cap;
    }
    snprintf(pn->name[pn->n++], sizeof pn->name[0], "%s", p->node);
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
    uint64_t clients = eng->nclients, jobs = eng->njobs, inflight = sp_engine_inflight_locked(eng);
    sp_gpu_counts_t gpu = sp_gpu_counts(eng);
    uint64_t net_dropped = sp_net_dropped(eng);
    bool draining = atomic_load(&eng->draining);
    int rc = sp_stats_copy(eng, NULL, viewer, false, total, &copies, &ncopies, &found);
    pthread_mutex_unlock(&eng->lock);
    if (rc != 0)
        return -1;

    peer_nodes_t pn = { 0 };
    sp_peers_foreach(src->peers, peer_node, &pn);

    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (f == NULL || pn.oom) {
        if (f != NULL)
            fclose(f);
        free(text);
        free(pn.name);
        sp_stats_copies_free(copies, ncopies);
        return -1;
    }

    /* The daemon. */
    labels_t l = { .n = 0 };
    lab(&l, "node", eng->node);
    lab(&l, "version", SPD_VERSION);
    family(f, "spd_info", "gauge", "The running spd: its node name and version (always 1).");
    sample(f, "spd_info", &l, 1);
    family(f, "spd_start_time_seconds", "gauge", "When spd started, in seconds since the Unix epoch.");
    fprintf(f, "spd_start_time_seconds %.3f\n", start_time_s(src));
    family(f, "spd_clients", "gauge", "Trainer processes attached (spctl sessions not included).");
    sample(f, "spd_clients", NULL, clients);
    family(f, "spd_jobs", "gauge", "Jobs this daemon knows.");
    sample(f, "spd_jobs", NULL, jobs);
    family(f, "spd_ops_inflight", "gauge", "Requests taken from the rings and not yet completed.");
    sample(f, "spd_ops_inflight", NULL, inflight);
    family(f, "spd_draining", "gauge", "1 while spd drains (SIGTERM) before it exits.");
    sample(f, "spd_draining", NULL, draining ? 1 : 0);

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

    /* Peers. */
    family(f, "spd_peer_up", "gauge", "1 while a link to the peer daemon is up, by node.");
    for (size_t i = 0; i < pn.n; i++) {
        labels_t pl = { .n = 0 };
        lab(&pl, "node", pn.name[i]);
        sample(f, "spd_peer_up", &pl, sp_peers_is_up(src->peers, pn.name[i]) ? 1 : 0);
    }
    family(f, "spd_peer_refused_total", "counter", "Inbound peer links that failed authentication.");
    sample(f, "spd_peer_refused_total", NULL, src->peers->refused_in);
    family(f, "spd_peer_closed_at_accept_total", "counter",
           "Inbound peer links closed at once: peer_max_pending, peer_max_pending_per_addr or fd_reserve.");
    sample(f, "spd_peer_closed_at_accept_total", NULL, src->peers->closed_at_accept);
    family(f, "spd_peer_messages_dropped_total", "counter",
           "Data-path messages dropped unread: no authenticated link, another run, a bad MAC, a replay or an "
           "overrun.");
    sample(f, "spd_peer_messages_dropped_total", NULL, net_dropped);

    /* Ops. */
    op_families(f, "spd", "since spd started", total, NULL, 0);
    op_families(f, "spd_group", "on the group", NULL, copies, ncopies);

    free(pn.name);
    sp_stats_copies_free(copies, ncopies);
    if (fclose(f) != 0) {
        free(text);
        return -1;
    }
    *text_p = text;
    *len_p = len;
    return 0;
}
