/* merge.c — host reference of the out/LSE merge of ring attention, from the
 * formula of sp_kern_merge.h. */
#include "sp_kern_merge.h"

int sp_kern_lse_merge_host(float *out, float *lse, const float *out_a, const float *lse_a, const float *out_b,
                           const float *lse_b, const sp_kern_lse_merge_t *m)
{
    if (m->batch == 0 || m->seq_len == 0 || m->heads == 0 || m->head_dim == 0 || m->layout > SP_KERN_SBHD)
        return -1;
    for (uint32_t b = 0; b < m->batch; b++)
        for (uint32_t h = 0; h < m->heads; h++)
            for (uint32_t s = 0; s < m->seq_len; s++) {
                uint64_t li = ((uint64_t)b * m->heads + h) * m->seq_len + s;
                uint64_t o = (sp_kern_row(m->layout, m->batch, m->seq_len, b, s) * m->heads + h) * m->head_dim;
                sp_kern_lse_weights_t w = sp_kern_lse_weigh(lse_a[li], lse_b[li]);
                for (uint32_t i = 0; i < m->head_dim; i++)
                    out[o + i] = sp_kern_lse_out(&w, out_a[o + i], out_b[o + i]);
                lse[li] = w.lse;
            }
    return 0;
}
