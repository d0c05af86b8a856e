/*
 * sp_kern_cases.h — all-to-all tensors for the kernel tests (tests/unit/test_kern_a2a.c
 * against the daemon's loop, tests/gpu/test_kernels_gpu.c device against host):
 * those of tests/integration/test_alltoall.c, one tensor each. Dummy heads (3 on
 * 2 ranks, 5 on 3, 7 on 4, 28 on 8, inside GQA groups), GQA, MQA, replicated KV
 * heads with and without summed replicas, padding rows (a rank with padding
 * only), both layouts, every element size, P = 2, 3, 4 and 8.
 */
#ifndef SP_KERN_CASES_H
#define SP_KERN_CASES_H

#include "sp_kern_a2a.h"

typedef struct sp_kern_case {
    const char *name;
    uint32_t    ranks, dtype, layout, batch, seq_len, kv_heads, heads, head_dim, kind, flags;
} sp_kern_case_t;

#define Q_  SP_KERN_HEADS_Q, 0
#define KV_ SP_KERN_HEADS_KV, 0
#define KVS SP_KERN_HEADS_KV, SP_KERN_A2A_SUM_REPLICAS
#define BSHD SP_KERN_BSHD
#define SBHD SP_KERN_SBHD

static const sp_kern_case_t sp_kern_cases[] = {
    /* name                    P  dtype         layout B  S    kv  H   D    kind */
    { "S=7 q fp32",            2, SP_KERN_F32,  BSHD, 2, 7,    0, 4,  8,   Q_ },
    { "S=7 kv-sum fp32",       2, SP_KERN_F32,  BSHD, 2, 7,    0, 4,  4,   KVS },
    { "3 heads fp64",          2, SP_KERN_F64,  SBHD, 3, 10,   0, 3,  5,   Q_ },
    { "MQA 6q/1kv fp16 q",     2, SP_KERN_F16,  BSHD, 1, 12,   1, 6,  8,   Q_ },
    { "MQA 1kv-sum fp16",      2, SP_KERN_F16,  BSHD, 1, 12,   1, 1,  8,   KVS },
    { "GQA 4q/2kv bf16 q",     2, SP_KERN_BF16, SBHD, 2, 5,    2, 4,  4,   Q_ },
    { "GQA 2kv-sum bf16",      2, SP_KERN_BF16, SBHD, 2, 5,    2, 2,  2,   KVS },
    { "GQA 12q/3kv fp32",      3, SP_KERN_F32,  BSHD, 2, 20,   3, 12, 8,   Q_ },
    { "5 heads bf16",          3, SP_KERN_BF16, SBHD, 2, 5,    0, 5,  6,   Q_ },
    { "1 kv-sum bf16",         3, SP_KERN_BF16, SBHD, 2, 5,    0, 1,  6,   KVS },
    { "S=4 fp64 kv",           3, SP_KERN_F64,  BSHD, 1, 4,    0, 3,  4,   KV_ },
    { "7 heads fp64",          4, SP_KERN_F64,  BSHD, 2, 13,   0, 7,  8,   Q_ },
    { "GQA 8q/2kv fp32 q",     4, SP_KERN_F32,  SBHD, 2, 16,   2, 8,  8,   Q_ },
    { "GQA 2kv-sum fp32",      4, SP_KERN_F32,  SBHD, 2, 16,   2, 2,  16,  KVS },
    { "GQA 6q/2kv fp16 q",     4, SP_KERN_F16,  BSHD, 1, 11,   2, 6,  4,   Q_ },
    { "GQA 2kv fp16",          4, SP_KERN_F16,  BSHD, 1, 11,   2, 2,  4,   KV_ },
    { "4 heads bf16",          4, SP_KERN_BF16, BSHD, 2, 17,   0, 4,  8,   Q_ },
    { "large GQA 2kv-sum fp32",4, SP_KERN_F32,  BSHD, 2, 1001, 2, 2,  64,  KVS },
    { "28 heads fp32",         8, SP_KERN_F32,  BSHD, 2, 37,   0, 28, 8,   Q_ },
    { "GQA 16q/2kv bf16 q",    8, SP_KERN_BF16, SBHD, 2, 24,   2, 16, 8,   Q_ },
    { "GQA 2kv-sum bf16",      8, SP_KERN_BF16, SBHD, 2, 24,   2, 2,  8,   KVS },
    { "GQA 28q/4kv fp16 q",    8, SP_KERN_F16,  BSHD, 1, 50,   4, 28, 8,   Q_ },
    { "GQA 4kv-sum fp16",      8, SP_KERN_F16,  BSHD, 1, 50,   4, 4,  16,  KVS },
    { "GQA 4kv-sum fp64",      8, SP_KERN_F64,  SBHD, 2, 19,   4, 4,  4,   KVS },
    { "MQA 8q/1kv fp32 S=8",   8, SP_KERN_F32,  BSHD, 1, 8,    1, 8,  4,   Q_ },
    { "MQA 1kv-sum fp32 S=8",  8, SP_KERN_F32,  BSHD, 1, 8,    1, 1,  4,   KVS },
    { "large 16q/2kv bf16",    8, SP_KERN_BF16, SBHD, 2, 515,  2, 16, 128, Q_ },
    { "large 2kv-sum bf16",    8, SP_KERN_BF16, SBHD, 2, 515,  2, 2,  128, KVS },
    { "int32 kv-sum",          4, SP_KERN_I32,  BSHD, 1, 9,    0, 1,  3,   KVS },
    { "int64 3 heads",         2, SP_KERN_I64,  SBHD, 2, 5,    0, 3,  2,   Q_ },
    { "u8 5 heads",            4, SP_KERN_U8,   BSHD, 1, 10,   0, 5,  7,   Q_ },
};
#define SP_KERN_NCASES (sizeof sp_kern_cases / sizeof sp_kern_cases[0])

#undef Q_
#undef KV_
#undef KVS
#undef BSHD
#undef SBHD

static inline sp_kern_a2a_desc_t sp_kern_case_desc(const sp_kern_case_t *c, uint32_t direction)
{
    sp_kern_a2a_desc_t d = { direction, c->layout, c->batch, c->seq_len, c->heads, c->head_dim,
                             c->kind, c->kv_heads, c->ranks, c->dtype, c->flags };
    return d;
}

/* splitmix64: deterministic, so a failure reproduces. */
static inline uint64_t sp_kern_rng(uint64_t *state)
{
    uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* n random bytes: every bit pattern, NaNs and infinities of every type included. */
static inline void sp_kern_fill(void *p, uint64_t n, uint64_t *state)
{
    uint8_t *b = (uint8_t *)p;
    for (uint64_t i = 0; i < n; i += 8) {
        uint64_t x = sp_kern_rng(state);
        for (uint64_t k = 0; k < 8 && i + k < n; k++)
            b[i + k] = (uint8_t)(x >> (8 * k));
    }
}

#endif /* SP_KERN_CASES_H */
