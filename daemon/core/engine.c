/*
 * engine.c — clients, their segments and rings, and the progress thread.
 * See engine.h for the locking rule and the path of an operation.
 */
#include "core/engine.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "base/log.h"
#include "sp_futex.h"
#include "sp_msg.h"
#include "core/client.h"
#include "core/coll.h"
#include "core/exec.h"
#include "core/job.h"
#include "core/mem.h"
#include "core/stage.h"
#include "core/transport.h"
#include "core/workers.h"

#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438   /* Linux 5.6; the same number on the architectures spd builds for */
#endif

uint64_t sp_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint32_t round_pow2(uint32_t v)
{
    uint32_t p = 1;
    while (p < v)
        p <<= 1;
    return p;
}

/* A sealed memfd of `bytes`: the holder of a copy of the descriptor cannot
 * shrink it under the daemon's mapping (which would turn our accesses into
 * SIGBUS) nor grow it. *fd_p is set only on success. */
static spc_status_t memfd_make(const char *name, uint64_t bytes, int *fd_p, sp_err_t *e)
{
    int fd = memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0)
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "memfd_create: %s", strerror(errno));
    if (fchmod(fd, 0600) != 0 || ftruncate(fd, (off_t)bytes) != 0) {
        sp_err_set(e, SPC_ERR_NO_MEMORY, "sizing a %" PRIu64 "-byte segment: %s", bytes, strerror(errno));
        goto err_close;
    }
    if (fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
        sp_err_set(e, SPC_ERR_NO_MEMORY, "sealing the segment: %s", strerror(errno));
        goto err_close;
    }
    *fd_p = fd;
    return SPC_OK;

err_close:
    close(fd);
    return e->status;
}

/*
 * An eventfd that wakes the progress thread, watched by its epoll. Watched
 * edge-triggered and never read: every write is a new edge, so a wake-up is
 * never lost, and a client can do nothing with its own eventfd (fill its
 * counter, drain it, make it blocking) that reaches past waking the daemon.
 * *fd_p is set only on success.
 */
static spc_status_t wake_fd_make(sp_engine_t *eng, int *fd_p, sp_err_t *e)
{
    int fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd < 0)
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "cannot create a wake eventfd: %s", strerror(errno));
    struct epoll_event ev = { .events = EPOLLIN | EPOLLET };
    if (epoll_ctl(eng->wake_epfd, EPOLL_CTL_ADD, fd, &ev) != 0) {
        sp_err_set(e, SPC_ERR_NO_MEMORY, "cannot watch a wake eventfd: %s", strerror(errno));
        close(fd);
        return e->status;
    }
    *fd_p = fd;
    return SPC_OK;
}

static void wake_fd_close(sp_engine_t *eng, int fd)
{
    if (fd < 0)
        return;
    /* The client's copy keeps the eventfd open: take it out of the epoll ourselves. */
    epoll_ctl(eng->wake_epfd, EPOLL_CTL_DEL, fd, NULL);
    close(fd);
}

/* ---------------------------------------------------------------- engine */

int sp_engine_init(sp_engine_t *eng, const sp_config_t *cfg, const char *node)
{
    sp_err_t e = SP_ERR_INIT;

    memset(eng, 0, sizeof *eng);
    pthread_mutex_init(&eng->lock, NULL);
    eng->cfg = cfg;
    snprintf(eng->node, sizeof eng->node, "%s", node);
    eng->next_client_id = 1;
    /* Group ids start anywhere: a client a restart took over still names its
     * world group by the id the spd before gave it (libspclient maps it to
     * this spd's), and a group this spd makes later should not take that id. */
    uint32_t start;
    eng->next_group_id = getrandom(&start, sizeof start, 0) == (ssize_t)sizeof start ? (start & 0x7fffffffu) + 1 : 1;
    eng->next_region_id = 1;
    eng->next_deadline_ns = UINT64_MAX;
    eng->started_ns = sp_now_ns();
    eng->progress_cpu = -1;
    eng->copy_threads = 1;
    eng->mem_via_proc = sp_mem_ptrace_capable();
    sp_info(MEM, "%s", eng->mem_via_proc ?
            "spd holds CAP_SYS_PTRACE: registered host memory is reached through /proc/<pid>/mem of the program "
            "that attached" :
            "spd lacks CAP_SYS_PTRACE: registered host memory is reached with process_vm_readv/writev, in processes "
            "of spd's own user");

    eng->kick_fd = -1;
    eng->wake_epfd = epoll_create1(EPOLL_CLOEXEC);
    if (eng->wake_epfd < 0) {
        sp_error(RING, "cannot create the progress thread's epoll: %s", strerror(errno));
        return -1;
    }
    if (wake_fd_make(eng, &eng->kick_fd, &e) != SPC_OK) {
        sp_error(RING, "%s", e.msg);
        close(eng->wake_epfd);
        eng->wake_epfd = -1;
        return -1;
    }
    return 0;
}

