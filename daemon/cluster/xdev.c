/*
 * xdev.c — an op on GPU memory whose ranks sit on several daemons: this
 * daemon's part of it, one plan per op kind (the table at the end), which
 * NCCL's thread (nccl.c) runs. A daemon gets the inputs its own ranks read and
 * writes only its own ranks' outputs, with the one-node kernels, all on the
 * GPU of its NCCL rank; its ranks on other GPUs are reached from there over
 * peer access or staged through pinned host memory (xd_views). The core
 * reaches it through eng->xdev_ops; the NCCL thread calls the plan and the
 * kernels lock not held, sp_xdev_done with it. What travels per op kind, and
 * when each part runs: docs/architecture.md, "Each daemon's part: xdev.c".
 */
#include "cluster/xdev.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cluster/sp_nccl.h"
#include "core/client.h"
#include "core/engine.h"
#include "core/exec.h"
#include "core/job.h"
#include "core/ops.h"
#include "core/task.h"
#include "gpu/devplan.h"
#include "gpu/gpu.h"
#include "gpu/stream.h"
#include "sp_topo.h"

_Static_assert(SP_TOPO_MAX_GPUS <= 64, "a work names its GPUs in a 64-bit mask");

typedef struct sp_xdev xdev_t;

/* A tensor of a rank of this daemon on a GPU that the NCCL GPU cannot map:
 * its place in staging on the NCCL GPU, filled from it (an input) or emptied
 * into it (an output; every op writes its outputs whole), both through pinned
 * host memory by its own GPU. */
typedef struct xd_away {
    uint32_t         r, i;
    int              gpu;
    bool             in, out;
    sp_gpu_hstage_t *h;
} xd_away_t;

struct sp_xdev {
    sp_nccl_work_t  work;
    sp_engine_t    *eng;          /* its lock, around imports and host staging */
    uint32_t       *nrank;        /* by group rank: the NCCL rank of its daemon */
    uint64_t       *soff;         /* [rank * ntensors + i]: that tensor's place in staging; UINT64_MAX: none */
    uint8_t       **view;         /* [rank * ntensors + i], this daemon's ranks: the tensor as the NCCL GPU reaches it */
    uint64_t        stage_bytes;
    sp_gpu_stage_t *stage;
    xd_away_t      *away;         /* at most one per tensor of this daemon's ranks */
    uint32_t        naway;
    sp_gpu_hstage_t *hstaged;     /* the away tensors' pinned host blocks */
    uint32_t        cap;          /* of work.xfers */
    bool            back;         /* in stream order: handed back by the NCCL thread */
};

static int node_cmp(const void *a, const void *b)
{
    return strcmp(a, b);
}

/* Numbers the group's daemons by node name (NCCL ranks) and fills in what
 * NCCL needs to know of the op. Lock held. */
bool sp_xdev_attach(sp_engine_t *eng, sp_task_t *t, const sp_group_t *g, sp_op_t *const *ops)
{
    const sp_job_t *job = g->job;
    const uint32_t nd = 1 + g->nremote;
    xdev_t *x = calloc(1, sizeof *x);
    if (x == NULL)
        return false;
    t->xd = x;   /* sp_xdev_detach frees it from here on */
    x->eng = eng;
    x->nrank = calloc(t->size, sizeof *x->nrank);
    x->soff = malloc((size_t)t->size * t->ntensors * sizeof *x->soff);
    x->view = calloc((size_t)t->size * t->ntensors, sizeof *x->view);
    x->away = calloc((size_t)t->size * t->ntensors, sizeof *x->away);
    x->work.nodes = malloc(nd * sizeof *x->work.nodes);
    x->work.sems = calloc(t->size, sizeof *x->work.sems);   /* at most a rank each */
    if (x->nrank == NULL || x->soff == NULL || x->view == NULL || x->away == NULL || x->work.nodes == NULL ||
        x->work.sems == NULL)
        return false;
    snprintf(x->work.nodes[0], SP_NODE_MAX, "%s", job->nodes[0]);
    for (uint32_t k = 0; k < g->nremote; k++)
        snprintf(x->work.nodes[1 + k], SP_NODE_MAX, "%s", job->nodes[g->remote[k]]);
    qsort(x->work.nodes, nd, sizeof *x->work.nodes, node_cmp);
    for (uint32_t r = 0; r < t->size; r++) {
        const char *node = job->nodes[job->members[g->ranks[r]].node];
        for (uint32_t d = 0; d < nd; d++)
            if (strcmp(x->work.nodes[d], node) == 0)
                x->nrank[r] = d;
    }
    for (uint32_t d = 0; d < nd; d++)
        if (strcmp(x->work.nodes[d], job->nodes[0]) == 0)
            x->work.me = d;
    for (size_t k = 0; k < (size_t)t->size * t->ntensors; k++)
        x->soff[k] = UINT64_MAX;
    x->work.task = t;
    snprintf(x->work.job, sizeof x->work.job, "%s", job->id);
    x->work.group_index = g->index;
    x->work.channel = t->sqe.channel;
    x->work.seq = ops[0]->seq;
    x->work.opcode = t->sqe.opcode;
    /* The GPU of this daemon's lowest rank of the group: the same from op to op
     * while its ranks keep their GPUs, so the channel's communicator, made on
     * one GPU, is kept (nccl_work.c makes it again when the GPU changes). Its
     * ranks on other GPUs are reached from there (xd_views). */
    x->work.dev = t->gpu;
    x->work.nranks = nd;
    uint64_t ms = t->sqe.timeout_ms ? t->sqe.timeout_ms : (uint64_t)eng->cfg->op_timeout_ms;
    x->work.timeout_ns = ms * 1000000ull;
    x->work.rerun = eng->cfg->peer_restart_grace_ms > 0;
    return true;
}

