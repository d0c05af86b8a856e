/*
 * One rank per GPU, without a GPU: rank processes each on their own GPU of
 * the stand-in driver (tests/stubcuda, four devices) put device ops on their
 * own streams through a real spd built with the stand-in's kernels (spd_stub:
 * the host references, run in stream order on spd's lanes, refused where their
 * GPU may not reach the memory they touch). Every result is compared with a
 * reference computed here from every rank's inputs.
 *
 *   data      P = 2 and 4 ranks on as many GPUs, every pair joined by peer
 *             access: a seq->head all-to-all, a ring shift, an fp32
 *             all-reduce and one in place in turn, 8 rounds on one stream,
 *             each rank's input written on its stream before the op (one
 *             rank in turn 20 ms late) and overwritten right after it, its
 *             result saved and overwritten; one synchronize. With cudaMalloc memory (CUDA IPC) and with
 *             cuMem memory. spd opens each input once on each GPU that reads
 *             it (its log), and closes every opening when the ranks are gone
 *             (the stand-in's);
 *   order     two ranks on GPUs 0 and 1, GPU 1's kernels slow: rank 0
 *             overwrites its input as soon as its stream passes the op, so a
 *             done written before GPU 1 finished reading would put that into
 *             rank 1's output: every GPU's part comes before any done;
 *   no peer   GPUs 0 and 2 cannot reach each other, nor 1 and 3: the same
 *             rounds on GPUs 0 and 2, and on all four (peer access within
 *             0-1 and 2-3), with both kinds of memory, the inputs the other
 *             side reads staged through pinned host memory; `spctl status`
 *             says which pairs are staged and why, and counts the ops on
 *             several GPUs and those staged;
 *   late      rank 1's stream on GPU 1 held past the op's timeout: rank 1
 *             hears TIMEOUT, rank 0 PEER_REFUSED, the op submitted behind it
 *             fails too (never OK on the input that never came), both streams
 *             go on and the next op is right;
 *   death     rank 1 killed while spd's lanes on both GPUs wait for it: rank
 *             0 hears PEER_LOST and its stream goes on;
 *   shutdown  spd stopped while its lanes on both GPUs wait for a rank: both
 *             streams go on;
 *   cap       with gpu_host_staging_bytes at its least (64 KiB), an op whose
 *             inputs two GPUs without peer access must stage (a block of
 *             64 KiB each) is refused, naming the option; the next ops, on
 *             GPUs that reach each other, are right;
 *   capture   an op on a stream being captured into a CUDA graph is refused
 *             by libspclient, saying why, with nothing enqueued; once the
 *             capture ends the same op runs and is right.
 *   mig       the four GPUs MIG instances of one board (SPD_STUB_CUDA_MIG:
 *             one PCI bus id, UUIDs apart), no peer access between them:
 *             ranks on instances 1 and 3 (neither is what the bus id finds
 *             first) run their rounds right, spd finding each by its UUID;
 *   fault     spd's first kernel on GPU 0 faults (SPD_STUB_CUDA_FAULT: an
 *             illegal address, sticky for GPU 0's context), in an all-reduce
 *             of ranks on GPUs 0 and 1: both hear DEVICE naming GPU 0, both
 *             streams get past the op (spd stores their done itself: the done
 *             writes behind the kernel never run), the next op on either
 *             stream fails at once saying the stream is broken and why, a new
 *             stream on GPU 0 is refused with the reason, `spctl status` says
 *             GPU 0 is out of service and why, and two ranks on GPU 1 then run
 *             their rounds right.
 *
 * Skipped (77) where spd was built without CUDA.
 */
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include "sp_test.h"
#include "stub_cuda.h"

#define ROUNDS 8
#define SLOC   8u      /* rows per rank */
#define HPR    2u      /* heads per rank */
#define D      4u      /* head dim */
#define MAXP   4

enum { OP_A2A, OP_SHIFT, OP_ALLREDUCE, OP_ALLREDUCE_IN_PLACE, NOPS };

typedef struct mg_case {
    int  gpu_of[MAXP];  /* each rank's GPU */
    bool vmm;           /* cuMem memory, else cudaMalloc (IPC) */
    int  only;          /* one op kind every round; -1: each in turn */
} mg_case_t;

static int *shared;     /* flags between the ranks of one case */
static char job_id[SPC_JOB_ID_MAX];

static void gpu_bind(int gpu)
{
    void *ctx;
    CHECK_EQ(cuDevicePrimaryCtxRetain(&ctx, gpu), STUB_SUCCESS);
    CHECK_EQ(cuCtxSetCurrent(ctx), STUB_SUCCESS);
}

