/*
 * Device ops, on one daemon and across daemons, without a GPU or NCCL:
 * daemon/core/exec.c compiled into this program and the device plans linked
 * with it (gpu/devplan.c on one GPU, cluster/xdev.c across daemons, reached
 * through the engine's ops tables as spd reaches them), their GPU calls done on
 * the host with the host references of kernels/ (the ones the CUDA kernels
 * match bit for bit), the NCCL hand-over
 * replaced by a stand-in that pairs every daemon's transfers by their index,
 * as NCCL pairs them by their order. D = 2 and 3 "daemons", each with its own
 * view of the job, run every op for their own ranks through the real
 * sp_task_create, sp_task_xdev_submit, then what the NCCL thread calls
 * (sp_xdev_plan, sp_xdev_before, the exchange, sp_xdev_after, sp_xdev_done);
 * every rank's output is checked byte for byte against the
 * one-node result. One "daemon" (D = 1) runs the same ops through
 * sp_devplan_enqueue, the kernels of one node, checked against the same results,
 * its ranks on one GPU and on three (rank r on GPU r % 3; once with GPUs 0 and
 * 2 unable to reach each other), where every kernel must run on the GPU of
 * what it writes and read another GPU's tensor only through its import's
 * opening there (sp_gpu_import_on), or from pinned host memory its own GPU
 * copied it into where the two cannot reach each other. Across daemons a
 * daemon's ranks sit on one GPU, then on three (rank r on GPU (5r + 1) % 3),
 * then with GPUs 0 and 2 apart: every kernel runs on the daemon's NCCL GPU
 * (its lowest rank's) or copies to and from pinned host memory on its own
 * rank's GPU, touches another GPU's memory only where it was opened there, and
 * NCCL sends and receives only memory of its GPU or opened there:
 *
 *   placements  P = D .. 8 ranks (2 .. 8 on one daemon), in blocks, round-robin and scattered, the
 *               daemons' names out of order (NCCL ranks follow the names);
 *   allreduce   fp32, fp64 in place, bf16 sum, fp16 max: rank-order folds;
 *   allgather, broadcast from every root;
 *   reduce_scatter  fp32 sum, bf16 min: block r of the rank-order fold;
 *   shift       cyclic, linear with two tensors, reversed, reversed linear;
 *   alltoall    every case of sp_kern_cases.h for P, one tensor and with a
 *               second (KV, summed replicas), seq->head and back;
 *   alltoallv   counts of their own per pair of ranks, empty blocks among
 *               them, and the last rank sending and receiving nothing.
 *
 * And what the stand-in checks: every daemon counts the same transfers, every
 * receive has its send (same index, bytes and pair of daemons) and every send
 * its receive, and every daemon plans the op (none refuses it).
 *
 * The op table (ops.c) is compiled in too, and the checks it names are stubbed
 * (every op here is valid); the functions exec.c calls outside itself are
 * stubbed below; one it comes to call anew needs a stub here too.
 */
#include "../../daemon/core/exec.c"
#include "../../daemon/core/ops.c"

#include "cluster/sp_nccl.h"
#include "cluster/xdev.h"
#include "gpu/devplan.h"
#include "gpu/gpu.h"
#include "gpu/stream.h"

#include "sp_kern_a2a.h"
#include "sp_kern_cases.h"
#include "sp_test.h"
#include "core/client.h"
#include "core/engine.h"
#include "core/exec.h"
#include "core/job.h"
#include "core/mem.h"
#include "core/ops.h"
#include "core/workers.h"

#define MAXD 3
#define MAXP 8

/* ================================================================ stubs: memory, GPU, NCCL */

/* A region is one host buffer standing for a rank's device tensor on GPU
 * `gpu`, its own import; reached[i] has bit d once GPU d opened region i's. */
#define MAXREGIONS 1024
static sp_region_t regions[MAXREGIONS];
static uint64_t reached[MAXREGIONS];
static uint32_t nregions;
/* Where each kernel runs is checked. Across daemons every kernel runs on the
 * NCCL GPU (`pushing`): it may also write a rank's memory on another GPU
 * where that memory was opened there (peer access). */
static bool placing, pushing;

static uint32_t region_of(uint8_t *p, uint64_t n, int gpu)
{
    CHECK(nregions < MAXREGIONS);
    regions[nregions] = (sp_region_t){ .id = nregions, .kind = SP_REGION_DEVICE, .length = n, .gpu = gpu,
                                       .import = (struct sp_gpu_import *)&regions[nregions],
                                       .dptr = (uint64_t)(uintptr_t)p };
    reached[nregions] = 0;
    return nregions++;
}

/* Whether GPUs 0 and 2 cannot reach each other (no peer access): across
 * daemons, the tensors of a daemon's ranks on one of them go through pinned
 * host memory when its NCCL GPU is the other. */
static bool apart02;

bool sp_gpu_can_reach(int from, int to)
{
    return !(apart02 && ((from == 0 && to == 2) || (from == 2 && to == 0)));
}

/* The import stands for its region: opened on another GPU at the same address. */
spc_status_t sp_gpu_import_on(sp_gpu_import_t *imp, int dev, uint64_t *dptr_p, sp_err_t *e)
{
    const sp_region_t *r = (const sp_region_t *)imp;
    CHECK(r->gpu != dev);   /* a GPU reaches its own memory where it is */
    if (!sp_gpu_can_reach(dev, r->gpu))
        SP_FAIL("GPU %d opened GPU %d's memory, which it cannot reach", dev, r->gpu);
    reached[r - regions] |= 1ull << dev;
    *dptr_p = r->dptr;
    return SPC_OK;
}
uint64_t sp_gpu_import_ptr(const sp_gpu_import_t *imp) { return ((const sp_region_t *)imp)->dptr; }

