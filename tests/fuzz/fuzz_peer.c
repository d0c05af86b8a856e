/*
 * fuzz_peer.c — fuzz harness: what another daemon sends on the data path
 * (daemon/cluster/net.c, daemon/cluster/net_wire.h).
 *
 * The input (fuzz_peer.h) is a job, a group dealt over 2 to 4 daemons, and one
 * message from a peer: a header and a payload, bytes unchecked. As net.c does
 * with what UCX delivers, the harness:
 *   1. reads the header with sp_net_header_read, which must take exactly the
 *      headers of our size and magic, of a known kind, whose names end within
 *      their fields;
 *   2. copies the payload into a heap block of exactly its size, aligned as
 *      net.c's stage (ASan: nothing is read past it), and takes the message
 *      with sp_net_coll_take for the group, which must refuse it whole exactly
 *      when its channel, its sender or its count of descriptors cannot be;
 *   3. checks each op made of a descriptor: a rank of the sender's, of an
 *      opcode that runs on a group, with an error or OK for status, a
 *      terminated detail, a GPU in range; and for a host op that stands, that
 *      every input the ranks here read of it is there, as exec.c reads it (an
 *      all-reduce's or all-gather's count x element, the same of a broadcast
 *      root's, a shift send's bytes where its receiver is here): inside the
 *      payload, at a multiple of SP_WIRE_ALIGN; and for an all-to-all, each
 *      slice that sp_a2a_ranges lists for the ranks here inside the op's
 *      rebuilt input, holding the bytes packed for it, in order. Every byte
 *      read here is read (ASan);
 *   4. frees the ops (LeakSanitizer: nothing is left behind).
 * Messages whose descriptors claim an input of more than FP_NEED_MAX bytes
 * are not taken: the receiver allocates an all-to-all's input whole, which
 * the fuzzer's memory limit would count against the harness.
 * Built with libFuzzer (SP_FUZZ=ON) it is fuzzed; otherwise tests/fuzz/replay.c
 * gives it a main() and ctest runs it over tests/fuzz/corpus/peer.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "core/client.h"
#include "core/job.h"
#include "core/ops.h"
#include "cluster/net_wire.h"
#include "sp_topo.h"

#include "fuzz.h"
#include "fuzz_peer.h"

#define FP_NEED_MAX (256u << 10)

/* FUZZ_VERBOSE=1 in the environment: say what became of each descriptor (for
 * writing seeds; the fuzzer runs quiet). */
static int verbose = -1;

typedef struct fake_job {
    sp_job_t    job;
    sp_group_t  g;
    sp_member_t members[2 * FP_MAX_RANKS + 1];
    uint32_t    ranks[FP_MAX_RANKS];
    char        nodes[FP_MAX_NODES][SP_NODE_MAX];
} fake_job_t;

static void job_make(fake_job_t *f, uint32_t P, uint8_t flags)
{
    uint32_t world = fp_world(P, flags);

    memset(f, 0, sizeof *f);
    snprintf(f->job.id, sizeof f->job.id, "fuzz-node-0:peer");
    f->job.nnodes = FP_NODES(flags);
    for (uint32_t k = 0; k < f->job.nnodes; k++)
        fp_node_name(f->nodes[k], SP_NODE_MAX, k);
    f->job.nodes = f->nodes;
    f->job.world_size = world;
    f->job.complete = true;
    f->job.members = f->members;
    for (uint32_t r = 0; r < world; r++)
        f->members[r] = (sp_member_t){ .node = fp_node_of(r, world, flags), .present = true };
    for (uint32_t q = 0; q < P; q++)
        f->ranks[q] = fp_job_rank(q, flags);
    f->g = (sp_group_t){ .id = 7, .size = P, .kind = "ring", .job = &f->job, .ranks = f->ranks, .index = 3 };
    f->job.groups = &f->g;
    f->job.world = (flags & FP_F_SUBGROUP) ? NULL : &f->g;
}

static uint32_t node_of(const fake_job_t *f, uint32_t q)
{
    return f->members[f->ranks[q]].node;
}

