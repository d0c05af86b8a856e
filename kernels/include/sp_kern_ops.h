/*
 * sp_kern_ops.h — the element operations of the reduction kernels, written once
 * for the host (kernels/host) and the device (kernels/cuda), so both compute the
 * same bits.
 */
#ifndef SP_KERN_OPS_H
#define SP_KERN_OPS_H

#include "sp_kern.h"

#ifdef __CUDACC__
#define SP_KERN_HD __host__ __device__ __forceinline__
#else
#define SP_KERN_HD static inline
#endif

/* max and min propagate NaN: a NaN on either side wins (the left one first). */
#define SP_KERN_DEFINE_OP(T, suffix)                                              \
    SP_KERN_HD T sp_kern_op_##suffix(T a, T b, unsigned redop)                    \
    {                                                                             \
        if (redop == SP_KERN_SUM)                                                 \
            return a + b;                                                         \
        if (a != a)                                                               \
            return a;                                                             \
        if (b != b)                                                               \
            return b;                                                             \
        if (redop == SP_KERN_MAX)                                                 \
            return a > b ? a : b;                                                 \
        return a < b ? a : b;                                                     \
    }

SP_KERN_DEFINE_OP(float, f32)
SP_KERN_DEFINE_OP(double, f64)

#endif /* SP_KERN_OPS_H */