void sp_engine_cleanup(sp_engine_t *eng)
{
    /* Tasks the progress thread never got to (it has stopped). */
    SP_TRANSPORT_CALL(eng->gpu_ops, shutdown, eng);
    for (sp_task_t *t; (t = sp_task_next(eng)) != NULL;)
        sp_task_abort(eng, t, SPC_ERR_SHUTTING_DOWN, "spd is shutting down");
    SP_TRANSPORT_CALL(eng->gpu_ops, stop, eng);   /* what is on a GPU runs out */
    sp_task_stage_trim(eng, 0, true);
    while (eng->clients != NULL)
        sp_client_destroy(eng, eng->clients, "daemon exiting");
    sp_jobs_cleanup(eng);
    sp_stats_cleanup(eng);
    if (eng->kick_fd >= 0)
        close(eng->kick_fd);
    if (eng->wake_epfd >= 0)
        close(eng->wake_epfd);
    free(eng->events.doomed_ids);
    /* The progress thread is stopped: nobody progresses the data path. */
    SP_TRANSPORT_CALL(eng->net_ops, cleanup, eng);
    SP_TRANSPORT_CALL(eng->xdev_ops, cleanup, eng);
    SP_TRANSPORT_CALL(eng->gpu_ops, cleanup, eng);   /* last: the imports above close into its counts */
    pthread_mutex_destroy(&eng->lock);
}

void sp_engine_kick(sp_engine_t *eng)
{
    uint64_t one = 1;
    /* Only a counter at its maximum refuses, and then a wake-up is pending anyway. */
    (void)!write(eng->kick_fd, &one, sizeof one);
}

void sp_engine_drain(sp_engine_t *eng)
{
    pthread_mutex_lock(&eng->lock);
    atomic_store(&eng->draining, true);
    for (sp_client_t *c = eng->clients; c != NULL; c = c->next) {
        sp_store_relaxed(&c->v.wake->daemon_state, SP_DAEMON_DRAINING);
    }
    pthread_mutex_unlock(&eng->lock);
    sp_engine_kick(eng);
}

uint32_t sp_engine_inflight_locked(sp_engine_t *eng)
{
    uint32_t n = 0;
    for (sp_client_t *c = eng->clients; c != NULL; c = c->next)
        n += c->inflight;
    return n;
}

void sp_engine_shutdown_locked(sp_engine_t *eng)
{
    /* First, so that no GPU stream (the clients', the daemon's) waits for what
     * will not come; then the ops still waiting for ranks. */
    SP_TRANSPORT_CALL(eng->gpu_ops, shutdown, eng);
    sp_job_fail_all(eng, SPC_ERR_SHUTTING_DOWN, "spd is shutting down");
    for (sp_client_t *c = eng->clients; c != NULL; c = c->next) {
        /* Release: completions posted above are visible before the state says gone. */
        sp_store_release(&c->v.wake->daemon_state, SP_DAEMON_GONE);
        sp_futex_bump_wake(&c->v.wake->cq_futex);
    }
}

/* ---------------------------------------------------------------- events for the loop */

static void events_notify(sp_engine_t *eng)
{
    if (eng->notify != NULL)
        eng->notify(eng->notify_arg);
}

void sp_engine_doom(sp_engine_t *eng, sp_client_t *c, spc_status_t st, const char *why)
{
    if (c->doomed)
        return;
    sp_warn(RING, "client %" PRIu64 " (pid %d): %s; disconnecting it", c->id, (int)c->pid, why);
    c->doomed = true;
    sp_err_set(&c->doom, st, "%s", why);
    sp_engine_events_t *ev = &eng->events;
    if (ev->ndoomed == ev->cap) {
        uint32_t cap = ev->cap ? ev->cap * 2 : 8;
        uint64_t *ids = realloc(ev->doomed_ids, cap * sizeof *ids);
        if (ids == NULL)
            return;   /* the client stays doomed: it is ignored, and dropped at EOF */
        ev->doomed_ids = ids;
        ev->cap = cap;
    }
    ev->doomed_ids[ev->ndoomed++] = c->id;
    events_notify(eng);
}

/* ---------------------------------------------------------------- clients */

/* A client of pid, whose memory spd reaches as sp_mem_attach says; no segment yet. */
static spc_status_t client_new(sp_engine_t *eng, pid_t pid, int pidfd, uid_t uid, gid_t gid, const char *name,
                               uint32_t protocol, sp_client_t **c_p, sp_err_t *e)
{
    sp_client_t *c = calloc(1, sizeof *c);
    if (c == NULL)
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    c->pid = pid;
    c->uid = uid;
    c->gid = gid;
    c->seg_fd = -1;
    c->wake_fd = -1;
    spc_status_t st = sp_mem_attach(eng, c, pidfd, e);
    if (st != SPC_OK) {
        free(c);
        return st;
    }
    c->id = eng->next_client_id++;
    snprintf(c->name, sizeof c->name, "%s", name && *name ? name : "?");
    c->attached_ns = sp_now_ns();
    c->protocol = protocol;
    *c_p = c;
    return SPC_OK;
}

/* Frees a client that client_new made and nothing else holds yet. */
static void client_unmake(sp_engine_t *eng, sp_client_t *c)
{
    if (c->v.base != NULL)
        munmap(c->v.base, c->layout.segment_bytes);
    wake_fd_close(eng, c->wake_fd);
    if (c->seg_fd >= 0)
        close(c->seg_fd);
    if (c->mem_fd >= 0)
        close(c->mem_fd);
    free(c);
}