static bool any_here(const fake_job_t *f)
{
    for (uint32_t q = 0; q < f->g.size; q++)
        if (node_of(f, q) == 0)
            return true;
    return false;
}

/* The job node that h->from names; UINT32_MAX: none. */
static uint32_t sender(const fake_job_t *f, const sp_wire_hdr_t *h)
{
    for (uint32_t k = 0; k < f->job.nnodes; k++)
        if (strcmp(f->nodes[k], h->from) == 0)
            return k;
    return UINT32_MAX;
}

static uint64_t mul_sat(uint64_t a, uint64_t b)
{
    return (a != 0 && b > UINT64_MAX / a) ? UINT64_MAX : a * b;
}

static volatile uint8_t sink;

static void read_all(const uint8_t *p, uint64_t n)
{
    uint8_t x = 0;
    for (uint64_t i = 0; i < n; i++)
        x ^= p[i];
    sink = x;
}

/* Step 1's rule, read again. */
static bool header_ours(const uint8_t *b, size_t len)
{
    sp_wire_hdr_t h;
    if (len != sizeof h)
        return false;
    memcpy(&h, b, sizeof h);
    return h.magic == SP_WIRE_MAGIC && (h.kind == SP_WIRE_COLL || h.kind == SP_WIRE_RANK_LOST) &&
           memchr(h.from, '\0', sizeof h.from) != NULL && memchr(h.job, '\0', sizeof h.job) != NULL;
}

/* Whether some descriptor the message holds claims an input too large to feed. */
static bool too_large(const sp_wire_hdr_t *h, const uint8_t *payload, size_t len)
{
    for (size_t k = 0; k < h->nranks && (k + 1) * sizeof(sp_wire_rank_t) <= len; k++) {
        sp_wire_rank_t w;
        memcpy(&w, payload + k * sizeof w, sizeof w);
        for (unsigned i = 0; i < SP_MAX_TENSORS; i++)
            if (w.need[i] > FP_NEED_MAX)
                return true;
    }
    return false;
}

/* An input's slices (all-to-all, reduce-scatter), checked as the op table lists them. */
typedef struct slices {
    const sp_op_t *op;
    uint32_t       i;
    const uint8_t *packed;   /* where the descriptor said they were packed */
    uint64_t       plen, done;
} slices_t;

static void slice_seen(void *arg, uint64_t off, uint64_t len)
{
    slices_t *s = arg;
    const sp_op_t *op = s->op;
    uint64_t need = op->need[s->i];
    FUZZ_CHECK(op->rin[s->i] != NULL && op->rin[s->i] == op->own[s->i], "input %u: slices read here, none rebuilt",
               s->i);
    FUZZ_CHECK(off <= need && len <= need - off, "input %u: a slice of %llu bytes at %llu of %llu", s->i,
               (unsigned long long)len, (unsigned long long)off, (unsigned long long)need);
    FUZZ_CHECK(len <= s->plen - s->done, "input %u: slices past the %llu bytes packed", s->i,
               (unsigned long long)s->plen);
    FUZZ_CHECK(memcmp(op->rin[s->i] + off, s->packed + s->done, len) == 0, "input %u: a slice not as packed",
               s->i);
    s->done += len;
}

static void check_sliced_input(const fake_job_t *f, const sp_op_t *op, uint32_t r, uint32_t i,
                               const sp_wire_rank_t *w, const uint8_t *payload)
{
    const struct sp_a2a_params *a = &op->params.a2a;
    bool here[FP_MAX_RANKS];

    if (i % 2 != 0 || sp_dtype_size(op->sqe.dtype) == 0)
        return;   /* an output */
    if (op->sqe.opcode == SP_OP_ALLTOALL && (i / 2 >= a->ntensors || i / 2 >= SP_A2A_MAX_TENSORS))
        return;   /* no input of the descriptor */
    for (uint32_t q = 0; q < f->g.size; q++)
        here[q] = node_of(f, q) == 0;
    slices_t s = { .op = op, .i = i };
    if (op->rin[i] != NULL) {
        s.packed = payload + w->off[i];
        s.plen = w->plen[i];
    }
    sp_op_kind(op->sqe.opcode)->slices(op, f->g.size, r, i, here, slice_seen, &s);
    FUZZ_CHECK(s.done == s.plen, "input %u: %llu bytes packed, %llu read", i, (unsigned long long)s.plen,
               (unsigned long long)s.done);
}

