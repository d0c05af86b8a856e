/*
 * net_send.c — the sending side of the data path: a collective's descriptors
 * and the inputs each other daemon's ranks read, in one active message per
 * daemon, straight from the clients' arenas (registered memory read over,
 * within staging_bytes; slices packed); and a rank's departure, on the same
 * stream so that it arrives after its collectives. net.c says why.
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "cluster/net_int.h"
#include "cluster/sp_nccl.h"
#include "core/client.h"
#include "core/coll.h"
#include "core/engine.h"
#include "core/job.h"
#include "core/mem.h"
#include "core/ops.h"

static const uint8_t zeros[SP_WIRE_ALIGN];

/* A message on its way out: what to let go of when it is gone. */
typedef struct send_ctx {
    sp_engine_t  *eng;
    sp_wire_hdr_t   hdr;          /* valid until the send completes, as UCX asks */
    sp_wire_rank_t *descs;
    ucp_dt_iov_t *iov;
    uint8_t     **temps;        /* registered memory read into the daemon */
    uint32_t      ntemps;
    uint64_t      staged;       /* of them, what counts against staging_bytes */
    sp_client_t **pinned;
    uint32_t      npinned;
} send_ctx_t;

static void send_ctx_free(sp_engine_t *eng, send_ctx_t *c)
{
    eng->net->staged -= c->staged;
    for (uint32_t i = 0; i < c->npinned; i++)
        sp_client_unpin(eng, c->pinned[i]);
    for (uint32_t i = 0; i < c->ntemps; i++)
        free(c->temps[i]);
    free(c->temps);
    free(c->pinned);
    free(c->descs);
    free(c->iov);
    free(c);
}

static void on_sent(void *req, ucs_status_t status, void *user_data)
{
    send_ctx_t *c = user_data;
    sp_engine_t *eng = c->eng;
    ucp_request_free(req);
    if (status != UCS_OK)
        sp_warn(XPORT, "ucx: a message of job %s group %u went astray: %s", c->hdr.job, c->hdr.group_index,
                ucs_status_string(status));
    char job[SP_JOB_ID_MAX];
    snprintf(job, sizeof job, "%s", c->hdr.job);
    uint32_t gi = c->hdr.group_index, ch = c->hdr.channel;
    uint64_t seq = c->hdr.seq;
    bool coll = c->hdr.kind == SP_WIRE_COLL;
    send_ctx_free(eng, c);
    if (coll)
        sp_coll_sent(eng, job, gi, ch, seq);
}

/* A header to e's node, numbered next. Zeroed first: the MAC covers its
 * padding too, and no stack bytes go on the wire. */
static void header_init(sp_wire_hdr_t *h, sp_engine_t *eng, net_ep_t *e, uint32_t kind, const sp_job_t *job)
{
    memset(h, 0, sizeof *h);
    h->magic = SP_WIRE_MAGIC;
    h->kind = kind;
    h->incarnation = eng->net->incarnation;
    h->msgno = e->next_out++;
    snprintf(h->from, sizeof h->from, "%s", eng->node);
    snprintf(h->job, sizeof h->job, "%s", job->id);
}

void sp_net_send_rank_lost(sp_engine_t *eng, sp_job_t *job, uint32_t rank, const char *why)
{
    struct sp_net *n = eng->net;
    if (n == NULL)
        return;
    for (uint32_t k = 1; k < job->nnodes; k++) {
        net_ep_t *e = sp_net_ep_find(n, job->nodes[k]);
        if (e == NULL || e->ep == NULL || sp_job_node_waited(eng, job, k))
            continue;   /* no path there: its link going down tells it instead */
        send_ctx_t *c = calloc(1, sizeof *c);
        if (c == NULL)
            continue;
        c->eng = eng;
        c->temps = malloc(sizeof *c->temps);
        char *text = strdup(why);
        if (c->temps == NULL || text == NULL) {
            free(text);
            send_ctx_free(eng, c);
            continue;
        }
        c->temps[c->ntemps++] = (uint8_t *)text;
        header_init(&c->hdr, eng, e, SP_WIRE_RANK_LOST, job);
        c->hdr.rank = rank;
        sp_net_header_seal(&c->hdr, strlen(text), e->key);
        ucp_request_param_t p = { .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                                  .cb.send = on_sent, .user_data = c };
        void *req = ucp_am_send_nbx(e->ep, NET_AM_ID, &c->hdr, sizeof c->hdr, text, strlen(text), &p);
        if (req == NULL || UCS_PTR_IS_ERR(req))
            send_ctx_free(eng, c);
    }
}

