/*
 * exec.c — moving the data of a collective whose ranks have all arrived and
 * agree: the task (sp_task_create, lock held), its host copy in chunks shared
 * with the copy workers (sp_task_run, lock dropped), and its end
 * (sp_task_finish, lock held). Device tasks go to eng->gpu_ops, and across
 * daemons to eng->xdev_ops; a device task holds a reference on each import it
 * uses. Per op kind: its sp_op_exec_t, the rows at the end (ops.c points at
 * them). The story (staging, device memory, a task's life):
 * docs/architecture.md, "Moving the data: exec.c".
 */
#include "core/engine.h"
#include "core/ops.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "core/client.h"
#include "core/exec.h"
#include "core/job.h"
#include "core/mem.h"
#include "core/stage.h"
#include "core/task.h"
#include "core/transport.h"
#include "core/workers.h"
#include "base/log.h"
#include "sp_kern.h"
#include "sp_ulysses.h"

_Static_assert((int)SP_DTYPE_F32 == (int)SP_KERN_F32 && (int)SP_DTYPE_F64 == (int)SP_KERN_F64 && (int)SP_DTYPE_F16 == (int)SP_KERN_F16 &&
               (int)SP_DTYPE_BF16 == (int)SP_KERN_BF16 && (int)SP_DTYPE_I32 == (int)SP_KERN_I32 && (int)SP_DTYPE_I64 == (int)SP_KERN_I64 &&
               (int)SP_DTYPE_U8 == (int)SP_KERN_U8, "wire and kernel dtypes agree");
_Static_assert((int)SP_REDOP_SUM == (int)SP_KERN_SUM && (int)SP_REDOP_MAX == (int)SP_KERN_MAX && (int)SP_REDOP_MIN == (int)SP_KERN_MIN,
               "wire and kernel reduction operators agree");

/* Below this many bytes a task runs on the progress thread alone: waking the
 * workers costs more than the copy. */
#define PAR_MIN_BYTES   (256u << 10)
/* Chunk sizes: small enough to balance the threads, large enough that the
 * per-chunk bookkeeping vanishes. */
#define CHUNK_MIN_BYTES (64u << 10)
#define CHUNK_MAX_BYTES (1u << 20)
/* Elements a reduction folds per block (its accumulator lives on the stack). */
#define REDUCE_BLOCK    1024u

enum chunk_kind { CH_COPY, CH_ZERO };   /* sp_chunk_t.kind */

static void memcpy_fn(void *dst, const void *src, size_t n)
{
    memcpy(dst, src, n);
}

/* Byte `off` of rank's tensor i, where the copy reaches it: in place, or in the
 * staging of the window that holds it. */
static uint8_t *at(sp_task_t *t, uint32_t rank, uint32_t i, uint64_t off)
{
    sp_task_buf_t *b = sp_task_buf(t, rank, i);
    return b->ptr + (off - b->lo);
}

static bool chunk_add(sp_task_t *t, sp_chunk_t c)
{
    if (t->nchunks == t->chunks_cap) {
        uint32_t cap = t->chunks_cap ? t->chunks_cap * 2 : 64;
        sp_chunk_t *n = realloc(t->chunks, cap * sizeof *n);
        if (n == NULL)
            return false;
        t->chunks = n;
        t->chunks_cap = cap;
    }
    t->chunks[t->nchunks++] = c;
    return true;
}

/* Adds chunks covering [0, n) units of `unit_bytes` each, in pieces of about `target` bytes. */
static bool chunk_split(sp_task_t *t, sp_chunk_t proto, uint64_t n, uint64_t unit_bytes, uint64_t target)
{
    uint64_t per = unit_bytes >= target ? 1 : target / (unit_bytes ? unit_bytes : 1);
    for (uint64_t lo = 0; lo < n; lo += per) {
        proto.lo = lo;
        proto.hi = n - lo < per ? n : lo + per;
        if (!chunk_add(t, proto))
            return false;
    }
    return true;
}

static uint64_t sp_chunk_target(const sp_engine_t *eng, uint64_t total)
{
    uint64_t t = total / ((uint64_t)eng->copy_threads * 4);
    return t < CHUNK_MIN_BYTES ? CHUNK_MIN_BYTES : t > CHUNK_MAX_BYTES ? CHUNK_MAX_BYTES : t;
}

/* ================================================================ all-to-all */

/*
 * head->seq of a replicated KV head with SP_A2A_T_SUM_REPLICAS: out = the sum of
 * the r copies held by ranks q .. q + r - 1, in rank order (the gradient of the
 * replication); 16-bit types accumulate in fp32 and round once.
 */
