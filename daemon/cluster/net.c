/*
 * net.c — collectives across daemons: the UCX data path.
 *
 * Why active messages. A collective on a group whose ranks sit on several
 * daemons runs on every one of them, each writing the outputs of its own
 * ranks. What a daemon needs from another is that daemon's ranks' descriptors
 * (to check, as on one node, that every rank agrees) and the inputs its own
 * ranks read. Both go in one UCP active message per (collective, daemon pair):
 * a small header naming the collective (job, group index, channel, sequence
 * number) and a payload of rank descriptors followed by the input tensors,
 * sent straight from the clients' arenas (an IOV, no packing copy; UCX picks
 * eager or rendezvous by size). The receiver lands the payload in one staging
 * block and the task (exec.c) reads those inputs in place while it writes its
 * ranks' final layouts: the all-to-all's re-layout and the rank-order sum of an
 * all-reduce happen exactly as on one node, so the bits are the same. Tags
 * would need a receive posted per message and a size known beforehand; RMA
 * would need every arena registered and its key exchanged per client, for a
 * copy the task makes anyway.
 *
 * Which inputs travel: all-reduce and all-gather send every input to every
 * daemon of the group; a shift only to the daemon of the rank that reads it; a
 * broadcast only the root's; an all-to-all and a reduce-scatter only the slices
 * the receiver's ranks read (their heads of each row, or their rows; their
 * blocks), packed, and the receiver puts them back in place (the op table's
 * slices enumerate them for both). A barrier sends
 * descriptors alone, and so does an op on GPU memory: its inputs go by NCCL
 * (nccl.c, exec.c) once every daemon has agreed on it here.
 *
 * Trust. Only a node whose TCP link authenticated (peer.c) has an inbox here,
 * and only for the run that link proved: every header carries a MAC under the
 * key of (its run, this run), checked before a byte of the message is kept. A
 * message from anyone else, for another run, with a bad MAC or numbered
 * outside the window of peer_inbox_msgs is dropped and counted; what one node
 * may have here undelivered is bounded by peer_inbox_msgs and
 * peer_inbox_bytes. A node that overruns them (which no daemon of this code
 * does) breaks its stream: its link is dropped (sp_net_take_broken), which
 * fails its jobs, and the next authentication starts a clean one.
 *
 * Order. Each daemon numbers the messages it sends to another, and the
 * receiver delivers them in that order (a rendezvous message lands after an
 * eager one sent later; the numbers put them back in line). A rank that leaves
 * is announced on the same stream, so its last collectives always arrive
 * before the news that it is gone. A message that names a job or group this
 * daemon does not have yet (the sender ran ahead of a JobReady or a mesh
 * creation) waits at the head of its stream and is retried on every pass.
 *
 * Threads. Everything here runs with the engine lock held: the progress thread
 * progresses the worker in its passes, the loop thread adds endpoints and
 * announces lost ranks. The lock is what makes the worker's SERIALIZED mode true.
 */
#include "cluster/net.h"

#include <inttypes.h>
#include <sodium.h>
#include <stdalign.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucp/api/ucp.h>
#include <unistd.h>

#include "base/log.h"
#include "cluster/net_wire.h"
#include "core/transport.h"
#include "sp_ulysses.h"

#define NET_AM_ID       1
#define PARK_TIMEOUT_NS (60ull * 1000000000ull)

static const uint8_t zeros[SP_WIRE_ALIGN];

/* A received message; the remote ops made from it hold references. */
struct sp_stage {
    sp_stage_t  *next;         /* in its inbox, by msgno */
    sp_engine_t *eng;
    bool         ready;        /* the payload is in */
    uint32_t     refs;
    uint64_t     arrived_ns;
    uint64_t     msgno;
    const char  *from;         /* hdr.from */
    sp_wire_hdr_t hdr;
    size_t       len;
    size_t       charged;      /* what it counts in its inbox's queued_bytes */
    alignas(SP_WIRE_ALIGN) uint8_t data[];   /* the payload; its tensors at multiples of SP_WIRE_ALIGN */
};

typedef struct net_ep {
    char     node[SP_NODE_MAX];
    ucp_ep_h ep;
    uint64_t next_out;   /* number of the next message to it */
    uint8_t  key[SP_WIRE_MAC_BYTES];   /* seals what goes to it */
} net_ep_t;

/* What came from one daemon, delivered in its order. */
typedef struct inbox {
    char        node[SP_NODE_MAX];
    bool        live;         /* its link is authenticated: messages are taken */
    uint64_t    incarnation;  /* the run its link proved */
    uint8_t     key[SP_WIRE_MAC_BYTES];
    uint64_t    next;         /* msgno to deliver next */
    sp_stage_t *queue;        /* by msgno */
    uint32_t    queued;       /* in queue, and their bytes: bounded by peer_inbox_msgs and _bytes */
    uint64_t    queued_bytes;
    char        broken[SP_DETAIL_BYTES];   /* why its stream cannot go on; "" when it can */
} inbox_t;

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

