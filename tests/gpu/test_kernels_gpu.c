/*
 * The CUDA data movers against their host references, bit for bit (the host
 * references are checked against the daemon's loops and the definitions in
 * tests/unit/test_kern_a2a.c):
 *
 *   all-to-all  every rank's output of every case of sp_kern_cases.h, both
 *               directions, sources in device memory, once with every pointer
 *               16-byte aligned and once offset by one element (narrower words);
 *   shift       a copy and the zeros of a linear shift's edge, odd sizes and offsets;
 *   zigzag      split and merge, both layouts, P = 1 to 8, and the round trip;
 *   pad         heads and rows padded and cut, GQA groups, both layouts;
 *   LSE merge   random values with -inf and NaN lse on either side, both
 *               layouts, four-wide and scalar rows, and in place.
 *
 * Needs a GPU; without one it says why and exits 77 (skipped).
 */
#include <math.h>

#include "sp_gpu_test.h"
#include "sp_kern_cases.h"
#include "sp_kern_cuda.h"

static uint64_t rng_state = 0x13198A2E03707344ull;

/* Device memory holding n bytes at `offset` past a 256-byte aligned start. */
static uint8_t *dev_alloc(uint64_t n, uint32_t offset, void **base_p)
{
    CUDA_CHECK(cudaMalloc(base_p, n + offset + 1));
    return (uint8_t *)*base_p + offset;
}

static void compare(const uint8_t *got, const uint8_t *want, uint64_t n, const char *what)
{
    for (uint64_t i = 0; i < n; i++)
        if (got[i] != want[i])
            SP_FAIL("%s: byte %" PRIu64 " of %" PRIu64 " is 0x%02x on the device, 0x%02x on the host", what, i, n,
                    got[i], want[i]);
}

/* ================================================================ all-to-all */

static uint64_t a2a_bytes_checked;

static void test_a2a_case(const sp_kern_case_t *c, uint32_t dir, uint32_t offset)
{
    const uint32_t P = c->ranks;
    sp_kern_a2a_desc_t d = sp_kern_case_desc(c, dir);
    sp_kern_a2a_geom_t g;
    CHECK_EQ(sp_kern_a2a_geom(&g, &d, 0), 0);
    const uint64_t in_bytes = sp_kern_a2a_src_bytes(&g), out_bytes = sp_kern_a2a_out_bytes(&g);
    uint8_t *in[8], *din[8], *dout, *want = malloc(out_bytes), *got = malloc(out_bytes);
    void *base[8], *out_base;
    for (uint32_t q = 0; q < P; q++) {
        in[q] = malloc(in_bytes);
        sp_kern_fill(in[q], in_bytes, &rng_state);
        din[q] = dev_alloc(in_bytes, offset, &base[q]);
        CUDA_CHECK(cudaMemcpy(din[q], in[q], in_bytes, cudaMemcpyHostToDevice));
    }
    dout = dev_alloc(out_bytes, offset, &out_base);
    for (uint32_t r = 0; r < P; r++) {
        char what[160];
        snprintf(what, sizeof what, "all-to-all %s, case \"%s\", rank %u, offset %u", dir ? "head->seq" : "seq->head",
                 c->name, r, offset);
        /* The device must write every byte: its output starts out as a pattern. */
        CUDA_CHECK(cudaMemset(dout, 0x5A, out_bytes));
        CHECK_EQ(sp_kern_a2a_host(want, (const void *const *)in, &d, r), 0);
        int rc = sp_kern_a2a_cuda(dout, (const void *const *)din, &d, r, NULL);
        if (rc != 0)
            SP_FAIL("%s: sp_kern_a2a_cuda returned %d", what, rc);
        CUDA_CHECK(cudaMemcpy(got, dout, out_bytes, cudaMemcpyDeviceToHost));
        compare(got, want, out_bytes, what);
        a2a_bytes_checked += out_bytes;
    }
    for (uint32_t q = 0; q < P; q++) {
        cudaFree(base[q]);
        free(in[q]);
    }
    cudaFree(out_base);
    free(want);
    free(got);
}

