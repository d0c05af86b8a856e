/*
 * Stream order without a GPU: daemon/gpu/stream.c compiled into this program, the
 * GPU it drives replaced by queues the test runs on the host. A lane (the
 * daemon's, a client's CUDA stream, an NCCL communicator's) is a queue of
 * steps run in order: wait until a 64-bit value >= v (the signed difference,
 * as cuStreamWaitValue64's GEQ), write a value, a task's kernels, a mark, a
 * wait for a mark; a client's stream also writes its inputs and can be held.
 * exec.c's tasks and the NCCL thread are stood in for here too, so what is
 * tested is stream.c's part: the order ops start in, the semaphores around
 * them, and giving up. Every kernel checks that the input of each stream rank
 * for its op was written before it ran; a task that read an input not written
 * must never complete OK.
 *
 *   local      two clients, one stream each, ops on one daemon: every op runs
 *              after its inputs, every done reaches its seq;
 *   across     ops across daemons among them (the NCCL lane waits for the
 *              ranks' ready and writes their done): the same, the flight list
 *              completes them in their streams' order, and the next op of a
 *              stream needs nothing more than the semaphores;
 *   refused    an op across daemons the NCCL thread hands back failed before
 *              its lane held anything: the host stores its done, in order, and
 *              the stream goes on;
 *   late       a rank's stream held past the op's timeout while its next op
 *              is submitted too: the first fails TIMEOUT naming it, the other
 *              daemons are told (the work is given up), the second fails
 *              CANCELED ("given up at") although its waits passed, and every
 *              stream's waits end;
 *   late-local the same with ops on one daemon only;
 *   let go     the second op submitted 60 ms after the first: spd finishes the
 *              first (giving up on rank 1) once the second's own timeout has
 *              passed, and polls again before rank 0's CUDA stream, let go by
 *              that done, has run: rank 0 is not late (its stream has the
 *              timeout from that done), and the second op fails only for rank 1;
 *   gone       a client lost while its op waits on the daemon's stream, on one
 *              daemon and across daemons (the work is given up): the op fails
 *              PEER_LOST naming the rank, for every rank;
 *   leak       an op across daemons whose NCCL stream did not drain (its done
 *              writes still queued there): both streams break and their waits
 *              end, a stream closed then leaves its slot retired (the next
 *              stream gets another, and the late write lands in the old one),
 *              and the semaphore page is never unregistered;
 *   unwritten  a stream closed while its CUDA stream still owes the ready of
 *              an op spd took: its slot is retired too; a stream whose ready
 *              came is closed and its slot given again.
 */
#include "../../daemon/gpu/stream.c"

#include "cluster/sp_nccl.h"
#include "sp_test.h"
#include "core/client.h"
#include "core/engine.h"
#include "core/exec.h"
#include "core/ops.h"

/* ================================================================ the GPU, on the host */

enum step_kind { S_WAIT, S_WRITE, S_KERNEL, S_MARK, S_WAIT_MARK, S_INPUT, S_HOLD };

typedef struct step {
    enum step_kind kind;
    volatile uint64_t *addr;
    uint64_t v;
    uint32_t rank;                  /* S_INPUT: whose input (seq v) */
    sp_task_t *task;
    struct sp_gpu_mark *mark;
} step_t;

#define QMAX 512
struct sp_gpu_lane {
    const char *name;
    step_t q[QMAX];
    uint32_t head, tail;
};
struct sp_gpu_mark {
    bool done;
};

#define LANES_MAX 32
static struct sp_gpu_lane *lanes[LANES_MAX];
static uint32_t nlanes;
static struct sp_gpu_lane device_stream = { .name = "device" };
static struct sp_gpu_lane *current_lane;
static bool held;   /* S_HOLD waits while this is set */
static struct sp_gpu_lane *paused;   /* a lane the GPU does not run for now */

static struct sp_gpu_lane *lane_new(const char *name)
{
    CHECK(nlanes < LANES_MAX);
    struct sp_gpu_lane *l = calloc(1, sizeof *l);
    CHECK(l != NULL);
    l->name = name;
    lanes[nlanes++] = l;
    return l;
}