typedef struct pack_ctx {
    uint8_t       *dst;
    const uint8_t *src;
    uint64_t       done, cap;   /* cap: the tensor's size, which bounds both sides */
    bool           ok;
} pack_ctx_t;

static void pack_range(void *arg, uint64_t off, uint64_t len)
{
    pack_ctx_t *pk = arg;
    if (!pk->ok || off > pk->cap || len > pk->cap - off || len > pk->cap - pk->done) {
        pk->ok = false;
        return;
    }
    memcpy(pk->dst + pk->done, pk->src + off, len);
    pk->done += len;
}

/* Packs what daemon `node`'s ranks read of rank r's input ref i (at src);
 * *len_p gets the packed size. The slices never repeat (the op table lists
 * each once), so they fit in the tensor's own size. NULL when out of
 * memory (or a slice would fall outside the tensor). */
static uint8_t *pack_slices(const sp_group_t *g, const sp_op_t *op, uint32_t r, uint32_t i, uint32_t node,
                            const uint8_t *src, uint64_t *len_p)
{
    bool *readers = calloc(g->size, sizeof *readers);
    pack_ctx_t pk = { .dst = malloc(op->need[i] ? op->need[i] : 1), .src = src, .cap = op->need[i], .ok = true };
    if (readers == NULL || pk.dst == NULL) {
        free(readers);
        free(pk.dst);
        return NULL;
    }
    for (uint32_t q = 0; q < g->size; q++)
        readers[q] = g->job->members[g->ranks[q]].node == node;
    sp_op_kind(op->sqe.opcode)->slices(op, g->size, r, i, readers, pack_range, &pk);
    free(readers);
    if (!pk.ok) {   /* validation bounded the tensor by its descriptor: cannot happen */
        free(pk.dst);
        return NULL;
    }
    *len_p = pk.done;
    return pk.dst;
}

/* The staging a registered input takes per daemon it goes to: read whole, and
 * its slices packed once more. */
static uint64_t stage_bytes(const sp_op_t *op, uint32_t i)
{
    return (net_sliced(op) ? 2 : 1) * op->need[i];
}

/*
 * Registered memory is read into the daemon to be sent, whole, for every
 * daemon that reads it: the messages in flight hold at most staging_bytes of
 * such copies, as the copy's staging holds at most that much (exec.c). A
 * collective whose copies do not fit beside those in flight is refused before
 * anything goes: the first rank here whose tensor passes the bound gets
 * SPC_ERR_LIMIT with the reason, and its descriptor (with no inputs) carries
 * the refusal to the other daemons, so every rank of the group hears it, as
 * of a request refused at submit.
 */