static void test_a2a(void)
{
    for (size_t i = 0; i < SP_KERN_NCASES; i++) {
        const sp_kern_case_t *c = &sp_kern_cases[i];
        uint32_t es = c->dtype == SP_KERN_U8 ? 1 : c->dtype == SP_KERN_F16 || c->dtype == SP_KERN_BF16 ? 2
                    : c->dtype == SP_KERN_F64 || c->dtype == SP_KERN_I64 ? 8 : 4;
        for (uint32_t dir = 0; dir < 2; dir++) {
            test_a2a_case(c, dir, 0);
            test_a2a_case(c, dir, es);
        }
    }
    /* An element split across words cannot be summed: misaligned pointers are refused. */
    sp_kern_a2a_desc_t d = { SP_KERN_HEAD_TO_SEQ, SP_KERN_BSHD, 1, 4, 1, 4, SP_KERN_HEADS_KV, 0, 2, SP_KERN_F32,
                             SP_KERN_A2A_SUM_REPLICAS };
    const void *src[2] = { (void *)(uintptr_t)0x1001, (void *)(uintptr_t)0x2001 };
    CHECK_EQ(sp_kern_a2a_cuda((void *)(uintptr_t)0x3001, src, &d, 0, NULL), -1);
}

/* ================================================================ shift, zigzag, pad */

static void test_shift(void)
{
    const uint64_t sizes[] = { 1, 15, 16, 4099, (1u << 22) + 5 };
    for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++)
        for (uint32_t offset = 0; offset < 3; offset++) {
            uint64_t n = sizes[k];
            uint8_t *x = malloc(n), *want = malloc(n), *got = malloc(n);
            void *xb, *yb;
            uint8_t *dx = dev_alloc(n, offset, &xb), *dy = dev_alloc(n, offset ? 4 - offset : 0, &yb);
            sp_kern_fill(x, n, &rng_state);
            CUDA_CHECK(cudaMemcpy(dx, x, n, cudaMemcpyHostToDevice));
            for (int zero = 0; zero < 2; zero++) {
                CUDA_CHECK(cudaMemset(dy, 0x5A, n));
                sp_kern_shift_host(want, zero ? NULL : x, n);
                CHECK_EQ(sp_kern_shift_cuda(dy, zero ? NULL : dx, n, NULL), 0);
                CUDA_CHECK(cudaMemcpy(got, dy, n, cudaMemcpyDeviceToHost));
                compare(got, want, n, zero ? "shift (zeros)" : "shift");
            }
            cudaFree(xb);
            cudaFree(yb);
            free(x);
            free(want);
            free(got);
        }
}

static void test_zigzag(void)
{
    const uint32_t shapes[][4] = { /* P, B, S, row bytes */
        { 1, 2, 6, 4 }, { 2, 2, 8, 12 }, { 3, 1, 12, 8 }, { 4, 3, 16, 6 }, { 8, 2, 48, 16 }, { 4, 1, 4096, 2048 },
    };
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++)
        for (uint32_t layout = SP_KERN_BSHD; layout <= SP_KERN_SBHD; layout++) {
            sp_kern_zigzag_t z = { layout, shapes[k][1], shapes[k][2], shapes[k][0], shapes[k][3], 0 };
            uint64_t n = (uint64_t)z.batch * z.seq_len * z.row_bytes;
            uint8_t *x = malloc(n), *want = malloc(n), *got = malloc(n);
            void *xb, *yb, *bb;
            uint8_t *dx = dev_alloc(n, 0, &xb), *dy = dev_alloc(n, 0, &yb), *dback = dev_alloc(n, 0, &bb);
            sp_kern_fill(x, n, &rng_state);
            CUDA_CHECK(cudaMemcpy(dx, x, n, cudaMemcpyHostToDevice));
            CHECK_EQ(sp_kern_zigzag_host(want, x, &z), 0);
            CHECK_EQ(sp_kern_zigzag_cuda(dy, dx, &z, NULL), 0);
            CUDA_CHECK(cudaMemcpy(got, dy, n, cudaMemcpyDeviceToHost));
            compare(got, want, n, "zigzag split");
            z.merge = 1;
            CHECK_EQ(sp_kern_zigzag_cuda(dback, dy, &z, NULL), 0);
            CUDA_CHECK(cudaMemcpy(got, dback, n, cudaMemcpyDeviceToHost));
            compare(got, x, n, "zigzag merge of the split");
            cudaFree(xb);
            cudaFree(yb);
            cudaFree(bb);
            free(x);
            free(want);
            free(got);
        }
}

