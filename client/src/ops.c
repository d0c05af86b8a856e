/*
 * ops.c — libspclient's data plane: submit, reap, test and wait.
 *
 * Submit writes an SQ entry and its argument slot, publishes the tail, and wakes
 * the daemon (its wake eventfd) only if the progress thread said it sleeps. Wait reaps the
 * CQ, spins for SPC_SPIN_US, then sleeps on the segment's cq_futex in slices of
 * at most 50 ms; between slices it checks that the daemon is still there, so a
 * dead daemon is reported within a slice, never as a hang.
 */
#include <errno.h>
#include <inttypes.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

#include "internal.h"
#include "sp_futex.h"
#include "sp_ulysses.h"

#define WAIT_SLICE_NS (50ull * 1000000ull)
/* A request that moves this many bytes takes tens of microseconds in spd: its
 * waiter sleeps at once instead of spinning, leaving the CPUs to the copy. */
#define WAIT_SLEEP_BYTES (16u << 20)

/* ================================================================ requests */

static spc_request_t *req_get(spc_handle_t *h)
{
    if (h->free_head == UINT32_MAX)
        return NULL;
    spc_request_t *r = &h->reqs[h->free_head];
    h->free_head = r->next_free;
    r->gen++;
    r->state = REQ_INFLIGHT;
    r->status = SPC_IN_PROGRESS;
    r->detail[0] = '\0';
    r->stream = NULL;
    h->inflight++;
    return r;
}

static void req_put(spc_handle_t *h, spc_request_t *r)
{
    r->state = REQ_FREE;
    r->next_free = h->free_head;
    h->free_head = r->index;
}

void spc__req_finish(spc_handle_t *h, spc_request_t *r, spc_status_t st, const char *detail)
{
    h->inflight--;
    if (r->stream != NULL) {
        spc__stream_completed(r->stream, st, detail);
        r->stream = NULL;
    }
    if (r->state == REQ_ORPHAN) {
        req_put(h, r);
        return;
    }
    r->state = REQ_DONE;
    r->status = st;
    if (detail != NULL)
        snprintf(r->detail, sizeof r->detail, "%s", detail);
}

void spc__fail_all_inflight(spc_handle_t *h, spc_status_t st, const char *detail)
{
    for (uint32_t i = 0; i < h->layout.cq_entries; i++) {
        spc_request_t *r = &h->reqs[i];
        if (r->state == REQ_INFLIGHT || r->state == REQ_ORPHAN)
            spc__req_finish(h, r, st, detail);
    }
}

/* ================================================================ completions */

void spc__reap(spc_handle_t *h)
{
    if (h->seg == NULL)
        return;
    /* Acquire: the entries (and detail text) the daemon wrote before publishing
     * its tail are visible. */
    uint32_t tail = sp_load_acquire(&h->v.cq->tail);
    uint32_t n = tail - h->cq_head;
    if (n == 0)
        return;
    if (n > h->layout.cq_entries)
        n = h->layout.cq_entries;   /* never trust a distance beyond the ring */
    for (uint32_t k = 0; k < n; k++) {
        uint32_t idx = h->cq_head & h->cq_mask;
        struct sp_cqe cqe = h->v.cqes[idx];
        const char *detail = (cqe.flags & SP_CQE_F_DETAIL) ? h->v.cq_detail + (size_t)idx * SP_DETAIL_BYTES : NULL;
        uint32_t ri = (uint32_t)cqe.user_data, gen = (uint32_t)(cqe.user_data >> 32);
        if (ri < h->layout.cq_entries) {
            spc_request_t *r = &h->reqs[ri];
            if (r->gen == gen && (r->state == REQ_INFLIGHT || r->state == REQ_ORPHAN)) {
                char text[SP_DETAIL_BYTES];
                if (detail != NULL) {
                    memcpy(text, detail, sizeof text);
                    text[sizeof text - 1] = '\0';
                }
                spc__req_finish(h, r, (spc_status_t)cqe.status, detail ? text : NULL);
            }
        }
        h->cq_head++;
    }
    /* Release: our reads of the entries are done before the daemon may reuse them. */
    sp_store_release(&h->v.cq->head, h->cq_head);
    /* Completions may be queued in the daemon for want of the room we just made;
     * if its progress thread sleeps, tell it. (Barrier: head store before flag load.) */
    sp_smp_mb();
    if (sp_load_relaxed(&h->v.wake->sq_need_wakeup))
        spc__wake_daemon(h);
}

bool spc__daemon_alive(spc_handle_t *h)
{
    if (h->lost)
        return false;
    bool gone = false;
    const char *why = "";
    if (h->seg != NULL && sp_load_acquire(&h->v.wake->daemon_state) == SP_DAEMON_GONE) {
        gone = true;
        why = "spd shut down";
    } else {
        char c;
        ssize_t n = recv(h->sock, &c, 1, MSG_PEEK | MSG_DONTWAIT);
        if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
            gone = true;
            why = "spd closed the connection (daemon exited or was killed)";
        }
    }
    if (!gone)
        return true;
    return spc__conn_lost(h, why);
}

