/*
 * ops.c — the op table: one row per opcode (ops.h), and the rules of which
 * tensors are inputs and which daemons read them, which the host path and the
 * path between daemons share.
 */
#include "core/ops.h"

#include "core/client.h"
#include "core/job.h"
#include "core/stats.h"
#include "sp_ulysses.h"

/* ---------------------------------------------------------------- inputs */

/* Tensor refs come as (send, receive) pairs: the even ones are read. */
static bool input_sends(const struct sp_sqe *e, uint32_t rank, uint32_t i)
{
    return i % 2 == 0;
}

/* The root's buffer is read, every other rank's written. */
static bool input_root(const struct sp_sqe *e, uint32_t rank, uint32_t i)
{
    return rank == e->root && i == 0;
}

static bool reads_none(const sp_group_t *g, const sp_op_t *op, uint32_t r, uint32_t node)
{
    return false;
}

/* Every rank's input makes every rank's output. */
static bool reads_all(const sp_group_t *g, const sp_op_t *op, uint32_t r, uint32_t node)
{
    return true;
}

static bool reads_root(const sp_group_t *g, const sp_op_t *op, uint32_t r, uint32_t node)
{
    return r == op->sqe.root;
}

/* The daemon of the rank it sends to. */
static bool reads_shift(const sp_group_t *g, const sp_op_t *op, uint32_t r, uint32_t node)
{
    const struct sp_sqe *e = &op->sqe;
    bool reverse = e->flags & SP_SHIFT_F_REVERSE, linear = e->flags & SP_SHIFT_F_LINEAR;
    if (linear && (reverse ? r == 0 : r == g->size - 1))
        return false;   /* sent past the end of a linear shift: nobody reads it */
    uint32_t dst = reverse ? (r + g->size - 1) % g->size : (r + 1) % g->size;
    return g->job->members[g->ranks[dst]].node == node;
}

/* The daemons of the ranks it sends a block to. */
static bool reads_a2av(const sp_group_t *g, const sp_op_t *op, uint32_t r, uint32_t node)
{
    if (g->size > SP_A2AV_MAX_RANKS)
        return false;   /* refused by its check on every rank */
    for (uint32_t q = 0; q < g->size; q++)
        if (op->params.a2av.counts[q] > 0 && g->job->members[g->ranks[q]].node == node)
            return true;
    return false;
}

/* ---------------------------------------------------------------- slices */

/*
 * The byte ranges of group rank `rank`'s input tensor `tensor` that the ranks
 * marked in `reader` read, in order, adjacent ones merged: what another daemon
 * needs of an all-to-all input (net.c sends these and the receiver puts them
 * back in place, both from this one enumeration). seq->head: each real row's
 * heads that the readers hold; head->seq: the rows of the readers' sequence
 * shards.
 */
void sp_a2a_ranges(const struct sp_a2a_params *a, uint32_t es, uint32_t P, uint32_t tensor, uint32_t rank,
                   const bool *reader, void (*fn)(void *arg, uint64_t off, uint64_t len), void *arg)
{
    const struct sp_a2a_tensor *ta = &a->t[tensor];
    sp_heads_plan_t pl;
    if (!sp_heads_plan(&pl, ta->heads, ta->kind, a->kv_heads, P))
        return;   /* refused by validation on every rank: nothing is read */
    const uint32_t S = a->seq_len, S_loc = sp_rows_local(S, P);
    const uint64_t head = (uint64_t)ta->head_dim * es, wide = (uint64_t)ta->heads * head,
                   narrow = (uint64_t)pl.local * head;
    const bool sum = pl.replicate && (ta->flags & SP_A2A_T_SUM_REPLICAS);
    sp_ranges_t run = { .fn = fn, .arg = arg };
    if (a->direction == SP_A2A_SEQ_TO_HEAD) {
        const uint32_t rows = sp_rows_real(S, P, rank);
        for (uint64_t b = 0; b < a->batch; b++)
            for (uint64_t s = 0; s < rows; s++) {
                /* Holders' heads ascend with the rank; replicas repeat theirs: each once. */
                uint32_t done = 0;
                for (uint32_t q = 0; q < P; q++) {
                    uint32_t first, nreal = sp_heads_real(&pl, q, &first);
                    uint32_t lo = first > done ? first : done;
                    if (!reader[q] || lo >= first + nreal)
                        continue;
                    sp_ranges_add(&run, sp_a2a_row(a, b, s, S_loc) * wide + lo * head, (first + nreal - lo) * head);
                    done = first + nreal;
                }
            }
    } else {
        uint32_t first;
        if (sp_heads_real(&pl, rank, &first) == 0 && !sum)
            return;   /* dummies only: nobody reads them */
        for (uint64_t b = 0; b < a->batch; b++)
            for (uint32_t o = 0; o < P; o++) {
                if (!reader[o])
                    continue;
                for (uint64_t s = 0, rows = sp_rows_real(S, P, o); s < rows; s++)
                    sp_ranges_add(&run, sp_a2a_row(a, b, (uint64_t)o * S_loc + s, S) * narrow, narrow);
            }
    }
    sp_ranges_end(&run);
}