/* n bytes of device memory on `gpu`, registered: cudaMalloc-like, or one cuMem chunk. */
static float *dev_new(spc_handle_t *h, int gpu, bool vmm, size_t n, spc_region_t *r)
{
    stub_ptr_t p;
    if (vmm) {
        stub_mem_prop_t prop = { .type = 1, .requested_handle_types = STUB_HANDLE_POSIX_FD, .location = { 1, gpu } };
        stub_access_desc_t a = { .location = { 1, gpu }, .flags = 3 };
        stub_mem_t m;
        size_t size = (n + STUB_GRANULARITY - 1) / STUB_GRANULARITY * STUB_GRANULARITY;
        CHECK_EQ(cuMemAddressReserve(&p, size, STUB_GRANULARITY, 0, 0), STUB_SUCCESS);
        CHECK_EQ(cuMemCreate(&m, size, &prop, 0), STUB_SUCCESS);
        CHECK_EQ(cuMemMap(p, size, 0, m, 0), STUB_SUCCESS);
        CHECK_EQ(cuMemRelease(m), STUB_SUCCESS);   /* the mapping keeps it */
        CHECK_EQ(cuMemSetAccess(p, size, &a, 1), STUB_SUCCESS);
    } else {
        CHECK_EQ(cuMemAlloc_v2(&p, n), STUB_SUCCESS);
    }
    CHECK_OK(h, spc_register_device(h, (void *)(uintptr_t)p, n, r));
    return (float *)(uintptr_t)p;
}

static float value(int rank, int round, uint32_t i)
{
    return (float)((rank + 1) * 100000 + round * 1000) + (float)(i % 512);
}

/* ---------------------------------------------------------------- work on a rank's stream */

typedef struct fill {
    float   *p;
    float   *save;       /* copy p here first (NULL: no) */
    uint32_t n;
    int      rank, round;/* rank < 0: overwrite with NaN */
} fill_t;

static void fill_run(void *arg)
{
    const fill_t *f = arg;
    if (f->save != NULL)
        memcpy(f->save, f->p, f->n * sizeof(float));
    for (uint32_t i = 0; i < f->n; i++)
        f->p[i] = f->rank >= 0 ? value(f->rank, f->round, i) : __builtin_nanf("");
}

static void sleep_run(void *arg)
{
    usleep((useconds_t)(intptr_t)arg * 1000);
}

static void on_stream(void *cs, fill_t *f)
{
    CHECK_EQ(cuLaunchHostFunc(cs, fill_run, f), STUB_SUCCESS);
}

static void stall(void *cs, int ms)
{
    CHECK_EQ(cuLaunchHostFunc(cs, sleep_run, (void *)(intptr_t)ms), STUB_SUCCESS);
}

/* Submits op `kind` from in to out on the current stream (the blocking forms
 * return at once there). */
static spc_status_t submit(spc_handle_t *h, spc_group_t world, int P, int kind, float *in, float *out, uint32_t t_ms,
                           spc_request_t **req_p)
{
    const uint32_t n = SLOC * HPR * (uint32_t)P * D;
    spc_op_t op = { .struct_size = sizeof op, .group = world, .dtype = SPC_F32, .ntensors = 2, .timeout_ms = t_ms };
    op.tensors[0].ptr = in;
    op.tensors[1].ptr = out;
    switch (kind) {
    case OP_A2A: {
        spc_alltoall_desc_t d = SPC_ALLTOALL_DESC_INIT;
        d.group = world;
        d.dtype = SPC_F32;
        d.direction = SPC_SEQ_TO_HEAD;
        d.layout = SPC_LAYOUT_BSHD;
        d.batch = 1;
        d.seq_len = SLOC * (uint32_t)P;
        d.ntensors = 1;
        d.tensors[0] = (spc_a2a_tensor_t){ .send = in, .recv = out, .heads = HPR * (uint32_t)P, .head_dim = D };
        d.timeout_ms = t_ms;
        CHECK(req_p == NULL);
        return spc_alltoall(h, &d, 30000);
    }
    case OP_SHIFT: {
        spc_shift_desc_t sd = { .struct_size = sizeof sd, .group = world, .ntensors = 1, .timeout_ms = t_ms };
        sd.tensors[0].send = in;
        sd.tensors[0].recv = out;
        sd.tensors[0].bytes = n * sizeof(float);
        CHECK(req_p == NULL);
        return spc_shift(h, &sd, 30000);
    }
    default:
        if (kind == OP_ALLREDUCE_IN_PLACE)
            out = in;
        op.tensors[1].ptr = out;
        op.opcode = SPC_OP_ALLREDUCE;
        op.redop = SPC_SUM;
        op.count = n;
        if (req_p != NULL)
            return spc_submit(h, &op, req_p);
        return spc_allreduce(h, world, in, out, n, SPC_F32, SPC_SUM, 30000);
    }
}

