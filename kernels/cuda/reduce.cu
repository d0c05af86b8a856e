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

/* fp16 and bf16 through an fp32 accumulator, as on the host (sp_kern_widen,
 * sp_kern_reduce_widen, sp_kern_narrow), with the same element functions. */
__device__ __forceinline__ float widen16(uint16_t x, bool bf16)
{
    return bf16 ? sp_kern_bf16_to_f32(x) : sp_kern_f16_to_f32(x);
}

__global__ void widen_kernel(float *__restrict__ dst, const uint16_t *__restrict__ src, uint64_t n, bool bf16)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        dst[i] = widen16(src[i], bf16);
}

__global__ void reduce_widen_kernel(float *__restrict__ acc, const uint16_t *__restrict__ src, uint64_t n, bool bf16,
                                    unsigned redop)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        acc[i] = sp_kern_op_f32(acc[i], widen16(src[i], bf16), redop);
}

__global__ void narrow_kernel(uint16_t *__restrict__ dst, const float *__restrict__ src, uint64_t n, bool bf16)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x)
        dst[i] = bf16 ? sp_kern_f32_to_bf16(src[i]) : sp_kern_f32_to_f16(src[i]);
}

static unsigned grid_for(uint64_t n)
{
    uint64_t want = (n + 255) / 256;
    return want > 4096 ? 4096u : want == 0 ? 1u : (unsigned)want;
}

static bool is16(unsigned dtype)
{
    return dtype == SP_KERN_F16 || dtype == SP_KERN_BF16;
}

extern "C" int sp_kern_widen_cuda(float *dst, const void *src, uint64_t n, unsigned dtype, void *stream)
{
    if (!is16(dtype))
        return -1;
    if (n > 0)
        widen_kernel<<<grid_for(n), 256, 0, (cudaStream_t)stream>>>(dst, (const uint16_t *)src, n,
                                                                     dtype == SP_KERN_BF16);
    return (int)cudaGetLastError();
}

extern "C" int sp_kern_reduce_widen_cuda(float *acc, const void *src, uint64_t n, unsigned dtype, unsigned redop,
                                         void *stream)
{
    if (!is16(dtype) || !sp_kern_reduce_supported(dtype, redop))
        return -1;
    if (n > 0)
        reduce_widen_kernel<<<grid_for(n), 256, 0, (cudaStream_t)stream>>>(acc, (const uint16_t *)src, n,
                                                                            dtype == SP_KERN_BF16, redop);
    return (int)cudaGetLastError();
}

extern "C" int sp_kern_narrow_cuda(void *dst, const float *src, uint64_t n, unsigned dtype, void *stream)
{
    if (!is16(dtype))
        return -1;
    if (n > 0)
        narrow_kernel<<<grid_for(n), 256, 0, (cudaStream_t)stream>>>((uint16_t *)dst, src, n, dtype == SP_KERN_BF16);
    return (int)cudaGetLastError();
}

/* ================================================================ the fused all-reduce */

/* Every rank's pointers, passed by value (kernel parameters: 2 x 64 x 8 bytes). */
struct allreduce_args {
    const void *src[SP_KERN_A2A_MAX_RANKS];
    void       *dst[SP_KERN_A2A_MAX_RANKS];
};

/* Element i: the rank-order fold of every src[r][i], in A (T's accumulator:
 * T itself, or fp32 for 16-bit types), written to every dst[r][i]. One thread
 * reads element i of every source before it writes element i of any
 * destination, so a rank's recv may be its send. */
template <typename T, typename A>
__device__ __forceinline__ A load_acc(const void *p, uint64_t i, bool bf16);
template <> __device__ __forceinline__ float load_acc<float, float>(const void *p, uint64_t i, bool)
{
    return ((const float *)p)[i];
}
template <> __device__ __forceinline__ double load_acc<double, double>(const void *p, uint64_t i, bool)
{
    return ((const double *)p)[i];
}
template <> __device__ __forceinline__ uint32_t load_acc<uint32_t, uint32_t>(const void *p, uint64_t i, bool)
{
    return ((const uint32_t *)p)[i];
}
template <> __device__ __forceinline__ uint64_t load_acc<uint64_t, uint64_t>(const void *p, uint64_t i, bool)
{
    return ((const uint64_t *)p)[i];
}
template <> __device__ __forceinline__ float load_acc<uint16_t, float>(const void *p, uint64_t i, bool bf16)
{
    return widen16(((const uint16_t *)p)[i], bf16);
}

template <typename T, typename A> __device__ __forceinline__ void store_acc(void *p, uint64_t i, A v, bool bf16)
{
    ((T *)p)[i] = v;
}
template <> __device__ __forceinline__ void store_acc<uint16_t, float>(void *p, uint64_t i, float v, bool bf16)
{
    ((uint16_t *)p)[i] = bf16 ? sp_kern_f32_to_bf16(v) : sp_kern_f32_to_f16(v);
}

template <typename T, typename A>
__global__ void allreduce_kernel(allreduce_args a, uint32_t P, uint64_t n, unsigned redop, bool bf16)
{
    for (uint64_t i = blockIdx.x * (uint64_t)blockDim.x + threadIdx.x; i < n; i += (uint64_t)gridDim.x * blockDim.x) {
        A acc = load_acc<T, A>(a.src[0], i, bf16);
        for (uint32_t r = 1; r < P; r++)
            acc = op<A>(acc, load_acc<T, A>(a.src[r], i, bf16), redop);
        for (uint32_t r = 0; r < P; r++)
            store_acc<T, A>(a.dst[r], i, acc, bf16);
    }
}

extern "C" int sp_kern_allreduce_cuda(void *const *dst, const void *const *src, uint32_t P, uint64_t n,
                                      unsigned dtype, unsigned redop, void *stream)
{
    if (P == 0 || P > SP_KERN_A2A_MAX_RANKS || !sp_kern_reduce_supported(dtype, redop))
        return -1;
    if (n == 0)
        return 0;
    allreduce_args a;
    for (uint32_t r = 0; r < P; r++) {
        a.src[r] = src[r];
        a.dst[r] = dst[r];
    }
    cudaStream_t s = (cudaStream_t)stream;
    const unsigned g = grid_for(n);
    switch (dtype) {
    case SP_KERN_F32: allreduce_kernel<float, float><<<g, 256, 0, s>>>(a, P, n, redop, false); break;
    case SP_KERN_F64: allreduce_kernel<double, double><<<g, 256, 0, s>>>(a, P, n, redop, false); break;
    case SP_KERN_I32: allreduce_kernel<uint32_t, uint32_t><<<g, 256, 0, s>>>(a, P, n, redop, false); break;
    case SP_KERN_I64: allreduce_kernel<uint64_t, uint64_t><<<g, 256, 0, s>>>(a, P, n, redop, false); break;
    case SP_KERN_F16: allreduce_kernel<uint16_t, float><<<g, 256, 0, s>>>(a, P, n, redop, false); break;
    case SP_KERN_BF16: allreduce_kernel<uint16_t, float><<<g, 256, 0, s>>>(a, P, n, redop, true); break;
    default: return -1;
    }
    return (int)cudaGetLastError();
}
