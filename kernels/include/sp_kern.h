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

/*
 * Whether this layer can reduce the type with the operator: sum, max and min over
 * fp32, fp64, fp16, bf16, int32 and int64. Types whose accumulator type
 * (sp_kern_acc_dtype) is themselves go through sp_kern_reduce; fp16 and bf16 go
 * through an fp32 accumulator: sp_kern_widen the first operand,
 * sp_kern_reduce_widen each further one, sp_kern_narrow the result.
 */
bool sp_kern_reduce_supported(unsigned dtype, unsigned redop);

/*
 * acc[i] = acc[i] (op) src[i] for i < n. Element-wise, no reassociation: a caller
 * that folds ranks in rank order gets the same bits on every run. max and min
 * propagate NaN. Integer sums wrap modulo 2^32 or 2^64. Returns 0, or -1 when the
 * type or operator is unsupported, and for fp16 and bf16, which accumulate in fp32
 * (see sp_kern_reduce_widen).
 */
int sp_kern_reduce(void *acc, const void *src, uint64_t n, unsigned dtype, unsigned redop);

/*
 * The type a reduction over dtype accumulates in: SP_KERN_F32 for fp16 and bf16,
 * so that a fold over many ranks rounds to 16 bits once, at the end, rather than
 * once per rank; dtype itself for every other type.
 */
unsigned sp_kern_acc_dtype(unsigned dtype);

/*
 * dst[i] = (float)src[i] for i < n, src holding fp16 or bf16 (dtype says which).
 * Exact: every fp16 and bf16 value, NaN payloads included, is an fp32 value.
 * Returns 0, or -1 when dtype is not SP_KERN_F16 or SP_KERN_BF16.
 */
int sp_kern_widen(float *dst, const void *src, uint64_t n, unsigned dtype);

/*
 * acc[i] = acc[i] (op) (float)src[i] for i < n, src holding fp16 or bf16: the
 * fp32 operation of sp_kern_reduce (same rounding, same NaN rules) on the widened
 * value. Returns 0, or -1 when dtype is not SP_KERN_F16 or SP_KERN_BF16 or the
 * operator is unsupported.
 */
int sp_kern_reduce_widen(float *acc, const void *src, uint64_t n, unsigned dtype, unsigned redop);

/*
 * dst[i] = src[i] rounded to fp16 or bf16 (dtype says which), to nearest, ties to
 * even, for i < n. A NaN stays a NaN, made quiet; a value that rounds past the
 * largest finite value becomes infinity; results below the smallest normal are
 * correctly rounded subnormals. Returns 0, or -1 when dtype is not SP_KERN_F16
 * or SP_KERN_BF16.
 */
int sp_kern_narrow(void *dst, const float *src, uint64_t n, unsigned dtype);

/*
 * memcpy with streaming (non-temporal) stores: the destination is not read into
 * the cache first and does not evict it. For copies larger than the cache, whose
 * destination will not be read before it would have been evicted anyway, this
 * saves the read of every destination line. The stores are weakly ordered: call
 * sp_kern_copy_fence before telling another thread the data is there.
 * Elsewhere than x86-64, plain memcpy.
 */
void sp_kern_copy_stream(void *dst, const void *src, size_t n);
void sp_kern_copy_fence(void);

#ifdef __cplusplus
}
#endif
#endif /* SP_KERN_H */
