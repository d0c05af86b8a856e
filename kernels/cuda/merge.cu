/*
 * merge.cu — the out/LSE merge of ring attention on the GPU, with the formula of
 * sp_kern_merge.h, as the host reference in kernels/host/merge.c. Compiled with
 * --fmad=false (kernels/CMakeLists.txt): a fused multiply-add would round once
 * where the host rounds twice.
 *
 * One warp per (b, s, h) row of out: its lanes compute the row's weights together
 * (the same instructions, once per warp) and then share the head_dim elements,
 * four at a time where out's rows allow.
 */
#include <cuda_runtime.h>

#include "sp_kern_cuda.h"
#include "sp_kern_merge.h"

namespace {

template <bool VEC4>
__global__ void lse_merge_kernel(float *out, float *lse, const float *out_a, const float *lse_a, const float *out_b,
                                 const float *lse_b, sp_kern_lse_merge_t m)
{
    const unsigned lane = threadIdx.x & 31;
    const uint64_t rows = (uint64_t)m.batch * m.seq_len * m.heads;
    const uint64_t warps = (uint64_t)gridDim.x * (blockDim.x / 32);
    for (uint64_t t = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) / 32; t < rows; t += warps) {
        /* t walks out's rows in memory order: (row, h), row in out's layout. */
        uint64_t row = t / m.heads;
        uint32_t h = (uint32_t)(t - row * m.heads), b, s;
        if (m.layout == SP_KERN_BSHD) {
            b = (uint32_t)(row / m.seq_len);
            s = (uint32_t)(row - (uint64_t)b * m.seq_len);
        } else {
            s = (uint32_t)(row / m.batch);
            b = (uint32_t)(row - (uint64_t)s * m.batch);
        }
        const uint64_t li = ((uint64_t)b * m.heads + h) * m.seq_len + s, o = t * m.head_dim;
        sp_kern_lse_weights_t w = sp_kern_lse_weigh(lse_a[li], lse_b[li]);
        /* Every lane has read lse_a and lse_b before lane 0 may overwrite them in place. */
        __syncwarp();
        if (VEC4) {
            for (uint32_t i = lane; i < m.head_dim / 4; i += 32) {
                float4 a = ((const float4 *)(out_a + o))[i], c = ((const float4 *)(out_b + o))[i];
                float4 r = { sp_kern_lse_out(&w, a.x, c.x), sp_kern_lse_out(&w, a.y, c.y), sp_kern_lse_out(&w, a.z, c.z),
                             sp_kern_lse_out(&w, a.w, c.w) };
                ((float4 *)(out + o))[i] = r;
            }
        } else {
            for (uint32_t i = lane; i < m.head_dim; i += 32)
                out[o + i] = sp_kern_lse_out(&w, out_a[o + i], out_b[o + i]);
        }
        if (lane == 0)
            lse[li] = w.lse;
    }
}

}  // namespace

extern "C" int sp_kern_lse_merge_cuda(float *out, float *lse, const float *out_a, const float *lse_a,
                                      const float *out_b, const float *lse_b, const sp_kern_lse_merge_t *m,
                                      void *stream)
{
    if (m->batch == 0 || m->seq_len == 0 || m->heads == 0 || m->head_dim == 0 || m->layout > SP_KERN_SBHD)
        return -1;
    const unsigned threads = 256;
    uint64_t rows = (uint64_t)m->batch * m->seq_len * m->heads, want = (rows + threads / 32 - 1) / (threads / 32);
    unsigned blocks = want > 8192 ? 8192u : (unsigned)want;
    bool vec4 = m->head_dim % 4 == 0 && (((uintptr_t)out | (uintptr_t)out_a | (uintptr_t)out_b) & 15) == 0;
    cudaStream_t s = (cudaStream_t)stream;
    if (vec4)
        lse_merge_kernel<true><<<blocks, threads, 0, s>>>(out, lse, out_a, lse_a, out_b, lse_b, *m);
    else
        lse_merge_kernel<false><<<blocks, threads, 0, s>>>(out, lse, out_a, lse_a, out_b, lse_b, *m);
    return (int)cudaGetLastError();
}
