/*
 * coll.c — collective matching: an op's dispatch to its group, the collective
 * it belongs to (a rank's k-th op on a channel is collective k there), the run
 * once every rank is in and agrees, failure and deadlines. A failed collective
 * stays until every rank has collected its error; a lost member breaks the
 * group for good (SPC_ERR_PEER_LOST). Runs under the engine lock. The story:
 * docs/architecture.md, "Matching and failure".
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/client.h"
#include "core/coll.h"
#include "core/engine.h"
#include "core/exec.h"
#include "core/job.h"
#include "core/mem.h"
#include "core/ops.h"
#include "core/transport.h"
#include "core/validate.h"

/* ---------------------------------------------------------------- failure */

static void coll_free(sp_group_t *g, sp_coll_t *coll)
{
    sp_coll_t **pp = &g->colls[coll->channel];
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
    sp_stats_coll_done(eng, g->stats, coll->ops, g->size, 0, st, detail, NULL);
    coll->failed = st;
    snprintf(coll->failed_detail, sizeof coll->failed_detail, "%s", detail);
    sp_engine_wakes_hold(eng);
    for (uint32_t r = 0; r < g->size; r++) {
        if (coll->ops[r] != NULL) {
            sp_op_complete(eng, coll->ops[r], st, detail);
            coll->ops[r] = NULL;
            coll->passed++;
        }
    }
    sp_engine_wakes_release(eng);
    if (coll->passed == g->size)
        coll_free(g, coll);
}

void sp_group_break(sp_engine_t *eng, sp_group_t *g, spc_status_t st, const char *detail)
{
    if (g->broken == SPC_OK) {
        g->broken = st;
        snprintf(g->broken_detail, sizeof g->broken_detail, "%s", detail);
    }
    for (unsigned ch = 0; ch < SP_CHANNELS; ch++) {
        while (g->colls[ch] != NULL) {
            sp_coll_t *coll = g->colls[ch];
            if (coll->failed == SPC_OK) {
                coll_fail(eng, g, coll, st, detail);
                if (g->colls[ch] == coll)   /* still there: ranks missing; nobody will come */
                    coll_free(g, coll);
            } else {
                coll_free(g, coll);
            }
        }
    }
}

/*
 * A rank of another daemon is gone, but what it sent is here: collectives it
 * already joined may still finish (the others' daemons may have finished them
 * already); those it never joined fail, and so does every later one.
 */
void sp_group_break_after(sp_engine_t *eng, sp_group_t *g, uint32_t grank, spc_status_t st, const char *detail)
{
    if (g->broken == SPC_OK) {
        g->broken = st;
        snprintf(g->broken_detail, sizeof g->broken_detail, "%s", detail);
    }
    for (unsigned ch = 0; ch < SP_CHANNELS; ch++) {
        sp_coll_t *next;
        for (sp_coll_t *coll = g->colls[ch]; coll != NULL; coll = next) {
            next = coll->next;
            if (coll->failed != SPC_OK || coll->ops[grank] != NULL)
                continue;
            coll_fail(eng, g, coll, st, detail);
        }
    }
}

/* ---------------------------------------------------------------- after a restart */

/*
 * A group a new spd rebuilt (sp_job_resume) knows, of each rank that came back,
 * the lowest op it replays on each channel: that rank saw every collective
 * below it complete, and will never submit it again. So a collective below
 * it that another rank replays (its completion was lost as spd died, between
 * the ranks' completion entries) can never run: it fails at once, naming the
 * rank that saw it complete, rather than at its deadline. The ranks that will
 * not come count as passed, so the record goes with the last that does.
 * Returns whether coll failed (and may be gone).
 */
