/*
 * load.cu — the kernels put into a context before any of them is launched.
 */
#include <cuda_runtime.h>

#include "sp_kern_cuda.h"

int sp_kern_cuda_load(void)
{
    /* The runtime binds to the current context on its first call and loads the
     * modules then (every kernel, with CUDA_MODULE_LOADING=EAGER). */
    cudaError_t rc = cudaFree(0);
    return rc == cudaSuccess ? 0 : (int)rc;
}
