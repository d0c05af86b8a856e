/*
 * ops.h — one row per op kind: what the daemon does with each opcode.
 *
 * A row says an op's name and traits, how one rank's request is checked
 * (validate.c), how ranks must agree (validate.c), which tensors are inputs and
 * which daemons read them (ops.c; net.c sends them), and how the data moves in
 * host memory (exec.c). Its plans on GPUs are tables by opcode in the layers
 * that own the devices (gpu/devplan.c, cluster/xdev.c). Every place that once
 * switched on the opcode asks the row instead, so a new collective is a new
 * row and its functions. sp_op_kind returns NULL for an opcode with no row: the
 * caller refuses it.
 */
#ifndef SP_CORE_OPS_H
#define SP_CORE_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sp_shm.h"

typedef struct sp_op sp_op_t;
typedef struct sp_group sp_group_t;
typedef struct sp_agree sp_agree_t;
typedef struct sp_op_exec sp_op_exec_t;
typedef struct sp_engine sp_engine_t;
typedef struct sp_task sp_task_t;
struct sp_chunk;

/* Traits of an op kind (sp_op_kind_t.flags). */
#define SP_OPK_GROUP     1u     /* runs on a group: matched, checked, agreed (noop does not) */
#define SP_OPK_FLAGS     2u     /* takes sqe.flags (any other kind refuses them) */
#define SP_OPK_TYPED     4u     /* its ranks agree on sqe.dtype */
#define SP_OPK_REDOP     8u     /* reduces with sqe.redop, which its ranks agree on */
#define SP_OPK_ROOT      16u    /* one tensor, sent by sqe.root */
#define SP_OPK_GATHER    32u    /* receive holds a block of count elements per rank */
#define SP_OPK_SCATTER   64u    /* send holds a block of count elements per rank */
#define SP_OPK_IN_PLACE  128u   /* send may be receive */
#define SP_OPK_DEV_RANKS 256u   /* on GPU memory at most SP_KERN_A2A_MAX_RANKS ranks: one kernel reads them all */

typedef struct sp_op_kind {
    const char *name;
    uint32_t    flags;      /* SP_OPK_* */
    /* One rank's request alone: sets op->need[] and, on refusal,
     * op->local (validate.c). NULL: nothing to check. */
    void (*check)(sp_op_t *op, uint32_t group_size);
    /* Rank r's op against rank 0's, beyond op, memory and dtype (validate.c);
     * NULL: nothing more. */
    void (*agree)(sp_agree_t *ag, uint32_t r, const sp_op_t *b, const sp_op_t *a);
    /* Whether group rank `rank`'s tensor i is read (else written). */
    bool (*input)(const struct sp_sqe *e, uint32_t rank, uint32_t i);
    /* Whether the daemon of job node `node` reads rank r's inputs (net.c sends
     * them there). */
    bool (*reads)(const sp_group_t *g, const sp_op_t *op, uint32_t r, uint32_t node);
    /* The byte ranges of group rank `rank`'s input i that the ranks marked in
     * reader[] read, in order, adjacent ones merged, none empty (sp_ranges_add):
     * all another daemon gets of it (net.c). NULL: the whole input. The op
     * passed its checks. */
    void (*slices)(const sp_op_t *op, uint32_t size, uint32_t rank, uint32_t i, const bool *reader,
                   void (*fn)(void *arg, uint64_t off, uint64_t len), void *arg);
    /* How its data moves in host memory (exec.c); NULL: nothing moves (barrier). */
    const sp_op_exec_t *exec;
} sp_op_kind_t;

/* Byte ranges handed on to fn with adjacent ones merged, as slices lists
 * them: sp_ranges_add each in order (empty ones are skipped), then
 * sp_ranges_end for the last run. */
typedef struct sp_ranges {
    void    (*fn)(void *arg, uint64_t off, uint64_t len);
    void     *arg;
    uint64_t  off, len;   /* the run not yet handed on; len 0: none */
} sp_ranges_t;

static inline void sp_ranges_add(sp_ranges_t *r, uint64_t off, uint64_t len)
{
    if (len == 0)
        return;
    if (r->len > 0 && r->off + r->len == off) {
        r->len += len;
        return;
    }
    if (r->len > 0)
        r->fn(r->arg, r->off, r->len);
    r->off = off;
    r->len = len;
}