static bool coll_restart_orphan(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll)
{
    char detail[SP_DETAIL_BYTES], who[40];
    uint32_t gone = 0, first = UINT32_MAX;

    if (g->resume_first == NULL || coll->failed != SPC_OK)
        return false;
    for (uint32_t q = 0; q < g->size; q++) {
        if (coll->ops[q] == NULL && g->resume_first[coll->channel * g->size + q] > coll->seq) {
            gone++;
            if (first == UINT32_MAX)
                first = q;
        }
    }
    if (gone == 0)
        return false;
    sp_rank_text(who, sizeof who, g, first);
    snprintf(detail, sizeof detail, "spd restarted as op #%" PRIu64 " of %s group %u completed: rank %s saw it "
             "complete and this rank did not, so the ranks disagree on what completed (its outputs may hold the "
             "result)", coll->seq, g->kind, g->id, who);
    sp_warn(JOB, "job %s: %s", g->job->id, detail);
    coll->passed += gone;
    coll_fail(eng, g, coll, SPC_ERR_RESTARTED, detail);
    return true;
}

void sp_group_resume_check(sp_engine_t *eng, sp_group_t *g)
{
    for (unsigned ch = 0; ch < SP_CHANNELS; ch++) {
        sp_coll_t *next;
        for (sp_coll_t *coll = g->colls[ch]; coll != NULL; coll = next) {
            next = coll->next;
            coll_restart_orphan(eng, g, coll);
        }
    }
}

/* Whether every rank replays coll's op as one the spd before took, and one's
 * outputs overlap its inputs: the first run may have written them, whole or in
 * part, so a second would read its own results (sp_shm.h, SP_REPLAY_*). */
static bool coll_unsafe_replay(const sp_group_t *g, const sp_coll_t *coll)
{
    bool aliased = false;
    for (uint32_t r = 0; r < g->size; r++) {
        const sp_op_t *op = coll->ops[r];
        if (op->client == NULL || !(op->sqe.replay & SP_REPLAY_TAKEN))
            return false;   /* that rank's op never reached the old spd: the collective never ran */
        aliased |= (op->sqe.replay & SP_REPLAY_ALIASED) != 0;
    }
    return aliased;
}

/* ---------------------------------------------------------------- dispatch */

/* A client may deregister a region while an op naming it waits for the other
 * ranks (validation was at submit). Such an op is refused here like one whose
 * region was bad from the start, before a task looks its buffers up. */
static void coll_recheck_regions(sp_op_t *op)
{
    sp_err_t e = SP_ERR_INIT;
    if (op->client == NULL || op->local.status != SPC_OK)
        return;
    for (uint32_t i = 0; i < op->sqe.ntensors; i++) {
        spc_status_t st = sp_mem_check(op->client, &op->tensor[i], op->need[i], &e);
        if (st != SPC_OK) {
            sp_err_set(&op->local, st, "%s (deregistered while the op waited)", e.msg);
            return;
        }
    }
}

/* Every rank has arrived: check, then hand the data movement to a task. */
static void coll_run_held(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll)
{
    char detail[SP_DETAIL_BYTES];

    for (uint32_t r = 0; r < g->size; r++)
        coll_recheck_regions(coll->ops[r]);

    /* A rank whose own request was refused: it gets its error, the others learn
     * which rank and why. */
    for (uint32_t r = 0; r < g->size; r++) {
        sp_op_t *bad = coll->ops[r];
        if (bad->local.status == SPC_OK)
            continue;
        char who[40];
        sp_rank_text(who, sizeof who, g, r);
        snprintf(detail, sizeof detail, "rank %s's request was refused: %s", who, bad->local.msg);
        sp_warn(JOB, "job %s group %u op #%" PRIu64 ": %s", g->job->id, g->id, coll->seq, detail);
        sp_stats_coll_done(eng, g->stats, coll->ops, g->size, 0, bad->local.status, detail, NULL);
        const sp_err_t why = bad->local;   /* bad is freed once it completes, in the loop */
        for (uint32_t k = 0; k < g->size; k++) {
            sp_op_t *op = coll->ops[k];
            coll->ops[k] = NULL;
            if (op->local.status != SPC_OK)
                sp_op_complete(eng, op, op->local.status, op->local.msg);
            else if (why.status == SPC_ERR_RESTARTED)   /* overtaken by a restart, not refused */
                sp_op_complete(eng, op, SPC_ERR_RESTARTED, why.msg);
            else
                sp_op_complete(eng, op, SPC_ERR_PEER_REFUSED, detail);
        }
        coll_free(g, coll);
        return;
    }
    if (coll_unsafe_replay(g, coll)) {
        snprintf(detail, sizeof detail, "spd restarted mid-op; not retried (in place): %s #%" PRIu64 " may have run "
                 "in part before, and its outputs overlap its inputs", sp_op_name(coll->ops[0]->sqe.opcode),
                 coll->seq);
        sp_warn(JOB, "job %s group %u: %s", g->job->id, g->id, detail);
        sp_stats_coll_done(eng, g->stats, coll->ops, g->size, 0, SPC_ERR_RESTARTED, detail, NULL);
        for (uint32_t k = 0; k < g->size; k++) {
            sp_op_complete(eng, coll->ops[k], SPC_ERR_RESTARTED, detail);
            coll->ops[k] = NULL;
        }
        coll_free(g, coll);
        return;
    }
    sp_err_t e = SP_ERR_INIT;
    if (!sp_coll_agree(g, coll->ops, &e)) {
        sp_warn(JOB, "job %s group %u op #%" PRIu64 ": mismatch: %s", g->job->id, g->id, coll->seq, e.msg);
        sp_stats_coll_done(eng, g->stats, coll->ops, g->size, 0, e.status, e.msg, NULL);
        for (uint32_t k = 0; k < g->size; k++) {
            sp_op_complete(eng, coll->ops[k], e.status, e.msg);
            coll->ops[k] = NULL;
        }
        coll_free(g, coll);
        return;
    }
    sp_task_create(eng, g, coll->ops);
    coll_free(g, coll);
}