/* ================================================================ submit */

/*
 * An arena tensor's extent is what its allocation holds from where it starts:
 * libspclient alone knows the allocations (spd sees one arena), so it declares
 * no more than that, and spd, which knows what the op writes, refuses an op
 * that needs more, on every rank, with the tensor and both sizes. A tensor in
 * no live allocation (freed, or never allocated) names nothing; it is refused
 * here.
 */
static spc_status_t arena_extent(spc_handle_t *h, uint32_t i, struct sp_tensor_ref *ref)
{
    uint64_t start, asked;
    if (ref->bytes == 0)
        return SPC_OK;   /* an empty side of an uneven all-to-all: it names nothing */
    if (!spc__arena_find(&h->arena, ref->offset, &start, &asked))
        return spc__fail(h, SPC_ERR_BAD_REGION, "tensor %u at arena offset %llu is in no live allocation "
                         "(spc_free'd, or never returned by spc_alloc)", i, (unsigned long long)ref->offset);
    uint64_t room = start + asked - ref->offset;
    if (ref->bytes > room)
        ref->bytes = room;
    return SPC_OK;
}

/* Resolves tensor i to (region, offset, extent); *device says whether it is GPU memory. */
static spc_status_t resolve(spc_handle_t *h, uint32_t i, const spc_tensor_t *t, uint64_t need,
                            struct sp_tensor_ref *ref, bool *device)
{
    memset(ref, 0, sizeof *ref);
    ref->bytes = t->bytes ? t->bytes : need;
    *device = false;
    if (t->ptr == NULL) {
        ref->region = t->region;
        ref->offset = t->offset;
        if (t->region == SP_REGION_ARENA)
            return arena_extent(h, i, ref);
        for (uint32_t k = 0; k < h->nregions; k++)
            if (h->regions[k].id == t->region)
                *device = h->regions[k].device;
        return SPC_OK;
    }
    uintptr_t p = (uintptr_t)t->ptr;
    uintptr_t arena = (uintptr_t)h->v.arena;
    if (p >= arena && p - arena < h->layout.arena_bytes) {
        ref->region = SP_REGION_ARENA;
        ref->offset = p - arena;
        return arena_extent(h, i, ref);
    }
    /* A registered region is spd's to check: it knows each one's length. */
    for (uint32_t k = 0; k < h->nregions; k++) {
        const spc__region_t *r = &h->regions[k];
        if (p >= r->addr && p - r->addr < r->length) {
            ref->region = r->id;
            ref->offset = p - r->addr;
            *device = r->device;
            return SPC_OK;
        }
    }
    return spc__fail(h, SPC_ERR_BAD_REGION, "pointer %p is neither in the arena nor in a registered region", t->ptr);
}

/*
 * Enqueues on s's CUDA stream its ready write for op s->seq + 1, or its wait
 * for the done of op s->seq, with the handle's lock let go: the driver may
 * block on a full queue, behind a done that only the next spd writes, and the
 * stream watcher must be able to take the client over meanwhile. The caller
 * holds the lock once.
 */
static spc_status_t stream_enqueue(spc_handle_t *h, spc_stream_t *s, bool wait_done)
{
    spc__unlock(h);
    spc_status_t st = wait_done ? spc__cuda_wait64(h, s->ctx, s->cu_stream, s->done_dptr, s->seq)
                                : spc__cuda_write64(h, s->ctx, s->cu_stream, s->ready_dptr, s->seq + 1);
    spc__lock(h);
    return st;
}

/*
 * Queues op, whose tensors are tensors[0, op->ntensors) (at most
 * SP_MAX_TENSORS): the op's own, or an all-to-all's pairs, which may be more
 * than an spc_op_t holds. op's struct_size has been read.
 */
