/*
 * job.c — jobs, groups and collective matching.
 *
 * Matching. Every rank's k-th operation on a group belongs to collective k of
 * that group (each rank has its own next sequence number). A collective runs when
 * all its ranks have arrived, after checking that they agree. Ranks may run ahead:
 * several collectives of a group can be open at once, and a rank may submit its
 * next ops before the others caught up; the order in which ranks submit never
 * matters.
 *
 * Failure. A collective that fails (a rank's own request invalid, ranks
 * disagreeing, a deadline passing) completes every arrived op with the error and
 * stays behind, marked failed, until the remaining ranks arrive and get the same
 * error, so sequence numbers stay aligned and the group stays usable. A lost
 * member is different: the group is broken for good, and every op on it, pending
 * or future, fails with SPC_ERR_PEER_LOST naming the rank.
 */
#include "engine.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>

#include "log.h"
#include "sp_kern.h"

#define SP_MAX_WORLD 65536u

static const char *op_name(unsigned opcode)
{
    switch (opcode) {
    case SP_OP_NOOP:      return "noop";
    case SP_OP_BARRIER:   return "barrier";
    case SP_OP_ALLREDUCE: return "allreduce";
    }
    return "unknown";
}

static const char *redop_name(unsigned redop)
{
    switch (redop) {
    case SP_REDOP_SUM: return "sum";
    case SP_REDOP_MAX: return "max";
    case SP_REDOP_MIN: return "min";
    }
    return "unknown";
}

/* ---------------------------------------------------------------- groups */

static sp_group_t *group_create(sp_engine_t *eng, sp_job_t *job, uint32_t size)
{
    sp_group_t *g = calloc(1, sizeof *g);
    if (g == NULL)
        return NULL;
    g->next_seq = calloc(size, sizeof *g->next_seq);
    if (g->next_seq == NULL) {
        free(g);
        return NULL;
    }
    g->id = eng->next_group_id++;
    g->size = size;
    g->job = job;
    return g;
}

static void coll_free(sp_group_t *g, sp_coll_t *coll)
{
    sp_coll_t **pp = &g->colls;
    while (*pp != NULL && *pp != coll)
        pp = &(*pp)->next;
    if (*pp == coll)
        *pp = coll->next;
    free(coll);
}

/* Completes every op that arrived at `coll` with `st` and marks it failed. The
 * record stays until the ranks that did not arrive yet come and get the same error. */
static void coll_fail(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll, spc_status_t st, const char *detail)
{
    coll->failed = st;
    snprintf(coll->failed_detail, sizeof coll->failed_detail, "%s", detail);
    for (uint32_t r = 0; r < g->size; r++) {
        if (coll->ops[r] != NULL) {
            sp_op_complete(eng, coll->ops[r], st, detail);
            coll->ops[r] = NULL;
            coll->passed++;
        }
    }
    if (coll->passed == g->size)
        coll_free(g, coll);
}

static void group_break(sp_engine_t *eng, sp_group_t *g, spc_status_t st, const char *detail)
{
    if (g->broken == SPC_OK) {
        g->broken = st;
        snprintf(g->broken_detail, sizeof g->broken_detail, "%s", detail);
    }
    while (g->colls != NULL) {
        sp_coll_t *coll = g->colls;
        if (coll->failed == SPC_OK) {
            coll_fail(eng, g, coll, st, detail);
            if (g->colls == coll)   /* still there: ranks missing; nobody will come */
                coll_free(g, coll);
        } else {
            coll_free(g, coll);
        }
    }
}

static void group_destroy(sp_engine_t *eng, sp_group_t *g)
{
    if (g == NULL)
        return;
    group_break(eng, g, SPC_ERR_CANCELED, "group destroyed");
    free(g->next_seq);
    free(g);
}

uint32_t sp_group_pending_ops(const sp_group_t *g)
{
    uint32_t n = 0;
    for (const sp_coll_t *coll = g->colls; coll != NULL; coll = coll->next)
        if (coll->failed == SPC_OK)
            n += coll->arrived;
    return n;
}

/* ---------------------------------------------------------------- jobs */

