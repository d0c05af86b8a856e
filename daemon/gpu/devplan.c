/*
 * devplan.c — an op on GPU memory of one node: its kernels, one plan per op
 * kind (the table at the end), on the daemon's lanes of the task's GPUs.
 *
 * Every tensor of the task is a device region, each rank's on its own GPU
 * (validation refuses a rank whose tensors are on two), imported into spd:
 * the kernels of kernels/cuda read and write every rank's allocation in place.
 * A kernel runs on the GPU that owns what it writes, reading the other ranks'
 * inputs over peer access (pull): each input is reached from that GPU through
 * its import (sp_gpu_import_on), so nothing but the output is written across a
 * link, and an all-reduce folds every input in rank order on each output's GPU,
 * the bits every rank gets on one GPU. Where a GPU cannot reach another's
 * memory (no peer access), the inputs it needs from there are staged through
 * pinned host memory: copied there by their own GPU, read there by the
 * others' kernels (stage_inputs). stream.c decides when (after the ranks'
 * streams, in stream order, every GPU's kernels before any done), enqueues the
 * plan (sp_devplan_enqueue) and completes the task once its kernels have run.
 * The task holds a reference on every import it uses, so a client that dies
 * meanwhile does not take its memory out from under a kernel. Ops across
 * daemons use the same kernels on the GPU of each daemon's NCCL rank
 * (cluster/xdev.c).
 */
#include "gpu/devplan.h"

#include <stdio.h>
#include <stdlib.h>

#include "core/exec.h"
#include "core/ops.h"
#include "core/task.h"
#include "gpu/gpu.h"
#include "sp_topo.h"

/* One tensor of an all-to-all as the kernel describes it. */
sp_kern_a2a_desc_t sp_devplan_a2a_desc(const sp_task_t *t, uint32_t i)
{
    const struct sp_a2a_params *a = &t->a2a;
    return (sp_kern_a2a_desc_t){ .direction = a->direction, .layout = a->layout, .batch = a->batch,
                                 .seq_len = a->seq_len, .heads = a->t[i].heads, .head_dim = a->t[i].head_dim,
                                 .kind = a->t[i].kind, .kv_heads = a->kv_heads, .ranks = t->size,
                                 .dtype = t->sqe.dtype, .flags = a->t[i].flags };
}

/* The GPU that owns rank r's tensors: its outputs are written there. */
static int dev_of(const sp_task_t *t, uint32_t r)
{
    return t->ops[r]->gpu;
}

/* The inputs of the task being planned that were staged through pinned host
 * memory: rank q's tensor i at staged_at[q * t->ntensors + i], an address for
 * every GPU; 0 where it was not. Set around the plan by sp_devplan_enqueue
 * (progress thread, lock held); NULL when nothing was staged. */
static const uint64_t *staged_at;

/* Rank q's tensor i as GPU dev's kernels reach it (*p_p): where it is, its
 * copy in host memory where it was staged, or through its import's opening on
 * dev. Engine lock held. */
static spc_status_t on_dev(sp_task_t *t, uint32_t q, uint32_t i, int dev, uint8_t **p_p, sp_err_t *e)
{
    const sp_task_buf_t *b = sp_task_buf(t, q, i);
    uint64_t base;
    if (dev_of(t, q) == dev) {
        *p_p = b->ptr;
        return SPC_OK;
    }
    if (staged_at != NULL && staged_at[q * t->ntensors + i] != 0) {
        *p_p = (uint8_t *)(uintptr_t)staged_at[q * t->ntensors + i];
        return SPC_OK;
    }
    spc_status_t st = sp_gpu_import_on(b->import, dev, &base, e);
    if (st == SPC_OK)
        *p_p = (uint8_t *)(uintptr_t)(base + ((uint64_t)(uintptr_t)b->ptr - sp_gpu_import_ptr(b->import)));
    return st;
}

