/*
 * stats.c — op accounting and the flight recorder. See stats.h for what is
 * counted and what it costs.
 *
 * Sections: buckets and names · group records · the op path · copies for queries.
 */
#include "core/client.h"
#include "core/engine.h"
#include "core/exec.h"
#include "core/job.h"
#include "core/ops.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"

/* ---------------------------------------------------------------- buckets and names */

unsigned sp_stats_bucket_of(uint64_t ns)
{
    if (ns <= (1ull << SP_LAT_SHIFT))
        return 0;
    /* ceil(log2(ns)) - SP_LAT_SHIFT: the first bucket whose bound is >= ns. */
    unsigned k = 64u - (unsigned)__builtin_clzll(ns - 1) - SP_LAT_SHIFT;
    return k < SP_LAT_BUCKETS - 1 ? k : SP_LAT_BUCKETS - 1;
}

uint64_t sp_stats_bucket_le_ns(unsigned k)
{
    return k < SP_LAT_BUCKETS - 1 ? 1ull << (SP_LAT_SHIFT + k) : UINT64_MAX;
}

static unsigned kind_of(unsigned opcode)
{
    return opcode < SP_STATS_KINDS - 1 ? opcode : SP_STATS_KINDS - 1;
}

const char *sp_stats_kind_name(unsigned k)
{
    return k < SP_STATS_KINDS - 1 ? sp_op_name(k) : "unknown";
}

static unsigned status_index(spc_status_t st)
{
    switch (st) {
#define SP__STATUS_CASE(name, value, msg) case name: return SP_STATUS_IDX_##name;
        SPC_STATUS_MAP(SP__STATUS_CASE)
#undef SP__STATUS_CASE
    }
    return SP_STATUS_COUNT;
}

spc_status_t sp_stats_status_of(unsigned i)
{
    static const spc_status_t table[] = {
#define SP__STATUS_VALUE(name, value, msg) name,
        SPC_STATUS_MAP(SP__STATUS_VALUE)
#undef SP__STATUS_VALUE
    };
    return i < SP_STATUS_COUNT ? table[i] : SPC_OK;
}

double sp_stats_quantile_ns(const sp_opstats_t *s, double q)
{
    uint64_t n = 0;
    for (unsigned k = 0; k < SP_LAT_BUCKETS; k++)
        n += s->lat[k];
    if (n == 0)
        return 0.0;
    /* The rank of the wanted duration, 1-based, then the bucket holding it. */
    double want = q * (double)n;
    if (want < 1.0)
        want = 1.0;
    uint64_t below = 0;
    for (unsigned k = 0; k < SP_LAT_BUCKETS; k++) {
        if (s->lat[k] == 0 || (double)(below + s->lat[k]) < want) {
            below += s->lat[k];
            continue;
        }
        double lo = k == 0 ? 0.0 : (double)sp_stats_bucket_le_ns(k - 1);
        double hi = (double)s->max_ns;
        if (k < SP_LAT_BUCKETS - 1 && (double)sp_stats_bucket_le_ns(k) < hi)
            hi = (double)sp_stats_bucket_le_ns(k);
        if (hi < lo)   /* the largest duration is in a lower bucket: cannot be, but never go below it */
            return hi;
        return lo + (hi - lo) * ((want - (double)below) / (double)s->lat[k]);
    }
    return (double)s->max_ns;
}

/* ---------------------------------------------------------------- group records */

sp_gstats_t *sp_stats_group_new(sp_engine_t *eng, const sp_group_t *g)
{
    if (g->nlocal == 0)
        return NULL;   /* no op of it ever ends here */
    uint32_t cap = (uint32_t)eng->cfg->op_history;
    sp_gstats_t *gs = calloc(1, sizeof *gs + (size_t)cap * sizeof gs->recs[0]);
    uint32_t *ranks = malloc((size_t)g->size * sizeof *ranks);
    if (gs == NULL || ranks == NULL) {
        free(gs);
        free(ranks);
        sp_warn(JOB, "job %s group %u: out of memory for its statistics; it goes uncounted", g->job->id, g->id);
        return NULL;
    }
    memcpy(ranks, g->ranks, (size_t)g->size * sizeof *ranks);
    gs->refs = 1;   /* the group's */
    snprintf(gs->job, sizeof gs->job, "%s", g->job->id);
    gs->job_created_ns = g->job->created_ns;
    gs->access = g->job->access;
    gs->group_id = g->id;
    gs->size = g->size;
    gs->world = strcmp(g->kind, "world") == 0;   /* job->world is set once this returns */
    snprintf(gs->kind, sizeof gs->kind, "%s", g->kind);
    gs->ranks = ranks;
    gs->cap = cap;
    return gs;
}

static void gstats_unref(sp_gstats_t *gs)
{
    if (--gs->refs > 0)
        return;
    free(gs->ranks);
    free(gs);
}

