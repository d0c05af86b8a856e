/*
 * sp_gpu_test.h — what the GPU tests share: CUDA calls that fail the test with
 * the CUDA message, and the answer to "is there a GPU to test on?".
 */
#ifndef SP_GPU_TEST_H
#define SP_GPU_TEST_H

#include <cuda_runtime.h>
#include <stdio.h>

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

#endif /* SP_GPU_TEST_H */
