/*
 * Host reduction kernels against plain references written here, independently of
 * kernels/: fp32 and fp64 operators, wrapping integer sums, the fp16 conversions
 * against GCC's _Float16 (widening over all 65536 patterns, narrowing over random
 * bit patterns, every tie and the overflow and subnormal edges), the bf16 ones
 * against rounding done in double, the fp32 accumulation of 16-bit types, and the
 * bits of folds over ranks in rank order.
 */
#include <math.h>

#include "sp_kern.h"
#include "sp_test.h"

/* ---- helpers ---- */

static uint64_t rng_state = 0x243F6A8885A308D3ull;

/* splitmix64: deterministic, so a failure reproduces. */
static uint64_t rng(void)
{
    uint64_t z = (rng_state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint32_t f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static float f32_of(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static bool h16_is_nan(uint16_t h, unsigned dtype)
{
    uint16_t exp = dtype == SP_KERN_F16 ? 0x7c00 : 0x7f80;
    return (h & exp) == exp && (h & ~exp & 0x7fff) != 0;
}

/* Same bits, except that any NaN matches any NaN. */
static void check_f32_same(float got, float want, const char *what, uint64_t i)
{
    if (isnan(got) && isnan(want))
        return;
    if (f32_bits(got) != f32_bits(want))
        SP_FAIL("%s [%" PRIu64 "]: got %a (0x%08x), expected %a (0x%08x)", what, i, (double)got, f32_bits(got),
                (double)want, f32_bits(want));
}

static void check_h16_same(uint16_t got, uint16_t want, unsigned dtype, const char *what, float in)
{
    if (h16_is_nan(got, dtype) && h16_is_nan(want, dtype))
        return;
    if (got != want)
        SP_FAIL("%s(%a = 0x%08x): got 0x%04x, expected 0x%04x", what, (double)in, f32_bits(in), got, want);
}

/* ---- references ---- */

static float ref_f16_to_f32(uint16_t h)
{
    _Float16 x;
    memcpy(&x, &h, sizeof x);
    return (float)x;
}

static uint16_t ref_f32_to_f16(float f)
{
    _Float16 x = (_Float16)f;
    uint16_t h;
    memcpy(&h, &x, sizeof h);
    return h;
}

/* bf16 from its fields, in double: (1.m) * 2^(e-127), or 0.m * 2^-126. */
static float ref_bf16_to_f32(uint16_t h)
{
    int exp = (h >> 7) & 0xff, man = h & 0x7f;
    double sign = (h & 0x8000) ? -1.0 : 1.0;
    if (exp == 0xff)
        return man ? NAN : (float)(sign * INFINITY);
    if (exp == 0)
        return (float)(sign * ldexp(man, -133));
    return (float)(sign * ldexp(128 + man, exp - 134));
}

/*
 * fp32 to bf16 by arithmetic in double: bf16 keeps 8 significant bits, so its
 * spacing at |x| is q = 2^(exponent of x - 7), never below the subnormal spacing
 * 2^-133. Of the two multiples of q around |x|, take the nearer, or on a tie the
 * one that is an even multiple; 2^128 and up is infinity.
 */
static uint16_t ref_f32_to_bf16(float f)
{
    if (isnan(f))
        return 0x7fc0;
    uint16_t sign = signbit(f) ? 0x8000 : 0;
    double x = fabs((double)f);
    if (isinf(x))
        return sign | 0x7f80;
    int e;
    frexp(x, &e);                       /* x = m * 2^e, m in [0.5, 1) */
    double q = ldexp(1.0, e - 8 > -133 ? e - 8 : -133);
    double k = floor(x / q), lo = k * q, hi = lo + q;
    double pick = x - lo < hi - x ? lo : hi - x < x - lo ? hi : fmod(k, 2) == 0 ? lo : hi;
    if (pick >= 0x1p128)
        return sign | 0x7f80;
    return sign | (uint16_t)(f32_bits((float)pick) >> 16);
}

static float ref_widen(uint16_t h, unsigned dtype)
{
    return dtype == SP_KERN_F16 ? ref_f16_to_f32(h) : ref_bf16_to_f32(h);
}

static uint16_t ref_narrow(float f, unsigned dtype)
{
    return dtype == SP_KERN_F16 ? ref_f32_to_f16(f) : ref_f32_to_bf16(f);
}

static double ref(double a, double b, unsigned op)
{
    if (isnan(a) || isnan(b))
        return op == SP_KERN_SUM ? a + b : (isnan(a) ? a : b);
    switch (op) {
    case SP_KERN_SUM: return a + b;
    case SP_KERN_MAX: return a > b ? a : b;
    default:          return a < b ? a : b;
    }
}

/* In float, so that a sum rounds once, in fp32, as the kernel's does. */
static float ref_f32(float a, float b, unsigned op)
{
    return op == SP_KERN_SUM ? a + b : (float)ref(a, b, op);
}

/* ---- fp32, fp64 ---- */

static void test_float_ops(void)
{
    enum { N = 1000 };
    srand(7);
    for (unsigned op = SP_KERN_SUM; op <= SP_KERN_MIN; op++) {
        float af[N], bf[N], ef[N];
        double ad[N], bd[N], ed[N];
        for (int i = 0; i < N; i++) {
            af[i] = (float)(rand() % 2001 - 1000) / 7.0f;
            bf[i] = (float)(rand() % 2001 - 1000) / 3.0f;
            ad[i] = (double)(rand() % 2001 - 1000) / 7.0;
            bd[i] = (double)(rand() % 2001 - 1000) / 3.0;
        }
        af[3] = NAN;
        bd[5] = NAN;
        for (int i = 0; i < N; i++) {
            ef[i] = ref_f32(af[i], bf[i], op);
            ed[i] = ref(ad[i], bd[i], op);
        }
        CHECK_EQ(sp_kern_reduce(af, bf, N, SP_KERN_F32, op), 0);
        CHECK_EQ(sp_kern_reduce(ad, bd, N, SP_KERN_F64, op), 0);
        for (int i = 0; i < N; i++) {
            check_f32_same(af[i], ef[i], "fp32 reduce", (uint64_t)i);
            if (isnan(ed[i]))
                CHECK(isnan(ad[i]));
            else
                CHECK(memcmp(&ad[i], &ed[i], sizeof ad[i]) == 0);
        }
    }
}

/* NaN bits are part of the result: the first NaN operand, unchanged; inf - inf
 * the canonical quiet NaN (the GPU kernel gives the same, tests/gpu). */
static void test_nan_bits(void)
{
    uint32_t payload = 0x7fc01234u, neg = 0xffc00007u, canon = 0x7fc00000u;
    float a[4], b[4];
    memcpy(&a[0], &payload, 4);
    b[0] = 1.0f;                          /* NaN + 1: the NaN, its payload kept */
    a[1] = 2.0f;
    memcpy(&b[1], &neg, 4);               /* 2 + NaN: the NaN on the right */
    memcpy(&a[2], &neg, 4);
    memcpy(&b[2], &payload, 4);           /* both: the left one */
    a[3] = INFINITY;
    b[3] = -INFINITY;                     /* inf - inf: canonical */
    CHECK_EQ(sp_kern_reduce(a, b, 4, SP_KERN_F32, SP_KERN_SUM), 0);
    uint32_t got[4];
    memcpy(got, a, sizeof got);
    CHECK_EQ(got[0], payload);
    CHECK_EQ(got[1], neg);
    CHECK_EQ(got[2], neg);
    CHECK_EQ(got[3], canon);
    double c = INFINITY, d = -INFINITY;
    uint64_t cbits;
    CHECK_EQ(sp_kern_reduce(&c, &d, 1, SP_KERN_F64, SP_KERN_SUM), 0);
    memcpy(&cbits, &c, 8);
    CHECK_EQ(cbits, 0x7ff8000000000000ull);
}

/* ---- int32, int64 ---- */

static int64_t ref_i64(int64_t a, int64_t b, unsigned op)
{
    int64_t sum;
    switch (op) {
    case SP_KERN_SUM: __builtin_add_overflow(a, b, &sum); return sum;   /* wraps */
    case SP_KERN_MAX: return a > b ? a : b;
    default:          return a < b ? a : b;
    }
}

static int32_t ref_i32(int32_t a, int32_t b, unsigned op)
{
    int32_t sum;
    if (op == SP_KERN_SUM) {
        __builtin_add_overflow(a, b, &sum);
        return sum;
    }
    return (int32_t)ref_i64(a, b, op);
}

/* Random values, with the extremes often, so that sums overflow both ways. */
static int64_t int_value(unsigned dtype)
{
    static const int64_t edge32[] = { INT32_MAX, INT32_MIN, -1, 0, 1, INT32_MAX - 1, INT32_MIN + 1 };
    static const int64_t edge64[] = { INT64_MAX, INT64_MIN, -1, 0, 1, INT64_MAX - 1, INT64_MIN + 1 };
    uint64_t r = rng();
    if (r % 4 == 0)
        return dtype == SP_KERN_I32 ? edge32[(r >> 8) % 7] : edge64[(r >> 8) % 7];
    return dtype == SP_KERN_I32 ? (int32_t)(uint32_t)(r >> 16) : (int64_t)r;
}

static void test_int_ops(void)
{
    enum { N = 4096 };
    static int32_t a32[N], b32[N], e32[N];
    static int64_t a64[N], b64[N], e64[N];
    for (unsigned op = SP_KERN_SUM; op <= SP_KERN_MIN; op++) {
        for (int i = 0; i < N; i++) {
            a32[i] = (int32_t)int_value(SP_KERN_I32);
            b32[i] = (int32_t)int_value(SP_KERN_I32);
            a64[i] = int_value(SP_KERN_I64);
            b64[i] = int_value(SP_KERN_I64);
            e32[i] = ref_i32(a32[i], b32[i], op);
            e64[i] = ref_i64(a64[i], b64[i], op);
        }
        CHECK_EQ(sp_kern_reduce(a32, b32, N, SP_KERN_I32, op), 0);
        CHECK_EQ(sp_kern_reduce(a64, b64, N, SP_KERN_I64, op), 0);
        for (int i = 0; i < N; i++) {
            CHECK_EQ(a32[i], e32[i]);
            CHECK_EQ(a64[i], e64[i]);
        }
    }
    /* The wrap itself, spelled out rather than computed. */
    int32_t x32[2] = { INT32_MAX, INT32_MIN }, y32[2] = { 1, -1 };
    int64_t x64[2] = { INT64_MAX, INT64_MIN }, y64[2] = { 1, -1 };
    CHECK_EQ(sp_kern_reduce(x32, y32, 2, SP_KERN_I32, SP_KERN_SUM), 0);
    CHECK_EQ(sp_kern_reduce(x64, y64, 2, SP_KERN_I64, SP_KERN_SUM), 0);
    CHECK_EQ(x32[0], INT32_MIN);
    CHECK_EQ(x32[1], INT32_MAX);
    CHECK(x64[0] == INT64_MIN);
    CHECK(x64[1] == INT64_MAX);
}

/* ---- 16-bit conversions ---- */

static void test_widen(void)
{
    static uint16_t h[65536];
    static float got[65536];
    for (uint32_t i = 0; i < 65536; i++)
        h[i] = (uint16_t)i;
    for (unsigned dtype = SP_KERN_F16; dtype <= SP_KERN_BF16; dtype++) {
        const char *what = dtype == SP_KERN_F16 ? "widen fp16" : "widen bf16";
        CHECK_EQ(sp_kern_widen(got, h, 65536, dtype), 0);
        for (uint32_t i = 0; i < 65536; i++) {
            CHECK_EQ(isnan(got[i]) != 0, h16_is_nan(h[i], dtype));
            check_f32_same(got[i], ref_widen(h[i], dtype), what, i);
        }
    }
}

/*
 * Floats worth narrowing: for every 16-bit value, itself, the exact midpoint to
 * its successor and the floats either side of that midpoint; then random bit
 * patterns (NaNs, infinities and fp32 subnormals among them) and a few edges.
 * Returns the count written to out.
 */
static size_t narrow_inputs(float *out, unsigned dtype)
{
    size_t n = 0;
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i, next = (uint16_t)(i + 1);
        float v = ref_widen(h, dtype);
        out[n++] = v;
        if (isnan(v) || isinf(v) || (next & 0x7fff) == 0 || h16_is_nan(next, dtype))
            continue;
        float w = ref_widen(next, dtype);
        if (isinf(w))       /* the overflow ties are among the edges below */
            continue;
        float mid = (float)(((double)v + (double)w) / 2);     /* exact: 12 or 9 bits needed */
        out[n++] = mid;
        out[n++] = nextafterf(mid, 0.0f);
        out[n++] = nextafterf(mid, signbit(mid) ? -INFINITY : INFINITY);
    }
    for (int i = 0; i < 1 << 20; i++)
        out[n++] = f32_of((uint32_t)rng());
    /* fp32 subnormals and tiny normals: the fp16 zero / smallest-subnormal boundary. */
    for (int i = 0; i < 1 << 16; i++)
        out[n++] = f32_of((uint32_t)(rng() % 0x34000000u) | (rng() & 1 ? 0x80000000u : 0));
    static const float edges[] = { 65504.0f, 65519.99f, 65520.0f, 65536.0f, -65520.0f, 0x1p-24f, 0x1p-25f,
                                   0x1.000002p-25f, 0x1.8p-24f, 0x1.ffep-15f, 0x1p-14f, 0x1.fffffep127f, 0.0f,
                                   -0.0f, INFINITY, -INFINITY, NAN, -NAN };
    for (size_t i = 0; i < sizeof edges / sizeof edges[0]; i++)
        out[n++] = edges[i];
    out[n++] = f32_of(0x7f7f8000u);     /* bf16: the tie between the largest finite and inf */
    out[n++] = f32_of(0x7f7f7fffu);
    out[n++] = f32_of(0xff7f8000u);
    out[n++] = f32_of(0x7f800001u);     /* signalling NaN, payload in the low bits only */
    out[n++] = f32_of(0xff80a000u);
    return n;
}

static void test_narrow(void)
{
    size_t cap = 65536 * 4 + (1 << 20) + (1 << 16) + 64;
    float *in = malloc(cap * sizeof *in);
    uint16_t *got = malloc(cap * sizeof *got);
    CHECK(in != NULL && got != NULL);
    for (unsigned dtype = SP_KERN_F16; dtype <= SP_KERN_BF16; dtype++) {
        const char *what = dtype == SP_KERN_F16 ? "narrow fp16" : "narrow bf16";
        uint16_t quiet = dtype == SP_KERN_F16 ? 0x0200 : 0x0040;
        size_t n = narrow_inputs(in, dtype);
        CHECK(n <= cap);
        CHECK_EQ(sp_kern_narrow(got, in, n, dtype), 0);
        for (size_t i = 0; i < n; i++) {
            check_h16_same(got[i], ref_narrow(in[i], dtype), dtype, what, in[i]);
            if (isnan(in[i]))
                CHECK(h16_is_nan(got[i], dtype) && (got[i] & quiet));
        }
    }
    free(in);
    free(got);
}

/* ---- fp32 accumulation of 16-bit types ---- */

static uint16_t h16_value(unsigned dtype)
{
    uint16_t h = (uint16_t)rng();
    /* Mostly moderate exponents, so that sums do not all overflow or vanish. */
    if (rng() % 8 != 0)
        h = dtype == SP_KERN_F16 ? (uint16_t)((h & 0x83ff) | (0x3000 + (rng() % 0x1800 & 0x7c00)))
                                 : (uint16_t)((h & 0x807f) | (0x3800 + (rng() % 0x1000 & 0x7f80)));
    return h;
}

static void test_reduce_widen(void)
{
    enum { N = 1 << 16 };
    static uint16_t src[N];
    static float acc[N], want[N];
    for (unsigned dtype = SP_KERN_F16; dtype <= SP_KERN_BF16; dtype++) {
        for (unsigned op = SP_KERN_SUM; op <= SP_KERN_MIN; op++) {
            for (int i = 0; i < N; i++) {
                src[i] = h16_value(dtype);
                acc[i] = ref_widen(h16_value(dtype), dtype) * 1.3f;
                want[i] = ref_f32(acc[i], ref_widen(src[i], dtype), op);
            }
            CHECK_EQ(sp_kern_reduce_widen(acc, src, N, dtype, op), 0);
            for (int i = 0; i < N; i++)
                check_f32_same(acc[i], want[i], "reduce_widen", (uint64_t)i);
        }
    }
}

/* ---- folds over ranks, in rank order ---- */

/* What a caller does: widen rank 0, fold the others in, narrow once. */
static void fold_16(uint16_t *out, uint16_t *const *ranks, int nranks, uint64_t n, unsigned dtype,
                    unsigned op, float *acc)
{
    CHECK_EQ(sp_kern_acc_dtype(dtype), SP_KERN_F32);
    CHECK_EQ(sp_kern_widen(acc, ranks[0], n, dtype), 0);
    for (int r = 1; r < nranks; r++)
        CHECK_EQ(sp_kern_reduce_widen(acc, ranks[r], n, dtype, op), 0);
    CHECK_EQ(sp_kern_narrow(out, acc, n, dtype), 0);
}

static void test_fold_known(void)
{
    /* fp32: 1 + 1e8 rounds back to 1e8, so rank order gives 1, not 2. */
    float f[4] = { 1.0f, 1e8f, -1e8f, 1.0f };
    for (int r = 1; r < 4; r++)
        CHECK_EQ(sp_kern_reduce(&f[0], &f[r], 1, SP_KERN_F32, SP_KERN_SUM), 0);
    CHECK_EQ(f32_bits(f[0]), f32_bits(1.0f));

    /* 16 bits, one rounding at the end: 2048+1+1+1 = 2051 in fp32, a tie between
     * fp16 2050 (odd) and 2052 (even); rounding per rank would give 2048. For
     * bf16 the same at 256+1+1+1 = 259, between 258 and 260. */
    static const uint16_t f16[4] = { 0x6800, 0x3c00, 0x3c00, 0x3c00 }, bf16[4] = { 0x4380, 0x3f80, 0x3f80, 0x3f80 };
    uint16_t r16[4][1], out;
    uint16_t *ranks[4] = { r16[0], r16[1], r16[2], r16[3] };
    float acc;
    for (int r = 0; r < 4; r++)
        r16[r][0] = f16[r];
    fold_16(&out, ranks, 4, 1, SP_KERN_F16, SP_KERN_SUM, &acc);
    CHECK_EQ(out, 0x6802);
    for (int r = 0; r < 4; r++)
        r16[r][0] = bf16[r];
    fold_16(&out, ranks, 4, 1, SP_KERN_BF16, SP_KERN_SUM, &acc);
    CHECK_EQ(out, 0x4382);

    /* int32: MAX + 1 wraps to MIN, + -1 wraps back to MAX, + MIN is -1. */
    int32_t i32[4] = { INT32_MAX, 1, -1, INT32_MIN };
    int64_t i64[4] = { INT64_MAX, 1, -1, INT64_MIN };
    for (int r = 1; r < 4; r++) {
        CHECK_EQ(sp_kern_reduce(&i32[0], &i32[r], 1, SP_KERN_I32, SP_KERN_SUM), 0);
        CHECK_EQ(sp_kern_reduce(&i64[0], &i64[r], 1, SP_KERN_I64, SP_KERN_SUM), 0);
    }
    CHECK_EQ(i32[0], -1);
    CHECK_EQ(i64[0], -1);
}

static void test_fold_random(void)
{
    enum { N = 1 << 14, RANKS = 4 };
    static uint16_t in[RANKS][N], out[N];
    static float acc[N];
    uint16_t *ranks[RANKS] = { in[0], in[1], in[2], in[3] };
    for (unsigned dtype = SP_KERN_F16; dtype <= SP_KERN_BF16; dtype++) {
        for (unsigned op = SP_KERN_SUM; op <= SP_KERN_MIN; op++) {
            for (int r = 0; r < RANKS; r++)
                for (int i = 0; i < N; i++)
                    in[r][i] = h16_value(dtype);
            fold_16(out, ranks, RANKS, N, dtype, op, acc);
            for (int i = 0; i < N; i++) {
                float want = ref_widen(in[0][i], dtype);
                for (int r = 1; r < RANKS; r++)
                    want = ref_f32(want, ref_widen(in[r][i], dtype), op);
                check_h16_same(out[i], ref_narrow(want, dtype), dtype, "rank-order fold", want);
            }
        }
    }
}

/* ---- what each call takes ---- */

static void test_arguments(void)
{
    for (unsigned dtype = 0; dtype <= SP_KERN_U8 + 1; dtype++) {
        bool known = dtype >= SP_KERN_F32 && dtype <= SP_KERN_I64;
        bool narrow = dtype == SP_KERN_F16 || dtype == SP_KERN_BF16;
        for (unsigned op = 0; op <= SP_KERN_MIN + 1; op++)
            CHECK_EQ(sp_kern_reduce_supported(dtype, op), known && op <= SP_KERN_MIN);
        CHECK_EQ(sp_kern_acc_dtype(dtype), narrow ? SP_KERN_F32 : dtype);
    }
    uint64_t x = 0;
    float f = 0;
    CHECK_EQ(sp_kern_reduce(&x, &x, 1, SP_KERN_F16, SP_KERN_SUM), -1);
    CHECK_EQ(sp_kern_reduce(&x, &x, 1, SP_KERN_BF16, SP_KERN_SUM), -1);
    CHECK_EQ(sp_kern_reduce(&x, &x, 1, SP_KERN_U8, SP_KERN_SUM), -1);
    CHECK_EQ(sp_kern_reduce(&x, &x, 1, SP_KERN_F32, 9), -1);
    CHECK_EQ(sp_kern_reduce(&x, &x, 1, SP_KERN_I64, 9), -1);
    CHECK_EQ(sp_kern_widen(&f, &x, 1, SP_KERN_F32), -1);
    CHECK_EQ(sp_kern_narrow(&x, &f, 1, SP_KERN_I32), -1);
    CHECK_EQ(sp_kern_reduce_widen(&f, &x, 1, SP_KERN_F32, SP_KERN_SUM), -1);
    CHECK_EQ(sp_kern_reduce_widen(&f, &x, 1, SP_KERN_F16, 9), -1);
}

int main(void)
{
    test_nan_bits();
    test_float_ops();
    test_int_ops();
    test_widen();
    test_narrow();
    test_reduce_widen();
    test_fold_known();
    test_fold_random();
    test_arguments();
    printf("kern: ok\n");
    return 0;
}
