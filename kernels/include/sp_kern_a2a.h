/*
 * sp_kern_a2a.h — the index math of the fused Ulysses all-to-all, written once for
 * the host reference (kernels/host/a2a.c) and the CUDA kernel (kernels/cuda/a2a.cu).
 *
 * The kernel writes one destination rank's whole output of one tensor, reading the
 * P ranks' inputs (on a GPU: peers' imported buffers). Every destination head
 * vector (the head_dim elements of one head of one row, contiguous in both
 * layouts) is a copy of one source head vector, zeros, or the sum of replicas:
 *
 *   seq->head  output [B, S, L, D] of holder q from the owners' [B, S_loc, H, D]:
 *              global row s comes from owner s / S_loc, its row s mod S_loc;
 *              local head j < count is source head first + j, the rest are dummy
 *              heads (zeros); the owners' padding rows are never read.
 *   head->seq  output [B, S_loc, H, D] of owner o from the holders' [B, S, L, D]:
 *              row s < rows_real(o) is global row o S_loc + s; head h is local
 *              head j of its first holder, or with SUM_REPLICAS the sum of the
 *              r replicas' copies in rank order; padding rows are zeros.
 *
 * The way heads are dealt (dummy heads, GQA groups, KV replication) and rows are
 * split is proto/sp_ulysses.h's, the daemon's own rule: sp_kern_a2a_geom (host
 * code, kernels/host/a2a.c) evaluates it into the plain sp_kern_a2a_geom_t below,
 * which the device takes by value. The semantics are those of daemon/core/exec.c's
 * run_a2a; tests/unit/test_kern_a2a.c checks the two against each other.
 */
#ifndef SP_KERN_A2A_H
#define SP_KERN_A2A_H

#include "sp_kern_ops.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The numbers of proto/sp_shm.h's sp_a2a_direction, sp_layout, sp_heads_kind and
 * SP_A2A_T_SUM_REPLICAS; kernels/host/a2a.c checks that they agree. */
enum sp_kern_a2a_direction {
    SP_KERN_SEQ_TO_HEAD = 0,
    SP_KERN_HEAD_TO_SEQ = 1,
};

enum sp_kern_layout {
    SP_KERN_BSHD = 0,   /* batch first: row (b, s) is b S + s */
    SP_KERN_SBHD = 1,   /* sequence first: row (b, s) is s B + b */
};

enum sp_kern_heads_kind {
    SP_KERN_HEADS_Q  = 0,
    SP_KERN_HEADS_KV = 1,
};

#define SP_KERN_A2A_SUM_REPLICAS 1u

/* Most ranks one launch of the CUDA kernel reads from: their pointers travel in
 * the launch's parameters. */
#define SP_KERN_A2A_MAX_RANKS 64u

/* One tensor of one all-to-all, as every rank describes it. */
typedef struct sp_kern_a2a_desc {
    uint32_t direction;   /* enum sp_kern_a2a_direction */
    uint32_t layout;      /* enum sp_kern_layout */
    uint32_t batch;       /* B */
    uint32_t seq_len;     /* S: the true global sequence length */
    uint32_t heads;       /* H, without dummies */
    uint32_t head_dim;    /* D */
    uint32_t kind;        /* enum sp_kern_heads_kind */
    uint32_t kv_heads;    /* query heads' groups (GQA); 0: as many as heads */
    uint32_t ranks;       /* P */
    uint32_t dtype;       /* enum sp_kern_dtype */
    uint32_t flags;       /* SP_KERN_A2A_SUM_REPLICAS */
} sp_kern_a2a_desc_t;

/* What one destination rank's output needs, plain numbers (see sp_kern_a2a_geom). */
typedef struct sp_kern_a2a_geom {
    uint32_t s2h;         /* direction is seq->head */
    uint32_t layout, batch, rank;
    uint32_t seq_len;     /* S */
    uint32_t rows_local;  /* S_loc = ceil(S / P) */
    uint32_t out_rows;    /* rows per batch entry of the output: S (seq->head) or S_loc */
    uint32_t src_rows;    /* likewise of every source: S_loc or S */
    uint32_t rows_real;   /* head->seq: the output's real rows; the rest is padding */
    uint32_t out_heads;   /* heads per row of the output: L or H */
    uint32_t src_heads;   /* likewise of every source: H or L */
    uint32_t first, count;/* seq->head: the output's real heads are source heads [first, first + count) */
    uint32_t local;       /* L: heads a holder holds, dummies included */
    uint32_t per_group;   /* g: heads per group */
    uint32_t replicas;    /* r: ranks sharing a group (1: none) */
    uint32_t replicate;   /* key/value heads copied to r ranks */
    uint32_t sum;         /* head->seq: replicas summed (else the first copy taken) */
    uint32_t head_dim, dtype, elem_size;
} sp_kern_a2a_geom_t;

/*
 * Fills *g_p for rank `rank`'s output of the tensor `d` describes. Returns 0, or -1
 * when the descriptor is invalid (the heads cannot be dealt to the ranks, an
 * unknown type, direction or layout, a zero size, rank >= P) or asks what the
 * kernels do not do: summing replicas of a type sp_kern_reduce cannot sum (u8).
 */
int sp_kern_a2a_geom(sp_kern_a2a_geom_t *g_p, const sp_kern_a2a_desc_t *d, uint32_t rank);

/* Bytes of the output of g's rank, and of each rank's input. */
uint64_t sp_kern_a2a_out_bytes(const sp_kern_a2a_geom_t *g);
uint64_t sp_kern_a2a_src_bytes(const sp_kern_a2a_geom_t *g);