static void sum_replicas(sp_task_t *t, uint32_t tensor, uint32_t q, uint64_t hoff, uint8_t *out)
{
    const sp_heads_plan_t *pl = &t->plan[tensor];
    const uint32_t dim = t->a2a.t[tensor].head_dim;
    const unsigned dt = t->sqe.dtype;

    if (sp_kern_acc_dtype(dt) == dt) {
        memcpy(out, sp_task_buf(t, q, 2u * tensor)->ptr + hoff, dim * t->es);
        for (uint32_t k = 1; k < pl->replicas; k++)
            sp_kern_reduce(out, sp_task_buf(t, q + k, 2u * tensor)->ptr + hoff, dim, dt, SP_KERN_SUM);
        return;
    }
    float acc[REDUCE_BLOCK];
    for (uint32_t e0 = 0; e0 < dim; e0 += REDUCE_BLOCK) {
        uint32_t n = dim - e0 < REDUCE_BLOCK ? dim - e0 : REDUCE_BLOCK;
        sp_kern_widen(acc, sp_task_buf(t, q, 2u * tensor)->ptr + hoff + e0 * t->es, n, dt);
        for (uint32_t k = 1; k < pl->replicas; k++)
            sp_kern_reduce_widen(acc, sp_task_buf(t, q + k, 2u * tensor)->ptr + hoff + e0 * t->es, n, dt, SP_KERN_SUM);
        sp_kern_narrow(out + e0 * t->es, acc, n, dt);
    }
}

/*
 * A chunk of an all-to-all: tensor t, the flattened (b, s) real rows [lo, hi) of
 * sequence owner `src` (seq->head: it scatters each of its rows to every head
 * holder) or `dst` (head->seq: it gathers each row from the holders). Going row
 * by row over all holders reads (or writes) each sequence row once, in order.
 * CH_ZERO clears owner dst's padding rows (head->seq).
 */
static void run_a2a(sp_task_t *t, const sp_chunk_t *c)
{
    const struct sp_a2a_params *a = &t->a2a;
    const struct sp_a2a_tensor *ta = &a->t[c->t];
    const sp_heads_plan_t *pl = &t->plan[c->t];
    const uint32_t P = t->size, S = a->seq_len, S_loc = sp_rows_local(S, P);
    const uint64_t head = (uint64_t)ta->head_dim * t->es;
    const uint64_t wide = (uint64_t)ta->heads * head, narrow = (uint64_t)pl->local * head;
    const bool s2h = a->direction == SP_A2A_SEQ_TO_HEAD;
    const bool sum = !s2h && pl->replicate && (ta->flags & SP_A2A_T_SUM_REPLICAS);
    const uint32_t owner = s2h ? c->src : c->dst;
    uint8_t *seq = s2h ? sp_task_buf(t, owner, 2u * c->t)->ptr : sp_task_buf(t, owner, 2u * c->t + 1)->ptr;

    if (c->kind == CH_ZERO) {
        uint32_t real = sp_rows_real(S, P, owner);
        for (uint64_t b = 0; b < a->batch; b++)
            for (uint64_t s = real; s < S_loc; s++)
                memset(seq + sp_a2a_row(a, b, s, S_loc) * wide, 0, wide);
        return;
    }
    const uint32_t rows = sp_rows_real(S, P, owner);
    const uint64_t glob0 = (uint64_t)owner * S_loc;
    for (uint64_t i = c->lo; i < c->hi; i++) {
        uint64_t b = i / rows, s = i % rows;
        uint8_t *srow = seq + sp_a2a_row(a, b, s, S_loc) * wide;
        uint64_t hoff = sp_a2a_row(a, b, glob0 + s, S) * narrow;
        for (uint32_t q = 0; q < P; q++) {
            uint32_t first, nreal = sp_heads_real(pl, q, &first);
            if (s2h) {
                if (!t->here[q])
                    continue;   /* its own daemon writes it */
                uint8_t *d = sp_task_buf(t, q, 2u * c->t + 1)->ptr + hoff;
                if (nreal > 0)
                    t->copy(d, srow + first * head, nreal * head);
                if (nreal < pl->local)
                    memset(d + nreal * head, 0, narrow - nreal * head);
            } else if (!sp_heads_primary(pl, q) || nreal == 0) {
                continue;   /* dummies, or a replica its primary takes (or sums) */
            } else if (!sum) {
                t->copy(srow + first * head, sp_task_buf(t, q, 2u * c->t)->ptr + hoff, nreal * head);
            } else {
                sum_replicas(t, c->t, q, hoff, srow + first * head);
            }
        }
    }
}

