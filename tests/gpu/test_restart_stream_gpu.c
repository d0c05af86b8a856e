/*
 * spd restarted under ranks with CUDA streams open: 2 rank processes on one GPU
 * submit fp32 all-reduces in the order of a CUDA stream of their own, each
 * followed on that stream by what a trainer's next kernels would do with the
 * result: a copy of the op's output to host memory, then a kernel that adds
 * MARK to it (sp_kern_reduce_cuda). The first K_BEFORE ops run before spd is
 * SIGKILLed; the others are queued, rank 0's behind a host function that
 * holds its stream (its ready writes not done), rank 1's waiting on the done of
 * the first of them. Both ranks' threads sit in cudaStreamSynchronize when spd
 * goes, so only libspclient's stream watcher can hand them to the next spd.
 *
 * Afterwards, compared bit for bit with host references computed here (the
 * rank-order sum of kernels/host, then + MARK): every copy holds the op's
 * result (no kernel after an op ran before the next spd did it) and every
 * output the result plus MARK (no op ran twice, which would write its result
 * over the kernel's). One op in the middle fails (the ranks disagree on its
 * count), most often in the old spd while the ops before it wait: the stream
 * reports the mismatch, and the kernels after it run in turn on its untouched
 * output. Beside them a client with reconnecting off
 * (SPC_RECONNECT_MS=0) and an op queued on its stream is released: its
 * synchronize returns SPC_ERR_DAEMON_LOST saying why, and its output was
 * never written.
 *
 * Needs a GPU; without one it says why and exits 77 (skipped).
 */
#include <signal.h>
#include <unistd.h>

#include "sp_gpu_regions.h"
#include "sp_kern_cases.h"
#include "sp_kern_cuda.h"

#define P        2
#define N        (65536u + 5u)   /* floats per op */
#define K        6               /* stream ops per rank */
#define K_BEFORE 2               /* of them, run before spd is killed */
#define MARK     4096.0f
#define K_BAD    3               /* the op whose counts the ranks disagree on: it fails, its output untouched */

static sp_test_daemon_t d;
static struct shared {
    volatile int phase[P];   /* 1: its first ops ran; 2: every op queued */
    volatile int gate;       /* opens rank 0's stream, once the next spd is up */
    volatile int lost;       /* the client no spd takes over: 1: its op is queued; 2: released */
    volatile int lost_gate;  /* opens its stream, once spd is gone */
    uint32_t     resumes[P];
} *sh;

/* Finite fp32 values whose rank-order sums are exact neither trivially nor in any order. */
static void fill(float *p, int rank, int k)
{
    for (uint32_t i = 0; i < N; i++)
        p[i] = (float)(((double)((i * 2654435761u + (uint32_t)rank * 97u + (uint32_t)k * 131u) % 100003u) - 50000.0) /
                       7.0);
}

/* A host function on a stream: holds it until the gate opens. */
static void CUDART_CB gate_fn(void *arg)
{
    volatile int *gate = arg;
    while (!*gate)
        usleep(1000);
}

static int rank_main(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    (void)arg;
    const uint64_t bytes = (uint64_t)N * sizeof(float);
    float *host = malloc(K * bytes), *want = malloc(bytes), *x = malloc(bytes), *marks = malloc(bytes);
    float *copies;
    CUDA_CHECK(cudaMallocHost((void **)&copies, K * bytes));
    for (int k = 0; k < K; k++)
        fill(host + (size_t)k * N, rank, k);
    for (uint32_t i = 0; i < N; i++)
        marks[i] = MARK;
    spc_region_t rin, rout, rmark;
    float *in = dev_put(h, host, K * bytes, &rin), *out = dev_put(h, NULL, K * bytes, &rout);
    float *mark = dev_put(h, marks, bytes, &rmark);

    cudaStream_t cs;
    CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    spc_stream_t *st;
    CHECK_OK(h, spc_stream_create(h, cs, &st));
    CHECK_OK(h, spc_set_stream(h, st));
    for (int k = 0; k < K; k++) {
        if (k == K_BEFORE) {
            CHECK_OK(h, spc_stream_synchronize(st));
            sh->phase[rank] = 1;
            if (rank == 0)
                CUDA_CHECK(cudaLaunchHostFunc(cs, gate_fn, (void *)&sh->gate));
        }
        float *o = out + (size_t)k * N;
        uint64_t count = k == K_BAD && rank == 1 ? N - 1 : N;
        CHECK_OK(h, spc_allreduce(h, world, in + (size_t)k * N, o, count, SPC_F32, SPC_SUM, 60000));
        /* What the trainer's next kernels do with the result, in the stream's order. */
        CUDA_CHECK(cudaMemcpyAsync(copies + (size_t)k * N, o, bytes, cudaMemcpyDeviceToHost, cs));
        CHECK_EQ(sp_kern_reduce_cuda(o, mark, N, SP_KERN_F32, SP_KERN_SUM, cs), 0);
    }
    sh->phase[rank] = 2;
    /* In the driver until the next spd has run every op: the watcher hands the client over. */
    CHECK_ST(h, spc_stream_synchronize(st), SPC_ERR_MISMATCH);

    for (int k = 0; k < K; k++) {
        fill(want, 0, k);
        for (int q = 1; q < nranks && k != K_BAD; q++) {
            fill(x, q, k);
            CHECK_EQ(sp_kern_reduce(want, x, N, SP_KERN_F32, SP_KERN_SUM), 0);
        }
        if (k == K_BAD)
            memset(want, 0x5A, bytes);   /* dev_put's filling: the op never wrote its output */
        char what[96];
        snprintf(what, sizeof what, "op %d as the kernels after it saw it", k);
        compare((const uint8_t *)(copies + (size_t)k * N), (const uint8_t *)want, bytes, what, rank);
        CHECK_EQ(sp_kern_reduce(want, marks, N, SP_KERN_F32, SP_KERN_SUM), 0);
        snprintf(what, sizeof what, "op %d's output at the end (result + MARK: the op ran once)", k);
        dev_check(out + (size_t)k * N, want, bytes, what, rank);
    }
    spc_resume_info_t info = SPC_RESUME_INFO_INIT;
    CHECK_OK(h, spc_resume_info(h, &info));
    sh->resumes[rank] = info.resumes;
    CHECK_OK(h, spc_stream_destroy(st));
    CUDA_CHECK(cudaStreamDestroy(cs));
    dev_drop(h, in, rin);
    dev_drop(h, out, rout);
    dev_drop(h, mark, rmark);
    CUDA_CHECK(cudaFreeHost(copies));
    free(host);
    free(want);
    free(x);
    free(marks);
    return 0;
}