/* Staging in pinned host memory: a region of no GPU's (gpu -1), which every
 * GPU reaches. The kernels here run at once, so marks order nothing. */
struct sp_gpu_hstage {
    sp_gpu_hstage_t *next;
    uint8_t         *p;
};
static int hstaged_across;   /* tensors staged so across daemons: the path ran */
static uint64_t multi_across, staged_across;   /* the daemons' counts of such ops */
spc_status_t sp_gpu_hstage_get(uint64_t bytes, sp_gpu_hstage_t **s_p, sp_err_t *e)
{
    sp_gpu_hstage_t *s = calloc(1, sizeof *s);
    hstaged_across += pushing;
    CHECK(s != NULL && (s->p = malloc(bytes)) != NULL);
    region_of(s->p, bytes, -1);
    *s_p = s;
    return SPC_OK;
}
void *sp_gpu_hstage_ptr(const sp_gpu_hstage_t *s) { return s->p; }
void sp_gpu_hstage_chain(sp_gpu_hstage_t *s, sp_gpu_hstage_t **list)
{
    s->next = *list;
    *list = s;
}
void sp_gpu_hstage_put(sp_gpu_hstage_t *list)
{
    while (list != NULL) {
        sp_gpu_hstage_t *s = list;
        list = s->next;
        free(s->p);
        free(s);
    }
}
static int marks_made;
spc_status_t sp_gpu_mark(int dev, sp_gpu_mark_t **mark_p, sp_err_t *e)
{
    *mark_p = (sp_gpu_mark_t *)&marks_made;
    marks_made++;
    return SPC_OK;
}
spc_status_t sp_gpu_wait_mark(int dev, sp_gpu_mark_t *mark, sp_err_t *e) { return SPC_OK; }
void sp_gpu_mark_free(sp_gpu_mark_t *mark) {}

/* The region [p, p + n) lies in. */
static const sp_region_t *region_at(const void *p, uint64_t n)
{
    uint64_t a = (uint64_t)(uintptr_t)p;
    for (uint32_t i = 0; i < nregions; i++)
        if (a >= regions[i].dptr && a + n <= regions[i].dptr + regions[i].length)
            return &regions[i];
    SP_FAIL("a kernel touches %p + %" PRIu64 " bytes, in no rank's tensor", p, n);
}

/* A kernel on GPU dev writes n bytes at dst and reads src_n at each src: dst
 * is dev's (pull), staging (gpu -1) that a copy of dev's fills, or opened on
 * dev where `push` (an all-reduce in place); each src is dev's, staging, or
 * opened on dev. */
static void kernel_place(int dev, const void *dst, const void *const *src, uint32_t nsrc, uint64_t n,
                         uint64_t src_n, bool push)
{
    const sp_region_t *r = region_at(dst, n);
    push = push || pushing;
    if (r->gpu != dev && r->gpu >= 0 && !(push && (reached[r - regions] & (1ull << dev))))
        SP_FAIL("a kernel on GPU %d writes rank memory of GPU %d (a kernel runs where its output is)", dev, r->gpu);
    for (uint32_t q = 0; q < nsrc; q++) {
        if (src[q] == NULL)
            continue;
        r = region_at(src[q], src_n);
        if (r->gpu != dev && r->gpu >= 0 && !(reached[r - regions] & (1ull << dev)))
            SP_FAIL("a kernel on GPU %d reads GPU %d's memory that was never opened there", dev, r->gpu);
    }
}

const sp_region_t *sp_mem_device(const sp_client_t *c, const struct sp_tensor_ref *t) { return &regions[t->region]; }
void *sp_mem_direct(const sp_client_t *c, const struct sp_tensor_ref *t) { return NULL; }
uint64_t sp_mem_remote_addr(const sp_client_t *c, const struct sp_tensor_ref *t) { return 0; }
spc_status_t sp_mem_vm_copy(sp_client_t *c, uint64_t remote, void *local, uint64_t len, bool write,
                            sp_err_t *e) { return SPC_OK; }
bool sp_mem_gone(sp_client_t *c, sp_err_t *e) { return false; }
void sp_gpu_import_ref(sp_gpu_import_t *imp) {}
void sp_gpu_import_unref(sp_engine_t *eng, sp_gpu_import_t *imp) {}
void sp_client_unpin(sp_engine_t *eng, sp_client_t *c) { c->pins--; }
void sp_engine_wakes_hold(sp_engine_t *eng) {}
void sp_engine_wakes_release(sp_engine_t *eng) {}
void sp_check_barrier(sp_op_t *op, uint32_t group_size) {}
void sp_check_counted(sp_op_t *op, uint32_t group_size) {}
void sp_check_shift(sp_op_t *op, uint32_t group_size) {}
void sp_check_alltoall(sp_op_t *op, uint32_t group_size) {}
void sp_check_alltoallv(sp_op_t *op, uint32_t group_size) {}
void sp_agree_counted(sp_agree_t *ag, uint32_t r, const sp_op_t *b, const sp_op_t *a) {}
void sp_agree_shift(sp_agree_t *ag, uint32_t r, const sp_op_t *b, const sp_op_t *a) {}
void sp_agree_alltoall(sp_agree_t *ag, uint32_t r, const sp_op_t *b, const sp_op_t *a) {}
void sp_agree_alltoallv(sp_agree_t *ag, uint32_t r, const sp_op_t *b, const sp_op_t *a) {}
void sp_parallel_for(sp_engine_t *eng, uint32_t n, uint32_t helpers, sp_par_fn fn, void *arg)
{
    for (uint32_t i = 0; i < n; i++)
        fn(arg, i);
}
void sp_kern_copy_fence(void) {}
_Atomic int sp_log_level = SP_LOG_ERROR;
_Atomic uint32_t sp_log_mask = SP_LOG_ALL;
void sp_log_emit(int level, int subsys_bit, const char *fmt, ...) {}
uint64_t sp_now_ns(void) { return 0; }
void sp_kern_copy_stream(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }
void sp_stats_coll_done(sp_engine_t *eng, sp_gstats_t *gs, sp_op_t *const *ops, uint32_t n, uint64_t bytes,
                        spc_status_t st, const char *detail, const spc_status_t *rank_status) {}