static spc_status_t submit_locked(spc_handle_t *h, const spc_op_t *op, const spc_tensor_t *tensors,
                                  spc_request_t **req_p)
{
    struct sp_tensor_ref refs[SP_MAX_TENSORS];
    spc_status_t st;

    if (req_p == NULL)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "req_p is required");
    if (h->seg == NULL)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "control-only handles cannot submit operations");
    if (h->lost || sp_load_relaxed(&h->v.wake->daemon_state) == SP_DAEMON_GONE) {
        spc__daemon_alive(h);
        return spc__fail(h, SPC_ERR_DAEMON_LOST, "connection to spd was lost");
    }
    const void *params = op->params;
    uint32_t param_bytes = params != NULL ? op->param_bytes : 0;
    uint32_t channel = op->channel;
    /* The argument slot is the segment layout's: layout 4's holds 8 refs and 512 bytes. */
    if (op->ntensors > h->v.slot_tensors)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "%u tensor refs; the segment of spd %s (protocol %u, layout %u) "
                         "holds %u per op", op->ntensors, h->daemon_version, h->protocol, h->layout.version,
                         h->v.slot_tensors);
    if (param_bytes > sp_seg_slot_max_params(&h->v))
        return spc__fail(h, SPC_ERR_INVALID_ARG, "%u parameter bytes; at most %u", param_bytes,
                         sp_seg_slot_max_params(&h->v));
    if (channel >= SPC_CHANNELS)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "channel %u; there are %d", channel, SPC_CHANNELS);
    uint64_t need = op->count * spc_dtype_size(op->dtype), moved = 0;
    spc_region_t device_regions[SP_MAX_TENSORS];
    uint32_t ndevice = 0;
    for (uint32_t i = 0; i < op->ntensors; i++) {
        bool device;
        st = resolve(h, i, &tensors[i], need, &refs[i], &device);
        if (st != SPC_OK)
            return st;
        refs[i].dtype = (uint8_t)op->dtype;
        moved += refs[i].bytes;
        if (device)
            device_regions[ndevice++] = refs[i].region;
    }
    /* Ops on GPU memory follow the current stream, if any. (A mix of host and
     * device tensors goes as it is: spd refuses it with the reason.) */
    spc_stream_t *s = op->ntensors > 0 && ndevice == op->ntensors ? h->cur_stream : NULL;
    if (s != NULL && (s->broken || (h->v.sems[s->slot].done & SP_STREAM_POISON))) {
        spc_stream_query(s);
        return spc__fail(h, s->error != SPC_OK ? s->error : SPC_ERR_CANCELED, "stream %u is broken: %s", s->slot,
                         s->detail);
    }
    /* A graph's replays would repeat this op's ready and done with one seq,
     * and spd would see it once: refused, the stream untouched. */
    if (s != NULL && spc__cuda_capturing(s->ctx, s->cu_stream))
        return spc__fail(h, SPC_ERR_INVALID_ARG, "stream %u is being captured into a CUDA graph: spd's ops are not "
                         "replayable (each is one op of spd's stream order); submit them outside the capture",
                         s->slot);

    /* Back-pressure, two ways: at most cq_entries requests in flight (the daemon
     * must always have room for their completions), and a free SQ slot. Neither
     * is ever overwritten: the caller hears RING_FULL and nothing is queued. A
     * stream op waits for room instead (its caller does not wait for it, so
     * nothing else would make room), as long as the daemon is there. */
    uint64_t room_deadline = 0;
    for (;;) {
        if (h->inflight >= h->layout.cq_entries || h->free_head == UINT32_MAX)
            spc__reap(h);
        bool cq_full = h->inflight >= h->layout.cq_entries || h->free_head == UINT32_MAX;
        bool sq_full = sp_ring_used(h->v.sq, h->sq_tail) >= h->layout.sq_entries;
        if (!cq_full && !sq_full)
            break;
        if (s != NULL && room_deadline == 0)
            room_deadline = spc__now_ns() + (uint64_t)h->timeout_ms * 1000000ull;
        if (s == NULL || spc__now_ns() > room_deadline || !spc__daemon_alive(h)) {
            if (h->lost)
                return spc__fail(h, SPC_ERR_DAEMON_LOST, "connection to spd was lost");
            if (cq_full)
                return spc__fail(h, SPC_ERR_RING_FULL, "%u requests in flight (the completion ring's size); wait "
                                 "for some", h->inflight);
            return spc__fail(h, SPC_ERR_RING_FULL, "submission ring full (%u entries not yet taken by spd)",
                             h->layout.sq_entries);
        }
        sched_yield();
    }
    /* Stream order: the CUDA stream says "ready" when it gets here. Enqueued
     * before the op is published, so a failure leaves nothing behind. */
    if (s != NULL && (st = stream_enqueue(h, s, false)) != SPC_OK)
        return st;
    if (s != NULL) {
        s->seq++;
        /* A take-over while the lock was let go may have filled the SQ with
         * the ops it submitted again. This op's ready is on the stream: it
         * goes, once the new spd has made room. */
        uint64_t deadline = spc__now_ns() + (uint64_t)h->timeout_ms * 1000000ull;
        while (sp_ring_used(h->v.sq, h->sq_tail) >= h->layout.sq_entries && spc__daemon_alive(h) &&
               spc__now_ns() < deadline)
            sched_yield();
        if (h->lost || sp_ring_used(h->v.sq, h->sq_tail) >= h->layout.sq_entries) {
            s->broken = true;   /* its ready is written for an op that never comes */
            if (s->error == SPC_OK) {
                s->error = h->lost ? SPC_ERR_DAEMON_LOST : SPC_ERR_RING_FULL;
                snprintf(s->detail, sizeof s->detail, "op #%llu was not submitted: %s", (unsigned long long)s->seq,
                         h->lost ? "spd was lost" : "no room on the submission ring");
            }
            return spc__fail(h, s->error, "stream %u: %s", s->slot, s->detail);
        }
    }

    spc_request_t *r = req_get(h);
    r->bytes = moved;
    memcpy(r->regions, device_regions, ndevice * sizeof device_regions[0]);
    r->nregions = (uint8_t)ndevice;
    /* The group as this spd names it (another than the caller's after a restart). */
    spc__group_t *g = op->opcode != SPC_OP_NOOP ? spc__group_find(h, op->group) : NULL;
    uint32_t idx = h->sq_tail & h->sq_mask;
    struct sp_sqe *e = &h->v.sqes[idx];
    *e = (struct sp_sqe){
        .opcode = (uint8_t)op->opcode,
        .dtype = (uint8_t)op->dtype,
        .redop = (uint8_t)op->redop,
        .ntensors = (uint8_t)op->ntensors,
        .group = g != NULL ? g->wire : op->group,
        .timeout_ms = op->timeout_ms,
        .user_data = (uint64_t)r->gen << 32 | r->index,
        .count = op->count,
        .flags = op->flags,
        .channel = (uint8_t)channel,
        .root = op->root,
        .param_bytes = param_bytes,
        .stream = s != NULL ? s->slot + 1 : 0,
        .stream_seq = s != NULL ? s->seq : 0,
    };
    if (op->ntensors > 0)
        memcpy(sp_seg_slot_tensor(&h->v, idx), refs, op->ntensors * sizeof refs[0]);
    if (param_bytes > 0)
        memcpy(sp_seg_slot_params(&h->v, idx), params, param_bytes);
    /* Kept to submit again to the next spd, should this one go (resume.c),
     * with the sequence number spd gives it on its group's channel. */
    r->sqe = *e;
    r->sqe.replay_seq = g != NULL ? g->next_seq[channel]++ : 0;
    r->sq_pos = h->sq_tail;
    memcpy(r->refs, refs, op->ntensors * sizeof refs[0]);
    if (param_bytes > 0)
        memcpy(r->params, params, param_bytes);
    h->sq_tail++;
    /* Release: the entry and its arguments are visible before the new tail. */
    sp_store_release(&h->v.sq->tail, h->sq_tail);
    /* Full barrier: our tail store before reading the daemon's sleep flag. The
     * daemon stores its flag, then re-reads our tail; one of us sees the other. */
    sp_smp_mb();
    if (sp_load_relaxed(&h->v.wake->sq_need_wakeup))
        spc__wake_daemon(h);

    if (s != NULL) {
        r->stream = s;
        s->inflight++;
        /* The CUDA stream goes on once spd's stream has run the op. */
        st = stream_enqueue(h, s, true);
        if (st != SPC_OK) {
            /* The op is in spd; the CUDA stream will not wait for it. */
            s->broken = true;
            if (s->error == SPC_OK) {
                s->error = st;
                snprintf(s->detail, sizeof s->detail, "%s", spc_last_error(h));
            }
            spc_request_release(r);   /* its completion still comes, and is dropped */
            return st;
        }
    }
    *req_p = r;
    return SPC_OK;
}

