/*
 * spd restarted under ranks whose ops run on GPU memory, without a GPU: rank
 * processes on GPUs 0 and 1 of the stand-in driver (tests/stubcuda) loop over
 * an all-reduce and a shift from cudaMalloc memory (CUDA IPC) into cuMem
 * memory, through spd built with the stand-in's kernels (spd_stub). spd is
 * SIGKILLed mid-loop and started again: the new spd takes the ranks over, their
 * GPU registrations sent again under the ids they had, and every result, each
 * compared with a reference computed here, is right.
 *
 * Beside them, clients with CUDA streams open:
 *   - a 2-rank job in stream order (GPUs 0 and 1): on each rank's stream
 *     all-reduces, each followed by a host function (a "kernel" after the op)
 *     that copies the op's output aside and then adds MARK to it. The first
 *     ops run before spd is killed; the others are queued, rank 0's behind a
 *     gate (its ready not written), rank 1's waiting on a done. Both ranks'
 *     threads sit in the driver (cuStreamSynchronize) when spd goes, so only
 *     the stream watcher can take them over. Afterwards every copy holds the
 *     op's result (no kernel after an op ran before it) and every output the
 *     result plus MARK (no op ran twice, which would write the result over it).
 *     One op in the middle fails (the ranks disagree on its count): most
 *     often the old spd fails it, and the ranks take its completion, while
 *     the ops before it wait; the next spd, which never sees it again, writes
 *     its done in turn, and its output is never written.
 *     Once with spd SIGKILLed, once with spd stopped for an upgrade (SIGUSR2),
 *     and once, with no gate, with spd stopped (SIGSTOP, by a host function
 *     on rank 0's stream) just after it wrote an op's done, then killed: most
 *     often before it posted the op's completion, which the ranks then take
 *     from the page (3 runs in 5 on the development machine);
 *   - a client with reconnecting off, and one whose reconnect window passes
 *     before spd is back, each with an op queued on its stream: the stream is
 *     released (synchronize returns) with SPC_ERR_DAEMON_LOST saying why, and
 *     the op never ran;
 *   - one whose stream was destroyed before spd went is taken over, and its
 *     next stream (slot, semaphores) is the new spd's: a stream-ordered
 *     all-reduce on it is right.
 *
 * Skipped (77) where spd was built without CUDA.
 */
#include <signal.h>
#include <unistd.h>

#include "sp_test.h"
#include "stub_cuda.h"

#define P     2
#define N     2048u          /* floats per op */
#define ITERS 200

static sp_test_daemon_t d;
static volatile int *iters;  /* each rank's iteration, in shared memory */

static void gpu_bind(int gpu)
{
    void *ctx;
    CHECK_EQ(cuDevicePrimaryCtxRetain(&ctx, gpu), STUB_SUCCESS);
    CHECK_EQ(cuCtxSetCurrent(ctx), STUB_SUCCESS);
}

/* n bytes of the stand-in's device memory on `gpu`, registered: cudaMalloc-like,
 * or cuMem chunks. The stand-in's device memory is the process's own. */
static float *dev_new(spc_handle_t *h, int gpu, bool vmm, size_t n)
{
    stub_ptr_t p;
    spc_region_t r;
    if (vmm) {
        stub_mem_prop_t prop = { .type = 1, .requested_handle_types = STUB_HANDLE_POSIX_FD, .location = { 1, gpu } };
        stub_access_desc_t a = { .location = { 1, gpu }, .flags = 3 };
        stub_mem_t m;
        size_t size = (n + STUB_GRANULARITY - 1) / STUB_GRANULARITY * STUB_GRANULARITY;
        CHECK_EQ(cuMemAddressReserve(&p, size, STUB_GRANULARITY, 0, 0), STUB_SUCCESS);
        CHECK_EQ(cuMemCreate(&m, size, &prop, 0), STUB_SUCCESS);
        CHECK_EQ(cuMemMap(p, size, 0, m, 0), STUB_SUCCESS);
        CHECK_EQ(cuMemRelease(m), STUB_SUCCESS);
        CHECK_EQ(cuMemSetAccess(p, size, &a, 1), STUB_SUCCESS);
    } else {
        CHECK_EQ(cuMemAlloc_v2(&p, n), STUB_SUCCESS);
    }
    CHECK_OK(h, spc_register_device(h, (void *)(uintptr_t)p, n, &r));
    return (float *)(uintptr_t)p;
}