/* Each rank's completion, on its daemon. */
static spc_status_t completed[MAXP];
static char completed_detail[MAXP][SP_DETAIL_BYTES];

void sp_op_complete(sp_engine_t *eng, sp_op_t *op, spc_status_t status, const char *detail)
{
    if (op->client != NULL) {
        completed[op->client->rank] = status;
        snprintf(completed_detail[op->client->rank], SP_DETAIL_BYTES, "%s", detail != NULL ? detail : "");
    }
    free(op);
}

spc_status_t sp_gpu_copy(int dev, void *dst, const void *src, uint64_t n, sp_err_t *e)
{
    if (placing)
        kernel_place(dev, dst, &src, 1, n, n, false);
    if (src != NULL)
        memmove(dst, src, n);
    else
        memset(dst, 0, n);
    return SPC_OK;
}

/* The rank-order fold of src[0..nsrc-1] into out, as the fused kernel and the
 * host path make it (16-bit types through fp32, rounded once). */
static void fold(void *out, const void *const *src, uint32_t nsrc, uint64_t n, unsigned dtype, unsigned redop)
{
    if (sp_kern_acc_dtype(dtype) == dtype) {
        memcpy(out, src[0], n * sp_dtype_size(dtype));
        for (uint32_t r = 1; r < nsrc; r++)
            CHECK_EQ(sp_kern_reduce(out, src[r], n, dtype, redop), 0);
        return;
    }
    float *acc = malloc(n * sizeof *acc + 1);
    CHECK(acc != NULL);
    sp_kern_widen(acc, src[0], n, dtype);
    for (uint32_t r = 1; r < nsrc; r++)
        sp_kern_reduce_widen(acc, src[r], n, dtype, redop);
    sp_kern_narrow(out, acc, n, dtype);
    free(acc);
}

/* sp_kern_allreduce_cuda on the host: every source read before any
 * destination is written, so a rank's receive may be its send. */
spc_status_t sp_gpu_allreduce(int dev, void *const *dst, const void *const *src, uint32_t nranks, uint64_t n,
                              unsigned dtype, unsigned redop, sp_err_t *e)
{
    CHECK(nranks >= 1 && nranks <= SP_KERN_A2A_MAX_RANKS);
    uint64_t bytes = n * sp_dtype_size(dtype);
    bool in_place = false;
    for (uint32_t r = 0; r < nranks; r++)
        in_place = in_place || dst[r] == src[r];
    for (uint32_t r = 0; r < nranks && placing; r++)
        kernel_place(dev, dst[r], src, nranks, bytes, bytes, in_place);
    uint8_t *out = malloc(bytes + 1);
    CHECK(out != NULL);
    fold(out, src, nranks, n, dtype, redop);
    for (uint32_t r = 0; r < nranks; r++)
        memcpy(dst[r], out, bytes);
    free(out);
    return SPC_OK;
}

spc_status_t sp_gpu_a2a(int dev, void *dst, const void *const *src, const sp_kern_a2a_desc_t *d, uint32_t rank,
                        sp_err_t *e)
{
    sp_kern_a2a_geom_t g;
    if (placing && sp_kern_a2a_geom(&g, d, rank) == 0)
        kernel_place(dev, dst, src, d->ranks, sp_kern_a2a_out_bytes(&g), sp_kern_a2a_src_bytes(&g), false);
    if (sp_kern_a2a_host(dst, src, d, rank) != 0)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "all-to-all on GPU %d: the kernel refuses these arguments", dev);
    return SPC_OK;
}

struct sp_gpu_stage {
    uint8_t *p;
};

/* Device staging: a region of GPU dev's. */
spc_status_t sp_gpu_stage_get(int dev, uint64_t bytes, sp_gpu_stage_t **s_p, sp_err_t *e)
{
    sp_gpu_stage_t *s = malloc(sizeof *s);
    CHECK(s != NULL && (s->p = malloc(bytes ? bytes : 1)) != NULL);
    region_of(s->p, bytes, dev);
    memset(s->p, 0xA5, bytes);   /* what a transfer misses shows */
    *s_p = s;
    return SPC_OK;
}

void *sp_gpu_stage_ptr(const sp_gpu_stage_t *s) { return s->p; }

void sp_gpu_stage_put(sp_gpu_stage_t *s)
{
    if (s != NULL) {
        free(s->p);
        free(s);
    }
}

/* What each daemon handed to NCCL. */
static sp_nccl_work_t *works[MAXD];
static int current;   /* the daemon whose task runs */

void sp_nccl_submit(sp_engine_t *eng, sp_nccl_work_t *w)
{
    works[current] = w;
}

