/*
 * sp_kern_merge.h — the fp32 out/LSE merge of ring attention, written once for the
 * host reference (kernels/host/merge.c) and the CUDA kernel (kernels/cuda/merge.cu).
 *
 * Attention over two disjoint key sets A and B gives (out_a, lse_a) and (out_b,
 * lse_b); over their union, with m = max(lse_a, lse_b) and e = exp(min - m):
 *
 *   lse = m + log1p(e)
 *   out = out_max / (1 + e) + out_min e / (1 + e)
 *
 * where out_max is the side whose lse is m. A side whose lse is -inf (it saw no
 * key, or every key was masked) contributes nothing: the other side is copied,
 * whatever its partner's out holds; both -inf give lse -inf and out 0. A NaN
 * lse, or two +inf, give NaN.
 *
 * The same bits on host and device: exp and log1p are computed here in double
 * with + - * / alone (libm's and CUDA's expf and logf differ in their last bits),
 * every output element is (float)(out_a ca + out_b cb) in double, and every NaN
 * written is the canonical quiet NaN (a GPU does not keep NaN payloads through
 * arithmetic as x86 does). IEEE basic operations round identically on both only
 * if none is fused: the CUDA files are compiled with --fmad=false and the host
 * files with -ffp-contract=off (kernels/CMakeLists.txt).
 */
#ifndef SP_KERN_MERGE_H
#define SP_KERN_MERGE_H

#include "sp_kern_a2a.h"

#ifdef __cplusplus
extern "C" {
#endif

/* out is [B, S, H, D] (BSHD) or [S, B, H, D] (SBHD) fp32; lse is [B, H, S] fp32. */
typedef struct sp_kern_lse_merge {
    uint32_t layout;      /* of out: enum sp_kern_layout */
    uint32_t batch, seq_len, heads, head_dim;
} sp_kern_lse_merge_t;

/*
 * The host reference: (out, lse) = the merge of (out_a, lse_a) and (out_b, lse_b).
 * out may be out_a or out_b and lse may be lse_a or lse_b (in place); no other
 * overlap. Returns 0, or -1 when a size is zero or the layout unknown.
 */
int sp_kern_lse_merge_host(float *out, float *lse, const float *out_a, const float *lse_a, const float *out_b,
                           const float *lse_b, const sp_kern_lse_merge_t *m);

#ifdef __cplusplus
}
#endif

/* How one (b, s, h) row of out is made from the two sides. */
enum sp_kern_lse_take {
    SP_KERN_TAKE_ZERO = 0,   /* both sides -inf */
    SP_KERN_TAKE_A    = 1,   /* b is -inf: a copied */
    SP_KERN_TAKE_B    = 2,   /* a is -inf: b copied */
    SP_KERN_TAKE_BOTH = 3,   /* out_a ca + out_b cb */
    SP_KERN_TAKE_NAN  = 4,
};

typedef struct sp_kern_lse_weights {
    double   ca, cb;
    float    lse;
    uint32_t take;           /* enum sp_kern_lse_take */
} sp_kern_lse_weights_t;

SP_KERN_HD float sp_kern_qnan_f32(void)
{
    return sp_kern_f32_from_bits(0x7fc00000u);
}

SP_KERN_HD float sp_kern_canon_f32(float x)
{
    return x != x ? sp_kern_qnan_f32() : x;
}

/* exp(d) for d <= 0. Below -200 it is 0: exp(-200) < 2^-288 changes neither lse
 * nor any fp32 coefficient. d = k ln2 + r, |r| <= ln2 / 2 (ln2 in two parts, the
 * high one with enough trailing zeros that k ln2_hi is exact), exp(r) by its
 * Taylor series to r^13 (the rest is below 2^-57), times 2^k built from bits. */
SP_KERN_HD double sp_kern_exp_neg(double d)
{
    if (d < -200.0)
        return 0.0;
    int k = (int)(d * 1.4426950408889634 - 0.5);   /* d <= 0: truncation rounds to nearest */
    double r = (d - k * 6.93147180369123816490e-01) - k * 1.90821492927058770002e-10;
    double p = 1.0 / 6227020800.0;                  /* 1/13! */
    const double inv_fact[13] = { 1.0, 1.0, 1.0 / 2, 1.0 / 6, 1.0 / 24, 1.0 / 120, 1.0 / 720, 1.0 / 5040,
                                  1.0 / 40320, 1.0 / 362880, 1.0 / 3628800, 1.0 / 39916800, 1.0 / 479001600 };
    for (int i = 12; i >= 0; i--)
        p = p * r + inv_fact[i];
    uint64_t bits = (uint64_t)(k + 1023) << 52;
    double scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* log(1 + e) for 0 <= e <= 1: 2 atanh(z), z = u / (2 + u), with 1 + e = 2 (1 + u)
 * and ln2 added when 1 + e > sqrt 2, so that |z| <= 0.172 and the series to z^21
 * is exact to 2^-56. */
SP_KERN_HD double sp_kern_log1p_unit(double e)
{
    double u = e, add = 0.0;
    if (e > 0.41421356237309503) {
        u = (e - 1.0) * 0.5;
        add = 6.93147180559945286227e-01;
    }
    double z = u / (2.0 + u), z2 = z * z, p = 1.0 / 21;
    for (int n = 9; n >= 0; n--)
        p = p * z2 + 1.0 / (2 * n + 1);
    return add + 2.0 * z * p;
}

SP_KERN_HD sp_kern_lse_weights_t sp_kern_lse_weigh(float la, float lb)
{
    sp_kern_lse_weights_t w = { 0.0, 0.0, 0.0f, SP_KERN_TAKE_NAN };
    const float ninf = sp_kern_f32_from_bits(0xff800000u);
    if (la != la || lb != lb) {
        w.lse = sp_kern_qnan_f32();
        return w;
    }
    if (la == ninf || lb == ninf) {
        w.take = la == ninf && lb == ninf ? SP_KERN_TAKE_ZERO : la == ninf ? SP_KERN_TAKE_B : SP_KERN_TAKE_A;
        w.lse = la == ninf ? lb : la;
        return w;
    }
    bool a_max = la >= lb;
    double m = a_max ? la : lb, d = (double)(a_max ? lb : la) - m;
    if (!(d <= 0.0)) {            /* +inf - +inf */
        w.lse = sp_kern_qnan_f32();
        return w;
    }
    double e = sp_kern_exp_neg(d), c_max = 1.0 / (1.0 + e), c_min = e / (1.0 + e);
    w.take = SP_KERN_TAKE_BOTH;
    w.ca = a_max ? c_max : c_min;
    w.cb = a_max ? c_min : c_max;
    w.lse = (float)(m + sp_kern_log1p_unit(e));
    return w;
}

SP_KERN_HD float sp_kern_lse_out(const sp_kern_lse_weights_t *w, float oa, float ob)
{
    switch (w->take) {
    case SP_KERN_TAKE_ZERO: return 0.0f;
    case SP_KERN_TAKE_A: return sp_kern_canon_f32(oa);
    case SP_KERN_TAKE_B: return sp_kern_canon_f32(ob);
    case SP_KERN_TAKE_BOTH: return sp_kern_canon_f32((float)((double)oa * w->ca + (double)ob * w->cb));
    }
    return sp_kern_qnan_f32();
}

#endif /* SP_KERN_MERGE_H */
