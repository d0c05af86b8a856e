/*
 * net_recv.c — the receiving side of the data path: one inbox per daemon
 * whose link authenticated, the worker's active-message handler (which checks
 * a message before it keeps a byte, and bounds what a node may queue), and
 * delivery in each sender's order, turning a collective's message into remote
 * ops (net_wire.c) that arrive at their collective, or a rank's departure
 * into the job's news. net.c says why it is built so.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "cluster/net_int.h"
#include "core/client.h"
#include "core/coll.h"
#include "core/engine.h"
#include "core/job.h"
#include "core/stage.h"

#define PARK_TIMEOUT_NS (60ull * 1000000000ull)

/* Frees a remote op's share of its stage. */
void sp_net_stage_unref(sp_stage_t *st)
{
    if (st != NULL && --st->refs == 0)
        free(st);
}

/* The group a collective's message is for; NULL when it is not here yet. */
static sp_group_t *stage_group(sp_engine_t *eng, const sp_stage_t *st)
{
    sp_job_t *job = sp_job_find(eng, st->hdr.job);
    return job != NULL && job->complete ? sp_job_group_by_index(job, st->hdr.group_index) : NULL;
}

/* A message for a collective this daemon's ranks are past: the sender's
 * daemon restarted and lost its result, or (here restarted) ours lost the
 * sender's inputs. It does not run here again: its ops are let go of. The
 * sender gets the copy kept of this daemon's message, to run it there; or,
 * with none kept (the inputs of the ranks here may be overwritten since), the
 * news that it cannot run, unless the message is such news itself. True: it
 * was so. */
static bool stage_overtaken(sp_engine_t *eng, sp_stage_t *st, sp_group_t *g, sp_wire_arrival_t *arrivals, int n)
{
    const sp_wire_hdr_t *h = &st->hdr;
    if (!sp_coll_passed(g, h->channel, h->seq))
        return false;
    if (h->rank == SP_WIRE_AGAIN) {   /* both sides are past it: nothing to answer */
        for (int k = 0; k < n; k++)
            if (arrivals[k].op != NULL)
                sp_op_complete(eng, arrivals[k].op, SPC_ERR_RESTARTED, "sent again; ran here already");
        return true;
    }
    const sp_op_t *first = NULL;
    bool news = true;
    for (int k = 0; k < n; k++) {
        if (arrivals[k].op == NULL)
            continue;
        first = first != NULL ? first : arrivals[k].op;
        news &= arrivals[k].op->local.status != SPC_OK;
    }
    char detail[SP_DETAIL_BYTES];
    snprintf(detail, sizeof detail, "op #%" PRIu64 " of %s group #%u completed on node %s, not on node %s, when "
             "a spd restarted: the inputs of its ranks on %s may be overwritten since, so it cannot run again", h->seq,
             g->kind, g->index, eng->node, h->from, eng->node);
    if (first != NULL && !news && !sp_net_send_kept(eng, g, h)) {
        sp_warn(XPORT, "job %s: %s", h->job, detail);
        sp_net_send_overtaken(eng, g, h, &first->sqe, detail);
    }
    for (int k = 0; k < n; k++)
        if (arrivals[k].op != NULL)
            sp_op_complete(eng, arrivals[k].op, SPC_ERR_RESTARTED, detail);
    return true;
}

/* Turns a message into remote ops and lets each arrive at its collective g. */
static void stage_deliver(sp_engine_t *eng, sp_stage_t *st, sp_group_t *g)
{
    const sp_wire_hdr_t *h = &st->hdr;
    sp_err_t e = SP_ERR_INIT;
    sp_wire_arrival_t *arrivals = calloc(g->size, sizeof *arrivals);
    int n = arrivals != NULL ? sp_net_coll_take(g, h, st->data, st->len, arrivals, &e) : -1;
    if (n < 0) {
        sp_warn(XPORT, "node %s: job %s: %s; dropped", st->from, h->job,
                arrivals != NULL ? e.msg : "out of memory taking a message");
        free(arrivals);
        free(st);
        return;
    }
    if (stage_overtaken(eng, st, g, arrivals, n)) {
        free(arrivals);
        free(st);
        return;
    }
    uint64_t now = sp_now_ns();
    uint32_t refused = 0;
    st->refs = 1;   /* ours, while we deliver */
    for (int k = 0; k < n; k++) {
        sp_op_t *op = arrivals[k].op;
        if (op == NULL) {
            refused++;
            continue;
        }
        op->arrive_ns = now;
        op->stage = st;
        st->refs++;
        sp_coll_arrive_remote(eng, g, h->channel, h->seq, arrivals[k].grank, op);
    }
    if (refused > 0)
        sp_warn(XPORT, "node %s: job %s group %u: %u of %d ranks' descriptors dropped, the first as %s", st->from,
                h->job, h->group_index, refused, n, e.msg);
    free(arrivals);
    sp_net_stage_unref(st);
}