/* Step 3's inputs: what the ranks here read of rank r's op. */
static void check_inputs(const fake_job_t *f, const sp_op_t *op, uint32_t r, const sp_wire_rank_t *w,
                         const uint8_t *payload, size_t len)
{
    const struct sp_sqe *e = &op->sqe;
    const uint32_t P = f->g.size;
    uint64_t per_rank = mul_sat(e->count, sp_dtype_size(e->dtype));
    bool reverse = e->flags & SP_SHIFT_F_REVERSE, linear = e->flags & SP_SHIFT_F_LINEAR;
    uint32_t to = reverse ? (r + P - 1) % P : (r + 1) % P;
    bool to_edge = reverse ? to == P - 1 : to == 0;

    for (uint32_t i = 0; i < e->ntensors; i++) {
        bool read = false;
        uint64_t extent = 0;
        switch (e->opcode) {
        case SP_OP_ALLREDUCE:
        case SP_OP_ALLGATHER:
            read = i == 0 && any_here(f);
            extent = per_rank;
            break;
        case SP_OP_BROADCAST:
            read = i == 0 && r == e->root && any_here(f);
            extent = per_rank;
            break;
        case SP_OP_REDUCE_SCATTER:
            if (i == 0 && any_here(f))
                check_sliced_input(f, op, r, i, w, payload);
            continue;
        case SP_OP_SHIFT:
            read = i % 2 == 0 && node_of(f, to) == 0 && !(linear && to_edge);
            extent = op->tensor[i].bytes;
            break;
        case SP_OP_ALLTOALL:
        case SP_OP_ALLTOALLV:
            check_sliced_input(f, op, r, i, w, payload);
            continue;
        default:
            break;
        }
        if (!read || extent == 0)
            continue;
        const uint8_t *p = op->rin[i];
        FUZZ_CHECK(p != NULL, "rank %u's %s input %u is read here and did not come", r, sp_op_name(e->opcode), i);
        FUZZ_CHECK(p >= payload && (size_t)(p - payload) <= len && extent <= len - (size_t)(p - payload),
                   "rank %u's %s input %u: %llu bytes read at %td of a %zu-byte payload", r, sp_op_name(e->opcode),
                   i, (unsigned long long)extent, p - payload, len);
        FUZZ_CHECK((size_t)(p - payload) % SP_WIRE_ALIGN == 0, "rank %u input %u at %td", r, i, p - payload);
        read_all(p, extent);
    }
}

/* Step 3 for the op of descriptor w. */
static void check_op(const fake_job_t *f, uint32_t from, const sp_wire_arrival_t *a, const sp_wire_rank_t *w,
                     const uint8_t *payload, size_t len)
{
    const sp_op_t *op = a->op;
    uint32_t r = a->grank;

    FUZZ_CHECK(r == w->grank && r < f->g.size && node_of(f, r) == from, "rank %u taken from node %u", r, from);
    FUZZ_CHECK(op->client == NULL && op->stage == NULL, "a remote op with a client or a stage");
    FUZZ_CHECK(op->sqe.opcode >= SP_OP_BARRIER && op->sqe.opcode <= SP_OP_ALLTOALLV && op->sqe.ntensors <= SP_MAX_TENSORS,
               "opcode %u with %u tensors", op->sqe.opcode, op->sqe.ntensors);
    FUZZ_CHECK(op->local.status <= 0, "status %d", (int)op->local.status);
    FUZZ_CHECK(memchr(op->local.msg, '\0', sizeof op->local.msg) != NULL, "detail not terminated");
    FUZZ_CHECK(!op->device || (op->gpu >= 0 && op->gpu < SP_TOPO_MAX_GPUS), "GPU %d", op->gpu);
    if (op->local.status != SPC_OK || op->device)
        return;   /* a refused rank fails the collective; GPU inputs go by NCCL */
    check_inputs(f, op, r, w, payload, len);
}

