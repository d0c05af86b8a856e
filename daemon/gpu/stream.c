/*
 * stream.c — device tasks on the daemon's GPU streams (a lane per client
 * stream), and the stream order of clients' ops (spclient.h, "GPU streams";
 * DESIGN.md §4). The progress thread hands tasks over (sp_stream_task_ready)
 * and polls their marks (sp_stream_poll): it never blocks on the GPU. A task
 * starts only once its ranks' streams have started every op before it; every
 * op, failed or not, owes its ranks a done, in order. Lanes, the start order,
 * giving up, ops across daemons: docs/architecture.md, "Stream order on GPUs".
 */
#include "gpu/stream.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "gpu/devplan.h"
#include "gpu/gpu.h"
#include "base/log.h"
#include "core/client.h"
#include "core/engine.h"
#include "core/exec.h"
#include "core/ops.h"

static uint64_t sem_dptr(const sp_client_t *c, uint32_t slot, bool done)
{
    return c->sems_dptr + slot * sizeof(struct sp_stream_sem) +
           (done ? offsetof(struct sp_stream_sem, done) : offsetof(struct sp_stream_sem, ready));
}

static void store_done(sp_client_t *c, sp_dstream_t *ds, uint64_t v)
{
    __atomic_store_n(&c->v.sems[ds->slot].done, v, __ATOMIC_RELEASE);
}

/* The stream op's stream, or NULL when the op names none or a bad one. */
static sp_dstream_t *op_stream(const sp_op_t *op)
{
    if (op->client == NULL || op->sqe.stream == 0 || op->sqe.stream > SP_STREAMS_MAX)
        return NULL;
    return op->client->streams[op->sqe.stream - 1];
}

static void stream_break(sp_client_t *c, sp_dstream_t *ds, const char *why)
{
    if (!ds->broken) {
        ds->broken = true;
        snprintf(ds->broken_detail, sizeof ds->broken_detail, "%s", why);
        sp_warn(OP, "client %" PRIu64 " stream %u broken: %s", c->id, ds->slot, why);
    }
    if (ds->nflight == 0)
        store_done(c, ds, SP_STREAM_POISON);
}

static bool op_given_up(const sp_op_t *op)
{
    const sp_dstream_t *ds = op_stream(op);
    return ds != NULL && op->in_window && ds->gave_up_at != 0 && op->sqe.stream_seq >= ds->gave_up_at;
}

/*
 * Fails t if the input of one of its ranks never came (see gave_up_at). A rank
 * whose client is gone is lost, as coll.c says of any rank that dies mid-op:
 * every rank hears PEER_LOST naming it, unless spd is stopping, which closes
 * every client itself: then every rank hears that. Otherwise the rank's stream
 * was given up (a timeout, spd going): that rank hears CANCELED, the others
 * that it refused.
 */
static void fail_if_given_up(const sp_engine_t *eng, sp_task_t *t)
{
    for (uint32_t r = 0; r < sp_task_size(t) && sp_task_status(t) == SPC_OK; r++) {
        sp_op_t *op = sp_task_op(t, r);
        if (!op_given_up(op))
            continue;
        const sp_dstream_t *ds = op_stream(op);
        char why[SP_DETAIL_BYTES - 32];
        if (op->client->zombie && eng->gpu_sched->stopping) {
            sp_task_fail(t, SPC_ERR_SHUTTING_DOWN, UINT32_MAX, "spd is shutting down");
            continue;
        }
        if (op->client->zombie) {
            snprintf(why, sizeof why, "rank %u (pid %d) lost: its client is gone, its input for op #%" PRIu64
                     " never came", r, (int)op->client->pid, op->sqe.stream_seq);
            sp_task_fail(t, SPC_ERR_PEER_LOST, UINT32_MAX, why);
            continue;
        }
        snprintf(why, sizeof why, "stream %u of rank %u was given up at its op #%" PRIu64 " (%s): its input for op #%"
                 PRIu64 " never came", ds->slot, r, ds->gave_up_at, ds->broken_detail, op->sqe.stream_seq);
        sp_task_fail(t, SPC_ERR_CANCELED, r, why);
    }
}

/*
 * Stops the daemon's waits for ds's ready: stores the poison there, after
 * noting the first seq whose input will not come, and telling the other
 * daemons of every op across daemons in flight that needed one.
 */
static void poison_ready(sp_engine_t *eng, sp_client_t *c, sp_dstream_t *ds)
{
    struct sp_stream_sem *sem = &c->v.sems[ds->slot];
    uint64_t ready = __atomic_load_n(&sem->ready, __ATOMIC_ACQUIRE);
    if (ds->gave_up_at == 0 && ready != SP_STREAM_POISON)
        ds->gave_up_at = ready + 1;
    const sp_gpu_sched_t *gs = eng->gpu_sched;
    for (uint32_t i = 0; i < gs->nflight && ds->gave_up_at != 0; i++) {
        sp_task_t *t = gs->flight[i].task;
        if (!sp_task_xdev(t))
            continue;
        for (uint32_t r = 0; r < sp_task_size(t); r++)
            if (op_stream(sp_task_op(t, r)) == ds && op_given_up(sp_task_op(t, r)))
                sp_task_xdev_give_up(t);
    }
    __atomic_store_n(&sem->ready, SP_STREAM_POISON, __ATOMIC_RELEASE);
}

/*
 * Whether the slot's semaphores may still be written once its stream is gone:
 * by a lane of spd's that did not drain (an op across daemons whose NCCL
 * stream would not stop), or by the client's CUDA stream, which has not
 * written ready for every op spd took (its destroy did not synchronize; where
 * spd poisoned ready, the writes it gave up on have not come). Such a write
 * would pass the waits of a new stream in the slot: the slot is retired.
 */
