/*
 * sp_kern_seq.h — the sequence-side data movers of ring attention and Ulysses,
 * their index math written once for the host references (kernels/host/seq.c)
 * and the CUDA kernels (kernels/cuda/seq.cu):
 *
 *   shift    one rank's block of a ring shift: a copy of its neighbour's block, or
 *            zeros for the rank at the edge of a linear (non-cyclic) shift;
 *   zigzag   the rows of a [B, S, ...] or [S, B, ...] tensor put in the zigzag
 *            order of ring attention (split), or back (merge);
 *   pad      heads padded with zero dummy heads, or the dummies dropped, group by
 *            group, and rows padded with zeros to a longer sequence, or cut.
 */
#ifndef SP_KERN_SEQ_H
#define SP_KERN_SEQ_H

#include "sp_kern_a2a.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The numbers of proto/sp_shm.h's SP_SHIFT_F_*. */
#define SP_KERN_SHIFT_LINEAR  1u   /* no wrap: the edge rank receives zeros */
#define SP_KERN_SHIFT_REVERSE 2u   /* receive from rank + 1 rather than rank - 1 */

/* The rank whose block rank `rank` of a ring of P receives, or -1 for zeros. */
int64_t sp_kern_shift_source(uint32_t rank, uint32_t ranks, uint32_t flags);

/* dst = src's n bytes, or n zero bytes when src is NULL (the edge of a linear shift). */
void sp_kern_shift_host(void *dst, const void *src, uint64_t n);

/*
 * Zigzag: the sequence's S rows form 2P chunks of C = S / (2P) rows; rank r
 * works on chunks r and 2P - 1 - r, which balances the causal mask's work over
 * the ring. Split writes the rows in rank order, [chunk 0, chunk 2P-1, chunk 1,
 * chunk 2P-2, ...], so that rank r's rows are the r-th 2C of the sequence (a
 * slice per batch entry in BSHD, one slice in SBHD); merge puts them back.
 */
typedef struct sp_kern_zigzag {
    uint32_t layout;      /* enum sp_kern_layout */
    uint32_t batch;       /* B */
    uint32_t seq_len;     /* S, a multiple of 2P (pad first: sp_kern_pad) */
    uint32_t ranks;       /* P */
    uint64_t row_bytes;   /* bytes of one (b, s) row: heads x head_dim x element size */
    uint32_t merge;       /* 0: natural -> zigzag order (split); 1: back (merge) */
} sp_kern_zigzag_t;

/* dst = src with its rows permuted as z says; dst and src do not overlap.
 * Returns 0, or -1 when S is not a multiple of 2P or a size is zero. */
int sp_kern_zigzag_host(void *dst, const void *src, const sp_kern_zigzag_t *z);

/*
 * Pad and unpad: dst[b, s, grp, w, :] = src[b, s, grp, w, :] when s < rows_in and
 * w < per_group_in, else zeros, for s < rows_out and w < per_group_out, where each
 * row's heads form `groups` groups. Padding heads: per_group_out > per_group_in
 * (one group: dummies after the real heads, as Ulysses deals them when H is not a
 * multiple of P; groups = kv_heads: the dummies that pad each GQA group); rows:
 * rows_out > rows_in (a sequence padded to a multiple). Smaller outputs drop them.
 */
typedef struct sp_kern_pad {
    uint32_t layout;      /* enum sp_kern_layout */
    uint32_t batch;       /* B */
    uint32_t rows_in, rows_out;
    uint32_t groups;
    uint32_t per_group_in, per_group_out;
    uint64_t vec_bytes;   /* bytes of one head: head_dim x element size */
} sp_kern_pad_t;

/* Returns 0, or -1 when a size is zero. */
int sp_kern_pad_host(void *dst, const void *src, const sp_kern_pad_t *p);

#ifdef __cplusplus
}
#endif

/* The source row of row s of the output of z (within a batch entry). */
SP_KERN_HD uint32_t sp_kern_zigzag_row(const sp_kern_zigzag_t *z, uint32_t s)
{
    uint32_t c = z->seq_len / (2 * z->ranks);
    if (!z->merge) {
        /* Output row s is rank r's row w: its first chunk r, then chunk 2P - 1 - r. */
        uint32_t r = s / (2 * c), w = s - r * 2 * c;
        uint32_t chunk = w < c ? r : 2 * z->ranks - 1 - r;
        return chunk * c + (w < c ? w : w - c);
    }
    uint32_t chunk = s / c, i = s - chunk * c;
    return chunk < z->ranks ? chunk * 2 * c + i : (2 * z->ranks - 1 - chunk) * 2 * c + c + i;
}

/* Where head `head` of row (b, s) of the output of p comes from: 1 and the head
 * vector *vec_p of the source, or 0: zeros. */
SP_KERN_HD uint32_t sp_kern_pad_source(const sp_kern_pad_t *p, uint32_t b, uint32_t s, uint32_t head,
                                       uint64_t *vec_p)
{
    uint32_t grp = head / p->per_group_out, w = head - grp * p->per_group_out;
    if (s >= p->rows_in || w >= p->per_group_in)
        return 0;
    *vec_p = sp_kern_row(p->layout, p->batch, p->rows_in, b, s) * p->groups * p->per_group_in +
             (uint64_t)grp * p->per_group_in + w;
    return 1;
}

#endif /* SP_KERN_SEQ_H */