void sp_stats_group_gone(sp_engine_t *eng, sp_gstats_t *gs)
{
    sp_stats_t *s = &eng->stats;
    if (gs == NULL)
        return;
    gs->ended = true;
    if (gs->nrecs == 0) {   /* nothing to read back */
        gstats_unref(gs);
        return;
    }
    /* The group's reference passes to the list of ended groups. */
    gs->next = NULL;
    if (s->ended_tail != NULL)
        s->ended_tail->next = gs;
    else
        s->ended = gs;
    s->ended_tail = gs;
    if (++s->nended > SP_STATS_ENDED_MAX) {
        sp_gstats_t *old = s->ended;
        s->ended = old->next;
        s->nended--;
        gstats_unref(old);
    }
}

void sp_stats_cleanup(sp_engine_t *eng)
{
    sp_stats_t *s = &eng->stats;
    while (s->ended != NULL) {
        sp_gstats_t *gs = s->ended;
        s->ended = gs->next;
        gstats_unref(gs);
    }
    s->ended_tail = NULL;
    s->nended = 0;
}

/* ---------------------------------------------------------------- the op path */

void sp_stats_hold(sp_op_t *op, sp_gstats_t *gs)
{
    op->gs = gs;
    if (gs != NULL)
        gs->refs++;
}

void sp_stats_release(sp_engine_t *eng, sp_op_t *op)
{
    (void)eng;
    if (op->gs != NULL) {
        gstats_unref(op->gs);
        op->gs = NULL;
    }
}

void sp_stats_task_started(sp_engine_t *eng, sp_task_t *t)
{
    /* The progress thread's last clock reading (an arrival, or the end of the
     * task before this one) rather than a reading of its own: close enough to
     * tell queueing from copying, and free. */
    sp_op_t *op = sp_task_op(t, 0);
    if (op != NULL)
        op->start_ns = eng->stats.clock_ns;
}

/* Counts one ended op of kind k into s. */
static void count(sp_opstats_t *s, spc_status_t st, uint64_t dur_ns, uint64_t bytes)
{
    s->ops++;
    if (st != SPC_OK) {
        s->failed++;
        s->failed_by[status_index(st)]++;
        return;
    }
    s->bytes += bytes;
    s->sum_ns += dur_ns;
    if (dur_ns > s->max_ns)
        s->max_ns = dur_ns;
    s->lat[sp_stats_bucket_of(dur_ns)]++;
}

void sp_stats_request_done(sp_engine_t *eng, const sp_group_t *g, const sp_op_t *op, spc_status_t st)
{
    /* It ends in the call that took it from the ring, well under the first
     * bucket: a clock read to measure that would cost more than the no-op
     * itself (0.3 us on the development machine), so it counts as 0. */
    unsigned k = kind_of(op->sqe.opcode);
    count(&eng->stats.total[k], st, 0, 0);
    if (g != NULL && g->stats != NULL)
        count(&g->stats->op[k], st, 0, 0);
}

void sp_stats_coll_done(sp_engine_t *eng, sp_gstats_t *gs, sp_op_t *const *ops, uint32_t n, uint64_t bytes,
                        spc_status_t st, const char *detail, const spc_status_t *rank_status)
{
    uint64_t first = UINT64_MAX, last = 0, start = 0;
    uint32_t first_rank = UINT32_MAX, last_rank = UINT32_MAX, arrived = 0, here = 0, nmissing = 0;
    uint32_t missing[SP_REC_MISSING];
    unsigned opcode = SP_STATS_KINDS - 1;
    char rank_detail[SP_DETAIL_BYTES];

    /* One pass over the ranks: phases, who came first and last, who never came. */
    for (uint32_t r = 0; r < n; r++) {
        const sp_op_t *op = ops[r];
        if (op == NULL) {
            if (nmissing < SP_REC_MISSING)
                missing[nmissing] = r;
            nmissing++;
            continue;
        }
        if (arrived++ == 0)
            opcode = op->sqe.opcode;
        if (gs == NULL)
            gs = op->gs;
        here += op->client != NULL;
        if (op->arrive_ns < first) {
            first = op->arrive_ns;
            first_rank = r;
        }
        if (op->arrive_ns >= last) {
            last = op->arrive_ns;
            last_rank = r;
        }
        if (op->start_ns > start)
            start = op->start_ns;
        if (st == SPC_OK && rank_status != NULL && rank_status[r] != SPC_OK) {
            st = rank_status[r];
            snprintf(rank_detail, sizeof rank_detail, "rank %u: its result could not be written back (%s)", r,
                     spc_status_name(st));
            detail = rank_detail;
        }
    }
    uint64_t now = eng->stats.clock_ns = sp_now_ns();
    if (first == UINT64_MAX)
        first = last = now;
    if (start != 0 && start < last)
        start = last;   /* the last arrival came from another daemon, after the engine's reading */
    uint64_t dur = now - first;
    /* This daemon's share of what the collective wrote. */
    uint64_t mine = st != SPC_OK ? 0 : here == n ? bytes : bytes / n * here;
    unsigned k = kind_of(opcode);
    count(&eng->stats.total[k], st, dur, mine);
    if (gs == NULL)
        return;
    count(&gs->op[k], st, dur, mine);
    if (gs->cap == 0)
        return;

    sp_oprec_t *rec = &gs->recs[gs->nrecs++ % gs->cap];
    const sp_op_t *any = first_rank != UINT32_MAX ? ops[first_rank] : NULL;
    rec->seq = any != NULL ? any->seq : 0;
    rec->channel = any != NULL ? any->sqe.channel : 0;
    rec->opcode = (uint8_t)(opcode < 256 ? opcode : 255);
    rec->first_ns = first;
    rec->last_ns = last;
    rec->start_ns = start;
    rec->end_ns = now;
    rec->bytes = mine;
    rec->status = st;
    rec->arrived = arrived;
    rec->first_rank = first_rank;
    rec->last_rank = last_rank;
    rec->nmissing = nmissing;
    memcpy(rec->missing, missing, (nmissing < SP_REC_MISSING ? nmissing : SP_REC_MISSING) * sizeof missing[0]);
    if (st != SPC_OK && detail != NULL)
        snprintf(rec->detail, sizeof rec->detail, "%s", detail);
    else
        rec->detail[0] = '\0';
}

