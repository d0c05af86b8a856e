/*
 * sp_gpu_test.h — what the GPU tests share: CUDA calls that fail the test with
 * the CUDA message, the answer to "is there a GPU to test on?", and the
 * stream-order tests' stall and stream all-reduce.
 */
#ifndef SP_GPU_TEST_H
#define SP_GPU_TEST_H

#include <cuda_runtime.h>
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include "sp_test.h"

#define CUDA_CHECK(call)                                                                   \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess)                                                             \
            SP_FAIL("%s: %s", #call, cudaGetErrorString(e_));                              \
    } while (0)

/* 0 when a CUDA device is usable; else SP_TEST_SKIP, having said why. */
static inline int sp_gpu_test_usable(void)
{
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        fprintf(stderr, "skipped: no usable CUDA device (%s)\n",
                e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
        return SP_TEST_SKIP;
    }
    return 0;
}

static int sp_gpu_test_probe_main(void *arg)
{
    (void)arg;
    return sp_gpu_test_usable();
}

/* Whether there is a GPU to test on, asked in a child process so that this one
 * makes no CUDA context before it forks its ranks: 0, or SP_TEST_SKIP having
 * said why. A probe that fails otherwise fails the test. */
static inline int sp_gpu_test_probe(void)
{
    int rc = sp_test_wait(sp_test_fork(sp_gpu_test_probe_main, NULL), 60000);
    if (rc != SP_TEST_SKIP)
        CHECK_EQ(rc, 0);
    return rc;
}

/* Holds a CUDA stream for ms milliseconds: a host function that sleeps, run in
 * the stream's order (the stall a late rank's stream is made of). */
static void CUDART_CB sp_gpu_sleep_ms_fn(void *arg)
{
    struct timespec ts = { (time_t)((intptr_t)arg / 1000), (long)((intptr_t)arg % 1000) * 1000000L };
    nanosleep(&ts, NULL);
}

static inline void sp_gpu_stall(cudaStream_t cs, int ms)
{
    CUDA_CHECK(cudaLaunchHostFunc(cs, sp_gpu_sleep_ms_fn, (void *)(intptr_t)ms));
}

/* One fp32 sum all-reduce of n elements x -> y, on the handle's current
 * stream, with the daemon timeout t_ms (0: spd's default). */
static inline spc_status_t sp_gpu_stream_allreduce(spc_handle_t *h, spc_group_t g, float *x, float *y, uint64_t n,
                                                   uint32_t t_ms, spc_request_t **req_p)
{
    spc_op_t op = { .struct_size = sizeof op, .opcode = SPC_OP_ALLREDUCE, .group = g, .dtype = SPC_F32,
                    .redop = SPC_SUM, .count = n, .ntensors = 2, .timeout_ms = t_ms };
    op.tensors[0].ptr = x;
    op.tensors[1].ptr = y;
    return spc_submit(h, &op, req_p);
}

#endif /* SP_GPU_TEST_H */
