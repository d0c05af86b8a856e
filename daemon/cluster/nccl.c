/*
 * nccl.c — NCCL communicators for device ops across daemons (sp_nccl.h): sets
 * up, runs the thread's loop and takes what the other threads hand it (works,
 * ids, lost daemons, ended groups); nccl_work.c loads the library and runs each
 * work phase by phase; nccl_int.h is what they share. NCCL is dlopened on
 * first use; without it, sp_nccl_usable refuses those ops up front. No thread
 * waits for the GPU or another daemon: all poll. Phases, failures, ids, the
 * CUDA calls that may wait, NCCL_HOSTID: docs/architecture.md, "GPU memory
 * across daemons".
 */
#include "cluster/sp_nccl.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "cluster/nccl_int.h"
#include "cluster/xdev.h"
#include "core/engine.h"
#include "core/job.h"
#include "core/transport.h"

/* ================================================================ set-up, any build */

/* What the engine asks of device ops across daemons (core/transport.h). */
static const sp_transport_ops_t nccl_ops = {
    .stop            = sp_nccl_stop,
    .cleanup         = sp_nccl_cleanup,
    .usable          = sp_nccl_usable,
    .node_lost       = sp_nccl_node_lost,
    .node_held       = sp_nccl_node_held,
    .halt            = sp_nccl_halt,
    .job_node_back   = sp_nccl_job_node_back,
    .job_node_lost   = sp_nccl_job_node_lost,
    .group_gone      = sp_nccl_group_gone,
    .task_attach     = sp_xdev_attach,
    .task_detach     = sp_xdev_detach,
    .task_ready      = sp_xdev_submit,
    .task_stream     = sp_xdev_stream,
    .task_give_up    = sp_xdev_give_up,
    .task_back       = sp_xdev_back,
    .task_wrote_done = sp_xdev_wrote_done,
    .task_leaks      = sp_xdev_leaks,
};

void sp_nccl_setup(sp_engine_t *eng, const char *library, const char *probe, int gpus)
{
    sp_nccl_t *n = calloc(1, sizeof *n);
    if (n == NULL) {
        sp_error(XPORT, "out of memory setting up NCCL");
        return;
    }
    pthread_mutex_init(&n->lock, NULL);
    pthread_cond_init(&n->wake, NULL);
    n->eng = eng;
    snprintf(n->library, sizeof n->library, "%s", library != NULL ? library : "");
#if !defined(SP_HAVE_CUDA)
    snprintf(n->why, sizeof n->why, "spd was built without CUDA");
#elif !defined(SP_HAVE_NCCL)
    snprintf(n->why, sizeof n->why, "spd was built without NCCL (no nccl.h where the build looked)");
#else
    bool have = probe != NULL && strncmp(probe, "found", 5) == 0;
    if (gpus <= 0) {
        snprintf(n->why, sizeof n->why, "no GPU on node %s", eng->node);
    } else if (!have) {
        snprintf(n->why, sizeof n->why, "NCCL %s on node %s", probe != NULL ? probe : "not probed", eng->node);
        n->why_is_probe = true;
    }
    /* Before any thread (UCX's, NCCL's) reads the environment. */
    if (getenv("NCCL_HOSTID") == NULL) {
        setenv("NCCL_HOSTID", eng->node, 1);
        sp_info(XPORT, "NCCL_HOSTID=%s: NCCL sees each daemon as a host of its own", eng->node);
    } else {
        sp_info(XPORT, "NCCL_HOSTID=%s, as the environment set it", getenv("NCCL_HOSTID"));
    }
#endif
    eng->nccl = n;
    eng->xdev_ops = &nccl_ops;
    if (n->why[0] != '\0')
        sp_info(XPORT, "device ops across daemons will be refused: %s", n->why);
}

bool sp_nccl_usable(sp_engine_t *eng, sp_err_t *e)
{
    sp_nccl_t *n = eng->nccl;
    if (n == NULL) {
        sp_err_set(e, SPC_ERR_NO_DEVICE, "NCCL was not set up in this spd");
        return false;
    }
    pthread_mutex_lock(&n->lock);
    bool ok = n->why[0] == '\0';
    if (!ok)
        sp_err_set(e, SPC_ERR_NO_DEVICE, "%s", n->why);
    pthread_mutex_unlock(&n->lock);
    return ok;
}