/* Element i of rank r's output of op `kind` in round `round`, from the inputs. */
static float reference(int kind, int P, int r, int round, uint32_t i)
{
    switch (kind) {
    case OP_A2A: {
        /* [S, HPR, D] from every rank's [SLOC, HPR * P, D]: row s from rank
         * s / SLOC, heads [r * HPR, (r + 1) * HPR) of it. */
        uint32_t d = i % D, j = (i / D) % HPR, s = i / (D * HPR);
        uint32_t q = s / SLOC, row = s % SLOC;
        return value((int)q, round, (row * HPR * (uint32_t)P + (uint32_t)r * HPR + j) * D + d);
    }
    case OP_SHIFT:
        return value((r + P - 1) % P, round, i);
    default: {
        float sum = 0;
        for (int q = 0; q < P; q++)
            sum += value(q, round, i);
        return sum;
    }
    }
}

static const char *op_name(int kind)
{
    return kind == OP_A2A ? "all-to-all" : kind == OP_SHIFT ? "shift" : kind == OP_ALLREDUCE ? "all-reduce"
                                                                    : "all-reduce in place";
}

/* A rank on its GPU: a stream of its own, spd's stream on it the current one,
 * and an input and an output of n floats. */
typedef struct rank_gpu {
    void         *cs;
    spc_stream_t *s;
    spc_region_t  rin, rout;
    float        *in, *out;
} rank_gpu_t;

static void rank_gpu_open(spc_handle_t *h, int gpu, bool vmm, uint32_t n, rank_gpu_t *g)
{
    gpu_bind(gpu);
    CHECK_EQ(cuStreamCreate(&g->cs, 0), STUB_SUCCESS);
    CHECK_OK(h, spc_stream_create(h, g->cs, &g->s));
    CHECK_OK(h, spc_set_stream(h, g->s));
    g->in = dev_new(h, gpu, vmm, n * sizeof(float), &g->rin);
    g->out = dev_new(h, gpu, vmm, n * sizeof(float), &g->rout);
}

static void rank_gpu_close(spc_handle_t *h, rank_gpu_t *g)
{
    CHECK_OK(h, spc_stream_destroy(g->s));
    CHECK_OK(h, spc_deregister(h, g->rin));
    CHECK_OK(h, spc_deregister(h, g->rout));
    CHECK_EQ(cuStreamDestroy_v2(g->cs), STUB_SUCCESS);
}

/* ---------------------------------------------------------------- data and order */

static int data_main(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    const mg_case_t *c = arg;
    const uint32_t n = SLOC * HPR * (uint32_t)P * D;
    rank_gpu_t g;
    rank_gpu_open(h, c->gpu_of[rank], c->vmm, n, &g);
    void *cs = g.cs;
    spc_stream_t *s = g.s;
    float *in = g.in, *out = g.out;
    float *saved = calloc((size_t)ROUNDS * n, sizeof(float));
    fill_t *steps = calloc(3 * ROUNDS, sizeof *steps);
    CHECK(saved != NULL && steps != NULL);

    /* Everything is enqueued without a wait on the host. */
    for (int round = 0; round < ROUNDS; round++) {
        const int kind = c->only >= 0 ? c->only : round % NOPS;
        float *result = kind == OP_ALLREDUCE_IN_PLACE ? in : out;
        fill_t *f = &steps[3 * round];
        f[0] = (fill_t){ .p = in, .n = n, .rank = rank, .round = round };
        f[1] = (fill_t){ .p = result, .save = saved + (size_t)round * n, .n = n, .rank = -1 };
        f[2] = (fill_t){ .p = in, .n = n, .rank = -1 };                         /* the input overwritten */
        if (round % P == rank)
            stall(cs, 20);   /* a GPU that started before this rank's ready would read the NaNs of the last round */
        on_stream(cs, &f[0]);
        CHECK_OK(h, submit(h, world, P, kind, in, out, 0, NULL));
        on_stream(cs, &f[1]);
        if (result != in)
            on_stream(cs, &f[2]);
    }
    CHECK_OK(h, spc_stream_synchronize(s));
    for (int round = 0; round < ROUNDS; round++) {
        const int kind = c->only >= 0 ? c->only : round % NOPS;
        for (uint32_t i = 0; i < n; i++) {
            float want = reference(kind, P, rank, round, i), got = saved[(size_t)round * n + i];
            if (got != want)
                SP_FAIL("rank %d on GPU %d, round %d (%s), element %u of %u: %g from spd, %g expected%s", rank,
                        c->gpu_of[rank], round, op_name(kind), i, n, got, want,
                        got != got ? " (NaN: an input read before its rank's stream wrote it, or after it "
                                     "overwrote it: the order across GPUs broke)" : "");
        }
    }
    rank_gpu_close(h, &g);
    free(saved);
    free(steps);
    return 0;
}

