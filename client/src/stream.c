/*
 * stream.c — stream order: device ops that follow a CUDA stream of the
 * application, with no host round trip (spclient.h, "GPU streams").
 *
 * For op `seq` on a stream, spc_submit (ops.c) enqueues on the CUDA stream
 * "ready = seq", publishes the SQ entry naming the stream's slot and seq, and
 * enqueues "wait until done >= seq". The semaphores are the slot's pair in the
 * segment's semaphore page, which this process registers with CUDA once.
 *
 * Nothing here blocks on the daemon, but the application's thread may block
 * in the CUDA driver on a done only spd writes. So while a stream is open a
 * watcher thread sleeps on the control socket, and when spd hangs up it takes
 * the client over to the next spd itself (resume.c), under the handle's lock:
 * each stream's slot is given back at the done its page holds, with the ops
 * past it that completed here (failed before they ran), and its ops still in
 * flight are submitted again, in order; those whose done the old spd wrote
 * complete here. Only when no spd takes the client over (reconnecting is off, spd shut
 * down for good, none came in time, the one that came refused) does the
 * watcher store SPC_STREAM_POISON into every done of the page: every wait then
 * passes and the ops' requests say DAEMON_LOST. Poisoning sooner would let the
 * kernels after an op run before the next spd did it.
 */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

static void poison_all(spc_handle_t *h)
{
    for (uint32_t i = 0; i < SP_STREAMS_MAX; i++)
        __atomic_store_n(&h->v.sems[i].done, SP_STREAM_POISON, __ATOMIC_RELEASE);
}

static void *watch_main(void *arg)
{
    spc_handle_t *h = arg;
    for (;;) {
        /* The socket is another one after a take-over (by this thread, or by
         * the application's, which notices spd gone where it does today). */
        spc__lock(h);
        int sock = h->sock;
        bool lost = h->lost;
        spc__unlock(h);
        if (lost) {
            poison_all(h);
            return NULL;
        }
        struct pollfd fds[2] = { { .fd = sock, .events = POLLRDHUP }, { .fd = h->watch_pipe[0], .events = POLLIN } };
        if (poll(fds, 2, -1) < 0)
            continue;   /* EINTR */
        if (fds[1].revents != 0)
            return NULL;   /* detaching, or the last stream was destroyed */
        if (fds[0].revents & (POLLRDHUP | POLLHUP | POLLERR | POLLNVAL)) {
            spc__lock(h);
            spc__daemon_alive(h);   /* the next spd takes the client over, or it is lost */
            spc__unlock(h);
        }
    }
}

/* Ends the watcher: the handle detaches, or its last stream was destroyed. */
static void watch_stop(spc_handle_t *h)
{
    if (!h->watch_started)
        return;
    char c = 0;
    if (write(h->watch_pipe[1], &c, 1) < 0) {
        /* The watcher also ends when the socket closes, which follows. */
    }
    pthread_join(h->watch, NULL);
    close(h->watch_pipe[0]);
    close(h->watch_pipe[1]);
    h->watch_started = false;
}

static bool streams_open(const spc_handle_t *h)
{
    for (uint32_t i = 0; i < SPC_STREAMS_MAX; i++)
        if (h->streams[i] != NULL)
            return true;
    return false;
}

static spc_status_t watch_start(spc_handle_t *h)
{
    if (h->watch_started)
        return SPC_OK;
    if (pipe2(h->watch_pipe, O_CLOEXEC) != 0)
        return spc__fail(h, SPC_ERR_NO_MEMORY, "pipe: %s", strerror(errno));
    int rc = pthread_create(&h->watch, NULL, watch_main, h);
    if (rc != 0) {
        close(h->watch_pipe[0]);
        close(h->watch_pipe[1]);
        return spc__fail(h, SPC_ERR_NO_MEMORY, "starting the stream watcher: %s", strerror(rc));
    }
    h->watch_started = true;
    return SPC_OK;
}