static bool slot_may_be_written(const sp_client_t *c, const sp_dstream_t *ds)
{
    uint64_t ready = __atomic_load_n(&c->v.sems[ds->slot].ready, __ATOMIC_ACQUIRE);
    bool owed = ready == SP_STREAM_POISON ? ds->gave_up_at != 0 && (int64_t)(ds->consumed - ds->gave_up_at) >= 0
                                          : (int64_t)(ready - ds->consumed) < 0;
    return ds->late_writes || owed;
}

static void stream_free(sp_client_t *c, sp_dstream_t *ds)
{
    if (!c->zombie && slot_may_be_written(c, ds)) {
        c->slots_retired |= 1u << ds->slot;
        sp_warn(OP, "client %" PRIu64 ": stream slot %u is not given again: a write to its semaphores may still come",
                c->id, ds->slot);
    }
    c->streams[ds->slot] = NULL;
    c->nstreams--;
    sp_gpu_lane_close(ds->lane);
    free(ds->win);
    free(ds);
}

/* ---------------------------------------------------------------- open, close */

/* The seqs a stream's window holds: the most ops one client has in flight, and one. */
static uint32_t window_size(const sp_client_t *c)
{
    uint32_t n = 1;
    while (n < c->layout.cq_entries + 1)
        n *= 2;
    return n;
}

/* A stream at `slot` on GPU dev: its lane, its window, the semaphore page
 * registered with dev where it is not yet. Its timeline is the caller's to set. */
static spc_status_t stream_make(sp_client_t *c, int dev, uint32_t slot, sp_dstream_t **ds_p, sp_err_t *e)
{
    spc_status_t st;
    if (c->sems_registered == NULL) {
        st = sp_gpu_host_register(dev, c->v.sems, SP_PAGE, &c->sems_dptr, e);
        if (st != SPC_OK)
            return st;
        c->sems_registered = c->v.sems;
    }
    sp_dstream_t *ds = calloc(1, sizeof *ds);
    uint32_t n = window_size(c);
    if (ds == NULL || (ds->win = calloc(n, sizeof *ds->win)) == NULL) {
        free(ds);
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    }
    if ((st = sp_gpu_lane_open(dev, &ds->lane, e)) != SPC_OK) {
        free(ds->win);
        free(ds);
        return st;
    }
    ds->slot = slot;
    ds->gpu = dev;
    ds->win_mask = n - 1;
    c->streams[slot] = ds;
    c->nstreams++;
    *ds_p = ds;
    return SPC_OK;
}

spc_status_t sp_stream_open(sp_engine_t *eng, sp_client_t *c, const char *pci_bus_id, const uint8_t *uuid,
                            int client_ordinal, uint32_t *slot_p, sp_err_t *e)
{
    int dev;
    sp_dstream_t *ds;

    if (c->v.sems == NULL)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "a control-only client has no stream semaphores");
    spc_status_t st = sp_gpu_stream_device(pci_bus_id, uuid, client_ordinal, &dev, e);
    if (st != SPC_OK)
        return st;
    uint32_t slot = 0;
    while (slot < SP_STREAMS_MAX && (c->streams[slot] != NULL || (c->slots_retired >> slot & 1)))
        slot++;
    if (slot == SP_STREAMS_MAX)
        return sp_err_set(e, SPC_ERR_LIMIT, "this client has %u streams and %u slots retired (a late write may still "
                          "reach them), of the %d one may have", c->nstreams,
                          (unsigned)__builtin_popcount(c->slots_retired), SP_STREAMS_MAX);
    if ((st = stream_make(c, dev, slot, &ds, e)) != SPC_OK)
        return st;
    /* A fresh timeline: whatever an earlier stream of this slot left is gone. */
    c->v.sems[slot].ready = 0;
    store_done(c, ds, 0);
    sp_info(OP, "client %" PRIu64 ": stream %u on GPU %d", c->id, slot, dev);
    *slot_p = slot;
    return SPC_OK;
}

static bool advance(sp_engine_t *eng, sp_client_t *c, sp_dstream_t *ds);

/* Takes the seqs next in turn that a stream taken back says are settled as
 * failed ops, which owe only their done, in order. */
static void take_settled(sp_dstream_t *ds)
{
    while (ds->consumed - ds->started < ds->win_mask) {
        sp_stream_slot_t *s = &ds->win[(ds->consumed + 1) & ds->win_mask];
        if (!s->settled)
            return;
        ds->consumed++;
        *s = (sp_stream_slot_t){ .failed = true };
    }
}

/*
 * The stream of a client taken over keeps the timeline it had: the client's
 * CUDA stream waits on it. Its next op is the one after the page's done; the
 * client submits again the ops past it still in flight, and the others, which
 * the spd before failed without running (the client took their completions),
 * are failed here in their turn, their done written in order. A stream that
 * spd gave up on (a poisoned ready or done) comes back broken, its done
 * poisoned: nothing waits on it.
 */