static void push(struct sp_gpu_lane *l, step_t s)
{
    CHECK(l->tail - l->head < QMAX);
    l->q[l->tail++ % QMAX] = s;
}

static struct sp_gpu_lane *enq_lane(void)
{
    return current_lane != NULL ? current_lane : &device_stream;
}

spc_status_t sp_gpu_lane_open(int dev, sp_gpu_lane_t **lane_p, sp_err_t *e)
{
    *lane_p = lane_new("client stream's lane");
    return SPC_OK;
}
void sp_gpu_lane_close(sp_gpu_lane_t *lane) {}   /* what it holds runs out; freed at the end */
void sp_gpu_use_lane(int dev, sp_gpu_lane_t *lane) { current_lane = lane; }
void sp_gpu_lane_counts(uint64_t *open, uint64_t *most, uint64_t *refused)
{
    *open = *most = *refused = 0;
}
spc_status_t sp_gpu_wait_value(int dev, uint64_t dptr, uint64_t v, sp_err_t *e)
{
    push(enq_lane(), (step_t){ .kind = S_WAIT, .addr = (volatile uint64_t *)(uintptr_t)dptr, .v = v });
    return SPC_OK;
}
spc_status_t sp_gpu_write_value(int dev, uint64_t dptr, uint64_t v, sp_err_t *e)
{
    push(enq_lane(), (step_t){ .kind = S_WRITE, .addr = (volatile uint64_t *)(uintptr_t)dptr, .v = v });
    return SPC_OK;
}
spc_status_t sp_gpu_mark(int dev, sp_gpu_mark_t **mark_p, sp_err_t *e)
{
    *mark_p = calloc(1, sizeof **mark_p);
    CHECK(*mark_p != NULL);
    push(enq_lane(), (step_t){ .kind = S_MARK, .mark = *mark_p });
    return SPC_OK;
}
int sp_gpu_mark_done(sp_gpu_mark_t *mark, sp_err_t *e) { return mark->done; }
void sp_gpu_mark_free(sp_gpu_mark_t *mark) { free(mark); }
spc_status_t sp_gpu_wait_mark(int dev, sp_gpu_mark_t *mark, sp_err_t *e)
{
    push(enq_lane(), (step_t){ .kind = S_WAIT_MARK, .mark = mark });
    return SPC_OK;
}
spc_status_t sp_gpu_host_register(int dev, void *p, size_t n, uint64_t *dptr_p, sp_err_t *e)
{
    *dptr_p = (uint64_t)(uintptr_t)p;   /* the host runs the lanes: the same address */
    return SPC_OK;
}
static uint32_t unregistered;   /* semaphore pages given back to CUDA */
void sp_gpu_host_unregister(void *p) { unregistered++; }
const char *sp_gpu_fault(int dev) { return NULL; }
spc_status_t sp_gpu_stream_device(const char *pci_bus_id, const uint8_t *uuid, int client_ordinal, int *dev_p,
                                  sp_err_t *e)
{
    *dev_p = 0;
    return SPC_OK;
}

/* ================================================================ the rest of spd */

static uint64_t clock_ns = 1000000000ull;
uint64_t sp_now_ns(void) { return clock_ns; }
const char *sp_op_name(unsigned opcode) { return "allreduce"; }

#define PMAX 4
/* A client: its semaphores, and which inputs its CUDA stream has written. */
typedef struct client {
    sp_client_t c;
    struct sp_stream_sem sems[SP_STREAMS_MAX];
    bool input[64];                  /* by seq of its stream 0 */
    struct sp_gpu_lane *cuda;        /* its CUDA stream */
    uint64_t submitted;
} client_t;

struct sp_task {
    uint32_t size;
    sp_op_t *ops[PMAX];
    bool xdev, back, finished, kernels_ran, stale;
    spc_status_t status;
    uint32_t bad_rank;
    char detail[SP_DETAIL_BYTES];
    sp_nccl_work_t work;
    sp_nccl_sem_t sems[PMAX];
};