static spc_status_t stream_create_locked(spc_handle_t *h, void *cu_stream, spc_stream_t **s_p)
{
    spc__cuda_stream_info_t info;

    if (h->seg == NULL)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "control-only handles have no streams");
    if (h->lost)
        return spc__fail(h, SPC_ERR_DAEMON_LOST, "connection to spd was lost");
    spc_status_t st = spc__cuda_stream_info(h, cu_stream, &info);
    if (st != SPC_OK)
        return st;
    if (h->sems_registered == NULL) {
        uint64_t unused;
        if ((st = spc__cuda_host_register(h, info.ctx, h->v.sems, SP_PAGE, &unused)) != SPC_OK)
            return st;
        h->sems_registered = h->v.sems;
    }
    if ((st = watch_start(h)) != SPC_OK)
        return st;
    spc_stream_t *s = calloc(1, sizeof *s);
    uint64_t base;
    if (s == NULL)
        st = spc__fail(h, SPC_ERR_NO_MEMORY, "out of memory");
    else if ((st = spc__cuda_host_pointer(h, info.ctx, h->v.sems, &base)) == SPC_OK)
        st = spc__stream_open_call(h, &info, &s->slot);
    if (st != SPC_OK) {
        free(s);
        return st;
    }
    s->h = h;
    s->cu_stream = cu_stream;
    s->ctx = info.ctx;
    s->device = info.device;
    memcpy(s->pci_bus_id, info.pci_bus_id, sizeof s->pci_bus_id);
    memcpy(s->uuid, info.uuid, sizeof s->uuid);
    s->ready_dptr = base + s->slot * sizeof(struct sp_stream_sem) + offsetof(struct sp_stream_sem, ready);
    s->done_dptr = base + s->slot * sizeof(struct sp_stream_sem) + offsetof(struct sp_stream_sem, done);
    h->streams[s->slot] = s;
    *s_p = s;
    return SPC_OK;
}

spc_status_t spc_stream_create(spc_handle_t *h, void *cu_stream, spc_stream_t **s_p)
{
    if (h == NULL || s_p == NULL)
        return h ? spc__fail(h, SPC_ERR_INVALID_ARG, "s_p is required") : SPC_ERR_INVALID_ARG;
    spc__lock(h);
    spc_status_t st = stream_create_locked(h, cu_stream, s_p);
    bool none = !streams_open(h);
    spc__unlock(h);
    if (none)
        watch_stop(h);   /* unlocked: the watcher may wait for the lock */
    return st;
}

/* The daemon stored SPC_STREAM_POISON in done: it gave up on the stream. */
static bool poisoned(const spc_stream_t *s)
{
    return (__atomic_load_n(&s->h->v.sems[s->slot].done, __ATOMIC_ACQUIRE) & SP_STREAM_POISON) != 0;
}

void spc__stream_completed(spc_stream_t *s, spc_status_t st, const char *detail)
{
    s->inflight--;
    if (st != SPC_OK)
        snprintf(s->last_failure, sizeof s->last_failure, "%s", detail ? detail : spc_status_message(st));
    if (st != SPC_OK && s->error == SPC_OK) {
        s->error = st;
        snprintf(s->detail, sizeof s->detail, "%s", detail ? detail : spc_status_message(st));
    }
}

static spc_status_t stream_query_locked(spc_stream_t *s)
{
    spc_handle_t *h = s->h;
    spc__reap(h);
    if (s->inflight > 0)
        spc__daemon_alive(h);   /* a lost daemon fails its requests, and so the stream */
    if (s->error == SPC_OK && poisoned(s)) {
        s->broken = true;
        s->error = h->lost ? SPC_ERR_DAEMON_LOST : SPC_ERR_CANCELED;
        if (h->lost)
            snprintf(s->detail, sizeof s->detail, "connection to spd was lost");
        else if (s->last_failure[0] != '\0')   /* what broke it (a timeout, a GPU fault), as far as it was told */
            snprintf(s->detail, sizeof s->detail, "spd gave up on this stream; its last failed op: %s",
                     s->last_failure);
        else
            snprintf(s->detail, sizeof s->detail, "spd gave up on this stream (a rank's stream missed an op's "
                     "timeout, or spd is going)");
    }
    spc_status_t st = s->error;
    if (st == SPC_OK)
        return SPC_OK;
    spc__fail(h, st, "stream %u: %s", s->slot, s->detail);
    if (!s->broken)
        s->error = SPC_OK;   /* reported; a broken stream keeps saying so */
    return st;
}

