/* seq.c — host references of the shift block, the zigzag permutation and pad /
 * unpad, one row or head vector at a time from the index math of sp_kern_seq.h. */
#include <string.h>

#include "sp_kern_seq.h"

int64_t sp_kern_shift_source(uint32_t rank, uint32_t ranks, uint32_t flags)
{
    bool reverse = flags & SP_KERN_SHIFT_REVERSE;
    if ((flags & SP_KERN_SHIFT_LINEAR) && rank == (reverse ? ranks - 1 : 0))
        return -1;
    return reverse ? (rank + 1) % ranks : (rank + ranks - 1) % ranks;
}

void sp_kern_shift_host(void *dst, const void *src, uint64_t n)
{
    if (src == NULL)
        memset(dst, 0, n);
    else
        memcpy(dst, src, n);
}

int sp_kern_zigzag_host(void *dst, const void *src, const sp_kern_zigzag_t *z)
{
    if (z->batch == 0 || z->ranks == 0 || z->row_bytes == 0 || z->seq_len == 0 || z->seq_len % (2 * z->ranks) != 0 ||
        z->layout > SP_KERN_SBHD)
        return -1;
    for (uint32_t b = 0; b < z->batch; b++)
        for (uint32_t s = 0; s < z->seq_len; s++)
            memcpy((uint8_t *)dst + sp_kern_row(z->layout, z->batch, z->seq_len, b, s) * z->row_bytes,
                   (const uint8_t *)src +
                       sp_kern_row(z->layout, z->batch, z->seq_len, b, sp_kern_zigzag_row(z, s)) * z->row_bytes,
                   z->row_bytes);
    return 0;
}

int sp_kern_pad_host(void *dst, const void *src, const sp_kern_pad_t *p)
{
    if (p->batch == 0 || p->rows_out == 0 || p->groups == 0 || p->per_group_out == 0 || p->vec_bytes == 0 ||
        p->layout > SP_KERN_SBHD)
        return -1;
    const uint32_t heads = p->groups * p->per_group_out;
    for (uint32_t b = 0; b < p->batch; b++)
        for (uint32_t s = 0; s < p->rows_out; s++)
            for (uint32_t h = 0; h < heads; h++) {
                uint8_t *out = (uint8_t *)dst + (sp_kern_row(p->layout, p->batch, p->rows_out, b, s) * heads + h) * p->vec_bytes;
                uint64_t v;
                if (sp_kern_pad_source(p, b, s, h, &v))
                    memcpy(out, (const uint8_t *)src + v * p->vec_bytes, p->vec_bytes);
                else
                    memset(out, 0, p->vec_bytes);
            }
    return 0;
}