static client_t clients[PMAX];
static sp_engine_t eng;
static sp_config_t cfg;

bool sp_task_device(const sp_task_t *t) { return true; }
int sp_task_gpu(const sp_task_t *t) { return 0; }
uint32_t sp_task_size(const sp_task_t *t) { return t->size; }
sp_op_t *sp_task_op(const sp_task_t *t, uint32_t r) { return t->ops[r]; }
spc_status_t sp_task_status(const sp_task_t *t) { return t->status; }
void sp_task_fail(sp_task_t *t, spc_status_t st, uint32_t bad_rank, const char *detail)
{
    if (t->status != SPC_OK)
        return;
    t->status = st;
    t->bad_rank = bad_rank;
    snprintf(t->detail, sizeof t->detail, "%s", detail);
}
void sp_devplan_enqueue(sp_task_t *t, sp_gpu_hstage_t **staged_p)
{
    push(enq_lane(), (step_t){ .kind = S_KERNEL, .task = t });
}
void sp_gpu_hstage_put(sp_gpu_hstage_t *list) {}
void sp_task_finish(sp_engine_t *e, sp_task_t *t)
{
    CHECK(!t->finished);
    t->finished = true;
    for (uint32_t r = 0; r < t->size; r++)   /* as sp_op_complete: an op that never started owes its done */
        if (t->ops[r]->client != NULL)
            sp_stream_op_unstarted(e, t->ops[r]);
}
void sp_task_abort(sp_engine_t *e, sp_task_t *t, spc_status_t st, const char *detail)
{
    sp_task_fail(t, st, UINT32_MAX, detail);
    sp_task_finish(e, t);
}
bool sp_task_xdev(const sp_task_t *t) { return t->xdev; }
void sp_task_xdev_stream(sp_task_t *t, uint64_t ready, uint64_t done, uint64_t seq)
{
    CHECK(t->work.nsems < PMAX);
    t->work.sems = t->sems;
    t->sems[t->work.nsems++] = (sp_nccl_sem_t){ ready, done, seq };
}
/* The NCCL thread's queue. */
static sp_task_t *nccl_q[16];
static uint32_t nccl_n;
void sp_task_xdev_submit(sp_engine_t *e, sp_task_t *t)
{
    CHECK(nccl_n < 16);
    nccl_q[nccl_n++] = t;
}
bool sp_task_xdev_back(const sp_task_t *t) { return t->back; }
void sp_task_xdev_give_up(sp_task_t *t) { t->work.given_up = true; }
bool sp_task_xdev_wrote_done(const sp_task_t *t) { return t->work.done_enqueued; }
static sp_task_t *leaking;   /* its NCCL stream does not drain */
bool sp_task_xdev_leaks(const sp_task_t *t) { return t == leaking; }

/* ================================================================ running it */

/* One pass over every lane: each runs until it must wait. Returns whether anything ran. */
static bool gpu_pass(void)
{
    bool any = false;
    struct sp_gpu_lane *all[LANES_MAX + 1];
    uint32_t n = 0;
    all[n++] = &device_stream;
    for (uint32_t i = 0; i < nlanes; i++)
        all[n++] = lanes[i];
    for (uint32_t i = 0; i < n; i++) {
        struct sp_gpu_lane *l = all[i];
        while (l != paused && l->head != l->tail) {
            step_t *s = &l->q[l->head % QMAX];
            bool go = true;
            switch (s->kind) {
            case S_WAIT:      go = (int64_t)(*s->addr - s->v) >= 0; break;
            case S_WRITE:     *s->addr = s->v; break;
            case S_MARK:      s->mark->done = true; break;
            case S_WAIT_MARK: go = s->mark->done; break;
            case S_INPUT:     clients[s->rank].input[s->v] = true; break;
            case S_HOLD:      go = !held; break;
            case S_KERNEL: {
                sp_task_t *t = s->task;
                t->kernels_ran = true;
                for (uint32_t r = 0; r < t->size; r++) {
                    sp_op_t *op = t->ops[r];
                    if (op->client != NULL && op->sqe.stream != 0 &&
                        !((client_t *)op->client)->input[op->sqe.stream_seq])
                        t->stale = true;   /* read an input its stream had not written */
                }
                break;
            }
            }
            if (!go)
                break;
            l->head++;
            any = true;
        }
    }
    return any;
}