static void test_pad(void)
{
    /* layout, B, rows in, rows out, groups, per group in, per group out, vec bytes */
    const uint32_t shapes[][8] = {
        { SP_KERN_BSHD, 2, 7, 8, 1, 28, 32, 16 },   { SP_KERN_SBHD, 3, 10, 12, 1, 5, 6, 10 },
        { SP_KERN_BSHD, 1, 11, 12, 2, 3, 4, 8 },    { SP_KERN_SBHD, 2, 5, 5, 4, 7, 8, 2 },
        { SP_KERN_BSHD, 1, 1000, 1024, 1, 30, 32, 256 }, { SP_KERN_BSHD, 2, 12, 9, 1, 32, 28, 16 },
    };
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        const uint32_t *t = shapes[k];
        sp_kern_pad_t p = { t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7] };
        uint64_t nin = (uint64_t)p.batch * p.rows_in * p.groups * p.per_group_in * p.vec_bytes;
        uint64_t nout = (uint64_t)p.batch * p.rows_out * p.groups * p.per_group_out * p.vec_bytes;
        uint8_t *x = malloc(nin), *want = malloc(nout), *got = malloc(nout);
        void *xb, *yb;
        uint8_t *dx = dev_alloc(nin, 0, &xb), *dy = dev_alloc(nout, 0, &yb);
        sp_kern_fill(x, nin, &rng_state);
        CUDA_CHECK(cudaMemcpy(dx, x, nin, cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemset(dy, 0x5A, nout));
        CHECK_EQ(sp_kern_pad_host(want, x, &p), 0);
        CHECK_EQ(sp_kern_pad_cuda(dy, dx, &p, NULL), 0);
        CUDA_CHECK(cudaMemcpy(got, dy, nout, cudaMemcpyDeviceToHost));
        compare(got, want, nout, "pad");
        cudaFree(xb);
        cudaFree(yb);
        free(x);
        free(want);
        free(got);
    }
}

/* ================================================================ LSE merge */