spc_status_t sp_stream_resume(sp_engine_t *eng, sp_client_t *c, const char *pci_bus_id, const uint8_t *uuid,
                              int client_ordinal, uint32_t slot, uint64_t ready, uint64_t done,
                              const uint64_t *settled, size_t nsettled, sp_err_t *e)
{
    int dev;
    sp_dstream_t *ds;

    if (c->v.sems == NULL)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "a control-only client has no stream semaphores");
    if (slot >= SP_STREAMS_MAX || c->streams[slot] != NULL || (c->slots_retired >> slot & 1))
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "stream slot %u is not free to be taken back", slot);
    /* Read once: the client's CUDA stream may write ready meanwhile, nobody else anything. */
    uint64_t page_ready = __atomic_load_n(&c->v.sems[slot].ready, __ATOMIC_ACQUIRE);
    uint64_t page_done = __atomic_load_n(&c->v.sems[slot].done, __ATOMIC_ACQUIRE);
    bool given_up = ((page_ready | page_done) & SP_STREAM_POISON) != 0;
    /* Past the client's: a last write of the old spd's GPU work as it went,
     * after the client settled its ops. It goes on from its own; those ops
     * run again, as an op taken does. */
    if (!given_up && (done & SP_STREAM_POISON || (int64_t)(page_done - done) < 0))
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "stream %u: its page says done %" PRIu64 ", the client %" PRIu64,
                          slot, page_done, done);
    uint32_t win = window_size(c);
    for (size_t i = 0; i < nsettled && !given_up; i++)
        if (settled[i] <= (i > 0 ? settled[i - 1] : done) || settled[i] - done >= win)
            return sp_err_set(e, SPC_ERR_INVALID_ARG, "stream %u: settled op %" PRIu64 " is not past the one "
                              "before and within %u of done %" PRIu64, slot, settled[i], win - 1, done);
    spc_status_t st = sp_gpu_stream_device(pci_bus_id, uuid, client_ordinal, &dev, e);
    if (st != SPC_OK)
        return st;
    if ((st = stream_make(c, dev, slot, &ds, e)) != SPC_OK)
        return st;
    ds->consumed = ds->started = done;
    if (given_up) {
        stream_break(c, ds, "the spd before gave up on it");   /* nothing of it runs: done poisoned now */
    } else {
        for (size_t i = 0; i < nsettled; i++)
            ds->win[settled[i] & ds->win_mask].settled = true;
        take_settled(ds);
        advance(eng, c, ds);   /* the done owed for those first */
    }
    sp_info(OP, "client %" PRIu64 ": stream %u on GPU %d taken back at done %" PRIu64 " (ready %" PRIu64 ", done %"
            PRIu64 " in its page), %zu ops after it settled%s", c->id, slot, dev, done, ready, page_done, nsettled,
            given_up ? "; broken: the spd before gave up on it" : "");
    return SPC_OK;
}

spc_status_t sp_stream_close(sp_engine_t *eng, sp_client_t *c, uint32_t slot, sp_err_t *e)
{
    sp_dstream_t *ds = slot < SP_STREAMS_MAX ? c->streams[slot] : NULL;
    if (ds == NULL || ds->closing)
        return sp_err_set(e, SPC_ERR_NOT_FOUND, "no stream %u", slot);
    if (ds->started == ds->consumed && ds->nflight == 0) {
        stream_free(c, ds);
    } else {
        /* Its ops run to their end; the last one to finish frees it. */
        ds->closing = true;
        stream_break(c, ds, "the stream was destroyed with ops in flight");
    }
    return SPC_OK;
}

/* ---------------------------------------------------------------- taking ops */

void sp_stream_consume(sp_engine_t *eng, sp_op_t *op)
{
    sp_client_t *c = op->client;
    sp_dstream_t *ds = op_stream(op);

    if (ds == NULL || ds->closing) {
        sp_err_set(&op->local, SPC_ERR_INVALID_ARG, "the op names stream %u, which this client does not have",
                   op->sqe.stream - 1);
        return;
    }
    take_settled(ds);
    if (op->sqe.stream_seq != ds->consumed + 1) {
        /* Only a broken client library does this; the stream's order is lost. */
        sp_err_set(&op->local, SPC_ERR_INVALID_ARG, "stream %u: op seq %" PRIu64 " where %" PRIu64 " was next",
                   ds->slot, op->sqe.stream_seq, ds->consumed + 1);
        stream_break(c, ds, op->local.msg);
        return;
    }
    if (ds->consumed - ds->started >= ds->win_mask) {
        /* Ops that failed at once free their completions but keep their places
         * until the ones before them start: the window is full. */
        sp_err_set(&op->local, SPC_ERR_LIMIT, "stream %u: %u ops wait for an earlier one to start", ds->slot,
                   ds->win_mask);
        stream_break(c, ds, op->local.msg);
        return;
    }
    ds->consumed++;
    ds->win[ds->consumed & ds->win_mask] = (sp_stream_slot_t){ 0 };
    op->in_window = true;
    take_settled(ds);   /* those after it settle once it has started */
    if (ds->broken) {
        sp_err_set(&op->local, SPC_ERR_CANCELED, "stream %u is broken: %s", ds->slot, ds->broken_detail);
    }
}

void sp_stream_validate(sp_op_t *op)
{
    sp_dstream_t *ds = op_stream(op);
    if (op->local.status != SPC_OK)
        return;
    if (!op->device) {
        sp_err_set(&op->local, SPC_ERR_INVALID_ARG, "%s on stream %u: stream-ordered ops take GPU memory (host-memory "
                   "ops never follow a stream)", sp_op_name(op->sqe.opcode), ds->slot);
    } else if (op->gpu != ds->gpu) {
        sp_err_set(&op->local, SPC_ERR_INVALID_ARG, "%s: its tensors are on GPU %d and its stream %u on GPU %d",
                   sp_op_name(op->sqe.opcode), op->gpu, ds->slot, ds->gpu);
    }
}

/* ---------------------------------------------------------------- starting tasks */

