/*
 * devplan.c — an op on GPU memory of one node: its kernels, one plan per op
 * kind (the table at the end), on the daemon's stream of the task's GPU.
 *
 * Every tensor of the task is a device region on one GPU (validation refuses a
 * mix), imported into spd: the kernels of kernels/cuda read and write every
 * rank's allocation in place. stream.c decides when (after the ranks' streams,
 * in stream order), enqueues the plan (sp_devplan_enqueue) and completes the
 * task once its kernels have run. The task holds a reference on every import
 * it uses, so a client that dies meanwhile does not take its memory out from
 * under a kernel. Ops across daemons use the same kernels (cluster/xdev.c).
 */
#include "gpu/devplan.h"

#include <stdio.h>

#include "core/exec.h"
#include "core/ops.h"
#include "core/task.h"
#include "gpu/gpu.h"

/* One tensor of an all-to-all as the kernel describes it. */
sp_kern_a2a_desc_t sp_devplan_a2a_desc(const sp_task_t *t, uint32_t i)
{
    const struct sp_a2a_params *a = &t->a2a;
    return (sp_kern_a2a_desc_t){ .direction = a->direction, .layout = a->layout, .batch = a->batch,
                                 .seq_len = a->seq_len, .heads = a->t[i].heads, .head_dim = a->t[i].head_dim,
                                 .kind = a->t[i].kind, .kv_heads = a->kv_heads, .ranks = t->size,
                                 .dtype = t->sqe.dtype, .flags = a->t[i].flags };
}

/* The op on GPU t->gpu, in one pass over its ranks. Whatever was enqueued
 * runs before the op completes, failed or not (stream.c waits for its mark):
 * the task's references on the imports outlive its kernels. */

/* One kernel per (tensor, destination rank), reading every rank's source. */
static spc_status_t device_a2a(sp_task_t *t, sp_err_t *e)
{
    const void *src[SP_KERN_A2A_MAX_RANKS];
    spc_status_t st = SPC_OK;
    for (uint32_t i = 0; i < t->a2a.ntensors && st == SPC_OK; i++) {
        sp_kern_a2a_desc_t d = sp_devplan_a2a_desc(t, i);
        for (uint32_t q = 0; q < t->size; q++)
            src[q] = sp_task_buf(t, q, 2 * i)->ptr;
        for (uint32_t r = 0; r < t->size && st == SPC_OK; r++)
            st = sp_gpu_a2a(t->gpu, sp_task_buf(t, r, 2 * i + 1)->ptr, src, &d, r, e);
    }
    return st;
}

/* A copy (or the zeros of a linear shift's edge) per (tensor, rank). */
static spc_status_t device_shift(sp_task_t *t, sp_err_t *e)
{
    const uint32_t P = t->size;
    const bool linear = t->sqe.flags & SP_SHIFT_F_LINEAR, reverse = t->sqe.flags & SP_SHIFT_F_REVERSE;
    spc_status_t st = SPC_OK;
    for (uint32_t i = 0; i < t->ntensors && st == SPC_OK; i += 2) {
        for (uint32_t dst = 0; dst < P && st == SPC_OK; dst++) {
            uint32_t from = reverse ? (dst + 1) % P : (dst + P - 1) % P;
            bool edge = reverse ? dst == P - 1 : dst == 0;
            const sp_task_buf_t *out = sp_task_buf(t, dst, i + 1);
            st = sp_gpu_copy(t->gpu, out->ptr, linear && edge ? NULL : sp_task_buf(t, from, i)->ptr, out->bytes, e);
        }
    }
    return st;
}

/* A copy per (destination, source). */
static spc_status_t device_allgather(sp_task_t *t, sp_err_t *e)
{
    const uint64_t n = t->sqe.count * t->es;
    spc_status_t st = SPC_OK;
    for (uint32_t dst = 0; dst < t->size && st == SPC_OK; dst++)
        for (uint32_t q = 0; q < t->size && st == SPC_OK; q++)
            st = sp_gpu_copy(t->gpu, sp_task_buf(t, dst, 1)->ptr + q * n, sp_task_buf(t, q, 0)->ptr, n, e);
    return st;
}

/* A copy from the root per other rank. */
static spc_status_t device_broadcast(sp_task_t *t, sp_err_t *e)
{
    const uint64_t n = t->sqe.count * t->es;
    spc_status_t st = SPC_OK;
    for (uint32_t dst = 0; dst < t->size && st == SPC_OK; dst++)
        if (dst != t->sqe.root)
            st = sp_gpu_copy(t->gpu, sp_task_buf(t, dst, 0)->ptr, sp_task_buf(t, t->sqe.root, 0)->ptr, n, e);
    return st;
}

/* One launch: every rank's result, folded in rank order (16-bit types in
 * fp32, rounded once), as the host path does, so the bits agree. */