/* Small integers in floats: sums are exact. */
static float value(int rank, int it, uint32_t i)
{
    return (float)((rank + 1) * 1000 + (it * 7 + (int)i) % 997);
}

static int rank_main(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    (void)arg;
    gpu_bind(rank);
    float *in = dev_new(h, rank, false, N * sizeof(float));
    float *out = dev_new(h, rank, true, N * sizeof(float));
    for (int it = 0; it < ITERS; it++) {
        iters[rank] = it;
        for (uint32_t i = 0; i < N; i++)
            in[i] = value(rank, it, i);
        CHECK_OK(h, spc_allreduce(h, world, in, out, N, SPC_F32, SPC_SUM, 60000));
        for (uint32_t i = 0; i < N; i++)
            if (out[i] != value(0, it, i) + value(1, it, i))
                SP_FAIL("iter %d rank %d: all-reduce [%u] is %g", it, rank, i, out[i]);
        spc_shift_desc_t s = SPC_SHIFT_DESC_INIT;
        s.group = world;
        s.ntensors = 1;
        s.tensors[0].send = in;
        s.tensors[0].recv = out;
        s.tensors[0].bytes = N * sizeof(float);
        CHECK_OK(h, spc_shift(h, &s, 60000));
        for (uint32_t i = 0; i < N; i++)
            if (out[i] != value((rank + nranks - 1) % nranks, it, i))
                SP_FAIL("iter %d rank %d: shift [%u] is %g", it, rank, i, out[i]);
    }
    spc_resume_info_t info = SPC_RESUME_INFO_INIT;
    CHECK_OK(h, spc_resume_info(h, &info));
    CHECK_EQ(info.resumes, 1);
    return 0;
}

/* ---------------------------------------------------------------- streams open */

#define K        6          /* stream ops per rank of the streamed job */
#define K_BEFORE 2          /* of them, run before spd is killed */
#define MARK     100000.0f  /* what the host function after an op adds to its output */
#define K_BAD    3          /* the op whose counts the ranks disagree on: it fails, and only its done is owed */

/* Shared with the forked clients: the streamed ranks' phase (1: its first ops
 * ran; 2: every op queued), the gates, and the lost clients' phase. */
typedef struct shared_state {
    int streamed[P];
    int gate;               /* opens rank 0's stream of the streamed job, after the restart */
    int lost_gate;          /* opens the lost clients' streams, once spd is gone */
    int lost[2];            /* 1: its op is queued; 2: released */
    int closed;             /* the client whose stream was destroyed: 1: ready; 2: spd was restarted */
    int freeze;             /* this round, no gate: rank 0's stream stops spd once op K_BEFORE's done is written */
    int frozen_pid;         /* the spd it stopped */
} shared_state_t;
static volatile shared_state_t *sh;

/* A host function on a stream: waits for a gate. */
static void gate_run(void *arg)
{
    volatile int *gate = arg;
    while (!*gate)
        usleep(1000);
}

/* A host function after an op: its output copied aside, then MARK added. */
typedef struct mark {
    float *out, *copy;
} mark_t;

static void mark_run(void *arg)
{
    mark_t *m = arg;
    memcpy(m->copy, m->out, N * sizeof(float));
    for (uint32_t i = 0; i < N; i++)
        m->out[i] += MARK;
}

/* A host function after an op's done: stops spd (SIGSTOP) where it stands,
 * most often before it saw that its kernels ran and posted the op's
 * completion, which then goes with it: the op completes in the client. */
