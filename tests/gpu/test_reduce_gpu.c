/*
 * The CUDA reduction kernels against the host kernel, bit for bit: four ranks'
 * vectors folded in rank order on the device and on the host, for fp32, fp64,
 * int32 and int64 and each operator, NaNs, infinities and wrapping sums included;
 * and the fused all-reduce (every rank's result in one launch, rank 0 in place)
 * against the same host fold for 1, 3, 4 and 8 ranks and every type. Needs a
 * GPU; without one it says why and exits 77 (skipped).
 */
#include <math.h>

#include "sp_gpu_test.h"
#include "sp_kern_cuda.h"

#define N ((1 << 20) + 3)
#define RANKS 4

static double value(int rank, int i)
{
    uint64_t x = (uint64_t)(rank + 1) * 0x9E3779B97F4A7C15ull ^ (uint64_t)(i + 1) * 0xBF58476D1CE4E5B9ull;
    x ^= x >> 31;
    x *= 0xD6E8FEB86659FD93ull;
    x ^= x >> 29;
    if (x % 100003 == 0)
        return NAN;
    if (x % 100019 == 0)   /* with another rank's opposite infinity: a NaN made by the sum */
        return (x >> 41) & 1 ? -INFINITY : INFINITY;
    return ((x >> 40) & 1 ? -1.0 : 1.0) * ldexp((double)(x & 0xFFFFF) / 0xFFFFF + 0.5, (int)((x >> 20) % 48) - 24);
}

/* Integers from the same mix: the full range, so that sums wrap both ways. */
static uint64_t int_value(int rank, int i)
{
    uint64_t x = (uint64_t)(rank + 7) * 0xD6E8FEB86659FD93ull ^ (uint64_t)(i + 1) * 0x9E3779B97F4A7C15ull;
    x ^= x >> 32;
    return x * 0xBF58476D1CE4E5B9ull;
}

static void fill(void *buf, unsigned dtype, int rank)
{
    for (int i = 0; i < N; i++) {
        switch (dtype) {
        case SP_KERN_F32: ((float *)buf)[i] = (float)value(rank, i); break;
        case SP_KERN_F64: ((double *)buf)[i] = value(rank, i); break;
        case SP_KERN_I32: ((uint32_t *)buf)[i] = (uint32_t)int_value(rank, i); break;
        case SP_KERN_I64: ((uint64_t *)buf)[i] = int_value(rank, i); break;
        }
    }
}

static void run(unsigned dtype, unsigned redop)
{
    size_t es = dtype == SP_KERN_F32 || dtype == SP_KERN_I32 ? 4 : 8, bytes = (size_t)N * es;
    uint8_t *in[RANKS], *host = malloc(bytes), *back = malloc(bytes);
    for (int r = 0; r < RANKS; r++) {
        in[r] = malloc(bytes);
        fill(in[r], dtype, r);
    }
    memcpy(host, in[0], bytes);
    for (int r = 1; r < RANKS; r++)
        CHECK_EQ(sp_kern_reduce(host, in[r], N, dtype, redop), 0);

    void *acc, *src;
    CUDA_CHECK(cudaMalloc(&acc, bytes));
    CUDA_CHECK(cudaMalloc(&src, bytes));
    CUDA_CHECK(cudaMemcpy(acc, in[0], bytes, cudaMemcpyHostToDevice));
    for (int r = 1; r < RANKS; r++) {
        CUDA_CHECK(cudaMemcpy(src, in[r], bytes, cudaMemcpyHostToDevice));
        CHECK_EQ(sp_kern_reduce_cuda(acc, src, N, dtype, redop, NULL), 0);
    }
    CUDA_CHECK(cudaMemcpy(back, acc, bytes, cudaMemcpyDeviceToHost));
    if (memcmp(host, back, bytes) != 0)
        SP_FAIL("device and host reductions (dtype %u, op %u) differ", dtype, redop);
    cudaFree(acc);
    cudaFree(src);
    for (int r = 0; r < RANKS; r++)
        free(in[r]);
    free(host);
    free(back);
}

