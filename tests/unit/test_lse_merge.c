/* spc_lse_merge (client/src/merge.c) on host memory against the merge written
 * here from its definition, in double with libm: lse = logaddexp(lse_a, lse_b),
 * out = out_a exp(lse_a - lse) + out_b exp(lse_b - lse). Both layouts, rows where
 * either side or both saw no key (-inf), NaN, the merge in place, and the
 * arguments it refuses. Device memory is the GPU tests' (tests/python/test_cuda.py). */
#include <math.h>

#include "sp_test.h"

static uint32_t rng_state = 4242;
static double uniform(void)
{
    rng_state = rng_state * 1103515245u + 12345u;
    return (rng_state >> 8) / 16777216.0;
}

typedef struct case_s {
    uint32_t layout, B, S, H, D;
    size_t   nout, nlse;
    float   *out_a, *lse_a, *out_b, *lse_b;
} case_t;

static spc_lse_merge_desc_t desc_of(const case_t *c, float *out, float *lse, const float *out_a, const float *lse_a,
                                    const float *out_b, const float *lse_b)
{
    spc_lse_merge_desc_t d = SPC_LSE_MERGE_DESC_INIT;
    d.layout = c->layout;
    d.batch = c->B;
    d.seq_len = c->S;
    d.heads = c->H;
    d.head_dim = c->D;
    d.out = out;
    d.lse = lse;
    d.out_a = out_a;
    d.lse_a = lse_a;
    d.out_b = out_b;
    d.lse_b = lse_b;
    return d;
}

/* Where (b, s, h, i) of an out lies, from the layout's definition. */
static size_t out_at(const case_t *c, uint32_t b, uint32_t s, uint32_t h, uint32_t i)
{
    size_t row = c->layout == SPC_LAYOUT_BSHD ? (size_t)b * c->S + s : (size_t)s * c->B + b;
    return (row * c->H + h) * c->D + i;
}

/* Random outs and lses; every row kind appears: some rows of a and of b saw no
 * key (their out then holds NaN, which the merge must not read), some both, a
 * few a NaN lse, some with lses far apart (the smaller side underflows). */
static void case_make(case_t *c, uint32_t layout, uint32_t B, uint32_t S, uint32_t H, uint32_t D)
{
    *c = (case_t){ .layout = layout, .B = B, .S = S, .H = H, .D = D };
    c->nout = (size_t)B * S * H * D;
    c->nlse = (size_t)B * H * S;
    c->out_a = malloc(c->nout * sizeof(float));
    c->out_b = malloc(c->nout * sizeof(float));
    c->lse_a = malloc(c->nlse * sizeof(float));
    c->lse_b = malloc(c->nlse * sizeof(float));
    CHECK(c->out_a && c->out_b && c->lse_a && c->lse_b);
    for (size_t i = 0; i < c->nout; i++) {
        c->out_a[i] = (float)(uniform() * 4 - 2);
        c->out_b[i] = (float)(uniform() * 4 - 2);
    }
    for (size_t r = 0; r < c->nlse; r++) {
        double u = uniform();
        c->lse_a[r] = (float)(uniform() * 20 - 10);
        c->lse_b[r] = (float)(uniform() * 20 - 10);
        if (u < 0.1)
            c->lse_a[r] = -INFINITY;
        else if (u < 0.2)
            c->lse_b[r] = -INFINITY;
        else if (u < 0.25)
            c->lse_a[r] = c->lse_b[r] = -INFINITY;
        else if (u < 0.28)
            c->lse_b[r] = NAN;
        else if (u < 0.35)
            c->lse_b[r] = c->lse_a[r] - 300.0f;
    }
    /* A side that saw no key may hold anything in its out. */
    for (uint32_t b = 0; b < B; b++)
        for (uint32_t h = 0; h < H; h++)
            for (uint32_t s = 0; s < S; s++) {
                size_t r = ((size_t)b * H + h) * S + s;
                for (uint32_t i = 0; i < D; i++) {
                    if (c->lse_a[r] == -INFINITY)
                        c->out_a[out_at(c, b, s, h, i)] = NAN;
                    if (c->lse_b[r] == -INFINITY)
                        c->out_b[out_at(c, b, s, h, i)] = NAN;
                }
            }
}

