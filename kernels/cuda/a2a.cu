/*
 * a2a.cu — the fused Ulysses all-to-all on the GPU: one launch writes one rank's
 * whole output of a tensor in its final layout, reading every rank's input
 * (peers' buffers imported into this process), dummy heads, KV replicas and
 * padding rows included, each head vector from sp_kern_a2a_source as on the host.
 */
#include "gather.cuh"
#include "sp_kern_cuda.h"

namespace {

struct a2a_map {
    sp_kern_a2a_geom_t g;
    const uint8_t     *src[SP_KERN_A2A_MAX_RANKS];

    template <unsigned W, typename word>
    __device__ __forceinline__ void move(uint8_t *vec, uint32_t k, uint32_t b, uint32_t s, uint32_t h) const
    {
        uint32_t r;
        uint64_t v;
        uint32_t n = sp_kern_a2a_source(&g, b, s, h, &r, &v);
        const uint64_t vec_bytes = (uint64_t)g.head_dim * g.elem_size;
        if (n == 0) {
            sp_kern_zero<word>(vec + (uint64_t)k * W);
        } else if (n == 1) {
            sp_kern_copy<word>(vec + (uint64_t)k * W, src[r] + v * vec_bytes + (uint64_t)k * W);
        } else {
            /* A word holds whole elements: the launcher takes words no narrower than one. */
            const uint32_t per = W / g.elem_size;
            for (uint32_t i = 0; i < per; i++)
                sp_kern_a2a_sum(vec, (const void *const *)src, r, n, v * vec_bytes, (uint64_t)k * per + i, g.dtype);
        }
    }
};

}  // namespace

extern "C" int sp_kern_a2a_cuda(void *dst, const void *const *src, const sp_kern_a2a_desc_t *d, uint32_t rank,
                                void *stream)
{
    a2a_map m;
    if (sp_kern_a2a_geom(&m.g, d, rank) != 0 || d->ranks > SP_KERN_A2A_MAX_RANKS)
        return -1;
    const uint64_t vec_bytes = (uint64_t)m.g.head_dim * m.g.elem_size;
    if (vec_bytes > UINT32_MAX)
        return -1;   /* the kernel counts a head vector's words in 32 bits */
    uint64_t bits = vec_bytes | (uintptr_t)dst;
    for (uint32_t q = 0; q < d->ranks; q++) {
        m.src[q] = (const uint8_t *)src[q];
        bits |= (uintptr_t)src[q];
    }
    unsigned word = sp_kern_word_bytes(bits);
    if (word < m.g.elem_size)
        return -1;   /* a pointer not aligned to the element */
    sp_kern_walk w = { m.g.layout, m.g.batch, m.g.out_rows, m.g.out_heads, vec_bytes };
    return sp_kern_gather_launch(dst, w, m, word, (cudaStream_t)stream);
}