struct sp_net {
    ucp_context_h ctx;
    ucp_worker_h  worker;
    void         *address;
    size_t        address_len;
    int           efd;
    net_ep_t    **eps;          /* each its own allocation: the error handler keeps a pointer */
    uint32_t      neps;
    inbox_t      *inboxes;
    uint32_t      ninboxes;
    uint64_t      incarnation;
    bool          delivering;   /* guards the inboxes against re-entry */
    uint64_t      dropped;      /* messages dropped unread (sp_net_dropped) */
    uint64_t      dropped_logged;
    uint64_t      drop_logged_ns;
    uint64_t      staged;       /* registered memory read for the messages in flight */
};

static void inbox_clear(inbox_t *in);
static inbox_t *inbox_find(struct sp_net *n, const char *node);

/* ================================================================ endpoints */

static net_ep_t *ep_find(struct sp_net *n, const char *node)
{
    for (uint32_t i = 0; i < n->neps; i++)
        if (strcmp(n->eps[i]->node, node) == 0)
            return n->eps[i];
    return NULL;
}

static void ep_close(struct sp_net *n, net_ep_t *e)
{
    ucp_request_param_t p = { .op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE };
    void *req = ucp_ep_close_nbx(e->ep, &p);
    if (UCS_PTR_IS_PTR(req)) {
        while (ucp_request_check_status(req) == UCS_INPROGRESS)
            ucp_worker_progress(n->worker);
        ucp_request_free(req);
    }
    e->ep = NULL;
}

static void on_ep_error(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    (void)ep;
    /* The TCP link between the daemons notices too and fails the jobs' groups. */
    sp_warn(XPORT, "ucx: endpoint to node %s failed: %s", (const char *)arg, ucs_status_string(status));
}

int sp_net_connect(sp_engine_t *eng, const char *node, const void *addr, size_t len,
                   const uint8_t key[SP_NET_KEY_BYTES])
{
    struct sp_net *n = eng->net;
    if (n == NULL || addr == NULL || len == 0) {
        sp_warn(XPORT, "node %s: no UCX address to send data to", node);
        return -1;
    }
    net_ep_t *e = ep_find(n, node);
    if (e == NULL) {
        net_ep_t **ne = realloc(n->eps, (n->neps + 1) * sizeof *ne);
        if (ne == NULL)
            return -1;
        n->eps = ne;
        if ((e = calloc(1, sizeof *e)) == NULL)
            return -1;
        n->eps[n->neps++] = e;
        snprintf(e->node, sizeof e->node, "%s", node);
    } else if (e->ep != NULL) {
        ep_close(n, e);
    }
    memcpy(e->key, key, sizeof e->key);
    ucp_ep_params_t p = {
        .field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
        .address = addr,
        .err_mode = UCP_ERR_HANDLING_MODE_PEER,
        .err_handler = { .cb = on_ep_error, .arg = e->node },
    };
    ucs_status_t st = ucp_ep_create(n->worker, &p, &e->ep);
    if (st != UCS_OK) {
        e->ep = NULL;
        sp_error(XPORT, "ucx: cannot reach node %s: %s", node, ucs_status_string(st));
        return -1;
    }
    sp_info(XPORT, "ucx: endpoint to node %s", node);
    return 0;
}

void sp_net_disconnect(sp_engine_t *eng, const char *node)
{
    struct sp_net *n = eng->net;
    if (n == NULL)
        return;
    net_ep_t *e = ep_find(n, node);
    if (e != NULL && e->ep != NULL)
        ep_close(n, e);
    /* Both ends saw the link go: both streams start again from 0. */
    if (e != NULL)
        e->next_out = 0;
    inbox_t *in = inbox_find(n, node);
    if (in != NULL) {
        inbox_clear(in);
        in->live = false;   /* nothing is taken from it until a link authenticates again */
        in->broken[0] = '\0';
    }
}

int sp_net_expect(sp_engine_t *eng, const char *node, uint64_t incarnation, const uint8_t key[SP_NET_KEY_BYTES])
{
    struct sp_net *n = eng->net;
    if (n == NULL)
        return -1;
    inbox_t *in = inbox_find(n, node);
    if (in == NULL) {
        inbox_t *ni = realloc(n->inboxes, (n->ninboxes + 1) * sizeof *ni);
        if (ni == NULL)
            return -1;
        n->inboxes = ni;
        in = &n->inboxes[n->ninboxes++];
        memset(in, 0, sizeof *in);
        snprintf(in->node, sizeof in->node, "%s", node);
    } else if (in->live && in->incarnation == incarnation) {
        return 0;   /* its other link, to the same run: the stream goes on */
    }
    inbox_clear(in);   /* a new run, or the first link since the last went: numbering starts again */
    in->broken[0] = '\0';
    in->incarnation = incarnation;
    memcpy(in->key, key, sizeof in->key);
    in->live = true;
    return 0;
}