/*
 * The host reference: writes rank `rank`'s output of the tensor `d` describes into
 * dst, reading src[q], rank q's input, for q < P (every source a rank's whole
 * tensor, laid out as the descriptor says). Returns 0, or -1 as sp_kern_a2a_geom.
 */
int sp_kern_a2a_host(void *dst, const void *const *src, const sp_kern_a2a_desc_t *d, uint32_t rank);

#ifdef __cplusplus
}
#endif

/* Row (b, s) of a tensor with `rows` rows per batch entry. */
SP_KERN_HD uint64_t sp_kern_row(uint32_t layout, uint32_t batch, uint32_t rows, uint32_t b, uint32_t s)
{
    return layout == SP_KERN_BSHD ? (uint64_t)b * rows + s : (uint64_t)s * batch + b;
}

/*
 * Where head `head` of row (b, s) of g's output comes from. Returns how many
 * copies make it: 0, zeros (a dummy head or a padding row); 1, a copy of head
 * vector *vec_p (in units of head_dim elements) of rank *rank_p's input; n > 1,
 * the sum in rank order of that head vector of ranks *rank_p .. *rank_p + n - 1
 * (the replicas hold it at the same place). The outputs are set when it is not 0.
 */
SP_KERN_HD uint32_t sp_kern_a2a_source(const sp_kern_a2a_geom_t *g, uint32_t b, uint32_t s, uint32_t head,
                                       uint32_t *rank_p, uint64_t *vec_p)
{
    if (g->s2h) {
        if (head >= g->count)
            return 0;
        uint32_t owner = s / g->rows_local, row = s - owner * g->rows_local;
        *rank_p = owner;
        *vec_p = sp_kern_row(g->layout, g->batch, g->rows_local, b, row) * g->src_heads + g->first + head;
        return 1;
    }
    if (s >= g->rows_real)
        return 0;
    uint64_t src_row = sp_kern_row(g->layout, g->batch, g->seq_len, b, g->rank * g->rows_local + s);
    uint32_t holder, j;
    if (g->replicas == 1) {
        /* Groups padded to a multiple of P: holder p holds padded heads [p L, (p + 1) L). */
        holder = head / g->local;
        j = head - holder * g->local;
    } else if (g->replicate) {
        /* Key/value head h copied to ranks h r .. h r + r - 1, as their one head. */
        *rank_p = head * g->replicas;
        *vec_p = src_row * g->src_heads;
        return g->sum ? g->replicas : 1;
    } else {
        /* A query group's g heads split over its r ranks, L each. */
        uint32_t group = head / g->per_group, within = head - group * g->per_group, slice = within / g->local;
        holder = group * g->replicas + slice;
        j = within - slice * g->local;
    }
    *rank_p = holder;
    *vec_p = src_row * g->src_heads + j;
    return 1;
}

/*
 * Element i of the sum of n replicas (n >= 2) whose head vectors start at byte
 * `off` of src[r0], ..., src[r0 + n - 1], in rank order, written to out: the
 * operations of sp_kern_reduce, and for fp16 and bf16 those of sp_kern_widen,
 * sp_kern_reduce_widen and sp_kern_narrow (fp32 accumulation, rounded once).
 */
SP_KERN_HD void sp_kern_a2a_sum(void *out, const void *const *src, uint32_t r0, uint32_t n, uint64_t off,
                                uint64_t i, uint32_t dtype)
{
#define SP_KERN_AT(T, k) (((const T *)((const uint8_t *)src[r0 + (k)] + off))[i])
    switch (dtype) {
    case SP_KERN_F32: {
        float acc = SP_KERN_AT(float, 0);
        for (uint32_t k = 1; k < n; k++) acc = sp_kern_op_f32(acc, SP_KERN_AT(float, k), SP_KERN_SUM);
        ((float *)out)[i] = acc;
        return;
    }
    case SP_KERN_F64: {
        double acc = SP_KERN_AT(double, 0);
        for (uint32_t k = 1; k < n; k++) acc = sp_kern_op_f64(acc, SP_KERN_AT(double, k), SP_KERN_SUM);
        ((double *)out)[i] = acc;
        return;
    }
    case SP_KERN_I32: {
        uint32_t acc = SP_KERN_AT(uint32_t, 0);
        for (uint32_t k = 1; k < n; k++) acc = sp_kern_op_i32(acc, SP_KERN_AT(uint32_t, k), SP_KERN_SUM);
        ((uint32_t *)out)[i] = acc;
        return;
    }
    case SP_KERN_I64: {
        uint64_t acc = SP_KERN_AT(uint64_t, 0);
        for (uint32_t k = 1; k < n; k++) acc = sp_kern_op_i64(acc, SP_KERN_AT(uint64_t, k), SP_KERN_SUM);
        ((uint64_t *)out)[i] = acc;
        return;
    }
    case SP_KERN_F16: {
        float acc = sp_kern_f16_to_f32(SP_KERN_AT(uint16_t, 0));
        for (uint32_t k = 1; k < n; k++)
            acc = sp_kern_op_f32(acc, sp_kern_f16_to_f32(SP_KERN_AT(uint16_t, k)), SP_KERN_SUM);
        ((uint16_t *)out)[i] = sp_kern_f32_to_f16(acc);
        return;
    }
    case SP_KERN_BF16: {
        float acc = sp_kern_bf16_to_f32(SP_KERN_AT(uint16_t, 0));
        for (uint32_t k = 1; k < n; k++)
            acc = sp_kern_op_f32(acc, sp_kern_bf16_to_f32(SP_KERN_AT(uint16_t, k)), SP_KERN_SUM);
        ((uint16_t *)out)[i] = sp_kern_f32_to_bf16(acc);
        return;
    }
    }
#undef SP_KERN_AT
}

#endif /* SP_KERN_A2A_H */