void sp_net_inbox_clear(inbox_t *in)
{
    while (in->queue != NULL) {
        sp_stage_t *st = in->queue;
        in->queue = st->next;
        if (st->ready)
            free(st);
        else
            st->refs = UINT32_MAX;   /* its receive is in flight: on_rndv_done frees it */
    }
    in->next = 0;
    in->queued = 0;
    in->queued_bytes = 0;
}

inbox_t *sp_net_inbox_find(struct sp_net *n, const char *node)
{
    for (uint32_t i = 0; i < n->ninboxes; i++)
        if (strcmp(n->inboxes[i].node, node) == 0)
            return &n->inboxes[i];
    return NULL;
}

/* Takes st off the head of its inbox. */
static void inbox_pop(inbox_t *in, sp_stage_t *st)
{
    in->queue = st->next;
    in->next++;
    in->queued--;
    in->queued_bytes -= st->charged;
    st->next = NULL;
}

static void on_rank_lost(sp_engine_t *eng, sp_stage_t *st)
{
    char why[SP_DETAIL_BYTES];
    snprintf(why, sizeof why, "%.*s", (int)(st->len < sizeof why ? st->len : sizeof why - 1), (const char *)st->data);
    sp_job_t *job = sp_job_find(eng, st->hdr.job);
    if (job != NULL && job->members != NULL && st->hdr.rank < job->world_size &&
        sp_job_node_index(job, st->from, false) == job->members[st->hdr.rank].node)
        sp_job_remote_rank_lost(eng, job, st->hdr.rank, why);
    free(st);
}

/* Delivers what is next in line from one daemon; stops at a message whose job
 * or group is not here yet (retried on the next pass). */
int sp_net_inbox_drain(sp_engine_t *eng, inbox_t *in)
{
    int work = 0;
    uint64_t now = sp_now_ns();
    while (in->queue != NULL && in->queue->msgno == in->next && in->queue->ready) {
        sp_stage_t *st = in->queue;
        sp_group_t *g = st->hdr.kind == SP_WIRE_COLL ? stage_group(eng, st) : NULL;
        if (st->hdr.kind == SP_WIRE_COLL && g == NULL) {
            if (now - st->arrived_ns < PARK_TIMEOUT_NS)
                break;
            sp_warn(XPORT, "node %s: job %s group %u never appeared here; its message dropped", st->from,
                    st->hdr.job, st->hdr.group_index);
            inbox_pop(in, st);
            free(st);
            continue;
        }
        inbox_pop(in, st);
        if (g != NULL)
            stage_deliver(eng, st, g);
        else
            on_rank_lost(eng, st);
        work++;
    }
    return work;
}

static void on_rndv_done(void *req, ucs_status_t status, size_t length, void *user_data)
{
    sp_stage_t *st = user_data;
    sp_engine_t *eng = st->eng;
    ucp_request_free(req);
    if (st->refs == UINT32_MAX) {   /* its inbox was cleared meanwhile */
        free(st);
        return;
    }
    if (status != UCS_OK || length != st->len) {
        /* The stream has a hole now: what follows from that daemon cannot be
         * delivered in order. Its link is failing anyway; the jobs hear of it. */
        sp_warn(XPORT, "node %s: receiving a message failed: %s", st->from, ucs_status_string(status));
        st->len = 0;
        st->hdr.kind = SP_WIRE_RANK_LOST;
        st->hdr.rank = UINT32_MAX;   /* delivered as a no-op, to keep the order */
    }
    st->ready = true;
    struct sp_net *n = eng->net;
    for (uint32_t i = 0; i < n->ninboxes; i++)
        if (strcmp(n->inboxes[i].node, st->from) == 0 && !n->delivering) {
            n->delivering = true;
            sp_net_inbox_drain(eng, &n->inboxes[i]);
            n->delivering = false;
        }
}

/* Counts a message dropped unread; says so at most once a second, with how many. */
static void net_drop(struct sp_net *n, const sp_wire_hdr_t *h, size_t length, const char *why)
{
    n->dropped++;
    uint64_t now = sp_now_ns();
    if (now - n->drop_logged_ns < 1000000000ull)
        return;
    sp_warn(XPORT, "ucx: dropped a %zu-byte message naming node %s (run %016" PRIx64 ", #%" PRIu64 "): %s; "
            "%" PRIu64 " dropped since the last report", length, h->from, h->incarnation, h->msgno, why,
            n->dropped - n->dropped_logged);
    n->dropped_logged = n->dropped;
    n->drop_logged_ns = now;
}

/* Why a message is not taken into in, or NULL. in is its node's, NULL when none. */
static const char *am_refusal(const inbox_t *in, const sp_wire_hdr_t *h, size_t length)
{
    if (in == NULL || !in->live)
        return "no authenticated link from that node";
    if (h->incarnation != in->incarnation)
        return "not from the run of that node whose link authenticated";
    if (!sp_net_header_check(h, length, in->key))
        return "its MAC does not check (not sent by that node to this run)";
    if (in->broken[0] != '\0')
        return "that node's stream is broken";
    if (h->msgno < in->next)
        return "numbered before the next one expected (a replay)";
    for (const sp_stage_t *q = in->queue; q != NULL; q = q->next)
        if (q->msgno == h->msgno)
            return "a second message under one number (a replay)";
    return NULL;
}