bool sp_net_take_broken(sp_engine_t *eng, char *node, size_t nlen, char *why, size_t wlen)
{
    struct sp_net *n = eng->net;
    for (uint32_t i = 0; n != NULL && i < n->ninboxes; i++) {
        inbox_t *in = &n->inboxes[i];
        if (in->live && in->broken[0] != '\0') {
            snprintf(node, nlen, "%s", in->node);
            snprintf(why, wlen, "%s", in->broken);
            in->live = false;   /* taken: dropped until its link authenticates again */
            return true;
        }
    }
    return false;
}

uint64_t sp_net_dropped(sp_engine_t *eng)
{
    return eng->net != NULL ? eng->net->dropped : 0;
}

/* ================================================================ taking a message */

bool sp_net_header_read(const void *bytes, size_t len, sp_wire_hdr_t *hdr_p)
{
    sp_wire_hdr_t h;
    if (len != sizeof h)
        return false;
    memcpy(&h, bytes, sizeof h);
    if (h.magic != SP_WIRE_MAGIC || (h.kind != SP_WIRE_COLL && h.kind != SP_WIRE_RANK_LOST) ||
        memchr(h.job, '\0', sizeof h.job) == NULL || memchr(h.from, '\0', sizeof h.from) == NULL)
        return false;
    *hdr_p = h;
    return true;
}

static void header_mac(const sp_wire_hdr_t *h, uint64_t payload_len, const uint8_t key[SP_WIRE_MAC_BYTES],
                       uint8_t out[SP_WIRE_MAC_BYTES])
{
    uint8_t len[8];
    for (int i = 0; i < 8; i++)
        len[i] = (uint8_t)(payload_len >> (8 * i));
    crypto_auth_hmacsha256_state st;
    crypto_auth_hmacsha256_init(&st, key, SP_WIRE_MAC_BYTES);
    crypto_auth_hmacsha256_update(&st, (const unsigned char *)h, offsetof(sp_wire_hdr_t, mac));
    crypto_auth_hmacsha256_update(&st, len, sizeof len);
    crypto_auth_hmacsha256_final(&st, out);
}

void sp_net_header_seal(sp_wire_hdr_t *h, uint64_t payload_len, const uint8_t key[SP_WIRE_MAC_BYTES])
{
    header_mac(h, payload_len, key, h->mac);
}

bool sp_net_header_check(const sp_wire_hdr_t *h, uint64_t payload_len, const uint8_t key[SP_WIRE_MAC_BYTES])
{
    uint8_t want[SP_WIRE_MAC_BYTES];
    header_mac(h, payload_len, key, want);
    return crypto_verify_32(h->mac, want) == 0;
}

/* Whether the op's inputs travel as the slices their readers read. */
static bool sliced(const sp_op_t *op)
{
    return sp_op_kind(op->sqe.opcode)->slices != NULL;
}

/* Puts packed slices back where the task reads them. */
typedef struct unpack_ctx {
    uint8_t       *dst;
    const uint8_t *src;
    uint64_t       need, plen, done;
    bool           ok;
} unpack_ctx_t;

static void unpack_range(void *arg, uint64_t off, uint64_t len)
{
    unpack_ctx_t *u = arg;
    if (!u->ok || off > u->need || len > u->need - off || len > u->plen - u->done) {
        u->ok = false;
        return;
    }
    memcpy(u->dst + off, u->src + u->done, len);
    u->done += len;
}

static bool unpack(const sp_group_t *g, sp_op_t *op, uint32_t grank, uint32_t i, const uint8_t *src,
                   uint64_t plen)
{
    /* The op passed its checks here (rank_sizes): its slices lie in its input. */
    if (!sliced(op))
        return false;
    bool *mine = calloc(g->size, sizeof *mine);
    unpack_ctx_t u = { .dst = malloc(op->need[i] ? op->need[i] : 1), .src = src, .need = op->need[i],
                       .plen = plen, .ok = true };
    if (mine == NULL || u.dst == NULL) {
        free(mine);
        free(u.dst);
        return false;
    }
    for (uint32_t q = 0; q < g->size; q++)
        mine[q] = g->job->members[g->ranks[q]].node == 0;
    sp_op_kind(op->sqe.opcode)->slices(op, g->size, grank, i, mine, unpack_range, &u);
    free(mine);
    if (!u.ok || u.done != plen) {
        free(u.dst);
        return false;
    }
    op->own[i] = u.dst;
    op->rin[i] = u.dst;
    return true;
}

