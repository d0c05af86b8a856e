/*
 * stage.c — registered memory, through a staging buffer of the engine's.
 *
 * Registered memory is not mapped in the daemon: the copy reaches it through a
 * staging buffer that cross-memory attach fills before and empties after. Its
 * size is bounded by staging_bytes, not by what the client registered (an
 * untouched mapping costs the client nothing, and its copy would cost spd all
 * of it): an op larger than that streams through it in windows, slices of an
 * axis along which every tensor of the op is indexed (its kind's axis, span
 * and base in exec.c say how).
 *
 * A window reads its slices of the registered inputs, runs the op's chunks cut
 * to it, and writes its slices of the registered outputs back (sp_task_run).
 * Every element is made from the same inputs in the same order as in one pass
 * (an all-reduce still folds in rank order), so the bits are the same; a send
 * that is its receive is read before it is written, slice by slice, as in one
 * pass.
 */
#include "core/stage.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "core/engine.h"
#include "core/exec.h"
#include "core/mem.h"
#include "core/ops.h"
#include "core/task.h"
#include "base/log.h"

/* The bytes [*lo_p, *hi_p) of rank r's tensor i in window [u0, u1). */
static void window_span(sp_task_t *t, uint32_t r, uint32_t i, uint64_t u0, uint64_t u1, uint64_t *lo_p,
                        uint64_t *hi_p)
{
    const uint64_t n = sp_task_buf(t, r, i)->bytes;
    uint64_t lo = u0 * t->unit, hi = u1 * t->unit;
    if (t->ex->span != NULL)
        t->ex->span(t, r, i, u0, u1, &lo, &hi);
    *lo_p = lo < n ? lo : n;
    *hi_p = hi < n ? hi : n;
}

/* Cuts chunk c to window [u0, u1); false when none of it is there. */
bool sp_stage_clip(sp_task_t *t, sp_chunk_t *c, uint64_t u0, uint64_t u1)
{
    const uint64_t base = t->ex->base != NULL ? t->ex->base(t, c) : 0;
    const uint64_t lo = c->lo + base > u0 ? c->lo + base : u0, hi = c->hi + base < u1 ? c->hi + base : u1;
    if (lo >= hi)
        return false;
    c->lo = lo - base;
    c->hi = hi - base;
    return true;
}

/*
 * Sizes the windows and places each registered tensor's slot in the staging:
 * the whole op in one window when its registered tensors fit in staging_bytes,
 * else the widest window whose slices do (every tensor's slice is at most
 * `window` units). The staging itself is the engine's, taken when the task
 * runs (sp_stage_alloc). Returns SPC_OK, SPC_ERR_LIMIT (logged) when no window
 * fits, or SPC_ERR_NO_MEMORY, the reason in e.
 */
spc_status_t sp_stage_plan(sp_engine_t *eng, sp_task_t *t, sp_err_t *e)
{
    uint64_t total = 0, unit, most = 0;
    uint32_t nreg = 0, most_r = 0, most_i = 0;

    for (uint32_t r = 0; r < t->size; r++) {
        for (uint32_t i = 0; i < t->ntensors; i++) {
            const sp_task_buf_t *b = sp_task_buf(t, r, i);
            if (b->remote == 0)
                continue;
            nreg++;
            total += b->bytes;
            if (b->bytes >= most) {
                most = b->bytes;
                most_r = r;
                most_i = i;
            }
        }
    }
    if (nreg == 0)
        return SPC_OK;
    const uint64_t budget = (uint64_t)eng->cfg->staging_bytes;
    t->axis = t->ex->axis(t, &unit);
    t->unit = unit;
    if (total <= budget)
        t->window = t->axis;
    else if (unit != UINT64_MAX && budget / nreg >= unit)
        t->window = budget / nreg / unit;
    else {
        sp_err_set(e, SPC_ERR_LIMIT, "%s needs %" PRIu64 " bytes of registered memory staged at once (rank %u's tensor "
                   "%u: %" PRIu64 " bytes), more than staging_bytes (%" PRIu64 "): raise staging_bytes, or allocate "
                   "the tensors with spc_alloc", sp_op_name(t->sqe.opcode), total, most_r, most_i, most, budget);
        sp_warn(OP, "group %u: %s", t->group_id, e->msg);
        return e->status;
    }

    for (uint32_t k = 0; k < t->size * t->ntensors; k++) {
        sp_task_buf_t *b = &t->bufs[k];
        if (b->remote != 0) {
            b->lo = t->stage_bytes;   /* its slot's offset, until the staging exists */
            t->stage_bytes += t->window == t->axis || b->bytes / unit <= t->window ? b->bytes : t->window * unit;
        }
    }
    if (t->window < t->axis && (t->wchunks = malloc(t->nchunks * sizeof *t->wchunks)) == NULL)
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "daemon out of memory staging a %s", sp_op_name(t->sqe.opcode));
    if (t->window < t->axis)
        sp_debug(OP, "group %u: %s of %" PRIu64 " registered bytes streams through %" PRIu64 " bytes of staging",
                 t->group_id, sp_op_name(t->sqe.opcode), total, t->stage_bytes);
    return SPC_OK;
}