/* Stream order is stream.c's; these tasks follow no stream. */
void sp_nccl_give_up(sp_nccl_work_t *w) { SP_FAIL("an op in no stream was given up"); }

/* The engine's ops tables, as the GPU layer and the NCCL transport fill them
 * in for a task. */
static const sp_transport_ops_t gpu_ops = {
    .import_ref = sp_gpu_import_ref, .import_unref = sp_gpu_import_unref,
};
static const sp_transport_ops_t xdev_ops = {
    .task_attach = sp_xdev_attach, .task_detach = sp_xdev_detach, .task_ready = sp_xdev_submit,
    .task_stream = sp_xdev_stream, .task_give_up = sp_xdev_give_up, .task_back = sp_xdev_back,
    .task_wrote_done = sp_xdev_wrote_done, .task_leaks = sp_xdev_leaks,
};

/* ================================================================ the daemons' views */

typedef struct world {
    int         D, P;
    int         daemon_of[MAXP];
    int         gpu_of[MAXP];      /* one daemon: each rank's GPU */
    const char *names[MAXD];
} world_t;

/* One daemon: its engine, its job (nodes[0] itself), its copy of the group. */
typedef struct view {
    sp_engine_t eng;
    sp_config_t cfg;
    sp_gpu_sched_t sched;   /* its counts of ops on several GPUs, and staged */
    sp_job_t    job;
    sp_group_t  g;
    sp_client_t clients[MAXP];
    char        nodes[MAXD][SP_NODE_MAX];
    sp_member_t members[MAXP];
    uint32_t    ranks[MAXP], remote[MAXD];
} view_t;
static view_t views[MAXD];

static void views_make(const world_t *w)
{
    for (int d = 0; d < w->D; d++) {
        view_t *v = &views[d];
        memset(v, 0, sizeof *v);
        v->cfg.op_timeout_ms = 1000;
        v->eng.cfg = &v->cfg;
        v->eng.copy_threads = 1;
        v->eng.stream_min_bytes = UINT64_MAX;
        v->eng.gpu_ops = &gpu_ops;
        v->eng.xdev_ops = &xdev_ops;
        v->eng.gpu_sched = &v->sched;
        int idx[MAXD], n = 0;
        idx[d] = n;
        snprintf(v->nodes[n++], SP_NODE_MAX, "%s", w->names[d]);
        for (int e = 0; e < w->D; e++)
            if (e != d) {
                idx[e] = n;
                snprintf(v->nodes[n++], SP_NODE_MAX, "%s", w->names[e]);
            }
        v->job.nodes = v->nodes;
        v->job.nnodes = (uint32_t)n;
        snprintf(v->job.id, sizeof v->job.id, "node-b:test");
        v->job.members = v->members;
        v->job.world_size = (uint32_t)w->P;
        v->job.world = &v->g;
        for (int r = 0; r < w->P; r++) {
            v->members[r].node = (uint32_t)idx[w->daemon_of[r]];
            v->ranks[r] = (uint32_t)r;
            v->clients[r].rank = (uint32_t)r;
            v->g.nlocal += w->daemon_of[r] == d;
        }
        v->g = (sp_group_t){ .size = (uint32_t)w->P, .ranks = v->ranks, .job = &v->job, .index = 3, .id = 7,
                             .nlocal = v->g.nlocal, .remote = v->remote };
        for (int e = 0; e < w->D; e++)
            if (e != d)
                v->remote[v->g.nremote++] = (uint32_t)idx[e];
    }
}

/* An op as every rank submits it (sizes need[], a2a parameters); an
 * alltoallv's counts and sizes are each rank's own. */
typedef struct opdesc {
    struct sp_sqe         sqe;
    struct sp_a2a_params  a2a;
    uint64_t              need[SP_MAX_TENSORS];
    struct sp_a2av_params a2av[MAXP];
    uint64_t              vneed[MAXP][2];
} opdesc_t;

static int daemon_named(const char *name)
{
    for (int e = 0; e < MAXD; e++)
        if (works[e] != NULL && strcmp(works[e]->nodes[works[e]->me], name) == 0)
            return e;
    SP_FAIL("no daemon named %s", name);
}

static const sp_nccl_xfer_t *xfer_at(const sp_nccl_work_t *w, uint32_t index)
{
    for (uint32_t j = 0; j < w->nxfers; j++)
        if (w->xfers[j].index == index)
            return &w->xfers[j];
    return NULL;
}

/* The NCCL stand-in: every receive gets its send's bytes (all sends read first,
 * as they may run in any order). */