static void op_free(sp_op_t *op)
{
    for (unsigned i = 0; i < SP_MAX_TENSORS; i++)
        free(op->own[i]);
    free(op);
}

/* Whether daemon `node` (a job node index) reads input tensors of group rank r. */
static bool node_reads(const sp_group_t *g, const sp_op_t *op, uint32_t r, uint32_t node)
{
    return sp_op_kind(op->sqe.opcode)->reads(g, op, r, node);
}

static bool is_input(const sp_op_t *op, uint32_t r, uint32_t i)
{
    return sp_op_kind(op->sqe.opcode)->input(&op->sqe, r, i);
}

/* Finds each input the descriptor carries in the payload, whose inputs begin
 * at byte `start` (past the descriptors); false (why set) when one is missing,
 * or does not fit, or is not where send_to puts it. */
static bool take_inputs(const sp_group_t *g, const sp_wire_rank_t *w, sp_op_t *op, const uint8_t *payload,
                        size_t start, size_t len, char *why, size_t why_len)
{
    for (uint32_t i = 0; i < SP_MAX_TENSORS; i++) {
        /* What send_to sends this daemon, by the same rule: the task reads
         * each such input, and one that did not come would be a NULL. */
        bool sent = !op->device && i < op->sqe.ntensors && is_input(op, w->grank, i) && op->need[i] > 0 &&
                    node_reads(g, op, w->grank, 0);
        if ((w->off[i] != UINT64_MAX) != sent) {
            snprintf(why, why_len, "rank %u's %s input %u %s", w->grank, sp_op_name(op->sqe.opcode), i,
                     sent ? "is read here and did not come" : "came, and nothing here reads it");
            return false;
        }
        if (!sent)
            continue;
        /* At a multiple of SP_WIRE_ALIGN, as the stage itself: the kernels
         * read the inputs in place as arrays of their element type. */
        bool ok;
        if (w->off[i] % SP_WIRE_ALIGN != 0 || w->off[i] < start || w->off[i] > len || w->plen[i] > len - w->off[i] ||
            w->plen[i] > op->need[i])
            ok = false;
        else if (w->packed & (1u << i))
            ok = unpack(g, op, w->grank, i, payload + w->off[i], w->plen[i]);
        else
            ok = w->plen[i] == op->need[i];
        if (!ok) {
            snprintf(why, why_len, "rank %u's input %u (%" PRIu64 " bytes at %" PRIu64 ") does not fit its "
                     "%zu-byte message, or is not aligned there", w->grank, i, w->plen[i], w->off[i], len);
            return false;
        }
        if (!(w->packed & (1u << i)))
            op->rin[i] = payload + w->off[i];
    }
    return true;
}

/*
 * Sets the sizes of a standing rank's op from its own arguments, as its daemon
 * did. The executor reads count x element of an all-reduce's input, a shift's
 * send bytes, an all-to-all's slices: a size taken from the message instead
 * (need[i]) could say less than that, and the task would read past the input
 * in the stage, or write past a receive of a rank here. False (why set) when
 * the arguments fail here or the sizes differ from the message's: another
 * version, or a damaged message.
 */
static bool rank_sizes(const sp_group_t *g, const sp_wire_rank_t *w, sp_op_t *op, char *why, size_t why_len)
{
    sp_op_validate_remote(op, g->size);
    if (op->local_status != SPC_OK) {
        snprintf(why, why_len, "rank %u's %s, accepted by its daemon, fails here: %s", w->grank,
                 sp_op_name(op->sqe.opcode), op->local_detail);
        return false;
    }
    for (uint32_t i = 0; i < SP_MAX_TENSORS; i++) {
        if (op->need[i] != w->need[i]) {
            snprintf(why, why_len, "rank %u's tensor %u spans %" PRIu64 " bytes, its message says %" PRIu64,
                     w->grank, i, op->need[i], w->need[i]);
            return false;
        }
    }
    return true;
}

