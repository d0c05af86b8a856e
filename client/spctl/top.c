/*
 * top.c — `spctl top`: what spd is doing now, refreshed until interrupted.
 *
 *   spctl [--json] top [--interval S] [--count N] [JOB_ID]
 *
 * Each refresh asks the daemon for its op counters (the stats topic: the
 * daemon's and every group's, those of JOB_ID's groups shown) and for the ops in
 * flight (ops, of JOB_ID alone when given: top ends when that job does). Rates are the counters' differences between two
 * refreshes over the time between them, so the first frame comes one interval
 * after the start. A group that was not there at the refresh before is new:
 * it counts from zero. So does a daemon that restarted in between: a counter
 * lower than before counts from zero.
 *
 * Each refresh attaches anew: a control session that sends nothing for
 * session_idle_ms is closed by spd, and the interval may be longer.
 */
#include <errno.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "spctl.h"

/* One group's counters, summed over the op kinds it ran. */
typedef struct group_count {
    char     job[SPC_JOB_ID_MAX];
    char     kind[16];
    int64_t  group, size;
    uint64_t ops, bytes;
} group_count_t;

/* What one refresh saw. */
typedef struct sample {
    group_count_t      *groups;
    size_t              ngroups, cap;
    uint64_t            ops, bytes;   /* daemon-wide */
    double              t;            /* monotonic, seconds */
    spc_query_result_t *waiting;      /* the ops in flight */
} sample_t;

static volatile sig_atomic_t interrupted;