static void stage_check(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll)
{
    struct sp_net *n = eng->net;
    const uint64_t budget = (uint64_t)eng->cfg->staging_bytes;
    uint64_t held = n->staged;

    for (uint32_t r = 0; r < g->size; r++) {
        sp_op_t *op = coll->ops[r];
        if (op == NULL || op->client == NULL || op->local.status != SPC_OK || op->device)
            continue;
        for (uint32_t i = 0; i < op->sqe.ntensors && i < SP_MAX_TENSORS; i++) {
            if (!net_is_input(op, r, i) || op->need[i] == 0 || sp_mem_direct(op->client, &op->tensor[i]) != NULL)
                continue;
            uint32_t readers = 0;
            for (uint32_t k = 0; k < g->nremote; k++)
                readers += net_node_reads(g, op, r, g->remote[k]);
            uint64_t bytes = stage_bytes(op, i) * readers;
            if (held <= budget && bytes <= budget - held) {   /* the budget may have shrunk meanwhile */
                held += bytes;
                continue;
            }
            sp_err_set(&op->local, SPC_ERR_LIMIT, "%s tensor %u: %" PRIu64 " bytes of registered memory to copy for %u "
                       "other daemon%s, and messages in flight hold %" PRIu64 " of staging_bytes (%" PRIu64
                       "): raise staging_bytes, or allocate the tensor with spc_alloc", sp_op_name(op->sqe.opcode), i,
                       bytes, readers, readers == 1 ? "" : "s", n->staged, budget);
            sp_warn(XPORT, "job %s group %u op #%" PRIu64 " rank %u: %s", g->job->id, g->id, coll->seq, r,
                    op->local.msg);
            return;
        }
    }
}

/* ================================================================ copies kept for a restart */

static void kept_free(struct sp_net *n, net_kept_t *k)
{
    n->kept_bytes -= k->len;
    free(k->bytes);
    free(k);
}

void sp_net_kept_clear(struct sp_net *n)
{
    while (n->kept != NULL) {
        net_kept_t *k = n->kept;
        n->kept = k->next;
        kept_free(n, k);
    }
}

/* No restart of its daemons can ask for them any more. */
void sp_net_group_gone(sp_engine_t *eng, const char *job, uint32_t group_index)
{
    struct sp_net *n = eng->net;
    for (net_kept_t **pp = &n->kept; *pp != NULL;) {
        net_kept_t *k = *pp;
        if (k->group_index == group_index && strcmp(k->job, job) == 0) {
            *pp = k->next;
            kept_free(n, k);
        } else {
            pp = &k->next;
        }
    }
}

static bool kept_same(const net_kept_t *k, const char *job, const char *node, const sp_wire_hdr_t *h)
{
    return k->group_index == h->group_index && k->channel == h->channel && strcmp(k->job, job) == 0 &&
           strcmp(k->node, node) == 0;
}

/* Keeps a copy of the message h (its payload in iov) to job node `node`, sent
 * or held. Of the copies of the same collective, one of this message (sent
 * again) goes, and those NET_KEPT or more collectives back, which their
 * receiver has completed: these go whether this one is kept or not, else the
 * copies the bound holds would stay for the job's life while it turns every
 * later one away (the rest go with their group, sp_net_group_gone). Out of
 * memory, or past peer_restart_keep_bytes in all, nothing is kept (a restart
 * then fails the collective, SPC_ERR_RESTARTED). */
static void kept_add(sp_engine_t *eng, sp_job_t *job, uint32_t node, const sp_wire_hdr_t *h, const ucp_dt_iov_t *iov,
                     uint32_t niov, uint64_t len, bool held, bool device)
{
    struct sp_net *n = eng->net;
    const char *to = job->nodes[node];
    for (net_kept_t **pp = &n->kept; *pp != NULL;) {
        net_kept_t *k = *pp;
        if (kept_same(k, job->id, to, h) && (k->seq == h->seq || k->seq + NET_KEPT <= h->seq)) {
            *pp = k->next;
            kept_free(n, k);
            continue;
        }
        pp = &k->next;
    }
    if (n->kept_bytes + len > (uint64_t)eng->cfg->peer_restart_keep_bytes) {
        n->not_kept++;   /* past the bound: as out of memory */
        return;
    }
    net_kept_t *k = calloc(1, sizeof *k);
    uint8_t *bytes = malloc(len > 0 ? len : 1);
    if (k == NULL || bytes == NULL) {
        n->not_kept++;
        free(k);
        free(bytes);
        return;
    }
    size_t off = 0;
    for (uint32_t i = 0; i < niov; i++) {
        memcpy(bytes + off, iov[i].buffer, iov[i].length);
        off += iov[i].length;
    }
    snprintf(k->job, sizeof k->job, "%s", job->id);
    snprintf(k->node, sizeof k->node, "%s", to);
    k->group_index = h->group_index;
    k->channel = h->channel;
    k->nranks = h->nranks;
    k->seq = h->seq;
    k->held = held;
    k->device = device;
    k->len = len;
    k->bytes = bytes;
    k->next = n->kept;
    n->kept = k;
    n->kept_bytes += len;
}