/* The NCCL thread, one work at a time (one communicator): the work's waits,
 * its kernels and transfers (one step), its done writes, on a lane of its
 * own; handed back once the lane has run them. The work in `refuse` is handed
 * back failed before its lane holds anything. */
static struct sp_gpu_lane *comm_lane, *leaked_lane;
static sp_task_t *refuse, *running;

static void nccl_hand_back(sp_task_t *t)
{
    if (t->work.status != SPC_OK)
        sp_task_fail(t, t->work.status, UINT32_MAX, t->work.detail);
    if (t->work.nsems > 0)
        t->back = true;
    else
        sp_task_finish(&eng, t);
}

static bool nccl_pass(void)
{
    if (running != NULL) {
        if (comm_lane->head != comm_lane->tail)
            return false;   /* polled as the thread polls its lane */
        nccl_hand_back(running);
        running = NULL;
        return true;
    }
    if (nccl_n == 0)
        return false;
    sp_task_t *t = nccl_q[0];
    memmove(nccl_q, nccl_q + 1, --nccl_n * sizeof nccl_q[0]);
    if (t == refuse) {
        t->work.status = SPC_ERR_TRANSPORT;
        snprintf(t->work.detail, sizeof t->work.detail, "refused by the stand-in NCCL thread");
        nccl_hand_back(t);
        return true;
    }
    if (t == leaking) {
        /* Aborted with its done writes queued behind what never ends (held):
         * handed back failed, the lane left to run out whenever it does. */
        push(leaked_lane, (step_t){ .kind = S_HOLD });
        for (uint32_t k = 0; k < t->work.nsems; k++)
            push(leaked_lane, (step_t){ .kind = S_WRITE, .addr = (volatile uint64_t *)(uintptr_t)t->sems[k].done,
                                        .v = t->sems[k].seq });
        t->work.done_enqueued = t->work.nsems > 0;
        t->work.status = SPC_ERR_TRANSPORT;
        snprintf(t->work.detail, sizeof t->work.detail, "the NCCL stream did not drain after the abort");
        nccl_hand_back(t);
        return true;
    }
    for (uint32_t k = 0; k < t->work.nsems; k++)
        push(comm_lane, (step_t){ .kind = S_WAIT, .addr = (volatile uint64_t *)(uintptr_t)t->sems[k].ready,
                                  .v = t->sems[k].seq });
    push(comm_lane, (step_t){ .kind = S_KERNEL, .task = t });
    for (uint32_t k = 0; k < t->work.nsems; k++)
        push(comm_lane, (step_t){ .kind = S_WRITE, .addr = (volatile uint64_t *)(uintptr_t)t->sems[k].done,
                                  .v = t->sems[k].seq });
    t->work.done_enqueued = t->work.nsems > 0;
    running = t;
    return true;
}

/* Runs the GPU, the NCCL stand-in and spd's poll until nothing moves. */
static void settle(void)
{
    /* A poll that gives up moves nothing itself: quiet means twice in a row. */
    for (int round = 0, quiet = 0; round < 10000; round++) {
        bool any = gpu_pass();
        any = nccl_pass() || any;
        any = sp_stream_poll(&eng, clock_ns) > 0 || any;
        quiet = any ? 0 : quiet + 1;
        if (quiet == 2)
            return;
    }
    SP_FAIL("no quiet state after 10000 rounds");
}

/* ================================================================ making ops */