/* fp16 and bf16 through the fp32 accumulator: arbitrary bit patterns (NaNs and
 * infinities among them), widened, folded in rank order and rounded once. */
static void run16(unsigned dtype, unsigned redop)
{
    uint16_t *in[RANKS], *host = malloc(N * 2), *back = malloc(N * 2);
    float *acc = malloc((size_t)N * sizeof *acc);
    for (int r = 0; r < RANKS; r++) {
        in[r] = malloc(N * 2);
        for (int i = 0; i < N; i++)
            in[r][i] = (uint16_t)(int_value(r, i) >> 17);
    }
    CHECK_EQ(sp_kern_widen(acc, in[0], N, dtype), 0);
    for (int r = 1; r < RANKS; r++)
        CHECK_EQ(sp_kern_reduce_widen(acc, in[r], N, dtype, redop), 0);
    CHECK_EQ(sp_kern_narrow(host, acc, N, dtype), 0);

    float *dacc;
    void *dsrc, *dout;
    CUDA_CHECK(cudaMalloc((void **)&dacc, (size_t)N * sizeof *dacc));
    CUDA_CHECK(cudaMalloc(&dsrc, N * 2));
    CUDA_CHECK(cudaMalloc(&dout, N * 2));
    CUDA_CHECK(cudaMemcpy(dsrc, in[0], N * 2, cudaMemcpyHostToDevice));
    CHECK_EQ(sp_kern_widen_cuda(dacc, dsrc, N, dtype, NULL), 0);
    for (int r = 1; r < RANKS; r++) {
        CUDA_CHECK(cudaMemcpy(dsrc, in[r], N * 2, cudaMemcpyHostToDevice));
        CHECK_EQ(sp_kern_reduce_widen_cuda(dacc, dsrc, N, dtype, redop, NULL), 0);
    }
    CHECK_EQ(sp_kern_narrow_cuda(dout, dacc, N, dtype, NULL), 0);
    CUDA_CHECK(cudaMemcpy(back, dout, N * 2, cudaMemcpyDeviceToHost));
    if (memcmp(host, back, N * 2) != 0)
        SP_FAIL("device and host 16-bit reductions (dtype %u, op %u) differ", dtype, redop);
    cudaFree(dacc);
    cudaFree(dsrc);
    cudaFree(dout);
    for (int r = 0; r < RANKS; r++)
        free(in[r]);
    free(host);
    free(back);
    free(acc);
}

/* The host fold of P ranks' inputs (the references above, in rank order). */
static void host_fold(uint8_t *out, uint8_t *const *in, int P, unsigned dtype, unsigned redop, size_t bytes)
{
    if (dtype == SP_KERN_F16 || dtype == SP_KERN_BF16) {
        float *acc = malloc((size_t)N * sizeof *acc);
        CHECK_EQ(sp_kern_widen(acc, in[0], N, dtype), 0);
        for (int r = 1; r < P; r++)
            CHECK_EQ(sp_kern_reduce_widen(acc, in[r], N, dtype, redop), 0);
        CHECK_EQ(sp_kern_narrow(out, acc, N, dtype), 0);
        free(acc);
        return;
    }
    memcpy(out, in[0], bytes);
    for (int r = 1; r < P; r++)
        CHECK_EQ(sp_kern_reduce(out, in[r], N, dtype, redop), 0);
}