static void test_merge_shape(uint32_t layout, uint32_t B, uint32_t S, uint32_t H, uint32_t D)
{
    const uint64_t n = (uint64_t)B * S * H * D, nl = (uint64_t)B * H * S;
    float *oa = malloc(n * 4), *ob = malloc(n * 4), *la = malloc(nl * 4), *lb = malloc(nl * 4);
    float *out = malloc(n * 4), *lse = malloc(nl * 4), *got = malloc(n * 4), *got_lse = malloc(nl * 4);
    for (uint64_t i = 0; i < n; i++) {
        oa[i] = (float)((int64_t)(sp_kern_rng(&rng_state) % 2000001) - 1000000) / 1e5f;
        ob[i] = (float)((int64_t)(sp_kern_rng(&rng_state) % 2000001) - 1000000) / 1e5f;
    }
    for (uint64_t i = 0; i < nl; i++) {
        uint64_t x = sp_kern_rng(&rng_state);
        la[i] = (float)((int64_t)(x % 400001) - 200000) / 3700.0f;
        lb[i] = x % 11 == 0 ? la[i] : (float)((int64_t)((x >> 20) % 400001) - 200000) / 3700.0f;
        if (x % 13 == 0)
            la[i] = -INFINITY;
        if (x % 17 == 0)
            lb[i] = -INFINITY;
        if (x % 101 == 0)
            la[i] = NAN;
        /* A side that saw no key may hold anything in out: it must not show. */
        if (x % 7 == 0 && la[i] == -INFINITY)
            oa[(i % (n / D)) * D] = NAN;
    }
    sp_kern_lse_merge_t m = { layout, B, S, H, D };
    CHECK_EQ(sp_kern_lse_merge_host(out, lse, oa, la, ob, lb, &m), 0);

    void *b1, *b2, *b3, *b4, *b5, *b6;
    float *doa = (float *)dev_alloc(n * 4, 0, &b1), *dob = (float *)dev_alloc(n * 4, 0, &b2);
    float *dla = (float *)dev_alloc(nl * 4, 0, &b3), *dlb = (float *)dev_alloc(nl * 4, 0, &b4);
    float *dout = (float *)dev_alloc(n * 4, 0, &b5), *dlse = (float *)dev_alloc(nl * 4, 0, &b6);
    CUDA_CHECK(cudaMemcpy(doa, oa, n * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dob, ob, n * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dla, la, nl * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(dlb, lb, nl * 4, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(dout, 0x5A, n * 4));
    CUDA_CHECK(cudaMemset(dlse, 0x5A, nl * 4));
    CHECK_EQ(sp_kern_lse_merge_cuda(dout, dlse, doa, dla, dob, dlb, &m, NULL), 0);
    CUDA_CHECK(cudaMemcpy(got, dout, n * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got_lse, dlse, nl * 4, cudaMemcpyDeviceToHost));
    char what[96];
    snprintf(what, sizeof what, "LSE merge out, %s [%u, %u, %u, %u]", layout ? "SBHD" : "BSHD", B, S, H, D);
    compare((const uint8_t *)got, (const uint8_t *)out, n * 4, what);
    compare((const uint8_t *)got_lse, (const uint8_t *)lse, nl * 4, "LSE merge lse");
    /* In place, into side a. */
    CHECK_EQ(sp_kern_lse_merge_cuda(doa, dla, doa, dla, dob, dlb, &m, NULL), 0);
    CUDA_CHECK(cudaMemcpy(got, doa, n * 4, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(got_lse, dla, nl * 4, cudaMemcpyDeviceToHost));
    compare((const uint8_t *)got, (const uint8_t *)out, n * 4, "LSE merge out, in place");
    compare((const uint8_t *)got_lse, (const uint8_t *)lse, nl * 4, "LSE merge lse, in place");
    cudaFree(b1);
    cudaFree(b2);
    cudaFree(b3);
    cudaFree(b4);
    cudaFree(b5);
    cudaFree(b6);
    free(oa);
    free(ob);
    free(la);
    free(lb);
    free(out);
    free(lse);
    free(got);
    free(got_lse);
}

int main(void)
{
    if (sp_gpu_test_usable() != 0)
        return SP_TEST_SKIP;
    test_a2a();
    test_shift();
    test_zigzag();
    test_pad();
    test_merge_shape(SP_KERN_BSHD, 2, 257, 4, 128);
    test_merge_shape(SP_KERN_SBHD, 3, 100, 5, 64);
    test_merge_shape(SP_KERN_BSHD, 1, 77, 3, 13);
    test_merge_shape(SP_KERN_SBHD, 2, 40, 2, 20);
    printf("kernels_gpu: device matches host bit for bit: all-to-all (%zu cases x 2 directions x every rank x 2 "
           "alignments, %" PRIu64 " bytes), shift, zigzag split/merge, pad/unpad, LSE merge\n",
           (size_t)SP_KERN_NCASES, a2a_bytes_checked);
    return 0;
}
