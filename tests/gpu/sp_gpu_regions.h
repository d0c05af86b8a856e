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

/* Writes n bytes of `host` into device buffer d before a host-synchronous op
 * reads it. A copy from pageable memory may still be on its way when
 * cudaMemcpy returns, and nothing orders it before the daemon's stream, which
 * runs in another context: it could land after spd's result (seen on an H100
 * as a broadcast's output holding the rank's own input again). */
static inline void dev_write(void *d, const void *host, uint64_t n)
{
    CUDA_CHECK(cudaMemcpy(d, host, n, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize());
}

/* A device buffer of n bytes holding `host` (or 0x5A everywhere: spd must write
 * every byte), registered with the daemon, written before the daemon's stream
 * touches it (see dev_write; a memset may still run when the call returns). */
static inline void *dev_put(spc_handle_t *h, const void *host, uint64_t n, spc_region_t *r_p)
{
    void *d;
    CUDA_CHECK(cudaMalloc(&d, n ? n : 1));
    if (host != NULL)
        dev_write(d, host, n);
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

/* A stream of the current device for ops in stream order, and what the
 * tests put on it: a stall, copies in and out. */
static inline void *stream_make(void)
{
    cudaStream_t cs;
    CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    return cs;
}

static inline void stream_stall(void *cs, int ms)
{
    sp_gpu_stall((cudaStream_t)cs, ms);
}

static inline void stream_copy_in(void *cs, void *d, const void *host, uint64_t n)
{
    CUDA_CHECK(cudaMemcpyAsync(d, host, n, cudaMemcpyHostToDevice, (cudaStream_t)cs));
}

static inline void stream_copy_out(void *cs, void *host, const void *d, uint64_t n)
{
    CUDA_CHECK(cudaMemcpyAsync(host, d, n, cudaMemcpyDeviceToHost, (cudaStream_t)cs));
}

static inline void stream_destroy(void *cs)
{
    CUDA_CHECK(cudaStreamDestroy((cudaStream_t)cs));
}

/* Pinned host memory for a stream's copies: from pageable memory a copy in
 * waits on the host for the stream, one out for its own end. NULL is ignored. */
static inline void *host_pinned(uint64_t n)
{
    void *p;
    CUDA_CHECK(cudaMallocHost(&p, n ? n : 1));
    return p;
}

static inline void host_unpin(void *p)
{
    if (p != NULL)
        CUDA_CHECK(cudaFreeHost(p));
}

static inline uint64_t seed_of(int rank, int tag)
{
    return 0x9E3779B97F4A7C15ull * (uint64_t)(rank + 1) + (uint64_t)tag * 7919u;
}

#endif /* SP_GPU_REGIONS_H */
