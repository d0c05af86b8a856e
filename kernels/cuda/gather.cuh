/*
 * gather.cuh — the one kernel shape of the data movers (all-to-all, zigzag,
 * pad): each output is [B, rows, heads] head vectors of vec_bytes, each a copy
 * of a source head vector, zeros, or (all-to-all) a sum; a map says which. The
 * kernel moves the widest word (16 bytes down to 1) that the head vectors' size
 * and every pointer allow, consecutive threads on consecutive words of a head
 * vector and then of the next row's, so warps read and write whole lines.
 * blockIdx.z walks the batch, blockIdx.y the heads, x (grid-stride) the rows'
 * words, so that a thread divides once, and in 32 bits when the count allows.
 */
#ifndef SP_KERN_GATHER_CUH
#define SP_KERN_GATHER_CUH

#include <cuda_runtime.h>
#include <stdint.h>

#include "sp_kern_a2a.h"

template <unsigned W> struct sp_kern_word;
template <> struct sp_kern_word<16> { typedef uint4 type; };
template <> struct sp_kern_word<8> { typedef uint2 type; };
template <> struct sp_kern_word<4> { typedef uint32_t type; };
template <> struct sp_kern_word<2> { typedef uint16_t type; };
template <> struct sp_kern_word<1> { typedef uint8_t type; };

/* The output's shape, as the kernel walks it. */
struct sp_kern_walk {
    uint32_t layout, batch, rows, heads;
    uint64_t vec_bytes;
};

template <unsigned W, typename Idx, typename Map>
__global__ void sp_kern_gather_kernel(uint8_t *__restrict__ dst, const __grid_constant__ sp_kern_walk w,
                                      const __grid_constant__ Map map)
{
    typedef typename sp_kern_word<W>::type word;
    const uint32_t per_vec = (uint32_t)(w.vec_bytes / W);
    const Idx units = (Idx)w.rows * per_vec;
    for (uint32_t b = blockIdx.z; b < w.batch; b += gridDim.z)
        for (uint32_t h = blockIdx.y; h < w.heads; h += gridDim.y)
            for (Idx u = (Idx)blockIdx.x * blockDim.x + threadIdx.x; u < units; u += (Idx)gridDim.x * blockDim.x) {
                uint32_t s = (uint32_t)(u / per_vec), k = (uint32_t)(u - (Idx)s * per_vec);
                uint8_t *vec = dst + (sp_kern_row(w.layout, w.batch, w.rows, b, s) * w.heads + h) * w.vec_bytes;
                map.template move<W, word>(vec, k, b, s, h);
            }
}

/* The widest word that divides x (the OR of a size and the pointers), at most 16. */
static inline unsigned sp_kern_word_bytes(uint64_t x)
{
    unsigned w = 16;
    while (w > 1 && (x & (w - 1)))
        w >>= 1;
    return w;
}

template <unsigned W, typename Map>
static void sp_kern_gather_launch_w(uint8_t *dst, const sp_kern_walk &w, const Map &map, cudaStream_t stream)
{
    const unsigned threads = 256;
    uint64_t units = (uint64_t)w.rows * (w.vec_bytes / W);
    unsigned z = w.batch < 65535 ? w.batch : 65535, y = w.heads < 65535 ? w.heads : 65535;
    /* About 16 blocks of 256 threads per SM on the largest parts, in all. */
    uint64_t x = (units + threads - 1) / threads, cap = 8192 / ((uint64_t)y * z);
    if (x > cap)
        x = cap > 0 ? cap : 1;
    dim3 grid((unsigned)x, y, z);
    /* 32-bit indices only where the grid stride past the last unit cannot wrap
     * them back below it (an endless loop). */
    if (units + x * threads <= UINT32_MAX)
        sp_kern_gather_kernel<W, uint32_t, Map><<<grid, threads, 0, stream>>>(dst, w, map);
    else
        sp_kern_gather_kernel<W, uint64_t, Map><<<grid, threads, 0, stream>>>(dst, w, map);
}

/* Launches the gather with words of `word_bytes` (a power of two <= 16 that
 * divides the head vectors and every pointer); returns 0 or the launch's error. */
template <typename Map>
static int sp_kern_gather_launch(void *dst, const sp_kern_walk &w, const Map &map, unsigned word_bytes,
                                 cudaStream_t stream)
{
    if ((uint64_t)w.batch * w.rows * w.heads == 0)
        return 0;
    uint8_t *d = (uint8_t *)dst;
    switch (word_bytes) {
    case 16: sp_kern_gather_launch_w<16>(d, w, map, stream); break;
    case 8: sp_kern_gather_launch_w<8>(d, w, map, stream); break;
    case 4: sp_kern_gather_launch_w<4>(d, w, map, stream); break;
    case 2: sp_kern_gather_launch_w<2>(d, w, map, stream); break;
    default: sp_kern_gather_launch_w<1>(d, w, map, stream); break;
    }
    return (int)cudaGetLastError();
}

/* A zero word, and a copy of one word. */
template <typename word> __device__ __forceinline__ void sp_kern_zero(uint8_t *p)
{
    *(word *)p = word{};
}

template <typename word> __device__ __forceinline__ void sp_kern_copy(uint8_t *p, const uint8_t *q)
{
    *(word *)p = *(const word *)q;
}

#endif /* SP_KERN_GATHER_CUH */