void sp_nccl_outbox_drain(sp_engine_t *eng, sp_nccl_send_fn fn, void *arg)
{
    sp_nccl_t *n = eng->nccl;
    if (n == NULL)
        return;
    pthread_mutex_lock(&n->lock);
    outmsg_t *list = n->outbox;
    n->outbox = NULL;
    pthread_mutex_unlock(&n->lock);
    /* Oldest first: they were pushed at the head. */
    outmsg_t *rev = NULL;
    while (list != NULL) {
        outmsg_t *m = list;
        list = m->next;
        m->next = rev;
        rev = m;
    }
    while (rev != NULL) {
        outmsg_t *m = rev;
        rev = m->next;
        fn(arg, m->node, m->job, m->group_index, m->channel, m->seq, m->id, sizeof m->id);
        free(m);
    }
}

void sp_nccl_node_up(sp_engine_t *eng, const char *node)
{
    sp_nccl_t *n = eng->nccl;
    if (n == NULL)
        return;
    pthread_mutex_lock(&n->lock);
    for (lostnode_t **pp = &n->lost; *pp != NULL;) {
        lostnode_t *l = *pp;
        if (strcmp(l->node, node) == 0) {
            *pp = l->next;
            free(l);
        } else {
            pp = &l->next;
        }
    }
    pthread_mutex_unlock(&n->lock);
}

#ifdef SP_NCCL_BUILT

/* ================================================================ the thread */

/* Goes round every communicator, one step each (nccl_work.c), until stopped. */
static void *nccl_main(void *arg)
{
    sp_nccl_t *n = arg;
    unsigned round = 0;
    pthread_mutex_lock(&n->lock);
    while (!n->stopping) {
        comm_t *list = n->comms;
        bool halting = n->halting;
        pthread_mutex_unlock(&n->lock);
        /* Only this thread unlinks communicators; others insert at the head,
         * so the list taken here stays walkable without the lock. Halting,
         * only the works in their exchange go on. */
        int busy = 0;
        bool exchanging = false;
        for (comm_t *c = list; c != NULL; c = c->next) {
            if (halting && (c->work == NULL || c->work->phase < W_LAUNCH))
                continue;
            int step = sp_nccl_comm_step(n, c);
            busy = step > busy ? step : busy;
            exchanging |= c->work != NULL && c->work->phase >= W_LAUNCH;
        }
        if (!halting)
            sp_nccl_reap(n);
        pthread_mutex_lock(&n->lock);
        if (halting && !exchanging && !n->quiet) {
            n->quiet = true;
            pthread_cond_broadcast(&n->wake);
        }
        if (n->stopping)
            break;
        if (busy == 2)
            round = 0;   /* something moved: poll closely again */
        if (busy) {
            pthread_mutex_unlock(&n->lock);
            sp_nccl_nap(round++);
            pthread_mutex_lock(&n->lock);
        } else {
            round = 0;
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 100 * 1000000;
            if (ts.tv_nsec >= 1000000000) {
                ts.tv_sec++;
                ts.tv_nsec -= 1000000000;
            }
            pthread_cond_timedwait(&n->wake, &n->lock, &ts);
        }
    }
    pthread_mutex_unlock(&n->lock);
    sp_nccl_drain_all(n);
    return NULL;
}

/* ================================================================ from the other threads */

static bool node_in(char (*nodes)[SP_NODE_MAX], uint32_t n, const char *node)
{
    for (uint32_t i = 0; i < n; i++)
        if (strcmp(nodes[i], node) == 0)
            return true;
    return false;
}

/* The daemon of w that its job waits for, if any: one restarting (a
 * survivor's wait), or one that has not taken the job back from this
 * restarted daemon yet. No communicator can be made with it until then.
 * Engine lock held. */