void sp_xdev_detach(sp_task_t *t)
{
    xdev_t *x = t->xd;
    if (!x->work.leak) {
        sp_gpu_stage_put(x->stage);
        sp_gpu_hstage_put(x->hstaged);
    }
    free(x->work.xfers);
    free(x->work.sems);
    free(x->work.nodes);
    free(x->away);
    free(x->view);
    free(x->soff);
    free(x->nrank);
    free(x);
    t->xd = NULL;
}

bool sp_xdev_leaks(const sp_task_t *t)
{
    return t->xd->work.leak;
}

/* Where rank q's tensor i is on the NCCL GPU: in staging (another daemon's
 * input, or a tensor of ours staged from a GPU the NCCL GPU cannot map), or
 * where it is, as reached from there (xd_views); NULL: nowhere here. */
static uint8_t *xd_at(sp_task_t *t, uint32_t q, uint32_t i)
{
    const size_t k = (size_t)q * t->ntensors + i;
    uint64_t off = t->xd->soff[k];
    if (off != UINT64_MAX)
        return (uint8_t *)sp_gpu_stage_ptr(t->xd->stage) + off;
    return t->here[q] ? t->xd->view[k] : NULL;
}

/* Places rank r's tensor i in staging, past what was placed before. */
static void xd_take(sp_task_t *t, xdev_t *x, uint32_t r, uint32_t i)
{
    x->soff[(size_t)r * t->ntensors + i] = x->stage_bytes;
    x->stage_bytes = (x->stage_bytes + sp_task_buf(t, r, i)->bytes + 255) & ~(uint64_t)255;
}

/* What comes whole into staging: the other daemons' inputs that this
 * daemon's ranks read, and (seq->head) the outputs it computes for the other
 * daemons' holders. A shift's sends come straight into the receives. */
static void xd_stage_inputs(sp_task_t *t, xdev_t *x)
{
    for (uint32_t r = 0; r < t->size; r++)
        if (!t->here[r])
            xd_take(t, x, r, 0);
}

static void xd_stage_root(sp_task_t *t, xdev_t *x)
{
    if (!t->here[t->sqe.root])
        xd_take(t, x, t->sqe.root, 0);
}

static void xd_stage_a2a(sp_task_t *t, xdev_t *x)
{
    for (uint32_t i = 0; i < t->a2a.ntensors; i++)
        for (uint32_t r = 0; r < t->size; r++)
            if (!t->here[r])
                xd_take(t, x, r, t->a2a.direction == SP_A2A_SEQ_TO_HEAD ? 2 * i + 1 : 2 * i);
}

