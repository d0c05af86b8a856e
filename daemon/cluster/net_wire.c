/*
 * net_wire.c — the checks a daemon makes of a data-path message another one
 * sent (net_wire.h): its header, its MAC, and sp_net_coll_take, which turns a
 * collective's payload into ops of the sender's ranks, refusing what does not
 * fit. No UCX here: tests/fuzz/fuzz_peer.c runs these on any bytes.
 */
#include "cluster/net_wire.h"

#include <inttypes.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cluster/net_int.h"
#include "core/client.h"
#include "core/job.h"
#include "core/ops.h"
#include "core/validate.h"

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
    /* The op passed its checks here (rank_sizes), and its kind has slices
     * (take_inputs): they lie in its input. */
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

/* Finds each input the descriptor carries in the payload, whose inputs begin
 * at byte `start` (past the descriptors); false (the reason in e) when one is missing,
 * or does not fit, or is not where send_to puts it. */
static bool take_inputs(const sp_group_t *g, const sp_wire_rank_t *w, sp_op_t *op, const uint8_t *payload,
                        size_t start, size_t len, sp_err_t *e)
{
    for (uint32_t i = 0; i < SP_MAX_TENSORS; i++) {
        /* What send_to sends this daemon, by the same rule: the task reads
         * each such input, and one that did not come would be a NULL. */
        bool sent = !op->device && i < op->sqe.ntensors && net_is_input(op, w->grank, i) && op->need[i] > 0 &&
                    net_node_reads(g, op, w->grank, 0);
        if ((w->off[i] != UINT64_MAX) != sent) {
            sp_err_set(e, SPC_ERR_PROTOCOL, "rank %u's %s input %u %s", w->grank, sp_op_name(op->sqe.opcode), i,
                       sent ? "is read here and did not come" : "came, and nothing here reads it");
            return false;
        }
        if (!sent)
            continue;
        /* At a multiple of SP_WIRE_ALIGN, as the stage itself: the kernels
         * read the inputs in place as arrays of their element type. */
        /* Packed exactly where the op kind lists slices (net_send.c packs them
         * all): a whole input in its place comes from another version. */
        bool packed = w->packed & (1u << i);
        if (packed != net_sliced(op)) {
            sp_err_set(e, SPC_ERR_PROTOCOL, "rank %u's %s input %u came %s; its kind sends %s", w->grank,
                       sp_op_name(op->sqe.opcode), i, packed ? "packed" : "whole", packed ? "it whole" : "slices");
            return false;
        }
        bool ok;
        if (w->off[i] % SP_WIRE_ALIGN != 0 || w->off[i] < start || w->off[i] > len || w->plen[i] > len - w->off[i] ||
            w->plen[i] > op->need[i])
            ok = false;
        else if (packed)
            ok = unpack(g, op, w->grank, i, payload + w->off[i], w->plen[i]);
        else
            ok = w->plen[i] == op->need[i];
        if (!ok) {
            sp_err_set(e, SPC_ERR_PROTOCOL, "rank %u's input %u (%" PRIu64 " bytes at %" PRIu64 ") does not fit its "
                       "%zu-byte message, or is not aligned there", w->grank, i, w->plen[i], w->off[i], len);
            return false;
        }
        if (!packed)
            op->rin[i] = payload + w->off[i];
    }
    return true;
}

/*
 * Sets the sizes of a standing rank's op from its own arguments, as its daemon
 * did. The executor reads count x element of an all-reduce's input, a shift's
 * send bytes, an all-to-all's slices: a size taken from the message instead
 * (need[i]) could say less than that, and the task would read past the input
 * in the stage, or write past a receive of a rank here. False (the reason in e) when
 * the arguments fail here or the sizes differ from the message's: another
 * version, or a damaged message.
 */
static bool rank_sizes(const sp_group_t *g, const sp_wire_rank_t *w, sp_op_t *op, sp_err_t *e)
{
    sp_op_validate_remote(op, g->size);
    if (op->local.status != SPC_OK) {
        sp_err_set(e, SPC_ERR_PROTOCOL, "rank %u's %s, accepted by its daemon, fails here: %s", w->grank,
                   sp_op_name(op->sqe.opcode), op->local.msg);
        return false;
    }
    for (uint32_t i = 0; i < SP_MAX_TENSORS; i++) {
        if (op->need[i] != w->need[i]) {
            sp_err_set(e, SPC_ERR_PROTOCOL, "rank %u's tensor %u spans %" PRIu64 " bytes, its message says %" PRIu64,
                       w->grank, i, op->need[i], w->need[i]);
            return false;
        }
    }
    return true;
}