/* An op while the stream captures is refused, and the stream is as it was:
 * the same op after the capture runs, in order, and is right. */
static int capture_main(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    const mg_case_t *c = arg;
    const uint32_t n = SLOC * HPR * (uint32_t)P * D;
    rank_gpu_t g;
    rank_gpu_open(h, c->gpu_of[rank], c->vmm, n, &g);
    void *cs = g.cs, *graph;
    spc_stream_t *s = g.s;
    float *in = g.in, *out = g.out;
    float *saved = calloc(n, sizeof(float));
    CHECK(saved != NULL);

    CHECK_EQ(cuStreamBeginCapture_v2(cs, 0), STUB_SUCCESS);
    CHECK_ST(h, submit(h, world, P, OP_ALLREDUCE, in, out, 0, NULL), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(h), "captured into a CUDA graph");
    CHECK_EQ(cuStreamEndCapture(cs, &graph), STUB_SUCCESS);

    fill_t f[2] = { { .p = in, .n = n, .rank = rank, .round = 0 }, { .p = out, .save = saved, .n = n, .rank = -1 } };
    on_stream(cs, &f[0]);
    CHECK_OK(h, submit(h, world, P, OP_ALLREDUCE, in, out, 0, NULL));
    on_stream(cs, &f[1]);
    CHECK_OK(h, spc_stream_synchronize(s));
    for (uint32_t i = 0; i < n; i++)
        if (saved[i] != reference(OP_ALLREDUCE, P, rank, 0, i))
            SP_FAIL("rank %d after the capture, element %u: %g from spd, %g expected", rank, i, saved[i],
                    reference(OP_ALLREDUCE, P, rank, 0, i));
    rank_gpu_close(h, &g);
    free(saved);
    return 0;
}

/* An op between GPUs that cannot reach each other, past the pinned memory
 * spd may keep to stage it: refused on every rank, saying which option. */
static int cap_main(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    const mg_case_t *c = arg;
    const uint32_t n = SLOC * HPR * (uint32_t)P * D;
    gpu_bind(c->gpu_of[rank]);
    spc_region_t rin, rout;
    float *in = dev_new(h, c->gpu_of[rank], false, n * sizeof(float), &rin);
    float *out = dev_new(h, c->gpu_of[rank], false, n * sizeof(float), &rout);
    spc_status_t st = spc_allreduce(h, world, in, out, n, SPC_F32, SPC_SUM, 30000);
    if (st != SPC_ERR_LIMIT)
        SP_FAIL("rank %d: an op past gpu_host_staging_bytes gave %s (%s)", rank, spc_status_name(st),
                spc_last_error(h));
    CHECK_CONTAINS(spc_last_error(h), "gpu_host_staging_bytes");
    printf("cap: rank %d: %s\n", rank, spc_last_error(h));
    CHECK_OK(h, spc_deregister(h, rin));
    CHECK_OK(h, spc_deregister(h, rout));
    return 0;
}

/* Lines of `path` that contain `what` (and `who`, when not NULL). */
static int count_lines(const char *path, const char *who, const char *what)
{
    FILE *f = fopen(path, "r");
    char line[1024];
    int n = 0;
    if (f == NULL)
        return 0;
    while (fgets(line, sizeof line, f) != NULL)
        n += strstr(line, what) != NULL && (who == NULL || strncmp(line, who, strlen(who)) == 0);
    fclose(f);
    return n;
}

/* ---------------------------------------------------------------- late rank */