/*
 * This daemon's ranks' tensors as the NCCL GPU reaches them: in place on it;
 * over peer access where it can map the rank's GPU (the import opened there,
 * as devplan.c reads another GPU's input), so NCCL sends from it and the
 * kernels read and write it there; else a place in staging on the NCCL GPU,
 * which the rank's own GPU fills and empties through pinned host memory
 * (xd_stage_in, xd_stage_out): host staging bounded by gpu_host_staging_bytes,
 * the places with the rest of staging by gpu_device_staging_bytes. Counted
 * with the one-node tasks on several GPUs, and those staged (stream.c).
 * Takes the engine lock, under which imports, host staging and the counts
 * change.
 */
static spc_status_t xd_views(sp_task_t *t, xdev_t *x, sp_err_t *e)
{
    const int dev = x->work.dev;
    spc_status_t st = SPC_OK;
    bool several = false;
    pthread_mutex_lock(&x->eng->lock);
    for (uint32_t r = 0; r < t->size && st == SPC_OK; r++) {
        const int gpu = t->ops[r]->gpu;
        for (uint32_t i = 0; i < t->ntensors && st == SPC_OK && t->here[r]; i++) {
            const sp_task_buf_t *b = sp_task_buf(t, r, i);
            uint8_t **v = &x->view[(size_t)r * t->ntensors + i];
            uint64_t base;
            if (gpu == dev || b->bytes == 0) {
                *v = b->ptr;
                continue;
            }
            several = true;
            if (sp_gpu_can_reach(dev, gpu)) {
                st = sp_gpu_import_on(b->import, dev, &base, e);
                if (st == SPC_OK)
                    *v = (uint8_t *)(uintptr_t)(base + ((uint64_t)(uintptr_t)b->ptr - sp_gpu_import_ptr(b->import)));
            } else {
                xd_away_t *a = &x->away[x->naway];
                st = sp_gpu_hstage_get(b->bytes, &a->h, e);
                if (st != SPC_OK)
                    break;
                sp_gpu_hstage_chain(a->h, &x->hstaged);
                a->r = r;
                a->i = i;
                a->gpu = gpu;
                a->in = b->input;
                a->out = b->output;
                x->naway++;
                x->work.gpus |= 1ull << gpu;
                xd_take(t, x, r, i);
            }
        }
    }
    if (st == SPC_OK) {
        x->eng->gpu_sched->multi_ops += several;
        x->eng->gpu_sched->staged_ops += x->naway > 0;
    }
    pthread_mutex_unlock(&x->eng->lock);
    return st;
}

/* Enqueues on GPU `to`'s lane a wait for what the lanes of the GPUs in `from`
 * (a mask) hold now. */
static spc_status_t xd_join(int to, uint64_t from, sp_err_t *e)
{
    spc_status_t st = SPC_OK;
    for (int g = 0; g < SP_TOPO_MAX_GPUS && st == SPC_OK; g++) {
        sp_gpu_mark_t *m;
        if (!(from >> g & 1) || (st = sp_gpu_mark(g, &m, e)) != SPC_OK)
            continue;
        st = sp_gpu_wait_mark(to, m, e);
        sp_gpu_mark_free(m);   /* a wait holds the record it was made after */
    }
    return st;
}

/* Enqueues on the lanes of the GPUs in `to` a wait for what GPU `from`'s holds now. */
static spc_status_t xd_fan_out(int from, uint64_t to, sp_err_t *e)
{
    sp_gpu_mark_t *m;
    spc_status_t st = sp_gpu_mark(from, &m, e);
    if (st != SPC_OK)
        return st;
    for (int g = 0; g < SP_TOPO_MAX_GPUS && st == SPC_OK; g++)
        if (to >> g & 1)
            st = sp_gpu_wait_mark(g, m, e);
    sp_gpu_mark_free(m);
    return st;
}

/* Before anything else of the op (every lane already past its ranks' ready):
 * each GPU copies its staged tensors into their host blocks, and the NCCL
 * GPU, once they all have, into their places in staging. */