static void work_held_node(sp_engine_t *eng, sp_nccl_work_t *w)
{
    sp_job_t *job = sp_job_find(eng, w->job);
    w->held_node[0] = '\0';
    for (uint32_t d = 0; job != NULL && d < w->nranks; d++) {
        uint32_t idx = d == w->me ? UINT32_MAX : sp_job_node_index(job, w->nodes[d], false);
        if (idx != UINT32_MAX && sp_job_node_waited(eng, job, idx)) {
            snprintf(w->held_node, sizeof w->held_node, "%s", w->nodes[d]);
            return;
        }
    }
}

void sp_nccl_submit(sp_engine_t *eng, sp_nccl_work_t *w)
{
    sp_nccl_t *n = eng->nccl;
    sp_err_t e = SP_ERR_INIT;
    if (!sp_nccl_usable(eng, &e)) {
        w->status = e.status;
        snprintf(w->detail, sizeof w->detail, "%s", e.msg);
        sp_xdev_done(eng, w->task);
        return;
    }
    w->next = NULL;
    w->phase = W_START;
    w->next_group = 0;
    work_held_node(eng, w);
    pthread_mutex_lock(&n->lock);
    comm_t *c = n->comms;
    while (c != NULL && (c->gone || strcmp(c->job, w->job) != 0 || c->group_index != w->group_index ||
                         c->channel != w->channel))
        c = c->next;
    if (c == NULL) {
        c = calloc(1, sizeof *c);
        if (c != NULL && (c->nodes = malloc(w->nranks * sizeof *c->nodes)) == NULL) {
            free(c);
            c = NULL;
        }
        if (c == NULL) {
            pthread_mutex_unlock(&n->lock);
            w->status = SPC_ERR_NO_MEMORY;
            snprintf(w->detail, sizeof w->detail, "daemon out of memory for an NCCL communicator");
            sp_xdev_done(eng, w->task);
            return;
        }
        snprintf(c->job, sizeof c->job, "%s", w->job);
        c->group_index = w->group_index;
        c->channel = w->channel;
        c->nranks = w->nranks;
        c->me = w->me;
        c->dev = w->dev;
        memcpy(c->nodes, w->nodes, w->nranks * sizeof *c->nodes);
        /* A daemon already gone fails it at once, naming that daemon. */
        for (lostnode_t *l = n->lost; l != NULL && c->lost[0] == '\0'; l = l->next)
            if (node_in(c->nodes, c->nranks, l->node))
                snprintf(c->lost, sizeof c->lost, "node %s lost: %s", l->node, l->why);
        c->next = n->comms;
        n->comms = c;
    }
    /* The job waits for a daemon of the op (restarting, or, restarted here,
     * not yet taken the job back): the op waits with the communicator. */
    if (w->held_node[0] != '\0' && c->lost[0] == '\0' && c->held[0] == '\0')
        snprintf(c->held, sizeof c->held, "%s", w->held_node);
    if (c->queue_tail != NULL)
        c->queue_tail->next = w;
    else
        c->queue = w;
    c->queue_tail = w;
    n->inflight++;
    bool start = !n->started;
    n->started = true;
    pthread_cond_signal(&n->wake);
    pthread_mutex_unlock(&n->lock);
    if (start) {
        int rc = pthread_create(&n->thread, NULL, nccl_main, n);
        if (rc != 0) {
            sp_error(XPORT, "cannot start the NCCL thread: %s", strerror(rc));
            pthread_mutex_lock(&n->lock);
            n->started = false;
            snprintf(n->why, sizeof n->why, "spd could not start its NCCL thread: %s", strerror(rc));
            /* Take the work back out; it fails here. */
            c->queue = c->queue_tail = NULL;
            n->inflight--;
            pthread_mutex_unlock(&n->lock);
            w->status = SPC_ERR_NO_DEVICE;
            snprintf(w->detail, sizeof w->detail, "spd could not start its NCCL thread");
            sp_xdev_done(eng, w->task);
            return;
        }
        pthread_setname_np(n->thread, "spd-nccl");
    }
}

