/*
 * sp_gpu_regions.h — what the GPU tests that drive a real spd share: device
 * buffers registered as regions, the byte comparison with a host reference,
 * the inputs' seeds, and spd's status counters.
 */
#ifndef SP_GPU_REGIONS_H
#define SP_GPU_REGIONS_H

#include <stdlib.h>

#include "sp_gpu_test.h"

static inline void compare(const uint8_t *got, const uint8_t *want, uint64_t n, const char *what, int rank)
{
    for (uint64_t i = 0; i < n; i++)
        if (got[i] != want[i])
            SP_FAIL("rank %d, %s: byte %" PRIu64 " of %" PRIu64 " is 0x%02x from spd, 0x%02x from the host reference",
                    rank, what, i, n, got[i], want[i]);
}

/* A device buffer of n bytes holding `host` (or 0x5A everywhere: spd must write
 * every byte), registered with the daemon. Ops are host-synchronous here: the
 * buffer is written (a memset or a pageable copy may still run when the call
 * returns) before the daemon's stream touches it. */
static inline void *dev_put(spc_handle_t *h, const void *host, uint64_t n, spc_region_t *r_p)
{
    void *d;
    CUDA_CHECK(cudaMalloc(&d, n ? n : 1));
    if (host != NULL)
        CUDA_CHECK(cudaMemcpy(d, host, n, cudaMemcpyHostToDevice));
    else
        CUDA_CHECK(cudaMemset(d, 0x5A, n));
    CUDA_CHECK(cudaDeviceSynchronize());
    CHECK_OK(h, spc_register_device(h, d, n ? n : 1, r_p));
    return d;
}

static inline void dev_drop(spc_handle_t *h, void *d, spc_region_t r)
{
    CHECK_OK(h, spc_deregister(h, r));
    CUDA_CHECK(cudaFree(d));
}

static inline void dev_check(const void *d, const void *want, uint64_t n, const char *what, int rank)
{
    uint8_t *got = malloc(n ? n : 1);
    CUDA_CHECK(cudaMemcpy(got, d, n, cudaMemcpyDeviceToHost));
    compare(got, want, n, what, rank);
    free(got);
}

static inline uint64_t seed_of(int rank, int tag)
{
    return 0x9E3779B97F4A7C15ull * (uint64_t)(rank + 1) + (uint64_t)tag * 7919u;
}

#endif /* SP_GPU_REGIONS_H */