static spc_status_t xd_stage_in(sp_task_t *t, sp_err_t *e)
{
    const xdev_t *x = t->xd;
    uint64_t from = 0;
    spc_status_t st = SPC_OK;
    for (uint32_t k = 0; k < x->naway && st == SPC_OK; k++) {
        const xd_away_t *a = &x->away[k];
        const sp_task_buf_t *b = sp_task_buf(t, a->r, a->i);
        if (!a->in)
            continue;
        st = sp_gpu_copy(a->gpu, sp_gpu_hstage_ptr(a->h), b->ptr, b->bytes, e);
        from |= 1ull << a->gpu;
    }
    if (st == SPC_OK)
        st = xd_join(x->work.dev, from, e);
    for (uint32_t k = 0; k < x->naway && st == SPC_OK; k++) {
        const xd_away_t *a = &x->away[k];
        if (a->in)
            st = sp_gpu_copy(x->work.dev, xd_at(t, a->r, a->i), sp_gpu_hstage_ptr(a->h),
                             sp_task_buf(t, a->r, a->i)->bytes, e);
    }
    return st;
}

/* After the kernels: the NCCL GPU copies the staged outputs into their host
 * blocks, each output's own GPU then copies them in place, and the NCCL GPU
 * waits for that, so the ranks' done (written next on its lane) follows
 * every output. */
static spc_status_t xd_stage_out(sp_task_t *t, sp_err_t *e)
{
    const xdev_t *x = t->xd;
    uint64_t to = 0;
    spc_status_t st = SPC_OK;
    for (uint32_t k = 0; k < x->naway && st == SPC_OK; k++) {
        const xd_away_t *a = &x->away[k];
        if (!a->out)
            continue;
        st = sp_gpu_copy(x->work.dev, sp_gpu_hstage_ptr(a->h), xd_at(t, a->r, a->i),
                         sp_task_buf(t, a->r, a->i)->bytes, e);
        to |= 1ull << a->gpu;
    }
    if (st != SPC_OK || to == 0)
        return st;
    st = xd_fan_out(x->work.dev, to, e);
    for (uint32_t k = 0; k < x->naway && st == SPC_OK; k++) {
        const xd_away_t *a = &x->away[k];
        const sp_task_buf_t *b = sp_task_buf(t, a->r, a->i);
        if (a->out)
            st = sp_gpu_copy(a->gpu, b->ptr, sp_gpu_hstage_ptr(a->h), b->bytes, e);
    }
    return st == SPC_OK ? xd_join(x->work.dev, to, e) : st;
}

/* Transfer number `index` of the op (every daemon numbers the op's transfers
 * alike, in this enumeration's order): kept when this daemon is one end. */
static bool xd_xfer(xdev_t *x, uint32_t from, uint32_t to, uint8_t *send, uint8_t *recv, uint64_t bytes)
{
    if (bytes == 0 || from == to)
        return true;
    uint32_t index = x->work.nglobal++, me = x->work.me;
    if (from != me && to != me)
        return true;
    if (x->work.nxfers == x->cap) {
        uint32_t cap = x->cap ? 2 * x->cap : 16;
        sp_nccl_xfer_t *n = realloc(x->work.xfers, cap * sizeof *n);
        if (n == NULL)
            return false;
        x->work.xfers = n;
        x->cap = cap;
    }
    x->work.xfers[x->work.nxfers++] = (sp_nccl_xfer_t){ .peer = from == me ? to : from, .send = from == me,
                                                        .index = index, .ptr = from == me ? send : recv,
                                                        .bytes = bytes };
    return true;
}

/* Byte ranges of one buffer (at `at`, on whichever end this daemon is) sent
 * from daemon `from` to daemon `to`. */
typedef struct xd_ranges {
    xdev_t  *x;
    uint32_t from, to;
    uint8_t *at;
    bool     ok;
} xd_ranges_t;

static void xd_range(void *arg, uint64_t off, uint64_t len)
{
    xd_ranges_t *rg = arg;
    if (rg->ok)
        rg->ok = xd_xfer(rg->x, rg->from, rg->to, rg->at + off, rg->at + off, len);
}

/*
 * The byte ranges of holder output `tensor` of a seq->head all-to-all whose
 * rows come from the owners marked in `owner` (merged, in order): owner q's
 * real rows are global rows [q S_loc, q S_loc + real(q)) of every batch entry,
 * whole rows of the output (its heads are the holder's).
 */