/* The op on its ranks' GPUs, in one pass over its ranks. Whatever was
 * enqueued runs before the op completes, failed or not (stream.c waits for
 * every GPU's part): the task's references on the imports outlive its kernels. */

/* One kernel per (tensor, destination rank), on the destination's GPU,
 * reading every rank's source. */
static spc_status_t device_a2a(sp_task_t *t, sp_err_t *e)
{
    const void *src[SP_KERN_A2A_MAX_RANKS];
    spc_status_t st = SPC_OK;
    for (uint32_t i = 0; i < t->a2a.ntensors && st == SPC_OK; i++) {
        sp_kern_a2a_desc_t d = sp_devplan_a2a_desc(t, i);
        for (uint32_t r = 0; r < t->size && st == SPC_OK; r++) {
            const int dev = dev_of(t, r);
            for (uint32_t q = 0; q < t->size && st == SPC_OK; q++) {
                uint8_t *p = NULL;
                st = on_dev(t, q, 2 * i, dev, &p, e);
                src[q] = p;
            }
            if (st == SPC_OK)
                st = sp_gpu_a2a(dev, sp_task_buf(t, r, 2 * i + 1)->ptr, src, &d, r, e);
        }
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
            uint8_t *src = NULL;
            if (!(linear && edge))
                st = on_dev(t, from, i, dev_of(t, dst), &src, e);
            if (st == SPC_OK)
                st = sp_gpu_copy(dev_of(t, dst), out->ptr, src, out->bytes, e);
        }
    }
    return st;
}

/* A copy per (destination, source). */
static spc_status_t device_allgather(sp_task_t *t, sp_err_t *e)
{
    const uint64_t n = t->sqe.count * t->es;
    spc_status_t st = SPC_OK;
    for (uint32_t dst = 0; dst < t->size && st == SPC_OK; dst++) {
        for (uint32_t q = 0; q < t->size && st == SPC_OK; q++) {
            uint8_t *src;
            st = on_dev(t, q, 0, dev_of(t, dst), &src, e);
            if (st == SPC_OK)
                st = sp_gpu_copy(dev_of(t, dst), sp_task_buf(t, dst, 1)->ptr + q * n, src, n, e);
        }
    }
    return st;
}

/* A copy from the root per other rank. */
static spc_status_t device_broadcast(sp_task_t *t, sp_err_t *e)
{
    const uint64_t n = t->sqe.count * t->es;
    spc_status_t st = SPC_OK;
    for (uint32_t dst = 0; dst < t->size && st == SPC_OK; dst++) {
        uint8_t *src;
        if (dst == t->sqe.root)
            continue;
        st = on_dev(t, t->sqe.root, 0, dev_of(t, dst), &src, e);
        if (st == SPC_OK)
            st = sp_gpu_copy(dev_of(t, dst), sp_task_buf(t, dst, 0)->ptr, src, n, e);
    }
    return st;
}

/* Whether t's all-reduce writes a result over its input on several GPUs. */
static bool allreduce_in_place_across(const sp_task_t *t)
{
    bool in_place = false, several = false;
    if (t->sqe.opcode != SP_OP_ALLREDUCE)
        return false;
    for (uint32_t r = 0; r < t->size; r++) {
        in_place = in_place || sp_task_buf(t, r, 1)->ptr == sp_task_buf(t, r, 0)->ptr;
        several = several || dev_of(t, r) != dev_of(t, 0);
    }
    return in_place && several;
}

/* One launch per GPU: the results of the ranks there, each the fold of every
 * input in rank order (16-bit types in fp32, rounded once), as the host path
 * does, so the bits agree on every GPU. The kernel writes a result for every
 * source: the slots of ranks elsewhere name a result of this GPU again (the
 * same value stored twice), as the reduce-scatter does.
 * In place on several GPUs, a GPU writing its ranks' results would change
 * inputs that another GPU may still read: there one launch on the first
 * rank's GPU reads every input before it writes any result (element by
 * element, as on one GPU), and writes the other GPUs' over peer access; or,
 * where some GPUs cannot reach each other, every input was staged and each
 * GPU reads the others' copies (stage_inputs). */