static int late_main(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    const mg_case_t *c = arg;
    const uint32_t n = SLOC * HPR * (uint32_t)P * D;
    rank_gpu_t g;
    rank_gpu_open(h, c->gpu_of[rank], c->vmm, n, &g);
    void *cs = g.cs;
    spc_stream_t *s = g.s;
    float *in = g.in, *out = g.out;
    fill_t f[3] = { { .p = in, .n = n, .rank = rank, .round = 0 }, { .p = in, .n = n, .rank = rank, .round = 1 },
                    { .p = out, .n = n, .rank = -1 } };

    /* Rank 1's stream is held 1.5 s; the ops' timeout is 300 ms. The second op
     * is on the streams before spd gives up on rank 1's at the first. */
    on_stream(cs, &f[0]);
    if (rank == 1)
        stall(cs, 1500);
    spc_request_t *late[2];
    CHECK_OK(h, submit(h, world, P, OP_ALLREDUCE, in, out, 300, &late[0]));
    CHECK_OK(h, submit(h, world, P, OP_ALLREDUCE, in, out, 300, &late[1]));
    spc_status_t want = rank == 1 ? SPC_ERR_TIMEOUT : SPC_ERR_PEER_REFUSED;
    CHECK_ST(h, spc_wait(late[0], 10000), want);
    CHECK_CONTAINS(spc_request_detail(late[0]), "did not reach");
    printf("late: rank %d on GPU %d: %s: %s\n", rank, c->gpu_of[rank], spc_status_name(want),
           spc_request_detail(late[0]));
    spc_status_t after = spc_wait(late[1], 10000), want_after = rank == 1 ? SPC_ERR_CANCELED : SPC_ERR_PEER_REFUSED;
    if (after != want_after)
        SP_FAIL("rank %d, the op submitted before spd gave up on rank 1's stream: %s (%s); want %s", rank,
                spc_status_name(after), spc_request_detail(late[1]), spc_status_name(want_after));
    CHECK_CONTAINS(spc_request_detail(late[1]), "was given up at");
    spc_request_release(late[0]);
    spc_request_release(late[1]);
    CHECK_ST(h, spc_stream_synchronize(s), want);
    if (rank == 1) {
        CHECK_ST(h, spc_stream_destroy(s), SPC_ERR_CANCELED);   /* broken: destroyed, saying what it was */
        CHECK_OK(h, spc_stream_create(h, cs, &s));
        CHECK_OK(h, spc_set_stream(h, s));
    }
    /* Both streams went on: the next op is right. */
    on_stream(cs, &f[1]);
    CHECK_OK(h, submit(h, world, P, OP_ALLREDUCE, in, out, 0, NULL));
    CHECK_OK(h, spc_stream_synchronize(s));
    for (uint32_t i = 0; i < n; i++)
        if (out[i] != reference(OP_ALLREDUCE, P, rank, 1, i))
            SP_FAIL("rank %d, after the late rank: element %u is %g, %g expected", rank, i, out[i],
                    reference(OP_ALLREDUCE, P, rank, 1, i));
    CHECK_OK(h, spc_stream_destroy(s));
    return 0;
}

/* ---------------------------------------------------------------- a GPU faults */

static void flag_run(void *arg)
{
    __atomic_store_n((int *)arg, 1, __ATOMIC_RELEASE);
}

/* Holds a rank's stream until both ranks have submitted, and 200 ms more:
 * spd has the whole task on its lanes, waiting for the ranks' ready. */
static void gate_run(void *arg)
{
    while (__atomic_load_n(&shared[2], __ATOMIC_ACQUIRE) < 2)
        usleep(1000);
    usleep(200000);
}

/* An all-reduce whose kernel on GPU 0 faults (spd's first there), while the
 * ranks' streams wait for its done. */
static int fault_main(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    const mg_case_t *c = arg;
    const uint32_t n = SLOC * HPR * (uint32_t)P * D;
    rank_gpu_t g;
    rank_gpu_open(h, c->gpu_of[rank], false, n, &g);
    fill_t f = { .p = g.in, .n = n, .rank = rank, .round = 0 };
    /* spd's lanes wait for the ranks' ready until the whole task is on them:
     * the fault comes after, as a kernel's does on a GPU. */
    CHECK_EQ(cuLaunchHostFunc(g.cs, gate_run, NULL), STUB_SUCCESS);
    on_stream(g.cs, &f);
    CHECK_OK(h, submit(h, world, P, OP_ALLREDUCE, g.in, g.out, 0, NULL));
    __atomic_add_fetch(&shared[2], 1, __ATOMIC_RELEASE);
    /* Runs once the stream has passed the op: once its done came. */
    CHECK_EQ(cuLaunchHostFunc(g.cs, flag_run, &shared[rank]), STUB_SUCCESS);
    uint64_t t0 = sp_test_now_ms();
    while (!__atomic_load_n(&shared[rank], __ATOMIC_ACQUIRE)) {
        if (sp_test_now_ms() - t0 > 10000)
            SP_FAIL("rank %d: its CUDA stream still waits for the op spd's GPU 0 faulted in", rank);
        usleep(1000);
    }
    CHECK_ST(h, spc_stream_synchronize(g.s), SPC_ERR_DEVICE);
    CHECK_CONTAINS(spc_last_error(h), "GPU 0: the daemon's stream failed: an illegal memory access was encountered");
    printf("fault: rank %d on GPU %d, its stream went on after %" PRIu64 " ms: %s\n", rank, c->gpu_of[rank],
           sp_test_now_ms() - t0, spc_last_error(h));

    /* The stream is broken (its done poisoned): the next op fails at once, saying why. */
    CHECK_ST(h, submit(h, world, P, OP_ALLREDUCE, g.in, g.out, 0, NULL), SPC_ERR_CANCELED);
    CHECK_CONTAINS(spc_last_error(h), "is broken: spd gave up on this stream; its last failed op: GPU 0: "
                   "the daemon's stream failed");
    CHECK(spc_stream_destroy(g.s) != SPC_OK);
    if (c->gpu_of[rank] == 0) {
        spc_stream_t *s;
        CHECK_ST(h, spc_stream_create(h, g.cs, &s), SPC_ERR_DEVICE);
        CHECK_CONTAINS(spc_last_error(h), "GPU 0 is out of service");
        printf("fault: a new stream on GPU 0: %s\n", spc_last_error(h));
    }
    CHECK_OK(h, spc_deregister(h, g.rin));
    CHECK_OK(h, spc_deregister(h, g.rout));
    return 0;
}