/* The op of descriptor w, from job node `from`; NULL (the reason in e) when refused. */
static sp_op_t *rank_take(const sp_group_t *g, uint32_t from, const sp_wire_rank_t *w, const uint8_t *payload,
                          size_t start, size_t len, sp_err_t *e)
{
    if (w->grank >= g->size || g->job->members[g->ranks[w->grank]].node != from ||
        w->sqe.ntensors > SP_MAX_TENSORS) {
        sp_err_set(e, SPC_ERR_PROTOCOL, "rank %u of group %u is not its to send", w->grank, g->index);
        return NULL;
    }
    /* Only collectives travel: a noop or an unknown opcode would reach
     * sp_coll_agree and the task's planner, which know none. */
    const sp_op_kind_t *k = sp_op_kind(w->sqe.opcode);
    if (k == NULL || !(k->flags & SP_OPK_GROUP)) {
        sp_err_set(e, SPC_ERR_PROTOCOL, "rank %u's opcode %u runs on no group", w->grank, w->sqe.opcode);
        return NULL;
    }
    /* A rank's status is OK or an error: a positive one (1, in progress)
     * would complete every rank's op with a status that says it has not. */
    if (w->local_status > 0) {
        sp_err_set(e, SPC_ERR_PROTOCOL, "rank %u's status %d is no outcome", w->grank, w->local_status);
        return NULL;
    }
    /* A GPU the sender could not have: an op's ordinal is an int below this. */
    if (w->memory > SP_TOPO_MAX_GPUS) {
        sp_err_set(e, SPC_ERR_PROTOCOL, "rank %u's memory %u names no GPU", w->grank, w->memory);
        return NULL;
    }
    sp_op_t *op = calloc(1, sizeof *op);
    if (op == NULL) {
        sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory taking rank %u", w->grank);
        return NULL;
    }
    op->sqe = w->sqe;
    memcpy(op->tensor, w->tensor, sizeof op->tensor);
    memcpy(op->params.raw, w->params, sizeof op->params.raw);
    /* The sender's text, to its field's end: it need not hold a NUL. */
    sp_err_set(&op->local, w->local_status, "%.*s", (int)sizeof w->local_detail, w->local_detail);
    op->device = w->memory != 0;
    op->gpu = (int)w->memory - 1;
    if (op->local.status != SPC_OK)
        return op;   /* it fails the collective, naming the rank: nothing of it is read */
    if (!rank_sizes(g, w, op, e) || !take_inputs(g, w, op, payload, start, len, e)) {
        op_free(op);
        return NULL;
    }
    return op;
}

int sp_net_coll_take(const sp_group_t *g, const sp_wire_hdr_t *h, const uint8_t *payload, size_t len,
                     sp_wire_arrival_t *arrivals, sp_err_t *e)
{
    uint32_t from = sp_job_node_index(g->job, h->from, false);
    if (h->kind != SP_WIRE_COLL || h->channel >= SP_CHANNELS || from == UINT32_MAX || from == 0 ||
        h->nranks > g->size || (size_t)h->nranks * sizeof(sp_wire_rank_t) > len) {
        sp_err_set(e, SPC_ERR_PROTOCOL, "a malformed message (channel %u, %u descriptors in %zu bytes) for group %u",
                   h->channel, h->nranks, len, g->index);
        return -1;
    }
    bool refused = false;
    sp_err_t later = SP_ERR_INIT;   /* the reasons after the first go unsaid */
    size_t start = (size_t)h->nranks * sizeof(sp_wire_rank_t);
    for (uint32_t k = 0; k < h->nranks; k++) {
        sp_wire_rank_t w;   /* the payload promises no alignment either */
        memcpy(&w, payload + (size_t)k * sizeof w, sizeof w);
        arrivals[k] = (sp_wire_arrival_t){ .grank = w.grank,
                                           .op = rank_take(g, from, &w, payload, start, len, refused ? &later : e) };
        refused |= arrivals[k].op == NULL;
    }
    return (int)h->nranks;
}