static spc_status_t device_allreduce(sp_task_t *t, sp_err_t *e)
{
    void *dst[SP_KERN_A2A_MAX_RANKS];
    const void *src[SP_KERN_A2A_MAX_RANKS];
    spc_status_t st = SPC_OK;
    if (t->size == 1 && sp_task_buf(t, 0, 1)->ptr == sp_task_buf(t, 0, 0)->ptr)
        return SPC_OK;   /* one rank in place: nothing to do */
    if (allreduce_in_place_across(t) && staged_at == NULL) {
        for (uint32_t r = 0; r < t->size && st == SPC_OK; r++) {
            uint8_t *in, *out;
            if ((st = on_dev(t, r, 0, dev_of(t, 0), &in, e)) == SPC_OK &&
                (st = on_dev(t, r, 1, dev_of(t, 0), &out, e)) == SPC_OK) {
                src[r] = in;
                dst[r] = out;
            }
        }
        return st != SPC_OK ? st
                            : sp_gpu_allreduce(dev_of(t, 0), dst, src, t->size, t->sqe.count, t->sqe.dtype,
                                               t->sqe.redop, e);
    }
    for (uint32_t first = 0; first < t->size && st == SPC_OK; first++) {
        const int dev = dev_of(t, first);
        bool seen = false;
        for (uint32_t f = 0; f < first && !seen; f++)
            seen = dev_of(t, f) == dev;
        if (seen)
            continue;   /* its GPU's launch is made */
        for (uint32_t r = 0; r < t->size && st == SPC_OK; r++) {
            uint8_t *in = NULL;
            dst[r] = sp_task_buf(t, dev_of(t, r) == dev ? r : first, 1)->ptr;
            st = on_dev(t, r, 0, dev, &in, e);
            src[r] = in;
        }
        if (st == SPC_OK)
            st = sp_gpu_allreduce(dev, dst, src, t->size, t->sqe.count, t->sqe.dtype, t->sqe.redop, e);
    }
    return st;
}