static void op_free(sp_op_t *op)
{
    for (unsigned i = 0; i < SP_MAX_TENSORS; i++)
        free(op->own[i]);
    free(op);
}

/* Step 2's rule, read again: whether the whole message is refused. */
static bool message_refused(const fake_job_t *f, const sp_wire_hdr_t *h, size_t len)
{
    uint32_t from = sender(f, h);
    return h->channel >= SP_CHANNELS || from == UINT32_MAX || from == 0 || h->nranks > f->g.size ||
           (uint64_t)h->nranks * sizeof(sp_wire_rank_t) > len;
}

static void take_message(const fake_job_t *f, const sp_wire_hdr_t *h, const uint8_t *payload, size_t len)
{
    sp_wire_arrival_t arrivals[FP_MAX_RANKS];
    sp_err_t e = SP_ERR_INIT;
    int n = sp_net_coll_take(&f->g, h, payload, len, arrivals, &e);

    if (verbose)
        fprintf(stderr, "  %d of %u descriptors%s%s\n", n, h->nranks, e.msg[0] ? ": " : "", e.msg);
    FUZZ_CHECK((n < 0) == message_refused(f, h, len), "message refused: %d (%s)", n < 0, e.msg);
    if (n < 0) {
        FUZZ_CHECK(e.status != SPC_OK && e.msg[0] != '\0', "a message refused without a reason");
        return;
    }
    FUZZ_CHECK((uint32_t)n == h->nranks, "%d arrivals of %u descriptors", n, h->nranks);
    bool refused = false;
    for (int k = 0; k < n; k++) {
        sp_wire_rank_t w;
        memcpy(&w, payload + (size_t)k * sizeof w, sizeof w);
        if (arrivals[k].op == NULL) {
            refused = true;
            continue;
        }
        if (verbose)
            fprintf(stderr, "    rank %u: %s, status %d\n", arrivals[k].grank, sp_op_name(arrivals[k].op->sqe.opcode),
                    (int)arrivals[k].op->local.status);
        check_op(f, sender(f, h), &arrivals[k], &w, payload, len);
        op_free(arrivals[k].op);
    }
    FUZZ_CHECK(!refused || (e.status != SPC_OK && e.msg[0] != '\0'), "a descriptor refused without a reason");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static fake_job_t f;
    sp_wire_hdr_t h;

    if (verbose < 0)
        verbose = getenv("FUZZ_VERBOSE") != NULL;
    if (size < FP_HDR_BYTES)
        return 0;
    uint32_t P = data[0] % FP_MAX_RANKS + 1;
    uint8_t flags = data[1];
    size_t hlen = size - FP_HDR_BYTES < sizeof h ? size - FP_HDR_BYTES : sizeof h;
    const uint8_t *hb = data + FP_HDR_BYTES;

    /* 1. The header; the same bytes one short are never one. */
    bool ours = sp_net_header_read(hb, hlen, &h);
    FUZZ_CHECK(ours == header_ours(hb, hlen), "header of %zu bytes taken: %d", hlen, ours);
    sp_wire_hdr_t shorter;
    FUZZ_CHECK(hlen == 0 || !sp_net_header_read(hb, hlen - 1, &shorter), "a header of %zu bytes taken", hlen - 1);
    if (!ours)
        return 0;
    if (verbose)
        fprintf(stderr, "  kind %u from %s, %u ranks, channel %u\n", h.kind, h.from, h.nranks, h.channel);
    if (h.kind != SP_WIRE_COLL)
        return 0;   /* a rank lost: net.c reads a bounded reason, and a rank it checks against the job */

    /* 2. The payload, in a block of its exact size aligned as a stage's. */
    size_t len = size - FP_HDR_BYTES - sizeof h;
    const uint8_t *src = hb + sizeof h;
    if (too_large(&h, src, len))
        return 0;
    void *block = NULL;
    FUZZ_CHECK(posix_memalign(&block, SP_WIRE_ALIGN, len ? len : 1) == 0, "out of memory");
    memcpy(block, src, len);
    job_make(&f, P, flags);
    take_message(&f, &h, block, len);
    free(block);
    return 0;
}