static void freeze_run(void *arg)
{
    pid_t pid = (pid_t)(intptr_t)arg;
    CHECK_EQ(kill(pid, SIGSTOP), 0);
    sh->frozen_pid = (int)pid;
}

static int streamed_rank(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    (void)arg;
    (void)nranks;
    gpu_bind(rank);
    void *cs;
    spc_stream_t *s;
    CHECK_EQ(cuStreamCreate(&cs, 0), STUB_SUCCESS);
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_set_stream(h, s));
    float *in = dev_new(h, rank, false, K * N * sizeof(float)), *out = dev_new(h, rank, true, K * N * sizeof(float));
    float *copy = calloc(K * N, sizeof(float));
    mark_t marks[K];
    for (uint32_t i = 0; i < K * N; i++) {
        in[i] = value(rank, (int)(i / N), i % N);
        out[i] = -1;
    }
    for (int k = 0; k < K; k++) {
        if (k == K_BEFORE) {
            CHECK_OK(h, spc_stream_synchronize(s));
            sh->streamed[rank] = 1;
            if (rank == 0 && !sh->freeze)   /* the rest of its stream, ready writes included, waits for the gate */
                CHECK_EQ(cuLaunchHostFunc(cs, gate_run, (void *)&sh->gate), STUB_SUCCESS);
        }
        uint64_t count = k == K_BAD && rank == 1 ? N - 1 : N;
        CHECK_OK(h, spc_allreduce(h, world, in + k * N, out + k * N, count, SPC_F32, SPC_SUM, 60000));
        marks[k] = (mark_t){ out + k * N, copy + k * N };
        CHECK_EQ(cuLaunchHostFunc(cs, mark_run, &marks[k]), STUB_SUCCESS);
        if (rank == 0 && sh->freeze && k == K_BEFORE)
            CHECK_EQ(cuLaunchHostFunc(cs, freeze_run, (void *)(intptr_t)spc_daemon_pid(h)), STUB_SUCCESS);
    }
    sh->streamed[rank] = 2;
    /* In the driver until the next spd has done every op: its watcher takes it over. */
    CHECK_ST(h, spc_stream_synchronize(s), SPC_ERR_MISMATCH);
    for (int k = 0; k < K; k++) {
        for (uint32_t i = 0; i < N; i++) {
            float want = k == K_BAD ? -1 : value(0, k, i) + value(1, k, i);
            if (copy[k * N + i] != want)
                SP_FAIL("rank %d op %d: the host function after it saw [%u] = %g, the op's result is %g", rank, k, i,
                        copy[k * N + i], want);
            if (out[k * N + i] != want + MARK)
                SP_FAIL("rank %d op %d: [%u] is %g at the end, want %g (the op ran again after the function "
                        "after it?)", rank, k, i, out[k * N + i], want + MARK);
        }
    }
    spc_resume_info_t info = SPC_RESUME_INFO_INIT;
    CHECK_OK(h, spc_resume_info(h, &info));
    CHECK_EQ(info.resumes, 1);
    CHECK_OK(h, spc_stream_destroy(s));
    free(copy);
    return 0;
}

static int streamed_runner(void *arg)
{
    (void)arg;
    sp_test_run_job(P, streamed_rank, NULL);
    return 0;
}

/* A client with an op queued on its stream behind a gate that no spd takes
 * over: with reconnecting off (which 0), or with a window that passes before
 * spd is back (which 1). */