static void setup(uint32_t P)
{
    memset(&eng, 0, sizeof eng);
    memset(clients, 0, sizeof clients);
    cfg = (sp_config_t){ .op_timeout_ms = 1000 };
    eng.cfg = &cfg;
    eng.gpu_sched = calloc(1, sizeof *eng.gpu_sched);   /* as sp_gpu_install makes it; stream.c alone runs here */
    CHECK(eng.gpu_sched != NULL);
    device_stream.head = device_stream.tail = 0;
    for (uint32_t i = 0; i < nlanes; i++)
        free(lanes[i]);
    nlanes = 0;
    nccl_n = 0;
    refuse = running = leaking = NULL;
    held = false;
    paused = NULL;
    unregistered = 0;
    comm_lane = lane_new("NCCL communicator's lane");
    leaked_lane = lane_new("an aborted NCCL communicator's lane");
    for (uint32_t r = 0; r < P; r++) {
        client_t *cl = &clients[r];
        cl->c.id = r + 1;
        cl->c.pid = 1000 + (int)r;
        cl->c.rank = r;
        cl->c.v.sems = cl->sems;
        cl->c.layout.cq_entries = 64;
        cl->c.next = r + 1 < P ? &clients[r + 1].c : NULL;
        cl->cuda = lane_new("client's CUDA stream");
        uint32_t slot;
        sp_err_t e = SP_ERR_INIT;
        CHECK(sp_stream_open(&eng, &cl->c, "0000:00:00.0", NULL, 0, &slot, &e) == SPC_OK);
        CHECK_EQ(slot, 0u);
    }
    eng.clients = &clients[0].c;
}

/* What the client library and the application do for one op on rank r's
 * stream: the application's kernels write the input (after a hold when
 * `hold`), then ready = seq, the op goes to spd, then a wait for done. */
static sp_op_t *submit(uint32_t r, bool hold)
{
    client_t *cl = &clients[r];
    uint64_t seq = ++cl->submitted;
    if (hold)
        push(cl->cuda, (step_t){ .kind = S_HOLD });
    push(cl->cuda, (step_t){ .kind = S_INPUT, .v = seq, .rank = r });
    push(cl->cuda, (step_t){ .kind = S_WRITE, .addr = &cl->sems[0].ready, .v = seq });
    push(cl->cuda, (step_t){ .kind = S_WAIT, .addr = &cl->sems[0].done, .v = seq });
    sp_op_t *op = calloc(1, sizeof *op);
    CHECK(op != NULL);
    op->client = &cl->c;
    op->device = true;
    op->sqe.stream = 1;
    op->sqe.stream_seq = seq;
    op->sqe.timeout_ms = 100;
    sp_stream_consume(&eng, op);
    CHECK_EQ(op->local.status, SPC_OK);
    return op;
}

/* A matched op of every rank in ranks[0..n-1] (the others: another daemon's). */
static sp_task_t *task_of(sp_op_t **ops, uint32_t n, uint32_t size, bool xdev)
{
    sp_task_t *t = calloc(1, sizeof *t);
    CHECK(t != NULL);
    t->size = size;
    t->xdev = xdev;
    for (uint32_t r = 0; r < size; r++) {
        if (r < n) {
            t->ops[r] = ops[r];
        } else {
            t->ops[r] = calloc(1, sizeof(sp_op_t));   /* a rank of another daemon */
            CHECK(t->ops[r] != NULL);
            t->ops[r]->sqe.timeout_ms = 100;
        }
    }
    return t;
}

/* One op on ranks 0..P-1 here (and one of another daemon's when xdev). */
static sp_task_t *op_all(uint32_t P, bool xdev, int hold_rank)
{
    sp_op_t *ops[PMAX];
    for (uint32_t r = 0; r < P; r++)
        ops[r] = submit(r, (int)r == hold_rank);
    sp_task_t *t = task_of(ops, P, xdev ? P + 1 : P, xdev);
    sp_stream_task_ready(&eng, t);
    return t;
}