/* coll_run's refusals complete every rank's op: their wakes go out together. */
static void coll_run(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll)
{
    sp_engine_wakes_hold(eng);
    coll_run_held(eng, g, coll);
    sp_engine_wakes_release(eng);
}

/* Runs coll once every rank is in and this daemon's own message to the others
 * (if any) is off: until then the send may still read its ranks' buffers. */
static void coll_maybe_run(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll)
{
    if (coll->arrived == g->size && coll->sends_pending == 0 && (g->nremote == 0 || coll->sent))
        coll_run(eng, g, coll);
}

/* The collective with sequence number `seq`, created (*fresh_p) when this is its
 * first arrival. */
static sp_coll_t *coll_get(sp_group_t *g, unsigned channel, uint64_t seq, bool *fresh_p)
{
    sp_coll_t **pp = &g->colls[channel];
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
    coll->channel = (uint8_t)channel;
    coll->deadline_ns = UINT64_MAX;
    coll->next = *pp;
    *pp = coll;
    return coll;
}

/* Puts an arriving op in its place and keeps the collective's deadline. */
static void coll_place(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll, uint32_t grank, sp_op_t *op)
{
    coll->ops[grank] = op;
    op->seq = coll->seq;
    sp_stats_hold(op, g->stats);
    if (coll->arrived++ == 0)
        coll->first_ns = op->arrive_ns;
    uint64_t timeout_ms = op->sqe.timeout_ms ? op->sqe.timeout_ms : (uint64_t)eng->cfg->op_timeout_ms;
    uint64_t deadline = op->arrive_ns + timeout_ms * 1000000ull;
    if (deadline < coll->deadline_ns)
        coll->deadline_ns = deadline;
    if (deadline < eng->next_deadline_ns)
        eng->next_deadline_ns = deadline;
    sp_trace(JOB, "group %u channel %u op #%" PRIu64 ": rank %u arrived (%u of %u)%s", g->id, coll->channel,
             coll->seq, grank, coll->arrived, g->size, op->client == NULL ? " from another daemon" : "");
}

/* A broken group takes an op only into a live collective that a lost rank of
 * another daemon joined before it went (group_break_after). */
static bool broken_refuses(sp_group_t *g, unsigned channel, uint64_t seq)
{
    if (g->broken == SPC_OK)
        return false;
    for (sp_coll_t *coll = g->colls[channel]; coll != NULL; coll = coll->next)
        if (coll->seq == seq)
            return coll->failed != SPC_OK;
    return true;
}

/* Every rank of this daemon arrived at coll: the data path takes what the
 * group's other daemons need of it. -1: it could not, and coll failed (and
 * may be gone). */