static spc_status_t submit(spc_handle_t *h, const spc_op_t *op, const spc_tensor_t *tensors,
                           spc_request_t **req_p)
{
    spc__lock(h);
    spc_status_t st = submit_locked(h, op, tensors, req_p);
    spc__unlock(h);
    return st;
}

spc_status_t spc_submit(spc_handle_t *h, const spc_op_t *caller_op, spc_request_t **req_p)
{
    spc_op_t op;   /* the caller's op, fields its version predates zero */
    spc_status_t st;

    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    if ((st = spc__struct_read(h, spc_op_t, caller_op, tensors, &op)) != SPC_OK)
        return st;
    if (op.ntensors > SPC_OP_MAX_TENSORS)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "%u tensors; at most %d", op.ntensors, SPC_OP_MAX_TENSORS);
    return submit(h, &op, op.tensors, req_p);
}

/* ================================================================ test and wait */

spc_status_t spc_test(spc_request_t *req)
{
    if (req == NULL)
        return SPC_ERR_INVALID_ARG;
    spc_handle_t *h = req->h;
    spc__lock(h);
    if (req->state == REQ_INFLIGHT) {
        spc__reap(h);
        if (req->state == REQ_INFLIGHT)
            spc__daemon_alive(h);
    }
    if (req->state == REQ_DONE && req->status != SPC_OK)
        spc__fail(h, req->status, "%s", req->detail[0] ? req->detail : spc_status_message(req->status));
    spc_status_t st = req->state == REQ_DONE ? req->status : SPC_IN_PROGRESS;
    spc__unlock(h);
    return st;
}

