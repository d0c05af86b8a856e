/*
 * sp_stub_regions.h — device buffers on the stand-in driver for tests whose
 * ranks are real client processes (the counterpart of tests/gpu/
 * sp_gpu_regions.h, with the same names, so that the cases of
 * sp_xdev_cases.h and sp_gpu_alltoallv.h run on either): cuMemAlloc memory
 * of the rank's current device, registered with the daemon. The stand-in's
 * device memory is shared memory mapped in the rank, so it is written and
 * read in place; spd reaches it only through its own import.
 */
#ifndef SP_STUB_REGIONS_H
#define SP_STUB_REGIONS_H

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sp_test.h"
#include "stub_cuda.h"

static inline void compare(const uint8_t *got, const uint8_t *want, uint64_t n, const char *what, int rank)
{
    for (uint64_t i = 0; i < n; i++)
        if (got[i] != want[i])
            SP_FAIL("rank %d, %s: byte %" PRIu64 " of %" PRIu64 " is 0x%02x from spd, 0x%02x from the host reference",
                    rank, what, i, n, got[i], want[i]);
}

static inline void dev_write(void *d, const void *host, uint64_t n)
{
    memcpy(d, host, n);
}

/* n bytes holding `host`, or 0x5A everywhere (spd must write every byte). */
static inline void *dev_put(spc_handle_t *h, const void *host, uint64_t n, spc_region_t *r_p)
{
    stub_ptr_t p;
    CHECK_EQ(cuMemAlloc_v2(&p, n ? n : 1), STUB_SUCCESS);
    void *d = (void *)(uintptr_t)p;
    if (host != NULL)
        dev_write(d, host, n);
    else
        memset(d, 0x5A, n);
    CHECK_OK(h, spc_register_device(h, d, n ? n : 1, r_p));
    return d;
}

static inline void dev_drop(spc_handle_t *h, void *d, spc_region_t r)
{
    CHECK_OK(h, spc_deregister(h, r));
    CHECK_EQ(cuMemFree_v2((stub_ptr_t)(uintptr_t)d), STUB_SUCCESS);
}

static inline void dev_check(const void *d, const void *want, uint64_t n, const char *what, int rank)
{
    compare(d, want, n, what, rank);
}

/* A stream of the current device for ops in stream order, and what the
 * tests put on it: a stall (a host function that sleeps), copies in and out. */
static void stub_sleep_ms_fn(void *arg)
{
    usleep((useconds_t)(intptr_t)arg * 1000);
}

static inline void *stream_make(void)
{
    void *cs;
    CHECK_EQ(cuStreamCreate(&cs, 1), STUB_SUCCESS);
    return cs;
}

static inline void stream_stall(void *cs, int ms)
{
    CHECK_EQ(cuLaunchHostFunc(cs, stub_sleep_ms_fn, (void *)(intptr_t)ms), STUB_SUCCESS);
}

static inline void stream_copy_in(void *cs, void *d, const void *host, uint64_t n)
{
    CHECK_EQ(cuMemcpyHtoDAsync_v2((stub_ptr_t)(uintptr_t)d, host, n, cs), STUB_SUCCESS);
}

static inline void stream_copy_out(void *cs, void *host, const void *d, uint64_t n)
{
    CHECK_EQ(cuMemcpyDtoHAsync_v2(host, (stub_ptr_t)(uintptr_t)d, n, cs), STUB_SUCCESS);
}

static inline void stream_destroy(void *cs)
{
    CHECK_EQ(cuStreamDestroy_v2(cs), STUB_SUCCESS);
}

/* Host memory the stream's copies use (every stand-in copy is in stream order). */
static inline void *host_pinned(uint64_t n)
{
    void *p = malloc(n ? n : 1);
    CHECK(p != NULL);
    return p;
}

static inline void host_unpin(void *p)
{
    free(p);
}

static inline uint64_t seed_of(int rank, int tag)
{
    return 0x9E3779B97F4A7C15ull * (uint64_t)(rank + 1) + (uint64_t)tag * 7919u;
}

#endif /* SP_STUB_REGIONS_H */
