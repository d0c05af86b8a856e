/*
 * nccl_work.c — the NCCL thread's work (sp_nccl.h, nccl.c say why it is
 * built so): the library, loaded on the first work; each communicator, made
 * from the id its rank 0 sent, on a lane and header blocks of its GPU; and
 * each work on it, phase by phase (start, wait for the id, init, launch,
 * enqueue, run, grace), handed back to exec.c with its status. Every
 * function here runs on the thread; the state the others share is under the
 * module's mutex.
 */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/log.h"
#include "cluster/nccl_int.h"
#include "cluster/xdev.h"
#include "core/engine.h"
#include "core/ops.h"

#ifdef SP_NCCL_BUILT

/* ================================================================ the library */

#define GROUP_MAX     256u                        /* transfers per NCCL group */
#define GRACE_NS      (2000ull * 1000000ull)      /* to hear of a lost daemon after an NCCL error */
#define DRAIN_NS      (10000ull * 1000000ull)     /* for a stream to drain after an abort */
#define HDR_MAGIC     0x7370686eu                 /* "sphn" */
#define NCCL_OLDEST   NCCL_VERSION(2, 14, 0)      /* non-blocking communicators, ncclCommInitRankConfig */

static struct {
    ncclResult_t (*get_version)(int *);
    ncclResult_t (*get_unique_id)(ncclUniqueId *);
    ncclResult_t (*init)(ncclComm_t *, int, ncclUniqueId, int, ncclConfig_t *);
    ncclResult_t (*async_error)(ncclComm_t, ncclResult_t *);
    ncclResult_t (*abort)(ncclComm_t);
    ncclResult_t (*destroy)(ncclComm_t);
    ncclResult_t (*group_start)(void);
    ncclResult_t (*group_end)(void);
    ncclResult_t (*send)(const void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    ncclResult_t (*recv)(void *, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t);
    const char  *(*error_string)(ncclResult_t);
    const char  *(*last_error)(ncclComm_t);
} nc;

/* Loads the library (the thread, on its first work). Returns false with n->why set. */
static bool nccl_load(sp_nccl_t *n)
{
    const char *names[3];
    int k = 0;
    if (n->library[0] != '\0') {
        names[k++] = n->library;   /* the operator's choice, and only it */
    } else {
#ifdef SP_NCCL_LIBRARY
        names[k++] = SP_NCCL_LIBRARY;
#endif
        names[k++] = "libnccl.so.2";
    }
    void *lib = NULL;
    char err[160] = "";
    for (int i = 0; i < k && lib == NULL; i++) {
        lib = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
        if (lib == NULL && i == 0)
            snprintf(err, sizeof err, "%s", dlerror());
    }
    char why[sizeof n->why];
    if (lib == NULL) {
        snprintf(why, sizeof why, "cannot load NCCL: %s", err);
        goto fail;
    }
#define SYM(field, name) (*(void **)&nc.field = dlsym(lib, name))
    SYM(get_version, "ncclGetVersion");
    SYM(get_unique_id, "ncclGetUniqueId");
    SYM(init, "ncclCommInitRankConfig");
    SYM(async_error, "ncclCommGetAsyncError");
    SYM(abort, "ncclCommAbort");
    SYM(destroy, "ncclCommDestroy");
    SYM(group_start, "ncclGroupStart");
    SYM(group_end, "ncclGroupEnd");
    SYM(send, "ncclSend");
    SYM(recv, "ncclRecv");
    SYM(error_string, "ncclGetErrorString");
    SYM(last_error, "ncclGetLastError");
#undef SYM
    for (size_t i = 0; i < sizeof nc / sizeof(void *); i++) {
        if (((void **)&nc)[i] == NULL) {
            snprintf(why, sizeof why, "the NCCL library lacks the calls spd needs (NCCL 2.14 or later)");
            goto fail_close;
        }
    }
    int v = 0;
    nc.get_version(&v);
    if (v < NCCL_OLDEST) {
        snprintf(why, sizeof why, "NCCL %d.%d.%d is older than 2.14 (non-blocking communicators)", v / 10000,
                 (v / 100) % 100, v % 100);
        goto fail_close;
    }
    pthread_mutex_lock(&n->lock);
    n->version = v;
    pthread_mutex_unlock(&n->lock);
    sp_info(XPORT, "NCCL %d.%d.%d loaded: device ops across daemons", v / 10000, (v / 100) % 100, v % 100);
    return true;   /* the library stays loaded until spd exits */

fail_close:
    dlclose(lib);
    memset(&nc, 0, sizeof nc);
fail:
    sp_error(XPORT, "%s: device ops across daemons are refused from now on", why);
    pthread_mutex_lock(&n->lock);
    snprintf(n->why, sizeof n->why, "%s", why);
    n->why_is_probe = false;
    pthread_mutex_unlock(&n->lock);
    return false;
}

static const char *nccl_msg(ncclResult_t r, ncclComm_t comm)
{
    const char *last = comm != NULL && nc.last_error != NULL ? nc.last_error(comm) : NULL;
    if (last != NULL && last[0] != '\0')
        return last;
    return nc.error_string != NULL ? nc.error_string(r) : "unknown NCCL error";
}

/* ================================================================ communicators */

/* Pinned host blocks for headers, kept once made for the reason staging is (gpu.c). */
typedef struct pinned {
    struct pinned *next;
    size_t         bytes;
} pinned_t;
static pinned_t *pinned_free;   /* the thread's own */

static hdr_t *pinned_get(size_t bytes)
{
    for (pinned_t **pp = &pinned_free; *pp != NULL; pp = &(*pp)->next) {
        if ((*pp)->bytes >= bytes) {
            pinned_t *p = *pp;
            *pp = p->next;
            return (hdr_t *)p;
        }
    }
    void *p = NULL;
    size_t want = bytes < sizeof(pinned_t) ? sizeof(pinned_t) : bytes;
    sp_err_t e = SP_ERR_INIT;   /* logged where it arose */
    if (sp_gpu_pinned_alloc(want, &p, &e) != SPC_OK)
        return NULL;
    ((pinned_t *)p)->bytes = want;
    return p;
}

static void pinned_put(hdr_t *h, size_t bytes)
{
    if (h == NULL)
        return;
    pinned_t *p = (pinned_t *)h;
    p->bytes = bytes < sizeof(pinned_t) ? sizeof(pinned_t) : bytes;
    p->next = pinned_free;
    pinned_free = p;
}

static uint64_t now_ns(void)
{
    return sp_now_ns();
}

/* Between polls: short while an op has just started (small ones finish in tens
 * of microseconds), longer while it waits for another daemon. */
void sp_nccl_nap(unsigned round)
{
    struct timespec ts = { 0, round < 64 ? 2000 : round < 4096 ? 20000 : 200000 };
    nanosleep(&ts, NULL);
}

/* Hands a work back to xdev.c, its status set: its task completes. */
static void work_done(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w)
{
    if (w->status != SPC_OK)
        sp_warn(XPORT, "job %s group %u channel %u op #%" PRIu64 " across daemons failed: %s", w->job, w->group_index,
                w->channel, w->seq, w->detail);
    /* Counted out first: by the time its ranks see it complete, spctl does too. */
    pthread_mutex_lock(&n->lock);
    if (c != NULL && c->work == w)
        c->work = NULL;
    n->inflight--;
    n->held_failed += w->phase == W_HELD;   /* handed back held: it failed (one released left W_HELD) */
    pthread_mutex_unlock(&n->lock);
    sp_engine_t *eng = n->eng;
    pthread_mutex_lock(&eng->lock);
    w->hdr_out = NULL;                 /* the headers are the next work's now */
    sp_xdev_done(eng, w->task);   /* w goes with it */
    pthread_mutex_unlock(&eng->lock);
    /* Completions make room in the clients' CQs: SQ entries held back for it
     * may go now, and only the progress thread takes them. */
    sp_engine_kick(eng);
}

/* Whether c's lanes have run all they hold: 1, 0 (not yet), or SPC_ERR_DEVICE
 * for one whose device failed (the message in e). */
static int lanes_idle(const comm_t *c, sp_err_t *e)
{
    int idle = c->lane != NULL ? sp_gpu_lane_idle(c->lane, e) : 1;
    for (int g = 0; g < SP_TOPO_MAX_GPUS && idle == 1; g++)
        if (c->lanes[g] != NULL)
            idle = sp_gpu_lane_idle(c->lanes[g], e);
    return idle;
}

static void lanes_close(comm_t *c)
{
    sp_gpu_lane_close(c->lane);
    c->lane = NULL;
    for (int g = 0; g < SP_TOPO_MAX_GPUS; g++) {
        sp_gpu_lane_close(c->lanes[g]);
        c->lanes[g] = NULL;
    }
}

/* Opens c's lanes on the other GPUs w enqueues on (its ranks there), kept
 * for the channel's later ops; false with the error in e (SPC_ERR_LIMIT past
 * gpu_lanes_max). */
static bool lanes_open(comm_t *c, const sp_nccl_work_t *w, sp_err_t *e)
{
    for (int g = 0; g < SP_TOPO_MAX_GPUS; g++)
        if ((w->gpus >> g & 1) && c->lanes[g] == NULL && sp_gpu_lane_open(g, &c->lanes[g], e) != SPC_OK)
            return false;
    return true;
}

/* Points the thread's enqueue calls at c's lanes of w's GPUs, or (lane NULL)
 * back at the devices' own streams. */
static void lanes_use(comm_t *c, const sp_nccl_work_t *w, bool use)
{
    sp_gpu_use_lane(w->dev, use ? c->lane : NULL);
    for (int g = 0; g < SP_TOPO_MAX_GPUS; g++)
        if (w->gpus >> g & 1)
            sp_gpu_use_lane(g, use ? c->lanes[g] : NULL);
}

/* Enqueues on w's lane of GPU dev a wait for each of its ranks' ready. */
static spc_status_t lane_wait_ready(const sp_nccl_work_t *w, int dev, sp_err_t *e)
{
    spc_status_t st = SPC_OK;
    for (uint32_t k = 0; k < w->nsems && st == SPC_OK; k++)
        st = sp_gpu_wait_value(dev, w->sems[k].ready, w->sems[k].seq, e);
    return st;
}

/* On every lane of w: nothing of the op runs on any GPU before every rank's
 * input is there, as on one node. */
static spc_status_t lanes_wait_ready(const sp_nccl_work_t *w, sp_err_t *e)
{
    spc_status_t st = lane_wait_ready(w, w->dev, e);
    for (int g = 0; g < SP_TOPO_MAX_GPUS && st == SPC_OK; g++)
        if (w->gpus >> g & 1)
            st = lane_wait_ready(w, g, e);
    return st;
}

/* Aborts c's NCCL communicator (if any); when w had launched on its lane,
 * waits for the lane to drain, marking w's memory as still in use if it
 * does not. */
static void comm_abort(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w, bool launched)
{
    sp_err_t e = SP_ERR_INIT;   /* logged where it arose */
    if (c->nc != NULL) {
        sp_gpu_use(c->dev, &e);
        ncclResult_t r = nc.abort(c->nc);
        if (r != ncclSuccess && r != ncclInProgress)
            sp_warn(XPORT, "job %s group %u channel %u: ncclCommAbort: %s", c->job, c->group_index, c->channel,
                    nc.error_string(r));
        else
            sp_info(XPORT, "job %s group %u channel %u: communicator aborted", c->job, c->group_index, c->channel);
        c->nc = NULL;
        pthread_mutex_lock(&n->lock);
        n->ncomms--;
        pthread_mutex_unlock(&n->lock);
    }
    c->state = C_NONE;
    if (!launched || c->lane == NULL)
        return;
    /* The abort makes NCCL's kernels quit; ours behind them finish. A lane
     * that failed has nothing more to run. */
    uint64_t until = now_ns() + DRAIN_NS;
    int idle;
    for (unsigned round = 0; (idle = lanes_idle(c, &e)) == 0 && now_ns() < until; round++)
        sp_nccl_nap(round);
    if (idle == 0) {
        sp_error(XPORT, "job %s group %u channel %u: its streams still run %llu s after the abort; its buffers stay "
                 "allocated", c->job, c->group_index, c->channel, (unsigned long long)(DRAIN_NS / 1000000000ull));
        if (w != NULL)
            w->leak = true;
        /* Its headers may still be written: leave them, and the lanes, to it
         * (closing a lane lets what it holds run out). */
        lanes_close(c);
        c->hdr_dev = NULL;
        c->hdr_host = NULL;
    }
}

/* The daemon lost among c's, if any (copied into buf). */
static bool comm_lost(sp_nccl_t *n, comm_t *c, char *buf, size_t len)
{
    pthread_mutex_lock(&n->lock);
    bool lost = c->lost[0] != '\0';
    if (lost)
        snprintf(buf, len, "%s", c->lost);
    pthread_mutex_unlock(&n->lock);
    return lost;
}

/* The daemon restarting among c's, if any (copied into buf). */
static bool comm_held(sp_nccl_t *n, comm_t *c, char *buf, size_t len)
{
    pthread_mutex_lock(&n->lock);
    bool held = c->held[0] != '\0';
    if (held)
        snprintf(buf, len, "%s", c->held);
    pthread_mutex_unlock(&n->lock);
    return held;
}

/*
 * Fails w. `nccl_side`: NCCL reported it or time ran out, so a daemon may have
 * died: without a lost daemon known yet, wait a little for the links to say.
 */
static void work_fail(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w, spc_status_t st, bool nccl_side, const char *fmt,
                      ...) __attribute__((format(printf, 6, 7)));
static void work_fail(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w, spc_status_t st, bool nccl_side, const char *fmt,
                      ...)
{
    char detail[SP_DETAIL_BYTES];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(detail, sizeof detail, fmt, ap);
    va_end(ap);
    comm_abort(n, c, w, w->phase >= W_LAUNCH);
    char lost[SP_DETAIL_BYTES];
    if ((nccl_side || st == SPC_ERR_PEER_LOST) && comm_lost(n, c, lost, sizeof lost)) {
        w->status = SPC_ERR_PEER_LOST;
        snprintf(w->detail, sizeof w->detail, "%s", lost);
    } else if (nccl_side) {
        w->pending = st;
        snprintf(w->pending_detail, sizeof w->pending_detail, "%s", detail);
        w->grace_ns = now_ns() + GRACE_NS;
        w->phase = W_GRACE;
        return;
    } else {
        w->status = st;
        snprintf(w->detail, sizeof w->detail, "%s", detail);
    }
    work_done(n, c, w);
}

/*
 * A daemon of c restarts (`node`): c cannot be repaired. Its NCCL
 * communicator is aborted and, once the lane has let go of w, w waits
 * (W_HELD) to run again from the start on a new one, at its own sequence
 * number, as the restarted daemon's replay of the op does. It can: its inputs
 * are untouched, since the kernels that write outputs wait for the exchange
 * (w->rerun) and a failed exchange never reaches them. One that cannot (no
 * grace when it started, a lane that did not drain) fails as for a lost daemon.
 */
static void work_hold(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w, const char *node)
{
    comm_abort(n, c, w, w->phase >= W_LAUNCH);
    if (!w->rerun || w->after_enqueued || w->leak) {
        w->status = SPC_ERR_PEER_LOST;
        snprintf(w->detail, sizeof w->detail, "node %s lost as it restarted, with %s op #%" PRIu64 " under way that "
                 "cannot run again", node, sp_op_name(w->opcode), w->seq);
        work_done(n, c, w);
        return;
    }
    if (w->phase != W_START)
        sp_info(XPORT, "job %s group %u channel %u: %s op #%" PRIu64 " waits for node %s to take the job back, to "
                "run again", w->job, w->group_index, w->channel, sp_op_name(w->opcode), w->seq, node);
    pthread_mutex_lock(&n->lock);
    n->held++;
    pthread_mutex_unlock(&n->lock);
    w->phase = W_HELD;
    w->next_group = 0;
    w->pending = SPC_OK;
    w->status = SPC_OK;
    w->detail[0] = '\0';
}

/* Whether the loop lost time or the op: the checks of every waiting phase.
 * Returns true when w was failed or held. */
static bool work_checks(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w, const char *waiting)
{
    char lost[SP_DETAIL_BYTES];
    /* Its exchange done (W_RUN of a work that can run again), only this
     * daemon's kernels are left: no daemon's going stops them. */
    bool exchanged = w->phase == W_RUN && w->rerun;
    if (!exchanged && comm_lost(n, c, lost, sizeof lost)) {
        work_fail(n, c, w, SPC_ERR_PEER_LOST, false, "%s", lost);
        return true;
    }
    if (!exchanged && w->phase != W_HELD && comm_held(n, c, lost, sizeof lost)) {
        work_hold(n, c, w, lost);
        return true;
    }
    bool stopping;
    pthread_mutex_lock(&n->lock);
    stopping = n->stopping;
    pthread_mutex_unlock(&n->lock);
    if (stopping) {
        work_fail(n, c, w, SPC_ERR_SHUTTING_DOWN, false, "spd is shutting down");
        return true;
    }
    if (now_ns() >= w->deadline_ns) {
        /* Held, it knows why it waited: no grace to hear of a lost daemon. */
        work_fail(n, c, w, SPC_ERR_TIMEOUT, w->phase != W_HELD, "%s of job %s group %u op #%" PRIu64 " across "
                  "daemons timed out after %" PRIu64 " ms %s", sp_op_name(w->opcode), w->job, w->group_index, w->seq,
                  w->timeout_ns / 1000000, waiting);
        return true;
    }
    return false;
}

/*
 * What rank 0 made for c, seen from op `seq`: the id made for this very op
 * (NULL when none), and whether one made for a later op is there (rank 0 is
 * past this op: it failed there). An id made for an earlier op that this
 * daemon never took is never taken later: rank 0 ran (or waited in) that
 * earlier op on it, and joining it now would pair different ops. Lock held.
 */
static mbox_t *mbox_find(sp_nccl_t *n, comm_t *c, uint64_t seq, bool *later)
{
    mbox_t *exact = NULL;
    *later = false;
    for (mbox_t **pp = &n->mbox; *pp != NULL;) {
        mbox_t *m = *pp;
        if (strcmp(m->job, c->job) != 0 || m->group_index != c->group_index || m->channel != c->channel) {
            pp = &m->next;
            continue;
        }
        if (m->seq < seq) {   /* for an op this daemon is past: never of use */
            *pp = m->next;
            free(m);
            continue;
        }
        if (m->seq == seq)
            exact = m;
        else
            *later = true;
        pp = &m->next;
    }
    return exact;
}

/* Drops c's ids up to `seq` (taken, or overtaken). Lock held. */
static void mbox_trim(sp_nccl_t *n, comm_t *c, uint64_t seq)
{
    for (mbox_t **pp = &n->mbox; *pp != NULL;) {
        mbox_t *m = *pp;
        if (strcmp(m->job, c->job) == 0 && m->group_index == c->group_index && m->channel == c->channel &&
            m->seq <= seq) {
            *pp = m->next;
            free(m);
        } else {
            pp = &m->next;
        }
    }
}

/* Readies c's lane and header buffers on the op's GPU; false with the error in e. */
static bool comm_buffers(comm_t *c, sp_nccl_work_t *w, sp_err_t *e)
{
    if (c->lane != NULL && c->dev != w->dev) {
        lanes_close(c);
        sp_gpu_stage_put(c->hdr_dev);
        c->hdr_dev = NULL;
    }
    c->dev = w->dev;
    /* The device's primary context, current on this thread from here on: the
     * CUDA runtime takes a current context as its current device, so NCCL,
     * which asks the runtime, works on dev (as after cudaSetDevice, which
     * makes that same primary context current). */
    if (sp_gpu_use(w->dev, e) != SPC_OK)
        return false;
    if (c->lane == NULL && sp_gpu_lane_open(w->dev, &c->lane, e) != SPC_OK)
        return false;
    size_t bytes = 2 * (size_t)c->nranks * sizeof(hdr_t);
    if (c->hdr_dev == NULL && sp_gpu_stage_get(w->dev, bytes, &c->hdr_dev, e) != SPC_OK)
        return false;
    if (c->hdr_host == NULL && (c->hdr_host = pinned_get(bytes)) == NULL) {
        sp_err_set(e, SPC_ERR_NO_MEMORY, "no pinned host memory for NCCL headers");
        return false;
    }
    return true;
}

/* Starts the NCCL communicator of c from `id`, made for op `seq`. */
static void comm_init(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w, const uint8_t *id, uint64_t seq)
{
    sp_err_t e = SP_ERR_INIT;
    if (!comm_buffers(c, w, &e)) {
        work_fail(n, c, w, e.status, false, "%s", e.msg);   /* LIMIT past gpu_device_staging_bytes */
        return;
    }
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;   /* every call returns at once; the thread polls */
    ncclUniqueId uid;
    memcpy(&uid, id, sizeof uid);
    ncclComm_t comm = NULL;
    ncclResult_t r = nc.init(&comm, (int)c->nranks, uid, (int)c->me, &cfg);
    if (comm != NULL) {
        c->nc = comm;
        pthread_mutex_lock(&n->lock);
        n->ncomms++;
        pthread_mutex_unlock(&n->lock);
    }
    if (r != ncclSuccess && r != ncclInProgress) {
        work_fail(n, c, w, SPC_ERR_DEVICE, true, "ncclCommInitRankConfig (rank %u of %u, GPU %d): %s", c->me, c->nranks,
                  w->dev, nccl_msg(r, comm));
        return;
    }
    c->state = C_INIT;
    w->phase = W_INIT;
    sp_info(XPORT, "job %s group %u channel %u: communicator from op #%" PRIu64 ": rank %u of %u (node %s) on GPU %d",
            c->job, c->group_index, c->channel, seq, c->me, c->nranks, c->nodes[c->me], w->dev);
}

static void work_comm(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w);

/* W_START: this daemon's plan of the op, then its communicator (work_comm). */
static void work_start(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w)
{
    sp_err_t e = SP_ERR_INIT;
    w->deadline_ns = now_ns() + w->timeout_ns;
    spc_status_t planned = sp_xdev_plan(w->task, &e);
    if (planned != SPC_OK) {
        /* This daemon will not run the op: the others cannot finish it, and must
         * not pair their next op with ours. */
        comm_abort(n, c, w, false);
        w->status = planned;
        snprintf(w->detail, sizeof w->detail, "%s", e.msg);
        work_done(n, c, w);
        return;
    }
    if (nc.init == NULL && !nccl_load(n)) {
        work_fail(n, c, w, SPC_ERR_NO_DEVICE, false, "%s", n->why);
        return;
    }
    work_comm(n, c, w);
}

/* W_START, planned (or W_HELD, released): keep the communicator, or make a new one. */
static void work_comm(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w)
{
    char lost[SP_DETAIL_BYTES];
    sp_err_t e = SP_ERR_INIT;
    if (comm_lost(n, c, lost, sizeof lost)) {
        work_fail(n, c, w, SPC_ERR_PEER_LOST, false, "%s", lost);
        return;
    }
    if (comm_held(n, c, lost, sizeof lost)) {
        work_hold(n, c, w, lost);
        return;
    }
    bool later = false, fresh = false;
    if (c->me != 0) {
        pthread_mutex_lock(&n->lock);
        fresh = mbox_find(n, c, w->seq, &later) != NULL;   /* rank 0 made another for this op */
        pthread_mutex_unlock(&n->lock);
    }
    if (c->state == C_READY && later) {
        /* Rank 0 left this communicator for one made at a later op. */
        work_fail(n, c, w, SPC_ERR_TRANSPORT, false, "node %s is past %s op #%" PRIu64 " of job %s group %u (it "
                  "failed there): this daemon cannot run it", c->nodes[0], sp_op_name(w->opcode), w->seq, w->job,
                  w->group_index);
        return;
    }
    if (c->state == C_READY && c->dev == w->dev && !fresh) {
        w->phase = W_LAUNCH;
        return;
    }
    comm_abort(n, c, w, false);
    if (c->me != 0) {
        w->phase = W_WAIT_ID;
        return;
    }
    ncclUniqueId uid;
    if (sp_gpu_use(w->dev, &e) != SPC_OK) {
        work_fail(n, c, w, SPC_ERR_DEVICE, false, "%s", e.msg);
        return;
    }
    ncclResult_t r = nc.get_unique_id(&uid);
    if (r != ncclSuccess) {
        work_fail(n, c, w, SPC_ERR_DEVICE, false, "ncclGetUniqueId: %s", nccl_msg(r, NULL));
        return;
    }
    /* The loop sends it to every other daemon of the group. */
    pthread_mutex_lock(&n->lock);
    for (uint32_t k = 1; k < c->nranks; k++) {
        outmsg_t *m = calloc(1, sizeof *m);
        if (m == NULL)
            continue;   /* that daemon times out; the next op makes another */
        snprintf(m->node, sizeof m->node, "%s", c->nodes[k]);
        snprintf(m->job, sizeof m->job, "%s", c->job);
        m->group_index = c->group_index;
        m->channel = c->channel;
        m->seq = w->seq;
        memcpy(m->id, &uid, sizeof m->id);
        m->next = n->outbox;
        n->outbox = m;
    }
    pthread_mutex_unlock(&n->lock);
    if (n->eng->notify != NULL)
        n->eng->notify(n->eng->notify_arg);
    comm_init(n, c, w, (const uint8_t *)&uid, w->seq);
}

/* W_WAIT_ID: the id rank 0 makes for this op. */
static void work_wait_id(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w)
{
    uint8_t id[SP_NCCL_ID_BYTES];
    bool later;
    pthread_mutex_lock(&n->lock);
    mbox_t *m = mbox_find(n, c, w->seq, &later);
    if (m != NULL) {
        memcpy(id, m->id, sizeof id);
        mbox_trim(n, c, w->seq);
    }
    pthread_mutex_unlock(&n->lock);
    if (m != NULL) {
        comm_init(n, c, w, id, w->seq);
        return;
    }
    if (later) {
        /* Rank 0 made a communicator for a later op: it is past this one. */
        work_fail(n, c, w, SPC_ERR_TRANSPORT, false, "node %s is past %s op #%" PRIu64 " of job %s group %u (it failed "
                  "there): this daemon cannot run it", c->nodes[0], sp_op_name(w->opcode), w->seq, w->job,
                  w->group_index);
        return;
    }
    char waiting[96];
    snprintf(waiting, sizeof waiting, "waiting for node %s's NCCL id", c->nodes[0]);
    work_checks(n, c, w, waiting);
}

/* W_INIT: polls the communicator's creation. */
static void work_init(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w)
{
    ncclResult_t st = ncclInProgress;
    ncclResult_t r = nc.async_error(c->nc, &st);
    if (r != ncclSuccess)
        st = r;
    if (st == ncclSuccess) {
        c->state = C_READY;
        sp_info(XPORT, "job %s group %u channel %u: communicator ready", c->job, c->group_index, c->channel);
        w->phase = W_LAUNCH;
        return;
    }
    if (st != ncclInProgress) {
        work_fail(n, c, w, SPC_ERR_TRANSPORT, true, "creating the NCCL communicator of job %s group %u channel %u: %s",
                  c->job, c->group_index, c->channel, nccl_msg(st, c->nc));
        return;
    }
    if (c->me != 0) {
        bool later;
        pthread_mutex_lock(&n->lock);
        mbox_find(n, c, w->seq, &later);
        pthread_mutex_unlock(&n->lock);
        if (later) {   /* rank 0 gave up on this one (and on this op) */
            work_fail(n, c, w, SPC_ERR_TRANSPORT, false, "node %s gave up the NCCL communicator for %s op #%" PRIu64
                      " of job %s group %u and moved on", c->nodes[0], sp_op_name(w->opcode), w->seq, w->job,
                      w->group_index);
            return;
        }
    }
    work_checks(n, c, w, "creating the NCCL communicator");
}

static uint64_t xfer_total(const sp_nccl_work_t *w, uint32_t peer, bool send)
{
    uint64_t b = 0;
    for (uint32_t i = 0; i < w->nxfers; i++)
        if (w->xfers[i].peer == peer && (w->xfers[i].send != 0) == send)
            b += w->xfers[i].bytes;
    return b;
}

/* The headers w sends, and room for those it gets. An op in stream order
 * writes them under the engine lock and leaves them there for
 * sp_nccl_give_up until it is handed back. */
static void write_headers(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w)
{
    hdr_t *out_h = c->hdr_host, *in_h = out_h + c->nranks;
    sp_engine_t *eng = n->eng;
    if (w->nsems > 0)
        pthread_mutex_lock(&eng->lock);
    for (uint32_t p = 0; p < c->nranks; p++) {
        out_h[p] = (hdr_t){ .magic = HDR_MAGIC, .opcode = w->opcode, .group_index = w->group_index,
                            .channel = w->channel, .seq = w->seq, .bytes = xfer_total(w, p, true),
                            .nglobal = w->nglobal, .flags = w->given_up ? HDR_GIVEN_UP : 0 };
        memset(&in_h[p], 0, sizeof in_h[p]);
    }
    if (w->nsems > 0) {
        w->hdr_out = out_h;
        w->hdr_count = c->nranks;
        pthread_mutex_unlock(&eng->lock);
    }
}

/* W_LAUNCH: issues the next NCCL group of w (the first one with the headers). */
static void work_launch(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w)
{
    sp_err_t e = SP_ERR_INIT;
    hdr_t *out_d = sp_gpu_stage_ptr(c->hdr_dev), *in_d = out_d + c->nranks;
    hdr_t *out_h = c->hdr_host;
    if (sp_gpu_use(w->dev, &e) != SPC_OK) {
        work_fail(n, c, w, SPC_ERR_DEVICE, false, "%s", e.msg);
        return;
    }
    cudaStream_t s = sp_gpu_lane_stream(c->lane);
    if (w->next_group == 0) {
        w->ngroups = w->nglobal == 0 ? 1 : (w->nglobal + GROUP_MAX - 1) / GROUP_MAX;
        write_headers(n, c, w);
        /* In stream order, the ranks' inputs are there once their streams say
         * so, on every GPU of the op; then this daemon's copies and kernels
         * that the transfers read from. The headers are copied behind the
         * waits: a rank given up on while they wait is in them. */
        spc_status_t st = lanes_open(c, w, &e) ? SPC_OK : e.status;
        lanes_use(c, w, true);
        if (st == SPC_OK)
            st = lanes_wait_ready(w, &e);
        if (st == SPC_OK)
            st = sp_xdev_before(w->task, &e);
        if (st == SPC_OK)
            st = sp_gpu_copy_in(w->dev, out_d, out_h, c->nranks * sizeof(hdr_t), &e);
        lanes_use(c, w, false);
        if (st == SPC_OK)
            st = sp_gpu_use(w->dev, &e);   /* the copies may have left another GPU's context current */
        if (st != SPC_OK) {
            work_fail(n, c, w, st, false, "%s", e.msg);
            return;
        }
    }
    uint32_t g = w->next_group, lo = g * GROUP_MAX, hi = lo + GROUP_MAX;
    ncclResult_t r = nc.group_start();
    for (uint32_t p = 0; g == 0 && p < c->nranks && r == ncclSuccess; p++) {
        if (p == c->me)
            continue;
        r = nc.send(out_d + p, sizeof(hdr_t), ncclUint8, (int)p, c->nc, s);
        if (r == ncclSuccess)
            r = nc.recv(in_d + p, sizeof(hdr_t), ncclUint8, (int)p, c->nc, s);
    }
    for (uint32_t i = 0; i < w->nxfers && r == ncclSuccess; i++) {
        const sp_nccl_xfer_t *x = &w->xfers[i];
        if (x->index < lo || x->index >= hi)
            continue;
        r = x->send ? nc.send(x->ptr, x->bytes, ncclUint8, (int)x->peer, c->nc, s)
                    : nc.recv(x->ptr, x->bytes, ncclUint8, (int)x->peer, c->nc, s);
    }
    ncclResult_t end = nc.group_end();   /* ends the group whatever happened inside it */
    if (r == ncclSuccess || r == ncclInProgress)
        r = end;
    if (r == ncclInProgress) {
        w->phase = W_ENQUEUE;
        return;
    }
    if (r != ncclSuccess) {
        work_fail(n, c, w, SPC_ERR_TRANSPORT, true, "%s of job %s group %u op #%" PRIu64 ": NCCL: %s",
                  sp_op_name(w->opcode), w->job, w->group_index, w->seq, nccl_msg(r, c->nc));
        return;
    }
    w->phase = W_ENQUEUE;   /* enqueued at once: the next step sees it done */
}

/* Behind the transfers on the lane: this daemon's ranks' outputs, then their
 * streams may go on (whatever the headers say: an error travels in the
 * completion, as on one daemon). False: w failed. */
static bool enqueue_after(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w)
{
    sp_err_t e = SP_ERR_INIT;
    if (sp_gpu_use(w->dev, &e) != SPC_OK) {
        work_fail(n, c, w, SPC_ERR_DEVICE, false, "%s", e.msg);
        return false;
    }
    lanes_use(c, w, true);
    spc_status_t st = sp_xdev_after(w->task, &e);
    w->after_enqueued = true;   /* in part, perhaps: outputs may be written */
    for (uint32_t k = 0; k < w->nsems && st == SPC_OK; k++)
        st = sp_gpu_write_value(w->dev, w->sems[k].done, w->sems[k].seq, &e);
    lanes_use(c, w, false);
    w->done_enqueued = w->nsems > 0 && st == SPC_OK;
    if (st != SPC_OK) {
        work_fail(n, c, w, st, false, "%s", e.msg);
        return false;
    }
    return true;
}

/* Behind the transfers on the lane: the headers the others sent, to the host. False: w failed. */
static bool headers_back(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w)
{
    sp_err_t e = SP_ERR_INIT;
    hdr_t *in_d = (hdr_t *)sp_gpu_stage_ptr(c->hdr_dev) + c->nranks, *in_h = c->hdr_host + c->nranks;
    sp_gpu_use_lane(w->dev, c->lane);
    spc_status_t st = sp_gpu_copy_out(w->dev, in_h, in_d, c->nranks * sizeof(hdr_t), &e);
    sp_gpu_use_lane(w->dev, NULL);
    if (st != SPC_OK) {
        work_fail(n, c, w, st, false, "%s", e.msg);
        return false;
    }
    return true;
}

/* W_ENQUEUE: polls until the group's operations are on the lane; after the
 * last, the others' headers and (but for a work that can run again, W_XFER)
 * the kernels that read what came. */
static void work_enqueue(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w)
{
    ncclResult_t st = ncclInProgress;
    ncclResult_t r = nc.async_error(c->nc, &st);
    if (r != ncclSuccess)
        st = r;
    if (st == ncclInProgress) {
        work_checks(n, c, w, "enqueueing its transfers");
        return;
    }
    if (st != ncclSuccess) {
        work_fail(n, c, w, SPC_ERR_TRANSPORT, true, "%s of job %s group %u op #%" PRIu64 ": NCCL: %s",
                  sp_op_name(w->opcode), w->job, w->group_index, w->seq, nccl_msg(st, c->nc));
        return;
    }
    if (++w->next_group < w->ngroups) {
        w->phase = W_LAUNCH;
        return;
    }
    /* A work that can run again writes no output before its exchange is
     * through (W_XFER); the others enqueue the rest at once. */
    if (w->rerun) {
        if (headers_back(n, c, w))
            w->phase = W_XFER;
        return;
    }
    if (enqueue_after(n, c, w) && headers_back(n, c, w))
        w->phase = W_RUN;
}

/* The others' headers against what this daemon expects of them: SPC_OK,
 * SPC_ERR_TRANSPORT (out of step) or SPC_ERR_PEER_REFUSED (a daemon gave up
 * on one of its ranks: what it sent is not that rank's input). */
static spc_status_t headers_agree(comm_t *c, sp_nccl_work_t *w, sp_err_t *e)
{
    const hdr_t *in = c->hdr_host + c->nranks;
    for (uint32_t p = 0; p < c->nranks; p++) {
        if (p == c->me)
            continue;
        const hdr_t *h = &in[p];
        uint64_t want = xfer_total(w, p, false);
        if (h->magic == HDR_MAGIC && h->seq == w->seq && h->opcode == w->opcode && h->group_index == w->group_index &&
            h->channel == w->channel && h->nglobal == w->nglobal && h->bytes == want) {
            if ((h->flags & HDR_GIVEN_UP) == 0)
                continue;
            return sp_err_set(e, SPC_ERR_PEER_REFUSED, "node %s gave up on %s op #%" PRIu64 ": the stream of a rank "
                              "there did not reach it (or its client was lost), so that rank's input never came",
                              c->nodes[p], sp_op_name(w->opcode), w->seq);
        }
        return sp_err_set(e, SPC_ERR_TRANSPORT, "out of step with node %s: it ran %s op #%" PRIu64 " (%" PRIu64
                          " bytes for this daemon, %u transfers), this daemon %s op #%" PRIu64 " (%" PRIu64 " bytes, "
                          "%u transfers)", c->nodes[p], h->magic == HDR_MAGIC ? sp_op_name(h->opcode) : "no", h->seq,
                          h->bytes, h->nglobal, sp_op_name(w->opcode), w->seq, want, w->nglobal);
    }
    return SPC_OK;
}

/* The others' headers, once the lane has run the exchange: false when w
 * failed (out of step). A daemon that gave up on a rank still ran the
 * exchange in step: the communicator stays, the op fails. */
static bool work_headers(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w)
{
    sp_err_t e = SP_ERR_INIT;
    w->status = headers_agree(c, w, &e);
    if (w->status == SPC_ERR_TRANSPORT) {
        work_fail(n, c, w, w->status, false, "%s", e.msg);
        return false;
    }
    if (w->status != SPC_OK)
        snprintf(w->detail, sizeof w->detail, "%s", e.msg);
    return true;
}

/* Whether NCCL says c failed (w failed then). */
static bool work_nccl_failed(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w)
{
    ncclResult_t st = ncclSuccess;
    ncclResult_t r = nc.async_error(c->nc, &st);
    if (r != ncclSuccess)
        st = r;
    if (st == ncclSuccess || st == ncclInProgress)
        return false;
    work_fail(n, c, w, SPC_ERR_TRANSPORT, true, "%s of job %s group %u op #%" PRIu64 ": NCCL: %s",
              sp_op_name(w->opcode), w->job, w->group_index, w->seq, nccl_msg(st, c->nc));
    return true;
}

/* W_XFER: polls the lane until the exchange is through; then the kernels
 * that write this daemon's ranks' outputs, and their done (W_RUN). */
static void work_xfer(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w)
{
    /* The lane on dev waits for the others' copies in (see work_run). */
    sp_err_t e = SP_ERR_INIT;
    int idle = lanes_idle(c, &e);
    if (idle == 1) {
        /* Transfers that failed end too (a peer gone), their data in part. */
        if (!work_nccl_failed(n, c, w) && work_headers(n, c, w) && enqueue_after(n, c, w))
            w->phase = W_RUN;
        return;
    }
    if (idle != 0) {
        work_fail(n, c, w, SPC_ERR_DEVICE, false, "a NCCL lane failed: %s", e.msg);
        return;
    }
    if (!work_nccl_failed(n, c, w))
        work_checks(n, c, w, "in its NCCL transfers");
}

/* W_RUN: polls the lane. */
static void work_run(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w)
{
    /* The lane on dev waits for the others' parts: it is done when they are,
     * and one of theirs that failed would hold it for ever. */
    sp_err_t e = SP_ERR_INIT;
    int idle = lanes_idle(c, &e);
    if (idle == 1) {
        if (w->rerun || (!work_nccl_failed(n, c, w) && work_headers(n, c, w)))   /* W_XFER read them */
            work_done(n, c, w);
        return;
    }
    if (idle != 0) {
        work_fail(n, c, w, SPC_ERR_DEVICE, false, "a NCCL lane failed: %s", e.msg);
        return;
    }
    /* Past W_XFER, NCCL has nothing of the op on the lane. */
    if (w->rerun) {
        work_checks(n, c, w, "in its kernels after the transfers");
        return;
    }
    if (!work_nccl_failed(n, c, w))
        work_checks(n, c, w, "in its NCCL transfers");
}

/* W_GRACE: an NCCL failure, waiting to learn whether a daemon died (or
 * restarts: then the work is held, within its deadline). */
static void work_grace(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w)
{
    char lost[SP_DETAIL_BYTES];
    if (comm_lost(n, c, lost, sizeof lost)) {
        w->status = SPC_ERR_PEER_LOST;
        snprintf(w->detail, sizeof w->detail, "%s", lost);
        work_done(n, c, w);
    } else if (now_ns() < w->deadline_ns && comm_held(n, c, lost, sizeof lost)) {
        work_hold(n, c, w, lost);
    } else if (now_ns() >= w->grace_ns) {
        w->status = w->pending;
        snprintf(w->detail, sizeof w->detail, "%s", w->pending_detail);
        work_done(n, c, w);
    }
}

/* W_HELD: until the daemon restarting takes the job back; then the work runs
 * again from the start on a new communicator, made at its op. */
static void work_held(sp_nccl_t *n, comm_t *c, sp_nccl_work_t *w)
{
    char node[SP_NODE_MAX] = "", waiting[96];
    bool held = comm_held(n, c, node, sizeof node);
    snprintf(waiting, sizeof waiting, "waiting for node %s to take the job back", held ? node : "restarting");
    if (work_checks(n, c, w, waiting) || held)   /* lost (the grace passed), or still held */
        return;
    sp_info(XPORT, "job %s group %u channel %u: %s op #%" PRIu64 " runs again on a new communicator", w->job,
            w->group_index, w->channel, sp_op_name(w->opcode), w->seq);
    pthread_mutex_lock(&n->lock);
    n->rerun++;
    pthread_mutex_unlock(&n->lock);
    w->phase = W_START;
    work_comm(n, c, w);
}

/* One step of c's running work (taking the next when none). Returns 0 when
 * there was none, 1 when it still waits as it did, 2 when it moved on. */
int sp_nccl_comm_step(sp_nccl_t *n, comm_t *c)
{
    sp_nccl_work_t *w = c->work;
    if (w == NULL) {
        pthread_mutex_lock(&n->lock);
        w = c->queue;
        if (w != NULL) {
            c->queue = w->next;
            if (c->queue == NULL)
                c->queue_tail = NULL;
            w->next = NULL;
            c->work = w;
        }
        pthread_mutex_unlock(&n->lock);
        if (w == NULL)
            return 0;
        w->phase = W_START;
        work_start(n, c, w);
        return 2;
    }
    int phase = w->phase;
    switch (w->phase) {
    case W_WAIT_ID: work_wait_id(n, c, w); break;
    case W_HELD:    work_held(n, c, w); break;
    case W_INIT:    work_init(n, c, w); break;
    case W_LAUNCH:  work_launch(n, c, w); break;
    case W_ENQUEUE: work_enqueue(n, c, w); break;
    case W_XFER:    work_xfer(n, c, w); break;
    case W_RUN:     work_run(n, c, w); break;
    case W_GRACE:   work_grace(n, c, w); break;
    default:        work_fail(n, c, w, SPC_ERR_DEVICE, false, "internal: work in phase %d", w->phase); break;
    }
    return c->work != w || w->phase != phase ? 2 : 1;
}

static void comm_free(sp_nccl_t *n, comm_t *c)
{
    char lost[SP_DETAIL_BYTES];
    sp_err_t e = SP_ERR_INIT;   /* logged where it arose */
    if (c->nc != NULL) {
        sp_gpu_use(c->dev, &e);
        /* Idle, in step and whole: destroy. Anything else is aborted, which
         * waits for nobody. */
        bool whole = c->state == C_READY && !comm_lost(n, c, lost, sizeof lost) && !comm_held(n, c, lost, sizeof lost);
        ncclResult_t r = whole ? nc.destroy(c->nc) : nc.abort(c->nc);
        if (r != ncclSuccess && r != ncclInProgress)
            sp_warn(XPORT, "job %s group %u channel %u: destroying the communicator: %s", c->job, c->group_index,
                    c->channel, nc.error_string(r));
        pthread_mutex_lock(&n->lock);
        n->ncomms--;
        pthread_mutex_unlock(&n->lock);
        sp_info(XPORT, "job %s group %u channel %u: communicator %s", c->job, c->group_index, c->channel,
                whole ? "destroyed" : "aborted");
    }
    lanes_close(c);   /* what they still hold runs out */
    sp_gpu_stage_put(c->hdr_dev);
    pinned_put(c->hdr_host, 2 * (size_t)c->nranks * sizeof(hdr_t));
    free(c->nodes);
    free(c);
}

/* Frees the communicators of ended groups once idle, and aborts the idle ones
 * a daemon of which is lost (their sockets and buffers go now; an op that comes
 * fails naming the daemon) or restarts (the next op makes another). */
void sp_nccl_reap(sp_nccl_t *n)
{
    comm_t *dead = NULL, *broken = NULL;
    pthread_mutex_lock(&n->lock);
    for (comm_t **pp = &n->comms; *pp != NULL;) {
        comm_t *c = *pp;
        if ((c->gone || n->stopping) && c->work == NULL && c->queue == NULL) {
            *pp = c->next;
            c->next = dead;
            dead = c;
            continue;
        }
        if (c->nc != NULL && c->work == NULL && (c->lost[0] != '\0' || c->held[0] != '\0') && broken == NULL)
            broken = c;   /* one a round is enough: the thread goes round often */
        pp = &c->next;
    }
    pthread_mutex_unlock(&n->lock);
    if (broken != NULL)
        comm_abort(n, broken, NULL, false);
    while (dead != NULL) {
        comm_t *c = dead;
        dead = c->next;
        comm_free(n, c);
    }
}

/* Shutdown: every work fails, every communicator goes. */
void sp_nccl_drain_all(sp_nccl_t *n)
{
    for (;;) {
        pthread_mutex_lock(&n->lock);
        comm_t *c = n->comms;
        while (c != NULL && c->work == NULL && c->queue == NULL)
            c = c->next;
        sp_nccl_work_t *w = NULL;
        if (c != NULL && c->work == NULL) {
            w = c->queue;
            c->queue = w->next;
            if (c->queue == NULL)
                c->queue_tail = NULL;
            w->next = NULL;
            c->work = w;
        }
        pthread_mutex_unlock(&n->lock);
        if (c == NULL)
            break;
        if (w != NULL)   /* queued: never ran */
            w->phase = W_START;
        w = c->work;
        if (w->phase == W_GRACE) {
            w->status = w->pending;
            snprintf(w->detail, sizeof w->detail, "%s", w->pending_detail);
            work_done(n, c, w);
        } else {
            work_fail(n, c, w, SPC_ERR_SHUTTING_DOWN, false, "spd is shutting down");
        }
    }
    sp_nccl_reap(n);
}

#endif /* SP_NCCL_BUILT */