/* Whether every stream rank of t has started everything before its op. */
static bool task_turn(const sp_task_t *t)
{
    for (uint32_t r = 0; r < sp_task_size(t); r++) {
        sp_op_t *op = sp_task_op(t, r);
        sp_dstream_t *ds = op_stream(op);
        if (ds != NULL && op->in_window && ds->started + 1 != op->sqe.stream_seq)
            return false;
    }
    return true;
}

static uint64_t task_timeout_ns(const sp_engine_t *eng, const sp_task_t *t)
{
    uint64_t ms = 0;
    for (uint32_t r = 0; r < sp_task_size(t); r++) {
        sp_op_t *op = sp_task_op(t, r);
        uint64_t m = op->sqe.timeout_ms ? op->sqe.timeout_ms : eng->cfg->op_timeout_ms;
        if (m > ms)
            ms = m;
    }
    return ms * 1000000ull;
}

/* op's seq has started on its stream: out of the window, into the flight list. */
static void take_place(sp_engine_t *eng, sp_op_t *op, sp_dstream_t *ds)
{
    uint64_t seq = op->sqe.stream_seq;
    ds->win[seq & ds->win_mask] = (sp_stream_slot_t){ 0 };
    ds->started = seq;
    ds->ops++;
    op->started = true;
    uint32_t i = (ds->flight_head + ds->nflight) % SP_GPU_FLIGHT_MAX;
    ds->flight_seq[i] = seq;
    ds->flight_owed[i] = 0;
    ds->nflight++;
    eng->gpu_sched->stream_ops++;
}

static void flight_add(sp_engine_t *eng, sp_task_t *t, sp_gpu_mark_t *mark, int dev, sp_gpu_mark_t *const *joined,
                       uint32_t njoined, sp_gpu_hstage_t *staged)
{
    sp_gpu_sched_t *gs = eng->gpu_sched;
    sp_gpu_flight_t *f = &gs->flight[gs->nflight++];
    *f = (sp_gpu_flight_t){ .task = t, .mark = mark, .gpu = dev, .njoined = njoined, .staged = staged,
                            .deadline_ns = sp_now_ns() + task_timeout_ns(eng, t) };
    for (uint32_t k = 0; k < njoined; k++)
        f->joined[k] = joined[k];
}

/* An op across daemons (see the top): its ranks' places taken here, the rest on the NCCL thread. */
static void xdev_start(sp_engine_t *eng, sp_task_t *t)
{
    bool streamed = false, given_up = false;
    fail_if_given_up(eng, t);
    for (uint32_t r = 0; r < sp_task_size(t); r++) {
        sp_op_t *op = sp_task_op(t, r);
        sp_dstream_t *ds = op_stream(op);
        if (ds == NULL || !op->in_window)
            continue;
        given_up = given_up || op_given_up(op);
        sp_task_xdev_stream(t, sem_dptr(op->client, ds->slot, false), sem_dptr(op->client, ds->slot, true),
                            op->sqe.stream_seq);
        take_place(eng, op, ds);
        ds->last_mark = NULL;   /* its ops' order holds through the semaphores */
        streamed = true;
    }
    if (given_up)
        sp_task_xdev_give_up(t);
    if (streamed)
        flight_add(eng, t, NULL, sp_task_gpu(t), NULL, 0, NULL);
    sp_task_xdev_submit(eng, t);   /* may hand it back at once */
}

/* The GPUs t runs on: its first rank's, where it completes, then the other
 * ranks' in rank order. Returns how many. */
static uint32_t task_gpus(const sp_task_t *t, int *gpus)
{
    uint32_t n = 0;
    gpus[n++] = sp_task_gpu(t);
    for (uint32_t r = 0; r < sp_task_size(t); r++) {
        const int g = sp_task_op(t, r)->gpu;
        bool seen = false;
        for (uint32_t k = 0; k < n && !seen; k++)
            seen = gpus[k] == g;
        if (!seen)
            gpus[n++] = g;
    }
    return n;
}

/* The lane of t's first stream rank on GPU gpu; NULL (the device's own
 * stream) where none is, as for host-synchronous tasks. */
static sp_gpu_lane_t *task_lane(const sp_task_t *t, int gpu)
{
    for (uint32_t r = 0; r < sp_task_size(t); r++) {
        sp_op_t *op = sp_task_op(t, r);
        sp_dstream_t *ds = op_stream(op);
        if (ds != NULL && op->in_window && ds->gpu == gpu)
            return ds->lane;
    }
    return NULL;
}

/*
 * Puts t on the daemon's lanes of its GPUs: on each, the ranks' ready waits
 * (every GPU's kernels read every rank's input) and that GPU's kernels; then,
 * on its first rank's GPU, a wait for every other GPU's part, the ranks' done
 * writes and a mark. So no rank's done is written while any GPU still reads
 * its input, and the mark says the whole task has run. The done writes go on
 * even when an earlier step failed, so the ranks' streams move on; the error
 * travels in the completion. On one GPU: its waits, kernels, done writes, mark.
 */