/* How long the staging outlives its last task. */
#define STAGE_KEEP_NS (1000ull * 1000000ull)

/*
 * Points each registered tensor of t at its slot in the engine's staging,
 * which grows to the task's size if it must. One buffer serves task after
 * task (tasks run one at a time, on the progress thread): its pages stay
 * faulted in, where a buffer allocated per task was mapped and faulted in
 * afresh by every op past glibc's mmap threshold. sp_task_stage_trim frees it
 * once the tasks stop.
 */
bool sp_stage_alloc(sp_engine_t *eng, sp_task_t *t)
{
    if (eng->stage_cap < t->stage_bytes) {
        free(eng->stage);
        eng->stage_cap = 0;
        if ((eng->stage = malloc(t->stage_bytes)) == NULL) {
            t->status = SPC_ERR_NO_MEMORY;
            snprintf(t->detail, sizeof t->detail, "daemon out of memory for %" PRIu64 " bytes of staging",
                     t->stage_bytes);
            return false;
        }
        eng->stage_cap = t->stage_bytes;
    }
    eng->stage_used_ns = sp_now_ns();
    for (uint32_t k = 0; k < t->size * t->ntensors; k++) {
        sp_task_buf_t *b = &t->bufs[k];
        if (b->remote != 0) {
            b->ptr = eng->stage + b->lo;
            b->lo = 0;
        }
    }
    return true;
}

void sp_task_stage_trim(sp_engine_t *eng, uint64_t now, bool all)
{
    if (eng->stage != NULL && (all || (int64_t)(now - eng->stage_used_ns) > (int64_t)STAGE_KEEP_NS)) {
        free(eng->stage);
        eng->stage = NULL;
        eng->stage_cap = 0;
    }
}

/* Reads window [u0, u1) of every registered input into its slot. False (the
 * task failed, naming the rank) when a rank's memory is gone. */
bool sp_stage_in(sp_task_t *t, uint64_t u0, uint64_t u1, sp_err_t *e)
{
    for (uint32_t r = 0; r < t->size; r++) {
        for (uint32_t i = 0; i < t->ntensors; i++) {
            sp_task_buf_t *b = sp_task_buf(t, r, i);
            if (b->remote == 0)
                continue;
            uint64_t hi;
            window_span(t, r, i, u0, u1, &b->lo, &hi);
            if (!b->input || hi == b->lo)
                continue;
            spc_status_t st = sp_mem_vm_copy(t->ops[r]->client, b->remote + b->lo, b->ptr, hi - b->lo, false, e);
            if (st != SPC_OK) {
                t->status = st;
                t->bad_rank = r;
                snprintf(t->detail, sizeof t->detail, "%s", e->msg);
                return false;
            }
        }
    }
    return true;
}

/* Writes window [u0, u1) of every registered output back; a failure there is
 * that rank's alone. */
void sp_stage_out(sp_task_t *t, uint64_t u0, uint64_t u1, sp_err_t *e)
{
    for (uint32_t r = 0; r < t->size; r++) {
        for (uint32_t i = 0; i < t->ntensors; i++) {
            sp_task_buf_t *b = sp_task_buf(t, r, i);
            uint64_t lo, hi;
            if (b->remote == 0 || !b->output || t->rank_status[r] != SPC_OK)
                continue;
            window_span(t, r, i, u0, u1, &lo, &hi);
            if (hi > lo)
                t->rank_status[r] = sp_mem_vm_copy(t->ops[r]->client, b->remote + lo, b->ptr, hi - lo, true, e);
        }
    }
}