static int coll_send(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll)
{
    if (eng->net_ops != NULL)
        return eng->net_ops->send_coll(eng, g, coll);
    coll->sent = true;
    sp_coll_fail_net(eng, g, coll, "spd has no data path to other daemons (set peer_listen or peers)");
    return -1;
}

/*
 * The sequence number of op: the rank's next on its channel, or, for an op a
 * client replays to the spd that adopted it, the one it had (SP_REPLAY_SEQ),
 * which must lie between the first the rank replays and its next (sp_job_resume)
 * and must not have arrived already. False: op was refused, and completed.
 */
static bool arrive_seq(sp_engine_t *eng, sp_group_t *g, uint32_t grank, sp_op_t *op, uint64_t *seq_p)
{
    size_t k = (size_t)op->sqe.channel * g->size + grank;
    if (!(op->sqe.replay & SP_REPLAY_SEQ)) {
        *seq_p = g->next_seq[k];
        return true;
    }
    uint64_t seq = op->sqe.replay_seq;
    char detail[SP_DETAIL_BYTES];
    if (g->resume_first == NULL || seq < g->resume_first[k] || seq >= g->next_seq[k]) {
        snprintf(detail, sizeof detail, "a replay of op #%" PRIu64 " on group %u channel %u, which this rank did not "
                 "bring back to this spd", seq, g->id, op->sqe.channel);
    } else {
        const sp_coll_t *coll = g->colls[op->sqe.channel];
        while (coll != NULL && coll->seq < seq)
            coll = coll->next;
        if (coll == NULL || coll->seq != seq || coll->ops[grank] == NULL) {
            *seq_p = seq;
            return true;
        }
        snprintf(detail, sizeof detail, "a second replay of op #%" PRIu64 " on group %u channel %u", seq, g->id,
                 op->sqe.channel);
    }
    sp_stats_request_done(eng, g, op, SPC_ERR_INVALID_ARG);
    sp_op_complete(eng, op, SPC_ERR_INVALID_ARG, detail);
    return false;
}

static void group_arrive(sp_engine_t *eng, sp_group_t *g, uint32_t grank, sp_op_t *op)
{
    unsigned ch = op->sqe.channel;
    uint64_t seq;
    if (!arrive_seq(eng, g, grank, op, &seq))
        return;
    if (broken_refuses(g, ch, seq)) {
        sp_stats_request_done(eng, g, op, g->broken);
        sp_op_complete(eng, op, g->broken, g->broken_detail);
        return;
    }
    if (!(op->sqe.replay & SP_REPLAY_SEQ))
        g->next_seq[ch * g->size + grank]++;
    bool fresh;
    sp_coll_t *coll = coll_get(g, ch, seq, &fresh);
    if (coll == NULL) {
        /* Without a record the ranks' sequence numbers would drift apart. */
        sp_group_break(eng, g, SPC_ERR_NO_MEMORY, "out of memory matching a collective");
        sp_stats_request_done(eng, g, op, SPC_ERR_NO_MEMORY);
        sp_op_complete(eng, op, SPC_ERR_NO_MEMORY, "out of memory matching a collective");
        return;
    }
    /* Draining: collectives already under way may finish; none may start. */
    if (fresh && atomic_load_explicit(&eng->draining, memory_order_relaxed)) {
        sp_stats_request_done(eng, g, op, SPC_ERR_SHUTTING_DOWN);   /* the collective's one count */
        coll->failed = SPC_ERR_SHUTTING_DOWN;
        snprintf(coll->failed_detail, sizeof coll->failed_detail, "spd is shutting down");
    }

    if (coll->failed != SPC_OK) {
        sp_op_complete(eng, op, coll->failed, coll->failed_detail);
        if (++coll->passed == g->size)
            coll_free(g, coll);
        return;
    }
    coll_place(eng, g, coll, grank, op);
    coll->arrived_local++;
    if (coll_restart_orphan(eng, g, coll))
        return;
    /* This daemon's last rank is in: the other daemons get what they need of ours. */
    if (g->nremote > 0 && coll->arrived_local == g->nlocal && !coll->sent && coll_send(eng, g, coll) != 0)
        return;
    coll_maybe_run(eng, g, coll);
}

