/*
 * validate.c — what the daemon checks before any byte moves.
 *
 * Two stages. sp_op_validate looks at one rank's request alone: the descriptor
 * makes sense, every tensor lies inside memory the client owns and is large
 * enough, send and receive do not overlap. sp_coll_agree then compares the ranks
 * of a collective with each other (op, dtype, sizes, head counts, flags); the
 * detail of a disagreement names the ranks and the fields, so a user can tell
 * "rank 3 passed 7 heads" from "rank 3 submitted its ops in another order".
 */
#include "core/client.h"
#include "core/coll.h"
#include "core/job.h"
#include "core/mem.h"
#include "core/ops.h"
#include "core/validate.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "base/log.h"
#include "sp_kern.h"
#include "sp_ulysses.h"

static const char *redop_name(unsigned redop)
{
    switch (redop) {
    case SP_REDOP_SUM: return "sum";
    case SP_REDOP_MAX: return "max";
    case SP_REDOP_MIN: return "min";
    }
    return "unknown";
}

#define REFUSE(op, st, ...)                          \
    do {                                             \
        sp_err_set(&(op)->local, (st), __VA_ARGS__); \
        return;                                      \
    } while (0)

/* a * b, or UINT64_MAX when it does not fit. */
static uint64_t mul_sat(uint64_t a, uint64_t b)
{
    return (a != 0 && b > UINT64_MAX / a) ? UINT64_MAX : a * b;
}

/*
 * Checks tensor i of op against `need` bytes, the extent the op reads or writes
 * there; refuses the op on failure. A tensor's declared length is the client's
 * word for what its buffer holds: spd cannot see a client's arena allocator, so
 * that word must be given and must cover the extent, or spd would write past
 * the buffer into whatever the client keeps after it. `shape` (may be NULL)
 * says where the extent comes from.
 */
static bool tensor_ok(sp_op_t *op, unsigned i, uint64_t need, const char *what, const char *shape)
{
    const struct sp_tensor_ref *t = &op->tensor[i];
    sp_err_t e = SP_ERR_INIT;

    if (need == UINT64_MAX) {
        sp_err_set(&op->local, SPC_ERR_INVALID_ARG, "%s tensor: its size overflows", what);
        return false;
    }
    if (t->bytes < need) {
        sp_err_set(&op->local, SPC_ERR_INVALID_ARG, "%s tensor holds %" PRIu64 " bytes; the op needs %" PRIu64
                   "%s%s%s: give it a buffer of at least that", what, t->bytes, need, shape ? " (" : "",
                   shape ? shape : "", shape ? ")" : "");
        return false;
    }
    /* A rank of another daemon: that daemon checked its memory (net.c). */
    spc_status_t st = op->client != NULL ? sp_mem_check(op->client, t, need, &e) : SPC_OK;
    if (st != SPC_OK) {
        sp_err_set(&op->local, st, "%s tensor: %s", what, e.msg);
        return false;
    }
    op->need[i] = need;   /* the extent the copy will touch */
    return true;
}

/* Whether [a, a + an) and [b, b + bn) of the same region overlap. */
static bool overlap(const struct sp_tensor_ref *a, uint64_t an, const struct sp_tensor_ref *b, uint64_t bn)
{
    return a->region == b->region && an != 0 && bn != 0 && a->offset < b->offset + bn && b->offset < a->offset + an;
}

/*
 * An op of `count` elements per block: allreduce and reduce-scatter (send and
 * receive), allgather (a block from each rank into every receive), broadcast
 * (one buffer, the root's sent). A block's extent is count x element; the
 * kind's traits say how many blocks each tensor holds.
 */