/* The op of descriptor w, from job node `from`; NULL (why set) when refused. */
static sp_op_t *rank_take(const sp_group_t *g, uint32_t from, const sp_wire_rank_t *w, const uint8_t *payload,
                          size_t start, size_t len, char *why, size_t why_len)
{
    if (w->grank >= g->size || g->job->members[g->ranks[w->grank]].node != from ||
        w->sqe.ntensors > SP_MAX_TENSORS) {
        snprintf(why, why_len, "rank %u of group %u is not its to send", w->grank, g->index);
        return NULL;
    }
    /* Only collectives travel: a noop or an unknown opcode would reach
     * sp_coll_agree and the task's planner, which know none. */
    const sp_op_kind_t *k = sp_op_kind(w->sqe.opcode);
    if (k == NULL || !(k->flags & SP_OPK_GROUP)) {
        snprintf(why, why_len, "rank %u's opcode %u runs on no group", w->grank, w->sqe.opcode);
        return NULL;
    }
    /* A rank's status is OK or an error: a positive one (1, in progress)
     * would complete every rank's op with a status that says it has not. */
    if (w->local_status > 0) {
        snprintf(why, why_len, "rank %u's status %d is no outcome", w->grank, w->local_status);
        return NULL;
    }
    /* A GPU the sender could not have: an op's ordinal is an int below this. */
    if (w->memory > SP_TOPO_MAX_GPUS) {
        snprintf(why, why_len, "rank %u's memory %u names no GPU", w->grank, w->memory);
        return NULL;
    }
    sp_op_t *op = calloc(1, sizeof *op);
    if (op == NULL) {
        snprintf(why, why_len, "out of memory taking rank %u", w->grank);
        return NULL;
    }
    op->sqe = w->sqe;
    memcpy(op->tensor, w->tensor, sizeof op->tensor);
    memcpy(op->params.raw, w->params, sizeof op->params.raw);
    op->local_status = w->local_status;
    /* The sender's text, to its field's end: it need not hold a NUL. */
    snprintf(op->local_detail, sizeof op->local_detail, "%.*s", (int)sizeof w->local_detail, w->local_detail);
    op->device = w->memory != 0;
    op->gpu = (int)w->memory - 1;
    if (op->local_status != SPC_OK)
        return op;   /* it fails the collective, naming the rank: nothing of it is read */
    if (!rank_sizes(g, w, op, why, why_len) || !take_inputs(g, w, op, payload, start, len, why, why_len)) {
        op_free(op);
        return NULL;
    }
    return op;
}

int sp_net_coll_take(const sp_group_t *g, const sp_wire_hdr_t *h, const uint8_t *payload, size_t len,
                     sp_wire_arrival_t *arrivals, char *why, size_t why_len)
{
    uint32_t from = sp_job_node_index(g->job, h->from, false);
    if (h->kind != SP_WIRE_COLL || h->channel >= SP_CHANNELS || from == UINT32_MAX || from == 0 ||
        h->nranks > g->size || (size_t)h->nranks * sizeof(sp_wire_rank_t) > len) {
        snprintf(why, why_len, "a malformed message (channel %u, %u descriptors in %zu bytes) for group %u",
                 h->channel, h->nranks, len, g->index);
        return -1;
    }
    bool refused = false;
    size_t start = (size_t)h->nranks * sizeof(sp_wire_rank_t);
    for (uint32_t k = 0; k < h->nranks; k++) {
        sp_wire_rank_t w;   /* the payload promises no alignment either */
        memcpy(&w, payload + (size_t)k * sizeof w, sizeof w);
        char rwhy[SP_DETAIL_BYTES];
        arrivals[k] = (sp_wire_arrival_t){ .grank = w.grank,
                                           .op = rank_take(g, from, &w, payload, start, len, rwhy, sizeof rwhy) };
        if (arrivals[k].op == NULL && !refused) {
            snprintf(why, why_len, "%s", rwhy);
            refused = true;
        }
    }
    return (int)h->nranks;
}

/* ================================================================ receiving */

/* Frees a remote op's share of its stage. */
static void stage_unref(sp_stage_t *st)
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

/* Turns a message into remote ops and lets each arrive at its collective g. */
static void stage_deliver(sp_engine_t *eng, sp_stage_t *st, sp_group_t *g)
{
    const sp_wire_hdr_t *h = &st->hdr;
    char why[SP_DETAIL_BYTES];
    sp_wire_arrival_t *arrivals = calloc(g->size, sizeof *arrivals);
    int n = arrivals != NULL ? sp_net_coll_take(g, h, st->data, st->len, arrivals, why, sizeof why) : -1;
    if (n < 0) {
        sp_warn(XPORT, "node %s: job %s: %s; dropped", st->from, h->job,
                arrivals != NULL ? why : "out of memory taking a message");
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
                h->job, h->group_index, refused, n, why);
    free(arrivals);
    stage_unref(st);
}

static void inbox_clear(inbox_t *in)
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

static inbox_t *inbox_find(struct sp_net *n, const char *node)
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
static int inbox_drain(sp_engine_t *eng, inbox_t *in)
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
            inbox_drain(eng, &n->inboxes[i]);
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