/* Sends the copy k to job node `node`, marked as sent again. False: no path
 * there now, or out of memory. */
static bool kept_send(sp_engine_t *eng, sp_job_t *job, uint32_t node, net_kept_t *k)
{
    net_ep_t *ep = sp_net_ep_find(eng->net, job->nodes[node]);
    if (ep == NULL || ep->ep == NULL || sp_job_node_waited(eng, job, node))
        return false;
    send_ctx_t *c = calloc(1, sizeof *c);
    if (c == NULL || (c->temps = malloc(sizeof *c->temps)) == NULL ||
        (c->temps[0] = malloc(k->len > 0 ? k->len : 1)) == NULL) {
        if (c != NULL)
            free(c->temps);
        free(c);
        return false;
    }
    c->ntemps = 1;
    c->eng = eng;
    memcpy(c->temps[0], k->bytes, k->len);   /* the copy kept may be replaced before this is gone */
    header_init(&c->hdr, eng, ep, SP_WIRE_COLL, job);
    c->hdr.nranks = k->nranks;
    c->hdr.group_index = k->group_index;
    c->hdr.channel = k->channel;
    c->hdr.seq = k->seq;
    c->hdr.rank = SP_WIRE_AGAIN;
    sp_net_header_seal(&c->hdr, k->len, ep->key);
    ucp_request_param_t p = { .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                              .cb.send = on_sent, .user_data = c };
    void *req = ucp_am_send_nbx(ep->ep, NET_AM_ID, &c->hdr, sizeof c->hdr, c->temps[0], k->len, &p);
    if (req == NULL || UCS_PTR_IS_ERR(req))
        send_ctx_free(eng, c);
    k->held = false;
    return true;
}

bool sp_net_send_kept(sp_engine_t *eng, sp_group_t *g, const sp_wire_hdr_t *in)
{
    sp_job_t *job = g->job;
    net_kept_t *k = eng->net->kept;
    while (k != NULL && !(kept_same(k, job->id, in->from, in) && k->seq == in->seq))
        k = k->next;
    uint32_t node = sp_job_node_index(job, in->from, false);
    /* A device op's copy holds no inputs (they go by NCCL): it runs there only
     * with this daemon's part, which must still be to run here (held while
     * that daemon restarted, nccl.c); else NCCL finds no partner here. */
    if (k == NULL || node == UINT32_MAX)
        return false;
    if (k->device && !sp_nccl_has_op(eng, job->id, g->index, in->channel, in->seq))
        return false;
    if (!kept_send(eng, job, node, k))
        return false;
    sp_info(XPORT, "job %s group %u op #%" PRIu64 ": node %s lost it as it restarted; sent again from the copy kept",
            job->id, g->index, in->seq, in->from);
    return true;
}

/* Sends this daemon's ranks of coll to daemon `node`. Returns 1 when a send is
 * in flight, 0 when it completed at once, -1 on failure (the reason in e). */