void sp_check_counted(sp_op_t *op, uint32_t size)
{
    const struct sp_sqe *e = &op->sqe;
    const uint32_t flags = sp_op_kind(e->opcode)->flags;
    size_t es = sp_dtype_size(e->dtype);
    uint64_t per_rank = mul_sat(e->count, es);

    if (flags & SP_OPK_ROOT) {
        if (e->ntensors != 1)
            REFUSE(op, SPC_ERR_INVALID_ARG, "%s takes 1 tensor; got %u", sp_op_name(e->opcode), e->ntensors);
        if (e->root >= size)
            REFUSE(op, SPC_ERR_INVALID_ARG, "%s root %u is not a rank of this %u-rank group", sp_op_name(e->opcode),
                   e->root, size);
    } else if (e->ntensors != 2) {
        REFUSE(op, SPC_ERR_INVALID_ARG, "%s takes 2 tensors (send, receive); got %u", sp_op_name(e->opcode),
               e->ntensors);
    }
    if (es == 0)
        REFUSE(op, SPC_ERR_INVALID_ARG, "unknown dtype %u", e->dtype);
    if ((flags & SP_OPK_REDOP) && !sp_kern_reduce_supported(e->dtype, e->redop))
        REFUSE(op, SPC_ERR_UNSUPPORTED, "%s %s over %s is not supported (sum, max, min over fp32, fp64, "
               "fp16, bf16, int32, int64)", sp_op_name(e->opcode), redop_name(e->redop), sp_dtype_name(e->dtype));
    if (e->count == 0 || per_rank == UINT64_MAX)
        REFUSE(op, SPC_ERR_INVALID_ARG, "%s count %" PRIu64 " is not a valid element count", sp_op_name(e->opcode),
               e->count);
    uint64_t send = flags & SP_OPK_SCATTER ? mul_sat(per_rank, size) : per_rank;
    if (!tensor_ok(op, 0, send, flags & SP_OPK_ROOT ? sp_op_name(e->opcode) : "send", NULL))
        return;
    if (flags & SP_OPK_ROOT)
        return;
    uint64_t recv = flags & SP_OPK_GATHER ? mul_sat(per_rank, size) : per_rank;
    if (!tensor_ok(op, 1, recv, "receive", NULL))
        return;
    /* An all-reduce may run in place; a partial overlap would read what it wrote. */
    bool same = op->tensor[0].region == op->tensor[1].region && op->tensor[0].offset == op->tensor[1].offset;
    if (overlap(&op->tensor[0], send, &op->tensor[1], recv) && !((flags & SP_OPK_IN_PLACE) && same))
        REFUSE(op, SPC_ERR_INVALID_ARG, "%s: send and receive overlap%s", sp_op_name(e->opcode),
               flags & SP_OPK_IN_PLACE ? " without being the same buffer" : "");
}

void sp_check_barrier(sp_op_t *op, uint32_t size)
{
    if (op->sqe.ntensors != 0)
        REFUSE(op, SPC_ERR_INVALID_ARG, "barrier takes no tensors (got %u)", op->sqe.ntensors);
}

void sp_check_shift(sp_op_t *op, uint32_t size)
{
    const struct sp_sqe *e = &op->sqe;
    if (e->ntensors == 0 || e->ntensors % 2 != 0)
        REFUSE(op, SPC_ERR_INVALID_ARG, "shift takes (send, receive) pairs; got %u tensors", e->ntensors);
    if (e->flags & ~(SP_SHIFT_F_LINEAR | SP_SHIFT_F_REVERSE))
        REFUSE(op, SPC_ERR_INVALID_ARG, "shift: unknown flags 0x%x", e->flags);
    for (unsigned i = 0; i < e->ntensors; i += 2) {
        /* The send's length is the op's extent; the receive must hold it. */
        uint64_t n = op->tensor[i].bytes;
        char what[32];
        if (n == 0)
            REFUSE(op, SPC_ERR_INVALID_ARG, "shift tensor %u: its send has 0 bytes", i / 2);
        snprintf(what, sizeof what, "send %u", i / 2);
        if (!tensor_ok(op, i, n, what, NULL))
            return;
        snprintf(what, sizeof what, "receive %u", i / 2);
        if (!tensor_ok(op, i + 1, n, what, NULL))
            return;
        if (op->tensor[i + 1].bytes != n)
            REFUSE(op, SPC_ERR_INVALID_ARG, "shift tensor %u: send has %" PRIu64 " bytes, receive %" PRIu64
                   " (they must be equal)", i / 2, n, op->tensor[i + 1].bytes);
        for (unsigned k = 0; k < e->ntensors; k++)
            if (k != i + 1 && overlap(&op->tensor[i + 1], n, &op->tensor[k], op->tensor[k].bytes))
                REFUSE(op, SPC_ERR_INVALID_ARG, "shift: receive %u overlaps another tensor of the op", i / 2);
    }
}