static void exchange(const world_t *w)
{
    const uint32_t ng = works[0]->nglobal;
    struct { uint8_t *dst, *data; uint64_t n; } *moves = NULL;
    size_t nmoves = 0;
    for (int a = 0; a < w->D; a++) {
        const sp_nccl_work_t *wa = works[a];
        CHECK_EQ(wa->nglobal, ng);
        CHECK_EQ(wa->nranks, w->D);
        for (uint32_t k = 0; k < wa->nxfers; k++) {
            const sp_nccl_xfer_t *x = &wa->xfers[k];
            CHECK(x->index < ng && x->bytes > 0 && x->peer != wa->me);
            const sp_region_t *at = region_at(x->ptr, x->bytes);   /* device memory NCCL's GPU reaches */
            if (at->gpu != wa->dev && !(reached[at - regions] & (1ull << wa->dev)))
                SP_FAIL("transfer %u of daemon %d: NCCL on GPU %d %s memory of GPU %d that is not open there",
                        x->index, a, wa->dev, x->send ? "sends from" : "receives into", at->gpu);
            const sp_nccl_work_t *wb = works[daemon_named(wa->nodes[x->peer])];
            const sp_nccl_xfer_t *y = xfer_at(wb, x->index);
            if (y == NULL || y->send == x->send || y->bytes != x->bytes ||
                strcmp(wb->nodes[y->peer], wa->nodes[wa->me]) != 0)
                SP_FAIL("transfer %u of daemon %d (%s %" PRIu64 " bytes with %s) has no partner", x->index, a,
                        x->send ? "sends" : "receives", x->bytes, wa->nodes[x->peer]);
            if (x->send)
                continue;
            moves = realloc(moves, (nmoves + 1) * sizeof *moves);
            CHECK(moves != NULL);
            moves[nmoves].dst = x->ptr;
            moves[nmoves].n = x->bytes;
            moves[nmoves].data = malloc(x->bytes);
            CHECK(moves[nmoves].data != NULL);
            memcpy(moves[nmoves].data, y->ptr, x->bytes);
            nmoves++;
        }
    }
    for (size_t i = 0; i < nmoves; i++) {
        memcpy(moves[i].dst, moves[i].data, moves[i].n);
        free(moves[i].data);
    }
    free(moves);
}

/* Runs one op over the world; bufs[r][i] is rank r's tensor i, on its daemon. */
static void run(const world_t *w, const opdesc_t *od, uint8_t *bufs[MAXP][SP_MAX_TENSORS], const char *what)
{
    views_make(w);
    nregions = 0;
    placing = true;
    pushing = w->D > 1;
    memset(works, 0, sizeof works);
    for (int d = 0; d < w->D; d++) {
        view_t *v = &views[d];
        sp_op_t *ops[MAXP];
        for (int r = 0; r < w->P; r++) {
            sp_op_t *op = calloc(1, sizeof *op);
            CHECK(op != NULL);
            op->sqe = od->sqe;
            memcpy(op->need, od->need, sizeof op->need);
            op->params.a2a = od->a2a;
            if (od->sqe.opcode == SP_OP_ALLTOALLV) {
                op->params.a2av = od->a2av[r];
                memcpy(op->need, od->vneed[r], sizeof od->vneed[r]);
            }
            op->device = true;
            op->gpu = w->gpu_of[r];
            op->seq = 5;
            for (int i = 0; i < od->sqe.ntensors; i++) {
                op->tensor[i].bytes = op->need[i];
                if (w->daemon_of[r] == d)
                    op->tensor[i].region = region_of(bufs[r][i], op->need[i], w->gpu_of[r]);
            }
            op->client = w->daemon_of[r] == d ? &v->clients[r] : NULL;
            ops[r] = op;
        }
        current = d;
        sp_task_create(&v->eng, &v->g, ops);
        sp_task_t *t = sp_task_next(&v->eng);
        if (w->D == 1) {   /* one daemon: the op's kernels on its ranks' GPUs, no NCCL */
            CHECK(t != NULL && !sp_task_xdev(t) && sp_task_device(t));
            sp_gpu_hstage_t *staged = NULL;
            sp_devplan_enqueue(t, &staged);
            sp_gpu_hstage_put(staged);
            sp_task_finish(&v->eng, t);
            for (int r = 0; r < w->P; r++)
                if (completed[r] != SPC_OK)
                    SP_FAIL("%s: rank %d on one daemon: %s (%s)", what, r, spc_status_name(completed[r]),
                            completed_detail[r]);
            return;
        }
        CHECK(t != NULL && sp_task_xdev(t) && sp_task_device(t));
        sp_task_xdev_submit(&v->eng, t);   /* to the NCCL thread, here the lines below */
        CHECK(works[d] != NULL && works[d]->task == t && sp_task_next(&v->eng) == NULL);
        sp_err_t e = SP_ERR_INIT;
        spc_status_t st = sp_xdev_plan(t, &e);
        if (st != SPC_OK)
            SP_FAIL("%s: daemon %d refused the op: %s (%s)", what, d, spc_status_name(st), e.msg);
        CHECK_EQ(e.status, SPC_OK);
        CHECK_EQ(sp_xdev_before(t, &e), SPC_OK);
    }
    exchange(w);
    for (int d = 0; d < w->D; d++) {
        view_t *v = &views[d];
        current = d;
        sp_task_t *t = works[d]->task;
        sp_err_t e = SP_ERR_INIT;
        CHECK_EQ(sp_xdev_after(t, &e), SPC_OK);
        works[d]->status = SPC_OK;
        sp_xdev_done(&v->eng, t);   /* completes and frees it */
        multi_across += v->sched.multi_ops;
        staged_across += v->sched.staged_ops;
        CHECK(v->sched.staged_ops <= v->sched.multi_ops);
        for (int r = 0; r < w->P; r++)
            if (w->daemon_of[r] == d && completed[r] != SPC_OK)
                SP_FAIL("%s: rank %d on daemon %d: %s (%s)", what, r, d, spc_status_name(completed[r]),
                        completed_detail[r]);
    }
}

static void compare(const uint8_t *got, const uint8_t *want, uint64_t n, const char *what, const world_t *w, int r)
{
    for (uint64_t i = 0; i < n; i++)
        if (got[i] != want[i])
            SP_FAIL("%s, P %d over %d daemons, rank %d (daemon %d): byte %" PRIu64 " of %" PRIu64 " is 0x%02x, "
                    "expected 0x%02x", what, w->P, w->D, r, w->daemon_of[r], i, n, got[i], want[i]);
}