static void task_start(sp_engine_t *eng, sp_task_t *t)
{
    const uint32_t P = sp_task_size(t);
    int gpus[SP_TOPO_MAX_GPUS];
    sp_gpu_lane_t *lanes[SP_TOPO_MAX_GPUS];
    sp_gpu_mark_t *joined[SP_TOPO_MAX_GPUS];
    uint32_t njoined = 0;
    sp_gpu_hstage_t *staged = NULL;
    sp_err_t e = SP_ERR_INIT;
    spc_status_t st = SPC_OK;

    if (sp_task_xdev(t)) {
        xdev_start(eng, t);
        return;
    }
    fail_if_given_up(eng, t);

    const uint32_t ngpus = task_gpus(t, gpus);
    const int dev = gpus[0];
    for (uint32_t k = 0; k < ngpus; k++) {
        lanes[k] = task_lane(t, gpus[k]);
        sp_gpu_use_lane(gpus[k], lanes[k]);
    }
    for (uint32_t k = 0; k < ngpus; k++) {
        for (uint32_t r = 0; r < P && st == SPC_OK; r++) {
            sp_op_t *op = sp_task_op(t, r);
            sp_dstream_t *ds = op_stream(op);
            if (ds != NULL && op->in_window && ds->last_mark != NULL && ds->lane != lanes[k])
                st = sp_gpu_wait_mark(gpus[k], ds->last_mark, &e);   /* its stream's previous op, elsewhere */
        }
        for (uint32_t r = 0; r < P && st == SPC_OK; r++) {
            sp_op_t *op = sp_task_op(t, r);
            sp_dstream_t *ds = op_stream(op);
            if (ds != NULL && op->in_window)
                st = sp_gpu_wait_value(gpus[k], sem_dptr(op->client, ds->slot, false), op->sqe.stream_seq, &e);
        }
    }
    if (st != SPC_OK)
        sp_task_fail(t, st, UINT32_MAX, e.msg);
    else if (sp_task_status(t) == SPC_OK)   /* not a rank given up on */
        sp_devplan_enqueue(t, &staged);
    for (uint32_t k = 1; k < ngpus; k++) {
        if (sp_gpu_mark(gpus[k], &joined[njoined], &e) != SPC_OK) {
            sp_task_fail(t, SPC_ERR_DEVICE, UINT32_MAX, e.msg);   /* that GPU's context is gone */
            continue;
        }
        if (sp_gpu_wait_mark(dev, joined[njoined++], &e) != SPC_OK)
            sp_task_fail(t, SPC_ERR_DEVICE, UINT32_MAX, e.msg);
    }
    for (uint32_t r = 0; r < P; r++) {
        sp_op_t *op = sp_task_op(t, r);
        sp_dstream_t *ds = op_stream(op);
        if (ds == NULL || !op->in_window)
            continue;
        take_place(eng, op, ds);
        if (sp_gpu_write_value(dev, sem_dptr(op->client, ds->slot, true), op->sqe.stream_seq, &e) != SPC_OK) {
            sp_task_fail(t, SPC_ERR_DEVICE, UINT32_MAX, e.msg);
            stream_break(op->client, ds, e.msg);   /* poisoned once this task is off the stream */
        }
    }
    sp_gpu_mark_t *mark = NULL;
    if (sp_gpu_mark(dev, &mark, &e) != SPC_OK)
        sp_task_fail(t, SPC_ERR_DEVICE, UINT32_MAX, e.msg);   /* the context is gone: nothing of it runs */
    for (uint32_t k = 0; k < ngpus; k++)
        sp_gpu_use_lane(gpus[k], NULL);
    eng->gpu_sched->multi_ops += ngpus > 1;
    eng->gpu_sched->staged_ops += staged != NULL;
    for (uint32_t r = 0; r < P; r++) {
        sp_op_t *op = sp_task_op(t, r);
        sp_dstream_t *ds = op_stream(op);
        if (ds != NULL && op->started)
            ds->last_mark = mark;
    }
    flight_add(eng, t, mark, dev, joined, njoined, staged);
}

static void parked_remove(sp_engine_t *eng, const sp_task_t *t)
{
    sp_gpu_sched_t *gs = eng->gpu_sched;
    for (uint32_t i = 0; i < gs->nparked; i++) {
        if (gs->parked[i].task == t) {
            memmove(&gs->parked[i], &gs->parked[i + 1], (gs->nparked - i - 1) * sizeof gs->parked[0]);
            gs->nparked--;
            return;
        }
    }
}

/* Takes t out of its ranks' windows (it will not start). */
static void unpark(sp_engine_t *eng, sp_task_t *t)
{
    for (uint32_t r = 0; r < sp_task_size(t); r++) {
        sp_op_t *op = sp_task_op(t, r);
        sp_dstream_t *ds = op_stream(op);
        if (ds != NULL && op->in_window && ds->win[op->sqe.stream_seq & ds->win_mask].task == t)
            ds->win[op->sqe.stream_seq & ds->win_mask].task = NULL;
    }
    parked_remove(eng, t);
}

/* Settles what can be settled at the front of a stream's window. */
static bool advance(sp_engine_t *eng, sp_client_t *c, sp_dstream_t *ds)
{
    bool moved = false;
    while (ds->started < ds->consumed) {
        sp_stream_slot_t *s = &ds->win[(ds->started + 1) & ds->win_mask];
        if (s->failed) {
            ds->started++;
            s->failed = false;
            if (ds->nflight == 0)
                store_done(c, ds, ds->started);
            else
                ds->flight_owed[(ds->flight_head + ds->nflight - 1) % SP_GPU_FLIGHT_MAX] = ds->started;
            moved = true;
            continue;
        }
        if (s->task == NULL || eng->gpu_sched->nflight == SP_GPU_FLIGHT_MAX || !task_turn(s->task))
            break;
        sp_task_t *t = s->task;
        parked_remove(eng, t);
        task_start(eng, t);   /* moves ds->started, and the task's other streams' */
        moved = true;
    }
    return moved;
}

static bool advance_list(sp_engine_t *eng, sp_client_t *list)
{
    bool moved = false;
    for (sp_client_t *c = list; c != NULL; c = c->next)
        for (uint32_t i = 0; i < SP_STREAMS_MAX && c->nstreams > 0; i++)
            if (c->streams[i] != NULL && advance(eng, c, c->streams[i]))
                moved = true;
    return moved;
}