static void on_signal(int sig)
{
    (void)sig;
    interrupted = 1;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* Sleeps until `until` (monotonic seconds) or a signal stops top. */
static void sleep_until(double until)
{
    double left;
    while (!interrupted && (left = until - now_s()) > 0) {
        struct timespec ts = { .tv_sec = (time_t)left, .tv_nsec = (long)((left - (double)(time_t)left) * 1e9) };
        nanosleep(&ts, NULL);   /* EINTR: the loop looks at the flag */
    }
}

static int64_t rec_int(const spc_query_result_t *r, size_t rec, const char *key)
{
    long f = spc_query_find(r, rec, key);
    return f < 0 || spc_query_kind(r, rec, (size_t)f) != SPC_VALUE_INT ? 0 : spc_query_int(r, rec, (size_t)f);
}

static const char *rec_str(const spc_query_result_t *r, size_t rec, const char *key)
{
    long f = spc_query_find(r, rec, key);
    return f < 0 || spc_query_kind(r, rec, (size_t)f) != SPC_VALUE_STRING ? "" : spc_query_str(r, rec, (size_t)f);
}

static double rec_double(const spc_query_result_t *r, size_t rec, const char *key)
{
    long f = spc_query_find(r, rec, key);
    return f < 0 || spc_query_kind(r, rec, (size_t)f) != SPC_VALUE_DOUBLE ? 0.0 : spc_query_double(r, rec, (size_t)f);
}

static group_count_t *group_of(sample_t *s, const char *job, int64_t group)
{
    for (size_t i = 0; i < s->ngroups; i++)
        if (s->groups[i].group == group && strcmp(s->groups[i].job, job) == 0)
            return &s->groups[i];
    if (s->ngroups == s->cap) {
        size_t cap = s->cap ? s->cap * 2 : 16;
        group_count_t *g = realloc(s->groups, cap * sizeof *g);
        if (g == NULL)
            return NULL;
        s->groups = g;
        s->cap = cap;
    }
    group_count_t *g = &s->groups[s->ngroups++];
    memset(g, 0, sizeof *g);
    snprintf(g->job, sizeof g->job, "%s", job);
    g->group = group;
    return g;
}

static void sample_clear(sample_t *s)
{
    spc_query_free(s->waiting);
    s->waiting = NULL;
    s->ngroups = 0;
    s->ops = s->bytes = 0;
}

/* Fills s from the daemon; says why on stderr and returns false when it cannot. */
static bool take_sample(const char *socket_path, const char *job, sample_t *s)
{
    spc_handle_t *h;
    spc_query_result_t *stats = NULL;
    if (spctl_attach(socket_path, &h) != SPC_OK)
        return false;
    sample_clear(s);
    spc_status_t st = spc_query(h, "stats", "", &stats);   /* the daemon's records too */
    if (st == SPC_OK)
        st = spc_query(h, "ops", job, &s->waiting);
    s->t = now_s();
    if (st != SPC_OK) {
        fprintf(stderr, "spctl: %s: %s\n", spc_status_name(st), spc_last_error(h));
        spc_query_free(stats);
        spc_detach(h);
        return false;
    }
    spc_detach(h);
    bool ok = true;
    for (size_t i = 0; i < spc_query_records(stats); i++) {
        uint64_t ops = (uint64_t)rec_int(stats, i, "ops"), bytes = (uint64_t)rec_int(stats, i, "bytes");
        if (strcmp(rec_str(stats, i, "scope"), "daemon") == 0) {
            s->ops += ops;
            s->bytes += bytes;
            continue;
        }
        if (job[0] != '\0' && strcmp(rec_str(stats, i, "job"), job) != 0)
            continue;
        group_count_t *g = group_of(s, rec_str(stats, i, "job"), rec_int(stats, i, "group"));
        if (g == NULL) {
            fprintf(stderr, "spctl: out of memory\n");
            ok = false;
            break;
        }
        snprintf(g->kind, sizeof g->kind, "%s", rec_str(stats, i, "kind"));
        g->size = rec_int(stats, i, "size");
        g->ops += ops;
        g->bytes += bytes;
    }
    spc_query_free(stats);
    return ok;
}

/* What a counter gained since the refresh before; from zero when it went down. */
static uint64_t gained(uint64_t now, uint64_t before)
{
    return now >= before ? now - before : now;
}

static const group_count_t *group_before(const sample_t *prev, const group_count_t *g)
{
    for (size_t i = 0; i < prev->ngroups; i++)
        if (prev->groups[i].group == g->group && strcmp(prev->groups[i].job, g->job) == 0)
            return &prev->groups[i];
    return NULL;
}

static void print_json(const sample_t *cur, const sample_t *prev, long refresh)
{
    double dt = cur->t - prev->t;
    uint64_t ops = gained(cur->ops, prev->ops), bytes = gained(cur->bytes, prev->bytes);
    printf("{\"refresh\":%ld,\"interval_s\":%.6f,\"ops\":%llu,\"bytes\":%llu,\"ops_per_s\":%.6g,"
           "\"bytes_per_s\":%.6g,\"groups\":[", refresh, dt, (unsigned long long)ops, (unsigned long long)bytes,
           (double)ops / dt, (double)bytes / dt);
    for (size_t i = 0; i < cur->ngroups; i++) {
        const group_count_t *g = &cur->groups[i], *b = group_before(prev, g);
        uint64_t gops = gained(g->ops, b ? b->ops : 0), gbytes = gained(g->bytes, b ? b->bytes : 0);
        printf("%s{\"job\":", i ? "," : "");
        spctl_json_string(g->job);
        printf(",\"group\":%lld,\"kind\":", (long long)g->group);
        spctl_json_string(g->kind);
        printf(",\"size\":%lld,\"ops\":%llu,\"bytes\":%llu,\"ops_per_s\":%.6g,\"bytes_per_s\":%.6g}",
               (long long)g->size, (unsigned long long)gops, (unsigned long long)gbytes, (double)gops / dt,
               (double)gbytes / dt);
    }
    printf("],\"waiting\":");
    spctl_json_list(cur->waiting, 1);
    printf("}\n");
}

static void print_text(const sample_t *cur, const sample_t *prev, long refresh, const char *job)
{
    double dt = cur->t - prev->t;
    if (isatty(STDOUT_FILENO))
        fputs("\033[H\033[J", stdout);   /* the frame in place of the one before */
    else if (refresh > 1)
        putchar('\n');
    printf("spd top%s%s: refresh %ld, over the last %.1f s\n", job[0] ? ", job " : "", job, refresh, dt);
    printf("daemon: %.1f ops/s, %.2f MB/s\n\n", (double)gained(cur->ops, prev->ops) / dt,
           (double)gained(cur->bytes, prev->bytes) / dt / 1e6);
    printf("%-6s %-8s %-5s %-11s %-11s %s\n", "GROUP", "KIND", "SIZE", "OPS/S", "MB/S", "JOB");
    for (size_t i = 0; i < cur->ngroups; i++) {
        const group_count_t *g = &cur->groups[i], *b = group_before(prev, g);
        printf("%-6lld %-8s %-5lld %-11.1f %-11.2f %s\n", (long long)g->group, g->kind, (long long)g->size,
               (double)gained(g->ops, b ? b->ops : 0) / dt, (double)gained(g->bytes, b ? b->bytes : 0) / dt / 1e6,
               g->job);
    }
    if (cur->ngroups == 0)
        printf("(no groups have run ops)\n");
    printf("\nwaiting for ranks:\n");
    const spc_query_result_t *w = cur->waiting;
    for (size_t i = 0; i < spc_query_records(w); i++)
        printf("  job %s group %lld (%s) channel %lld: %s #%lld, %lld of %lld arrived, waiting %.1f s, missing %s\n",
               rec_str(w, i, "job"), (long long)rec_int(w, i, "group"), rec_str(w, i, "kind"),
               (long long)rec_int(w, i, "channel"), rec_str(w, i, "op"), (long long)rec_int(w, i, "seq"),
               (long long)rec_int(w, i, "arrived"), (long long)rec_int(w, i, "size"),
               rec_double(w, i, "waiting_s"),
               rec_str(w, i, "missing_ranks"));
    if (spc_query_records(w) == 0)
        printf("  (none)\n");
}

int spctl_top(const char *socket_path, const char *job, int json, const spctl_top_opts_t *o)
{
    struct sigaction sa = { .sa_handler = on_signal };   /* no SA_RESTART: the sleep ends */
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);

    sample_t a = { 0 }, b = { 0 }, *prev = &a, *cur = &b;
    int rc = 0;
    if (!take_sample(socket_path, job, prev))
        rc = 1;
    for (long refresh = 1; rc == 0 && (o->count == 0 || refresh <= o->count); refresh++) {
        sleep_until(prev->t + o->interval_s);
        if (interrupted)
            break;
        if (!take_sample(socket_path, job, cur)) {
            rc = 1;
            break;
        }
        if (json)
            print_json(cur, prev, refresh);
        else
            print_text(cur, prev, refresh, job);
        fflush(stdout);
        sample_t *t = prev;
        prev = cur;
        cur = t;
    }
    sample_clear(&a);
    sample_clear(&b);
    free(a.groups);
    free(b.groups);
    return rc;
}