/* Bytes of one tensor of an all-to-all: rows x heads x head_dim x element. */
static uint64_t a2a_bytes(const struct sp_a2a_params *a, uint64_t rows, uint32_t heads, uint32_t dim, size_t es)
{
    return mul_sat(mul_sat(mul_sat(mul_sat(a->batch, rows), heads), dim), es);
}

/*
 * Checks tensor i of an all-to-all against the `rows` x `heads` its side of the
 * op spans (rows ceil(S / P) on the sequence side, heads the padded local ones
 * on the head side); a refusal says the shape, "[B, rows, heads, D] fp32" or
 * seq-first.
 */
static bool a2a_tensor_ok(sp_op_t *op, unsigned i, const char *what, uint32_t rows, uint32_t heads, uint32_t dim)
{
    const struct sp_a2a_params *a = &op->params.a2a;
    uint64_t need = a2a_bytes(a, rows, heads, dim, sp_dtype_size(op->sqe.dtype));
    char shape[96];
    bool seq_first = a->layout == SP_LAYOUT_SBHD;

    if (op->tensor[i].bytes >= need)
        return tensor_ok(op, i, need, what, NULL);
    snprintf(shape, sizeof shape, "[%u, %u, %u, %u] %s", seq_first ? rows : a->batch, seq_first ? a->batch : rows,
             heads, dim, sp_dtype_name(op->sqe.dtype));
    return tensor_ok(op, i, need, what, shape);
}