/* After a start, a failure or a finish: whatever now may go, goes. A client
 * that is gone but still pinned by a task (a zombie) keeps its streams until
 * then, and others' tasks may wait for their order. */
static void advance_all(sp_engine_t *eng)
{
    sp_gpu_sched_t *gs = eng->gpu_sched;
    if (gs->stopping)
        return;
    while (gs->nheld > 0 && gs->nflight < SP_GPU_FLIGHT_MAX) {
        sp_task_t *t = gs->held[0];
        memmove(gs->held, gs->held + 1, --gs->nheld * sizeof *gs->held);
        task_start(eng, t);
    }
    bool moved;
    do {   /* both lists every round: a stream of one may wait on the other's */
        moved = advance_list(eng, eng->clients);
        moved = advance_list(eng, eng->zombies) || moved;
    } while (moved);
}

static bool grow(void **arr, uint32_t *cap, size_t elem)
{
    uint32_t n = *cap ? 2 * *cap : 16;
    void *p = realloc(*arr, n * elem);
    if (p == NULL)
        return false;
    *arr = p;
    *cap = n;
    return true;
}

void sp_stream_task_ready(sp_engine_t *eng, sp_task_t *t)
{
    sp_gpu_sched_t *gs = eng->gpu_sched;
    bool streamed = false;
    for (uint32_t r = 0; r < sp_task_size(t); r++) {
        sp_op_t *op = sp_task_op(t, r);
        sp_dstream_t *ds = op_stream(op);
        if (ds != NULL && op->in_window) {
            ds->win[op->sqe.stream_seq & ds->win_mask].task = t;
            streamed = true;
        }
    }
    if (!streamed && sp_task_xdev(t)) {
        sp_task_xdev_submit(eng, t);   /* host-synchronous: the NCCL thread completes it */
        return;
    }
    if (!streamed && gs->nflight < SP_GPU_FLIGHT_MAX) {
        task_start(eng, t);
        return;
    }
    bool room = streamed ? gs->nparked < gs->parked_cap ||
                           grow((void **)&gs->parked, &gs->parked_cap, sizeof *gs->parked)
                         : gs->nheld < gs->held_cap || grow((void **)&gs->held, &gs->held_cap, sizeof *gs->held);
    if (!room) {
        if (streamed)
            unpark(eng, t);
        sp_task_abort(eng, t, SPC_ERR_NO_MEMORY, "out of memory queueing a GPU task");
        return;
    }
    if (!streamed) {
        gs->held[gs->nheld++] = t;
        return;
    }
    gs->parked[gs->nparked++] = (sp_gpu_parked_t){ .task = t, .deadline_ns = sp_now_ns() + task_timeout_ns(eng, t) };
    advance_all(eng);
}

void sp_stream_op_unstarted(sp_engine_t *eng, sp_op_t *op)
{
    sp_dstream_t *ds = op_stream(op);
    if (ds == NULL || !op->in_window || op->started)
        return;
    op->in_window = false;
    sp_stream_slot_t *s = &ds->win[op->sqe.stream_seq & ds->win_mask];
    s->task = NULL;
    s->failed = true;
    advance_all(eng);
}

/* ---------------------------------------------------------------- finishing */

/* Gives up on the ranks whose streams have not reached t's op within the
 * timeout. Returns how many; *behind_p: how many others have not reached it
 * yet, their streams held up by an earlier op of spd's until lately. */
static uint32_t give_up_on_ranks(sp_engine_t *eng, sp_task_t *t, uint64_t timeout_ns, uint64_t now,
                                 uint32_t *behind_p)
{
    uint32_t late = 0, behind = 0;
    char why[160];
    for (uint32_t r = 0; r < sp_task_size(t); r++) {
        sp_op_t *op = sp_task_op(t, r);
        sp_dstream_t *ds = op_stream(op);
        if (ds == NULL || !op->in_window)
            continue;
        struct sp_stream_sem *sem = &op->client->v.sems[ds->slot];
        uint64_t ready = __atomic_load_n(&sem->ready, __ATOMIC_ACQUIRE);
        uint64_t done = __atomic_load_n(&sem->done, __ATOMIC_ACQUIRE);
        if ((int64_t)(ready - op->sqe.stream_seq) >= 0)
            continue;
        /* Its stream waits for an earlier op of spd's, held up itself, or has
         * waited for one until less than the timeout ago (the task's own time
         * may be long past by then): not late. */
        if ((int64_t)(done - ready) < 0 || now - ds->done_ns < timeout_ns) {
            behind++;
            continue;
        }
        snprintf(why, sizeof why, "its CUDA stream did not reach %s #%" PRIu64 " within %" PRIu64 " ms (ready is %"
                 PRIu64 ")", sp_op_name(op->sqe.opcode), op->sqe.stream_seq, timeout_ns / 1000000, ready);
        if (late++ == 0)
            sp_task_fail(t, SPC_ERR_TIMEOUT, r, why);
        /* The daemon's stream stops waiting for it; nothing will wait for it again. */
        stream_break(op->client, ds, why);
        poison_ready(eng, op->client, ds);
        eng->gpu_sched->stream_timeouts++;
    }
    *behind_p = behind;
    return late;
}

/* Takes task i off the daemon's streams and completes it. `fault`: its run
 * failed on a GPU (why), whose context then runs nothing more. */