/* ---------------------------------------------------------------- a rank dies, spd stops */

typedef struct waiter {
    const mg_case_t *c;
    int              rank;
    bool             die;     /* rank 1 dies in the wait (else spd is stopped) */
} waiter_t;

/* Rank 1's stream never reaches "ready": spd's lanes on both GPUs wait for it,
 * until rank 1 dies (die) or spd stops. */
static int waiter_main(void *arg)
{
    const waiter_t *w = arg;
    const int rank = w->rank, P = 2;
    const uint32_t n = SLOC * HPR * (uint32_t)P * D;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, 2, (uint32_t)rank, 20000, &world));
    rank_gpu_t g;
    rank_gpu_open(h, w->c->gpu_of[rank], w->c->vmm, n, &g);
    void *cs = g.cs;
    spc_stream_t *s = g.s;
    float *in = g.in, *out = g.out;
    if (rank == 1) {
        stall(cs, 60000);
        CHECK_OK(h, submit(h, world, P, OP_A2A, in, out, 30000, NULL));
        shared[1] = 1;
        while (shared[0] == 0)
            usleep(1000);
        usleep(200000);   /* both ops matched, the task on spd's lanes */
        if (w->die)
            raise(SIGKILL);
        while (shared[2] == 0)   /* until spd has stopped; this stream sleeps on */
            usleep(1000);
        return 0;
    }
    CHECK_OK(h, submit(h, world, P, OP_A2A, in, out, 30000, NULL));
    shared[0] = 1;
    uint64_t t0 = sp_test_now_ms();
    spc_status_t st = spc_stream_synchronize(s);
    printf("%s: rank 0's stream went on after %" PRIu64 " ms: %s: %s\n", w->die ? "death" : "shutdown",
           sp_test_now_ms() - t0, spc_status_name(st), spc_last_error(h));
    if (w->die) {
        CHECK_EQ(st, SPC_ERR_PEER_LOST);
        CHECK_CONTAINS(spc_last_error(h), "rank 1");
    } else {
        CHECK(st == SPC_ERR_SHUTTING_DOWN || st == SPC_ERR_DAEMON_LOST);
    }
    spc_detach(h);
    return 0;
}

static void test_waiters(sp_test_daemon_t *d, const mg_case_t *c, bool die)
{
    spc_handle_t *q = sp_test_attach();   /* the job lives while its creator is attached */
    CHECK_OK(q, spc_job_create(q, job_id, sizeof job_id));
    shared[0] = shared[1] = shared[2] = 0;
    waiter_t w[2] = { { c, 0, die }, { c, 1, die } };
    pid_t pids[2];
    for (int r = 0; r < 2; r++)
        pids[r] = sp_test_fork(waiter_main, &w[r]);
    if (die) {
        CHECK_EQ(sp_test_wait(pids[1], 60000), -SIGKILL);
        sp_test_wait_all_ok(pids, 1, 60000);
        spc_detach(q);
        return;
    }
    while (shared[0] == 0 || shared[1] == 0)
        usleep(1000);
    usleep(300000);
    spc_detach(q);
    CHECK_EQ(sp_test_daemon_stop(d), 0);
    sp_test_wait_all_ok(pids, 1, 60000);
    shared[2] = 1;
    sp_test_wait_all_ok(pids + 1, 1, 60000);
}

/* ---------------------------------------------------------------- main */

/* One of spd's status counters. */
static int64_t status_int(const char *key)
{
    spc_handle_t *h = sp_test_attach();
    int64_t v = sp_test_status_int(h, key);
    spc_detach(h);
    return v;
}

/* spctl status on "0=1,2=3": which pairs are staged through host memory and why. */
static void check_paths(void)
{
    spc_handle_t *h = sp_test_attach();
    spc_query_result_t *r;
    CHECK_OK(h, spc_query(h, "status", "", &r));
    static const char *const want[][2] = {
        { "gpu_paths", "chosen by the topology (spctl topo): 4 pairs peer access, 8 staged through host memory, 0 "
                       "unknown" },
        { "gpu0->gpu1", "peer access over NVLink (nvl, performance rank 0, native atomics)" },
        { "gpu0->gpu2", "staged through host memory: GPU 0 cannot map GPU 2's memory (no peer access)" },
        { "gpu3->gpu1", "staged through host memory: GPU 3 cannot map GPU 1's memory (no peer access)" },
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
        long f = spc_query_find(r, 0, want[i][0]);
        CHECK(f >= 0);
        CHECK_STREQ(spc_query_str(r, 0, (size_t)f), want[i][1]);
    }
    spc_query_free(r);
    spc_detach(h);
}