void sp_check_alltoall(sp_op_t *op, uint32_t size)
{
    const struct sp_sqe *e = &op->sqe;
    const struct sp_a2a_params *a = &op->params.a2a;
    size_t es = sp_dtype_size(e->dtype);

    if (e->param_bytes < offsetof(struct sp_a2a_params, t))
        REFUSE(op, SPC_ERR_INVALID_ARG, "alltoall: descriptor of %u bytes, expected %zu at least", e->param_bytes,
               offsetof(struct sp_a2a_params, t));
    if (es == 0)
        REFUSE(op, SPC_ERR_INVALID_ARG, "alltoall: unknown dtype %u", e->dtype);
    if (a->ntensors == 0 || a->ntensors > SP_A2A_MAX_TENSORS || e->ntensors != 2 * a->ntensors)
        REFUSE(op, SPC_ERR_INVALID_ARG, "alltoall: %u tensors (1 to %d, each a send and a receive; %u refs given)",
               a->ntensors, SP_A2A_MAX_TENSORS, e->ntensors);
    /* Its tensors' entries, and no more: protocol 1's descriptor held 4. */
    size_t need = offsetof(struct sp_a2a_params, t) + a->ntensors * sizeof a->t[0];
    if (e->param_bytes < need)
        REFUSE(op, SPC_ERR_INVALID_ARG, "alltoall: descriptor of %u bytes, %u tensors take %zu", e->param_bytes,
               a->ntensors, need);
    if (a->direction > SP_A2A_HEAD_TO_SEQ || a->layout > SP_LAYOUT_SBHD)
        REFUSE(op, SPC_ERR_INVALID_ARG, "alltoall: direction %u or layout %u unknown", a->direction, a->layout);
    if (a->batch == 0 || a->seq_len == 0)
        REFUSE(op, SPC_ERR_INVALID_ARG, "alltoall: batch %u and sequence length %u must be positive", a->batch,
               a->seq_len);

    uint32_t s_loc = sp_rows_local(a->seq_len, size);
    for (unsigned i = 0; i < a->ntensors; i++) {
        const struct sp_a2a_tensor *t = &a->t[i];
        sp_heads_plan_t pl;
        if (t->head_dim == 0 || t->flags & ~SP_A2A_T_SUM_REPLICAS)
            REFUSE(op, SPC_ERR_INVALID_ARG, "alltoall tensor %u: head_dim %u, flags 0x%x", i, t->head_dim, t->flags);
        /* Summing replicas is a reduction: a type that cannot be summed would
         * silently get the first copy instead. */
        if ((t->flags & SP_A2A_T_SUM_REPLICAS) && !sp_kern_reduce_supported(e->dtype, SP_KERN_SUM))
            REFUSE(op, SPC_ERR_UNSUPPORTED, "alltoall tensor %u: replicas of %s cannot be summed", i,
                   sp_dtype_name(e->dtype));
        if (!sp_heads_plan(&pl, t->heads, t->kind, a->kv_heads, size)) {
            if (t->kind == SP_HEADS_Q && a->kv_heads != 0 && t->heads % a->kv_heads != 0)
                REFUSE(op, SPC_ERR_INVALID_ARG, "alltoall tensor %u: %u kv_heads do not divide its %u heads", i,
                       a->kv_heads, t->heads);
            REFUSE(op, SPC_ERR_INVALID_ARG, "alltoall tensor %u: %u %s heads cannot be dealt to %u ranks (with fewer "
                   "head groups than ranks, the ranks must be a multiple of the groups)", i, t->heads,
                   t->kind == SP_HEADS_KV ? "kv" : "query", size);
        }
        bool s2h = a->direction == SP_A2A_SEQ_TO_HEAD;
        uint32_t send_rows = s2h ? s_loc : a->seq_len, send_heads = s2h ? t->heads : pl.local;
        uint32_t recv_rows = s2h ? a->seq_len : s_loc, recv_heads = s2h ? pl.local : t->heads;
        char what[32];
        snprintf(what, sizeof what, "alltoall send %u", i);
        if (!a2a_tensor_ok(op, 2 * i, what, send_rows, send_heads, t->head_dim))
            return;
        snprintf(what, sizeof what, "alltoall receive %u", i);
        if (!a2a_tensor_ok(op, 2 * i + 1, what, recv_rows, recv_heads, t->head_dim))
            return;
        uint64_t recv = op->need[2 * i + 1];
        /* Each receive is written while every send is read, on every rank. */
        for (unsigned k = 0; k < e->ntensors; k++) {
            uint64_t kb = op->tensor[k].bytes;
            if (k != 2 * i + 1 && overlap(&op->tensor[2 * i + 1], recv, &op->tensor[k], kb ? kb : 1))
                REFUSE(op, SPC_ERR_INVALID_ARG, "alltoall: receive %u overlaps another tensor of the op", i);
        }
    }
}

/* a + b, or UINT64_MAX when it does not fit. */
static uint64_t add_sat(uint64_t a, uint64_t b)
{
    return b > UINT64_MAX - a ? UINT64_MAX : a + b;
}

/*
 * An uneven all-to-all: a count per rank each way (sp_shm.h), each side as
 * long as its counts. Whether the counts of different ranks pair up is the
 * agreement's (sp_agree_alltoallv), but for a group of one, whose rank only
 * sends to itself.
 */
void sp_check_alltoallv(sp_op_t *op, uint32_t size)
{
    const struct sp_sqe *e = &op->sqe;
    const struct sp_a2av_params *a = &op->params.a2av;
    const size_t es = sp_dtype_size(e->dtype);

    if (e->ntensors != 2)
        REFUSE(op, SPC_ERR_INVALID_ARG, "alltoallv takes 2 tensors (send, receive); got %u", e->ntensors);
    if (es == 0)
        REFUSE(op, SPC_ERR_INVALID_ARG, "alltoallv: unknown dtype %u", e->dtype);
    if (size > SP_A2AV_MAX_RANKS)
        REFUSE(op, SPC_ERR_UNSUPPORTED, "alltoallv on a group of %u ranks; at most %d", size, SP_A2AV_MAX_RANKS);
    if (e->param_bytes != 2 * size * sizeof a->counts[0])
        REFUSE(op, SPC_ERR_INVALID_ARG, "alltoallv: %u bytes of counts; a group of %u ranks takes %zu", e->param_bytes,
               size, 2 * size * sizeof a->counts[0]);
    if (size == 1 && a->counts[0] != a->counts[1])
        REFUSE(op, SPC_ERR_MISMATCH, "alltoallv: rank 0 sends %" PRIu64 " elements to itself and expects %" PRIu64,
               a->counts[0], a->counts[1]);
    uint64_t send = 0, recv = 0;
    for (uint32_t j = 0; j < size; j++) {
        send = add_sat(send, a->counts[j]);
        recv = add_sat(recv, a->counts[size + j]);
    }
    send = mul_sat(send, es);
    recv = mul_sat(recv, es);
    if (!tensor_ok(op, 0, send, "send", NULL) || !tensor_ok(op, 1, recv, "receive", NULL))
        return;
    if (overlap(&op->tensor[0], send, &op->tensor[1], recv))
        REFUSE(op, SPC_ERR_INVALID_ARG, "alltoallv: send and receive overlap");
}

