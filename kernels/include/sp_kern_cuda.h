/*
 * sp_kern_cuda.h — launchers of the CUDA kernels (built with SP_WITH_CUDA).
 */
#ifndef SP_KERN_CUDA_H
#define SP_KERN_CUDA_H

#include <stdint.h>

#include "sp_kern.h"
#include "sp_kern_a2a.h"
#include "sp_kern_merge.h"
#include "sp_kern_seq.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Binds the CUDA runtime to the current context and loads this library's
 * kernels into it (all of them where CUDA_MODULE_LOADING=EAGER). Call it before
 * any stream of that context may hold a wait that only another process ends:
 * loading a module can synchronize the context, which would then wait for
 * that process. Returns 0 or a cudaError_t. */
int sp_kern_cuda_load(void);

/* Enqueues acc[i] = acc[i] (op) src[i], i < n, on `stream` (a cudaStream_t; NULL:
 * the default stream); device pointers. Returns 0, -1 for an unsupported type or
 * operator, or a cudaError_t from the launch. */
int sp_kern_reduce_cuda(void *acc, const void *src, uint64_t n, unsigned dtype, unsigned redop, void *stream);

/* fp16 and bf16 folded through an fp32 accumulator, the device versions of
 * sp_kern_widen, sp_kern_reduce_widen and sp_kern_narrow (same bits): -1 for
 * another type (or operator), else 0 or a cudaError_t from the launch. */
int sp_kern_widen_cuda(float *dst, const void *src, uint64_t n, unsigned dtype, void *stream);
int sp_kern_reduce_widen_cuda(float *acc, const void *src, uint64_t n, unsigned dtype, unsigned redop,
                              void *stream);
int sp_kern_narrow_cuda(void *dst, const float *src, uint64_t n, unsigned dtype, void *stream);

/* The whole all-reduce in one launch: every dst[r] (r < P) gets the rank-order
 * fold of src[0..P-1], the bits of sp_kern_reduce over them (fp16 and bf16
 * through sp_kern_widen / reduce_widen / narrow: fp32, rounded once). dst[r]
 * may be src[r]. -1 for P = 0 or P > SP_KERN_A2A_MAX_RANKS, or a type or
 * operator sp_kern_reduce_supported refuses; else 0 or a cudaError_t. */
int sp_kern_allreduce_cuda(void *const *dst, const void *const *src, uint32_t P, uint64_t n, unsigned dtype,
                           unsigned redop, void *stream);

/*
 * The launchers below enqueue on `stream` the device version of a host reference
 * (same arguments, device pointers; the sources may be peers' buffers imported
 * into this process) that writes the same bits. Each returns 0, -1 where the host
 * reference would (and for the limits each one names), or a cudaError_t from the
 * launch.
 */

/* sp_kern_a2a_host: rank `rank`'s whole output from src[q], q < P, in one launch.
 * Also -1 for P > SP_KERN_A2A_MAX_RANKS, a pointer not aligned to the element
 * size, or a head vector of 4 GiB or more. */
int sp_kern_a2a_cuda(void *dst, const void *const *src, const sp_kern_a2a_desc_t *d, uint32_t rank, void *stream);

/* sp_kern_shift_host: n bytes of src, or zeros when src is NULL. */
int sp_kern_shift_cuda(void *dst, const void *src, uint64_t n, void *stream);

/* sp_kern_zigzag_host. Also -1 for rows of 4 GiB or more. */
int sp_kern_zigzag_cuda(void *dst, const void *src, const sp_kern_zigzag_t *z, void *stream);

/* sp_kern_pad_host. Also -1 for head vectors of 4 GiB or more. */
int sp_kern_pad_cuda(void *dst, const void *src, const sp_kern_pad_t *p, void *stream);

/* sp_kern_lse_merge_host, in place allowed as there. */
int sp_kern_lse_merge_cuda(float *out, float *lse, const float *out_a, const float *lse_a, const float *out_b,
                           const float *lse_b, const sp_kern_lse_merge_t *m, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* SP_KERN_CUDA_H */