sp_job_t *sp_job_find(sp_engine_t *eng, const char *id)
{
    for (sp_job_t *j = eng->jobs; j != NULL; j = j->next)
        if (strcmp(j->id, id) == 0)
            return j;
    return NULL;
}

spc_status_t sp_job_create(sp_engine_t *eng, sp_client_t *creator, sp_job_t **job_p,
                           char *err, size_t errlen)
{
    uint8_t token[16];

    if (getrandom(token, sizeof token, 0) != (ssize_t)sizeof token) {
        snprintf(err, errlen, "no randomness for a job token");
        return SPC_ERR_NO_MEMORY;
    }
    sp_job_t *job = calloc(1, sizeof *job);
    if (job == NULL) {
        snprintf(err, errlen, "out of memory");
        return SPC_ERR_NO_MEMORY;
    }
    int n = snprintf(job->id, sizeof job->id, "%.64s:", eng->node);
    for (size_t i = 0; i < sizeof token; i++)
        n += snprintf(job->id + n, sizeof job->id - (size_t)n, "%02x", token[i]);
    job->creator_id = creator->id;
    job->created_ns = sp_now_ns();
    job->next = eng->jobs;
    eng->jobs = job;
    eng->njobs++;
    sp_info(JOB, "job %s created by client %" PRIu64 " (pid %d)", job->id, creator->id, (int)creator->pid);
    *job_p = job;
    return SPC_OK;
}

static void job_free(sp_engine_t *eng, sp_job_t *job)
{
    sp_job_t **pp = &eng->jobs;
    while (*pp != NULL && *pp != job)
        pp = &(*pp)->next;
    if (*pp == job) {
        *pp = job->next;
        eng->njobs--;
    }
    sp_info(JOB, "job %s ended", job->id);
    group_destroy(eng, job->world);
    free(job->members);
    free(job);
}

static uint32_t job_live_members(const sp_job_t *job)
{
    uint32_t n = 0;
    for (uint32_t r = 0; r < job->world_size; r++)
        n += job->members[r].client != NULL;
    return n;
}

static void job_maybe_free(sp_engine_t *eng, sp_job_t *job)
{
    if (job->creator_id == 0 && job_live_members(job) == 0)
        job_free(eng, job);
}

spc_status_t sp_job_join(sp_engine_t *eng, sp_client_t *c, const char *job_id, uint32_t world_size,
                         uint32_t rank, void *join_pending, sp_job_t **job_p, bool *complete_p,
                         char *err, size_t errlen)
{
    if (c->job != NULL) {
        snprintf(err, errlen, "this client is already rank %u of job %s", c->rank, c->job->id);
        return SPC_ERR_BUSY;
    }
    sp_job_t *job = sp_job_find(eng, job_id);
    if (job == NULL) {
        snprintf(err, errlen, "no job '%.*s' on this daemon", 128, job_id);
        return SPC_ERR_NOT_FOUND;
    }
    if (world_size == 0 || world_size > SP_MAX_WORLD) {
        snprintf(err, errlen, "world size %u outside [1, %u]", world_size, SP_MAX_WORLD);
        return SPC_ERR_INVALID_ARG;
    }
    if (job->world_size != 0 && world_size != job->world_size) {
        snprintf(err, errlen, "job %s has world size %u; this rank said %u", job->id, job->world_size, world_size);
        return SPC_ERR_MISMATCH;
    }
    if (rank >= world_size) {
        snprintf(err, errlen, "rank %u is not below the world size %u", rank, world_size);
        return SPC_ERR_INVALID_ARG;
    }
    if (job->complete) {
        snprintf(err, errlen, "job %s has already started; create a new job", job->id);
        return SPC_ERR_BUSY;
    }
    if (job->world_size == 0) {
        job->members = calloc(world_size, sizeof *job->members);
        if (job->members == NULL) {
            snprintf(err, errlen, "out of memory");
            return SPC_ERR_NO_MEMORY;
        }
        job->world_size = world_size;
    }
    sp_member_t *m = &job->members[rank];
    if (m->client != NULL) {
        snprintf(err, errlen, "rank %u of job %s is already taken by pid %d", rank, job->id, (int)m->pid);
        return SPC_ERR_BUSY;
    }
    m->client = c;
    m->pid = c->pid;
    m->join_pending = join_pending;
    job->joined++;
    c->job = job;
    c->rank = rank;
    sp_info(JOB, "job %s: rank %u of %u joined (client %" PRIu64 ", pid %d)", job->id, rank, world_size,
            c->id, (int)c->pid);

    *complete_p = false;
    if (job->joined == job->world_size) {
        job->world = group_create(eng, job, job->world_size);
        if (job->world == NULL) {
            sp_job_join_cancel(eng, job, rank);
            snprintf(err, errlen, "out of memory");
            return SPC_ERR_NO_MEMORY;
        }
        job->complete = true;
        *complete_p = true;
        sp_info(JOB, "job %s complete: %u ranks, world group %u", job->id, job->world_size, job->world->id);
    }
    *job_p = job;
    return SPC_OK;
}

