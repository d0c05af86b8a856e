/*
 * sp_gpu_alltoallv.h — an uneven all-to-all on device regions, checked against
 * a reference made here: rank src sends rank dst C(src, dst) fp32 elements,
 * each byte a function of (src, dst, its place); rank dst's receive must hold
 * the blocks of every src in rank order. Counts differ per pair, some blocks
 * are empty, and with P > 2 the last rank sends and receives nothing (its
 * buffers are still device memory, of one byte, untouched). The includer
 * first defines the device memory it runs on (dev_put, dev_check, dev_drop:
 * sp_gpu_regions.h on a GPU, tests/stubcuda/sp_stub_regions.h on the stand-in).
 */
#ifndef SP_GPU_ALLTOALLV_H
#define SP_GPU_ALLTOALLV_H

#include <stdio.h>
#include <stdlib.h>

#include "sp_test.h"

static inline uint64_t a2av_count(int P, int src, int dst, int salt)
{
    if (P > 2 && (src == P - 1 || dst == P - 1))
        return 0;
    return (uint64_t)((src * 7 + dst * 3 + salt) % 5) * 1031u;
}

static inline uint8_t a2av_byte(int src, int dst, uint64_t k)
{
    return (uint8_t)((((uint64_t)src * 131u + (uint64_t)dst * 17u + k) * 0x9E3779B97F4A7C15ull) >> 56);
}

static inline void dev_alltoallv(spc_handle_t *h, spc_group_t world, int rank, int P, int salt)
{
    uint64_t sc[64], rc[64], sb = 0, rb = 0;
    for (int q = 0; q < P; q++) {
        sc[q] = a2av_count(P, rank, q, salt);
        rc[q] = a2av_count(P, q, rank, salt);
        sb += sc[q] * 4;
        rb += rc[q] * 4;
    }
    uint8_t *in = malloc(sb + 1), *want = malloc(rb + 1);
    CHECK(in != NULL && want != NULL);
    for (int dst = 0, at = 0; dst < P; dst++)
        for (uint64_t k = 0; k < sc[dst] * 4; k++)
            in[at++] = a2av_byte(rank, dst, k);
    for (int src = 0, at = 0; src < P; src++)
        for (uint64_t k = 0; k < rc[src] * 4; k++)
            want[at++] = a2av_byte(src, rank, k);
    spc_region_t rs, rr;
    void *ds = dev_put(h, in, sb, &rs), *dr = dev_put(h, NULL, rb, &rr);
    spc_alltoallv_desc_t d = SPC_ALLTOALLV_DESC_INIT;
    d.group = world;
    d.dtype = SPC_F32;
    d.send = ds;
    d.recv = dr;
    d.send_counts = sc;
    d.recv_counts = rc;
    CHECK_OK(h, spc_alltoallv(h, &d, 30000));
    char what[96];
    snprintf(what, sizeof what, "alltoallv, P %d, pattern %d", P, salt);
    dev_check(dr, want, rb, what, rank);
    dev_drop(h, ds, rs);
    dev_drop(h, dr, rr);
    free(in);
    free(want);
}

#endif /* SP_GPU_ALLTOALLV_H */