/*
 * How long a wait spins before it sleeps. A sleeper costs a futex wake-up when
 * its request completes, which on a virtual machine with an idle CPU is tens of
 * microseconds: a request expected to take longer than SPC_SPIN_US spins about
 * as long as its copy should take (0.5 ns a byte: 2 GB/s, slower than any copy
 * we measured), so the wake-up is paid only by the very largest, which sleep at
 * once and leave the CPUs to the copy threads.
 */
static uint64_t spin_budget_ns(const spc_handle_t *h, const spc_request_t *req)
{
    if (req->bytes >= WAIT_SLEEP_BYTES)
        return 0;
    uint64_t base = (uint64_t)h->spin_us * 1000ull, copy = req->bytes / 2;
    return copy > base ? copy : base;
}

void spc__wait_while(spc_request_t *req, uint8_t state, int wait_ms)
{
    spc_handle_t *h = req->h;
    struct sp_wake *wake = h->v.wake;
    uint64_t start = spc__now_ns();
    uint64_t deadline = wait_ms < 0 ? UINT64_MAX : start + (uint64_t)wait_ms * 1000000ull;
    uint64_t spin_until = start + spin_budget_ns(h, req);
    unsigned spins = 0;

    for (;;) {
        /* Locked only to look: the stream watcher may take the client over meanwhile. */
        spc__lock(h);
        spc__reap(h);
        bool left = req->state != state;
        spc__unlock(h);
        if (left)
            return;

        uint64_t now = spc__now_ns();
        if (now < spin_until && now < deadline) {
            if ((++spins & 63) != 0) {
                sp_cpu_relax();
                continue;
            }
            /* Sharing a CPU with the progress thread: spinning would only keep
             * it from running. Sleep now; see sp_wake.progress_cpu. */
            if ((uint32_t)sched_getcpu() == sp_load_relaxed(&h->v.wake->progress_cpu))
                spin_until = now;
            else
                sched_yield();
            continue;
        }
        spc__lock(h);
        bool alive = spc__daemon_alive(h);
        spc__unlock(h);
        if (!alive || now >= deadline)
            return;

        /* Sleep: say so, re-check (full barrier between the two), then wait. */
        uint32_t seen = sp_load_acquire(&wake->cq_futex);
        sp_store_relaxed(&wake->cq_waiting, (uint32_t)sched_getcpu() + 1);
        sp_smp_mb();
        if (sp_ring_ready(h->v.cq, h->cq_head) == 0 &&
            sp_load_relaxed(&wake->daemon_state) != SP_DAEMON_GONE) {
            uint64_t t = deadline - now < WAIT_SLICE_NS ? deadline - now : WAIT_SLICE_NS;
            sp_futex_wait(&wake->cq_futex, seen, (int64_t)t);
        }
        sp_store_relaxed(&wake->cq_waiting, 0);
    }
}

spc_status_t spc_wait(spc_request_t *req, int wait_ms)
{
    if (req == NULL)
        return SPC_ERR_INVALID_ARG;
    spc__wait_while(req, REQ_INFLIGHT, wait_ms);
    return spc_test(req);
}

const char *spc_request_detail(const spc_request_t *req)
{
    return req != NULL && req->state == REQ_DONE ? req->detail : "";
}

void spc_request_release(spc_request_t *req)
{
    if (req == NULL)
        return;
    spc_handle_t *h = req->h;
    spc__lock(h);
    if (req->state == REQ_DONE)
        req_put(h, req);
    else if (req->state == REQ_INFLIGHT)
        req->state = REQ_ORPHAN;   /* freed when its completion arrives */
    spc__unlock(h);
}

uint32_t spc_inflight(const spc_handle_t *h)
{
    return h->inflight;
}

/* ================================================================ helpers */

/* Waits for a request and releases it; a wait that runs out is a TIMEOUT. A
 * stream op is not waited for: the stream orders it, and keeps its error. */
static spc_status_t wait_release(spc_handle_t *h, spc_request_t *r, int wait_ms)
{
    if (r->stream != NULL) {
        spc_request_release(r);
        return SPC_OK;
    }
    spc_status_t st = spc_wait(r, wait_ms);
    spc_request_release(r);
    if (st == SPC_IN_PROGRESS)
        return spc__fail(h, SPC_ERR_TIMEOUT, "no completion within %d ms (the op stays queued in spd)", wait_ms);
    return st;
}

static spc_status_t submit_wait(spc_handle_t *h, const spc_op_t *op, int wait_ms)
{
    spc_request_t *r;
    spc_status_t st = spc_submit(h, op, &r);
    return st == SPC_OK ? wait_release(h, r, wait_ms) : st;
}

spc_status_t spc_inoop(spc_handle_t *h, spc_request_t **req_p)
{
    spc_op_t op = { .struct_size = sizeof op, .opcode = SPC_OP_NOOP };
    return spc_submit(h, &op, req_p);
}

spc_status_t spc_noop(spc_handle_t *h, int wait_ms)
{
    spc_op_t op = { .struct_size = sizeof op, .opcode = SPC_OP_NOOP };
    return submit_wait(h, &op, wait_ms);
}