static void s2h_rows(const struct sp_a2a_params *a, uint32_t es, uint32_t P, uint32_t tensor, const bool *owner,
                     void (*fn)(void *arg, uint64_t off, uint64_t len), void *arg)
{
    sp_heads_plan_t pl;
    if (!sp_heads_plan(&pl, a->t[tensor].heads, a->t[tensor].kind, a->kv_heads, P))
        return;
    const uint32_t S = a->seq_len, S_loc = sp_rows_local(S, P);
    const uint64_t narrow = (uint64_t)pl.local * a->t[tensor].head_dim * es;
    sp_ranges_t run = { .fn = fn, .arg = arg };
    if (a->layout == SP_LAYOUT_BSHD) {
        for (uint64_t b = 0; b < a->batch; b++)
            for (uint32_t q = 0; q < P; q++)
                if (owner[q])
                    sp_ranges_add(&run, sp_a2a_row(a, b, (uint64_t)q * S_loc, S) * narrow,
                                  sp_rows_real(S, P, q) * narrow);
    } else {   /* SBHD: an owner's rows of every batch entry are one run */
        for (uint32_t q = 0; q < P; q++)
            if (owner[q])
                sp_ranges_add(&run, (uint64_t)q * S_loc * a->batch * narrow,
                              (uint64_t)sp_rows_real(S, P, q) * a->batch * narrow);
    }
    sp_ranges_end(&run);
}

/* The op's transfers, in the order every daemon enumerates them. */

/* Every rank's input to every daemon. */
static bool xd_plan_inputs(sp_task_t *t, xdev_t *x)
{
    bool ok = true;
    for (uint32_t q = 0; q < t->size && ok; q++)
        for (uint32_t d = 0; d < x->work.nranks && ok; d++)
            ok = xd_xfer(x, x->nrank[q], d, xd_at(t, q, 0), xd_at(t, q, 0), t->sqe.count * t->es);
    return ok;
}

/* Of every rank's input, the slices another daemon's ranks read (the op
 * table's, as net.c sends host memory), each into its place in that daemon's
 * staging copy of the input. */
static bool xd_plan_slices(sp_task_t *t, xdev_t *x)
{
    const uint32_t P = t->size;
    const sp_op_kind_t *k = sp_op_kind(t->sqe.opcode);
    bool ok = true;
    bool *mask = calloc(P, sizeof *mask);
    if (mask == NULL)
        return false;
    for (uint32_t q = 0; q < P && ok; q++)
        for (uint32_t d = 0; d < x->work.nranks && ok; d++) {
            if (d == x->nrank[q])
                continue;
            for (uint32_t r = 0; r < P; r++)
                mask[r] = x->nrank[r] == d;
            xd_ranges_t rg = { x, x->nrank[q], d, xd_at(t, q, 0), true };
            k->slices(t->ops[0], P, q, 0, mask, xd_range, &rg);
            ok = rg.ok;
        }
    free(mask);
    return ok;
}

/* The root's input to every daemon. */
static bool xd_plan_root(sp_task_t *t, xdev_t *x)
{
    const uint32_t root = t->sqe.root;
    bool ok = true;
    for (uint32_t d = 0; d < x->work.nranks && ok; d++)
        ok = xd_xfer(x, x->nrank[root], d, xd_at(t, root, 0), xd_at(t, root, 0), t->sqe.count * t->es);
    return ok;
}

/* Each send to the daemon of the rank that reads it, straight into that rank's receive. */
static bool xd_plan_shift(sp_task_t *t, xdev_t *x)
{
    const uint32_t P = t->size;
    const bool linear = t->sqe.flags & SP_SHIFT_F_LINEAR, reverse = t->sqe.flags & SP_SHIFT_F_REVERSE;
    bool ok = true;
    for (uint32_t i = 0; i < t->ntensors && ok; i += 2)
        for (uint32_t dst = 0; dst < P && ok; dst++) {
            uint32_t from = reverse ? (dst + 1) % P : (dst + P - 1) % P;
            if (linear && (reverse ? dst == P - 1 : dst == 0))
                continue;   /* the edge receives zeros */
            ok = xd_xfer(x, x->nrank[from], x->nrank[dst], xd_at(t, from, i), xd_at(t, dst, i + 1),
                         sp_task_buf(t, from, i)->bytes);
        }
    return ok;
}

/* Each block from its sender's send straight into its receiver's receive
 * (another daemon's rank has no buffer here: NULL, never used). */