static int send_to(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll, uint32_t node, sp_err_t *e)
{
    struct sp_net *n = eng->net;
    sp_job_t *job = g->job;
    /* A daemon the job waits for lost what it had of it. A new run there knows
     * nothing of the job, and would park the message at the head of its inbox
     * from us, holding back every later job's for a minute (net_recv.c): send
     * nothing; the message is kept, and goes if the daemon takes the job
     * back (sp_net_resend); else the wait's end fails the op. */
    bool held = sp_job_node_waited(eng, job, node);
    if (held && eng->cfg->peer_restart_grace_ms == 0)
        return 0;
    net_ep_t *ep = sp_net_ep_find(n, job->nodes[node]);
    if (!held && (ep == NULL || ep->ep == NULL)) {
        sp_err_set(e, SPC_ERR_TRANSPORT, "no data path to node %s (is it linked through peers?)", job->nodes[node]);
        return -1;
    }
    send_ctx_t *c = calloc(1, sizeof *c);
    if (c == NULL)
        goto oom;
    c->eng = eng;
    uint32_t maxiov = 1 + 2 * g->nlocal * SP_MAX_TENSORS;   /* descriptors, then (pad, tensor) pairs */
    c->descs = calloc(g->nlocal, sizeof *c->descs);
    c->iov = calloc(maxiov, sizeof *c->iov);
    c->temps = calloc(2 * g->nlocal * SP_MAX_TENSORS, sizeof *c->temps);   /* staged, then packed */
    c->pinned = calloc(g->nlocal, sizeof *c->pinned);
    if (c->descs == NULL || c->iov == NULL || c->temps == NULL || c->pinned == NULL)
        goto oom;

    uint32_t nd = 0, niov = 1;
    bool device = false;
    uint64_t off = (uint64_t)g->nlocal * sizeof(sp_wire_rank_t);
    for (uint32_t r = 0; r < g->size; r++) {
        sp_op_t *op = coll->ops[r];
        if (op == NULL || op->client == NULL)
            continue;
        sp_wire_rank_t *w = &c->descs[nd++];
        w->grank = r;
        w->local_status = op->local.status;
        snprintf(w->local_detail, sizeof w->local_detail, "%s", op->local.msg);
        w->sqe = op->sqe;
        memcpy(w->tensor, op->tensor, sizeof w->tensor);
        memcpy(w->need, op->need, sizeof w->need);
        memcpy(w->params, op->params.raw, sizeof w->params);
        for (uint32_t i = 0; i < SP_MAX_TENSORS; i++)
            w->off[i] = UINT64_MAX;
        w->memory = op->device ? 1u + (uint32_t)op->gpu : 0;
        device |= op->device;
        /* GPU memory travels by NCCL once every daemon has the descriptors (nccl.c). */
        if (op->local.status != SPC_OK || op->device || !net_node_reads(g, op, r, node))
            continue;
        for (uint32_t i = 0; i < op->sqe.ntensors && i < SP_MAX_TENSORS; i++) {
            if (!net_is_input(op, r, i) || op->need[i] == 0)
                continue;
            void *p = sp_mem_direct(op->client, &op->tensor[i]);
            if (p == NULL) {   /* registered memory: read it over first */
                n->staged += stage_bytes(op, i);   /* stage_check saw it fit */
                c->staged += stage_bytes(op, i);
                uint8_t *tmp = malloc(op->need[i]);
                uint64_t remote = sp_mem_remote_addr(op->client, &op->tensor[i]);
                if (tmp == NULL)
                    goto oom;
                c->temps[c->ntemps++] = tmp;
                if (remote == 0 ||
                    sp_mem_vm_copy(op->client, remote, tmp, op->need[i], false, e) != SPC_OK) {
                    send_ctx_free(eng, c);
                    return -1;
                }
                p = tmp;
            }
            uint64_t len = op->need[i];
            if (net_sliced(op)) {   /* only the slices that node's ranks read */
                uint8_t *packed = pack_slices(g, op, r, i, node, p, &len);
                if (packed == NULL)
                    goto oom;
                c->temps[c->ntemps++] = packed;
                p = packed;
                w->packed |= 1u << i;
            }
            uint64_t pad = (SP_WIRE_ALIGN - off % SP_WIRE_ALIGN) % SP_WIRE_ALIGN;
            if (pad > 0)
                c->iov[niov++] = (ucp_dt_iov_t){ .buffer = (void *)zeros, .length = pad };
            off += pad;
            w->off[i] = off;
            w->plen[i] = len;
            c->iov[niov++] = (ucp_dt_iov_t){ .buffer = p, .length = len };
            off += len;
        }
        op->client->pins++;   /* its arena is read until the message is gone */
        c->pinned[c->npinned++] = op->client;
    }
    c->iov[0] = (ucp_dt_iov_t){ .buffer = c->descs, .length = (size_t)nd * sizeof(sp_wire_rank_t) };
    uint64_t payload_len = 0;
    for (uint32_t k = 0; k < niov; k++)
        payload_len += c->iov[k].length;
    c->hdr.nranks = nd;
    c->hdr.group_index = g->index;
    c->hdr.channel = coll->channel;
    c->hdr.seq = coll->seq;
    if (eng->cfg->peer_restart_grace_ms > 0)
        kept_add(eng, job, node, &c->hdr, c->iov, niov, payload_len, held, device);
    if (held) {
        send_ctx_free(eng, c);
        return 0;
    }

    header_init(&c->hdr, eng, ep, SP_WIRE_COLL, job);
    c->hdr.nranks = nd;
    c->hdr.group_index = g->index;
    c->hdr.channel = coll->channel;
    c->hdr.seq = coll->seq;
    sp_net_header_seal(&c->hdr, payload_len, ep->key);
    ucp_request_param_t p = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE,
        .cb.send = on_sent,
        .user_data = c,
        .datatype = ucp_dt_make_iov(),
    };
    void *req = ucp_am_send_nbx(ep->ep, NET_AM_ID, &c->hdr, sizeof c->hdr, c->iov, niov, &p);
    if (req == NULL) {   /* gone already: the header and payload were copied out */
        send_ctx_free(eng, c);
        return 0;
    }
    if (UCS_PTR_IS_ERR(req)) {
        sp_err_set(e, SPC_ERR_TRANSPORT, "sending to node %s failed: %s", job->nodes[node],
                   ucs_status_string(UCS_PTR_STATUS(req)));
        send_ctx_free(eng, c);
        /* With a grace for restarts, the link's end (close behind this) starts
         * the wait, and the daemon's run that takes the job back gets this
         * again (sp_net_resend): not a reason to fail the collective now. */
        if (eng->cfg->peer_restart_grace_ms > 0) {
            sp_warn(XPORT, "job %s group %u op #%" PRIu64 ": %s; sent again if node %s comes back", job->id, g->index,
                    coll->seq, e->msg, job->nodes[node]);
            return 0;
        }
        return -1;
    }
    return 1;