static void fill(uint8_t *p, uint64_t n, uint64_t seed)
{
    uint64_t st = seed * 0x9E3779B97F4A7C15ull + 1;
    sp_kern_fill(p, n, &st);
}

/* ================================================================ the ops */

static void test_collective(const world_t *w, unsigned op, unsigned dtype, unsigned redop, bool in_place,
                            uint32_t root, uint64_t count, const char *what)
{
    const int P = w->P;
    const uint64_t n = count * sp_dtype_size(dtype);
    const bool scatter = op == SP_OP_REDUCE_SCATTER;   /* a send holds P blocks of count */
    uint8_t *bufs[MAXP][SP_MAX_TENSORS] = { { 0 } }, *in[MAXP];
    opdesc_t od = { .sqe = { .opcode = (uint8_t)op, .dtype = (uint8_t)dtype, .redop = (uint8_t)redop,
                             .ntensors = op == SP_OP_BROADCAST ? 1 : 2, .count = count, .root = root } };
    od.need[0] = scatter ? n * (uint64_t)P : n;
    od.need[1] = op == SP_OP_ALLGATHER ? n * (uint64_t)P : n;
    for (int r = 0; r < P; r++) {
        in[r] = malloc(od.need[0]);
        fill(in[r], od.need[0], 1000 + (uint64_t)r);
        if (dtype == SP_DTYPE_F32 || dtype == SP_DTYPE_F64)   /* finite, inexact sums */
            for (uint64_t i = 0; i < od.need[0] / sp_dtype_size(dtype); i++) {
                double v = ((double)((i * 2654435761u + (uint64_t)r * 97u) % 100003u) - 50000.0) / 7.0;
                if (dtype == SP_DTYPE_F32)
                    ((float *)in[r])[i] = (float)v;
                else
                    ((double *)in[r])[i] = v;
            }
        bufs[r][0] = malloc(od.need[0]);
        memcpy(bufs[r][0], in[r], od.need[0]);
        if (op != SP_OP_BROADCAST) {
            bufs[r][1] = in_place ? bufs[r][0] : malloc(od.need[1]);
            if (!in_place)
                memset(bufs[r][1], 0x5A, od.need[1]);
        }
    }
    run(w, &od, bufs, what);
    uint8_t *want = malloc(od.need[1]);
    if (op == SP_OP_ALLREDUCE) {
        fold(want, (const void *const *)in, (uint32_t)P, count, dtype, redop);
    } else if (op == SP_OP_ALLGATHER) {
        for (int q = 0; q < P; q++)
            memcpy(want + n * (uint64_t)q, in[q], n);
    } else {
        memcpy(want, in[root], n);
    }
    for (int r = 0; r < P; r++) {
        if (scatter) {   /* block r of the all-reduce of the sends */
            const uint8_t *blocks[MAXP];
            for (int q = 0; q < P; q++)
                blocks[q] = in[q] + n * (uint64_t)r;
            fold(want, (const void *const *)blocks, (uint32_t)P, count, dtype, redop);
        }
        compare(op == SP_OP_BROADCAST ? bufs[r][0] : bufs[r][1], want, od.need[1], what, w, r);
        if (op != SP_OP_BROADCAST && !in_place)
            free(bufs[r][1]);
        free(bufs[r][0]);
    }
    for (int r = 0; r < P; r++)
        free(in[r]);   /* a reduce-scatter's reference reads every rank's */
    free(want);
}

static void test_shift(const world_t *w, uint32_t flags, uint32_t ntensors, const char *what)
{
    const int P = w->P;
    const uint64_t sizes[2] = { 1000 + 7, 333 };
    uint8_t *bufs[MAXP][SP_MAX_TENSORS] = { { 0 } };
    opdesc_t od = { .sqe = { .opcode = SP_OP_SHIFT, .flags = flags, .ntensors = (uint8_t)(2 * ntensors) } };
    for (uint32_t i = 0; i < ntensors; i++)
        od.need[2 * i] = od.need[2 * i + 1] = sizes[i];
    for (int r = 0; r < P; r++)
        for (uint32_t i = 0; i < ntensors; i++) {
            bufs[r][2 * i] = malloc(sizes[i]);
            fill(bufs[r][2 * i], sizes[i], 77 + (uint64_t)r * 10 + i);
            bufs[r][2 * i + 1] = malloc(sizes[i]);
            memset(bufs[r][2 * i + 1], 0x5A, sizes[i]);
        }
    run(w, &od, bufs, what);
    const bool linear = flags & SP_SHIFT_F_LINEAR, reverse = flags & SP_SHIFT_F_REVERSE;
    for (int r = 0; r < P; r++)
        for (uint32_t i = 0; i < ntensors; i++) {
            int from = reverse ? (r + 1) % P : (r + P - 1) % P;
            bool edge = linear && (reverse ? r == P - 1 : r == 0);
            uint8_t *want = calloc(1, sizes[i]);
            if (!edge)
                fill(want, sizes[i], 77 + (uint64_t)from * 10 + i);
            compare(bufs[r][2 * i + 1], want, sizes[i], what, w, r);
            free(want);
            free(bufs[r][2 * i]);
            free(bufs[r][2 * i + 1]);
        }
}