static bool xd_plan_alltoallv(sp_task_t *t, xdev_t *x)
{
    const uint32_t P = t->size;
    bool ok = true;
    for (uint32_t src = 0; src < P && ok; src++)
        for (uint32_t dst = 0; dst < P && ok; dst++) {
            const struct sp_a2av_params *a = &t->ops[dst]->params.a2av;
            uint8_t *send = t->here[src] ? xd_at(t, src, 0) +
                                               sp_a2av_at(&t->ops[src]->params.a2av, P, false, dst) * t->es
                                         : NULL;
            uint8_t *recv = t->here[dst] ? xd_at(t, dst, 1) + sp_a2av_at(a, P, true, src) * t->es : NULL;
            ok = xd_xfer(x, x->nrank[src], x->nrank[dst], send, recv, a->counts[P + src] * t->es);
        }
    return ok;
}

/* s2h: the rows of each holder's output that another daemon's owners make;
 * h2s: the slices of each input that another daemon's owners read. */
static bool xd_plan_a2a(sp_task_t *t, xdev_t *x)
{
    const uint32_t P = t->size, D = x->work.nranks;
    const uint32_t *nr = x->nrank;
    const bool s2h = t->a2a.direction == SP_A2A_SEQ_TO_HEAD;
    bool ok = true;
    bool *mask = calloc(P, sizeof *mask);
    if (mask == NULL)
        return false;
    for (uint32_t i = 0; i < t->a2a.ntensors && ok; i++)
        for (uint32_t r = 0; r < P && ok; r++)   /* s2h: r the holder; h2s: r the source */
            for (uint32_t d = 0; d < D && ok; d++) {
                if (d == nr[r])
                    continue;
                for (uint32_t q = 0; q < P; q++)
                    mask[q] = nr[q] == d;
                xd_ranges_t rg = { x, s2h ? d : nr[r], s2h ? nr[r] : d, xd_at(t, r, s2h ? 2 * i + 1 : 2 * i),
                                   true };
                if (s2h)   /* the rows of r's output that d's owners make */
                    s2h_rows(&t->a2a, (uint32_t)t->es, P, i, mask, xd_range, &rg);
                else       /* the slices of r's input that d's owners read */
                    sp_a2a_ranges(&t->a2a, (uint32_t)t->es, P, i, r, mask, xd_range, &rg);
                ok = rg.ok;
            }
    free(mask);
    return ok;
}

/* seq->head, before the exchange: every holder's output, this daemon's own
 * holders' in place and the others' into staging. A source of another daemon
 * is stood in for by one of ours (inputs are all the same size): the rows it
 * makes are replaced by what that daemon sends (ours) or dropped (theirs). */
static spc_status_t xd_before_a2a(sp_task_t *t, sp_err_t *e)
{
    const uint32_t P = t->size;
    const void *src[SP_KERN_A2A_MAX_RANKS];
    spc_status_t st = SPC_OK;
    if (t->a2a.direction != SP_A2A_SEQ_TO_HEAD)
        return SPC_OK;
    uint32_t mine = 0;
    while (!t->here[mine])
        mine++;
    for (uint32_t i = 0; i < t->a2a.ntensors && st == SPC_OK; i++) {
        sp_kern_a2a_desc_t d = sp_devplan_a2a_desc(t, i);
        for (uint32_t q = 0; q < P; q++)
            src[q] = xd_at(t, t->here[q] ? q : mine, 2 * i);
        for (uint32_t r = 0; r < P && st == SPC_OK; r++)
            st = sp_gpu_a2a(t->gpu, xd_at(t, r, 2 * i + 1), src, &d, r, e);
    }
    return st;
}

/* After the exchange: the kernels that read what came, writing this daemon's ranks' outputs. */

/* One launch, as on one node. The kernel writes every dst[r] of the P it
 * folds: another daemon's rank writes where one of ours does (the same thread
 * stores the same value twice), so nothing else is touched. */
static spc_status_t xd_after_allreduce(sp_task_t *t, sp_err_t *e)
{
    void *dst[SP_KERN_A2A_MAX_RANKS];
    const void *src[SP_KERN_A2A_MAX_RANKS];
    uint32_t mine = 0;
    while (!t->here[mine])
        mine++;
    for (uint32_t r = 0; r < t->size; r++) {
        src[r] = xd_at(t, r, 0);
        dst[r] = xd_at(t, t->here[r] ? r : mine, 1);
    }
    return sp_gpu_allreduce(t->gpu, dst, src, t->size, t->sqe.count, t->sqe.dtype, t->sqe.redop, e);
}