static int job_runner(void *arg)
{
    (void)arg;
    sp_test_run_job(P, rank_main, NULL);
    return 0;
}

/* A client that no spd takes over, an op queued on its stream behind a gate. */
static int lost_client(void *arg)
{
    (void)arg;
    setenv("SPC_RECONNECT_MS", "0", 1);
    const uint64_t bytes = (uint64_t)N * sizeof(float);
    float *host = malloc(bytes), *untouched = malloc(bytes);
    fill(host, 0, 0);
    memset(untouched, 0x5A, bytes);   /* dev_put's filling of an output */
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join_named(h, "lost", "restart-stream-gpu", 1, 0, 20000, &world));
    spc_region_t rin, rout;
    float *in = dev_put(h, host, bytes, &rin), *out = dev_put(h, NULL, bytes, &rout);
    cudaStream_t cs;
    CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    spc_stream_t *st;
    CHECK_OK(h, spc_stream_create(h, cs, &st));
    CHECK_OK(h, spc_set_stream(h, st));
    CUDA_CHECK(cudaLaunchHostFunc(cs, gate_fn, (void *)&sh->lost_gate));
    CHECK_OK(h, spc_allreduce(h, world, in, out, N, SPC_F32, SPC_SUM, 60000));
    sh->lost = 1;
    CHECK_ST(h, spc_stream_synchronize(st), SPC_ERR_DAEMON_LOST);
    CHECK_CONTAINS(spc_last_error(h), "reconnecting is off (SPC_RECONNECT_MS=0)");
    dev_check(out, untouched, bytes, "the output of an op no spd ran", 0);
    sh->lost = 2;
    spc_stream_destroy(st);
    CUDA_CHECK(cudaStreamDestroy(cs));
    spc_detach(h);
    free(host);
    free(untouched);
    return 0;
}

int main(void)
{
    if (sp_gpu_test_probe() == SP_TEST_SKIP)
        return SP_TEST_SKIP;
    sh = sp_test_shared(sizeof *sh);

    sp_test_daemon_start(&d, NULL);
    pid_t job = sp_test_fork(job_runner, NULL), lost = sp_test_fork(lost_client, NULL);
    uint64_t deadline = sp_test_now_ms() + 120000;
    while (sh->phase[0] != 2 || sh->phase[1] != 2 || sh->lost != 1) {
        CHECK(sp_test_now_ms() < deadline);
        usleep(1000);
    }
    CHECK_EQ(kill(d.pid, SIGKILL), 0);
    CHECK_EQ(sp_test_wait(d.pid, 10000), -SIGKILL);
    d.pid = 0;
    uint64_t gone = sp_test_now_ms();
    sh->lost_gate = 1;
    while (sh->lost != 2) {
        CHECK(sp_test_now_ms() < gone + 10000);
        usleep(1000);
    }
    uint64_t released_ms = sp_test_now_ms() - gone;
    sp_test_daemon_restart(&d, NULL);
    sh->gate = 1;
    CHECK_EQ(sp_test_wait(job, 240000), 0);
    CHECK_EQ(sp_test_wait(lost, 30000), 0);
    for (int r = 0; r < P; r++)
        CHECK_EQ(sh->resumes[r], 1);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("restart_stream_gpu: spd killed under 2 ranks with CUDA streams open and %d ops queued on each; the next "
           "spd ran each once, before the kernels after it, right bit for bit; a client with reconnecting off "
           "released in %" PRIu64 " ms with DAEMON_LOST, its op not run\n",
           K - K_BEFORE, released_ms);
    return 0;
}