static void flight_finish(sp_engine_t *eng, uint32_t i, const char *fault, uint64_t now)
{
    sp_gpu_sched_t *gs = eng->gpu_sched;
    sp_task_t *t = gs->flight[i].task;
    sp_gpu_mark_t *mark = gs->flight[i].mark;
    for (uint32_t r = 0; r < sp_task_size(t); r++) {
        sp_dstream_t *ds = op_stream(sp_task_op(t, r));
        if (ds != NULL && ds->last_mark == mark && mark != NULL)
            ds->last_mark = NULL;   /* it has run: nothing need wait for it */
    }
    sp_gpu_mark_free(mark);
    for (uint32_t k = 0; k < gs->flight[i].njoined; k++)
        sp_gpu_mark_free(gs->flight[i].joined[k]);
    sp_gpu_hstage_put(gs->flight[i].staged);
    memmove(&gs->flight[i], &gs->flight[i + 1], (gs->nflight - i - 1) * sizeof gs->flight[0]);
    gs->nflight--;

    fail_if_given_up(eng, t);   /* its waits passed on a poisoned ready: its result does not stand */
    for (uint32_t r = 0; r < sp_task_size(t); r++) {
        sp_op_t *op = sp_task_op(t, r);
        sp_client_t *c = op->client;
        sp_dstream_t *ds = op_stream(op);
        if (c != NULL && c->zombie && sp_task_status(t) == SPC_OK) {
            /* Its stream was released without its input: nobody's result holds. */
            char why[96];
            snprintf(why, sizeof why, "rank %u (pid %d) was lost while the op ran", r, (int)c->pid);
            sp_task_fail(t, SPC_ERR_PEER_LOST, UINT32_MAX, why);
        }
        if (ds == NULL || !op->started)
            continue;
        ds->done_ns = now;
        /* The stream's tasks run in its order: this is the oldest of them. An
         * op across daemons whose lane never wrote done (it failed first)
         * owes it here; nothing later of the stream can have run. So does a
         * task whose GPU faulted: its lane stopped there, before the done
         * writes, and the rank's stream would wait for ever. The stream is
         * broken: what follows it on that GPU cannot run. */
        if ((sp_task_xdev(t) && !sp_task_xdev_wrote_done(t)) || fault != NULL)
            store_done(c, ds, op->sqe.stream_seq);
        if (fault != NULL)
            stream_break(c, ds, fault);
        if (sp_task_xdev(t) && sp_task_xdev_leaks(t)) {
            stream_break(c, ds, "an op across daemons failed and its NCCL stream did not drain");
            ds->late_writes = true;   /* its done, and so its slot and page, may still be written */
            c->sems_kept = true;
        }
        uint64_t owed = ds->flight_owed[ds->flight_head];
        ds->flight_head = (ds->flight_head + 1) % SP_GPU_FLIGHT_MAX;
        ds->nflight--;
        if (owed != 0)
            store_done(c, ds, owed);
        if (ds->broken && ds->nflight == 0)
            store_done(c, ds, SP_STREAM_POISON);
        /* Given back while this ran: it goes now, before the task lets go of
         * its client (a gone client's last unpin frees its streams itself). */
        if (ds->closing && ds->nflight == 0 && ds->started == ds->consumed)
            stream_free(c, ds);
    }
    sp_task_finish(eng, t);   /* its ops have started: none of them looks at its stream */
}

/* Whether t is the oldest task in flight of each of its streams: the tasks of
 * a stream finish in its order even where a later one is seen done first. */
static bool oldest_of_its_streams(const sp_task_t *t)
{
    for (uint32_t r = 0; r < sp_task_size(t); r++) {
        sp_op_t *op = sp_task_op(t, r);
        sp_dstream_t *ds = op_stream(op);
        if (ds != NULL && op->started && ds->flight_seq[ds->flight_head] != op->sqe.stream_seq)
            return false;
    }
    return true;
}

int sp_stream_poll(sp_engine_t *eng, uint64_t now)
{
    sp_gpu_sched_t *gs = eng->gpu_sched;
    int done = 0;
    sp_err_t e = SP_ERR_INIT;

    /* Lanes run independently: every task in flight is looked at. */
    for (uint32_t i = 0; i < gs->nflight;) {
        sp_gpu_flight_t *f = &gs->flight[i];
        int ran = f->forced                ? 1
                  : sp_task_xdev(f->task) ? sp_task_xdev_back(f->task)
                  : f->mark != NULL       ? sp_gpu_mark_done(f->mark, &e)
                                          : 1;
        /* Its first GPU waits for the others' parts: one whose stream failed
         * would hold it for ever, or let it pass (a failed context's events
         * are never reached), so their failures are looked for too. */
        for (uint32_t k = 0; k < f->njoined && ran >= 0; k++)
            if (sp_gpu_mark_done(f->joined[k], &e) < 0)
                ran = -1;
        if (ran != 0 && !oldest_of_its_streams(f->task)) {
            i++;   /* an older task of one of its streams finishes first, next pass */
            continue;
        }
        if (ran == 0) {
            if (now >= f->deadline_ns) {
                uint64_t timeout = task_timeout_ns(eng, f->task);
                uint32_t behind;
                if (give_up_on_ranks(eng, f->task, timeout, now, &behind) == 0 && behind == 0 && !f->warned) {
                    sp_warn(OP, "a task on GPU %d has run for over %" PRIu64 " ms with every rank's stream there",
                            f->gpu, timeout / 1000000);
                    f->warned = true;
                }
                f->deadline_ns = now + timeout;
            }
            i++;
            continue;
        }
        if (ran < 0)
            sp_task_fail(f->task, SPC_ERR_DEVICE, UINT32_MAX, e.msg);
        flight_finish(eng, i, ran < 0 ? e.msg : NULL, now);   /* i now names the next one */
        done++;
    }
    /* A task that waited its timeout for its turn: some rank's stream has an op
     * before it that never starts (ranks that order ops differently on their
     * streams would otherwise wait on each other for ever). */
    for (uint32_t i = 0; i < gs->nparked; i++) {
        if (now < gs->parked[i].deadline_ns)
            continue;
        sp_task_t *t = gs->parked[i].task;
        char why[200];
        uint32_t late = 0;
        for (uint32_t r = 0; r < sp_task_size(t); r++) {
            sp_op_t *op = sp_task_op(t, r);
            sp_dstream_t *ds = op_stream(op);
            if (ds != NULL && op->in_window && ds->started + 1 != op->sqe.stream_seq) {
                late = r;
                break;
            }
        }
        snprintf(why, sizeof why, "its stream still has ops before this one that have not started after %" PRIu64
                 " ms (do the ranks submit their stream's ops in the same order?)", task_timeout_ns(eng, t) / 1000000);
        unpark(eng, t);
        gs->stream_timeouts++;
        sp_task_fail(t, SPC_ERR_TIMEOUT, late, why);
        sp_task_finish(eng, t);   /* its ops settle their seqs: others may go now */
        done++;
        i = UINT32_MAX;           /* the list changed under us: again from the start */
    }
    if (done > 0)
        advance_all(eng);
    return done;
}