/*
 * Where the tensors of an op that passed its other checks are: all in host
 * memory, or all in GPU memory of one GPU, the rank's (the ranks of one op may
 * each have their own: gpu/devplan.c runs each kernel on the GPU of what it
 * writes). A mix is refused up front: no transfer path between the two exists.
 * A device tensor must start on a multiple of its element size: the kernels
 * load whole elements, and a misaligned load is a fault that would poison the
 * context spd shares with every other client of that GPU.
 */
static void validate_op(sp_op_t *op, uint32_t group_size);

static void validate_memory(sp_op_t *op)
{
    const struct sp_sqe *e = &op->sqe;
    int first_dev = -1, first_host = -1;

    for (unsigned i = 0; i < e->ntensors; i++) {
        const sp_region_t *r = sp_mem_device(op->client, &op->tensor[i]);
        if (r == NULL) {
            if (first_host < 0)
                first_host = (int)i;
            continue;
        }
        size_t es = sp_dtype_size(e->dtype);
        uint64_t at = r->addr + op->tensor[i].offset;
        if (es > 1 && at % es != 0)
            REFUSE(op, SPC_ERR_INVALID_ARG, "%s: tensor %u at 0x%" PRIx64 " in GPU memory is not aligned to its %zu-byte "
                   "%s elements", sp_op_name(e->opcode), i, at, es, sp_dtype_name(e->dtype));
        if (first_dev < 0) {
            first_dev = (int)i;
            op->gpu = r->gpu;
        } else if (r->gpu != op->gpu) {
            REFUSE(op, SPC_ERR_INVALID_ARG, "%s: tensor %u is on GPU %d, tensor %d on GPU %d: an op's device tensors "
                   "must be on one GPU", sp_op_name(e->opcode), i, r->gpu, first_dev, op->gpu);
        }
    }
    if (first_dev >= 0 && first_host >= 0)
        REFUSE(op, SPC_ERR_INVALID_ARG, "%s mixes memories: tensor %d is in GPU memory (region %u), tensor %d in host "
               "memory (region %u); an op's tensors must all be on the GPU or all in host memory",
               sp_op_name(e->opcode), first_dev, op->tensor[first_dev].region, first_host,
               op->tensor[first_host].region);
    op->device = first_dev >= 0;
}

void sp_op_validate(sp_op_t *op, uint32_t group_size)
{
    op->local.status = SPC_OK;
    op->device = false;
    op->gpu = -1;
    validate_op(op, group_size);
    if (op->local.status == SPC_OK)
        validate_memory(op);
}

void sp_op_validate_remote(sp_op_t *op, uint32_t group_size)
{
    /* Its memory, and where it is (device, gpu), are its own daemon's word. */
    op->local.status = SPC_OK;
    memset(op->need, 0, sizeof op->need);
    validate_op(op, group_size);
}

static void validate_op(sp_op_t *op, uint32_t group_size)
{
    const struct sp_sqe *e = &op->sqe;
    const sp_op_kind_t *k = sp_op_kind(e->opcode);

    if (k == NULL || k->check == NULL)
        return;   /* no group op: sp_op_dispatch and net.c refuse it first */
    if (!(k->flags & SP_OPK_FLAGS) && e->flags != 0)
        REFUSE(op, SPC_ERR_INVALID_ARG, "%s takes no flags (got 0x%x)", sp_op_name(e->opcode), e->flags);
    k->check(op, group_size);
}