void sp_job_join_cancel(sp_engine_t *eng, sp_job_t *job, uint32_t rank)
{
    (void)eng;
    if (job->complete || rank >= job->world_size)
        return;
    sp_member_t *m = &job->members[rank];
    if (m->client != NULL) {
        m->client->job = NULL;
        m->client = NULL;
        m->join_pending = NULL;
        job->joined--;
    }
    /* Nobody waits any more: the next join may pick the world size afresh. */
    if (job->joined == 0) {
        free(job->members);
        job->members = NULL;
        job->world_size = 0;
    }
}

void sp_job_missing(const sp_job_t *job, char *buf, size_t len)
{
    size_t off = (size_t)snprintf(buf, len, "ranks");
    uint32_t missing = 0, shown = 0;
    for (uint32_t r = 0; r < job->world_size; r++) {
        if (job->members[r].client != NULL)
            continue;
        missing++;
        if (shown < 16 && off < len) {
            off += (size_t)snprintf(buf + off, len - off, "%s %u", shown ? "," : "", r);
            shown++;
        }
    }
    if (off < len)
        snprintf(buf + off, len - off, "%s (%u of %u) have not joined job %s", missing > shown ? ", ..." : "",
                 missing, job->world_size, job->id);
}

void sp_job_member_lost(sp_engine_t *eng, sp_client_t *c, const char *why)
{
    sp_job_t *job = c->job;
    char detail[SP_DETAIL_BYTES];

    if (job == NULL)
        return;
    uint32_t rank = c->rank;
    if (!job->complete) {
        sp_job_join_cancel(eng, job, rank);
    } else {
        snprintf(detail, sizeof detail, "rank %u (pid %d) lost: %s", rank, (int)c->pid, why);
        /* Leaving is normal at the end of a job; it is news only when others wait on it. */
        uint32_t waiting = job->world != NULL ? sp_group_pending_ops(job->world) : 0;
        if (waiting > 0)
            sp_warn(JOB, "job %s: %s; failing %u waiting ops", job->id, detail, waiting);
        else
            sp_info(JOB, "job %s: rank %u (pid %d) left: %s", job->id, rank, (int)c->pid, why);
        /* Clear the member first: completing the broken group's ops must not see it. */
        job->members[rank].client = NULL;
        if (job->world != NULL)
            group_break(eng, job->world, SPC_ERR_PEER_LOST, detail);
    }
    c->job = NULL;
    job_maybe_free(eng, job);
}

void sp_job_creator_gone(sp_engine_t *eng, uint64_t client_id)
{
    sp_job_t *next;
    for (sp_job_t *job = eng->jobs; job != NULL; job = next) {
        next = job->next;
        if (job->creator_id == client_id) {
            job->creator_id = 0;
            job_maybe_free(eng, job);
        }
    }
}

void sp_jobs_cleanup(sp_engine_t *eng)
{
    while (eng->jobs != NULL)
        job_free(eng, eng->jobs);
}

void sp_job_fail_all(sp_engine_t *eng, spc_status_t st, const char *detail)
{
    for (sp_job_t *job = eng->jobs; job != NULL; job = job->next)
        if (job->world != NULL)
            group_break(eng, job->world, st, detail);
}