static int lost_client(void *arg)
{
    int which = (int)(intptr_t)arg;
    setenv("SPC_RECONNECT_MS", which == 0 ? "0" : "300", 1);
    gpu_bind(0);
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join_named(h, which == 0 ? "lost-off" : "lost-late", "restart-test", 1, 0, 20000, &world));
    void *cs;
    spc_stream_t *s;
    CHECK_EQ(cuStreamCreate(&cs, 0), STUB_SUCCESS);
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_set_stream(h, s));
    float *in = dev_new(h, 0, false, N * sizeof(float)), *out = dev_new(h, 0, true, N * sizeof(float));
    for (uint32_t i = 0; i < N; i++) {
        in[i] = value(0, 5, i);
        out[i] = -1;
    }
    CHECK_EQ(cuLaunchHostFunc(cs, gate_run, (void *)&sh->lost_gate), STUB_SUCCESS);
    CHECK_OK(h, spc_allreduce(h, world, in, out, N, SPC_F32, SPC_SUM, 60000));
    sh->lost[which] = 1;
    CHECK_ST(h, spc_stream_synchronize(s), SPC_ERR_DAEMON_LOST);
    CHECK_CONTAINS(spc_last_error(h), which == 0 ? "reconnecting is off (SPC_RECONNECT_MS=0)"
                                                 : "no spd took it over within 300 ms (SPC_RECONNECT_MS)");
    for (uint32_t i = 0; i < N; i++)
        if (out[i] != -1)
            SP_FAIL("client %d: [%u] is %g: the op ran, though no spd took it", which, i, out[i]);
    sh->lost[which] = 2;
    spc_stream_destroy(s);
    spc_detach(h);
    return 0;
}

/* An all-reduce in the order of a stream of its own, on the one-rank job
 * `world`: its output is its input. */
static void stream_op(spc_handle_t *h, spc_group_t world, void *cs)
{
    spc_stream_t *s;
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_set_stream(h, s));
    float *in = dev_new(h, 0, false, N * sizeof(float)), *out = dev_new(h, 0, true, N * sizeof(float));
    for (uint32_t i = 0; i < N; i++) {
        in[i] = value(0, 3, i);
        out[i] = -1;
    }
    CHECK_OK(h, spc_allreduce(h, world, in, out, N, SPC_F32, SPC_SUM, 60000));
    CHECK_OK(h, spc_stream_synchronize(s));
    for (uint32_t i = 0; i < N; i++)
        if (out[i] != value(0, 3, i))
            SP_FAIL("stream-ordered all-reduce after the take-over: [%u] is %g", i, out[i]);
    CHECK_OK(h, spc_stream_destroy(s));
}

/* A client that destroyed its stream before spd went. */
static int closed_client(void *arg)
{
    (void)arg;
    gpu_bind(0);
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join_named(h, "stream-closed", "restart-test", 1, 0, 20000, &world));
    void *cs;
    CHECK_EQ(cuStreamCreate(&cs, 0), STUB_SUCCESS);
    spc_stream_t *s;
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_stream_destroy(s));
    sh->closed = 1;
    while (sh->closed != 2)
        usleep(1000);
    CHECK_OK(h, spc_barrier(h, world, 60000));
    spc_resume_info_t info = SPC_RESUME_INFO_INIT;
    CHECK_OK(h, spc_resume_info(h, &info));
    CHECK_EQ(info.resumes, 1);
    stream_op(h, world, cs);
    spc_detach(h);
    return 0;
}

static int job_runner(void *arg)
{
    (void)arg;
    sp_test_run_job(P, rank_main, NULL);
    return 0;
}