static spc_status_t xd_after_reduce_scatter(sp_task_t *t, sp_err_t *e)
{
    return sp_devplan_scatter(t, xd_at, e);
}

static spc_status_t xd_after_allgather(sp_task_t *t, sp_err_t *e)
{
    const uint64_t n = t->sqe.count * t->es;
    spc_status_t st = SPC_OK;
    for (uint32_t dst = 0; dst < t->size && st == SPC_OK; dst++)
        for (uint32_t q = 0; q < t->size && st == SPC_OK && t->here[dst]; q++)
            st = sp_gpu_copy(t->gpu, xd_at(t, dst, 1) + q * n, xd_at(t, q, 0), n, e);
    return st;
}

static spc_status_t xd_after_broadcast(sp_task_t *t, sp_err_t *e)
{
    const uint64_t n = t->sqe.count * t->es;
    spc_status_t st = SPC_OK;
    for (uint32_t dst = 0; dst < t->size && st == SPC_OK; dst++)
        if (t->here[dst] && dst != t->sqe.root)
            st = sp_gpu_copy(t->gpu, xd_at(t, dst, 0), xd_at(t, t->sqe.root, 0), n, e);
    return st;
}

static spc_status_t xd_after_shift(sp_task_t *t, sp_err_t *e)
{
    const uint32_t P = t->size;
    const bool linear = t->sqe.flags & SP_SHIFT_F_LINEAR, reverse = t->sqe.flags & SP_SHIFT_F_REVERSE;
    spc_status_t st = SPC_OK;
    for (uint32_t i = 0; i < t->ntensors && st == SPC_OK; i += 2)
        for (uint32_t dst = 0; dst < P && st == SPC_OK; dst++) {
            uint32_t from = reverse ? (dst + 1) % P : (dst + P - 1) % P;
            bool edge = linear && (reverse ? dst == P - 1 : dst == 0);
            if (!t->here[dst] || (!edge && !t->here[from]))
                continue;   /* another daemon's, or came straight in */
            st = sp_gpu_copy(t->gpu, xd_at(t, dst, i + 1), edge ? NULL : xd_at(t, from, i),
                             sp_task_buf(t, dst, i + 1)->bytes, e);
        }
    return st;
}

/* The blocks between this daemon's own ranks. */
static spc_status_t xd_after_alltoallv(sp_task_t *t, sp_err_t *e)
{
    const uint32_t P = t->size;
    spc_status_t st = SPC_OK;
    for (uint32_t dst = 0; dst < P && st == SPC_OK; dst++)
        for (uint32_t src = 0; src < P && st == SPC_OK && t->here[dst]; src++) {
            const struct sp_a2av_params *a = &t->ops[dst]->params.a2av;
            uint64_t n = a->counts[P + src] * t->es;
            if (n > 0 && t->here[src])
                st = sp_gpu_copy(t->gpu, xd_at(t, dst, 1) + sp_a2av_at(a, P, true, src) * t->es,
                                 xd_at(t, src, 0) + sp_a2av_at(&t->ops[src]->params.a2av, P, false, dst) * t->es,
                                 n, e);
        }
    return st;
}

static spc_status_t xd_after_a2a(sp_task_t *t, sp_err_t *e)
{
    const void *src[SP_KERN_A2A_MAX_RANKS];
    spc_status_t st = SPC_OK;
    if (t->a2a.direction == SP_A2A_SEQ_TO_HEAD)
        return SPC_OK;   /* its kernels ran before the exchange */
    for (uint32_t i = 0; i < t->a2a.ntensors && st == SPC_OK; i++) {
        sp_kern_a2a_desc_t d = sp_devplan_a2a_desc(t, i);
        for (uint32_t q = 0; q < t->size; q++)
            src[q] = xd_at(t, q, 2 * i);
        for (uint32_t o = 0; o < t->size && st == SPC_OK; o++)
            if (t->here[o])
                st = sp_gpu_a2a(t->gpu, xd_at(t, o, 2 * i + 1), src, &d, o, e);
    }
    return st;
}

/* How each kind crosses daemons, by opcode (every kind with a host plan in
 * the op table has a row).
 *   stage   places in staging what comes whole (xd_take; NULL: nothing, it
 *           comes straight into the receives);
 *   plan    the transfers, in the order every daemon enumerates them;
 *   before  kernels before the transfers (NULL: none);
 *   after   kernels that read what came, writing this daemon's ranks' outputs. */