/* ---------------------------------------------------------------- dispatch */

/* The group `id` as seen by client c, and c's rank in it; NULL when c is not in it. */
static sp_group_t *client_group(sp_client_t *c, uint32_t id, uint32_t *grank_p)
{
    sp_job_t *job = c->job;
    if (job != NULL && job->world != NULL && job->world->id == id) {
        *grank_p = c->rank;
        return job->world;
    }
    return NULL;
}

/* Checks what one rank can check alone. Sets op->local_status/detail. */
static void validate_local(sp_op_t *op)
{
    const struct sp_sqe *e = &op->sqe;
    sp_client_t *c = op->client;
    char *d = op->local_detail;
    size_t dl = sizeof op->local_detail;

    op->local_status = SPC_OK;
    switch (e->opcode) {
    case SP_OP_BARRIER:
        if (e->ntensors != 0) {
            snprintf(d, dl, "barrier takes no tensors (got %u)", e->ntensors);
            op->local_status = SPC_ERR_INVALID_ARG;
        }
        return;
    case SP_OP_ALLREDUCE: {
        size_t es = sp_dtype_size(e->dtype);
        if (e->ntensors != 2) {
            snprintf(d, dl, "allreduce takes 2 tensors (send, receive); got %u", e->ntensors);
            op->local_status = SPC_ERR_INVALID_ARG;
            return;
        }
        if (!sp_kern_reduce_supported(e->dtype, e->redop)) {
            snprintf(d, dl, "allreduce %s over %s is not supported (sum, max, min over fp32, fp64)",
                     redop_name(e->redop), sp_dtype_name(e->dtype));
            op->local_status = SPC_ERR_UNSUPPORTED;
            return;
        }
        if (e->count == 0 || e->count > UINT64_MAX / es) {
            snprintf(d, dl, "allreduce count %" PRIu64 " is not a valid element count", e->count);
            op->local_status = SPC_ERR_INVALID_ARG;
            return;
        }
        uint64_t bytes = e->count * es;
        for (int i = 0; i < 2; i++) {
            const struct sp_tensor_ref *t = &op->tensor[i];
            if (t->bytes != 0 && t->bytes < bytes) {
                snprintf(d, dl, "%s tensor holds %" PRIu64 " bytes; %" PRIu64 " x %s needs %" PRIu64,
                         i ? "receive" : "send", t->bytes, e->count, sp_dtype_name(e->dtype), bytes);
                op->local_status = SPC_ERR_INVALID_ARG;
                return;
            }
            char why[SP_DETAIL_BYTES - 32];
            spc_status_t st = sp_mem_check(c, t, bytes, why, sizeof why);
            if (st != SPC_OK) {
                snprintf(d, dl, "%s tensor: %s", i ? "receive" : "send", why);
                op->local_status = st;
                return;
            }
        }
        return;
    }
    }
}

/* Compares every rank's op with rank 0's. Returns false (and the detail) when
 * they disagree: the detail names the ranks and the fields. */
static bool coll_agree(const sp_group_t *g, const sp_coll_t *coll, char *detail, size_t len)
{
    const struct sp_sqe *a = &coll->ops[0]->sqe;
    size_t off = 0;
    int n = 0;

    for (uint32_t r = 1; r < g->size && off < len; r++) {
        const struct sp_sqe *b = &coll->ops[r]->sqe;
        const char *sep = n ? "; " : "";
        if (b->opcode != a->opcode) {
            off += (size_t)snprintf(detail + off, len - off, "%srank %u submitted %s where rank 0 submitted %s",
                                    sep, r, op_name(b->opcode), op_name(a->opcode));
            n++;
            continue;   /* other fields mean nothing across different ops */
        }
        if (b->dtype != a->dtype) {
            off += (size_t)snprintf(detail + off, len - off, "%srank %u sent dtype %s, rank 0 sent %s",
                                    sep, r, sp_dtype_name(b->dtype), sp_dtype_name(a->dtype));
            n++;
            sep = "; ";
        }
        if (off < len && b->count != a->count) {
            off += (size_t)snprintf(detail + off, len - off, "%srank %u sent count %" PRIu64 ", rank 0 sent %" PRIu64,
                                    sep, r, b->count, a->count);
            n++;
            sep = "; ";
        }
        if (off < len && b->redop != a->redop) {
            off += (size_t)snprintf(detail + off, len - off, "%srank %u asked for %s, rank 0 for %s",
                                    sep, r, redop_name(b->redop), redop_name(a->redop));
            n++;
        }
    }
    return n == 0;
}