static void check_clean(sp_task_t *t, const char *what)
{
    if (!t->finished || t->status != SPC_OK || t->stale || !t->kernels_ran)
        SP_FAIL("%s: finished %d, status %s (%s), stale input %d, ran %d", what, t->finished,
                spc_status_name(t->status), t->detail, t->stale, t->kernels_ran);
}

static void task_free(sp_task_t *t)
{
    for (uint32_t r = 0; r < t->size; r++)
        free(t->ops[r]);
    free(t);
}

static void teardown(uint32_t P, sp_task_t **ts, uint32_t n)
{
    sp_stream_stop(&eng);
    for (uint32_t r = 0; r < P; r++)
        sp_stream_client_free(&clients[r].c);
    for (uint32_t i = 0; i < n; i++)
        task_free(ts[i]);
    sp_stream_cleanup(&eng);
}

/* ================================================================ cases */

static void test_local_and_across(bool across)
{
    const uint32_t P = 2;
    setup(P);
    sp_task_t *ts[6];
    for (uint32_t i = 0; i < 6; i++)
        ts[i] = op_all(P, across && i % 2 == 1, -1);
    settle();
    for (uint32_t i = 0; i < 6; i++) {
        char what[64];
        snprintf(what, sizeof what, "%s op %u", across ? "across" : "local", i + 1);
        check_clean(ts[i], what);
    }
    for (uint32_t r = 0; r < P; r++) {
        CHECK_EQ(clients[r].sems[0].done, 6u);
        CHECK_EQ(clients[r].cuda->head, clients[r].cuda->tail);   /* every CUDA stream ran to its end */
    }
    CHECK_EQ(eng.gpu_sched->nflight, 0u);
    CHECK_EQ(eng.gpu_sched->stream_ops, 12u);
    teardown(P, ts, 6);
}

static void test_refused(void)
{
    const uint32_t P = 2;
    setup(P);
    sp_task_t *ts[3];
    ts[0] = op_all(P, false, -1);
    ts[1] = op_all(P, true, -1);
    refuse = ts[1];
    ts[2] = op_all(P, false, -1);
    settle();
    check_clean(ts[0], "refused: the op before");
    CHECK(ts[1]->finished);
    CHECK_EQ(ts[1]->status, SPC_ERR_TRANSPORT);
    CHECK(!ts[1]->kernels_ran);
    check_clean(ts[2], "refused: the op after");
    for (uint32_t r = 0; r < P; r++)
        CHECK_EQ(clients[r].sems[0].done, 3u);   /* the host stored 2, the lane 3 */
    teardown(P, ts, 3);
}

static void test_late(bool across)
{
    const uint32_t P = 2;
    setup(P);
    sp_task_t *ts[3];
    ts[0] = op_all(P, across, -1);
    held = true;
    ts[1] = op_all(P, across, 1);   /* rank 1's stream is held before this op's input */
    ts[2] = op_all(P, across, -1);  /* submitted before spd gives up on rank 1 */
    settle();
    check_clean(ts[0], "late: the op before");
    CHECK(!ts[1]->finished && !ts[2]->finished);
    clock_ns += 150ull * 1000000ull;   /* past the ops' 100 ms */
    settle();
    CHECK(ts[1]->finished);
    CHECK_EQ(ts[1]->status, SPC_ERR_TIMEOUT);
    CHECK_EQ(ts[1]->bad_rank, 1u);
    CHECK_CONTAINS(ts[1]->detail, "did not reach");
    if (across)
        CHECK(ts[1]->work.given_up);   /* the other daemons fail it too */
    held = false;
    clock_ns += 150ull * 1000000ull;
    settle();
    /* The second op's waits passed on the poisoned ready; its result does not stand. */
    CHECK(ts[2]->finished);
    CHECK_EQ(ts[2]->status, SPC_ERR_CANCELED);
    CHECK_EQ(ts[2]->bad_rank, 1u);
    CHECK_CONTAINS(ts[2]->detail, "given up at");
    if (across)
        CHECK(ts[2]->work.given_up);
    for (uint32_t r = 0; r < P; r++)
        CHECK_EQ(clients[r].cuda->head, clients[r].cuda->tail);   /* no CUDA stream waits for ever */
    CHECK(clients[1].c.streams[0]->broken);
    CHECK(!clients[0].c.streams[0]->broken);
    CHECK_EQ(clients[0].sems[0].done, 3u);
    CHECK_EQ(eng.gpu_sched->nflight, 0u);
    printf("late%s: \"%s\"; then \"%s\"\n", across ? " (across daemons)" : "", ts[1]->detail, ts[2]->detail);
    teardown(P, ts, 3);
}