/* Maps c's segment (c->seg_fd, of c->layout) with a wake eventfd of its own,
 * stamps c's id in its header, and links c into the engine. */
static spc_status_t client_install(sp_engine_t *eng, sp_client_t *c, sp_err_t *e)
{
    SP_CHECK(wake_fd_make(eng, &c->wake_fd, e));
    void *base = mmap(NULL, c->layout.segment_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, c->seg_fd, 0);
    if (base == MAP_FAILED)
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "mapping a %" PRIu64 "-byte segment: %s", c->layout.segment_bytes,
                          strerror(errno));
    memcpy(base, &c->layout, sizeof c->layout);
    sp_seg_view_init(&c->v, base, &c->layout);
    c->sq_mask = c->layout.sq_entries - 1;
    c->cq_mask = c->layout.cq_entries - 1;
    /* A client that arrives while the progress thread sleeps must wake it for
     * its first submission, or that waits out the whole sleep. */
    sp_store_relaxed(&c->v.wake->sq_need_wakeup, eng->sleeping ? 1u : 0u);
    sp_store_relaxed(&c->v.wake->progress_cpu, eng->progress_cpu >= 0 ? (uint32_t)eng->progress_cpu : UINT32_MAX);
    sp_store_relaxed(&c->v.wake->daemon_state,
                     atomic_load(&eng->draining) ? (uint32_t)SP_DAEMON_DRAINING : (uint32_t)SP_DAEMON_RUNNING);

    c->next = eng->clients;
    eng->clients = c;
    eng->nclients++;
    sp_info(MEM, "client %" PRIu64 " (pid %d, uid %u, '%s'): segment %" PRIu64 " bytes, sq %u, cq %u, arena %" PRIu64,
            c->id, (int)c->pid, (unsigned)c->uid, c->name, c->layout.segment_bytes, c->layout.sq_entries,
            c->layout.cq_entries, c->layout.arena_bytes);
    return SPC_OK;
}

spc_status_t sp_client_create(sp_engine_t *eng, pid_t pid, int pidfd, uid_t uid, gid_t gid, const char *name,
                              uint32_t protocol, uint32_t sq_entries, uint64_t arena_bytes, sp_client_t **c_p,
                              sp_err_t *e)
{
    const sp_config_t *cfg = eng->cfg;
    char memname[64];

    if (sq_entries == 0)
        sq_entries = (uint32_t)cfg->sq_entries;
    if (sq_entries < SP_SQ_MIN_ENTRIES || sq_entries > SP_SQ_MAX_ENTRIES)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "sq_entries %u outside [%u, %u]", sq_entries, SP_SQ_MIN_ENTRIES,
                          SP_SQ_MAX_ENTRIES);
    sq_entries = round_pow2(sq_entries);
    if (arena_bytes == 0)
        arena_bytes = (uint64_t)cfg->arena_bytes;
    if (arena_bytes > (uint64_t)cfg->max_arena_bytes)
        return sp_err_set(e, SPC_ERR_LIMIT, "arena of %" PRIu64 " bytes exceeds max_arena_bytes (%" PRId64 ")",
                          arena_bytes, cfg->max_arena_bytes);

    sp_client_t *c;
    SP_CHECK(client_new(eng, pid, pidfd, uid, gid, name, protocol, &c, e));
    sp_seg_layout(&c->layout, sp_protocol_seg_version(protocol), sq_entries, arena_bytes);
    c->layout.client_id = c->id;
    snprintf(memname, sizeof memname, "spd-seg-%" PRIu64, c->id);
    /* A fresh memfd reads as zeros: rings empty, flags clear. Only the header is written. */
    spc_status_t st = memfd_make(memname, c->layout.segment_bytes, &c->seg_fd, e);
    if (st == SPC_OK)
        st = client_install(eng, c, e);
    if (st != SPC_OK) {
        client_unmake(eng, c);
        return st;
    }
    *c_p = c;
    return SPC_OK;
}

/*
 * Checks a segment a client brings back (sp_client_adopt) as the client checks
 * the one spd gives it, trusting nothing in it: a memory file sealed so that
 * nobody can shrink it under spd's mapping (SIGBUS) nor grow it, and left
 * writable; its header that of the layout this protocol's segments have, as
 * spd computes it; its arena within max_arena_bytes. *layout_p on success.
 */
