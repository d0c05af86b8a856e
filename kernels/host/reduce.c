/* reduce.c — host reduction kernels. See sp_kern.h; the element operations are
 * in sp_kern_ops.h, shared with the CUDA kernels. */
#include "sp_kern.h"
#include "sp_kern_ops.h"

bool sp_kern_reduce_supported(unsigned dtype, unsigned redop)
{
    return (dtype == SP_KERN_F32 || dtype == SP_KERN_F64) &&
           (redop == SP_KERN_SUM || redop == SP_KERN_MAX || redop == SP_KERN_MIN);
}

/* One loop per operator, so each inner loop is branch-free and vectorises. */
#define SP_DEFINE_REDUCE(T, suffix)                                                         \
    static void reduce_##suffix(T *restrict acc, const T *restrict src, uint64_t n,        \
                                unsigned redop)                                             \
    {                                                                                       \
        switch (redop) {                                                                    \
        case SP_KERN_SUM:                                                                   \
            for (uint64_t i = 0; i < n; i++) acc[i] = sp_kern_op_##suffix(acc[i], src[i], SP_KERN_SUM); \
            break;                                                                          \
        case SP_KERN_MAX:                                                                   \
            for (uint64_t i = 0; i < n; i++) acc[i] = sp_kern_op_##suffix(acc[i], src[i], SP_KERN_MAX); \
            break;                                                                          \
        case SP_KERN_MIN:                                                                   \
            for (uint64_t i = 0; i < n; i++) acc[i] = sp_kern_op_##suffix(acc[i], src[i], SP_KERN_MIN); \
            break;                                                                          \
        }                                                                                   \
    }

SP_DEFINE_REDUCE(float, f32)
SP_DEFINE_REDUCE(double, f64)

int sp_kern_reduce(void *acc, const void *src, uint64_t n, unsigned dtype, unsigned redop)
{
    if (!sp_kern_reduce_supported(dtype, redop))
        return -1;
    if (dtype == SP_KERN_F32)
        reduce_f32(acc, src, n, redop);
    else
        reduce_f64(acc, src, n, redop);
    return 0;
}