static bool plan_a2a(sp_engine_t *eng, sp_task_t *t)
{
    const struct sp_a2a_params *a = &t->a2a;
    const uint32_t P = t->size;
    const bool s2h = a->direction == SP_A2A_SEQ_TO_HEAD;
    uint64_t total = 0;

    for (uint32_t i = 0; i < a->ntensors; i++) {
        sp_heads_plan(&t->plan[i], a->t[i].heads, a->t[i].kind, a->kv_heads, P);
        total += sp_task_buf(t, 0, 2 * i + 1)->bytes * P;
    }
    t->bytes = total;
    uint64_t target = sp_chunk_target(eng, total);
    for (uint32_t i = 0; i < a->ntensors; i++) {
        const uint64_t row = (uint64_t)P * t->plan[i].local * a->t[i].head_dim * t->es;
        for (uint32_t owner = 0; owner < P; owner++) {
            if (!s2h && !t->here[owner])
                continue;   /* head->seq writes the owner's rows: its own daemon does */
            uint64_t rows = (uint64_t)a->batch * sp_rows_real(a->seq_len, P, owner);
            sp_chunk_t c = { .kind = CH_COPY, .t = (uint8_t)i, .dst = owner, .src = owner };
            if (!chunk_split(t, c, rows, row, target))
                return false;
            if (!s2h && sp_rows_real(a->seq_len, P, owner) < sp_rows_local(a->seq_len, P) &&
                !chunk_add(t, (sp_chunk_t){ .kind = CH_ZERO, .t = (uint8_t)i, .dst = owner, .src = owner }))
                return false;
        }
    }
    return true;
}

/* ================================================================ shift, gather, broadcast */

/* Shift: tensor t's bytes [lo, hi) from src to dst, or zeros (linear, first rank). */
static void run_shift(sp_task_t *t, const sp_chunk_t *c)
{
    uint8_t *out = at(t, c->dst, 2u * c->t + 1, c->lo);
    if (c->kind == CH_ZERO)
        memset(out, 0, c->hi - c->lo);
    else
        t->copy(out, at(t, c->src, 2u * c->t, c->lo), c->hi - c->lo);
}

static bool plan_shift(sp_engine_t *eng, sp_task_t *t)
{
    const uint32_t P = t->size;
    const bool linear = t->sqe.flags & SP_SHIFT_F_LINEAR, reverse = t->sqe.flags & SP_SHIFT_F_REVERSE;
    uint64_t total = 0;
    for (uint32_t i = 0; i < t->ntensors; i += 2)
        total += sp_task_buf(t, 0, i)->bytes * P;
    t->bytes = total;
    uint64_t target = sp_chunk_target(eng, total);
    for (uint32_t i = 0; i < t->ntensors / 2; i++) {
        uint64_t n = sp_task_buf(t, 0, 2 * i)->bytes;
        for (uint32_t dst = 0; dst < P; dst++) {
            if (!t->here[dst])
                continue;
            uint32_t src = reverse ? (dst + 1) % P : (dst + P - 1) % P;
            bool edge = reverse ? dst == P - 1 : dst == 0;
            sp_chunk_t c = { .kind = linear && edge ? CH_ZERO : CH_COPY, .t = (uint8_t)i, .dst = dst, .src = src };
            if (!chunk_split(t, c, n, 1, target))
                return false;
        }
    }
    return true;
}

/* Allgather: src's send bytes [lo, hi) into its slot of dst's receive. */
static void run_allgather(sp_task_t *t, const sp_chunk_t *c)
{
    uint64_t n = sp_task_buf(t, c->src, 0)->bytes;
    t->copy(at(t, c->dst, 1, c->src * n + c->lo), at(t, c->src, 0, c->lo), c->hi - c->lo);
}

/* Broadcast: the root's bytes [lo, hi) into dst. */
static void run_broadcast(sp_task_t *t, const sp_chunk_t *c)
{
    t->copy(at(t, c->dst, 0, c->lo), at(t, t->sqe.root, 0, c->lo), c->hi - c->lo);
}

static bool plan_gather_bcast(sp_engine_t *eng, sp_task_t *t, bool gather)
{
    const uint32_t P = t->size;
    uint64_t n = t->sqe.count * t->es;
    t->bytes = gather ? n * P * P : n * (P - 1);
    uint64_t target = sp_chunk_target(eng, t->bytes);
    for (uint32_t dst = 0; dst < P; dst++) {
        if ((!gather && dst == t->sqe.root) || !t->here[dst])
            continue;
        for (uint32_t src = 0; src < (gather ? P : 1); src++)
            if (!chunk_split(t, (sp_chunk_t){ .kind = CH_COPY, .dst = dst, .src = src }, n, 1, target))
                return false;
    }
    return true;
}

static bool plan_allgather(sp_engine_t *eng, sp_task_t *t)
{
    return plan_gather_bcast(eng, t, true);
}

static bool plan_broadcast(sp_engine_t *eng, sp_task_t *t)
{
    return plan_gather_bcast(eng, t, false);
}

/* ================================================================ allreduce */