/* Every rank has arrived: check, then run. */
static void coll_run(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll)
{
    char detail[SP_DETAIL_BYTES];

    /* A rank whose own request was refused: it gets its error, the others learn
     * which rank and why. */
    for (uint32_t r = 0; r < g->size; r++) {
        sp_op_t *bad = coll->ops[r];
        if (bad->local_status == SPC_OK)
            continue;
        snprintf(detail, sizeof detail, "rank %u's request was refused: %s", r, bad->local_detail);
        for (uint32_t k = 0; k < g->size; k++) {
            sp_op_t *op = coll->ops[k];
            coll->ops[k] = NULL;
            if (op->local_status != SPC_OK)
                sp_op_complete(eng, op, op->local_status, op->local_detail);
            else
                sp_op_complete(eng, op, SPC_ERR_PEER_REFUSED, detail);
        }
        coll_free(g, coll);
        return;
    }
    if (!coll_agree(g, coll, detail, sizeof detail)) {
        sp_warn(JOB, "job %s group %u op #%" PRIu64 ": mismatch: %s", g->job->id, g->id, coll->seq, detail);
        for (uint32_t k = 0; k < g->size; k++) {
            sp_op_complete(eng, coll->ops[k], SPC_ERR_MISMATCH, detail);
            coll->ops[k] = NULL;
        }
        coll_free(g, coll);
        return;
    }
    switch (coll->ops[0]->sqe.opcode) {
    case SP_OP_BARRIER:
        sp_exec_barrier(eng, g, coll);
        break;
    case SP_OP_ALLREDUCE:
        sp_exec_allreduce(eng, g, coll);
        break;
    }
    coll_free(g, coll);
}

/* The collective with sequence number `seq`, created (*fresh_p) when this is its
 * first arrival. */
static sp_coll_t *coll_get(sp_group_t *g, uint64_t seq, bool *fresh_p)
{
    sp_coll_t **pp = &g->colls;
    while (*pp != NULL && (*pp)->seq < seq)
        pp = &(*pp)->next;
    *fresh_p = false;
    if (*pp != NULL && (*pp)->seq == seq)
        return *pp;
    *fresh_p = true;
    sp_coll_t *coll = calloc(1, sizeof *coll + g->size * sizeof coll->ops[0]);
    if (coll == NULL)
        return NULL;
    coll->seq = seq;
    coll->deadline_ns = UINT64_MAX;
    coll->next = *pp;
    *pp = coll;
    return coll;
}

static void group_arrive(sp_engine_t *eng, sp_group_t *g, uint32_t grank, sp_op_t *op)
{
    if (g->broken != SPC_OK) {
        sp_op_complete(eng, op, g->broken, g->broken_detail);
        return;
    }
    uint64_t seq = g->next_seq[grank]++;
    bool fresh;
    sp_coll_t *coll = coll_get(g, seq, &fresh);
    if (coll == NULL) {
        /* Without a record the ranks' sequence numbers would drift apart. */
        group_break(eng, g, SPC_ERR_NO_MEMORY, "out of memory matching a collective");
        sp_op_complete(eng, op, SPC_ERR_NO_MEMORY, "out of memory matching a collective");
        return;
    }
    /* Draining: collectives already under way may finish; none may start. */
    if (fresh && atomic_load_explicit(&eng->draining, memory_order_relaxed)) {
        coll->failed = SPC_ERR_SHUTTING_DOWN;
        snprintf(coll->failed_detail, sizeof coll->failed_detail, "spd is shutting down");
    }

    if (coll->failed != SPC_OK) {
        sp_op_complete(eng, op, coll->failed, coll->failed_detail);
        if (++coll->passed == g->size)
            coll_free(g, coll);
        return;
    }
    coll->ops[grank] = op;
    coll->arrived++;
    uint64_t timeout_ms = op->sqe.timeout_ms ? op->sqe.timeout_ms : (uint64_t)eng->cfg->op_timeout_ms;
    uint64_t deadline = op->arrive_ns + timeout_ms * 1000000ull;
    if (deadline < coll->deadline_ns)
        coll->deadline_ns = deadline;
    if (deadline < eng->next_deadline_ns)
        eng->next_deadline_ns = deadline;
    sp_trace(JOB, "group %u op #%" PRIu64 ": rank %u arrived (%u of %u)", g->id, seq, grank, coll->arrived, g->size);

    if (coll->arrived == g->size)
        coll_run(eng, g, coll);
}