static inline void sp_ranges_end(sp_ranges_t *r)
{
    if (r->len > 0)
        r->fn(r->arg, r->off, r->len);
    r->len = 0;
}

const sp_op_kind_t *sp_op_kind(unsigned opcode);
const char *sp_op_name(unsigned opcode);

/* Row index of (b, s) in a [B, S, ...] (BSHD) or [S, B, ...] (SBHD) tensor of
 * an all-to-all, of `rows` rows: its slices, host plan and plan across daemons
 * walk rows alike. */
static inline uint64_t sp_a2a_row(const struct sp_a2a_params *a, uint64_t b, uint64_t s, uint64_t rows)
{
    return a->layout == SP_LAYOUT_BSHD ? b * rows + s : s * a->batch + b;
}

/* Where block j of an uneven all-to-all's send (recv false) or receive (recv
 * true) starts, in elements: the counts before it. P <= SP_A2AV_MAX_RANKS. */
static inline uint64_t sp_a2av_at(const struct sp_a2av_params *a, uint32_t P, bool recv, uint32_t j)
{
    uint64_t at = 0;
    for (uint32_t k = 0; k < j; k++)
        at += a->counts[(recv ? P : 0) + k];
    return at;
}

/* The checks and agreements the rows share (validate.c). */
void sp_check_barrier(sp_op_t *op, uint32_t group_size);
void sp_check_counted(sp_op_t *op, uint32_t group_size);   /* count elements: allreduce, allgather, ... */
void sp_check_shift(sp_op_t *op, uint32_t group_size);
void sp_check_alltoall(sp_op_t *op, uint32_t group_size);
void sp_check_alltoallv(sp_op_t *op, uint32_t group_size);
void sp_agree_counted(sp_agree_t *ag, uint32_t r, const sp_op_t *b, const sp_op_t *a);
void sp_agree_shift(sp_agree_t *ag, uint32_t r, const sp_op_t *b, const sp_op_t *a);
void sp_agree_alltoall(sp_agree_t *ag, uint32_t r, const sp_op_t *b, const sp_op_t *a);
void sp_agree_alltoallv(sp_agree_t *ag, uint32_t r, const sp_op_t *b, const sp_op_t *a);

/*
 * How an op kind moves its data in host memory: its part of the row, each
 * function in the section of exec.c's path it serves.
 *   plan, run   the chunks of the task, and one chunk's copy;
 *   axis        registered memory's windows (core/stage.c): the axis's length,
 *               and *unit_p the bytes of one unit (UINT64_MAX: the op runs in
 *               one window);
 *   span        rank r's tensor i's bytes in window [u0, u1) (NULL: u0 and u1
 *               units, in every tensor);
 *   base        where chunk c starts on the axis (NULL: at its lo).
 * Device memory has plans of its own, by opcode, in the layers that own the
 * devices: gpu/devplan.c (one GPU) and cluster/xdev.c (across daemons).
 */
struct sp_op_exec {
    bool     (*plan)(sp_engine_t *eng, sp_task_t *t);
    void     (*run)(sp_task_t *t, const struct sp_chunk *c);
    uint64_t (*axis)(const sp_task_t *t, uint64_t *unit_p);
    void     (*span)(sp_task_t *t, uint32_t r, uint32_t i, uint64_t u0, uint64_t u1, uint64_t *lo_p,
                     uint64_t *hi_p);
    uint64_t (*base)(sp_task_t *t, const struct sp_chunk *c);
};

/* The data movement of each kind in host memory (exec.c). */
extern const sp_op_exec_t sp_exec_allreduce, sp_exec_alltoall, sp_exec_shift, sp_exec_allgather, sp_exec_broadcast,
    sp_exec_reduce_scatter, sp_exec_alltoallv;

/* The byte ranges of rank `rank`'s all-to-all input `tensor` that the group
 * ranks marked in reader[] read (merged, in order). */
void sp_a2a_ranges(const struct sp_a2a_params *a, uint32_t es, uint32_t P, uint32_t tensor, uint32_t rank,
                   const bool *reader, void (*fn)(void *arg, uint64_t off, uint64_t len), void *arg);

#endif