static void case_free(case_t *c)
{
    free(c->out_a);
    free(c->out_b);
    free(c->lse_a);
    free(c->lse_b);
}

/* got against the definition, row by row: within a few fp32 ulps of the
 * double result (spd rounds once from double, as this does; the exp and log
 * are its own). */
static void check_against_definition(const case_t *c, const float *out, const float *lse)
{
    for (uint32_t b = 0; b < c->B; b++)
        for (uint32_t h = 0; h < c->H; h++)
            for (uint32_t s = 0; s < c->S; s++) {
                size_t r = ((size_t)b * c->H + h) * c->S + s;
                double la = c->lse_a[r], lb = c->lse_b[r];
                if (isnan(la) || isnan(lb)) {
                    CHECK(isnan(lse[r]));
                    for (uint32_t i = 0; i < c->D; i++)
                        CHECK(isnan(out[out_at(c, b, s, h, i)]));
                    continue;
                }
                double m = fmax(la, lb);
                double want_lse = isinf(m) && m < 0 ? -INFINITY : m + log(exp(la - m) + exp(lb - m));
                double wa = isinf(la) ? 0.0 : exp(la - want_lse), wb = isinf(lb) ? 0.0 : exp(lb - want_lse);
                if (isinf(want_lse))
                    CHECK(lse[r] == -INFINITY);
                else if (fabs(lse[r] - want_lse) > 4e-7 * fmax(1.0, fabs(want_lse)))
                    SP_FAIL("lse[b %u, h %u, s %u]: %.9g, want %.9g", b, h, s, lse[r], want_lse);
                for (uint32_t i = 0; i < c->D; i++) {
                    size_t o = out_at(c, b, s, h, i);
                    double want = (wa != 0.0 ? c->out_a[o] * wa : 0.0) + (wb != 0.0 ? c->out_b[o] * wb : 0.0);
                    double scale = (wa != 0.0 ? fabs(c->out_a[o]) : 0.0) + (wb != 0.0 ? fabs(c->out_b[o]) : 0.0);
                    if (isnan(out[o]) || fabs(out[o] - want) > 4e-7 * scale + 1e-30)
                        SP_FAIL("out[b %u, s %u, h %u, %u]: %.9g, want %.9g (lse_a %g, lse_b %g)", b, s, h, i, out[o],
                                want, la, lb);
                }
            }
}

static void test_definition(uint32_t layout, uint32_t B, uint32_t S, uint32_t H, uint32_t D)
{
    case_t c;
    case_make(&c, layout, B, S, H, D);
    float *out = malloc(c.nout * sizeof(float)), *lse = malloc(c.nlse * sizeof(float));
    CHECK(out && lse);
    spc_lse_merge_desc_t d = desc_of(&c, out, lse, c.out_a, c.lse_a, c.out_b, c.lse_b);
    CHECK_OK(NULL, spc_lse_merge(&d));
    check_against_definition(&c, out, lse);

    /* In place, into either side: the same bits as into fresh arrays. */
    for (int side = 0; side < 2; side++) {
        float *io = malloc(c.nout * sizeof(float)), *il = malloc(c.nlse * sizeof(float));
        CHECK(io && il);
        memcpy(io, side == 0 ? c.out_a : c.out_b, c.nout * sizeof(float));
        memcpy(il, side == 0 ? c.lse_a : c.lse_b, c.nlse * sizeof(float));
        spc_lse_merge_desc_t di = side == 0 ? desc_of(&c, io, il, io, il, c.out_b, c.lse_b)
                                            : desc_of(&c, io, il, c.out_a, c.lse_a, io, il);
        CHECK_OK(NULL, spc_lse_merge(&di));
        CHECK(memcmp(io, out, c.nout * sizeof(float)) == 0);
        CHECK(memcmp(il, lse, c.nlse * sizeof(float)) == 0);
        free(io);
        free(il);
    }
    free(out);
    free(lse);
    case_free(&c);
}

