/*
 * sp_kern.h — data-movement and reduction kernels.
 *
 * This layer depends on nothing else in spd: the element types and reduction
 * operators are its own enums (the wire protocol uses the same numbers, which the
 * daemon checks at compile time). Host implementations live in kernels/host; CUDA
 * ones in kernels/cuda share the index math written here.
 */
#ifndef SP_KERN_H
#define SP_KERN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum sp_kern_dtype {
    SP_KERN_F32  = 1,
    SP_KERN_F64  = 2,
    SP_KERN_F16  = 3,
    SP_KERN_BF16 = 4,
    SP_KERN_I32  = 5,
    SP_KERN_I64  = 6,
    SP_KERN_U8   = 7,
};

enum sp_kern_redop {
    SP_KERN_SUM = 0,
    SP_KERN_MAX = 1,
    SP_KERN_MIN = 2,
};

/* Whether sp_kern_reduce handles this type and operator. */
bool sp_kern_reduce_supported(unsigned dtype, unsigned redop);

/*
 * acc[i] = acc[i] (op) src[i] for i < n. Element-wise, no reassociation: a caller
 * that folds ranks in rank order gets the same bits on every run. max and min
 * propagate NaN. Returns 0, or -1 when the type or operator is unsupported.
 */
int sp_kern_reduce(void *acc, const void *src, uint64_t n, unsigned dtype, unsigned redop);

#ifdef __cplusplus
}
#endif
#endif /* SP_KERN_H */