static void test_let_go(void)
{
    const uint32_t P = 2;
    setup(P);
    sp_task_t *ts[3];
    ts[0] = op_all(P, false, -1);
    settle();
    check_clean(ts[0], "let go: the op before");
    held = true;
    ts[1] = op_all(P, false, 1);   /* rank 1's stream is held before this op's input */
    clock_ns += 60ull * 1000000ull;
    ts[2] = op_all(P, false, -1);
    settle();   /* rank 0's stream is at op 2, waiting for its done */
    paused = clients[0].cuda;
    clock_ns += 50ull * 1000000ull;   /* past op 2's 100 ms, not op 3's */
    settle();
    CHECK(ts[1]->finished);
    CHECK_EQ(ts[1]->status, SPC_ERR_TIMEOUT);
    CHECK_EQ(ts[1]->bad_rank, 1u);
    CHECK_EQ(clients[0].sems[0].done, 2u);
    CHECK_EQ(clients[0].sems[0].ready, 2u);   /* its stream has not run since that done */
    clock_ns += 60ull * 1000000ull;   /* past op 3's 100 ms; 60 since rank 0's stream was let go */
    settle();
    if (ts[2]->finished)
        SP_FAIL("let go: op 3 given up %u ms after rank 0's stream was let go to it: %s (bad rank %u): %s", 60u,
                spc_status_name(ts[2]->status), ts[2]->bad_rank, ts[2]->detail);
    paused = NULL;
    held = false;
    settle();
    CHECK(ts[2]->finished);
    CHECK_EQ(ts[2]->status, SPC_ERR_CANCELED);
    CHECK_EQ(ts[2]->bad_rank, 1u);
    CHECK_CONTAINS(ts[2]->detail, "given up at");
    CHECK(!clients[0].c.streams[0]->broken);
    CHECK_EQ(clients[0].sems[0].done, 3u);
    for (uint32_t r = 0; r < P; r++)
        CHECK_EQ(clients[r].cuda->head, clients[r].cuda->tail);
    printf("let go: op 3 waited for rank 0's stream from op 2's done; then \"%s\"\n", ts[2]->detail);
    teardown(P, ts, 3);
}

static void test_gone(bool across)
{
    const uint32_t P = 2;
    setup(P);
    sp_task_t *ts[1];
    held = true;
    ts[0] = op_all(P, across, 1);
    settle();
    CHECK(!ts[0]->finished && !ts[0]->work.given_up);
    clients[1].c.zombie = true;
    sp_stream_client_gone(&eng, &clients[1].c);
    CHECK_EQ(ts[0]->work.given_up, across);
    settle();
    CHECK(ts[0]->finished);
    /* A rank that died mid-op is lost, for every rank (as coll.c says it): not
     * a stream given up, which would tell the others it refused. */
    if (ts[0]->status != SPC_ERR_PEER_LOST || ts[0]->bad_rank != UINT32_MAX)
        SP_FAIL("gone%s: %s (bad rank %u): %s; want PEER_LOST for every rank", across ? " (across daemons)" : "",
                spc_status_name(ts[0]->status), ts[0]->bad_rank, ts[0]->detail);
    CHECK_CONTAINS(ts[0]->detail, "rank 1");
    printf("gone%s: %s: %s\n", across ? " (across daemons)" : "", spc_status_name(ts[0]->status), ts[0]->detail);
    held = false;
    settle();
    CHECK_EQ(clients[0].cuda->head, clients[0].cuda->tail);
    clients[1].c.zombie = false;
    teardown(P, ts, 1);
}