/* ---------------------------------------------------------------- agreement */

struct sp_agree {
    const sp_group_t *g;
    char  *buf;
    size_t len, off;
    int    n;
    sp_op_t *const *ops;   /* by group rank: what an agreement between other ranks than 0 reads */
};

/* Appends "rank r sent <name> x, rank 0 sent y" when the values differ. */
static void text(sp_agree_t *ag, uint32_t r, const char *name, const char *got, const char *want)
{
    if (strcmp(got, want) == 0 || ag->off >= ag->len)
        return;
    char who[40], first[40];
    sp_rank_text(who, sizeof who, ag->g, r);
    sp_rank_text(first, sizeof first, ag->g, 0);
    if (strcmp(name, "op") == 0)
        ag->off += (size_t)snprintf(ag->buf + ag->off, ag->len - ag->off, "%srank %s submitted %s where rank %s submitted %s",
                                    ag->n ? "; " : "", who, got, first, want);
    else
        ag->off += (size_t)snprintf(ag->buf + ag->off, ag->len - ag->off, "%srank %s sent %s %s, rank %s sent %s",
                                    ag->n ? "; " : "", who, name, got, first, want);
    ag->n++;
}

static void field(sp_agree_t *ag, uint32_t r, const char *name, uint64_t got, uint64_t want)
{
    char g[24], w[24];
    snprintf(g, sizeof g, "%" PRIu64, got);
    snprintf(w, sizeof w, "%" PRIu64, want);
    text(ag, r, name, g, w);
}

void sp_agree_alltoall(sp_agree_t *ag, uint32_t r, const sp_op_t *bop, const sp_op_t *aop)
{
    const struct sp_a2a_params *b = &bop->params.a2a, *a = &aop->params.a2a;
    static const char *const dir[] = { "seq->head", "head->seq" };
    static const char *const lay[] = { "BSHD", "SBHD" };
    text(ag, r, "direction", dir[b->direction & 1], dir[a->direction & 1]);
    text(ag, r, "layout", lay[b->layout & 1], lay[a->layout & 1]);
    field(ag, r, "batch", b->batch, a->batch);
    field(ag, r, "seq_len", b->seq_len, a->seq_len);
    field(ag, r, "kv_heads", b->kv_heads, a->kv_heads);
    field(ag, r, "tensors", b->ntensors, a->ntensors);
    /* An op of another daemon arrives unvalidated here (net.c): its count may
     * exceed the descriptor's tensors. */
    for (unsigned i = 0; i < a->ntensors && i < b->ntensors && i < SP_A2A_MAX_TENSORS; i++) {
        char name[32];
        snprintf(name, sizeof name, "tensor %u heads", i);
        field(ag, r, name, b->t[i].heads, a->t[i].heads);
        snprintf(name, sizeof name, "tensor %u head_dim", i);
        field(ag, r, name, b->t[i].head_dim, a->t[i].head_dim);
        snprintf(name, sizeof name, "tensor %u kind", i);
        text(ag, r, name, b->t[i].kind ? "kv" : "q", a->t[i].kind ? "kv" : "q");
        snprintf(name, sizeof name, "tensor %u flags", i);
        field(ag, r, name, b->t[i].flags, a->t[i].flags);
    }
}

/* Appends "rank f sends n elements to rank t, which expects m from it" when
 * the two counts of that block differ. */