/*
 * Elements [lo, hi): acc = x0; acc = acc (op) x1; ... in rank order, then every
 * rank gets acc. All ranks hold the same bits, and a rerun gives them again.
 * 16-bit types fold in fp32 and are rounded once. Each block's reads finish
 * before its writes, and blocks are disjoint, so send may be receive.
 */
typedef struct fold {
    union {
        double d[REDUCE_BLOCK];
        float  f[REDUCE_BLOCK];
    } acc;
    uint16_t narrow[REDUCE_BLOCK];
} fold_t;

/* Folds elements [e, e + n) of every rank's send, n <= REDUCE_BLOCK, in rank
 * order; returns the result, in f. */
static const void *fold_ranks(sp_task_t *t, uint64_t e, uint64_t n, fold_t *f)
{
    const unsigned dt = t->sqe.dtype, op = t->sqe.redop;
    const bool widen = sp_kern_acc_dtype(dt) != dt;
    const uint8_t *x0 = at(t, 0, 0, e * t->es);

    if (widen)
        sp_kern_widen(f->acc.f, x0, n, dt);
    else
        memcpy(f->acc.d, x0, n * t->es);
    for (uint32_t r = 1; r < t->size; r++) {
        const uint8_t *x = at(t, r, 0, e * t->es);
        if (widen)
            sp_kern_reduce_widen(f->acc.f, x, n, dt, op);
        else
            sp_kern_reduce(f->acc.d, x, n, dt, op);
    }
    if (!widen)
        return f->acc.d;
    sp_kern_narrow(f->narrow, f->acc.f, n, dt);
    return f->narrow;
}

static void run_allreduce(sp_task_t *t, const sp_chunk_t *c)
{
    fold_t f;
    for (uint64_t e0 = c->lo; e0 < c->hi; e0 += REDUCE_BLOCK) {
        uint64_t n = c->hi - e0 < REDUCE_BLOCK ? c->hi - e0 : REDUCE_BLOCK;
        const void *result = fold_ranks(t, e0, n, &f);
        for (uint32_t r = 0; r < t->size; r++)
            if (t->here[r])
                memcpy(at(t, r, 1, e0 * t->es), result, n * t->es);
    }
}

static bool plan_allreduce(sp_engine_t *eng, sp_task_t *t)
{
    uint64_t n = t->sqe.count;
    t->bytes = n * t->es * t->size;
    uint64_t target = sp_chunk_target(eng, t->bytes / t->size);
    return chunk_split(t, (sp_chunk_t){ .kind = CH_COPY }, n, t->es, target);
}

/* ================================================================ reduce-scatter */

/*
 * Block dst's elements [lo, hi) (of count): every rank's send elements
 * [dst count + lo, dst count + hi), folded in rank order as an all-reduce folds
 * them (the bits of those elements of an all-reduce of the sends), into dst's
 * receive. Blocks are disjoint and a send is no receive, so chunks of
 * different blocks run side by side.
 */
static void run_reduce_scatter(sp_task_t *t, const sp_chunk_t *c)
{
    const uint64_t base = (uint64_t)c->dst * t->sqe.count;
    fold_t f;
    for (uint64_t e0 = c->lo; e0 < c->hi; e0 += REDUCE_BLOCK) {
        uint64_t n = c->hi - e0 < REDUCE_BLOCK ? c->hi - e0 : REDUCE_BLOCK;
        memcpy(at(t, c->dst, 1, e0 * t->es), fold_ranks(t, base + e0, n, &f), n * t->es);
    }
}

/* The blocks of this daemon's ranks; each reads P blocks, as an all-reduce of
 * P x count elements does per element. */
static bool plan_reduce_scatter(sp_engine_t *eng, sp_task_t *t)
{
    const uint64_t n = t->sqe.count;
    t->bytes = n * t->es * t->size;
    uint64_t target = sp_chunk_target(eng, t->bytes);
    for (uint32_t dst = 0; dst < t->size; dst++)
        if (t->here[dst] && !chunk_split(t, (sp_chunk_t){ .kind = CH_COPY, .dst = dst }, n, t->es, target))
            return false;
    return true;
}

/* ================================================================ uneven all-to-all */

/* Bytes [lo, hi) of src's block for dst: from src's send into dst's receive,
 * each at its block's place (the counts before it). */
static void run_alltoallv(sp_task_t *t, const sp_chunk_t *c)
{
    const uint32_t P = t->size;
    const uint64_t from = sp_a2av_at(&t->ops[c->src]->params.a2av, P, false, c->dst) * t->es;
    const uint64_t to = sp_a2av_at(&t->ops[c->dst]->params.a2av, P, true, c->src) * t->es;
    t->copy(at(t, c->dst, 1, to + c->lo), at(t, c->src, 0, from + c->lo), c->hi - c->lo);
}

/* Every block this daemon's ranks receive, as long as they expect (the ranks
 * agreed that is what was sent); empty blocks make no chunk. */