spc_status_t spc_ibarrier(spc_handle_t *h, spc_group_t group, spc_request_t **req_p)
{
    spc_op_t op = { .struct_size = sizeof op, .opcode = SPC_OP_BARRIER, .group = group };
    return spc_submit(h, &op, req_p);
}

spc_status_t spc_barrier(spc_handle_t *h, spc_group_t group, int wait_ms)
{
    spc_op_t op = { .struct_size = sizeof op, .opcode = SPC_OP_BARRIER, .group = group };
    return submit_wait(h, &op, wait_ms);
}

static void fill_allreduce(spc_op_t *op, spc_group_t group, const void *send, void *recv, uint64_t count,
                           spc_dtype_t dtype, spc_redop_t redop)
{
    *op = (spc_op_t){
        .struct_size = sizeof *op,
        .opcode = SPC_OP_ALLREDUCE,
        .group = group,
        .dtype = dtype,
        .redop = redop,
        .count = count,
        .ntensors = 2,
    };
    op->tensors[0].ptr = (void *)send;
    op->tensors[1].ptr = recv;
}

spc_status_t spc_iallreduce(spc_handle_t *h, spc_group_t group, const void *send, void *recv, uint64_t count,
                            spc_dtype_t dtype, spc_redop_t redop, spc_request_t **req_p)
{
    spc_op_t op;
    fill_allreduce(&op, group, send, recv, count, dtype, redop);
    return spc_submit(h, &op, req_p);
}

spc_status_t spc_allreduce(spc_handle_t *h, spc_group_t group, const void *send, void *recv, uint64_t count,
                           spc_dtype_t dtype, spc_redop_t redop, int wait_ms)
{
    spc_op_t op;
    fill_allreduce(&op, group, send, recv, count, dtype, redop);
    return submit_wait(h, &op, wait_ms);
}

spc_status_t spc_ireduce_scatter(spc_handle_t *h, spc_group_t group, const void *send, void *recv, uint64_t count,
                                 spc_dtype_t dtype, spc_redop_t redop, spc_request_t **req_p)
{
    spc_op_t op;
    fill_allreduce(&op, group, send, recv, count, dtype, redop);
    op.opcode = SPC_OP_REDUCE_SCATTER;
    /* The send holds every rank's block; the handle learned the group's size
     * when it joined or made the mesh. */
    uint32_t size = h != NULL ? spc__group_size(h, group) : 0;
    if (size == 0)
        return h ? spc__fail(h, SPC_ERR_INVALID_ARG, "reduce_scatter on group %u: not a group of this handle's job",
                             group)
                 : SPC_ERR_INVALID_ARG;
    op.tensors[0].bytes = count * spc_dtype_size(dtype) * size;
    return spc_submit(h, &op, req_p);
}

spc_status_t spc_reduce_scatter(spc_handle_t *h, spc_group_t group, const void *send, void *recv, uint64_t count,
                                spc_dtype_t dtype, spc_redop_t redop, int timeout_ms)
{
    spc_request_t *r;
    spc_status_t st = spc_ireduce_scatter(h, group, send, recv, count, dtype, redop, &r);
    return st == SPC_OK ? wait_release(h, r, timeout_ms) : st;
}

spc_status_t spc_iallgather(spc_handle_t *h, spc_group_t group, const void *send, void *recv, uint64_t count,
                            spc_dtype_t dtype, spc_request_t **req_p)
{
    spc_op_t op = { .struct_size = sizeof op, .opcode = SPC_OP_ALLGATHER, .group = group, .dtype = dtype,
                    .count = count, .ntensors = 2 };
    op.tensors[0].ptr = (void *)send;
    op.tensors[1].ptr = recv;
    /* The receive holds every rank's part; the handle learned the group's size
     * when it joined or made the mesh. */
    uint32_t size = h != NULL ? spc__group_size(h, group) : 0;
    if (size == 0)
        return h ? spc__fail(h, SPC_ERR_INVALID_ARG, "allgather on group %u: not a group of this handle's job", group)
                 : SPC_ERR_INVALID_ARG;
    op.tensors[1].bytes = count * spc_dtype_size(dtype) * size;
    return spc_submit(h, &op, req_p);
}

spc_status_t spc_allgather(spc_handle_t *h, spc_group_t group, const void *send, void *recv, uint64_t count,
                           spc_dtype_t dtype, int wait_ms)
{
    spc_request_t *r;
    spc_status_t st = spc_iallgather(h, group, send, recv, count, dtype, &r);
    return st == SPC_OK ? wait_release(h, r, wait_ms) : st;
}