static spc_status_t segment_check(const sp_engine_t *eng, int fd, uint32_t protocol, struct sp_seg_hdr *layout_p,
                                  sp_err_t *e)
{
    struct stat st;
    struct sp_seg_hdr hdr, want;
    int seals = fcntl(fd, F_GET_SEALS);

    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode) || seals < 0)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "the descriptor brought back as the segment is not a memory file");
    if ((seals & (F_SEAL_SHRINK | F_SEAL_GROW)) != (F_SEAL_SHRINK | F_SEAL_GROW) ||
        (seals & (F_SEAL_WRITE | F_SEAL_FUTURE_WRITE)) != 0)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "the segment brought back is not sealed as spd seals its segments "
                          "(seals 0x%x)", (unsigned)seals);
    if (pread(fd, &hdr, sizeof hdr, 0) != (ssize_t)sizeof hdr)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "the segment brought back has no header");
    uint32_t version = sp_protocol_seg_version(protocol);
    if (hdr.magic != SP_SEG_MAGIC || hdr.version != version || hdr.sq_entries < SP_SQ_MIN_ENTRIES ||
        hdr.sq_entries > SP_SQ_MAX_ENTRIES || (hdr.sq_entries & (hdr.sq_entries - 1)) != 0)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "the segment brought back is not one of protocol %u (layout %u, "
                          "%u SQ entries)", protocol, hdr.version, hdr.sq_entries);
    if (hdr.arena_bytes > (uint64_t)eng->cfg->max_arena_bytes)
        return sp_err_set(e, SPC_ERR_LIMIT, "the segment brought back has an arena of %" PRIu64 " bytes, more than "
                          "max_arena_bytes (%" PRId64 ")", hdr.arena_bytes, eng->cfg->max_arena_bytes);
    sp_seg_layout(&want, version, hdr.sq_entries, hdr.arena_bytes);
    want.client_id = hdr.client_id;
    if (memcmp(&want, &hdr, sizeof hdr) != 0 || (uint64_t)st.st_size != want.segment_bytes)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "the segment brought back is not laid out as spd lays out its "
                          "segments");
    *layout_p = want;
    return SPC_OK;
}

spc_status_t sp_client_adopt(sp_engine_t *eng, pid_t pid, int pidfd, uid_t uid, gid_t gid, const char *name,
                             uint32_t protocol, int seg_fd, sp_client_t **c_p, sp_err_t *e)
{
    sp_client_t *c;
    SP_CHECK(client_new(eng, pid, pidfd, uid, gid, name, protocol, &c, e));
    spc_status_t st;
    c->seg_fd = (int)syscall(SYS_pidfd_getfd, pidfd, seg_fd, 0);
    if (c->seg_fd < 0) {
        st = sp_err_set(e, SPC_ERR_PERMISSION, "spd may not take the segment's descriptor %d of pid %d "
                        "(pidfd_getfd: %s)", seg_fd, (int)pid, strerror(errno));
        goto err_unmake;
    }
    /* Descriptors outlive an exec: taken from the program that connected only if it still runs now. */
    if ((st = sp_mem_reachable(c, e)) != SPC_OK || (st = segment_check(eng, c->seg_fd, protocol, &c->layout, e)) !=
        SPC_OK)
        goto err_unmake;
    c->layout.client_id = c->id;
    if ((st = client_install(eng, c, e)) != SPC_OK)
        goto err_unmake;
    /* The rings go on from where the client left them: it emptied its SQ
     * and took every completion before it came (its word, checked on each
     * use as any counter of its is). */
    c->sq_head = sp_load_acquire(&c->v.sq->head);
    c->cq_tail = sp_load_acquire(&c->v.cq->tail);
    *c_p = c;
    return SPC_OK;

err_unmake:
    client_unmake(eng, c);
    return st;
}

static void client_free(sp_engine_t *eng, sp_client_t *c);

void sp_client_destroy(sp_engine_t *eng, sp_client_t *c, const char *why)
{
    if (c == NULL)
        return;
    sp_client_t **pp = &eng->clients;
    while (*pp != NULL && *pp != c)
        pp = &(*pp)->next;
    if (*pp == c) {
        *pp = c->next;
        eng->nclients--;
    }
    wake_fd_close(eng, c->wake_fd);
    c->wake_fd = -1;
    /* Nothing waits for its streams any more (tasks of it on a GPU run out). */
    SP_TRANSPORT_CALL(eng->gpu_ops, client_gone, eng, c);
    /* Breaking its groups completes (and frees) every op of this client that waits
     * in a collective; ops of the others complete with PEER_LOST. */
    if (c->job != NULL)
        sp_job_member_lost(eng, c, why);
    sp_job_creator_gone(eng, c->id);

    sp_info(MEM, "client %" PRIu64 " (pid %d) released: %s; %u regions, %" PRIu64 " ops",
            c->id, (int)c->pid, why, c->nregions, c->ops_submitted);
    /* Its regions go now; an import of its GPU memory that a running task
     * still uses closes when that task lets go of it. */
    sp_regions_release(eng, c);
    if (c->pins > 0) {
        /* A task still copies into or out of its arena: free it with the last pin. */
        c->zombie = true;
        c->next = eng->zombies;
        eng->zombies = c;
        return;
    }
    client_free(eng, c);
}

static void client_free(sp_engine_t *eng, sp_client_t *c)
{
    while (c->cq_overflow != NULL) {
        sp_cq_pending_t *p = c->cq_overflow;
        c->cq_overflow = p->next;
        free(p);
    }
    /* Its streams, and their semaphores registered with CUDA: nothing of it runs now. */
    SP_TRANSPORT_CALL(eng->gpu_ops, client_free, c);
    free(c->regions);
    free(c->memb);
    if (c->v.base != NULL && !c->sems_kept)
        munmap(c->v.base, c->layout.segment_bytes);
    if (c->seg_fd >= 0)
        close(c->seg_fd);
    if (c->mem_fd >= 0)
        close(c->mem_fd);
    free(c);
}

