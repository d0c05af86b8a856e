/*
 * reduce.cu — the device version of sp_kern_reduce: acc[i] = acc[i] (op) src[i],
 * element-wise with the operations of sp_kern_ops.h, so a fold over ranks in
 * rank order gives the host kernel's bits. The daemon's GPU data path uses it
 * for reductions of device buffers; tests/gpu compares it with the host kernel.
 */
#include <cuda_runtime.h>

#include "sp_kern_cuda.h"
#include "sp_kern_ops.h"

template <typename T> __device__ T op(T a, T b, unsigned redop);
template <> __device__ float op<float>(float a, float b, unsigned redop) { return sp_kern_op_f32(a, b, redop); }
template <> __device__ double op<double>(double a, double b, unsigned redop) { return sp_kern_op_f64(a, b, redop); }

template <typename T>
__global__ void reduce_kernel(T *__restrict__ acc, const T *__restrict__ src, uint64_t n, unsigned redop)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        acc[i] = op<T>(acc[i], src[i], redop);
}

extern "C" int sp_kern_reduce_cuda(void *acc, const void *src, uint64_t n, unsigned dtype, unsigned redop,
                                   void *stream)
{
    if (!sp_kern_reduce_supported(dtype, redop))
        return -1;
    if (n == 0)
        return 0;
    const unsigned threads = 256;
    uint64_t want = (n + threads - 1) / threads;
    unsigned blocks = want > 4096 ? 4096u : (unsigned)want;
    cudaStream_t s = (cudaStream_t)stream;
    if (dtype == SP_KERN_F32)
        reduce_kernel<float><<<blocks, threads, 0, s>>>((float *)acc, (const float *)src, n, redop);
    else
        reduce_kernel<double><<<blocks, threads, 0, s>>>((double *)acc, (const double *)src, n, redop);
    return (int)cudaGetLastError();
}