spc_status_t spc_ibroadcast(spc_handle_t *h, spc_group_t group, void *buf, uint64_t count, spc_dtype_t dtype,
                            uint32_t root, spc_request_t **req_p)
{
    spc_op_t op = { .struct_size = sizeof op, .opcode = SPC_OP_BROADCAST, .group = group, .dtype = dtype,
                    .count = count, .ntensors = 1, .root = root };
    op.tensors[0].ptr = buf;
    return spc_submit(h, &op, req_p);
}

spc_status_t spc_broadcast(spc_handle_t *h, spc_group_t group, void *buf, uint64_t count, spc_dtype_t dtype,
                           uint32_t root, int wait_ms)
{
    spc_request_t *r;
    spc_status_t st = spc_ibroadcast(h, group, buf, count, dtype, root, &r);
    return st == SPC_OK ? wait_release(h, r, wait_ms) : st;
}

/* ================================================================ Ulysses all-to-all */

spc_status_t spc_ialltoall(spc_handle_t *h, const spc_alltoall_desc_t *caller_d, spc_request_t **req_p)
{
    struct sp_a2a_params p = { 0 };
    spc_alltoall_desc_t desc;
    const spc_alltoall_desc_t *d = &desc;   /* the caller's, fields its version predates zero */
    spc_status_t st;

    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    if ((st = spc__struct_read(h, spc_alltoall_desc_t, caller_d, tensors, &desc)) != SPC_OK)
        return st;
    if (d->ntensors == 0 || d->ntensors > SPC_A2A_MAX_TENSORS)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "all-to-all of %u tensors; 1 to %d", d->ntensors,
                         SPC_A2A_MAX_TENSORS);
    if (d->ntensors > 4 && d->struct_size < spc__field_end(spc_alltoall_desc_t, more_tensors))
        return spc__fail(h, SPC_ERR_INVALID_ARG, "all-to-all of %u tensors: an spc_alltoall_desc_t of %zu bytes "
                         "has no more_tensors", d->ntensors, d->struct_size);
    p.direction = d->direction;
    p.layout = d->layout;
    p.batch = d->batch;
    p.seq_len = d->seq_len;
    p.kv_heads = d->kv_heads;
    p.ntensors = d->ntensors;
    spc_op_t op = {
        .struct_size = sizeof op, .opcode = SPC_OP_ALLTOALL, .group = d->group, .dtype = d->dtype,
        .ntensors = 2 * d->ntensors, .params = &p,
        .param_bytes = h->layout.version >= 5 ? (uint32_t)sizeof p : (uint32_t)SP_A2A_V4_PARAM_BYTES,
        .timeout_ms = d->timeout_ms,
    };
    spc_tensor_t refs[2 * SPC_A2A_MAX_TENSORS] = { { 0 } };   /* (send, receive) pairs */
    /* The extents follow from the group's size, which the handle learned when
     * it joined or made the mesh. */
    uint32_t P = spc__group_size(h, d->group);
    if (P == 0)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "alltoall on group %u: not a group of this handle's job", d->group);
    for (uint32_t i = 0; i < d->ntensors; i++) {
        const spc_a2a_tensor_t *t = i < 4 ? &d->tensors[i] : &d->more_tensors[i - 4];
        p.t[i] = (struct sp_a2a_tensor){ .heads = t->heads, .head_dim = t->head_dim, .kind = t->kind,
                                         .flags = t->flags };
        refs[2 * i].ptr = (void *)t->send;
        refs[2 * i + 1].ptr = t->recv;
        /* Padded heads and rows included; a combination that cannot be dealt
         * is left for spd to refuse with its reason. */
        sp_heads_plan_t pl;
        if (sp_heads_plan(&pl, t->heads, t->kind, d->kv_heads, P)) {
            uint64_t row = (uint64_t)d->batch * t->head_dim * spc_dtype_size(d->dtype);
            uint64_t seq_side = row * sp_rows_local(d->seq_len, P) * t->heads;
            uint64_t head_side = row * d->seq_len * pl.local;
            bool s2h = d->direction == SPC_SEQ_TO_HEAD;
            refs[2 * i].bytes = s2h ? seq_side : head_side;
            refs[2 * i + 1].bytes = s2h ? head_side : seq_side;
        }
    }
    return submit(h, &op, refs, req_p);
}

spc_status_t spc_alltoall(spc_handle_t *h, const spc_alltoall_desc_t *d, int wait_ms)
{
    spc_request_t *r;
    spc_status_t st = spc_ialltoall(h, d, &r);
    return st == SPC_OK ? wait_release(h, r, wait_ms) : st;
}

/* ================================================================ uneven all-to-all */

/* Elements of one side's counts, or UINT64_MAX when they do not add up in 64 bits. */
static uint64_t counts_sum(const uint64_t *counts, uint32_t P)
{
    uint64_t sum = 0;
    for (uint32_t j = 0; j < P; j++) {
        if (counts[j] > UINT64_MAX - sum)
            return UINT64_MAX;
        sum += counts[j];
    }
    return sum;
}