/* Why an authenticated message overruns its inbox's bounds, or NULL. */
static const char *am_overrun(const sp_engine_t *eng, const inbox_t *in, const sp_wire_hdr_t *h, size_t length,
                              char *why, size_t wlen)
{
    const sp_config_t *cfg = eng->cfg;
    if (h->msgno - in->next >= (uint64_t)cfg->peer_inbox_msgs || in->queued >= (uint64_t)cfg->peer_inbox_msgs)
        snprintf(why, wlen, "node %s sent message #%" PRIu64 " while #%" PRIu64 " is next and %u wait "
                 "(peer_inbox_msgs %" PRId64 ")", h->from, h->msgno, in->next, in->queued, cfg->peer_inbox_msgs);
    else if (length > (uint64_t)cfg->peer_inbox_bytes - in->queued_bytes && in->queued > 0)
        snprintf(why, wlen, "node %s sent %zu bytes while %" PRIu64 " wait undelivered (peer_inbox_bytes %" PRId64 ")",
                 h->from, length, in->queued_bytes, cfg->peer_inbox_bytes);
    else
        return NULL;
    return why;
}

static ucs_status_t on_am(void *arg, const void *header, size_t header_length, void *data, size_t length,
                          const ucp_am_recv_param_t *param)
{
    sp_engine_t *eng = arg;
    struct sp_net *n = eng->net;
    sp_wire_hdr_t hdr;
    const sp_wire_hdr_t *h = &hdr;
    char why[SP_DETAIL_BYTES];
    if (!sp_net_header_read(header, header_length, &hdr)) {
        sp_warn(XPORT, "ucx: a message with a foreign header (%zu bytes); dropped", header_length);
        n->dropped++;
        return UCS_OK;
    }
    /* Everything is checked before anything is allocated: a stranger's bytes
     * cost the daemon this callback, nothing more (the rendezvous data of a
     * message dropped here is never fetched). */
    inbox_t *in = inbox_find(n, h->from);
    const char *refused = am_refusal(in, h, length);
    if (refused != NULL) {
        net_drop(n, h, length, refused);
        return UCS_OK;
    }
    if (am_overrun(eng, in, h, length, why, sizeof why) != NULL) {
        /* Its sender holds the key and still broke the bounds: its stream has
         * a hole now, so its link goes (the loop thread drops it). */
        sp_error(XPORT, "ucx: %s; its link is dropped", why);
        snprintf(in->broken, sizeof in->broken, "%s", why);
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
        inbox_drain(eng, in);
        n->delivering = false;
    }
    return UCS_OK;
}

/* ================================================================ sending */

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
        net_ep_t *e = ep_find(n, job->nodes[k]);
        if (e == NULL || e->ep == NULL)
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
    return (sliced(op) ? 2 : 1) * op->need[i];
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
        if (op == NULL || op->client == NULL || op->local_status != SPC_OK || op->device)
            continue;
        for (uint32_t i = 0; i < op->sqe.ntensors && i < SP_MAX_TENSORS; i++) {
            if (!is_input(op, r, i) || op->need[i] == 0 || sp_mem_direct(op->client, &op->tensor[i]) != NULL)
                continue;
            uint32_t readers = 0;
            for (uint32_t k = 0; k < g->nremote; k++)
                readers += node_reads(g, op, r, g->remote[k]);
            uint64_t bytes = stage_bytes(op, i) * readers;
            if (held <= budget && bytes <= budget - held) {   /* the budget may have shrunk meanwhile */
                held += bytes;
                continue;
            }
            op->local_status = SPC_ERR_LIMIT;
            snprintf(op->local_detail, sizeof op->local_detail, "%s tensor %u: %" PRIu64 " bytes of registered memory "
                     "to copy for %u other daemon%s, and messages in flight hold %" PRIu64 " of staging_bytes (%" PRIu64
                     "): raise staging_bytes, or allocate the tensor with spc_alloc", sp_op_name(op->sqe.opcode), i,
                     bytes, readers, readers == 1 ? "" : "s", n->staged, budget);
            sp_warn(XPORT, "job %s group %u op #%" PRIu64 " rank %u: %s", g->job->id, g->id, coll->seq, r,
                    op->local_detail);
            return;
        }
    }
}

/* Sends this daemon's ranks of coll to daemon `node`. Returns 1 when a send is
 * in flight, 0 when it completed at once, -1 on failure (detail set). */