static bool plan_alltoallv(sp_engine_t *eng, sp_task_t *t)
{
    const uint32_t P = t->size;
    t->bytes = 0;
    for (uint32_t dst = 0; dst < P; dst++)
        if (t->here[dst])
            t->bytes += t->ops[dst]->need[1];
    uint64_t target = sp_chunk_target(eng, t->bytes);
    for (uint32_t dst = 0; dst < P; dst++) {
        if (!t->here[dst])
            continue;
        for (uint32_t src = 0; src < P; src++) {
            uint64_t n = t->ops[dst]->params.a2av.counts[P + src] * t->es;
            if (n > 0 && !chunk_split(t, (sp_chunk_t){ .kind = CH_COPY, .dst = dst, .src = src }, n, 1, target))
                return false;
        }
    }
    return true;
}

/* ================================================================ windows of registered memory */

/*
 * Registered memory streams through the staging in windows (core/stage.c),
 * slices of an axis along which every tensor of the op is indexed:
 *
 *   allreduce   elements: each tensor's elements [u0, u1);
 *   reduce-     elements of the send: each send's [u0, u1), and of rank r's
 *   scatter     receive the elements that come from there, [u0 - r n, u1 - r n);
 *   shift,      bytes: each tensor's bytes [u0, u1);
 *   broadcast
 *   allgather   bytes of the receive: each receive's [u0, u1), and of rank q's
 *               send the bytes that land there, [u0 - q n, u1 - q n);
 *   alltoall    none: a row's heads go to every receive, so the op is one
 *               window, refused when it does not fit.
 */

/* The axes: an all-reduce's elements; a shift's bytes (of its longest send); a
 * broadcast's bytes; an all-gather's bytes of the receive. */
static uint64_t axis_elements(const sp_task_t *t, uint64_t *unit_p)
{
    *unit_p = t->es;
    return t->sqe.count;
}

static uint64_t axis_scatter(const sp_task_t *t, uint64_t *unit_p)
{
    *unit_p = t->es;
    return t->sqe.count * t->size;
}

static uint64_t axis_shift(const sp_task_t *t, uint64_t *unit_p)
{
    uint64_t most = 0;
    for (uint32_t i = 0; i < t->ntensors; i += 2)
        most = t->bufs[i].bytes > most ? t->bufs[i].bytes : most;
    *unit_p = 1;
    return most;
}

static uint64_t axis_bytes(const sp_task_t *t, uint64_t *unit_p)
{
    *unit_p = 1;
    return t->sqe.count * t->es;
}

static uint64_t axis_gather(const sp_task_t *t, uint64_t *unit_p)
{
    *unit_p = 1;
    return t->sqe.count * t->es * t->size;
}

/* One window: a row's heads go to every receive. */
static uint64_t axis_one(const sp_task_t *t, uint64_t *unit_p)
{
    *unit_p = UINT64_MAX;
    return 1;
}

/* Rank r's send lands at r n of the receive: the window there. */
static void span_gather(sp_task_t *t, uint32_t r, uint32_t i, uint64_t u0, uint64_t u1, uint64_t *lo_p,
                        uint64_t *hi_p)
{
    const uint64_t base = i == 0 ? (uint64_t)r * sp_task_buf(t, r, 0)->bytes : 0;
    *lo_p = u0 > base ? u0 - base : 0;
    *hi_p = u1 > base ? u1 - base : 0;
}

/* Rank r's receive is block r of the sends: the window there. */
static void span_scatter(sp_task_t *t, uint32_t r, uint32_t i, uint64_t u0, uint64_t u1, uint64_t *lo_p,
                         uint64_t *hi_p)
{
    const uint64_t base = i == 1 ? (uint64_t)r * t->sqe.count : 0;
    *lo_p = (u0 > base ? u0 - base : 0) * t->es;
    *hi_p = (u1 > base ? u1 - base : 0) * t->es;
}

static void span_whole(sp_task_t *t, uint32_t r, uint32_t i, uint64_t u0, uint64_t u1, uint64_t *lo_p,
                       uint64_t *hi_p)
{
    *lo_p = 0;
    *hi_p = sp_task_buf(t, r, i)->bytes;
}

/* An all-gather's chunk runs over its source's send: on the axis, its slot of the receive. */
static uint64_t base_gather(sp_task_t *t, const sp_chunk_t *c)
{
    return (uint64_t)c->src * sp_task_buf(t, c->src, 0)->bytes;
}

/* A reduce-scatter's chunk runs over its block: on the axis, at dst count. */
static uint64_t base_scatter(sp_task_t *t, const sp_chunk_t *c)
{
    return (uint64_t)c->dst * t->sqe.count;
}

/* ================================================================ tasks */