void sp_nccl_halt(sp_engine_t *eng)
{
    sp_nccl_t *n = eng->nccl;
    if (n == NULL)
        return;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += SP_NCCL_HALT_MS / 1000;
    pthread_mutex_lock(&n->lock);
    n->halting = true;
    pthread_cond_broadcast(&n->wake);
    while (n->started && !n->quiet && pthread_cond_timedwait(&n->wake, &n->lock, &until) == 0)
        ;
    if (n->started && !n->quiet)
        sp_warn(XPORT, "stopping for a restart: an op across daemons still exchanges after %d ms; its ranks replay it",
                SP_NCCL_HALT_MS);
    pthread_mutex_unlock(&n->lock);
}

void sp_nccl_stop(sp_engine_t *eng)
{
    sp_nccl_t *n = eng->nccl;
    if (n == NULL)
        return;
    pthread_mutex_lock(&n->lock);
    bool started = n->started;
    n->stopping = true;
    pthread_cond_signal(&n->wake);
    pthread_mutex_unlock(&n->lock);
    if (started)
        pthread_join(n->thread, NULL);
    n->started = false;
}

void sp_nccl_id_arrived(sp_engine_t *eng, const char *from, const char *job_id, uint32_t group_index,
                        uint32_t channel, uint64_t seq, const void *id, size_t len)
{
    sp_nccl_t *n = eng->nccl;
    sp_job_t *job = sp_job_find(eng, job_id);
    sp_group_t *g = job != NULL ? sp_job_group_by_index(job, group_index) : NULL;
    if (n == NULL || g == NULL || len != SP_NCCL_ID_BYTES || channel >= SP_CHANNELS) {
        sp_warn(XPORT, "node %s: an NCCL id for job %s group %u channel %u that is not here; dropped", from, job_id,
                group_index, channel);
        return;
    }
    /* Only the group's lowest daemon makes ids. */
    const char *lowest = job->nodes[0];
    for (uint32_t k = 0; k < g->nremote; k++)
        if (strcmp(job->nodes[g->remote[k]], lowest) < 0)
            lowest = job->nodes[g->remote[k]];
    if (strcmp(from, lowest) != 0) {
        sp_warn(XPORT, "node %s sent an NCCL id for job %s group %u, whose ids node %s makes; dropped", from, job_id,
                group_index, lowest);
        return;
    }
    mbox_t *m = calloc(1, sizeof *m);
    if (m == NULL) {
        sp_error(XPORT, "out of memory keeping an NCCL id from node %s", from);
        return;
    }
    snprintf(m->job, sizeof m->job, "%s", job_id);
    m->group_index = group_index;
    m->channel = channel;
    m->seq = seq;
    memcpy(m->id, id, sizeof m->id);
    pthread_mutex_lock(&n->lock);
    m->next = n->mbox;
    n->mbox = m;
    pthread_cond_signal(&n->wake);
    pthread_mutex_unlock(&n->lock);
    sp_debug(XPORT, "node %s: NCCL id for job %s group %u channel %u from op #%" PRIu64, from, job_id, group_index,
             channel, seq);
}

void sp_nccl_node_lost(sp_engine_t *eng, const char *node, const char *why)
{
    sp_nccl_t *n = eng->nccl;
    if (n == NULL)
        return;
    lostnode_t *l = calloc(1, sizeof *l);
    pthread_mutex_lock(&n->lock);
    if (l != NULL) {
        snprintf(l->node, sizeof l->node, "%s", node);
        snprintf(l->why, sizeof l->why, "%s", why);
        l->next = n->lost;
        n->lost = l;
    }
    for (comm_t *c = n->comms; c != NULL; c = c->next)
        if (c->lost[0] == '\0' && node_in(c->nodes, c->nranks, node))
            snprintf(c->lost, sizeof c->lost, "node %s lost: %s", node, why);
    pthread_cond_signal(&n->wake);
    pthread_mutex_unlock(&n->lock);
}

/* Drops the ids kept for c's channel (their maker went). Lock held. */
static void mbox_drop(sp_nccl_t *n, const comm_t *c)
{
    for (mbox_t **pp = &n->mbox; *pp != NULL;) {
        mbox_t *m = *pp;
        if (m->group_index == c->group_index && m->channel == c->channel && strcmp(m->job, c->job) == 0) {
            *pp = m->next;
            free(m);
        } else {
            pp = &m->next;
        }
    }
}