int main(void)
{
    sp_test_use_stub_cuda(SP_STUB_CUDA_DIR);
    setenv("SP_TEST_SPD", SPD_STUB_BIN, 1);
    setenv("SPD_STUB_CUDA_GPUS", "2", 1);
    setenv("SPD_STUB_CUDA_P2P", "0=1", 1);
    iters = sp_test_shared(P * sizeof(int));
    sh = sp_test_shared(sizeof *sh);

    sp_test_daemon_start(&d, NULL);
    spc_handle_t *q = sp_test_attach();
    spc_query_result_t *r;
    CHECK_OK(q, spc_query(q, "status", "", &r));
    long f = spc_query_find(r, 0, "gpu_status");
    CHECK(f >= 0);
    bool no_cuda = strstr(spc_query_str(r, 0, (size_t)f), "built without CUDA") != NULL;
    spc_query_free(r);
    spc_detach(q);
    if (no_cuda) {
        fprintf(stderr, "skipped: spd was built without CUDA\n");
        sp_test_daemon_stop(&d);
        sp_test_daemon_cleanup(&d);
        return SP_TEST_SKIP;
    }

    pid_t job = sp_test_fork(job_runner, NULL), streamed = sp_test_fork(streamed_runner, NULL),
          closed = sp_test_fork(closed_client, NULL), lost_off = sp_test_fork(lost_client, (void *)0),
          lost_late = sp_test_fork(lost_client, (void *)1);
    uint64_t deadline = sp_test_now_ms() + 30000;
    while (iters[0] < ITERS / 4 || iters[1] < ITERS / 4 || sh->streamed[0] != 2 || sh->streamed[1] != 2 ||
           sh->closed != 1 || sh->lost[0] != 1 || sh->lost[1] != 1)
        CHECK(sp_test_now_ms() < deadline);
    CHECK_EQ(kill(d.pid, SIGKILL), 0);
    CHECK_EQ(sp_test_wait(d.pid, 10000), -SIGKILL);
    d.pid = 0;
    /* The lost clients' streams go on to their ops' waits; with no spd back,
     * theirs are released, the sooner at once. */
    uint64_t gone = sp_test_now_ms();
    sh->lost_gate = 1;
    while (sh->lost[0] != 2 || sh->lost[1] != 2)
        CHECK(sp_test_now_ms() < gone + 10000);
    CHECK(sp_test_now_ms() - gone < 5000);
    sp_test_daemon_restart(&d, NULL);
    sh->gate = 1;
    sh->closed = 2;
    CHECK_EQ(sp_test_wait(job, 120000), 0);
    CHECK_EQ(sp_test_wait(streamed, 60000), 0);
    CHECK_EQ(sp_test_wait(closed, 30000), 0);
    CHECK_EQ(sp_test_wait(lost_off, 30000), 0);
    CHECK_EQ(sp_test_wait(lost_late, 30000), 0);

    /* Again, spd stopped for an upgrade (SIGUSR2, exit 75), which drains
     * nothing: the streams' ops wait for the next spd as they did. */
    memset((void *)sh, 0, sizeof *sh);
    streamed = sp_test_fork(streamed_runner, NULL);
    deadline = sp_test_now_ms() + 30000;
    while (sh->streamed[0] != 2 || sh->streamed[1] != 2)
        CHECK(sp_test_now_ms() < deadline);
    CHECK_EQ(kill(d.pid, SIGUSR2), 0);
    CHECK_EQ(sp_test_wait(d.pid, 10000), 75);
    d.pid = 0;
    sp_test_daemon_restart(&d, NULL);
    sh->gate = 1;
    CHECK_EQ(sp_test_wait(streamed, 60000), 0);

    /* Once more, spd stopped and killed just after it wrote an op's done:
     * the op completes in the client, from the page, and is not run again. */
    memset((void *)sh, 0, sizeof *sh);
    sh->freeze = 1;
    streamed = sp_test_fork(streamed_runner, NULL);
    deadline = sp_test_now_ms() + 30000;
    while (sh->frozen_pid == 0 || sh->streamed[0] != 2 || sh->streamed[1] != 2)
        CHECK(sp_test_now_ms() < deadline);
    CHECK_EQ(sh->frozen_pid, d.pid);
    CHECK_EQ(kill(d.pid, SIGKILL), 0);
    CHECK_EQ(sp_test_wait(d.pid, 10000), -SIGKILL);
    d.pid = 0;
    sp_test_daemon_restart(&d, NULL);
    CHECK_EQ(sp_test_wait(streamed, 60000), 0);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("restart_stub: GPU registrations (CUDA IPC and cuMem) taken over; %d iterations right; a 2-rank job with "
           "streams open taken over by its watchers (spd killed; stopped with SIGUSR2; frozen after a done, then "
           "killed), its %d stream ops each run once and before the kernels after them; streams no spd took over "
           "released with DAEMON_LOST; one whose stream was destroyed taken over, its next stream's op right\n",
           ITERS, K);
    return 0;
}