/* One case of sp_kern_cases.h, with a KV tensor beside it when `two`, there and back. */
static void test_a2a(const world_t *w, const sp_kern_case_t *kc, bool two)
{
    const int P = w->P, nt = two ? 2 : 1;
    uint8_t *bufs[MAXP][SP_MAX_TENSORS] = { { 0 } }, *back[MAXP][SP_MAX_TENSORS] = { { 0 } };
    uint8_t *in[2][MAXP], *head[2][MAXP];
    sp_kern_a2a_desc_t s2h[2], h2s[2];
    uint64_t sb[2], hb[2];
    opdesc_t od = { .sqe = { .opcode = SP_OP_ALLTOALL, .dtype = (uint8_t)kc->dtype, .ntensors = (uint8_t)(2 * nt) } };
    od.a2a = (struct sp_a2a_params){ .direction = SP_A2A_SEQ_TO_HEAD, .layout = kc->layout, .batch = kc->batch,
                                     .seq_len = kc->seq_len, .kv_heads = kc->kv_heads, .ntensors = (uint32_t)nt };
    for (int i = 0; i < nt; i++) {
        uint32_t heads = i == 0 ? kc->heads : kc->kv_heads ? kc->kv_heads : kc->heads;
        uint32_t kind = i == 0 ? kc->kind : SP_KERN_HEADS_KV, flags = i == 0 ? kc->flags : SP_KERN_A2A_SUM_REPLICAS;
        od.a2a.t[i] = (struct sp_a2a_tensor){ heads, kc->head_dim, kind, flags };
        s2h[i] = (sp_kern_a2a_desc_t){ SP_KERN_SEQ_TO_HEAD, kc->layout, kc->batch, kc->seq_len, heads, kc->head_dim,
                                       kind, kc->kv_heads, (uint32_t)P, kc->dtype, 0 };
        h2s[i] = s2h[i];
        h2s[i].direction = SP_KERN_HEAD_TO_SEQ;
        h2s[i].flags = flags;
        sp_kern_a2a_geom_t g;
        if (sp_kern_a2a_geom(&g, &h2s[i], 0) != 0 || sp_kern_a2a_geom(&g, &s2h[i], 0) != 0)
            return;   /* refused by validation (e.g. u8 replicas summed) */
        sb[i] = sp_kern_a2a_src_bytes(&g);
        hb[i] = sp_kern_a2a_out_bytes(&g);
        od.need[2 * i] = sb[i];
        od.need[2 * i + 1] = hb[i];
        for (int q = 0; q < P; q++) {
            in[i][q] = malloc(sb[i]);
            fill(in[i][q], sb[i], 5000 + (uint64_t)q * 7 + (uint64_t)i);
        }
        for (int q = 0; q < P; q++) {
            head[i][q] = malloc(hb[i]);
            CHECK_EQ(sp_kern_a2a_host(head[i][q], (const void *const *)in[i], &s2h[i], (uint32_t)q), 0);
            bufs[q][2 * i] = in[i][q];
            bufs[q][2 * i + 1] = malloc(hb[i]);
            memset(bufs[q][2 * i + 1], 0x5A, hb[i]);
        }
    }
    char what[160];
    snprintf(what, sizeof what, "alltoall seq->head, %s%s", kc->name, two ? " with kv" : "");
    run(w, &od, bufs, what);
    for (int i = 0; i < nt; i++)
        for (int r = 0; r < P; r++)
            compare(bufs[r][2 * i + 1], head[i][r], hb[i], what, w, r);

    od.a2a.direction = SP_A2A_HEAD_TO_SEQ;
    for (int i = 0; i < nt; i++) {
        od.need[2 * i] = hb[i];
        od.need[2 * i + 1] = sb[i];
        for (int r = 0; r < P; r++) {
            back[r][2 * i] = bufs[r][2 * i + 1];
            back[r][2 * i + 1] = malloc(sb[i]);
            memset(back[r][2 * i + 1], 0x5A, sb[i]);
        }
    }
    snprintf(what, sizeof what, "alltoall head->seq, %s%s", kc->name, two ? " with kv" : "");
    run(w, &od, back, what);
    for (int i = 0; i < nt; i++) {
        for (int r = 0; r < P; r++) {
            uint8_t *want = malloc(sb[i]);
            CHECK_EQ(sp_kern_a2a_host(want, (const void *const *)head[i], &h2s[i], (uint32_t)r), 0);
            compare(back[r][2 * i + 1], want, sb[i], what, w, r);
            free(want);
        }
        for (int r = 0; r < P; r++) {
            free(back[r][2 * i + 1]);
            free(bufs[r][2 * i + 1]);
            free(in[i][r]);
            free(head[i][r]);
        }
    }
}

/* Elements rank src sends rank dst: their own per pair, some 0; the last
 * rank of more than two sends and receives nothing. */
static uint64_t v_count(int P, int src, int dst, uint64_t salt)
{
    if (P > 2 && (src == P - 1 || dst == P - 1))
        return 0;
    return (uint64_t)((src * 5 + dst * 3 + (int)salt) % 7) * 13;
}