static void a2av_block(sp_agree_t *ag, uint32_t from, uint32_t to)
{
    const uint32_t P = ag->g->size;
    const sp_op_t *s = ag->ops[from], *d = ag->ops[to];
    if (s->sqe.opcode != SP_OP_ALLTOALLV || d->sqe.opcode != SP_OP_ALLTOALLV || P > SP_A2AV_MAX_RANKS)
        return;   /* told as a disagreement on the op, or refused by the check */
    uint64_t sent = s->params.a2av.counts[to], want = d->params.a2av.counts[P + from];
    if (sent == want || ag->off >= ag->len)
        return;
    char sender[40], receiver[40];
    sp_rank_text(sender, sizeof sender, ag->g, from);
    sp_rank_text(receiver, sizeof receiver, ag->g, to);
    ag->off += (size_t)snprintf(ag->buf + ag->off, ag->len - ag->off, "%srank %s sends %" PRIu64 " elements to rank %s"
                                ", which expects %" PRIu64 " from it", ag->n ? "; " : "", sender, sent, receiver, want);
    ag->n++;
}

/*
 * Every block of an uneven all-to-all, sent and expected alike: at rank r,
 * r's sends to each rank, and rank 0's to r (and, at rank 1, rank 0's to
 * itself), so that over r = 1 .. P-1 each of the P x P blocks is seen once.
 */
void sp_agree_alltoallv(sp_agree_t *ag, uint32_t r, const sp_op_t *bop, const sp_op_t *aop)
{
    for (uint32_t j = 0; j < ag->g->size; j++)
        a2av_block(ag, r, j);
    a2av_block(ag, 0, r);
    if (r == 1)
        a2av_block(ag, 0, 0);
}

/* An op of count elements: its reduction, its count, its root. */
void sp_agree_counted(sp_agree_t *ag, uint32_t r, const sp_op_t *bop, const sp_op_t *aop)
{
    const struct sp_sqe *b = &bop->sqe, *a = &aop->sqe;
    const uint32_t flags = sp_op_kind(a->opcode)->flags;
    if (flags & SP_OPK_REDOP)
        text(ag, r, "redop", redop_name(b->redop), redop_name(a->redop));
    field(ag, r, "count", b->count, a->count);
    if (flags & SP_OPK_ROOT)
        field(ag, r, "root", b->root, a->root);
}

void sp_agree_shift(sp_agree_t *ag, uint32_t r, const sp_op_t *bop, const sp_op_t *aop)
{
    const struct sp_sqe *b = &bop->sqe, *a = &aop->sqe;
    field(ag, r, "flags", b->flags, a->flags);
    field(ag, r, "tensors", b->ntensors / 2, a->ntensors / 2);
    for (unsigned i = 0; i < a->ntensors && i < b->ntensors; i += 2) {
        char name[32];
        snprintf(name, sizeof name, "tensor %u bytes", i / 2);
        field(ag, r, name, bop->tensor[i].bytes, aop->tensor[i].bytes);
    }
}

bool sp_coll_agree(const sp_group_t *g, sp_op_t *const *ops, sp_err_t *e)
{
    const sp_op_t *o0 = ops[0];
    const struct sp_sqe *a = &o0->sqe;
    const sp_op_kind_t *k = sp_op_kind(a->opcode);
    sp_agree_t ag = { g, e->msg, sizeof e->msg, 0, 0, ops };   /* each disagreement appends to the detail */

    if (k == NULL) {   /* sp_op_dispatch and net.c take group ops only */
        sp_err_set(e, SPC_ERR_MISMATCH, "opcode %u runs on no group", a->opcode);
        return false;
    }
    for (uint32_t r = 1; r < g->size; r++) {
        const struct sp_sqe *b = &ops[r]->sqe;
        if (b->opcode != a->opcode) {
            /* Other fields mean nothing across different ops: most likely the
             * ranks issued their ops in different orders. */
            text(&ag, r, "op", sp_op_name(b->opcode), sp_op_name(a->opcode));
            continue;
        }
        if (k->agree == NULL && !(k->flags & SP_OPK_TYPED))
            continue;   /* a barrier: nothing to agree on */
        text(&ag, r, "memory", ops[r]->device ? "GPU" : "host", o0->device ? "GPU" : "host");
        if (k->flags & SP_OPK_TYPED)
            text(&ag, r, "dtype", sp_dtype_name(b->dtype), sp_dtype_name(a->dtype));
        if (k->agree != NULL)
            k->agree(&ag, r, ops[r], o0);
    }
    if (ag.n == 0)
        return true;
    e->status = SPC_ERR_MISMATCH;
    return false;
}
