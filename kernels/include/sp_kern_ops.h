/*
 * sp_kern_ops.h — the element operations of the reduction kernels, written once
 * for the host (kernels/host) and the device (kernels/cuda), so both compute the
 * same bits.
 */
#ifndef SP_KERN_OPS_H
#define SP_KERN_OPS_H

#include <stdint.h>
#include <string.h>

#include "sp_kern.h"

#ifdef __CUDACC__
#define SP_KERN_HD __host__ __device__ __forceinline__
#else
#define SP_KERN_HD static inline
#endif

/*
 * NaNs, for every operator: a NaN operand wins, the left one first, its bits
 * kept; a sum that makes a NaN (inf - inf) gives the canonical quiet NaN. The
 * hardware would not agree with itself here: x86 keeps the first NaN operand
 * and makes inf - inf negative, a GPU returns one canonical NaN for both.
 */
#define SP_KERN_DEFINE_OP(T, U, suffix, qnan)                                     \
    SP_KERN_HD T sp_kern_op_##suffix(T a, T b, unsigned redop)                    \
    {                                                                             \
        if (a != a)                                                               \
            return a;                                                             \
        if (b != b)                                                               \
            return b;                                                             \
        if (redop == SP_KERN_SUM) {                                               \
            T r = a + b;                                                          \
            if (r == r)                                                           \
                return r;                                                         \
            U bits = (qnan);                                                      \
            memcpy(&r, &bits, sizeof r);                                          \
            return r;                                                             \
        }                                                                         \
        if (redop == SP_KERN_MAX)                                                 \
            return a > b ? a : b;                                                 \
        return a < b ? a : b;                                                     \
    }

SP_KERN_DEFINE_OP(float, uint32_t, f32, 0x7fc00000u)
SP_KERN_DEFINE_OP(double, uint64_t, f64, 0x7ff8000000000000ull)

/*
 * Integer operations work on the two's complement bits in the unsigned type of the
 * same width: there a sum wraps modulo 2^bits by definition, where a signed
 * overflow would be undefined behaviour. Flipping the sign bit maps signed order
 * onto unsigned order, so max and min need no conversion back to signed.
 */
#define SP_KERN_DEFINE_INT_OP(U, sign_bit, suffix)                                \
    SP_KERN_HD U sp_kern_op_##suffix(U a, U b, unsigned redop)                    \
    {                                                                             \
        if (redop == SP_KERN_SUM)                                                 \
            return a + b;                                                         \
        int a_greater = (U)(a ^ (sign_bit)) > (U)(b ^ (sign_bit));                \
        if (redop == SP_KERN_MAX)                                                 \
            return a_greater ? a : b;                                             \
        return a_greater ? b : a;                                                 \
    }

SP_KERN_DEFINE_INT_OP(uint32_t, 0x80000000u, i32)
SP_KERN_DEFINE_INT_OP(uint64_t, 0x8000000000000000ull, i64)

/*
 * fp16 and bf16 <-> fp32, on bit patterns, with integer operations only: the
 * host compiler may have no 16-bit float type, and the host and device must agree
 * on every bit, rounding and NaNs included. Narrowing rounds to nearest, ties to
 * even, and makes a NaN quiet (keeping the top of its payload).
 */
SP_KERN_HD uint32_t sp_kern_f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

SP_KERN_HD float sp_kern_f32_from_bits(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

SP_KERN_HD float sp_kern_f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1f)        /* inf or NaN: the payload moves up with the mantissa */
        return sp_kern_f32_from_bits(sign | 0x7f800000u | man << 13);
    if (exp != 0)           /* normal: rebias the exponent from 15 to 127 */
        return sp_kern_f32_from_bits(sign | (exp + 112) << 23 | man << 13);
    if (man == 0)
        return sp_kern_f32_from_bits(sign);
    /* Subnormal, man * 2^-24: normal in fp32. Shift the leading 1 up to the
     * implicit bit's place (bit 10), lowering the exponent once per shift. */
    exp = 113;
    while (!(man & 0x400u)) {
        man <<= 1;
        exp--;
    }
    return sp_kern_f32_from_bits(sign | exp << 23 | (man & 0x3ffu) << 13);
}

/* Drops the low `shift` bits of m (1 <= shift <= 24), rounding to nearest, ties
 * to even. A carry out of the kept mantissa lands in the exponent, which is what
 * rounding up to the next binade (or to infinity) needs. */
SP_KERN_HD uint32_t sp_kern_round_shift(uint32_t m, unsigned shift)
{
    uint32_t kept = m >> shift, rest = m & ((1u << shift) - 1), half = 1u << (shift - 1);
    return kept + (rest > half || (rest == half && (kept & 1)));
}

SP_KERN_HD uint16_t sp_kern_f32_to_f16(float f)
{
    uint32_t u = sp_kern_f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u, exp = (u >> 23) & 0xffu, man = u & 0x7fffffu;
    if (exp == 0xff)        /* inf stays inf; NaN gets the quiet bit */
        return (uint16_t)(sign | 0x7c00u | (man ? 0x200u | man >> 13 : 0));
    if (exp > 142)          /* 2^16 and up: past fp16's largest finite value */
        return (uint16_t)(sign | 0x7c00u);
    if (exp >= 113)         /* normal in fp16: rebias, round off 13 bits */
        return (uint16_t)(sign | sp_kern_round_shift((exp - 112) << 23 | man, 13));
    if (exp < 102)          /* below 2^-25, half the smallest subnormal: zero */
        return (uint16_t)sign;
    /* Subnormal in fp16, in units of 2^-24: the 24-bit significand shifted right
     * by 126 - exp (14 to 24 bits). Rounding up to 0x400 gives the smallest normal. */
    return (uint16_t)(sign | sp_kern_round_shift(man | 0x800000u, 126 - exp));
}

SP_KERN_HD float sp_kern_bf16_to_f32(uint16_t h)
{
    return sp_kern_f32_from_bits((uint32_t)h << 16);
}

SP_KERN_HD uint16_t sp_kern_f32_to_bf16(float f)
{
    uint32_t u = sp_kern_f32_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)    /* NaN: keep the top payload, set quiet */
        return (uint16_t)(u >> 16 | 0x40u);
    /* bf16 is fp32's top half, so the sign, exponent and subnormals need no care;
     * the largest finite values round up into the infinity pattern. */
    return (uint16_t)((u >> 16 & 0x8000u) | sp_kern_round_shift(u & 0x7fffffffu, 16));
}

#endif /* SP_KERN_OPS_H */