static void test_leak(void)
{
    const uint32_t P = 2;
    setup(P);
    sp_task_t *ts[1];
    held = true;   /* what the leaked lane never gets past, for now */
    ts[0] = op_all(P, true, -1);
    leaking = ts[0];
    settle();
    CHECK(ts[0]->finished);
    CHECK_EQ(ts[0]->status, SPC_ERR_TRANSPORT);
    for (uint32_t r = 0; r < P; r++) {
        CHECK(clients[r].c.streams[0]->broken && clients[r].c.sems_kept);
        CHECK_EQ(clients[r].sems[0].done, SP_STREAM_POISON);
        CHECK_EQ(clients[r].cuda->head, clients[r].cuda->tail);   /* its CUDA stream went on */
    }
    sp_err_t e = SP_ERR_INIT;
    uint32_t slot;
    CHECK_EQ(sp_stream_close(&eng, &clients[0].c, 0, &e), SPC_OK);
    CHECK_EQ(clients[0].c.slots_retired, 1u);
    CHECK_EQ(sp_stream_open(&eng, &clients[0].c, "0000:00:00.0", NULL, 0, &slot, &e), SPC_OK);
    CHECK_EQ(slot, 1u);
    held = false;   /* the leaked lane runs out: its done lands in the retired slot */
    settle();
    CHECK_EQ(clients[0].sems[0].done, 1u);
    CHECK_EQ(clients[0].sems[1].done, 0u);
    printf("leak: \"%s\": slot 0 retired, the next stream in slot 1; ", ts[0]->detail);
    teardown(P, ts, 1);
    CHECK_EQ(unregistered, 0u);   /* a late write would have faulted the device */
    printf("the semaphores kept registered\n");
}

static void test_unwritten(void)
{
    setup(1);
    sp_err_t e = SP_ERR_INIT;
    uint32_t slot;
    held = true;
    sp_op_t *op = submit(0, true);   /* its CUDA stream is held before the op's ready */
    sp_stream_op_unstarted(&eng, op);   /* failed before it started: spd stores its done */
    CHECK_EQ(clients[0].sems[0].done, 1u);
    CHECK_EQ(sp_stream_close(&eng, &clients[0].c, 0, &e), SPC_OK);
    CHECK_EQ(clients[0].c.slots_retired, 1u);
    CHECK_EQ(sp_stream_open(&eng, &clients[0].c, "0000:00:00.0", NULL, 0, &slot, &e), SPC_OK);
    CHECK_EQ(slot, 1u);
    held = false;
    settle();
    CHECK_EQ(clients[0].sems[0].ready, 1u);   /* the late write, in the retired slot */
    CHECK_EQ(clients[0].sems[1].ready, 0u);
    /* A stream whose ready came is closed, and its slot given again. */
    CHECK_EQ(sp_stream_close(&eng, &clients[0].c, 1, &e), SPC_OK);
    CHECK_EQ(sp_stream_open(&eng, &clients[0].c, "0000:00:00.0", NULL, 0, &slot, &e), SPC_OK);
    CHECK_EQ(slot, 1u);
    CHECK_EQ(clients[0].c.slots_retired, 1u);
    free(op);
    teardown(1, NULL, 0);
    CHECK_EQ(unregistered, 1u);
    printf("unwritten: a slot whose ready was still owed retired; one whose ready came given again\n");
}

int main(void)
{
    test_local_and_across(false);
    test_local_and_across(true);
    printf("local and across: every op after its inputs, done at its seq\n");
    test_refused();
    printf("refused: done stored by the host, in order\n");
    test_late(false);
    test_late(true);
    test_let_go();
    test_gone(false);
    test_gone(true);
    test_leak();
    test_unwritten();
    for (uint32_t i = 0; i < nlanes; i++)
        free(lanes[i]);
    return 0;
}