static void run_chunk(void *arg, uint32_t i)
{
    sp_task_t *t = arg;
    const sp_chunk_t *c = &t->run[i];
    t->ex->run(t, c);
    if (t->stream)
        sp_kern_copy_fence();   /* the chunk's streaming stores land before it counts as done */
}

static void task_free(sp_engine_t *eng, sp_task_t *t)
{
    if (t->bufs != NULL) {
        for (uint32_t k = 0; k < t->size * t->ntensors; k++) {
            /* Kernels that an abort could not stop may still touch it: keep it open. */
            if (t->bufs[k].import != NULL && !sp_task_xdev_leaks(t))
                eng->gpu_ops->import_unref(eng, t->bufs[k].import);
        }
    }
    if (t->xd != NULL)
        t->xops->task_detach(t);
    free(t->bufs);
    free(t->chunks);
    free(t->wchunks);
    free(t->rank_status);
    free(t->here);
    free(t->job_rank);
    free(t->ops);
    free(t);
}

/* Completes every op with st, without a task (nothing was pinned). */
static void complete_all(sp_engine_t *eng, sp_op_t **ops, uint32_t n, spc_status_t st, const char *detail)
{
    sp_stats_coll_done(eng, NULL, ops, n, 0, st, detail, NULL);
    for (uint32_t r = 0; r < n; r++) {
        sp_op_complete(eng, ops[r], st, detail);
        ops[r] = NULL;
    }
}

void sp_task_create(sp_engine_t *eng, sp_group_t *g, sp_op_t **ops)
{
    const struct sp_sqe *e = &ops[0]->sqe;
    char detail[SP_DETAIL_BYTES];

    const sp_op_kind_t *k = sp_op_kind(e->opcode);
    if (k->exec == NULL) {   /* nothing moves: a barrier */
        complete_all(eng, ops, g->size, SPC_OK, NULL);
        return;
    }
    sp_task_t *t = calloc(1, sizeof *t);
    if (t == NULL)
        goto oom;
    t->size = g->size;
    t->ntensors = e->ntensors;
    t->group_id = g->id;
    t->world = g == g->job->world;
    t->job_rank = malloc(g->size * sizeof *t->job_rank);
    if (t->job_rank != NULL)
        memcpy(t->job_rank, g->ranks, g->size * sizeof *t->job_rank);
    t->sqe = *e;
    t->ex = k->exec;
    t->a2a = ops[0]->params.a2a;
    t->es = sp_dtype_size(e->dtype);
    t->status = SPC_OK;
    t->bad_rank = UINT32_MAX;
    t->ops = calloc(g->size, sizeof *t->ops);
    t->bufs = calloc((size_t)g->size * e->ntensors, sizeof *t->bufs);
    t->rank_status = calloc(g->size, sizeof *t->rank_status);
    t->here = calloc(g->size, sizeof *t->here);
    if (t->ops == NULL || t->bufs == NULL || t->rank_status == NULL || t->job_rank == NULL || t->here == NULL)
        goto oom;

    for (uint32_t r = 0; r < g->size; r++) {
        sp_op_t *op = ops[r];
        t->ops[r] = op;   /* the plans read it; the task takes it over below */
        t->here[r] = op->client != NULL;
        for (uint32_t i = 0; i < e->ntensors; i++) {
            sp_task_buf_t *b = sp_task_buf(t, r, i);
            uint64_t need = op->need[i];   /* checked against the region by sp_op_validate */
            b->bytes = need;
            b->input = k->input(e, r, i);
            b->output = !b->input;
            if (!t->here[r]) {
                /* Another daemon's rank: its inputs came with its message (NULL
                 * where this daemon needs none of them); its outputs are not ours. */
                b->ptr = (uint8_t *)op->rin[i];
                continue;
            }
            if (op->device) {
                /* Validation put every tensor of the op in a device region. */
                const sp_region_t *reg = sp_mem_device(op->client, &op->tensor[i]);
                if (!t->device)
                    t->gpu = op->gpu;   /* its first rank's: where stream.c completes it */
                t->device = true;
                b->ptr = (uint8_t *)(uintptr_t)(reg->dptr + op->tensor[i].offset);
                b->import = reg->import;
                eng->gpu_ops->import_ref(b->import);
                continue;
            }
            b->ptr = sp_mem_direct(op->client, &op->tensor[i]);
            if (b->ptr == NULL && (b->remote = sp_mem_remote_addr(op->client, &op->tensor[i])) == 0)
                goto oom;   /* validated under this lock: cannot happen */
        }
    }
    /* GPU memory with ranks on other daemons: NCCL brings what ours read. */
    if (t->device && g->nremote > 0) {
        t->xops = eng->xdev_ops;
        if (!t->xops->task_attach(eng, t, g, ops))
            goto oom;
    }
    if (!t->ex->plan(eng, t))
        goto oom;
    sp_err_t err = SP_ERR_INIT;
    if (sp_stage_plan(eng, t, &err) != SPC_OK) {
        task_free(eng, t);
        complete_all(eng, ops, g->size, err.status, err.msg);
        return;
    }
    /* Past the cache, reading destination lines in only to overwrite them costs a
     * third of the memory traffic; a smaller result is left in the cache for the
     * rank that reads it next. */
    t->stream = t->bytes >= eng->stream_min_bytes;
    t->copy = t->stream ? sp_kern_copy_stream : memcpy_fn;

    /* From here the ops belong to the task, and their clients stay mapped. */
    for (uint32_t r = 0; r < g->size; r++) {
        ops[r] = NULL;
        if (t->here[r])
            t->ops[r]->client->pins++;
    }
    if (eng->ready_tail != NULL)
        eng->ready_tail->next = t;
    else
        eng->ready = t;
    eng->ready_tail = t;
    return;

oom:
    snprintf(detail, sizeof detail, "daemon out of memory setting up a %s of %u ranks", sp_op_name(e->opcode),
             g->size);
    if (t != NULL)
        task_free(eng, t);
    complete_all(eng, ops, g->size, SPC_ERR_NO_MEMORY, detail);
}