oom:
    sp_err_set(e, SPC_ERR_NO_MEMORY, "daemon out of memory sending to node %s", job->nodes[node]);
    if (c != NULL)
        send_ctx_free(eng, c);
    return -1;
}

/* The transport's send_coll: every rank of this daemon arrived at coll; their
 * descriptors, and the inputs each other daemon needs, go to the other
 * daemons of the group. -1: they could not, and coll failed (and may be gone). */
int sp_net_send_coll(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll)
{
    sp_err_t e = SP_ERR_INIT;
    coll->sent = true;
    stage_check(eng, g, coll);
    for (uint32_t k = 0; k < g->nremote; k++) {
        int rc = send_to(eng, g, coll, g->remote[k], &e);
        if (rc < 0) {
            sp_coll_fail_net(eng, g, coll, e.msg);
            return -1;
        }
        coll->sends_pending += (uint32_t)rc;
    }
    return 0;
}

/* ================================================================ after a daemon restarted */

/* Whether daemon `node` (a job node index) has ranks in g. */
static bool group_spans(const sp_group_t *g, uint32_t node)
{
    for (uint32_t k = 0; k < g->nremote; k++)
        if (g->remote[k] == node)
            return true;
    return false;
}

void sp_net_resend(sp_engine_t *eng, sp_job_t *job, uint32_t node)
{
    if (eng->net == NULL)
        return;
    uint32_t n = 0;
    for (sp_group_t *g = job->groups; g != NULL; g = g->next) {
        if (!group_spans(g, node))
            continue;
        for (unsigned ch = 0; ch < SP_CHANNELS; ch++) {
            sp_coll_t *next;
            for (sp_coll_t *coll = g->colls[ch]; coll != NULL; coll = next) {
                next = coll->next;
                if (!coll->sent || coll->failed != SPC_OK)
                    continue;   /* this daemon's ranks are not all in yet: it goes when they are */
                sp_err_t e = SP_ERR_INIT;
                int rc = send_to(eng, g, coll, node, &e);
                if (rc < 0) {
                    sp_coll_fail_net(eng, g, coll, e.msg);
                    continue;
                }
                coll->sends_pending += (uint32_t)rc;
                n++;
            }
        }
    }
    /* What was held back for collectives that completed here meanwhile. */
    for (net_kept_t *k = eng->net->kept; k != NULL; k = k->next)
        if (k->held && strcmp(k->job, job->id) == 0 && strcmp(k->node, job->nodes[node]) == 0)
            n += kept_send(eng, job, node, k);
    if (n > 0)
        sp_info(XPORT, "job %s: %u collectives sent again to node %s", job->id, n, job->nodes[node]);
}