typedef struct xd_kind {
    void         (*stage)(sp_task_t *t, xdev_t *x);
    bool         (*plan)(sp_task_t *t, xdev_t *x);
    spc_status_t (*before)(sp_task_t *t, sp_err_t *e);
    spc_status_t (*after)(sp_task_t *t, sp_err_t *e);
} xd_kind_t;

static const xd_kind_t kinds[] = {
    [SP_OP_ALLREDUCE] = { .stage = xd_stage_inputs, .plan = xd_plan_inputs, .after = xd_after_allreduce },
    [SP_OP_ALLTOALL] = { .stage = xd_stage_a2a, .plan = xd_plan_a2a, .before = xd_before_a2a, .after = xd_after_a2a },
    [SP_OP_SHIFT] = { .plan = xd_plan_shift, .after = xd_after_shift },
    [SP_OP_ALLGATHER] = { .stage = xd_stage_inputs, .plan = xd_plan_inputs, .after = xd_after_allgather },
    [SP_OP_BROADCAST] = { .stage = xd_stage_root, .plan = xd_plan_root, .after = xd_after_broadcast },
    [SP_OP_REDUCE_SCATTER] = { .stage = xd_stage_inputs, .plan = xd_plan_slices,
                               .after = xd_after_reduce_scatter },
    [SP_OP_ALLTOALLV] = { .plan = xd_plan_alltoallv, .after = xd_after_alltoallv },
};

spc_status_t sp_xdev_plan(sp_task_t *t, sp_err_t *e)
{
    const xd_kind_t *k = &kinds[t->sqe.opcode];
    xdev_t *x = t->xd;
    spc_status_t st = sp_devplan_ranks_ok(t, e);
    if (st != SPC_OK)
        return st;
    x->stage_bytes = 0;
    if (k->stage != NULL)
        k->stage(t, x);
    st = xd_views(t, x, e);
    if (st != SPC_OK)
        return st;
    if (x->stage_bytes > 0) {
        st = sp_gpu_stage_get(t->gpu, x->stage_bytes, &x->stage, e);
        if (st != SPC_OK)
            return st;
    }
    if (!k->plan(t, x))
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "daemon out of memory planning a %s across daemons",
                          sp_op_name(t->sqe.opcode));
    return SPC_OK;
}

spc_status_t sp_xdev_before(sp_task_t *t, sp_err_t *e)
{
    const xd_kind_t *k = &kinds[t->sqe.opcode];
    spc_status_t st = xd_stage_in(t, e);
    return st == SPC_OK && k->before != NULL ? k->before(t, e) : st;
}

spc_status_t sp_xdev_after(sp_task_t *t, sp_err_t *e)
{
    spc_status_t st = kinds[t->sqe.opcode].after(t, e);
    return st == SPC_OK ? xd_stage_out(t, e) : st;
}

/* ================================================================ the task's life, for the core */

void sp_xdev_stream(sp_task_t *t, uint64_t ready_dptr, uint64_t done_dptr, uint64_t seq)
{
    sp_nccl_work_t *w = &t->xd->work;
    w->sems[w->nsems++] = (sp_nccl_sem_t){ .ready = ready_dptr, .done = done_dptr, .seq = seq };
}

void sp_xdev_submit(sp_engine_t *eng, sp_task_t *t)
{
    sp_nccl_submit(eng, &t->xd->work);
}

bool sp_xdev_back(const sp_task_t *t)
{
    return t->xd->back;
}

void sp_xdev_give_up(sp_task_t *t)
{
    sp_nccl_give_up(&t->xd->work);
}

bool sp_xdev_wrote_done(const sp_task_t *t)
{
    return t->xd->work.done_enqueued && !sp_xdev_leaks(t);
}

void sp_xdev_done(sp_engine_t *eng, sp_task_t *t)
{
    const sp_nccl_work_t *w = &t->xd->work;
    if (w->status != SPC_OK)
        sp_task_fail(t, w->status, UINT32_MAX, w->detail);
    if (w->nsems > 0) {
        t->xd->back = true;   /* stream.c's poll completes it, in its streams' order */
        return;
    }
    sp_task_finish(eng, t);
}