sp_task_t *sp_task_next(sp_engine_t *eng)
{
    sp_task_t *t = eng->ready;
    if (t != NULL) {
        eng->ready = t->next;
        if (eng->ready == NULL)
            eng->ready_tail = NULL;
        t->next = NULL;
    }
    return t;
}

/*
 * Helpers worth waking: the CPUs nobody else wants. Each rank of the task that
 * spins in its wait (it did not say it sleeps) holds a CPU, and so does the
 * progress thread; a helper on top of those only takes turns with them, and
 * every turn costs more than the copy it adds (on 2 CPUs, 2 spinning ranks and
 * 2 copy threads were 10x slower than 1 copy thread).
 */
static uint32_t idle_helpers(const sp_engine_t *eng, const sp_task_t *t)
{
    uint32_t busy = 1;
    for (uint32_t r = 0; r < t->size; r++)
        busy += t->here[r] && sp_load_relaxed(&t->ops[r]->client->v.wake->cq_waiting) == 0;
    uint32_t idle = eng->ncpus > busy ? eng->ncpus - busy : 0;
    return idle < eng->copy_threads - 1 ? idle : eng->copy_threads - 1;
}

static void run_chunks(sp_engine_t *eng, sp_task_t *t, const sp_chunk_t *chunks, uint32_t n)
{
    t->run = chunks;
    if (t->bytes >= PAR_MIN_BYTES && n > 1) {
        sp_parallel_for(eng, n, idle_helpers(eng, t), run_chunk, t);
    } else {
        for (uint32_t i = 0; i < n; i++)
            run_chunk(t, i);
    }
}

/*
 * Arena memory in one pass. With registered memory, per window: its inputs
 * come in (a rank whose memory is gone fails the op; windows already written
 * stay written, and the op's receives say nothing), the chunks cut to it run,
 * its outputs go out.
 */
void sp_task_run(sp_engine_t *eng, sp_task_t *t)
{
    sp_err_t e = SP_ERR_INIT;

    if (t->stage_bytes == 0) {
        run_chunks(eng, t, t->chunks, t->nchunks);
        return;
    }
    if (!sp_stage_alloc(eng, t))
        return;
    for (uint64_t u0 = 0; u0 < t->axis; u0 += t->window) {
        const uint64_t u1 = t->axis - u0 < t->window ? t->axis : u0 + t->window;
        if (!sp_stage_in(t, u0, u1, &e))
            return;
        if (t->wchunks == NULL) {
            run_chunks(eng, t, t->chunks, t->nchunks);
        } else {
            uint32_t n = 0;
            for (uint32_t i = 0; i < t->nchunks; i++) {
                t->wchunks[n] = t->chunks[i];
                n += sp_stage_clip(t, &t->wchunks[n], u0, u1);
            }
            run_chunks(eng, t, t->wchunks, n);
        }
        sp_stage_out(t, u0, u1, &e);
    }
}