void sp_op_dispatch(sp_engine_t *eng, sp_op_t *op)
{
    sp_client_t *c = op->client;
    char detail[SP_DETAIL_BYTES];
    uint32_t grank;

    if (op->sqe.ntensors > SP_MAX_TENSORS || op->sqe.flags != 0) {
        snprintf(detail, sizeof detail, "malformed submission (%u tensors, flags 0x%x)", op->sqe.ntensors,
                 op->sqe.flags);
        sp_op_complete(eng, op, SPC_ERR_INVALID_ARG, detail);
        return;
    }
    switch (op->sqe.opcode) {
    case SP_OP_NOOP:
        if (atomic_load_explicit(&eng->draining, memory_order_relaxed))
            sp_op_complete(eng, op, SPC_ERR_SHUTTING_DOWN, "spd is shutting down");
        else
            sp_op_complete(eng, op, SPC_OK, NULL);
        return;
    case SP_OP_BARRIER:
    case SP_OP_ALLREDUCE: {
        sp_group_t *g = client_group(c, op->sqe.group, &grank);
        if (g == NULL) {
            snprintf(detail, sizeof detail, "%s on group %u: this client is not a member of it",
                     op_name(op->sqe.opcode), op->sqe.group);
            sp_op_complete(eng, op, SPC_ERR_INVALID_ARG, detail);
            return;
        }
        validate_local(op);
        group_arrive(eng, g, grank, op);
        return;
    }
    default:
        snprintf(detail, sizeof detail, "unknown opcode %u", op->sqe.opcode);
        sp_op_complete(eng, op, SPC_ERR_UNSUPPORTED, detail);
        return;
    }
}

/* ---------------------------------------------------------------- deadlines */

uint64_t sp_job_check_deadlines(sp_engine_t *eng, uint64_t now)
{
    uint64_t next = UINT64_MAX;
    char detail[SP_DETAIL_BYTES];

    for (sp_job_t *job = eng->jobs; job != NULL; job = job->next) {
        sp_group_t *g = job->world;
        if (g == NULL)
            continue;
        sp_coll_t *coll = g->colls, *cnext;
        for (; coll != NULL; coll = cnext) {
            cnext = coll->next;
            if (coll->failed != SPC_OK || coll->arrived == 0)
                continue;
            if (coll->deadline_ns > now) {
                if (coll->deadline_ns < next)
                    next = coll->deadline_ns;
                continue;
            }
            const sp_op_t *any = NULL;
            size_t off = (size_t)snprintf(detail, sizeof detail, "timed out waiting for rank");
            uint32_t missing = 0;
            for (uint32_t r = 0; r < g->size; r++) {
                if (coll->ops[r] != NULL) {
                    any = coll->ops[r];
                    continue;
                }
                if (missing < 16 && off < sizeof detail)
                    off += (size_t)snprintf(detail + off, sizeof detail - off, "%s %u", missing ? "," : "", r);
                missing++;
            }
            if (off < sizeof detail)
                snprintf(detail + off, sizeof detail - off, "%s (%u of %u missing) in %s #%" PRIu64 " of job %s",
                         missing > 16 ? ", ..." : "", missing, g->size, any ? op_name(any->sqe.opcode) : "op",
                         coll->seq, job->id);
            sp_warn(JOB, "group %u: %s", g->id, detail);
            coll_fail(eng, g, coll, SPC_ERR_TIMEOUT, detail);
        }
    }
    return next;
}
