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
/* Integers as their unsigned bits, as on the host: see SP_KERN_DEFINE_INT_OP. */
template <> __device__ uint32_t op<uint32_t>(uint32_t a, uint32_t b, unsigned redop) { return sp_kern_op_i32(a, b, redop); }
template <> __device__ uint64_t op<uint64_t>(uint64_t a, uint64_t b, unsigned redop) { return sp_kern_op_i64(a, b, redop); }

template <typename T>
__global__ void reduce_kernel(T *__restrict__ acc, const T *__restrict__ src, uint64_t n, unsigned redop)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        acc[i] = op<T>(acc[i], src[i], redop);
}

extern "C" int sp_kern_reduce_cuda(void *acc, const void *src, uint64_t n, unsigned dtype, unsigned redop,
                                   void *stream)
{
    /* fp16 and bf16 accumulate in fp32 (sp_kern_acc_dtype), as on the host: this
     * kernel, whose accumulator has the operands' type, does not take them. */
    if (!sp_kern_reduce_supported(dtype, redop) || sp_kern_acc_dtype(dtype) != dtype)
        return -1;
    if (n == 0)
        return 0;
    const unsigned threads = 256;
    uint64_t want = (n + threads - 1) / threads;
    unsigned blocks = want > 4096 ? 4096u : (unsigned)want;
    cudaStream_t s = (cudaStream_t)stream;
    switch (dtype) {
    case SP_KERN_F32:
        reduce_kernel<float><<<blocks, threads, 0, s>>>((float *)acc, (const float *)src, n, redop);
        break;
    case SP_KERN_F64:
        reduce_kernel<double><<<blocks, threads, 0, s>>>((double *)acc, (const double *)src, n, redop);
        break;
    case SP_KERN_I32:
        reduce_kernel<uint32_t><<<blocks, threads, 0, s>>>((uint32_t *)acc, (const uint32_t *)src, n, redop);
        break;
    case SP_KERN_I64:
        reduce_kernel<uint64_t><<<blocks, threads, 0, s>>>((uint64_t *)acc, (const uint64_t *)src, n, redop);
        break;
    }
    return (int)cudaGetLastError();
}