/* The exact cases: a side that saw no key hands the other through bit for
 * bit; neither gives lse -inf and out 0; equal lses weigh a half each. */
static void test_exact_rows(void)
{
    float oa[2] = { 1.5f, -3.25f }, ob[2] = { NAN, 7.0f }, out[2];
    float la = 0.75f, lb = -INFINITY, lse;
    case_t c = { .layout = SPC_LAYOUT_BSHD, .B = 1, .S = 1, .H = 1, .D = 2 };
    spc_lse_merge_desc_t d = desc_of(&c, out, &lse, oa, &la, ob, &lb);
    CHECK_OK(NULL, spc_lse_merge(&d));
    CHECK(lse == la && out[0] == oa[0] && out[1] == oa[1]);

    la = -INFINITY;
    oa[0] = NAN;
    CHECK_OK(NULL, spc_lse_merge(&d));
    CHECK(lse == -INFINITY && out[0] == 0.0f && out[1] == 0.0f);

    la = lb = 2.0f;
    oa[0] = 1.0f;
    ob[0] = 3.0f;
    CHECK_OK(NULL, spc_lse_merge(&d));
    CHECK(out[0] == 2.0f && out[1] == 1.875f);
    if (fabs(lse - (2.0 + log(2.0))) > 1e-6)
        SP_FAIL("lse of two equal sides: %.9g, want 2 + ln 2", lse);
}

static void test_refusals(void)
{
    float x[4] = { 0 };
    case_t c = { .layout = SPC_LAYOUT_BSHD, .B = 1, .S = 1, .H = 1, .D = 4 };
    spc_lse_merge_desc_t d = desc_of(&c, x, x, x, x, x, x), bad;

    CHECK_ST(NULL, spc_lse_merge(NULL), SPC_ERR_INVALID_ARG);
    bad = d;
    bad.struct_size = 8;
    CHECK_ST(NULL, spc_lse_merge(&bad), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(NULL), "spc_lse_merge_desc_t.struct_size");
    bad = d;
    bad.head_dim = 0;
    CHECK_ST(NULL, spc_lse_merge(&bad), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(NULL), "a size is 0");
    bad = d;
    bad.layout = 2;
    CHECK_ST(NULL, spc_lse_merge(&bad), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(NULL), "layout 2");
    bad = d;
    bad.memory = 7;
    CHECK_ST(NULL, spc_lse_merge(&bad), SPC_ERR_INVALID_ARG);
    bad = d;
    bad.lse_b = NULL;
    CHECK_ST(NULL, spc_lse_merge(&bad), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(NULL), "NULL");
    bad = d;
    bad.batch = bad.seq_len = bad.heads = bad.head_dim = UINT32_MAX;
    CHECK_ST(NULL, spc_lse_merge(&bad), SPC_ERR_INVALID_ARG);
#ifndef SP_TEST_WITH_CUDA
    /* Built without CUDA: device memory is refused, saying so, before any
     * pointer is touched. */
    bad = d;
    bad.memory = SPC_MEMORY_CUDA;
    CHECK_ST(NULL, spc_lse_merge(&bad), SPC_ERR_NO_DEVICE);
    CHECK_CONTAINS(spc_last_error(NULL), "SP_WITH_CUDA=OFF");
#endif
}

int main(void)
{
    test_definition(SPC_LAYOUT_BSHD, 2, 9, 3, 8);
    test_definition(SPC_LAYOUT_SBHD, 3, 5, 2, 7);
    test_definition(SPC_LAYOUT_BSHD, 1, 64, 4, 64);
    test_exact_rows();
    test_refusals();
    printf("lse_merge: ok\n");
    return 0;
}