void sp_nccl_group_gone(sp_engine_t *eng, const char *job, uint32_t group_index)
{
    sp_nccl_t *n = eng->nccl;
    if (n == NULL)
        return;
    pthread_mutex_lock(&n->lock);
    for (comm_t *c = n->comms; c != NULL; c = c->next) {
        if (c->group_index == group_index && strcmp(c->job, job) == 0) {
            c->gone = true;
            mbox_drop(n, c);
        }
    }
    pthread_cond_signal(&n->wake);
    pthread_mutex_unlock(&n->lock);
}

void sp_nccl_node_held(sp_engine_t *eng, const char *node, const char *why)
{
    sp_nccl_t *n = eng->nccl;
    if (n == NULL)
        return;
    pthread_mutex_lock(&n->lock);
    for (comm_t *c = n->comms; c != NULL; c = c->next) {
        if (c->lost[0] != '\0' || c->held[0] != '\0' || !node_in(c->nodes, c->nranks, node))
            continue;
        snprintf(c->held, sizeof c->held, "%s", node);
        /* An id that daemon's old run made is for a communicator that is no more. */
        mbox_drop(n, c);
        sp_info(XPORT, "job %s group %u channel %u: node %s went (%s); its ops wait for it to take the job back",
                c->job, c->group_index, c->channel, node, why);
    }
    pthread_cond_signal(&n->wake);
    pthread_mutex_unlock(&n->lock);
}

bool sp_nccl_has_op(sp_engine_t *eng, const char *job, uint32_t group_index, uint32_t channel, uint64_t seq)
{
    sp_nccl_t *n = eng->nccl;
    bool has = false;
    if (n == NULL)
        return false;
    pthread_mutex_lock(&n->lock);
    for (comm_t *c = n->comms; c != NULL && !has; c = c->next) {
        if (c->group_index != group_index || c->channel != channel || strcmp(c->job, job) != 0)
            continue;
        has = c->work != NULL && c->work->seq == seq;
        for (const sp_nccl_work_t *w = c->queue; w != NULL && !has; w = w->next)
            has = w->seq == seq;
    }
    pthread_mutex_unlock(&n->lock);
    return has;
}

void sp_nccl_job_node_back(sp_engine_t *eng, const char *job, const char *node)
{
    sp_nccl_t *n = eng->nccl;
    if (n == NULL)
        return;
    pthread_mutex_lock(&n->lock);
    for (comm_t *c = n->comms; c != NULL; c = c->next)
        if (strcmp(c->held, node) == 0 && strcmp(c->job, job) == 0)
            c->held[0] = '\0';
    pthread_cond_signal(&n->wake);
    pthread_mutex_unlock(&n->lock);
}

void sp_nccl_job_node_lost(sp_engine_t *eng, const char *job, const char *node, const char *why)
{
    sp_nccl_t *n = eng->nccl;
    if (n == NULL)
        return;
    pthread_mutex_lock(&n->lock);
    for (comm_t *c = n->comms; c != NULL; c = c->next) {
        if (strcmp(c->job, job) != 0 || !node_in(c->nodes, c->nranks, node))
            continue;
        if (c->lost[0] == '\0')
            snprintf(c->lost, sizeof c->lost, "%s", why);
        c->held[0] = '\0';
    }
    pthread_cond_signal(&n->wake);
    pthread_mutex_unlock(&n->lock);
}

#else /* !SP_NCCL_BUILT: ops across daemons on GPU memory are refused (sp_nccl_usable says why). */

struct comm {
    comm_t *next;   /* never made: the list stays empty */
};

void sp_nccl_submit(sp_engine_t *eng, sp_nccl_work_t *w)
{
    sp_err_t e = SP_ERR_INIT;
    sp_nccl_usable(eng, &e);
    w->status = e.status;
    snprintf(w->detail, sizeof w->detail, "%s", e.msg);
    sp_xdev_done(eng, w->task);
}