void sp_client_unpin(sp_engine_t *eng, sp_client_t *c)
{
    if (--c->pins > 0 || !c->zombie)
        return;
    sp_client_t **pp = &eng->zombies;
    while (*pp != NULL && *pp != c)
        pp = &(*pp)->next;
    if (*pp == c)
        *pp = c->next;
    client_free(eng, c);
}

/* ---------------------------------------------------------------- completions */

/* Writes one CQE. Returns false when the CQ is full. */
static bool cq_try_post(sp_engine_t *eng, sp_client_t *c, const struct sp_cqe *cqe, const char *detail)
{
    uint32_t used = sp_ring_used(c->v.cq, c->cq_tail);
    if (used > c->layout.cq_entries) {
        sp_engine_doom(eng, c, SPC_ERR_PROTOCOL, "completion ring head out of range");
        return true;   /* dropped: the client is going */
    }
    if (used == c->layout.cq_entries)
        return false;

    uint32_t idx = c->cq_tail & c->cq_mask;
    struct sp_cqe out = *cqe;
    if (detail != NULL && detail[0] != '\0') {
        snprintf(c->v.cq_detail + (size_t)idx * SP_DETAIL_BYTES, SP_DETAIL_BYTES, "%s", detail);
        out.flags |= SP_CQE_F_DETAIL;
    }
    c->v.cqes[idx] = out;
    c->cq_tail++;
    /* Release: the entry and its detail text are visible before the new tail. */
    sp_store_release(&c->v.cq->tail, c->cq_tail);
    return true;
}

/* After posting: wake the client if it said it sleeps. The full barrier orders our
 * tail store before the flag load; the client orders its flag store before its
 * re-check of the tail. One of the two sees the other. */
static void cq_wake_now(sp_engine_t *eng, sp_client_t *c)
{
    sp_smp_mb();
    uint32_t waiting = sp_load_relaxed(&c->v.wake->cq_waiting);
    if (waiting != 0) {
        sp_futex_bump_wake(&c->v.wake->cq_futex);
        if ((int)waiting - 1 == eng->progress_cpu)
            eng->stacked = true;
    }
}

static void cq_wake(sp_engine_t *eng, sp_client_t *c)
{
    if (eng->wake_hold == 0) {
        cq_wake_now(eng, c);
    } else if (!c->wake_due) {
        c->wake_due = true;
        c->wake_next = eng->wake_due;
        eng->wake_due = c;
    }
}

void sp_engine_wakes_hold(sp_engine_t *eng)
{
    eng->wake_hold++;
}

void sp_engine_wakes_release(sp_engine_t *eng)
{
    if (--eng->wake_hold > 0)
        return;
    while (eng->wake_due != NULL) {
        sp_client_t *c = eng->wake_due;
        eng->wake_due = c->wake_next;
        c->wake_due = false;
        cq_wake_now(eng, c);
    }
}

static void cq_flush_overflow(sp_engine_t *eng, sp_client_t *c)
{
    bool posted = false;
    while (c->cq_overflow != NULL) {
        sp_cq_pending_t *p = c->cq_overflow;
        if (!cq_try_post(eng, c, &p->cqe, p->detail))
            break;
        c->cq_overflow = p->next;
        if (c->cq_overflow == NULL)
            c->cq_overflow_tail = NULL;
        c->cq_overflow_count--;
        free(p);
        posted = true;
    }
    if (posted)
        cq_wake(eng, c);
}

static void cq_post(sp_engine_t *eng, sp_client_t *c, const struct sp_cqe *cqe, const char *detail)
{
    if (c->cq_overflow == NULL && cq_try_post(eng, c, cqe, detail)) {
        cq_wake(eng, c);
        return;
    }
    /* The client has not reaped: keep the completion in order behind the others.
     * sq_consume keeps inflight + cq_overflow_count <= cq_entries, so this list
     * never holds more than one ring's worth. */
    sp_cq_pending_t *p = calloc(1, sizeof *p);
    if (p == NULL) {
        sp_engine_doom(eng, c, SPC_ERR_PROTOCOL, "out of memory queueing a completion");
        return;
    }
    p->cqe = *cqe;
    if (detail != NULL && detail[0] != '\0') {
        snprintf(p->detail, sizeof p->detail, "%s", detail);
        p->cqe.flags |= SP_CQE_F_DETAIL;
    }
    if (c->cq_overflow_tail != NULL)
        c->cq_overflow_tail->next = p;
    else
        c->cq_overflow = p;
    c->cq_overflow_tail = p;
    c->cq_overflow_count++;
}

void sp_op_complete(sp_engine_t *eng, sp_op_t *op, spc_status_t status, const char *detail)
{
    sp_client_t *c = op->client;
    struct sp_cqe cqe = { .user_data = op->sqe.user_data, .status = status };

    sp_stats_release(eng, op);   /* counted by its collective, or on its own, before this */
    if (c == NULL) {   /* a rank of another daemon: its own daemon completes it there */
        SP_TRANSPORT_CALL(eng->net_ops, op_release, op);
        free(op);
        return;
    }
    if (status != SPC_OK) {
        c->ops_failed++;
        eng->ops_failed++;
        sp_debug(OP, "client %" PRIu64 " op %u -> %s: %s", c->id, op->sqe.opcode,
                 spc_status_name(status), detail ? detail : "");
    }
    c->ops_completed++;
    c->inflight--;
    if (!c->zombie) {   /* nobody reads a zombie's ring */
        cq_post(eng, c, &cqe, detail);
        sp_mem_drop_if_gone(eng, c);   /* answered: now it may go */
    }
    if (op->in_window && !op->started)   /* its stream is owed a done, in order */
        SP_TRANSPORT_CALL(eng->gpu_ops, op_unstarted, eng, op);
    free(op);
}