void sp_coll_arrive_remote(sp_engine_t *eng, sp_group_t *g, unsigned channel, uint64_t seq, uint32_t grank,
                           sp_op_t *op)
{
    if (broken_refuses(g, channel, seq)) {
        sp_op_complete(eng, op, g->broken, g->broken_detail);
        return;
    }
    bool fresh;
    sp_coll_t *coll = coll_get(g, channel, seq, &fresh);
    if (coll == NULL) {
        sp_group_break(eng, g, SPC_ERR_NO_MEMORY, "out of memory matching a collective");
        sp_op_complete(eng, op, SPC_ERR_NO_MEMORY, "out of memory matching a collective");
        return;
    }
    if (coll->failed != SPC_OK) {
        sp_op_complete(eng, op, coll->failed, coll->failed_detail);
        if (++coll->passed == g->size)
            coll_free(g, coll);
        return;
    }
    if (coll->ops[grank] != NULL) {
        sp_op_complete(eng, op, SPC_ERR_PROTOCOL, "a second message for one rank of one collective");
        return;
    }
    coll_place(eng, g, coll, grank, op);
    coll_maybe_run(eng, g, coll);
}

bool sp_coll_passed(const sp_group_t *g, unsigned channel, uint64_t seq)
{
    /* A broken group refuses what comes (broken_refuses), with its own reason. */
    if (g->nlocal == 0 || g->broken != SPC_OK)
        return false;
    for (const sp_coll_t *coll = g->colls[channel]; coll != NULL; coll = coll->next)
        if (coll->seq == seq)
            return false;
    for (uint32_t r = 0; r < g->size; r++) {
        size_t k = (size_t)channel * g->size + r;
        if (g->job->members[g->ranks[r]].node != 0)
            continue;
        if (g->next_seq[k] <= seq || (g->resume_first != NULL && g->resume_first[k] <= seq))
            return false;
    }
    return true;
}

void sp_coll_fail_net(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll, const char *detail)
{
    sp_warn(JOB, "job %s group %u op #%" PRIu64 ": %s", g->job->id, g->id, coll->seq, detail);
    coll_fail(eng, g, coll, SPC_ERR_TRANSPORT, detail);
}

void sp_coll_sent(sp_engine_t *eng, const char *job_id, uint32_t group_index, unsigned channel, uint64_t seq)
{
    sp_job_t *job = sp_job_find(eng, job_id);
    sp_group_t *g = job != NULL ? sp_job_group_by_index(job, group_index) : NULL;
    if (g == NULL)
        return;
    for (sp_coll_t *coll = g->colls[channel]; coll != NULL; coll = coll->next) {
        if (coll->seq == seq) {
            if (coll->sends_pending > 0 && --coll->sends_pending == 0 && coll->failed == SPC_OK)
                coll_maybe_run(eng, g, coll);
            return;
        }
    }
}

/* Whether device ops across daemons can run here; why not in e. */
static bool xdev_usable(sp_engine_t *eng, sp_err_t *e)
{
    if (eng->xdev_ops != NULL)
        return eng->xdev_ops->usable(eng, e);
    sp_err_set(e, SPC_ERR_NO_DEVICE, "NCCL was not set up in this spd");
    return false;
}