void sp_net_send_overtaken(sp_engine_t *eng, sp_group_t *g, const sp_wire_hdr_t *in, const struct sp_sqe *sqe,
                           const char *detail)
{
    sp_job_t *job = g->job;
    uint32_t node = sp_job_node_index(job, in->from, false);
    net_ep_t *ep = node != UINT32_MAX ? sp_net_ep_find(eng->net, job->nodes[node]) : NULL;
    if (ep == NULL || ep->ep == NULL || sp_job_node_waited(eng, job, node))
        return;
    send_ctx_t *c = calloc(1, sizeof *c);
    if (c == NULL || (c->descs = calloc(g->nlocal, sizeof *c->descs)) == NULL) {
        free(c);
        sp_warn(XPORT, "job %s group %u op #%" PRIu64 ": out of memory telling node %s it is overtaken", job->id,
                g->index, in->seq, in->from);
        return;
    }
    c->eng = eng;
    uint32_t nd = 0;
    for (uint32_t r = 0; r < g->size; r++) {
        if (job->members[g->ranks[r]].node != 0)
            continue;
        sp_wire_rank_t *w = &c->descs[nd++];
        w->grank = r;
        w->local_status = SPC_ERR_RESTARTED;
        snprintf(w->local_detail, sizeof w->local_detail, "%s", detail);
        w->sqe = *sqe;   /* its kind: a status is read of a collective's rank only */
        w->sqe.ntensors = 0;
        for (uint32_t i = 0; i < SP_MAX_TENSORS; i++)
            w->off[i] = UINT64_MAX;
    }
    header_init(&c->hdr, eng, ep, SP_WIRE_COLL, job);
    c->hdr.nranks = nd;
    c->hdr.group_index = g->index;
    c->hdr.channel = in->channel;
    c->hdr.seq = in->seq;
    sp_net_header_seal(&c->hdr, (uint64_t)nd * sizeof *c->descs, ep->key);
    ucp_request_param_t p = { .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                              .cb.send = on_sent, .user_data = c };
    void *req = ucp_am_send_nbx(ep->ep, NET_AM_ID, &c->hdr, sizeof c->hdr, c->descs, (size_t)nd * sizeof *c->descs,
                                &p);
    if (req == NULL || UCS_PTR_IS_ERR(req))
        send_ctx_free(eng, c);
}