static void run_fused(unsigned dtype, unsigned redop, int P)
{
    size_t es = dtype == SP_KERN_F16 || dtype == SP_KERN_BF16 ? 2 : dtype == SP_KERN_F32 || dtype == SP_KERN_I32 ? 4
                                                                                                                 : 8;
    size_t bytes = (size_t)N * es;
    uint8_t *in[8] = { NULL }, *want = malloc(bytes), *back = malloc(bytes);
    void *src[8] = { NULL }, *dst[8] = { NULL };
    for (int r = 0; r < P; r++) {
        in[r] = malloc(bytes);
        if (es == 2) {
            for (int i = 0; i < N; i++)
                ((uint16_t *)in[r])[i] = (uint16_t)(int_value(r, i) >> 17);
        } else {
            fill(in[r], dtype, r);
        }
        CUDA_CHECK(cudaMalloc(&src[r], bytes));
        CUDA_CHECK(cudaMemcpy(src[r], in[r], bytes, cudaMemcpyHostToDevice));
        if (r == 0) {
            dst[r] = src[r];   /* in place: recv == send */
        } else {
            CUDA_CHECK(cudaMalloc(&dst[r], bytes));
            CUDA_CHECK(cudaMemset(dst[r], 0x5A, bytes));
        }
    }
    host_fold(want, in, P, dtype, redop, bytes);
    CHECK_EQ(sp_kern_allreduce_cuda(dst, (const void *const *)src, (uint32_t)P, N, dtype, redop, NULL), 0);
    for (int r = 0; r < P; r++) {
        CUDA_CHECK(cudaMemcpy(back, dst[r], bytes, cudaMemcpyDeviceToHost));
        if (memcmp(want, back, bytes) != 0)
            SP_FAIL("fused all-reduce, %d ranks (dtype %u, op %u): rank %d's result differs from the host fold", P,
                    dtype, redop, r);
    }
    for (int r = 0; r < P; r++) {
        cudaFree(src[r]);
        if (r > 0)
            cudaFree(dst[r]);
        free(in[r]);
    }
    free(want);
    free(back);
}

int main(void)
{
    if (sp_gpu_test_usable() != 0)
        return SP_TEST_SKIP;
    for (unsigned op = SP_KERN_SUM; op <= SP_KERN_MIN; op++) {
        run(SP_KERN_F32, op);
        run(SP_KERN_F64, op);
        run(SP_KERN_I32, op);
        run(SP_KERN_I64, op);
        run16(SP_KERN_F16, op);
        run16(SP_KERN_BF16, op);
    }
    const unsigned types[] = { SP_KERN_F32, SP_KERN_F64, SP_KERN_I32, SP_KERN_I64, SP_KERN_F16, SP_KERN_BF16 };
    const int ranks[] = { 1, 3, 4, 8 };
    for (unsigned op = SP_KERN_SUM; op <= SP_KERN_MIN; op++)
        for (size_t k = 0; k < sizeof types / sizeof types[0]; k++)
            for (size_t p = 0; p < sizeof ranks / sizeof ranks[0]; p++)
                run_fused(types[k], op, ranks[p]);
    CHECK_EQ(sp_kern_allreduce_cuda(NULL, NULL, 0, 1, SP_KERN_F32, SP_KERN_SUM, NULL), -1);
    CHECK_EQ(sp_kern_allreduce_cuda(NULL, NULL, 65, 1, SP_KERN_F32, SP_KERN_SUM, NULL), -1);
    CHECK_EQ(sp_kern_allreduce_cuda(NULL, NULL, 2, 1, SP_KERN_U8, SP_KERN_SUM, NULL), -1);
    CHECK_EQ(sp_kern_widen_cuda(NULL, NULL, 1, SP_KERN_F32, NULL), -1);
    /* 16-bit types accumulate in fp32, as on the host; this kernel does not take them. */
    CHECK_EQ(sp_kern_reduce_cuda(NULL, NULL, 1, SP_KERN_F16, SP_KERN_SUM, NULL), -1);
    CHECK_EQ(sp_kern_reduce_cuda(NULL, NULL, 1, SP_KERN_BF16, SP_KERN_SUM, NULL), -1);
    CHECK_EQ(sp_kern_reduce_cuda(NULL, NULL, 1, SP_KERN_U8, SP_KERN_SUM, NULL), -1);
    printf("reduce_gpu: device matches host bit for bit (fp32, fp64, int32, int64, and fp16, bf16 through fp32; "
           "sum, max, min; %d elements); the fused all-reduce too, 1, 3, 4 and 8 ranks\n",
           N);
    return 0;
}