/* ---------------------------------------------------------------- submissions */

void sp_op_copy_in(sp_op_t *op, const struct sp_sqe *sqe, const struct sp_sq_slot *slot)
{
    /* Copy first, look later: the client can rewrite the slot at any time. */
    memcpy(&op->sqe, sqe, sizeof op->sqe);
    uint32_t nt = op->sqe.ntensors;
    if (nt > slot->max_tensors)
        nt = slot->max_tensors;   /* sp_op_dispatch refuses the op past SP_MAX_TENSORS; copy only what exists */
    memcpy(op->tensor, slot->tensor, nt * sizeof op->tensor[0]);
    if (op->sqe.param_bytes > 0) {
        uint32_t pb = op->sqe.param_bytes < slot->max_params ? op->sqe.param_bytes : slot->max_params;
        memcpy(op->params.raw, slot->params, pb);
    }
}

/* A stream-ordered op takes its place on its client stream. Streams are the
 * GPU layer's: without it, no client has one. */
static void stream_consume(sp_engine_t *eng, sp_op_t *op)
{
    if (eng->gpu_ops != NULL) {
        eng->gpu_ops->op_consume(eng, op);
        return;
    }
    sp_err_set(&op->local, SPC_ERR_INVALID_ARG, "the op names stream %u, which this client does not have",
               op->sqe.stream - 1);
}

/* Consumes what the client published on its SQ. Returns the number of entries. */
static int sq_consume(sp_engine_t *eng, sp_client_t *c)
{
    /* Acquire: the entries and argument slots written before the client's tail
     * store are visible. */
    uint32_t tail = sp_load_acquire(&c->v.sq->tail);
    uint32_t ready = tail - c->sq_head;
    int n = 0;

    if (ready == 0)
        return 0;
    if (ready > c->layout.sq_entries) {
        sp_engine_doom(eng, c, SPC_ERR_PROTOCOL, "submission ring tail out of range");
        return 0;
    }
    /* Back-pressure: never take more than the CQ can hold completions for. The
     * rest stays on the SQ; a full SQ makes the client's submit say so. */
    while (ready > 0 && c->inflight + c->cq_overflow_count < c->layout.cq_entries) {
        uint32_t idx = c->sq_head & c->sq_mask;
        sp_op_t *op = calloc(1, sizeof *op);
        if (op == NULL) {
            sp_error(RING, "out of memory taking an op from client %" PRIu64, c->id);
            break;
        }
        op->client = c;
        op->arrive_ns = eng->stats.clock_ns = sp_now_ns();
        struct sp_sq_slot slot = sp_seg_slot(&c->v, idx);
        sp_op_copy_in(op, &c->v.sqes[idx], &slot);
        c->sq_head++;
        /* Release: our reads of the slot are done before the client may reuse it. */
        sp_store_release(&c->v.sq->head, c->sq_head);
        ready--;
        n++;
        c->inflight++;
        c->ops_submitted++;
        eng->ops_total++;
        if (op->sqe.stream != 0)
            stream_consume(eng, op);
        sp_op_dispatch(eng, op);
        if (c->doomed)
            break;
    }
    return n;
}

/* Tasks on a GPU, or waiting for their turn there: nothing rings when they can
 * move on, so the progress thread looks. */
static bool gpu_busy(sp_engine_t *eng)
{
    return eng->gpu_ops != NULL && eng->gpu_ops->busy(eng);
}

/* One pass over every client's rings. Caller holds the lock. Returns work done. */
static int progress_pass(sp_engine_t *eng, uint64_t now)
{
    int work = 0;
    for (sp_client_t *c = eng->clients; c != NULL; c = c->next) {
        if (c->doomed)
            continue;
        if (c->cq_overflow != NULL)
            cq_flush_overflow(eng, c);
        work += sq_consume(eng, c);
    }
    if (eng->net_ops != NULL)
        work += eng->net_ops->progress(eng, now);
    if (gpu_busy(eng))
        work += eng->gpu_ops->progress(eng, now);
    if (now >= eng->next_deadline_ns)
        eng->next_deadline_ns = sp_job_check_deadlines(eng, now);
    if (atomic_load_explicit(&eng->draining, memory_order_relaxed) && !eng->events.drained &&
        sp_engine_inflight_locked(eng) == 0) {
        eng->events.drained = true;
        events_notify(eng);
    }
    return work;
}

/* Whether the client has submissions the daemon can take now, or queued
 * completions that now fit. Entries held back by the in-flight cap are not work:
 * they wait for completions, which wake us (or for the client to reap, which rings). */
static bool client_has_work(const sp_client_t *c)
{
    if (c->doomed)
        return false;
    if (c->cq_overflow != NULL && sp_ring_used(c->v.cq, c->cq_tail) < c->layout.cq_entries)
        return true;
    return sp_ring_ready(c->v.sq, c->sq_head) != 0 && c->inflight + c->cq_overflow_count < c->layout.cq_entries;
}