spc_status_t spc_ialltoallv(spc_handle_t *h, const spc_alltoallv_desc_t *caller_d, spc_request_t **req_p)
{
    struct sp_a2av_params p;
    spc_alltoallv_desc_t desc;
    const spc_alltoallv_desc_t *d = &desc;   /* the caller's, fields its version predates zero */
    spc_status_t st;

    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    if ((st = spc__struct_read(h, spc_alltoallv_desc_t, caller_d, timeout_ms, &desc)) != SPC_OK)
        return st;
    uint32_t P = spc__group_size(h, d->group);
    if (P == 0)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "alltoallv on group %u: not a group of this handle's job", d->group);
    if (P > SPC_ALLTOALLV_MAX_RANKS)
        return spc__fail(h, SPC_ERR_UNSUPPORTED, "alltoallv on a group of %u ranks; at most %d", P,
                         SPC_ALLTOALLV_MAX_RANKS);
    if (d->send_counts == NULL || d->recv_counts == NULL)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "alltoallv needs send_counts and recv_counts");
    memcpy(p.counts, d->send_counts, P * sizeof p.counts[0]);
    memcpy(p.counts + P, d->recv_counts, P * sizeof p.counts[0]);
    uint64_t es = spc_dtype_size(d->dtype), send = counts_sum(p.counts, P), recv = counts_sum(p.counts + P, P);
    if (es == 0)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "alltoallv: unknown dtype %d", (int)d->dtype);
    if (send > UINT64_MAX / es || recv > UINT64_MAX / es)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "alltoallv: counts of more bytes than 64 bits hold");
    spc_op_t op = {
        .struct_size = sizeof op, .opcode = SPC_OP_ALLTOALLV, .group = d->group, .dtype = d->dtype,
        .ntensors = 2, .params = &p, .param_bytes = 2 * P * (uint32_t)sizeof p.counts[0],
        .timeout_ms = d->timeout_ms,
    };
    /* A side with nothing in it may be NULL: it names the other side's memory, or none. */
    op.tensors[0] = (spc_tensor_t){ .ptr = (void *)(d->send != NULL ? d->send : send == 0 ? d->recv : NULL),
                                    .bytes = send * es };
    op.tensors[1] = (spc_tensor_t){ .ptr = d->recv != NULL ? d->recv : recv == 0 ? (void *)d->send : NULL,
                                    .bytes = recv * es };
    for (int i = 0; i < 2; i++)
        if (op.tensors[i].ptr == NULL && op.tensors[i].bytes > 0)
            return spc__fail(h, SPC_ERR_INVALID_ARG, "alltoallv: %s is NULL with %" PRIu64 " bytes to %s",
                             i == 0 ? "send" : "recv", op.tensors[i].bytes, i == 0 ? "send" : "receive");
    return submit(h, &op, op.tensors, req_p);
}

spc_status_t spc_alltoallv(spc_handle_t *h, const spc_alltoallv_desc_t *d, int wait_ms)
{
    spc_request_t *r;
    spc_status_t st = spc_ialltoallv(h, d, &r);
    return st == SPC_OK ? wait_release(h, r, wait_ms) : st;
}

/* ================================================================ ring shift */

spc_status_t spc_ishift(spc_handle_t *h, const spc_shift_desc_t *caller_d, spc_request_t **req_p)
{
    spc_shift_desc_t desc;
    const spc_shift_desc_t *d = &desc;   /* the caller's, fields its version predates zero */
    spc_status_t st;

    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    if ((st = spc__struct_read(h, spc_shift_desc_t, caller_d, tensors, &desc)) != SPC_OK)
        return st;
    if (d->ntensors == 0 || d->ntensors > 4)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "shift of %u tensors; 1 to 4", d->ntensors);
    spc_op_t op = {
        .struct_size = sizeof op, .opcode = SPC_OP_SHIFT, .group = d->group, .dtype = SPC_U8,
        .ntensors = 2 * d->ntensors, .flags = d->flags, .channel = d->channel,
        .timeout_ms = d->timeout_ms,
    };
    for (uint32_t i = 0; i < d->ntensors; i++) {
        if (d->tensors[i].bytes == 0)
            return spc__fail(h, SPC_ERR_INVALID_ARG, "shift tensor %u has 0 bytes", i);
        op.tensors[2 * i].ptr = (void *)d->tensors[i].send;
        op.tensors[2 * i].bytes = d->tensors[i].bytes;
        op.tensors[2 * i + 1].ptr = d->tensors[i].recv;
        op.tensors[2 * i + 1].bytes = d->tensors[i].bytes;
    }
    return spc_submit(h, &op, req_p);
}

spc_status_t spc_shift(spc_handle_t *h, const spc_shift_desc_t *d, int wait_ms)
{
    spc_request_t *r;
    spc_status_t st = spc_ishift(h, d, &r);
    return st == SPC_OK ? wait_release(h, r, wait_ms) : st;
}
