/*
 * spd restarted under ranks whose ops run on GPU memory, without a GPU: rank
 * processes on GPUs 0 and 1 of the stand-in driver (tests/stubcuda) loop over
 * an all-reduce and a shift from cudaMalloc memory (CUDA IPC) into cuMem
 * memory, through spd built with the stand-in's kernels (spd_stub). spd is
 * SIGKILLed mid-loop and started again: the new spd takes the ranks over, their
 * GPU registrations sent again under the ids they had, and every result, each
 * compared with a reference computed here, is right. Beside them a client with
 * a CUDA stream open is not taken over: it hears SPC_ERR_DAEMON_LOST at once,
 * saying why; one whose stream was destroyed before spd went is, and its next
 * stream (slot, semaphores) is the new spd's: a stream-ordered all-reduce on
 * it is right.
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

/* Clients with a stream on GPU 0, each ready once it made its stream, then
 * waiting for spd to go: one keeps the stream open, one destroyed it. */
static volatile int *stream_state;   /* [2]: 1: it has its stream; 2: spd was killed */

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

static int stream_client(void *arg)
{
    bool keep_open = arg != NULL;
    volatile int *state = &stream_state[keep_open];
    gpu_bind(0);
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join_named(h, keep_open ? "streamed" : "stream-closed", "restart-test", 1, 0, 20000,
                                   &world));
    void *cs;
    CHECK_EQ(cuStreamCreate(&cs, 0), STUB_SUCCESS);
    spc_stream_t *s;
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    if (!keep_open)
        CHECK_OK(h, spc_stream_destroy(s));
    *state = 1;
    while (*state != 2)
        usleep(1000);
    if (keep_open) {
        uint64_t t0 = sp_test_now_ms();
        CHECK_ST(h, spc_barrier(h, world, 60000), SPC_ERR_DAEMON_LOST);
        CHECK(sp_test_now_ms() - t0 < 2000);
        CHECK_CONTAINS(spc_last_error(h), "no other spd can take this client over: it has a CUDA stream open");
    } else {
        CHECK_OK(h, spc_barrier(h, world, 60000));
        spc_resume_info_t info = SPC_RESUME_INFO_INIT;
        CHECK_OK(h, spc_resume_info(h, &info));
        CHECK_EQ(info.resumes, 1);
        stream_op(h, world, cs);
    }
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
    stream_state = sp_test_shared(2 * sizeof(int));

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

    pid_t job = sp_test_fork(job_runner, NULL), streamed = sp_test_fork(stream_client, (void *)1),
          closed = sp_test_fork(stream_client, NULL);
    uint64_t deadline = sp_test_now_ms() + 30000;
    while (iters[0] < ITERS / 4 || iters[1] < ITERS / 4 || stream_state[0] != 1 || stream_state[1] != 1)
        CHECK(sp_test_now_ms() < deadline);
    CHECK_EQ(kill(d.pid, SIGKILL), 0);
    CHECK_EQ(sp_test_wait(d.pid, 10000), -SIGKILL);
    d.pid = 0;
    sp_test_daemon_restart(&d, NULL);
    stream_state[0] = stream_state[1] = 2;
    CHECK_EQ(sp_test_wait(job, 120000), 0);
    CHECK_EQ(sp_test_wait(streamed, 30000), 0);
    CHECK_EQ(sp_test_wait(closed, 30000), 0);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("restart_stub: GPU registrations (CUDA IPC and cuMem) taken over; %d iterations right; a client with a "
           "CUDA stream open told at once it is not; one whose stream was destroyed taken over, its next stream's "
           "op right\n", ITERS);
    return 0;
}