/*
 * Arms (or disarms) every client's wake flag. When arming, looks once more and
 * returns true when something arrived meanwhile (then do not sleep).
 * Caller holds the lock.
 */
static bool progress_arm_sleep(sp_engine_t *eng, bool arm)
{
    eng->sleeping = arm;
    for (sp_client_t *c = eng->clients; c != NULL; c = c->next)
        sp_store_relaxed(&c->v.wake->sq_need_wakeup, arm ? 1u : 0u);
    if (!arm)
        return false;
    /* Full barrier: our flag stores before our tail loads. A submitter orders its
     * tail store before its flag load; so either we see its entry now, or it sees
     * our flag and wakes us. */
    sp_smp_mb();
    for (sp_client_t *c = eng->clients; c != NULL; c = c->next)
        if (client_has_work(c))
            return true;
    /* The network needs no arming here: the loop watches the worker's fd. */
    return false;
}

/*
 * Where the progress thread runs. Pinned when the operator says so
 * (progress_cpu >= 0). Otherwise it floats, but steps aside when it finds a
 * client sleeping on its own CPU: the two then take turns on one CPU (each wait
 * costs a sleep and a wake-up, ~10 us) while another CPU may idle, and the
 * kernel's wake-up placement keeps putting the client back next to the thread
 * that wakes it. Moving ourselves is the one placement the daemon owns.
 */
typedef struct placement {
    cpu_set_t allowed;
    int       ncpus;
    bool      pinned;
    uint64_t  last_move_ns;
} placement_t;

static void placement_init(sp_engine_t *eng, placement_t *pl)
{
    memset(pl, 0, sizeof *pl);
    if (sched_getaffinity(0, sizeof pl->allowed, &pl->allowed) != 0)
        CPU_ZERO(&pl->allowed);
    pl->ncpus = CPU_COUNT(&pl->allowed);
    int want = (int)eng->cfg->progress_cpu;
    if (want >= 0) {
        cpu_set_t one;
        CPU_ZERO(&one);
        CPU_SET(want, &one);
        if (sched_setaffinity(0, sizeof one, &one) == 0) {
            pl->pinned = true;
            sp_info(RING, "progress thread pinned to CPU %d", want);
        } else {
            sp_warn(RING, "cannot pin the progress thread to CPU %d: %s; it floats", want, strerror(errno));
        }
    }
}

static void placement_step_aside(placement_t *pl, int cpu, uint64_t now)
{
    if (pl->pinned || pl->ncpus < 2 || now - pl->last_move_ns < 1000000)
        return;
    pl->last_move_ns = now;
    cpu_set_t others = pl->allowed;
    CPU_CLR(cpu, &others);
    /* Narrowing the mask migrates us at once; restoring it does not move us back. */
    if (CPU_COUNT(&others) > 0 && sched_setaffinity(0, sizeof others, &others) == 0) {
        sched_setaffinity(0, sizeof pl->allowed, &pl->allowed);
        sp_debug(RING, "progress thread left CPU %d to a client waiting there, now on CPU %d", cpu, sched_getcpu());
    }
}

/* Sleeps until a wake eventfd is written or timeout_ns pass (rounded up to a
 * millisecond); returns whether it was woken. An edge that came while the
 * thread was awake wakes it at once, once: that is the submitter that saw the
 * sleep flag just before the thread went to sleep. */
static bool progress_sleep(sp_engine_t *eng, int64_t timeout_ns)
{
    struct epoll_event ev[64];
    int ms = (int)((timeout_ns + 999999) / 1000000);
    return epoll_wait(eng->wake_epfd, ev, 64, ms) > 0;
}

/* How long the progress thread polls for the network while ops wait on it. */
#define NET_SPIN_NS (1000 * 1000)
/* How often it looks at GPU tasks once it sleeps. */
#define GPU_POLL_NS (1000 * 1000)