spc_status_t spc_stream_query(spc_stream_t *s)
{
    if (s == NULL)
        return SPC_ERR_INVALID_ARG;
    spc_handle_t *h = s->h;
    spc__lock(h);
    spc_status_t st = stream_query_locked(s);
    spc__unlock(h);
    return st;
}

spc_status_t spc_stream_synchronize(spc_stream_t *s)
{
    if (s == NULL)
        return SPC_ERR_INVALID_ARG;
    spc_handle_t *h = s->h;
    spc_status_t st = spc__cuda_stream_sync(h, s->ctx, s->cu_stream);
    if (st != SPC_OK)
        return st;
    /* The CUDA stream has passed every done; the daemon posts the completions
     * once it sees its own kernels have run (it polls at least every
     * millisecond), and a lost daemon fails them. */
    uint64_t deadline = spc__now_ns() + (uint64_t)h->timeout_ms * 1000000ull;
    for (unsigned spins = 0;; spins++) {
        spc__lock(h);
        spc__reap(h);
        bool settled = s->inflight == 0 || !spc__daemon_alive(h);
        uint32_t missing = s->inflight;
        spc__unlock(h);
        if (settled)
            break;
        if (spc__now_ns() > deadline)
            return spc__fail(h, SPC_ERR_TIMEOUT, "stream %u: %u completions still missing after %d ms", s->slot,
                             missing, h->timeout_ms);
        if (spins < 1000) {
            sched_yield();
        } else {
            struct timespec ts = { 0, 50000 };
            nanosleep(&ts, NULL);
        }
    }
    return spc_stream_query(s);
}

spc_status_t spc_stream_destroy(spc_stream_t *s)
{
    if (s == NULL)
        return SPC_OK;
    spc_handle_t *h = s->h;
    spc_status_t st = spc_stream_synchronize(s);
    spc__lock(h);
    if (h->cur_stream == s)
        h->cur_stream = NULL;
    if (!h->lost)
        spc__stream_close_call(h, s->slot);
    /* Requests still in flight (a lost daemon, a timeout) forget the stream. */
    for (uint32_t i = 0; h->reqs != NULL && i < h->layout.cq_entries; i++)
        if (h->reqs[i].stream == s)
            h->reqs[i].stream = NULL;
    h->streams[s->slot] = NULL;
    free(s);
    bool none = !streams_open(h);
    spc__unlock(h);
    if (none)
        watch_stop(h);   /* unlocked: the watcher may wait for the lock */
    return st;
}

/* ---------------------------------------------------------------- a take-over */

static uint64_t page_done(const spc_stream_t *s)
{
    return __atomic_load_n(&s->h->v.sems[s->slot].done, __ATOMIC_ACQUIRE);
}