/* ---------------------------------------------------------------- copies for queries */

static bool job_matches(const char *want, const char *job)
{
    return want == NULL || want[0] == '\0' || strcmp(want, job) == 0;
}

/* Appends a copy of gs. Returns false when out of memory. */
static bool copy_one(const sp_gstats_t *gs, bool history, sp_stats_copy_t **v, size_t *n, size_t *cap)
{
    if (*n == *cap) {
        size_t ncap = *cap ? *cap * 2 : 16;
        sp_stats_copy_t *nv = realloc(*v, ncap * sizeof *nv);
        if (nv == NULL)
            return false;
        *v = nv;
        *cap = ncap;
    }
    sp_stats_copy_t *c = &(*v)[*n];
    memset(c, 0, sizeof *c);
    snprintf(c->job, sizeof c->job, "%s", gs->job);
    c->job_created_ns = gs->job_created_ns;
    c->group_id = gs->group_id;
    c->size = gs->size;
    c->world = gs->world;
    c->ended = gs->ended;
    snprintf(c->kind, sizeof c->kind, "%s", gs->kind);
    memcpy(c->op, gs->op, sizeof c->op);
    (*n)++;
    if (!history)
        return true;
    uint64_t kept = gs->nrecs < gs->cap ? gs->nrecs : gs->cap;
    c->ranks = malloc((size_t)gs->size * sizeof *c->ranks);
    c->recs = kept > 0 ? malloc((size_t)kept * sizeof *c->recs) : NULL;
    if (c->ranks == NULL || (kept > 0 && c->recs == NULL))
        return false;   /* freed with the others */
    memcpy(c->ranks, gs->ranks, (size_t)gs->size * sizeof *c->ranks);
    for (uint64_t i = 0; i < kept; i++)   /* oldest first */
        c->recs[i] = gs->recs[(gs->nrecs - kept + i) % gs->cap];
    c->nrecs = (uint32_t)kept;
    return true;
}

static int copy_cmp(const void *a, const void *b)
{
    const sp_stats_copy_t *x = a, *y = b;
    if (x->job_created_ns != y->job_created_ns)
        return x->job_created_ns < y->job_created_ns ? -1 : 1;
    int c = strcmp(x->job, y->job);
    if (c != 0)
        return c;
    return x->group_id < y->group_id ? -1 : x->group_id > y->group_id;
}

int sp_stats_copy(sp_engine_t *eng, const char *job, const sp_viewer_t *viewer, bool history,
                  sp_opstats_t total[SP_STATS_KINDS], sp_stats_copy_t **copies_p, size_t *n_p, bool *found_p)
{
    sp_stats_copy_t *v = NULL;
    size_t n = 0, cap = 0;
    bool ok = true, found = job == NULL || job[0] == '\0';

    memcpy(total, eng->stats.total, sizeof eng->stats.total);
    for (const sp_job_t *j = eng->jobs; j != NULL && ok; j = j->next) {
        if (!job_matches(job, j->id) || !sp_job_visible(j, viewer))
            continue;
        found = true;
        for (const sp_group_t *g = j->groups; g != NULL && ok; g = g->next)
            if (g->stats != NULL)
                ok = copy_one(g->stats, history, &v, &n, &cap);
    }
    for (const sp_gstats_t *gs = history ? eng->stats.ended : NULL; gs != NULL && ok; gs = gs->next) {
        if (!job_matches(job, gs->job) ||
            (viewer != NULL && !sp_auth_may_see(&gs->access, viewer->self, viewer->uid)))
            continue;
        found = true;
        ok = copy_one(gs, history, &v, &n, &cap);
    }
    if (!ok) {
        sp_stats_copies_free(v, n);
        return -1;
    }
    if (n > 1)
        qsort(v, n, sizeof *v, copy_cmp);
    *copies_p = v;
    *n_p = n;
    *found_p = found;
    return 0;
}

void sp_stats_copies_free(sp_stats_copy_t *c, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        free(c[i].ranks);
        free(c[i].recs);
    }
    free(c);
}