/* An all-to-all's: the rows or heads its readers hold. */
static void slices_a2a(const sp_op_t *op, uint32_t size, uint32_t rank, uint32_t i, const bool *reader,
                       void (*fn)(void *arg, uint64_t off, uint64_t len), void *arg)
{
    sp_a2a_ranges(&op->params.a2a, (uint32_t)sp_dtype_size(op->sqe.dtype), size, i / 2, rank, reader, fn, arg);
}

/* A send of a block of count elements per rank: the readers' blocks. */
static void slices_blocks(const sp_op_t *op, uint32_t size, uint32_t rank, uint32_t i, const bool *reader,
                          void (*fn)(void *arg, uint64_t off, uint64_t len), void *arg)
{
    const uint64_t n = op->sqe.count * sp_dtype_size(op->sqe.dtype);
    sp_ranges_t run = { .fn = fn, .arg = arg };
    for (uint32_t q = 0; q < size; q++)
        if (reader[q])
            sp_ranges_add(&run, q * n, n);   /* no empty slice when count is 0: nothing travels */
    sp_ranges_end(&run);
}

/* An uneven all-to-all's send: the readers' blocks, each as long as its count. */
static void slices_a2av(const sp_op_t *op, uint32_t size, uint32_t rank, uint32_t i, const bool *reader,
                        void (*fn)(void *arg, uint64_t off, uint64_t len), void *arg)
{
    const struct sp_a2av_params *a = &op->params.a2av;
    const uint64_t es = sp_dtype_size(op->sqe.dtype);
    sp_ranges_t run = { .fn = fn, .arg = arg };
    uint64_t at = 0;
    for (uint32_t q = 0; q < size; at += a->counts[q++])
        if (reader[q])
            sp_ranges_add(&run, at * es, a->counts[q] * es);
    sp_ranges_end(&run);
}

/* ---------------------------------------------------------------- the table */

static const sp_op_kind_t kinds[] = {
    [SP_OP_NOOP] = { .name = "noop" },
    [SP_OP_BARRIER] = { .name = "barrier", .flags = SP_OPK_GROUP, .check = sp_check_barrier, .input = input_sends,
                        .reads = reads_none },
    [SP_OP_ALLREDUCE] = { .name = "allreduce",
                          .flags = SP_OPK_GROUP | SP_OPK_TYPED | SP_OPK_REDOP | SP_OPK_IN_PLACE | SP_OPK_DEV_RANKS,
                          .check = sp_check_counted, .agree = sp_agree_counted, .input = input_sends,
                          .reads = reads_all, .exec = &sp_exec_allreduce },
    [SP_OP_ALLTOALL] = { .name = "alltoall", .flags = SP_OPK_GROUP | SP_OPK_TYPED | SP_OPK_DEV_RANKS,
                         .check = sp_check_alltoall, .agree = sp_agree_alltoall, .input = input_sends,
                         .reads = reads_all, .slices = slices_a2a, .exec = &sp_exec_alltoall },
    [SP_OP_SHIFT] = { .name = "shift", .flags = SP_OPK_GROUP | SP_OPK_FLAGS, .check = sp_check_shift,
                      .agree = sp_agree_shift, .input = input_sends, .reads = reads_shift, .exec = &sp_exec_shift },
    [SP_OP_ALLGATHER] = { .name = "allgather", .flags = SP_OPK_GROUP | SP_OPK_TYPED | SP_OPK_GATHER,
                          .check = sp_check_counted, .agree = sp_agree_counted, .input = input_sends,
                          .reads = reads_all, .exec = &sp_exec_allgather },
    [SP_OP_BROADCAST] = { .name = "broadcast", .flags = SP_OPK_GROUP | SP_OPK_TYPED | SP_OPK_ROOT,
                          .check = sp_check_counted, .agree = sp_agree_counted, .input = input_root,
                          .reads = reads_root, .exec = &sp_exec_broadcast },
    [SP_OP_REDUCE_SCATTER] = { .name = "reduce_scatter",
                               .flags = SP_OPK_GROUP | SP_OPK_TYPED | SP_OPK_REDOP | SP_OPK_SCATTER | SP_OPK_DEV_RANKS,
                               .check = sp_check_counted, .agree = sp_agree_counted, .input = input_sends,
                               .reads = reads_all, .slices = slices_blocks, .exec = &sp_exec_reduce_scatter },
    [SP_OP_ALLTOALLV] = { .name = "alltoallv", .flags = SP_OPK_GROUP | SP_OPK_TYPED, .check = sp_check_alltoallv,
                          .agree = sp_agree_alltoallv, .input = input_sends, .reads = reads_a2av,
                          .slices = slices_a2av, .exec = &sp_exec_alltoallv },
};
_Static_assert(sizeof kinds / sizeof kinds[0] == SP_STATS_KINDS - 1, "stats count every op kind, then unknown ones");

const sp_op_kind_t *sp_op_kind(unsigned opcode)
{
    return opcode < sizeof kinds / sizeof kinds[0] && kinds[opcode].name != NULL ? &kinds[opcode] : NULL;
}

const char *sp_op_name(unsigned opcode)
{
    const sp_op_kind_t *k = sp_op_kind(opcode);
    return k != NULL ? k->name : "unknown";
}