/* The all-reduce kernel once per block of this daemon's ranks, over the
 * ranks' sends at that block (at_fn: where rank q's tensor is on this GPU),
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
            dst[q] = at_fn(t, b, 1);
        }
        st = sp_gpu_allreduce(t->gpu, dst, src, t->size, t->sqe.count, t->sqe.dtype, t->sqe.redop, e);
    }
    return st;
}

/* Block b of the fold on rank b's GPU, as sp_devplan_scatter does on one. */
static spc_status_t device_reduce_scatter(sp_task_t *t, sp_err_t *e)
{
    void *dst[SP_KERN_A2A_MAX_RANKS];
    const void *src[SP_KERN_A2A_MAX_RANKS];
    const uint64_t n = t->sqe.count * t->es;
    spc_status_t st = SPC_OK;
    for (uint32_t b = 0; b < t->size && st == SPC_OK; b++) {
        uint8_t *p;
        for (uint32_t q = 0; q < t->size && st == SPC_OK; q++) {
            if ((st = on_dev(t, q, 0, dev_of(t, b), &p, e)) != SPC_OK)
                break;
            src[q] = p + b * n;
            dst[q] = sp_task_buf(t, b, 1)->ptr;
        }
        if (st == SPC_OK)
            st = sp_gpu_allreduce(dev_of(t, b), dst, src, t->size, t->sqe.count, t->sqe.dtype, t->sqe.redop, e);
    }
    return st;
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
            uint8_t *in;
            if (n == 0 || (st = on_dev(t, src, 0, dev_of(t, dst), &in, e)) != SPC_OK)
                continue;
            st = sp_gpu_copy(dev_of(t, dst), sp_task_buf(t, dst, 1)->ptr + sp_a2av_at(a, P, true, src) * t->es,
                             in + sp_a2av_at(&t->ops[src]->params.a2av, P, false, dst) * t->es, n, e);
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

/*
 * Stages the inputs some GPU of t cannot reach (no peer access): each such
 * rank's inputs are copied into pinned host memory by its own GPU, on its lane
 * (after every rank's ready, which stream.c put there first), and every other
 * GPU of t waits for those copies before its kernels, which then read the
 * copies (on_dev). An all-reduce in place on several GPUs stages every input
 * when it stages any: each GPU may then write its ranks' results while the
 * others read copies. *at_p gets the copies' addresses (NULL: none staged),
 * *staged_p the blocks, which the task gives back once it has run.
 */
static spc_status_t stage_inputs(sp_task_t *t, uint64_t **at_p, sp_gpu_hstage_t **staged_p, sp_err_t *e)
{
    int gpus[SP_TOPO_MAX_GPUS];
    bool staged_on[SP_TOPO_MAX_GPUS] = { false };
    bool apart[SP_KERN_A2A_MAX_RANKS] = { false }, any = false;
    uint32_t n = 0;
    for (uint32_t r = 0; r < t->size; r++) {
        uint32_t k = 0;
        while (k < n && gpus[k] != dev_of(t, r))
            k++;
        if (k == n)
            gpus[n++] = dev_of(t, r);
    }
    for (uint32_t q = 0; q < t->size && n > 1; q++)
        for (uint32_t k = 0; k < n; k++)
            if (!sp_gpu_can_reach(gpus[k], dev_of(t, q)))
                any = apart[q] = true;
    *at_p = NULL;
    if (!any)
        return SPC_OK;
    if ((*at_p = calloc((size_t)t->size * t->ntensors, sizeof **at_p)) == NULL)
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    const bool all = allreduce_in_place_across(t);
    spc_status_t st = SPC_OK;
    for (uint32_t q = 0; q < t->size && st == SPC_OK; q++) {
        for (uint32_t i = 0; i < t->ntensors && st == SPC_OK && (apart[q] || all); i++) {
            const sp_task_buf_t *b = sp_task_buf(t, q, i);
            sp_gpu_hstage_t *h;
            if (!b->input || b->bytes == 0 || (st = sp_gpu_hstage_get(b->bytes, &h, e)) != SPC_OK)
                continue;
            sp_gpu_hstage_chain(h, staged_p);
            st = sp_gpu_copy(dev_of(t, q), sp_gpu_hstage_ptr(h), b->ptr, b->bytes, e);
            (*at_p)[q * t->ntensors + i] = (uint64_t)(uintptr_t)sp_gpu_hstage_ptr(h);
            for (uint32_t k = 0; k < n; k++)
                staged_on[k] = staged_on[k] || gpus[k] == dev_of(t, q);
        }
    }
    for (uint32_t k = 0; k < n && st == SPC_OK; k++) {
        sp_gpu_mark_t *m;
        if (!staged_on[k] || (st = sp_gpu_mark(gpus[k], &m, e)) != SPC_OK)
            continue;
        for (uint32_t j = 0; j < n && st == SPC_OK; j++)
            if (j != k)
                st = sp_gpu_wait_mark(gpus[j], m, e);
        sp_gpu_mark_free(m);   /* a wait holds the record it was made after; the mark may be recorded anew */
    }
    return st;
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

void sp_devplan_enqueue(sp_task_t *t, sp_gpu_hstage_t **staged_p)
{
    sp_err_t e = SP_ERR_INIT;
    uint64_t *at = NULL;
    spc_status_t st = sp_devplan_ranks_ok(t, &e);
    if (st == SPC_OK)
        st = stage_inputs(t, &at, staged_p, &e);
    staged_at = at;
    if (st == SPC_OK)
        st = plans[t->sqe.opcode](t, &e);
    staged_at = NULL;
    free(at);
    if (st != SPC_OK)
        sp_task_fail(t, st, UINT32_MAX, e.msg);
}