/* Whether an authenticated message overruns its inbox's bounds: SPC_OK, or
 * SPC_ERR_LIMIT saying which. */
static spc_status_t am_overrun(const sp_engine_t *eng, const inbox_t *in, const sp_wire_hdr_t *h, size_t length,
                               sp_err_t *e)
{
    const sp_config_t *cfg = eng->cfg;
    if (h->msgno - in->next >= (uint64_t)cfg->peer_inbox_msgs || in->queued >= (uint64_t)cfg->peer_inbox_msgs)
        return sp_err_set(e, SPC_ERR_LIMIT, "node %s sent message #%" PRIu64 " while #%" PRIu64 " is next and %u wait "
                          "(peer_inbox_msgs %" PRId64 ")", h->from, h->msgno, in->next, in->queued,
                          cfg->peer_inbox_msgs);
    if (length > (uint64_t)cfg->peer_inbox_bytes - in->queued_bytes && in->queued > 0)
        return sp_err_set(e, SPC_ERR_LIMIT, "node %s sent %zu bytes while %" PRIu64 " wait undelivered "
                          "(peer_inbox_bytes %" PRId64 ")", h->from, length, in->queued_bytes, cfg->peer_inbox_bytes);
    return SPC_OK;
}

ucs_status_t sp_net_on_am(void *arg, const void *header, size_t header_length, void *data, size_t length,
                          const ucp_am_recv_param_t *param)
{
    sp_engine_t *eng = arg;
    struct sp_net *n = eng->net;
    sp_wire_hdr_t hdr;
    const sp_wire_hdr_t *h = &hdr;
    sp_err_t e = SP_ERR_INIT;
    if (!sp_net_header_read(header, header_length, &hdr)) {
        sp_warn(XPORT, "ucx: a message with a foreign header (%zu bytes); dropped", header_length);
        n->dropped++;
        return UCS_OK;
    }
    /* Everything is checked before anything is allocated: a stranger's bytes
     * cost the daemon this callback, nothing more (the rendezvous data of a
     * message dropped here is never fetched). */
    inbox_t *in = sp_net_inbox_find(n, h->from);
    const char *refused = am_refusal(in, h, length);
    if (refused != NULL) {
        net_drop(n, h, length, refused);
        return UCS_OK;
    }
    if (am_overrun(eng, in, h, length, &e) != SPC_OK) {
        /* Its sender holds the key and still broke the bounds: its stream has
         * a hole now, so its link goes (the loop thread drops it). */
        sp_error(XPORT, "ucx: %s; its link is dropped", e.msg);
        snprintf(in->broken, sizeof in->broken, "%s", e.msg);
        n->dropped++;
        if (eng->notify != NULL)
            eng->notify(eng->notify_arg);
        return UCS_OK;
    }
    sp_stage_t *st = aligned_alloc(SP_WIRE_ALIGN, (sizeof *st + length + SP_WIRE_ALIGN - 1) / SP_WIRE_ALIGN *
                                                      SP_WIRE_ALIGN);
    if (st == NULL) {
        sp_error(XPORT, "out of memory for a %zu-byte message from node %s", length, h->from);
        return UCS_OK;
    }
    memset(st, 0, sizeof *st);
    st->eng = eng;
    st->hdr = *h;
    st->from = st->hdr.from;
    st->msgno = h->msgno;
    st->len = length;
    st->charged = length;
    st->arrived_ns = sp_now_ns();
    sp_stage_t **pp = &in->queue;   /* in line by number */
    while (*pp != NULL && (*pp)->msgno < st->msgno)
        pp = &(*pp)->next;
    st->next = *pp;
    *pp = st;
    in->queued++;
    in->queued_bytes += length;
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) {
        ucp_request_param_t p = {
            .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
            .cb.recv_am = on_rndv_done,
            .user_data = st,
        };
        void *req = ucp_am_recv_data_nbx(n->worker, data, st->data, length, &p);
        if (UCS_PTR_IS_ERR(req)) {
            sp_warn(XPORT, "ucx: cannot receive a %zu-byte message: %s", length, ucs_status_string(UCS_PTR_STATUS(req)));
            st->len = 0;
            st->hdr.kind = SP_WIRE_RANK_LOST;
            st->hdr.rank = UINT32_MAX;
            st->ready = true;
        } else if (req == NULL) {
            st->ready = true;
        }
    } else {
        memcpy(st->data, data, length);
        st->ready = true;
    }
    if (st->ready && !n->delivering) {
        n->delivering = true;
        sp_net_inbox_drain(eng, in);
        n->delivering = false;
    }
    return UCS_OK;
}