void sp_nccl_stop(sp_engine_t *eng) {}
void sp_nccl_halt(sp_engine_t *eng) {}

void sp_nccl_id_arrived(sp_engine_t *eng, const char *from, const char *job, uint32_t group_index, uint32_t channel,
                        uint64_t seq, const void *id, size_t len)
{
    sp_warn(XPORT, "node %s sent an NCCL id; this spd has no NCCL", from);
}

void sp_nccl_node_lost(sp_engine_t *eng, const char *node, const char *why) {}
void sp_nccl_group_gone(sp_engine_t *eng, const char *job, uint32_t group_index) {}
void sp_nccl_node_held(sp_engine_t *eng, const char *node, const char *why) {}
bool sp_nccl_has_op(sp_engine_t *eng, const char *job, uint32_t group_index, uint32_t channel, uint64_t seq)
{
    return false;
}
void sp_nccl_job_node_back(sp_engine_t *eng, const char *job, const char *node) {}
void sp_nccl_job_node_lost(sp_engine_t *eng, const char *job, const char *node, const char *why) {}

#endif /* SP_NCCL_BUILT */

/* ================================================================ any build */

void sp_nccl_give_up(sp_nccl_work_t *w)
{
    w->given_up = true;
#ifdef SP_NCCL_BUILT
    /* Pinned memory the lane copies from once its waits pass, which they do
     * only after the caller poisons the ready: this store is seen there. */
    volatile hdr_t *out = w->hdr_out;
    for (uint32_t p = 0; out != NULL && p < w->hdr_count; p++)
        out[p].flags |= HDR_GIVEN_UP;
    __atomic_thread_fence(__ATOMIC_RELEASE);
#endif
}

sp_nccl_counts_t sp_nccl_counts(sp_engine_t *eng)
{
    sp_nccl_t *n = eng->nccl;
    sp_nccl_counts_t k = { 0 };
    if (n == NULL)
        return k;
    pthread_mutex_lock(&n->lock);
    k.comms = n->ncomms;
    k.inflight = n->inflight;
    k.held = n->held;
    k.rerun = n->rerun;
    k.held_failed = n->held_failed;
    pthread_mutex_unlock(&n->lock);
    return k;
}

void sp_nccl_status(sp_engine_t *eng, const char *probe, char *text, size_t len)
{
    sp_nccl_t *n = eng->nccl;
    if (n == NULL) {
        snprintf(text, len, "%s", probe);
        return;
    }
    pthread_mutex_lock(&n->lock);
    if (n->why[0] != '\0' && n->why_is_probe)
        snprintf(text, len, "%s; device ops across daemons refused", probe);
    else if (n->why[0] != '\0')
        snprintf(text, len, "%s; device ops across daemons refused: %s", probe, n->why);
    else if (n->version != 0)
        snprintf(text, len, "NCCL %d.%d.%d loaded; carries device ops across daemons", n->version / 10000,
                 (n->version / 100) % 100, n->version % 100);
    else
        snprintf(text, len, "%s; carries device ops across daemons (loaded on the first)", probe);
    pthread_mutex_unlock(&n->lock);
}

void sp_nccl_cleanup(sp_engine_t *eng)
{
    sp_nccl_t *n = eng->nccl;
    if (n == NULL)
        return;
    while (n->mbox != NULL) {
        mbox_t *m = n->mbox;
        n->mbox = m->next;
        free(m);
    }
    while (n->outbox != NULL) {
        outmsg_t *m = n->outbox;
        n->outbox = m->next;
        free(m);
    }
    while (n->lost != NULL) {
        lostnode_t *l = n->lost;
        n->lost = l->next;
        free(l);
    }
    /* Communicators went with the thread (sp_nccl_stop); any left never ran. */
    while (n->comms != NULL) {
        comm_t *c = n->comms;
        n->comms = c->next;
#ifdef SP_NCCL_BUILT
        free(c->nodes);
#endif
        free(c);
    }
    pthread_mutex_destroy(&n->lock);
    pthread_cond_destroy(&n->wake);
    free(n);
    eng->nccl = NULL;
    eng->xdev_ops = NULL;
}
