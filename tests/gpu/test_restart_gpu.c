/*
 * spd restarted under ranks whose ops run on GPU memory: 2 rank processes on
 * one GPU loop over an fp32 all-reduce and a shift between cudaMalloc'd
 * buffers registered with spc_register_device, every result copied back and
 * compared bit for bit with the host reference (kernels/host, in rank order)
 * computed here. spd is SIGKILLed mid-loop and started again: the new spd
 * imports the ranks' GPU memory again under the region ids they had, and the
 * loop goes on, right to the end. Each rank made an spc stream on a CUDA
 * stream of its own before the loop and destroyed it (test_restart_stream_gpu
 * keeps streams open across the kill); after the loop it makes one again on the same CUDA
 * stream, the new spd's, and an all-reduce in that stream's order, its input
 * written and its output read back on the stream, is right too. Prints how
 * long the ranks stalled.
 *
 * Needs a GPU; without one it says why and exits 77 (skipped).
 */
#include <signal.h>
#include <unistd.h>

#include "sp_gpu_regions.h"
#include "sp_kern_cases.h"

#define P     2
#define N     (65536u + 5u)   /* floats per op */
#define ITERS 200

static sp_test_daemon_t d;
static struct shared {
    volatile int iter[P];
    uint64_t     max_ms[P];
    uint32_t     resumes[P];
} *sh;

/* Finite fp32 values whose rank-order sums are exact neither trivially nor in any order. */
static void fill(float *p, int rank, int it)
{
    for (uint32_t i = 0; i < N; i++)
        p[i] = (float)(((double)((i * 2654435761u + (uint32_t)rank * 97u + (uint32_t)it * 131u) % 100003u) - 50000.0) /
                       7.0);
}

static int rank_main(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    (void)arg;
    const uint64_t bytes = (uint64_t)N * sizeof(float);
    float *mine = malloc(bytes), *x = malloc(bytes), *want = malloc(bytes), *prev = malloc(bytes);
    spc_region_t rs, rr;
    void *ds = dev_put(h, NULL, bytes, &rs), *dr = dev_put(h, NULL, bytes, &rr);
    cudaStream_t cs;
    CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    spc_stream_t *st;
    CHECK_OK(h, spc_stream_create(h, cs, &st));
    CHECK_OK(h, spc_stream_destroy(st));
    for (int it = 0; it < ITERS; it++) {
        sh->iter[rank] = it;
        fill(mine, rank, it);
        fill(want, 0, it);
        for (int q = 1; q < nranks; q++) {
            fill(x, q, it);
            CHECK_EQ(sp_kern_reduce(want, x, N, SP_KERN_F32, SP_KERN_SUM), 0);
        }
        fill(prev, (rank + nranks - 1) % nranks, it);
        dev_write(ds, mine, bytes);
        uint64_t t0 = sp_test_now_ms();
        CHECK_OK(h, spc_allreduce(h, world, ds, dr, N, SPC_F32, SPC_SUM, 60000));
        dev_check(dr, want, bytes, "allreduce fp32", rank);
        spc_shift_desc_t s = SPC_SHIFT_DESC_INIT;
        s.group = world;
        s.ntensors = 1;
        s.tensors[0].send = ds;
        s.tensors[0].recv = dr;
        s.tensors[0].bytes = bytes;
        CHECK_OK(h, spc_shift(h, &s, 60000));
        dev_check(dr, prev, bytes, "cyclic shift", rank);
        uint64_t dt = sp_test_now_ms() - t0;
        if (dt > sh->max_ms[rank])
            sh->max_ms[rank] = dt;
    }
    spc_resume_info_t info = SPC_RESUME_INFO_INIT;
    CHECK_OK(h, spc_resume_info(h, &info));
    sh->resumes[rank] = info.resumes;

    /* A stream of the new spd: input, op and output in its order, no host wait between. */
    fill(mine, rank, ITERS);
    fill(want, 0, ITERS);
    for (int q = 1; q < nranks; q++) {
        fill(x, q, ITERS);
        CHECK_EQ(sp_kern_reduce(want, x, N, SP_KERN_F32, SP_KERN_SUM), 0);
    }
    CHECK_OK(h, spc_stream_create(h, cs, &st));
    CHECK_OK(h, spc_set_stream(h, st));
    CUDA_CHECK(cudaMemcpyAsync(ds, mine, bytes, cudaMemcpyHostToDevice, cs));
    CHECK_OK(h, spc_allreduce(h, world, ds, dr, N, SPC_F32, SPC_SUM, 60000));
    CUDA_CHECK(cudaMemcpyAsync(x, dr, bytes, cudaMemcpyDeviceToHost, cs));
    CHECK_OK(h, spc_stream_synchronize(st));
    compare((const uint8_t *)x, (const uint8_t *)want, bytes, "stream-ordered allreduce after the take-over", rank);
    CHECK_OK(h, spc_stream_destroy(st));
    CUDA_CHECK(cudaStreamDestroy(cs));
    dev_drop(h, ds, rs);
    dev_drop(h, dr, rr);
    free(mine);
    free(x);
    free(want);
    free(prev);
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
    if (sp_gpu_test_probe() == SP_TEST_SKIP)
        return SP_TEST_SKIP;
    sh = sp_test_shared(sizeof *sh);

    sp_test_daemon_start(&d, NULL);
    pid_t job = sp_test_fork(job_runner, NULL);
    uint64_t deadline = sp_test_now_ms() + 120000;
    while (sh->iter[0] < ITERS / 4 || sh->iter[1] < ITERS / 4) {
        CHECK(sp_test_now_ms() < deadline);
        usleep(1000);
    }
    CHECK_EQ(kill(d.pid, SIGKILL), 0);
    CHECK_EQ(sp_test_wait(d.pid, 10000), -SIGKILL);
    d.pid = 0;
    sp_test_daemon_restart(&d, NULL);
    CHECK_EQ(sp_test_wait(job, 240000), 0);
    for (int r = 0; r < P; r++)
        CHECK_EQ(sh->resumes[r], 1);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("restart_gpu: spd killed mid-loop; ranks stalled at most %" PRIu64 " ms; %d iterations of all-reduce "
           "and shift on GPU memory right, bit for bit, and a stream-ordered all-reduce on a stream made after the "
           "take-over\n",
           sh->max_ms[0] > sh->max_ms[1] ? sh->max_ms[0] : sh->max_ms[1], ITERS);
    return 0;
}