void sp_task_finish(sp_engine_t *eng, sp_task_t *t)
{
    char peer[SP_DETAIL_BYTES];
    sp_err_t gone;

    if (t->status != SPC_OK && t->bad_rank != UINT32_MAX && t->world)
        snprintf(peer, sizeof peer, "rank %u: %s", t->bad_rank, t->detail);
    else if (t->status != SPC_OK && t->bad_rank != UINT32_MAX)
        snprintf(peer, sizeof peer, "rank %u (job rank %u): %s", t->bad_rank, t->job_rank[t->bad_rank], t->detail);
    sp_stats_coll_done(eng, NULL, t->ops, t->size, t->bytes, t->status,
                       t->status != SPC_OK && t->bad_rank != UINT32_MAX ? peer : t->detail, t->rank_status);
    sp_engine_wakes_hold(eng);
    for (uint32_t r = 0; r < t->size; r++) {
        sp_op_t *op = t->ops[r];
        sp_client_t *c = op->client;
        if (c == NULL) {   /* another daemon's rank: completed there */
            sp_op_complete(eng, op, SPC_OK, NULL);
            continue;
        }
        spc_status_t st = t->status;
        const char *detail = t->detail;
        if (st != SPC_OK && t->bad_rank != UINT32_MAX && r != t->bad_rank) {
            st = SPC_ERR_PEER_REFUSED;
            detail = peer;
        } else if (st == SPC_OK && t->rank_status[r] != SPC_OK) {
            st = t->rank_status[r];
            detail = sp_mem_gone(c, &gone) ? gone.msg : "writing the result into registered memory failed";
        }
        if (st == SPC_OK) {
            uint64_t mine = t->bytes / t->size;
            c->bytes_moved += mine;
            eng->bytes_moved += mine;
        }
        sp_op_complete(eng, op, st, st == SPC_OK ? NULL : detail);
        sp_client_unpin(eng, c);
    }
    sp_engine_wakes_release(eng);
    task_free(eng, t);   /* the ops are freed; it touches only its own arrays and imports */
}

void sp_task_abort(sp_engine_t *eng, sp_task_t *t, spc_status_t st, const char *detail)
{
    t->status = st;
    t->bad_rank = UINT32_MAX;
    snprintf(t->detail, sizeof t->detail, "%s", detail);
    sp_task_finish(eng, t);
}

/* ================================================================ device tasks, for the layers that run them */

bool sp_task_device(const sp_task_t *t)       { return t->device; }
int sp_task_gpu(const sp_task_t *t)           { return t->gpu; }
uint32_t sp_task_size(const sp_task_t *t)     { return t->size; }
sp_op_t *sp_task_op(const sp_task_t *t, uint32_t r) { return t->ops[r]; }
spc_status_t sp_task_status(const sp_task_t *t) { return t->status; }

void sp_task_fail(sp_task_t *t, spc_status_t st, uint32_t bad_rank, const char *detail)
{
    if (t->status != SPC_OK)
        return;
    t->status = st;
    t->bad_rank = bad_rank;
    snprintf(t->detail, sizeof t->detail, "%s", detail);
}

/* A task whose ranks sit on several daemons has its part there in the
 * transport that carries it (t->xops: the NCCL transport, cluster/xdev.c);
 * stream.c asks it through these. Validation refuses such an op where that
 * transport is absent (sp_op_validate), so a task that has one has its ops. */
bool sp_task_xdev(const sp_task_t *t)
{
    return t->xd != NULL;
}

void sp_task_xdev_stream(sp_task_t *t, uint64_t ready_dptr, uint64_t done_dptr, uint64_t seq)
{
    t->xops->task_stream(t, ready_dptr, done_dptr, seq);
}

void sp_task_xdev_submit(sp_engine_t *eng, sp_task_t *t)
{
    t->xops->task_ready(eng, t);
}

bool sp_task_xdev_back(const sp_task_t *t)
{
    return t->xops->task_back(t);
}

void sp_task_xdev_give_up(sp_task_t *t)
{
    t->xops->task_give_up(t);
}

bool sp_task_xdev_wrote_done(const sp_task_t *t)
{
    return t->xops->task_wrote_done(t);
}

bool sp_task_xdev_leaks(const sp_task_t *t)
{
    return t->xd != NULL && t->xops->task_leaks(t);
}

/* ================================================================ the op kinds' rows */

const sp_op_exec_t sp_exec_allreduce = {
    .plan = plan_allreduce, .run = run_allreduce, .axis = axis_elements,
};

const sp_op_exec_t sp_exec_alltoall = {
    .plan = plan_a2a, .run = run_a2a, .axis = axis_one, .span = span_whole,
};

const sp_op_exec_t sp_exec_shift = {
    .plan = plan_shift, .run = run_shift, .axis = axis_shift,
};

const sp_op_exec_t sp_exec_allgather = {
    .plan = plan_allgather, .run = run_allgather, .axis = axis_gather, .span = span_gather, .base = base_gather,
};

const sp_op_exec_t sp_exec_broadcast = {
    .plan = plan_broadcast, .run = run_broadcast, .axis = axis_bytes,
};

const sp_op_exec_t sp_exec_alltoallv = {
    .plan = plan_alltoallv, .run = run_alltoallv, .axis = axis_one, .span = span_whole,
};

const sp_op_exec_t sp_exec_reduce_scatter = {
    .plan = plan_reduce_scatter, .run = run_reduce_scatter, .axis = axis_scatter, .span = span_scatter,
    .base = base_scatter,
};