void spc__streams_settle(spc_handle_t *h)
{
    /* Read once, and kept for the new spd: the old spd is gone and the new one
     * has not the streams yet, but the GPU work of the old may still write a
     * done as its context is torn down. */
    for (uint32_t i = 0; i < SPC_STREAMS_MAX; i++)
        if (h->streams[i] != NULL)
            h->streams[i]->taken_at = page_done(h->streams[i]);
    for (uint32_t i = 0; h->reqs != NULL && i < h->layout.cq_entries; i++) {
        spc_request_t *r = &h->reqs[i];
        spc_stream_t *s = r->stream;
        if ((r->state != REQ_INFLIGHT && r->state != REQ_ORPHAN) || s == NULL)
            continue;
        uint64_t done = s->taken_at;
        char why[SP_DETAIL_BYTES];
        if (done & SP_STREAM_POISON) {
            /* Its completion is lost, and the next spd will not run it: the old spd gave the stream up. */
            snprintf(why, sizeof why, "spd gave up on stream %u before it went%s%s", s->slot,
                     s->last_failure[0] ? "; its last failed op: " : "", s->last_failure);
            spc__req_finish(h, r, SPC_ERR_CANCELED, why);
        } else if (r->sqe.stream_seq <= done) {
            spc__req_finish(h, r, SPC_OK, NULL);   /* its kernels ran, the done after them too */
        }
    }
}

/* Whether a request of stream s with op seq is in flight. */
static bool seq_in_flight(const spc_handle_t *h, const spc_stream_t *s, uint64_t seq)
{
    for (uint32_t k = 0; h->reqs != NULL && k < h->layout.cq_entries; k++) {
        const spc_request_t *r = &h->reqs[k];
        if ((r->state == REQ_INFLIGHT || r->state == REQ_ORPHAN) && r->stream == s && r->sqe.stream_seq == seq)
            return true;
    }
    return false;
}

spc_status_t spc__streams_resume(spc_handle_t *h)
{
    uint64_t *settled = calloc(h->layout.cq_entries + 1, sizeof *settled);
    if (settled == NULL)
        return spc__fail(h, SPC_ERR_NO_MEMORY, "out of memory");
    spc_status_t st = SPC_OK;
    for (uint32_t i = 0; i < SPC_STREAMS_MAX && st == SPC_OK; i++) {
        spc_stream_t *s = h->streams[i];
        if (s == NULL)
            continue;
        uint64_t done = s->taken_at, ready = __atomic_load_n(&h->v.sems[s->slot].ready, __ATOMIC_ACQUIRE);
        /* Past done, an op not in flight was completed here: one the old spd
         * failed before it ran, whose done it still owed (a success comes
         * after its done). At most the requests' count of them. */
        size_t n = 0;
        for (uint64_t q = done + 1; !(done & SP_STREAM_POISON) && q <= s->seq && n <= h->layout.cq_entries; q++)
            if (!seq_in_flight(h, s, q))
                settled[n++] = q;
        st = spc__stream_resume_call(h, s, ready, done, settled, n);
        if (st != SPC_OK)
            st = spc__fail(h, st, "stream %u: %s", s->slot, spc_last_error(h));
    }
    free(settled);
    return st;
}

/* ---------------------------------------------------------------- the current stream */

spc_status_t spc_set_stream(spc_handle_t *h, spc_stream_t *s)
{
    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    if (s != NULL && s->h != h)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "the stream belongs to another handle");
    h->cur_stream = s;
    return SPC_OK;
}

spc_stream_t *spc_get_stream(const spc_handle_t *h)
{
    return h ? h->cur_stream : NULL;
}

uint64_t spc_stream_seq(const spc_stream_t *s)
{
    return s ? s->seq : 0;
}

void spc__streams_detach(spc_handle_t *h)
{
    watch_stop(h);
    if (h->sems_registered == NULL)
        return;
    /* Release every wait still on a CUDA stream, let the streams pass them,
     * and only then take the page from CUDA: a wait must never read memory that
     * is gone. */
    poison_all(h);
    for (uint32_t i = 0; i < SPC_STREAMS_MAX; i++) {
        spc_stream_t *s = h->streams[i];
        if (s == NULL)
            continue;
        spc__cuda_stream_sync(h, s->ctx, s->cu_stream);
        free(s);
        h->streams[i] = NULL;
    }
    spc__cuda_host_unregister(h->sems_registered);
    h->sems_registered = NULL;
    h->cur_stream = NULL;
}
