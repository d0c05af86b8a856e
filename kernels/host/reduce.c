/* reduce.c — host reduction kernels. See sp_kern.h; the element operations and
 * the 16-bit conversions are in sp_kern_ops.h, shared with the CUDA kernels. */
#include "sp_kern.h"
#include "sp_kern_ops.h"

static bool redop_valid(unsigned redop)
{
    return redop == SP_KERN_SUM || redop == SP_KERN_MAX || redop == SP_KERN_MIN;
}

static bool is_16bit_float(unsigned dtype)
{
    return dtype == SP_KERN_F16 || dtype == SP_KERN_BF16;
}

bool sp_kern_reduce_supported(unsigned dtype, unsigned redop)
{
    switch (dtype) {
    case SP_KERN_F32:
    case SP_KERN_F64:
    case SP_KERN_F16:
    case SP_KERN_BF16:
    case SP_KERN_I32:
    case SP_KERN_I64:
        return redop_valid(redop);
    }
    return false;
}

unsigned sp_kern_acc_dtype(unsigned dtype)
{
    return is_16bit_float(dtype) ? SP_KERN_F32 : dtype;
}

/* acc[i] = op(acc[i], widen(src[i])). One loop per operator, so each inner loop
 * is free of the operator's branches. */
#define SP_KERN_SAME(x) (x)
#define SP_DEFINE_REDUCE(name, TA, TS, op, widen)                                            \
    static void name(TA *restrict acc, const TS *restrict src, uint64_t n, unsigned redop)  \
    {                                                                                        \
        switch (redop) {                                                                     \
        case SP_KERN_SUM:                                                                    \
            for (uint64_t i = 0; i < n; i++) acc[i] = op(acc[i], widen(src[i]), SP_KERN_SUM); \
            break;                                                                           \
        case SP_KERN_MAX:                                                                    \
            for (uint64_t i = 0; i < n; i++) acc[i] = op(acc[i], widen(src[i]), SP_KERN_MAX); \
            break;                                                                           \
        case SP_KERN_MIN:                                                                    \
            for (uint64_t i = 0; i < n; i++) acc[i] = op(acc[i], widen(src[i]), SP_KERN_MIN); \
            break;                                                                           \
        }                                                                                    \
    }

SP_DEFINE_REDUCE(reduce_f32, float, float, sp_kern_op_f32, SP_KERN_SAME)
SP_DEFINE_REDUCE(reduce_f64, double, double, sp_kern_op_f64, SP_KERN_SAME)
/* Integers as their unsigned bits: see SP_KERN_DEFINE_INT_OP. */
SP_DEFINE_REDUCE(reduce_i32, uint32_t, uint32_t, sp_kern_op_i32, SP_KERN_SAME)
SP_DEFINE_REDUCE(reduce_i64, uint64_t, uint64_t, sp_kern_op_i64, SP_KERN_SAME)
SP_DEFINE_REDUCE(reduce_widen_f16, float, uint16_t, sp_kern_op_f32, sp_kern_f16_to_f32)
SP_DEFINE_REDUCE(reduce_widen_bf16, float, uint16_t, sp_kern_op_f32, sp_kern_bf16_to_f32)

int sp_kern_reduce(void *acc, const void *src, uint64_t n, unsigned dtype, unsigned redop)
{
    if (!redop_valid(redop))
        return -1;
    switch (dtype) {
    case SP_KERN_F32: reduce_f32(acc, src, n, redop); return 0;
    case SP_KERN_F64: reduce_f64(acc, src, n, redop); return 0;
    case SP_KERN_I32: reduce_i32(acc, src, n, redop); return 0;
    case SP_KERN_I64: reduce_i64(acc, src, n, redop); return 0;
    }
    /* fp16 and bf16 too: summing in 16 bits would round once per rank. */
    return -1;
}

int sp_kern_widen(float *dst, const void *src, uint64_t n, unsigned dtype)
{
    const uint16_t *s = src;
    if (dtype == SP_KERN_F16)
        for (uint64_t i = 0; i < n; i++) dst[i] = sp_kern_f16_to_f32(s[i]);
    else if (dtype == SP_KERN_BF16)
        for (uint64_t i = 0; i < n; i++) dst[i] = sp_kern_bf16_to_f32(s[i]);
    else
        return -1;
    return 0;
}

int sp_kern_reduce_widen(float *acc, const void *src, uint64_t n, unsigned dtype, unsigned redop)
{
    if (!redop_valid(redop))
        return -1;
    if (dtype == SP_KERN_F16)
        reduce_widen_f16(acc, src, n, redop);
    else if (dtype == SP_KERN_BF16)
        reduce_widen_bf16(acc, src, n, redop);
    else
        return -1;
    return 0;
}

int sp_kern_narrow(void *dst, const float *src, uint64_t n, unsigned dtype)
{
    uint16_t *d = dst;
    if (dtype == SP_KERN_F16)
        for (uint64_t i = 0; i < n; i++) d[i] = sp_kern_f32_to_f16(src[i]);
    else if (dtype == SP_KERN_BF16)
        for (uint64_t i = 0; i < n; i++) d[i] = sp_kern_f32_to_bf16(src[i]);
    else
        return -1;
    return 0;
}
