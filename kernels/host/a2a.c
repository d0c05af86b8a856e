/*
 * a2a.c — the geometry of the fused all-to-all, from proto/sp_ulysses.h's rule,
 * and its host reference: one head vector at a time, straight from
 * sp_kern_a2a_source, so that it and the CUDA kernel differ only in how they
 * walk the output. See sp_kern_a2a.h.
 */
#include <string.h>

#include "sp_kern.h"
#include "sp_kern_a2a.h"
#include "sp_ulysses.h"

_Static_assert((int)SP_KERN_SEQ_TO_HEAD == (int)SP_A2A_SEQ_TO_HEAD && (int)SP_KERN_HEAD_TO_SEQ == (int)SP_A2A_HEAD_TO_SEQ &&
               (int)SP_KERN_BSHD == (int)SP_LAYOUT_BSHD && (int)SP_KERN_SBHD == (int)SP_LAYOUT_SBHD &&
               (int)SP_KERN_HEADS_Q == (int)SP_HEADS_Q && (int)SP_KERN_HEADS_KV == (int)SP_HEADS_KV &&
               SP_KERN_A2A_SUM_REPLICAS == SP_A2A_T_SUM_REPLICAS, "the descriptor's numbers are the wire's");

static uint32_t elem_size(uint32_t dtype)
{
    switch (dtype) {
    case SP_KERN_U8: return 1;
    case SP_KERN_F16:
    case SP_KERN_BF16: return 2;
    case SP_KERN_F32:
    case SP_KERN_I32: return 4;
    case SP_KERN_F64:
    case SP_KERN_I64: return 8;
    }
    return 0;
}

int sp_kern_a2a_geom(sp_kern_a2a_geom_t *g_p, const sp_kern_a2a_desc_t *d, uint32_t rank)
{
    sp_heads_plan_t pl;
    uint32_t es = elem_size(d->dtype);
    if (es == 0 || d->direction > SP_KERN_HEAD_TO_SEQ || d->layout > SP_KERN_SBHD || d->batch == 0 ||
        d->seq_len == 0 || d->head_dim == 0 || rank >= d->ranks || (d->flags & ~SP_KERN_A2A_SUM_REPLICAS) ||
        !sp_heads_plan(&pl, d->heads, d->kind, d->kv_heads, d->ranks))
        return -1;
    sp_kern_a2a_geom_t g = {
        .s2h = d->direction == SP_KERN_SEQ_TO_HEAD,
        .layout = d->layout,
        .batch = d->batch,
        .rank = rank,
        .seq_len = d->seq_len,
        .rows_local = sp_rows_local(d->seq_len, d->ranks),
        .rows_real = sp_rows_real(d->seq_len, d->ranks, rank),
        .local = pl.local,
        .per_group = pl.per_group,
        .replicas = pl.replicas,
        .replicate = pl.replicate,
        .head_dim = d->head_dim,
        .dtype = d->dtype,
        .elem_size = es,
    };
    g.sum = !g.s2h && pl.replicate && (d->flags & SP_KERN_A2A_SUM_REPLICAS);
    /* The daemon sums replicas with sp_kern_reduce, which takes no u8: refuse
     * rather than guess what such a sum would mean. */
    if (g.sum && !sp_kern_reduce_supported(d->dtype, SP_KERN_SUM))
        return -1;
    g.out_rows = g.s2h ? g.seq_len : g.rows_local;
    g.src_rows = g.s2h ? g.rows_local : g.seq_len;
    g.out_heads = g.s2h ? pl.local : pl.heads;
    g.src_heads = g.s2h ? pl.heads : pl.local;
    if (g.s2h)
        g.count = sp_heads_real(&pl, rank, &g.first);
    *g_p = g;
    return 0;
}

uint64_t sp_kern_a2a_out_bytes(const sp_kern_a2a_geom_t *g)
{
    return (uint64_t)g->batch * g->out_rows * g->out_heads * g->head_dim * g->elem_size;
}

uint64_t sp_kern_a2a_src_bytes(const sp_kern_a2a_geom_t *g)
{
    return (uint64_t)g->batch * g->src_rows * g->src_heads * g->head_dim * g->elem_size;
}

int sp_kern_a2a_host(void *dst, const void *const *src, const sp_kern_a2a_desc_t *d, uint32_t rank)
{
    sp_kern_a2a_geom_t g;
    if (sp_kern_a2a_geom(&g, d, rank) != 0)
        return -1;
    const uint64_t vec = (uint64_t)g.head_dim * g.elem_size;
    for (uint32_t b = 0; b < g.batch; b++)
        for (uint32_t s = 0; s < g.out_rows; s++)
            for (uint32_t h = 0; h < g.out_heads; h++) {
                uint8_t *out = (uint8_t *)dst + (sp_kern_row(g.layout, g.batch, g.out_rows, b, s) * g.out_heads + h) * vec;
                uint32_t r;
                uint64_t v;
                uint32_t n = sp_kern_a2a_source(&g, b, s, h, &r, &v);
                if (n == 0)
                    memset(out, 0, vec);
                else if (n == 1)
                    memcpy(out, (const uint8_t *)src[r] + v * vec, vec);
                else
                    for (uint32_t i = 0; i < g.head_dim; i++)
                        sp_kern_a2a_sum(out, src, r, n, v * vec, i, g.dtype);
            }
    return 0;
}