static void daemon_on(sp_test_daemon_t *d, const char *p2p, const char *slow)
{
    /* Stopped with a task waiting for a rank: no need to wait 10 s for it. */
    static const char *const args[] = { "--set", "drain_timeout_ms=500", NULL };
    setenv("SPD_STUB_CUDA_P2P", p2p, 1);
    if (slow != NULL)
        setenv("SPD_STUB_CUDA_SLOW", slow, 1);
    else
        unsetenv("SPD_STUB_CUDA_SLOW");
    sp_test_daemon_start(d, args);
}

static void daemon_off(sp_test_daemon_t *d)
{
    spc_handle_t *q = sp_test_attach();
    if (!sp_test_wait_status(q, "gpu_streams", 0, 5000) || !sp_test_wait_status(q, "gpu_tasks", 0, 5000))
        SP_FAIL("streams or GPU tasks left after every rank went");
    spc_detach(q);
    CHECK_EQ(sp_test_daemon_stop(d), 0);
    sp_test_daemon_cleanup(d);
}

int main(void)
{
    char log[256];
    sp_test_use_stub_cuda(SP_STUB_CUDA_DIR);
    setenv("SP_TEST_SPD", SPD_STUB_BIN, 1);
    setenv("SPD_STUB_CUDA_GPUS", "4", 1);
    snprintf(log, sizeof log, "/tmp/spd-multigpu-stub-%d.log", (int)getpid());
    unlink(log);
    setenv("SPD_STUB_CUDA_LOG", log, 1);
    shared = sp_test_shared(4 * sizeof(int));
    const char *all = "0=1,2=3,0-2,0-3,1-2,1-3";

    sp_test_daemon_t d;
    daemon_on(&d, all, NULL);
    {
        spc_handle_t *h = sp_test_attach();
        spc_query_result_t *r;
        CHECK_OK(h, spc_query(h, "status", "", &r));
        long f = spc_query_find(r, 0, "gpu_status");
        CHECK(f >= 0);
        if (strstr(spc_query_str(r, 0, (size_t)f), "built without CUDA") != NULL) {
            fprintf(stderr, "skipped: spd was built without CUDA\n");
            spc_query_free(r);
            spc_detach(h);
            sp_test_daemon_stop(&d);
            sp_test_daemon_cleanup(&d);
            return 77;
        }
        spc_query_free(r);
        spc_detach(h);
    }
    char who[32];
    snprintf(who, sizeof who, "%d ", (int)d.pid);

    mg_case_t two = { .gpu_of = { 0, 1 }, .only = -1 }, four = { .gpu_of = { 3, 1, 0, 2 }, .only = -1 };
    sp_test_run_job(2, data_main, &two);
    printf("data: P = 2 on GPUs 0, 1, cudaMalloc memory: %d rounds right\n", ROUNDS);
    sp_test_run_job(4, data_main, &four);
    printf("data: P = 4 on GPUs 3, 1, 0, 2, cudaMalloc memory: %d rounds right\n", ROUNDS);
    four.vmm = true;
    sp_test_run_job(4, data_main, &four);
    printf("data: P = 4, cuMem memory: %d rounds right\n", ROUNDS);
    CHECK_EQ(status_int("gpu_multi_ops"), 3 * ROUNDS);
    CHECK_EQ(status_int("gpu_staged_ops"), 0);
    /* Each input read from the other GPUs, opened once on each: 2 * 1 + 4 * 3
     * cudaMalloc allocations, 4 * 3 cuMem ranges. */
    CHECK_EQ(count_lines(d.log, NULL, "reachable from GPU"), 2 + 12 + 12);
    CHECK_EQ(count_lines(log, who, "ipc open gpu"), 2 * 2 + 4 * 2 + 2 + 12);
    /* cuMem: each range's access for its own GPU when spd maps it (4 * 2), then
     * for each GPU that reads it. */
    CHECK_EQ(count_lines(log, who, "access at="), 8 + 12);

    mg_case_t pair = { .gpu_of = { 0, 1 }, .only = -1 };
    sp_test_run_job(2, capture_main, &pair);
    printf("capture: an op on a capturing stream refused, saying why; after the capture it runs and is right\n");
    sp_test_run_job(2, late_main, &pair);
    printf("late: a rank's stream on GPU 1 past the timeout: said, both streams went on\n");
    test_waiters(&d, &pair, true);
    test_waiters(&d, &pair, false);   /* stops spd */
    sp_test_daemon_cleanup(&d);
    /* Everything spd opened it closed, on the owners' GPUs and the readers'. */
    CHECK_EQ(count_lines(log, who, "ipc close"), count_lines(log, who, "ipc open gpu"));

    daemon_on(&d, all, "1:30000");
    mg_case_t order = { .gpu_of = { 0, 1 }, .only = OP_A2A };
    sp_test_run_job(2, data_main, &order);
    printf("order: GPU 1 30 ms slower, rank 0 overwriting its input right after the op: %d rounds right\n",
           ROUNDS);
    daemon_off(&d);

    daemon_on(&d, "0=1,2=3", NULL);
    check_paths();
    mg_case_t apart = { .gpu_of = { 0, 2 }, .only = -1 }, halves = { .gpu_of = { 0, 2, 1, 3 }, .only = -1 };
    sp_test_run_job(2, data_main, &apart);
    printf("no peer: P = 2 on GPUs 0, 2, cudaMalloc memory, staged through host memory: %d rounds right\n", ROUNDS);
    apart.vmm = true;
    sp_test_run_job(2, data_main, &apart);
    printf("no peer: P = 2 on GPUs 0, 2, cuMem memory: %d rounds right\n", ROUNDS);
    sp_test_run_job(4, data_main, &halves);
    printf("no peer: P = 4 on GPUs 0, 2, 1, 3, peer access in 0-1 and 2-3 only: %d rounds right\n", ROUNDS);
    CHECK_EQ(status_int("gpu_staged_ops"), 3 * ROUNDS);   /* every op there read across */
    /* Each ordered pair of the 8 without peer access, asked once. */
    CHECK_EQ(count_lines(d.log, NULL, "ops between them are staged through pinned host memory"), 8);
    daemon_off(&d);

    /* The pinned memory for staging between GPUs is bounded. */
    static const char *const capped[] = { "--set", "drain_timeout_ms=500", "--set", "gpu_host_staging_bytes=64K",
                                          NULL };
    setenv("SPD_STUB_CUDA_P2P", "0=1,2=3", 1);
    sp_test_daemon_start(&d, capped);
    mg_case_t cap = { .gpu_of = { 0, 2 }, .only = -1 }, near = { .gpu_of = { 0, 1 }, .only = -1 };
    sp_test_run_job(2, cap_main, &cap);
    sp_test_run_job(2, data_main, &near);
    printf("cap: an op past gpu_host_staging_bytes refused, naming it; then P = 2 on GPUs 0, 1: %d rounds right\n",
           ROUNDS);
    daemon_off(&d);

    /* MIG: instances share the board's PCI bus id; spd tells them by UUID. */
    setenv("SPD_STUB_CUDA_MIG", "1", 1);
    daemon_on(&d, "", NULL);
    mg_case_t mig = { .gpu_of = { 1, 3 }, .only = -1 };
    sp_test_run_job(2, data_main, &mig);
    printf("mig: P = 2 on MIG instances 1 and 3 of one board, staged through host memory: %d rounds right\n", ROUNDS);
    daemon_off(&d);
    unsetenv("SPD_STUB_CUDA_MIG");

    /* A GPU fault: GPU 0 out of service, the ranks' streams go on, GPU 1 serves. */
    setenv("SPD_STUB_CUDA_FAULT", "0:1", 1);
    daemon_on(&d, "0=1", NULL);
    unsetenv("SPD_STUB_CUDA_FAULT");
    shared[0] = shared[1] = shared[2] = 0;
    sp_test_run_job(2, fault_main, &pair);
    {
        spc_handle_t *h = sp_test_attach();
        spc_query_result_t *r;
        CHECK_OK(h, spc_query(h, "status", "", &r));
        long failed = spc_query_find(r, 0, "gpus_failed"), why = spc_query_find(r, 0, "gpu0_fault");
        CHECK(failed >= 0 && why >= 0 && spc_query_find(r, 0, "gpu1_fault") < 0);
        CHECK_EQ(spc_query_int(r, 0, (size_t)failed), 1);
        CHECK_CONTAINS(spc_query_str(r, 0, (size_t)why), "an illegal memory access was encountered");
        printf("fault: spctl status: gpus_failed 1, gpu0_fault %s\n", spc_query_str(r, 0, (size_t)why));
        spc_query_free(r);
        spc_detach(h);
        static char metrics[1 << 16];
        CHECK_EQ(sp_test_run(metrics, sizeof metrics, "%s metrics", sp_test_spctl_bin()), 0);
        CHECK_CONTAINS(metrics, "\nspd_gpus_failed 1\n");
    }
    mg_case_t gpu1 = { .gpu_of = { 1, 1 }, .only = -1 };
    sp_test_run_job(2, data_main, &gpu1);
    printf("fault: then P = 2 on GPU 1: %d rounds right\n", ROUNDS);
    daemon_off(&d);

    unlink(log);
    printf("ok\n");
    return 0;
}
