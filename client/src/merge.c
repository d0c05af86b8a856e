/*
 * merge.c — spc_lse_merge, the out/LSE merge of ring attention, for the
 * application: the host reference of kernels/host/merge.c on host memory, the
 * kernel of kernels/cuda/merge.cu on device memory (same bits, see
 * sp_kern_merge.h). No handle, no daemon.
 *
 * The CUDA kernel comes with the CUDA runtime, linked statically (as the daemon
 * links it): the runtime loads the driver itself on its first call, so an
 * application without a GPU links and loads this library as before, and only a
 * merge of device memory ever calls it.
 */
#include "internal.h"

#include "sp_kern_merge.h"
#ifdef SPC_WITH_CUDA
#include <cuda_runtime_api.h>

#include "sp_kern_cuda.h"
#endif

/* Checks what the kernels cannot: each array's bytes fit in size_t. */
static spc_status_t merge_check(const spc_lse_merge_desc_t *d)
{
    uint64_t rows, elems;
    if (d->memory > SPC_MEMORY_CUDA)
        return spc__fail(NULL, SPC_ERR_INVALID_ARG, "spc_lse_merge: memory %u is neither host nor CUDA", d->memory);
    if (d->layout > SPC_LAYOUT_SBHD)
        return spc__fail(NULL, SPC_ERR_INVALID_ARG, "spc_lse_merge: layout %u is neither BSHD nor SBHD", d->layout);
    if (d->batch == 0 || d->seq_len == 0 || d->heads == 0 || d->head_dim == 0)
        return spc__fail(NULL, SPC_ERR_INVALID_ARG, "spc_lse_merge: a size is 0 (B %u, S %u, H %u, D %u)", d->batch,
                         d->seq_len, d->heads, d->head_dim);
    if (d->out == NULL || d->lse == NULL || d->out_a == NULL || d->lse_a == NULL || d->out_b == NULL
        || d->lse_b == NULL)
        return spc__fail(NULL, SPC_ERR_INVALID_ARG, "spc_lse_merge: an array is NULL");
    if (__builtin_mul_overflow((uint64_t)d->batch * d->seq_len, d->heads, &rows)
        || __builtin_mul_overflow(rows, d->head_dim, &elems) || elems > SIZE_MAX / sizeof(float))
        return spc__fail(NULL, SPC_ERR_INVALID_ARG, "spc_lse_merge: B x S x H x D (%u x %u x %u x %u) fp32 exceeds "
                         "the address space", d->batch, d->seq_len, d->heads, d->head_dim);
    return SPC_OK;
}

static spc_status_t merge_cuda(const spc_lse_merge_desc_t *d, const sp_kern_lse_merge_t *m)
{
#ifdef SPC_WITH_CUDA
    int rc = sp_kern_lse_merge_cuda(d->out, d->lse, d->out_a, d->lse_a, d->out_b, d->lse_b, m, d->cu_stream);
    if (rc == 0)
        return SPC_OK;
    cudaError_t e = (cudaError_t)rc;
    bool no_gpu = e == cudaErrorNoDevice || e == cudaErrorInsufficientDriver || e == cudaErrorInitializationError;
    return spc__fail(NULL, no_gpu ? SPC_ERR_NO_DEVICE : SPC_ERR_DEVICE, "spc_lse_merge: the kernel's launch: %s (%s)",
                     cudaGetErrorString(e), cudaGetErrorName(e));
#else
    (void)m;
    return spc__fail(NULL, SPC_ERR_NO_DEVICE, "spc_lse_merge: device memory, but this libspclient was built without "
                     "CUDA (SP_WITH_CUDA=OFF); merge host memory, or build with the CUDA toolkit");
#endif
}

spc_status_t spc_lse_merge(const spc_lse_merge_desc_t *desc)
{
    spc_lse_merge_desc_t d;
    spc_status_t st = spc__struct_read(NULL, spc_lse_merge_desc_t, desc, cu_stream, &d);
    if (st != SPC_OK || (st = merge_check(&d)) != SPC_OK)
        return st;
    sp_kern_lse_merge_t m = { .layout = d.layout == SPC_LAYOUT_BSHD ? SP_KERN_BSHD : SP_KERN_SBHD,
                              .batch = d.batch, .seq_len = d.seq_len, .heads = d.heads, .head_dim = d.head_dim };
    if (d.memory == SPC_MEMORY_CUDA)
        return merge_cuda(&d, &m);
    /* merge_check took every case the reference refuses. */
    (void)sp_kern_lse_merge_host(d.out, d.lse, d.out_a, d.lse_a, d.out_b, d.lse_b, &m);
    return SPC_OK;
}