static void *progress_main(void *arg)
{
    sp_engine_t *eng = arg;
    const int64_t spin_ns = eng->cfg->progress_spin_us * 1000;
    int64_t sleep_ns = eng->cfg->progress_sleep_ms * 1000000;
    uint64_t last_work = sp_now_ns();
    unsigned idle_spins = 0;

    if (eng->max_sleep_ns > 0 && eng->max_sleep_ns < sleep_ns)
        sleep_ns = eng->max_sleep_ns;
    sp_info(RING, "progress thread running (spin %" PRId64 " us, sleep at most %" PRId64 " ms)",
            spin_ns / 1000, sleep_ns / 1000000);

    placement_t pl;
    placement_init(eng, &pl);
    while (!atomic_load_explicit(&eng->stop, memory_order_relaxed)) {
        uint64_t now = sp_now_ns();
        int cpu = sched_getcpu();
        pthread_mutex_lock(&eng->lock);
        if (cpu != eng->progress_cpu) {
            eng->progress_cpu = cpu;
            for (sp_client_t *c = eng->clients; c != NULL; c = c->next)
                sp_store_relaxed(&c->v.wake->progress_cpu, (uint32_t)cpu);
        }
        int work = progress_pass(eng, now);
        /* Data moves with the lock dropped; tasks run one at a time, in order.
         * Device tasks go to the GPU layer, on the GPU's stream, and complete
         * later; those with ranks on other daemons go on, in their stream
         * order, to the NCCL thread, which runs them on its own lanes. */
        for (sp_task_t *t; (t = sp_task_next(eng)) != NULL; work++) {
            sp_stats_task_started(eng, t);
            if (sp_task_device(t) || sp_task_xdev(t)) {   /* only a GPU layer's regions make them */
                eng->gpu_ops->task_ready(eng, t);
                continue;
            }
            pthread_mutex_unlock(&eng->lock);
            sp_task_run(eng, t);
            pthread_mutex_lock(&eng->lock);
            sp_task_finish(eng, t);
        }
        uint64_t deadline = eng->next_deadline_ns;
        bool stacked = eng->stacked;
        eng->stacked = false;
        /* Ops in flight with another daemon in the job: what they wait for comes
         * over the network, and waking to it costs two thread switches (the
         * worker's fd wakes the loop, the loop rings us). Keep polling a while. */
        bool net_wait = work == 0 && eng->net_ops != NULL && sp_engine_inflight_locked(eng) > 0;
        /* Tasks on a GPU: nothing rings when their kernels are done, so look now
         * and then (their ranks' streams do not wait for this: only the CQ does). */
        bool gpu_wait = gpu_busy(eng);
        pthread_mutex_unlock(&eng->lock);
        atomic_fetch_add_explicit(&eng->heartbeat, 1, memory_order_relaxed);
        if (stacked)
            placement_step_aside(&pl, cpu, now);

        if (work > 0) {
            last_work = now;
            idle_spins = 0;
            continue;
        }
        if ((int64_t)(now - last_work) < (net_wait || gpu_wait ? NET_SPIN_NS : spin_ns)) {
            /* With more spinners than cores (ranks waiting, this thread polling),
             * give the others the CPU now and then. */
            if ((++idle_spins & 63) == 0)
                sched_yield();
            else
                sp_cpu_relax();
            continue;
        }

        /* Idle: sleep until a submitter wakes us, a deadline comes, or the cap. */
        sp_task_stage_trim(eng, now, false);
        pthread_mutex_lock(&eng->lock);
        bool pending = progress_arm_sleep(eng, true);
        pthread_mutex_unlock(&eng->lock);
        bool woken = false;
        if (!pending && !atomic_load(&eng->stop)) {
            int64_t t = gpu_wait && sleep_ns > GPU_POLL_NS ? GPU_POLL_NS : sleep_ns;
            if (deadline != UINT64_MAX) {
                int64_t until = (int64_t)(deadline - now);
                if (until < t)
                    t = until > 0 ? until : 0;
            }
            if (t > 0)
                woken = progress_sleep(eng, t);
        }
        pthread_mutex_lock(&eng->lock);
        progress_arm_sleep(eng, false);
        pthread_mutex_unlock(&eng->lock);
        /* Spin a little after a wake-up: more is likely coming. Not after a GPU
         * poll's timeout, or a long kernel would keep this thread spinning. */
        if (!gpu_wait || woken)
            last_work = sp_now_ns();
        idle_spins = 0;
    }
    return NULL;
}

/*
 * The progress thread and the copy workers block every signal (they inherit the
 * mask in force while they are created): the signals spd acts on are read by the
 * loop (ctl/server.c), and any other one the kernel may give to any thread should
 * not land on one asleep in a raw futex wait, where a sanitizer's runtime would
 * hold it until the thread's next intercepted call.
 */
int sp_engine_start(sp_engine_t *eng)
{
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = sp_workers_start(eng);
    if (rc == 0 && (rc = pthread_create(&eng->thread, NULL, progress_main, eng)) != 0)
        sp_error(RING, "cannot start the progress thread: %s", strerror(rc));
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0)
        return -1;
    pthread_setname_np(eng->thread, "spd-progress");
    eng->thread_started = true;
    return 0;
}

/* The progress thread, between two passes, then the copy workers. */
static void engine_threads_stop(sp_engine_t *eng)
{
    atomic_store(&eng->stop, true);
    sp_engine_kick(eng);
    pthread_join(eng->thread, NULL);
    eng->thread_started = false;
    sp_workers_stop(eng);
}

void sp_engine_stop(sp_engine_t *eng)
{
    if (!eng->thread_started)
        return;
    engine_threads_stop(eng);
    /* Ops still with NCCL fail with SHUTTING_DOWN and complete (the NCCL
     * thread takes the lock for that: nobody else holds it now). */
    SP_TRANSPORT_CALL(eng->xdev_ops, stop, eng);
}

void sp_engine_halt(sp_engine_t *eng)
{
    if (eng->thread_started)
        engine_threads_stop(eng);
    /* An op whose exchange is under way may complete on the other daemons:
     * it completes here too, or its ranks here would replay an op those
     * daemons are past. */
    SP_TRANSPORT_CALL(eng->xdev_ops, halt, eng);
    /* The NCCL thread completes a task under this lock: held to the exit, it
     * completes no more, and the clients replay the rest to the next spd. */
    pthread_mutex_lock(&eng->lock);
}