/* ---------------------------------------------------------------- ends */

void sp_stream_client_gone(sp_engine_t *eng, sp_client_t *c)
{
    for (uint32_t i = 0; i < SP_STREAMS_MAX && c->nstreams > 0; i++) {
        sp_dstream_t *ds = c->streams[i];
        if (ds == NULL)
            continue;
        /* Tasks of it already on the daemon's stream must not wait for it. */
        stream_break(c, ds, "the client is gone");
        poison_ready(eng, c, ds);
    }
}

void sp_stream_client_free(sp_client_t *c)
{
    for (uint32_t i = 0; i < SP_STREAMS_MAX; i++) {
        if (c->streams[i] != NULL) {
            sp_gpu_lane_close(c->streams[i]->lane);
            free(c->streams[i]->win);
            free(c->streams[i]);
            c->streams[i] = NULL;
        }
    }
    /* A page still registered is one no device write can fault on. */
    if (c->sems_registered != NULL && c->sems_kept)
        sp_warn(OP, "client %" PRIu64 ": its stream semaphores stay registered until spd exits: an NCCL stream that "
                "did not drain may still write them", c->id);
    else if (c->sems_registered != NULL)
        sp_gpu_host_unregister(c->sems_registered);
    c->sems_registered = NULL;
}

bool sp_stream_busy(sp_engine_t *eng)
{
    return eng->gpu_sched->nflight + eng->gpu_sched->nparked > 0;
}

void sp_stream_shutdown(sp_engine_t *eng)
{
    sp_gpu_sched_t *gs = eng->gpu_sched;
    gs->stopping = true;
    for (sp_client_t *c = eng->clients; c != NULL; c = c->next)
        sp_stream_client_gone(eng, c);
    /* Parked and held tasks never start. */
    while (gs->nparked > 0) {
        sp_task_t *t = gs->parked[gs->nparked - 1].task;
        unpark(eng, t);
        sp_task_abort(eng, t, SPC_ERR_SHUTTING_DOWN, "spd is shutting down");
    }
    while (gs->nheld > 0)
        sp_task_abort(eng, gs->held[--gs->nheld], SPC_ERR_SHUTTING_DOWN, "spd is shutting down");
}

void sp_stream_stop(sp_engine_t *eng)
{
    sp_gpu_sched_t *gs = eng->gpu_sched;
    /* Every wait was poisoned: what is on the daemon's streams runs out. */
    for (int i = 0; i < 2000 && gs->nflight > 0; i++) {
        sp_stream_poll(eng, sp_now_ns());
        if (gs->nflight > 0)
            usleep(1000);
    }
    while (gs->nflight > 0) {
        sp_warn(OP, "a GPU task still runs as spd exits");
        sp_gpu_mark_free(gs->flight[0].mark);
        gs->flight[0].mark = NULL;
        for (uint32_t k = 0; k < gs->flight[0].njoined; k++)
            sp_gpu_mark_free(gs->flight[0].joined[k]);
        gs->flight[0].njoined = 0;
        gs->flight[0].staged = NULL;   /* still read, perhaps: kept out of reuse */
        gs->flight[0].forced = true;   /* taken as run */
        sp_stream_poll(eng, sp_now_ns());
    }
}

void sp_stream_cleanup(sp_engine_t *eng)
{
    sp_gpu_sched_t *gs = eng->gpu_sched;
    free(gs->held);
    free(gs->parked);
    free(gs);
    eng->gpu_sched = NULL;
}

sp_gpu_counts_t sp_gpu_counts(const sp_engine_t *eng)
{
    sp_gpu_counts_t n = { 0 };
    for (const sp_client_t *c = eng->clients; c != NULL; c = c->next)
        n.streams += c->nstreams;   /* a gone client's streams go with it */
    const sp_gpu_sched_t *gs = eng->gpu_sched;
    if (gs != NULL) {
        n.imports = gs->imports;
        n.imports_total = gs->imports_total;
        n.reimports = gs->reimports;
        n.stream_ops = gs->stream_ops;
        n.stream_timeouts = gs->stream_timeouts;
        n.multi_ops = gs->multi_ops;
        n.staged_ops = gs->staged_ops;
        n.tasks = gs->nflight + gs->nparked;
    }
    for (int i = 0; i < SP_TOPO_MAX_GPUS; i++)
        n.gpus_failed += sp_gpu_fault(i) != NULL;
    sp_gpu_lane_counts(&n.lanes, &n.lanes_max, &n.lanes_refused);
    return n;
}