static int send_to(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll, uint32_t node, char *detail, size_t dlen)
{
    struct sp_net *n = eng->net;
    sp_job_t *job = g->job;
    net_ep_t *e = ep_find(n, job->nodes[node]);
    if (e == NULL || e->ep == NULL) {
        snprintf(detail, dlen, "no data path to node %s (is it linked through peers?)", job->nodes[node]);
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
    uint64_t off = (uint64_t)g->nlocal * sizeof(sp_wire_rank_t);
    for (uint32_t r = 0; r < g->size; r++) {
        sp_op_t *op = coll->ops[r];
        if (op == NULL || op->client == NULL)
            continue;
        sp_wire_rank_t *w = &c->descs[nd++];
        w->grank = r;
        w->local_status = op->local_status;
        snprintf(w->local_detail, sizeof w->local_detail, "%s", op->local_detail);
        w->sqe = op->sqe;
        memcpy(w->tensor, op->tensor, sizeof w->tensor);
        memcpy(w->need, op->need, sizeof w->need);
        memcpy(w->params, op->params.raw, sizeof w->params);
        for (uint32_t i = 0; i < SP_MAX_TENSORS; i++)
            w->off[i] = UINT64_MAX;
        w->memory = op->device ? 1u + (uint32_t)op->gpu : 0;
        /* GPU memory travels by NCCL once every daemon has the descriptors (nccl.c). */
        if (op->local_status != SPC_OK || op->device || !node_reads(g, op, r, node))
            continue;
        for (uint32_t i = 0; i < op->sqe.ntensors && i < SP_MAX_TENSORS; i++) {
            if (!is_input(op, r, i) || op->need[i] == 0)
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
                    sp_mem_vm_copy(op->client, remote, tmp, op->need[i], false, detail, dlen) != SPC_OK) {
                    send_ctx_free(eng, c);
                    return -1;
                }
                p = tmp;
            }
            uint64_t len = op->need[i];
            if (sliced(op)) {   /* only the slices that node's ranks read */
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

    header_init(&c->hdr, eng, e, SP_WIRE_COLL, job);
    c->hdr.nranks = nd;
    c->hdr.group_index = g->index;
    c->hdr.channel = coll->channel;
    c->hdr.seq = coll->seq;
    uint64_t payload_len = 0;
    for (uint32_t k = 0; k < niov; k++)
        payload_len += c->iov[k].length;
    sp_net_header_seal(&c->hdr, payload_len, e->key);
    ucp_request_param_t p = {
        .op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE,
        .cb.send = on_sent,
        .user_data = c,
        .datatype = ucp_dt_make_iov(),
    };
    void *req = ucp_am_send_nbx(e->ep, NET_AM_ID, &c->hdr, sizeof c->hdr, c->iov, niov, &p);
    if (req == NULL) {   /* gone already: the header and payload were copied out */
        send_ctx_free(eng, c);
        return 0;
    }
    if (UCS_PTR_IS_ERR(req)) {
        snprintf(detail, dlen, "sending to node %s failed: %s", job->nodes[node], ucs_status_string(UCS_PTR_STATUS(req)));
        send_ctx_free(eng, c);
        return -1;
    }
    return 1;

oom:
    snprintf(detail, dlen, "daemon out of memory sending to node %s", job->nodes[node]);
    if (c != NULL)
        send_ctx_free(eng, c);
    return -1;
}

/* The transport's send_coll: every rank of this daemon arrived at coll; their
 * descriptors, and the inputs each other daemon needs, go to the other
 * daemons of the group. -1: they could not, and coll failed (and may be gone). */
static int net_send_coll(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll)
{
    char detail[SP_DETAIL_BYTES];
    coll->sent = true;
    stage_check(eng, g, coll);
    for (uint32_t k = 0; k < g->nremote; k++) {
        int rc = send_to(eng, g, coll, g->remote[k], detail, sizeof detail);
        if (rc < 0) {
            sp_coll_fail_net(eng, g, coll, detail);
            return -1;
        }
        coll->sends_pending += (uint32_t)rc;
    }
    return 0;
}

/* ================================================================ the worker */

/* Progresses the worker; returns the events handled. */
static int net_progress(sp_engine_t *eng, uint64_t now)
{
    struct sp_net *n = eng->net;
    if (n == NULL)
        return 0;
    int work = 0;
    while (ucp_worker_progress(n->worker) != 0)
        work++;
    if (!n->delivering) {   /* messages that waited for their job or group */
        n->delivering = true;
        for (uint32_t i = 0; i < n->ninboxes; i++)
            work += inbox_drain(eng, &n->inboxes[i]);
        n->delivering = false;
    }
    return work;
}

void sp_net_poll_locked(sp_engine_t *eng)
{
    struct sp_net *n = eng->net;
    if (n == NULL)
        return;
    /* Armed: the fd signals the next event. Busy: events came meanwhile, go on. */
    do
        net_progress(eng, 0);   /* the worker keeps no clock */
    while (ucp_worker_arm(n->worker) == UCS_ERR_BUSY);
}

int sp_net_efd(sp_engine_t *eng)
{
    return eng->net != NULL ? eng->net->efd : -1;
}

size_t sp_net_address(sp_engine_t *eng, const void **addr_p)
{
    struct sp_net *n = eng->net;
    *addr_p = n != NULL ? n->address : NULL;
    return n != NULL ? n->address_len : 0;
}

/* The transport's op_release: a rank of another daemon's op completed. */
static void net_op_release(sp_op_t *op)
{
    stage_unref(op->stage);
    for (unsigned i = 0; i < SP_MAX_TENSORS; i++)
        free(op->own[i]);
}

/* What the engine asks of the data path (core/transport.h). */
static const sp_transport_ops_t net_ops = {
    .cleanup    = sp_net_cleanup,
    .progress   = net_progress,
    .op_release = net_op_release,
    .send_coll  = net_send_coll,
};

int sp_net_init(sp_engine_t *eng, uint64_t incarnation)
{
    struct sp_net *n = calloc(1, sizeof *n);
    ucp_config_t *config = NULL;
    ucs_status_t st;
    if (n == NULL)
        return -1;
    n->efd = -1;
    /* UCX's TCP transport moves 8 KiB segments by default, each one a pass of
     * the progress loop on both daemons; 256 KiB segments moved a 16 MiB shift
     * 2.5x faster between two daemons here (spbench shift --nodes 2). UCX reads
     * its transports' settings from the environment only (ucp_config_modify
     * reaches the UCP layer), so they go there, unless already set: the
     * operator's UCX_TCP_TX_SEG_SIZE and UCX_TCP_RX_SEG_SIZE win. */
    setenv("UCX_TCP_TX_SEG_SIZE", "256k", 0);
    setenv("UCX_TCP_RX_SEG_SIZE", "256k", 0);
    if ((st = ucp_config_read(NULL, NULL, &config)) != UCS_OK)
        goto fail;
    ucp_params_t cp = {
        .field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_NAME,
        .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP,
        .name = "spd",
    };
    st = ucp_init(&cp, config, &n->ctx);
    ucp_config_release(config);
    if (st != UCS_OK)
        goto fail;
    ucp_worker_params_t wp = { .field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                               .thread_mode = UCS_THREAD_MODE_SERIALIZED };
    if ((st = ucp_worker_create(n->ctx, &wp, &n->worker)) != UCS_OK)
        goto fail;
    ucp_am_handler_param_t hp = {
        .field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                      UCP_AM_HANDLER_PARAM_FIELD_FLAGS,
        .id = NET_AM_ID,
        .flags = UCP_AM_FLAG_WHOLE_MSG,
        .cb = on_am,
        .arg = eng,
    };
    ucp_address_t *addr;
    if ((st = ucp_worker_set_am_recv_handler(n->worker, &hp)) != UCS_OK ||
        (st = ucp_worker_get_efd(n->worker, &n->efd)) != UCS_OK ||
        (st = ucp_worker_get_address(n->worker, &addr, &n->address_len)) != UCS_OK)
        goto fail;
    n->address = malloc(n->address_len);
    if (n->address == NULL) {
        ucp_worker_release_address(n->worker, addr);
        st = UCS_ERR_NO_MEMORY;
        goto fail;
    }
    memcpy(n->address, addr, n->address_len);
    ucp_worker_release_address(n->worker, addr);
    /* This run, as its links proved it (sp_peers_t.incarnation): the
     * receivers' inboxes restart with it and their keys name it. */
    n->incarnation = incarnation;
    eng->net = n;
    eng->net_ops = &net_ops;
    unsigned major, minor, release;
    ucp_get_version(&major, &minor, &release);
    sp_info(XPORT, "ucx %u.%u.%u: data to other daemons by active messages (worker address %zu bytes)", major, minor,
            release, n->address_len);
    return 0;

fail:
    sp_error(XPORT, "ucx: cannot start the data path to other daemons: %s", ucs_status_string(st));
    if (n->worker != NULL)
        ucp_worker_destroy(n->worker);
    if (n->ctx != NULL)
        ucp_cleanup(n->ctx);
    free(n);
    return -1;
}

void sp_net_cleanup(sp_engine_t *eng)
{
    struct sp_net *n = eng->net;
    if (n == NULL)
        return;
    for (uint32_t i = 0; i < n->neps; i++) {
        if (n->eps[i]->ep != NULL)
            ep_close(n, n->eps[i]);
        free(n->eps[i]);
    }
    for (uint32_t i = 0; i < n->ninboxes; i++)
        inbox_clear(&n->inboxes[i]);
    free(n->inboxes);
    free(n->eps);
    free(n->address);
    ucp_worker_destroy(n->worker);
    ucp_cleanup(n->ctx);
    free(n);
    eng->net = NULL;
    eng->net_ops = NULL;
}