void sp_op_dispatch(sp_engine_t *eng, sp_op_t *op)
{
    sp_client_t *c = op->client;
    char detail[SP_DETAIL_BYTES];
    uint32_t grank;

    if (op->sqe.ntensors > SP_MAX_TENSORS || op->sqe.channel >= SP_CHANNELS) {
        snprintf(detail, sizeof detail, "malformed submission (%u tensors, channel %u)", op->sqe.ntensors,
                 op->sqe.channel);
        sp_stats_request_done(eng, NULL, op, SPC_ERR_INVALID_ARG);
        sp_op_complete(eng, op, SPC_ERR_INVALID_ARG, detail);
        return;
    }
    const sp_op_kind_t *k = sp_op_kind(op->sqe.opcode);
    if (k == NULL) {
        snprintf(detail, sizeof detail, "unknown opcode %u", op->sqe.opcode);
        sp_stats_request_done(eng, NULL, op, SPC_ERR_UNSUPPORTED);
        sp_op_complete(eng, op, SPC_ERR_UNSUPPORTED, detail);
        return;
    }
    if (!(k->flags & SP_OPK_GROUP)) {   /* noop: the round-trip probe */
        spc_status_t st = atomic_load_explicit(&eng->draining, memory_order_relaxed) ? SPC_ERR_SHUTTING_DOWN : SPC_OK;
        sp_stats_request_done(eng, NULL, op, st);
        sp_op_complete(eng, op, st, st == SPC_OK ? NULL : "spd is shutting down");
        return;
    }
    sp_group_t *g = sp_client_group(c, op->sqe.group, &grank);
    if (g == NULL) {
        snprintf(detail, sizeof detail, "%s on group %u: this client is not a member of it",
                 sp_op_name(op->sqe.opcode), op->sqe.group);
        sp_stats_request_done(eng, NULL, op, SPC_ERR_INVALID_ARG);
        sp_op_complete(eng, op, SPC_ERR_INVALID_ARG, detail);
        return;
    }
    if (op->local.status == SPC_OK) {   /* else its stream refused it, saying why */
        sp_op_validate(op, g->size);
        if (op->sqe.stream != 0)   /* its stream took it: there is a GPU layer */
            SP_TRANSPORT_CALL(eng->gpu_ops, op_validate, op);
    }
    /* Device tensors cross daemons through NCCL (nccl.c), on lanes of
     * the NCCL thread's. Where it cannot run, the op is refused here, with
     * the reason, before anything moves. A refused stream op still
     * settles its stream's done (sp_op_complete). */
    sp_err_t e = SP_ERR_INIT;
    if (op->local.status == SPC_OK && op->device && g->nremote > 0 && !xdev_usable(eng, &e)) {
        sp_err_set(&op->local, SPC_ERR_NO_DEVICE, "%s on GPU memory in a group that spans daemons needs NCCL: %s",
                   sp_op_name(op->sqe.opcode), e.msg);
    }
    group_arrive(eng, g, grank, op);
}

/* ---------------------------------------------------------------- deadlines */

size_t sp_rank_text(char *buf, size_t len, const sp_group_t *g, uint32_t grank)
{
    if (g == g->job->world)
        return (size_t)snprintf(buf, len, "%u", grank);
    return (size_t)snprintf(buf, len, "%u (job rank %u)", grank, g->ranks[grank]);
}

static uint64_t coll_check_deadlines(sp_engine_t *eng, sp_group_t *g, unsigned ch, uint64_t now, uint64_t next)
{
    char detail[SP_DETAIL_BYTES];
    sp_coll_t *cnext;

    for (sp_coll_t *coll = g->colls[ch]; coll != NULL; coll = cnext) {
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
            if (missing < 8 && off < sizeof detail) {
                off += (size_t)snprintf(detail + off, sizeof detail - off, "%s ", missing ? "," : "");
                if (off < sizeof detail)
                    off += sp_rank_text(detail + off, sizeof detail - off, g, r);
            }
            missing++;
        }
        if (off < sizeof detail)
            snprintf(detail + off, sizeof detail - off, "%s (%u of %u missing) in %s #%" PRIu64 " of %s group %u, job %s",
                     missing > 8 ? ", ..." : "", missing, g->size, any ? sp_op_name(any->sqe.opcode) : "op",
                     coll->seq, g->kind, g->id, g->job->id);
        sp_warn(JOB, "group %u: %s", g->id, detail);
        coll_fail(eng, g, coll, SPC_ERR_TIMEOUT, detail);
    }
    return next;
}

uint64_t sp_job_check_deadlines(sp_engine_t *eng, uint64_t now)
{
    uint64_t next = UINT64_MAX;

    for (sp_job_t *job = eng->jobs; job != NULL; job = job->next) {
        for (sp_group_t *g = job->groups; g != NULL; g = g->next)
            for (unsigned ch = 0; ch < SP_CHANNELS; ch++)
                next = coll_check_deadlines(eng, g, ch, now, next);
    }
    return next;
}
