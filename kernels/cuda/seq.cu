/*
 * seq.cu — the sequence-side data movers on the GPU: the shift block, the zigzag
 * permutation and pad / unpad, with the index math of sp_kern_seq.h, as the host
 * references in kernels/host/seq.c.
 */
#include "gather.cuh"
#include "sp_kern_cuda.h"
#include "sp_kern_seq.h"

namespace {

/* A shift block is one row of one head vector: the gather's shape with the bytes
 * as the row's words. */
struct shift_map {
    const uint8_t *src;   /* NULL: zeros */

    template <unsigned W, typename word>
    __device__ __forceinline__ void move(uint8_t *vec, uint32_t k, uint32_t, uint32_t, uint32_t) const
    {
        if (src == NULL)
            sp_kern_zero<word>(vec + (uint64_t)k * W);
        else
            sp_kern_copy<word>(vec + (uint64_t)k * W, src + (uint64_t)k * W);
    }
};

/* Zigzag: a head vector is a whole (b, s) row. */
struct zigzag_map {
    sp_kern_zigzag_t z;
    const uint8_t   *src;

    template <unsigned W, typename word>
    __device__ __forceinline__ void move(uint8_t *vec, uint32_t k, uint32_t b, uint32_t s, uint32_t) const
    {
        uint64_t row = sp_kern_row(z.layout, z.batch, z.seq_len, b, sp_kern_zigzag_row(&z, s));
        sp_kern_copy<word>(vec + (uint64_t)k * W, src + row * z.row_bytes + (uint64_t)k * W);
    }
};

struct pad_map {
    sp_kern_pad_t  p;
    const uint8_t *src;

    template <unsigned W, typename word>
    __device__ __forceinline__ void move(uint8_t *vec, uint32_t k, uint32_t b, uint32_t s, uint32_t h) const
    {
        uint64_t v;
        if (sp_kern_pad_source(&p, b, s, h, &v))
            sp_kern_copy<word>(vec + (uint64_t)k * W, src + v * p.vec_bytes + (uint64_t)k * W);
        else
            sp_kern_zero<word>(vec + (uint64_t)k * W);
    }
};

}  // namespace

extern "C" int sp_kern_shift_cuda(void *dst, const void *src, uint64_t n, void *stream)
{
    if (n == 0)
        return 0;
    /* One row of n bytes cut into words: rows of the gather count in 32 bits, so a
     * block of more than 4 GiB goes in several launches. */
    const uint64_t most = 1ull << 31;
    for (uint64_t off = 0; off < n; off += most) {
        uint64_t len = n - off < most ? n - off : most;
        shift_map m = { src ? (const uint8_t *)src + off : NULL };
        uint64_t bits = len | (uintptr_t)dst | (uintptr_t)src;
        sp_kern_walk w = { SP_KERN_BSHD, 1, 1, 1, len };
        int rc = sp_kern_gather_launch((uint8_t *)dst + off, w, m, sp_kern_word_bytes(bits), (cudaStream_t)stream);
        if (rc != 0)
            return rc;
    }
    return 0;
}

extern "C" int sp_kern_zigzag_cuda(void *dst, const void *src, const sp_kern_zigzag_t *z, void *stream)
{
    if (z->batch == 0 || z->ranks == 0 || z->row_bytes == 0 || z->seq_len == 0 || z->seq_len % (2 * z->ranks) != 0 ||
        z->layout > SP_KERN_SBHD || z->row_bytes > UINT32_MAX)
        return -1;
    zigzag_map m = { *z, (const uint8_t *)src };
    uint64_t bits = z->row_bytes | (uintptr_t)dst | (uintptr_t)src;
    sp_kern_walk w = { z->layout, z->batch, z->seq_len, 1, z->row_bytes };
    return sp_kern_gather_launch(dst, w, m, sp_kern_word_bytes(bits), (cudaStream_t)stream);
}

extern "C" int sp_kern_pad_cuda(void *dst, const void *src, const sp_kern_pad_t *p, void *stream)
{
    if (p->batch == 0 || p->rows_out == 0 || p->groups == 0 || p->per_group_out == 0 || p->vec_bytes == 0 ||
        p->layout > SP_KERN_SBHD || p->vec_bytes > UINT32_MAX)
        return -1;
    pad_map m = { *p, (const uint8_t *)src };
    uint64_t bits = p->vec_bytes | (uintptr_t)dst | (uintptr_t)src;
    sp_kern_walk w = { p->layout, p->batch, p->rows_out, p->groups * p->per_group_out, p->vec_bytes };
    return sp_kern_gather_launch(dst, w, m, sp_kern_word_bytes(bits), (cudaStream_t)stream);
}