static spc_status_t device_allreduce(sp_task_t *t, sp_err_t *e)
{
    void *dst[SP_KERN_A2A_MAX_RANKS];
    const void *src[SP_KERN_A2A_MAX_RANKS];
    for (uint32_t r = 0; r < t->size; r++) {
        src[r] = sp_task_buf(t, r, 0)->ptr;
        dst[r] = sp_task_buf(t, r, 1)->ptr;
    }
    if (t->size == 1 && dst[0] == src[0])
        return SPC_OK;   /* one rank in place: nothing to do */
    return sp_gpu_allreduce(t->gpu, dst, src, t->size, t->sqe.count, t->sqe.dtype, t->sqe.redop, e);
}

/* The all-reduce kernel once per block of this daemon's ranks, over the
 * ranks' sends at that block (at_fn: where rank q's send is on this GPU),
 * every destination the block's receive (the thread of an element stores the
 * same value P times): the bits of the host path. */
spc_status_t sp_devplan_scatter(sp_task_t *t, uint8_t *(*at_fn)(sp_task_t *, uint32_t, uint32_t), sp_err_t *e)
{
    void *dst[SP_KERN_A2A_MAX_RANKS];
    const void *src[SP_KERN_A2A_MAX_RANKS];
    const uint64_t n = t->sqe.count * t->es;
    spc_status_t st = SPC_OK;
    for (uint32_t b = 0; b < t->size && st == SPC_OK; b++) {
        if (!t->here[b])
            continue;   /* its own daemon reduces it */
        for (uint32_t q = 0; q < t->size; q++) {
            src[q] = at_fn(t, q, 0) + b * n;
            dst[q] = sp_task_buf(t, b, 1)->ptr;
        }
        st = sp_gpu_allreduce(t->gpu, dst, src, t->size, t->sqe.count, t->sqe.dtype, t->sqe.redop, e);
    }
    return st;
}

static uint8_t *buf_ptr(sp_task_t *t, uint32_t q, uint32_t i)
{
    return sp_task_buf(t, q, i)->ptr;
}

static spc_status_t device_reduce_scatter(sp_task_t *t, sp_err_t *e)
{
    return sp_devplan_scatter(t, buf_ptr, e);
}

/* Each block a copy from its sender's send into its receiver's receive. */
static spc_status_t device_alltoallv(sp_task_t *t, sp_err_t *e)
{
    const uint32_t P = t->size;
    spc_status_t st = SPC_OK;
    for (uint32_t dst = 0; dst < P && st == SPC_OK; dst++)
        for (uint32_t src = 0; src < P && st == SPC_OK; src++) {
            const struct sp_a2av_params *a = &t->ops[dst]->params.a2av;
            uint64_t n = a->counts[P + src] * t->es;
            if (n > 0)
                st = sp_gpu_copy(t->gpu, sp_task_buf(t, dst, 1)->ptr + sp_a2av_at(a, P, true, src) * t->es,
                                 sp_task_buf(t, src, 0)->ptr +
                                     sp_a2av_at(&t->ops[src]->params.a2av, P, false, dst) * t->es, n, e);
        }
    return st;
}

/* The kernels' limit on the ranks they read, refused before anything is
 * enqueued (across daemons, every daemon refuses alike, and none pairs the op
 * with another). */
spc_status_t sp_devplan_ranks_ok(const sp_task_t *t, sp_err_t *e)
{
    if ((sp_op_kind(t->sqe.opcode)->flags & SP_OPK_DEV_RANKS) && t->size > SP_KERN_A2A_MAX_RANKS)
        return sp_err_set(e, SPC_ERR_UNSUPPORTED, "%s on GPU memory takes at most %u ranks; this group has %u",
                          sp_op_name(t->sqe.opcode), SP_KERN_A2A_MAX_RANKS, t->size);
    return SPC_OK;
}

/* The plans, by opcode (every kind with a host plan in the op table has one). */
static spc_status_t (*const plans[])(sp_task_t *t, sp_err_t *e) = {
    [SP_OP_ALLREDUCE]      = device_allreduce,
    [SP_OP_ALLTOALL]       = device_a2a,
    [SP_OP_SHIFT]          = device_shift,
    [SP_OP_ALLGATHER]      = device_allgather,
    [SP_OP_BROADCAST]      = device_broadcast,
    [SP_OP_REDUCE_SCATTER] = device_reduce_scatter,
    [SP_OP_ALLTOALLV]      = device_alltoallv,
};

void sp_devplan_enqueue(sp_task_t *t)
{
    sp_err_t e = SP_ERR_INIT;
    spc_status_t st = sp_devplan_ranks_ok(t, &e);
    if (st == SPC_OK)
        st = plans[t->sqe.opcode](t, &e);
    if (st != SPC_OK)
        sp_task_fail(t, st, UINT32_MAX, e.msg);
}