static void test_alltoallv(const world_t *w, unsigned dtype, uint64_t salt, const char *what)
{
    const int P = w->P;
    const uint64_t es = sp_dtype_size(dtype);
    uint8_t *bufs[MAXP][SP_MAX_TENSORS] = { { 0 } };
    opdesc_t od = { .sqe = { .opcode = SP_OP_ALLTOALLV, .dtype = (uint8_t)dtype, .ntensors = 2,
                             .param_bytes = 2 * (uint32_t)P * 8 } };
    for (int r = 0; r < P; r++) {
        for (int q = 0; q < P; q++) {
            od.a2av[r].counts[q] = v_count(P, r, q, salt);
            od.a2av[r].counts[P + q] = v_count(P, q, r, salt);
            od.vneed[r][0] += od.a2av[r].counts[q] * es;
            od.vneed[r][1] += od.a2av[r].counts[P + q] * es;
        }
        bufs[r][0] = malloc(od.vneed[r][0] + 1);
        fill(bufs[r][0], od.vneed[r][0], 9000 + (uint64_t)r);
        bufs[r][1] = malloc(od.vneed[r][1] + 1);
        memset(bufs[r][1], 0x5A, od.vneed[r][1]);
    }
    run(w, &od, bufs, what);
    for (int dst = 0; dst < P; dst++) {   /* block src of dst's receive: src's block for dst, each packed in rank order */
        uint8_t *want = malloc(od.vneed[dst][1] + 1), *at = want;
        for (int src = 0; src < P; src++) {
            uint64_t from = 0;
            for (int k = 0; k < dst; k++)
                from += v_count(P, src, k, salt) * es;
            memcpy(at, bufs[src][0] + from, v_count(P, src, dst, salt) * es);
            at += v_count(P, src, dst, salt) * es;
        }
        compare(bufs[dst][1], want, od.vneed[dst][1], what, w, dst);
        free(want);
    }
    for (int r = 0; r < P; r++) {
        free(bufs[r][0]);
        free(bufs[r][1]);
    }
}

int main(void)
{
    /* Out of name order, so that NCCL ranks (by name) differ from the indices here. */
    static const char *const names[MAXD] = { "node-b", "node-a", "node-c" };
    int worlds = 0;
    for (int D = 1; D <= MAXD; D++)
        /* One rank in place launches nothing, so a NaN keeps the payload that
         * the reference's fold would quiet: one daemon starts at two. */
        for (int P = D > 1 ? D : 2; P <= MAXP; P++)
            for (int placement = 0; placement < 3; placement++) {
                world_t w = { .D = D, .P = P };
                for (int d = 0; d < D; d++)
                    w.names[d] = names[d];
                for (int r = 0; r < P; r++)   /* blocks, round-robin, scattered */
                    w.daemon_of[r] = D == 1 ? 0 : placement == 0 ? r * D / P : placement == 1 ? r % D
                                   : r == 0 ? 1 : r == P - 1 ? 0 : (r * 7) % D;
                /* One GPU, then three (a daemon's ranks on several), then 0-2 apart. */
                for (int r = 0; r < P; r++)
                    w.gpu_of[r] = placement == 0 ? 0 : D == 1 ? r % 3 : (r * 5 + 1) % 3;
                apart02 = placement == 2;
                bool every = true;   /* each daemon of the group has a rank */
                for (int d = 0; d < D; d++) {
                    bool has = false;
                    for (int r = 0; r < P; r++)
                        has |= w.daemon_of[r] == d;
                    every &= has;
                }
                if (!every)
                    continue;
                test_collective(&w, SP_OP_ALLREDUCE, SP_DTYPE_F32, SP_REDOP_SUM, false, 0, 1003, "allreduce fp32");
                test_collective(&w, SP_OP_ALLREDUCE, SP_DTYPE_F64, SP_REDOP_SUM, true, 0, 517, "allreduce fp64 in place");
                test_collective(&w, SP_OP_ALLREDUCE, SP_DTYPE_BF16, SP_REDOP_SUM, false, 0, 999, "allreduce bf16");
                test_collective(&w, SP_OP_ALLREDUCE, SP_DTYPE_F16, SP_REDOP_MAX, true, 0, 999, "allreduce fp16 max");
                test_collective(&w, SP_OP_ALLGATHER, SP_DTYPE_F32, 0, false, 0, 257, "allgather");
                test_collective(&w, SP_OP_REDUCE_SCATTER, SP_DTYPE_F32, SP_REDOP_SUM, false, 0, 301,
                                "reduce_scatter fp32");
                test_collective(&w, SP_OP_REDUCE_SCATTER, SP_DTYPE_BF16, SP_REDOP_MIN, false, 0, 77,
                                "reduce_scatter bf16 min");
                for (int root = 0; root < P; root++)
                    test_collective(&w, SP_OP_BROADCAST, SP_DTYPE_F32, 0, false, (uint32_t)root, 100, "broadcast");
                test_alltoallv(&w, SP_DTYPE_F32, 0, "alltoallv fp32");
                test_alltoallv(&w, SP_DTYPE_BF16, 3, "alltoallv bf16");
                test_shift(&w, 0, 1, "cyclic shift");
                test_shift(&w, SP_SHIFT_F_LINEAR, 2, "linear shift of two tensors");
                test_shift(&w, SP_SHIFT_F_REVERSE, 2, "reversed shift");
                test_shift(&w, SP_SHIFT_F_REVERSE | SP_SHIFT_F_LINEAR, 1, "reversed linear shift");
                for (size_t k = 0; k < SP_KERN_NCASES; k++) {
                    const sp_kern_case_t *kc = &sp_kern_cases[k];
                    if ((int)kc->ranks != P)
                        continue;
                    /* The large cases add bytes, not placements: once is enough (sanitizer builds). */
                    if (strncmp(kc->name, "large", 5) == 0 && (D != 2 || placement != 0))
                        continue;
                    test_a2a(&w, kc, false);
                    test_a2a(&w, kc, true);
                }
                worlds++;
            }
    CHECK(hstaged_across > 0 && staged_across > 0 && multi_across > staged_across);
    printf("xdev: %d placements over 1, 2 and 3 daemons (%" PRIu64 " daemons' parts on several GPUs, %" PRIu64
           " of them staging %d tensors): every op bit for bit as on one node\n", worlds, multi_across,
           staged_across, hstaged_across);
    return 0;
}
