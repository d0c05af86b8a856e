/*
 * sp_kern_cuda.h — launchers of the CUDA kernels (built with SP_WITH_CUDA).
 */
#ifndef SP_KERN_CUDA_H
#define SP_KERN_CUDA_H

#include <stdint.h>

#include "sp_kern.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Enqueues acc[i] = acc[i] (op) src[i], i < n, on `stream` (a cudaStream_t; NULL:
 * the default stream); device pointers. Returns 0, -1 for an unsupported type or
 * operator, or a cudaError_t from the launch. */
int sp_kern_reduce_cuda(void *acc, const void *src, uint64_t n, unsigned dtype, unsigned redop, void *stream);

#ifdef __cplusplus
}
#endif
#endif /* SP_KERN_CUDA_H */
