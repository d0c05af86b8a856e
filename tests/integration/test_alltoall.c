/*
 * test_alltoall.c — the Ulysses all-to-all through a real spd, byte for byte.
 *
 * Every expected byte comes from a reference written here with plain index
 * loops from the contract in spclient.h (and nothing else: no library helper
 * computes a shape or a head here). Each process can generate every rank's
 * input, so each rank builds its own expected output locally and compares.
 *
 * Each case runs, on every rank of its group:
 *   1. seq->head of every tensor, checked against the reference (padding rows
 *      of the input dropped, dummy heads zero, replicated KV heads on each of
 *      their ranks), in flight together with
 *   2. head->seq of independent rank-specific input, checked against the
 *      reference (dummy heads dropped, replicated KV heads from the first copy
 *      or, with SPC_A2A_SUM_REPLICAS, summed in rank order, padding rows zero);
 *   3. head->seq of the output of step 1 (the round trip), which must give the
 *      input back bit for bit in the true rows and zeros in the padding rows.
 * Receive buffers start out filled with a pattern, so zeros must be written,
 * and carry a canary past their end, so nothing may be written beyond them.
 *
 * Cases: P = 2, 3, 4 and 8; both layouts; fp32, fp64, fp16 and bf16; up to eight
 * tensors with their own head counts and head dims in one op (GatedDeltaNet's
 * q, k, v, beta and gate: five tensors, two head counts, beta and gate of
 * head dim 1; the last four of a descriptor in more_tensors); dummy heads
 * (28 heads on 8 ranks, 7 on 4, 5 on 3, 3 on 2, and inside a GQA group);
 * replicated KV heads (MQA and GQA with fewer KV heads than ranks, 2 KV heads
 * on 8 ranks); short sequences (7 rows on 2 ranks, a rank with padding only);
 * tensors large enough that spd splits their copies into chunks;
 * arena, registered (mmap and posix_memalign) and mixed buffers; a mesh whose
 * Ulysses and ring groups are not the world; and ranks that disagree.
 */
#include <math.h>
#include <sys/mman.h>
#include <time.h>

#include "sp_test.h"

#define MAXT       SPC_A2A_MAX_TENSORS
#define MAXP       8
#define TIMEOUT_MS 20000
#define CANARY     256    /* bytes past each receive buffer that must stay untouched */
#define FILLBYTE   0x5A   /* what receive buffers hold before an op */
#define MAXBAD     6      /* mismatches printed per buffer */

enum mem_kind {
    MEM_ARENA = 0,        /* every buffer from spc_alloc */
    MEM_MMAP,             /* every buffer in one mmap'd, registered region */
    MEM_MIXED,            /* sends in the arena, receives in a registered posix_memalign block */
};

typedef struct tcase_tensor {
    uint32_t heads, head_dim, kind, flags;
} tcase_tensor_t;

typedef struct tcase {
    const char    *name;
    uint32_t       P;
    spc_dtype_t    dtype;
    uint32_t       layout, batch, seq_len, kv_heads, ntensors;
    tcase_tensor_t t[MAXT];
    int            mem;
} tcase_t;

#define Q(h, d)    { h, d, SPC_HEADS_Q, 0 }
#define KV(h, d)   { h, d, SPC_HEADS_KV, 0 }
#define KVS(h, d)  { h, d, SPC_HEADS_KV, SPC_A2A_SUM_REPLICAS }
#define BSHD SPC_LAYOUT_BSHD
#define SBHD SPC_LAYOUT_SBHD

/* Dummy heads: 3 on 2 ranks, 5 on 3, 7 on 4, 28 on 8 (4 dummies), and inside a GQA group (6q/2kv on 4:
 * groups of 3 query heads split over 2 ranks). Replicated KV heads: MQA on 2 and 8 ranks, 1 KV head on 3,
 * 2 on 4, 2 on 8 (x4), 4 on 8. KVS tensors sum their replicas on head->seq. "large": copies split into
 * chunks. S=4 on 3 ranks: rank 2 holds padding rows only. */
static const tcase_t cases[] = {
    /* name                        P  dtype     layout B  S     kv n  tensors                                memory */
    { "S=7, qkv fp32",             2, SPC_F32,  BSHD, 2, 7,    0, 3, { Q(4, 8), KV(4, 16), KVS(4, 4) },     MEM_ARENA },
    { "3 heads fp64",              2, SPC_F64,  SBHD, 3, 10,   0, 1, { Q(3, 5) },                           MEM_MMAP },
    { "MQA 6q/1kv fp16",           2, SPC_F16,  BSHD, 1, 12,   1, 3, { Q(6, 8), KVS(1, 8), KV(1, 6) },      MEM_ARENA },
    { "GQA 4q/2kv bf16",           2, SPC_BF16, SBHD, 2, 5,    2, 3, { Q(4, 4), KV(2, 4), KVS(2, 2) },      MEM_MIXED },

    { "GQA 12q/3kv fp32",          3, SPC_F32,  BSHD, 2, 20,   3, 3, { Q(12, 8), KV(3, 8), KV(3, 8) },      MEM_ARENA },
    { "5 heads, 1 kv, bf16",       3, SPC_BF16, SBHD, 2, 5,    0, 2, { Q(5, 6), KVS(1, 6) },                MEM_MMAP },
    { "S=4 fp64",                  3, SPC_F64,  BSHD, 1, 4,    0, 2, { Q(3, 4), KV(3, 4) },                 MEM_ARENA },

    { "7 heads fp64",              4, SPC_F64,  BSHD, 2, 13,   0, 1, { Q(7, 8) },                           MEM_ARENA },
    { "GQA 8q/2kv fp32",           4, SPC_F32,  SBHD, 2, 16,   2, 3, { Q(8, 8), KV(2, 8), KVS(2, 16) },     MEM_ARENA },
    { "GQA 6q/2kv fp16",           4, SPC_F16,  BSHD, 1, 11,   2, 3, { Q(6, 4), KVS(2, 4), KV(2, 4) },      MEM_MIXED },
    { "4 heads bf16",              4, SPC_BF16, BSHD, 2, 17,   0, 2, { Q(4, 8), KV(4, 8) },                 MEM_MMAP },
    { "large GQA 8q/2kv fp32",     4, SPC_F32,  BSHD, 2, 1001, 2, 3, { Q(8, 64), KVS(2, 64), KV(2, 64) },   MEM_ARENA },

    { "28 heads fp32",             8, SPC_F32,  BSHD, 2, 37,   0, 1, { Q(28, 8) },                          MEM_ARENA },
    { "GQA 16q/2kv bf16",          8, SPC_BF16, SBHD, 2, 24,   2, 3, { Q(16, 8), KVS(2, 8), KV(2, 4) },     MEM_MIXED },
    { "GQA 28q/4kv fp16",          8, SPC_F16,  BSHD, 1, 50,   4, 4, { Q(28, 8), KV(4, 8), KVS(4, 16), KV(4, 2) },
      MEM_ARENA },
    { "GQA 28q/4kv fp64",          8, SPC_F64,  SBHD, 2, 19,   4, 3, { Q(28, 4), KVS(4, 4), KV(4, 4) },     MEM_MMAP },
    { "MQA 8q/1kv fp32, S_loc=1",  8, SPC_F32,  BSHD, 1, 8,    1, 2, { Q(8, 4), KVS(1, 4) },                MEM_ARENA },
    { "large GQA 16q/2kv bf16",    8, SPC_BF16, SBHD, 2, 515, 2, 3, { Q(16, 128), KVS(2, 128), KV(2, 128) }, MEM_MMAP },

    /* GatedDeltaNet: q, k (H_k heads), v, beta, gate (H_v heads; beta and gate of head dim 1) in one op.
     * 5 and 10 heads on 4 ranks are padded with dummies; k replicated where it has fewer heads than ranks. */
    { "GDN qkv+beta+a 5k/10v fp32", 4, SPC_F32, BSHD, 2, 13,   0, 5, { Q(5, 8), Q(5, 8), Q(10, 16), Q(10, 1), Q(10, 1) },
      MEM_ARENA },
    { "GDN 2k/5v, k replicated bf16", 4, SPC_BF16, SBHD, 2, 9, 0, 5, { Q(2, 4), KVS(2, 4), Q(5, 8), Q(5, 1), Q(5, 1) },
      MEM_MIXED },
    { "8 tensors fp64",            2, SPC_F64,  BSHD, 2, 7,    0, 8, { Q(3, 4), KV(1, 4), KVS(1, 2), Q(4, 8), Q(4, 1),
                                                                        Q(4, 1), KV(2, 3), Q(5, 2) },   MEM_MMAP },
    { "8 tensors, S=4 fp32",       3, SPC_F32,  SBHD, 1, 4,    0, 8, { Q(5, 4), Q(5, 4), Q(7, 8), Q(7, 1), Q(7, 1),
                                                                        KV(1, 4), KVS(1, 4), Q(3, 2) }, MEM_MIXED },
    { "GDN GQA 28q/4kv, 6 tensors fp16", 8, SPC_F16, BSHD, 1, 21, 4, 6, { Q(28, 4), KV(4, 4), KVS(4, 2), KV(4, 1),
                                                                        KV(4, 1), Q(28, 2) },           MEM_ARENA },
};
#define NCASES (sizeof cases / sizeof cases[0])

/* ================================================================ values */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 31;
    x *= 0xD6E8FEB86659FD93ull;
    x ^= x >> 29;
    x *= 0x9E3779B97F4A7C15ull;
    x ^= x >> 32;
    return x;
}

/* A key from a list of coordinates. */
static uint64_t keyv(const uint64_t *v, int n)
{
    uint64_t x = 0x243F6A8885A308D3ull;
    for (int i = 0; i < n; i++)
        x = mix64(x ^ (v[i] + 0xBF58476D1CE4E5B9ull * (uint64_t)(i + 1)));
    return x;
}
#define KEY(...)                                                                                       \
    keyv((const uint64_t[]){ __VA_ARGS__ }, (int)(sizeof((const uint64_t[]){ __VA_ARGS__ }) / sizeof(uint64_t)))

/* Both signs, magnitudes over 2^-24 .. 2^24: sums of these depend on their order. */
static double wide_value(uint64_t x)
{
    double m = (double)(x & 0xFFFFF) / (double)0xFFFFF + 0.5;
    int e = (int)((x >> 20) % 48) - 24;
    return ((x >> 40) & 1 ? -1.0 : 1.0) * ldexp(m, e);
}

static float f16_to_f32(uint16_t h)
{
    uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float v;
    if (e == 0)
        v = ldexpf((float)m, -24);
    else if (e == 31)
        v = m ? NAN : INFINITY;
    else
        v = ldexpf((float)(m | 0x400), (int)e - 25);
    return (h & 0x8000) ? -v : v;
}

/* Round to nearest, ties to even. */
static uint16_t f32_to_f16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u)
        return sign | 0x7e00;                     /* NaN */
    if (ax >= 0x47800000u)
        return sign | 0x7c00;                     /* >= 65536: infinity */
    if (ax < 0x38800000u) {                       /* below 2^-14: a subnormal (or the smallest normal) */
        double units = fabs((double)f) * 16777216.0;   /* in units of 2^-24, exact */
        double r = nearbyint(units);              /* default rounding mode: to nearest even */
        return sign | (uint16_t)r;
    }
    uint32_t base = (ax >> 13) - (112u << 10);    /* rebias the exponent 127 -> 15 */
    uint32_t rem = ax & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (base & 1)))
        base++;                                   /* a carry into the exponent is right, up to infinity */
    return sign | (uint16_t)base;
}

static float bf16_to_f32(uint16_t b)
{
    uint32_t x = (uint32_t)b << 16;
    float f;
    memcpy(&f, &x, sizeof f);
    return f;
}

static uint16_t f32_to_bf16(float f)
{
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x40);
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1)) >> 16);
}

static size_t esize(spc_dtype_t dt)
{
    return dt == SPC_F64 ? 8 : dt == SPC_F32 ? 4 : 2;
}

static const char *dtname(spc_dtype_t dt)
{
    return dt == SPC_F64 ? "fp64" : dt == SPC_F32 ? "fp32" : dt == SPC_F16 ? "fp16" : "bf16";
}

/* One element of dtype from a key. 16-bit types get arbitrary bit patterns (the
 * all-to-all only moves bytes) unless `finite`: then values of moderate size,
 * for the tensors whose copies are summed. */
static void gen(void *dst, spc_dtype_t dt, uint64_t key, bool finite)
{
    uint64_t x = mix64(key);
    switch (dt) {
    case SPC_F64: {
        double v = wide_value(x);
        memcpy(dst, &v, 8);
        break;
    }
    case SPC_F32: {
        float v = (float)wide_value(x);
        memcpy(dst, &v, 4);
        break;
    }
    default: {
        uint16_t v = (uint16_t)(x >> 24);
        if (finite) {
            double m = (double)(x & 0xFFFFF) / (double)0xFFFFF + 0.5;
            float f = (float)(((x >> 40) & 1 ? -1.0 : 1.0) * ldexp(m, (int)((x >> 20) % 12) - 6));
            v = dt == SPC_F16 ? f32_to_f16(f) : f32_to_bf16(f);
        }
        memcpy(dst, &v, 2);
        break;
    }
    }
}

/* ================================================================ the reference */

/* Where element (b, s, h, d) of an array of `rows` rows and H heads lies, in elements. */
static size_t eoff(uint32_t layout, uint32_t B, uint32_t rows, uint32_t H, uint32_t D, uint32_t b, uint32_t s,
                   uint32_t h, uint32_t d)
{
    if (layout == SPC_LAYOUT_BSHD)
        return (((size_t)b * rows + s) * H + h) * D + d;
    return (((size_t)s * B + b) * H + h) * D + d;
}

/* Head groups of a tensor: kv_heads of the descriptor for a query tensor (0: one
 * per head), its own heads for a key/value tensor. */
static uint32_t ref_groups(const tcase_t *c, const tcase_tensor_t *t)
{
    if (t->kind == SPC_HEADS_KV)
        return t->heads;
    return c->kv_heads ? c->kv_heads : t->heads;
}

/* Heads a rank holds on the head side, dummies included. */
static uint32_t ref_hloc(const tcase_t *c, const tcase_tensor_t *t, uint32_t P)
{
    uint32_t n = ref_groups(c, t), g = t->heads / n;
    if (n >= P) {
        uint32_t n_pad = (n + P - 1) / P * P;
        return n_pad / P * g;
    }
    uint32_t r = P / n;
    if (t->kind == SPC_HEADS_KV)
        return 1;
    uint32_t g_pad = (g + r - 1) / r * r;
    return g_pad / r;
}

/* The real head that local head k of rank p holds on the head side; -1: a dummy. */
static int64_t ref_head(const tcase_t *c, const tcase_tensor_t *t, uint32_t P, uint32_t p, uint32_t k)
{
    uint32_t n = ref_groups(c, t), g = t->heads / n, hloc = ref_hloc(c, t, P);
    if (n >= P) {
        uint32_t j = p * hloc + k;    /* padded head index: group j / g, in order */
        return j < t->heads ? (int64_t)j : -1;
    }
    uint32_t r = P / n, u = p / r, s = p % r;
    if (t->kind == SPC_HEADS_KV)
        return u;
    uint32_t i = s * hloc + k;
    return i < g ? (int64_t)(u * g + i) : -1;
}

static uint32_t s_loc(const tcase_t *c, uint32_t P)
{
    return (c->seq_len + P - 1) / P;
}

/* Byte offsets of an element of tensor ti on the sequence side ([B, S_loc, H, D],
 * local row lr, head h) and on the head side ([B, S, H_loc, D], row, local head k). */
static size_t seq_at(const tcase_t *c, uint32_t P, uint32_t ti, uint32_t b, uint32_t lr, uint32_t h, uint32_t d)
{
    const tcase_tensor_t *t = &c->t[ti];
    return eoff(c->layout, c->batch, s_loc(c, P), t->heads, t->head_dim, b, lr, h, d) * esize(c->dtype);
}

static size_t head_at(const tcase_t *c, uint32_t P, uint32_t ti, uint32_t b, uint32_t row, uint32_t k, uint32_t d)
{
    const tcase_tensor_t *t = &c->t[ti];
    return eoff(c->layout, c->batch, c->seq_len, ref_hloc(c, t, P), t->head_dim, b, row, k, d) * esize(c->dtype);
}

/* What rank q puts into its seq->head send buffer of tensor ti at (b, local row
 * lr, head h, d): the global tensor's element in true rows, rank-specific
 * garbage in padding rows. */
static void s2h_send_elem(const tcase_t *c, uint64_t salt, uint32_t P, uint32_t q, uint32_t ti, uint32_t b,
                          uint32_t lr, uint32_t h, uint32_t d, void *out)
{
    uint32_t t = q * s_loc(c, P) + lr;
    if (t < c->seq_len)
        gen(out, c->dtype, KEY(salt, 1, ti, b, t, h, d), false);
    else
        gen(out, c->dtype, KEY(salt, 2, q, ti, b, lr, h, d), false);
}

/* What rank q puts into its head->seq send buffer of tensor ti at (b, row t,
 * local head k, d): rank-specific everywhere, so copies of a replicated head
 * differ and dummy heads hold garbage. */
static void h2s_send_elem(const tcase_t *c, uint64_t salt, uint32_t q, uint32_t ti, uint32_t b, uint32_t t,
                          uint32_t k, uint32_t d, void *out)
{
    gen(out, c->dtype, KEY(salt, 3, q, ti, b, t, k, d), (c->t[ti].flags & SPC_A2A_SUM_REPLICAS) != 0);
}

/* The sum of n elements in rank order, in the element type (16-bit types in
 * fp32, rounded once). */
static void ref_sum(spc_dtype_t dt, const uint8_t (*el)[8], int n, void *out)
{
    if (dt == SPC_F64) {
        double acc, v;
        memcpy(&acc, el[0], 8);
        for (int i = 1; i < n; i++) {
            memcpy(&v, el[i], 8);
            acc = acc + v;
        }
        memcpy(out, &acc, 8);
    } else if (dt == SPC_F32) {
        float acc, v;
        memcpy(&acc, el[0], 4);
        for (int i = 1; i < n; i++) {
            memcpy(&v, el[i], 4);
            acc = acc + v;
        }
        memcpy(out, &acc, 4);
    } else {
        uint16_t u;
        float acc = 0;
        for (int i = 0; i < n; i++) {
            memcpy(&u, el[i], 2);
            float v = dt == SPC_F16 ? f16_to_f32(u) : bf16_to_f32(u);
            acc = i == 0 ? v : acc + v;
        }
        u = dt == SPC_F16 ? f32_to_f16(acc) : f32_to_bf16(acc);
        memcpy(out, &u, 2);
    }
}

/* Expected seq->head output of rank p: for every element, the source rank, row
 * and head it comes from. */
static void ref_s2h(const tcase_t *c, uint64_t salt, uint32_t P, uint32_t p, uint32_t ti, uint8_t *exp)
{
    const tcase_tensor_t *t = &c->t[ti];
    uint32_t B = c->batch, S = c->seq_len, D = t->head_dim, hloc = ref_hloc(c, t, P), sl = s_loc(c, P);
    size_t es = esize(c->dtype);
    for (uint32_t b = 0; b < B; b++)
        for (uint32_t row = 0; row < S; row++)
            for (uint32_t k = 0; k < hloc; k++)
                for (uint32_t d = 0; d < D; d++) {
                    uint8_t *dst = exp + head_at(c, P, ti, b, row, k, d);
                    int64_t j = ref_head(c, t, P, p, k);
                    if (j < 0) {
                        memset(dst, 0, es);
                        continue;
                    }
                    uint32_t q = row / sl, lr = row - q * sl;
                    s2h_send_elem(c, salt, P, q, ti, b, lr, (uint32_t)j, d, dst);
                }
}

/* Expected head->seq output of rank p: padding rows zero; each real head from
 * the ranks that hold it (found by scanning every rank's local heads), the
 * first of them, or their sum in rank order. */
static void ref_h2s(const tcase_t *c, uint64_t salt, uint32_t P, uint32_t p, uint32_t ti, uint32_t flags,
                    uint8_t *exp)
{
    const tcase_tensor_t *t = &c->t[ti];
    uint32_t B = c->batch, S = c->seq_len, H = t->heads, D = t->head_dim, hloc = ref_hloc(c, t, P);
    uint32_t sl = s_loc(c, P), n = ref_groups(c, t);
    size_t es = esize(c->dtype);

    uint32_t ncopy[64] = { 0 }, cq[64][MAXP], ck[64][MAXP];
    CHECK(H <= 64);
    for (uint32_t q = 0; q < P; q++)
        for (uint32_t k = 0; k < hloc; k++) {
            int64_t j = ref_head(c, t, P, q, k);
            if (j < 0)
                continue;
            CHECK(ncopy[j] < MAXP);
            cq[j][ncopy[j]] = q;
            ck[j][ncopy[j]] = k;
            ncopy[j]++;
        }
    /* The reference's own sanity: every head somewhere, replicas only of KV heads. */
    for (uint32_t h = 0; h < H; h++) {
        uint32_t want = t->kind == SPC_HEADS_KV && n < P ? P / n : 1;
        if (ncopy[h] != want)
            SP_FAIL("reference: head %u of tensor %u has %u copies, expected %u", h, ti, ncopy[h], want);
    }

    for (uint32_t b = 0; b < B; b++)
        for (uint32_t lr = 0; lr < sl; lr++)
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < D; d++) {
                    uint8_t *dst = exp + seq_at(c, P, ti, b, lr, h, d);
                    uint32_t row = p * sl + lr;
                    if (row >= S) {
                        memset(dst, 0, es);
                        continue;
                    }
                    uint8_t el[MAXP][8];
                    for (uint32_t i = 0; i < ncopy[h]; i++)
                        h2s_send_elem(c, salt, cq[h][i], ti, b, row, ck[h][i], d, el[i]);
                    if ((flags & SPC_A2A_SUM_REPLICAS) && ncopy[h] > 1)
                        ref_sum(c->dtype, (const uint8_t(*)[8])el, (int)ncopy[h], dst);
                    else
                        memcpy(dst, el[0], es);
                }
}

/* ================================================================ buffers */

typedef struct tbufs {
    size_t   seq_bytes, head_bytes;      /* [B, S_loc, H, D] and [B, S, H_loc, D] */
    uint8_t *s2h_send, *s2h_recv;        /* step 1 */
    uint8_t *h2s_send, *h2s_recv;        /* step 2 */
    uint8_t *rt_recv;                    /* step 3: s2h_recv -> rt_recv */
} tbufs_t;

typedef struct cbufs {
    tbufs_t      t[MAXT];
    void        *reg;                    /* the registered block, if any */
    size_t       reg_len;
    spc_region_t region;
    int          mem;
} cbufs_t;

static size_t round64(size_t x)
{
    return (x + 63) & ~(size_t)63;
}

/* Carves a buffer of `bytes` (plus the canary) from the registered block. */
static uint8_t *carve(cbufs_t *cb, size_t *used, size_t bytes)
{
    uint8_t *p = (uint8_t *)cb->reg + *used;
    *used += round64(bytes + CANARY);
    CHECK(*used <= cb->reg_len);
    return p;
}

static uint8_t *arena_buf(spc_handle_t *h, size_t bytes)
{
    uint8_t *p = spc_alloc(h, bytes + CANARY);
    if (p == NULL)
        SP_FAIL("spc_alloc(%zu): %s", bytes + CANARY, spc_last_error(h));
    return p;
}

static void bufs_alloc(spc_handle_t *h, const tcase_t *c, uint32_t P, cbufs_t *cb)
{
    memset(cb, 0, sizeof *cb);
    cb->mem = c->mem;
    size_t es = esize(c->dtype), recv_total = 0, all_total = 0;
    for (uint32_t ti = 0; ti < c->ntensors; ti++) {
        const tcase_tensor_t *t = &c->t[ti];
        tbufs_t *tb = &cb->t[ti];
        tb->seq_bytes = (size_t)c->batch * s_loc(c, P) * t->heads * t->head_dim * es;
        tb->head_bytes = (size_t)c->batch * c->seq_len * ref_hloc(c, t, P) * t->head_dim * es;
        /* Receives: s2h_recv (head side), h2s_recv and rt_recv (seq side). */
        recv_total += round64(tb->head_bytes + CANARY) + 2 * round64(tb->seq_bytes + CANARY);
        all_total += round64(tb->head_bytes + CANARY) * 2 + round64(tb->seq_bytes + CANARY) * 3;
    }
    size_t used = 0;
    if (c->mem == MEM_MMAP) {
        cb->reg_len = all_total;
        cb->reg = mmap(NULL, cb->reg_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        CHECK(cb->reg != MAP_FAILED);
    } else if (c->mem == MEM_MIXED) {
        cb->reg_len = recv_total;
        CHECK(posix_memalign(&cb->reg, 4096, cb->reg_len) == 0);
    }
    if (cb->reg)
        CHECK_OK(h, spc_register(h, cb->reg, cb->reg_len, &cb->region));
    for (uint32_t ti = 0; ti < c->ntensors; ti++) {
        tbufs_t *tb = &cb->t[ti];
        if (c->mem == MEM_MMAP) {
            tb->s2h_send = carve(cb, &used, tb->seq_bytes);
            tb->s2h_recv = carve(cb, &used, tb->head_bytes);
            tb->h2s_send = carve(cb, &used, tb->head_bytes);
            tb->h2s_recv = carve(cb, &used, tb->seq_bytes);
            tb->rt_recv = carve(cb, &used, tb->seq_bytes);
        } else {
            tb->s2h_send = arena_buf(h, tb->seq_bytes);
            tb->h2s_send = arena_buf(h, tb->head_bytes);
            if (c->mem == MEM_MIXED) {
                tb->s2h_recv = carve(cb, &used, tb->head_bytes);
                tb->h2s_recv = carve(cb, &used, tb->seq_bytes);
                tb->rt_recv = carve(cb, &used, tb->seq_bytes);
            } else {
                tb->s2h_recv = arena_buf(h, tb->head_bytes);
                tb->h2s_recv = arena_buf(h, tb->seq_bytes);
                tb->rt_recv = arena_buf(h, tb->seq_bytes);
            }
        }
    }
}

static void bufs_free(spc_handle_t *h, cbufs_t *cb, uint32_t ntensors)
{
    for (uint32_t ti = 0; ti < ntensors; ti++) {
        tbufs_t *tb = &cb->t[ti];
        if (cb->mem != MEM_MMAP) {
            spc_free(h, tb->s2h_send);
            spc_free(h, tb->h2s_send);
        }
        if (cb->mem == MEM_ARENA) {
            spc_free(h, tb->s2h_recv);
            spc_free(h, tb->h2s_recv);
            spc_free(h, tb->rt_recv);
        }
    }
    if (cb->reg) {
        CHECK_OK(h, spc_deregister(h, cb->region));
        if (cb->mem == MEM_MMAP)
            munmap(cb->reg, cb->reg_len);
        else
            free(cb->reg);
    }
}

/* ================================================================ checking */

typedef struct where {
    const tcase_t *c;
    const char    *step;
    uint32_t       P, p, ti;
} where_t;

static void hex(char *out, const uint8_t *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        sprintf(out + 2 * i, "%02x", b[n - 1 - i]);    /* most significant byte first */
}

/* Compares a receive buffer with the expected bytes and checks its canary;
 * prints the first mismatches with their coordinates. Returns the count. */
static int compare(const where_t *w, const uint8_t *got, const uint8_t *exp, size_t bytes, bool head_side)
{
    const tcase_t *c = w->c;
    const tcase_tensor_t *t = &c->t[w->ti];
    size_t es = esize(c->dtype);
    uint32_t rows = head_side ? c->seq_len : s_loc(c, w->P);
    uint32_t H = head_side ? ref_hloc(c, t, w->P) : t->heads;
    int bad = 0;
    for (uint32_t b = 0; b < c->batch; b++)
        for (uint32_t s = 0; s < rows; s++)
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < t->head_dim; d++) {
                    size_t o = head_side ? head_at(c, w->P, w->ti, b, s, h, d) : seq_at(c, w->P, w->ti, b, s, h, d);
                    if (memcmp(got + o, exp + o, es) == 0)
                        continue;
                    if (bad++ < MAXBAD) {
                        char e[20], g[20];
                        hex(e, exp + o, es);
                        hex(g, got + o, es);
                        fprintf(stderr, "  [%s] %s, rank %u/%u, tensor %u (%s): b=%u %s=%u %s=%u d=%u: "
                                "expected %s, got %s\n", c->name, w->step, w->p, w->P, w->ti, dtname(c->dtype), b,
                                head_side ? "row" : "local row", s, head_side ? "local head" : "head", h, d, e, g);
                    }
                }
    for (size_t i = 0; i < CANARY; i++)
        if (got[bytes + i] != FILLBYTE) {
            fprintf(stderr, "  [%s] %s, rank %u/%u, tensor %u: byte %zu past the end of the %zu-byte "
                    "receive buffer was written\n", c->name, w->step, w->p, w->P, w->ti, i, bytes);
            bad++;
            break;
        }
    return bad;
}

/* ================================================================ one case */

/* Tensor i of a descriptor: the first four in tensors, the rest in more_tensors. */
static spc_a2a_tensor_t *desc_tensor(spc_alltoall_desc_t *d, uint32_t i)
{
    return i < 4 ? &d->tensors[i] : &d->more_tensors[i - 4];
}

static spc_alltoall_desc_t make_desc(const tcase_t *c, spc_group_t group, uint32_t dir)
{
    spc_alltoall_desc_t d;
    memset(&d, 0, sizeof d);
    d.struct_size = sizeof d;
    d.group = group;
    d.dtype = c->dtype;
    d.direction = dir;
    d.layout = c->layout;
    d.batch = c->batch;
    d.seq_len = c->seq_len;
    d.kv_heads = c->kv_heads;
    d.ntensors = c->ntensors;
    for (uint32_t i = 0; i < c->ntensors; i++) {
        spc_a2a_tensor_t *t = desc_tensor(&d, i);
        t->heads = c->t[i].heads;
        t->head_dim = c->t[i].head_dim;
        t->kind = c->t[i].kind;
        t->flags = c->t[i].flags;
    }
    d.timeout_ms = TIMEOUT_MS;
    return d;
}

/* Runs case c as group rank p of `group` (P ranks). Returns the mismatches. */
static int run_case(spc_handle_t *h, spc_group_t group, uint32_t p, const tcase_t *c, uint64_t salt)
{
    uint32_t P = c->P, sl = s_loc(c, P);
    size_t es = esize(c->dtype);
    int bad = 0;

    for (uint32_t ti = 0; ti < c->ntensors; ti++)   /* the library agrees with the hand-computed shape */
        CHECK_EQ(spc_a2a_local_heads(c->t[ti].heads, c->t[ti].kind, c->kv_heads, P), ref_hloc(c, &c->t[ti], P));

    cbufs_t cb;
    bufs_alloc(h, c, P, &cb);
    for (uint32_t ti = 0; ti < c->ntensors; ti++) {
        const tcase_tensor_t *t = &c->t[ti];
        tbufs_t *tb = &cb.t[ti];
        uint32_t hloc = ref_hloc(c, t, P);
        for (uint32_t b = 0; b < c->batch; b++)
            for (uint32_t lr = 0; lr < sl; lr++)
                for (uint32_t hh = 0; hh < t->heads; hh++)
                    for (uint32_t d = 0; d < t->head_dim; d++)
                        s2h_send_elem(c, salt, P, p, ti, b, lr, hh, d, tb->s2h_send + seq_at(c, P, ti, b, lr, hh, d));
        for (uint32_t b = 0; b < c->batch; b++)
            for (uint32_t row = 0; row < c->seq_len; row++)
                for (uint32_t k = 0; k < hloc; k++)
                    for (uint32_t d = 0; d < t->head_dim; d++)
                        h2s_send_elem(c, salt, p, ti, b, row, k, d, tb->h2s_send + head_at(c, P, ti, b, row, k, d));
        memset(tb->s2h_recv, FILLBYTE, tb->head_bytes + CANARY);
        memset(tb->h2s_recv, FILLBYTE, tb->seq_bytes + CANARY);
        memset(tb->rt_recv, FILLBYTE, tb->seq_bytes + CANARY);
    }

    /* Steps 1 and 2 in flight together; they touch different buffers. */
    spc_alltoall_desc_t s2h = make_desc(c, group, SPC_SEQ_TO_HEAD);
    spc_alltoall_desc_t h2s = make_desc(c, group, SPC_HEAD_TO_SEQ);
    for (uint32_t ti = 0; ti < c->ntensors; ti++) {
        desc_tensor(&s2h, ti)->send = cb.t[ti].s2h_send;
        desc_tensor(&s2h, ti)->recv = cb.t[ti].s2h_recv;
        desc_tensor(&h2s, ti)->send = cb.t[ti].h2s_send;
        desc_tensor(&h2s, ti)->recv = cb.t[ti].h2s_recv;
    }
    spc_request_t *r1, *r2;
    CHECK_OK(h, spc_ialltoall(h, &s2h, &r1));
    CHECK_OK(h, spc_ialltoall(h, &h2s, &r2));
    spc_status_t st1 = spc_wait(r1, TIMEOUT_MS), st2 = spc_wait(r2, TIMEOUT_MS);
    if (st1 != SPC_OK || st2 != SPC_OK)
        SP_FAIL("[%s] rank %u: seq->head %s (%s), head->seq %s (%s)", c->name, p, spc_status_name(st1),
                spc_request_detail(r1), spc_status_name(st2), spc_request_detail(r2));
    spc_request_release(r1);
    spc_request_release(r2);

    for (uint32_t ti = 0; ti < c->ntensors; ti++) {
        const tcase_tensor_t *t = &c->t[ti];
        tbufs_t *tb = &cb.t[ti];
        uint8_t *exp = malloc(tb->head_bytes > tb->seq_bytes ? tb->head_bytes : tb->seq_bytes);
        CHECK(exp != NULL);
        where_t w = { c, "seq->head", P, p, ti };
        ref_s2h(c, salt, P, p, ti, exp);
        bad += compare(&w, tb->s2h_recv, exp, tb->head_bytes, true);
        w.step = "head->seq";
        ref_h2s(c, salt, P, p, ti, t->flags, exp);
        bad += compare(&w, tb->h2s_recv, exp, tb->seq_bytes, false);
        free(exp);
    }

    /* Step 3: the round trip, with replicas taken from their first copy. */
    spc_alltoall_desc_t rt = make_desc(c, group, SPC_HEAD_TO_SEQ);
    for (uint32_t ti = 0; ti < c->ntensors; ti++) {
        desc_tensor(&rt, ti)->send = cb.t[ti].s2h_recv;
        desc_tensor(&rt, ti)->recv = cb.t[ti].rt_recv;
        desc_tensor(&rt, ti)->flags = 0;
    }
    CHECK_OK(h, spc_alltoall(h, &rt, TIMEOUT_MS));
    for (uint32_t ti = 0; ti < c->ntensors; ti++) {
        tbufs_t *tb = &cb.t[ti];
        uint8_t *exp = malloc(tb->seq_bytes);
        CHECK(exp != NULL);
        memcpy(exp, tb->s2h_send, tb->seq_bytes);
        for (uint32_t b = 0; b < c->batch; b++)       /* padding rows come back as zeros */
            for (uint32_t lr = 0; lr < sl; lr++)
                if (p * sl + lr >= c->seq_len)
                    for (uint32_t hh = 0; hh < c->t[ti].heads; hh++)
                        memset(exp + seq_at(c, P, ti, b, lr, hh, 0), 0, (size_t)c->t[ti].head_dim * es);
        where_t w = { c, "round trip", P, p, ti };
        bad += compare(&w, tb->rt_recv, exp, tb->seq_bytes, false);
        /* The send buffer of step 1 is untouched. */
        for (uint32_t b = 0; b < c->batch; b++)
            for (uint32_t lr = 0; lr < sl; lr++)
                for (uint32_t hh = 0; hh < c->t[ti].heads; hh++)
                    for (uint32_t d = 0; d < c->t[ti].head_dim; d++)
                        s2h_send_elem(c, salt, P, p, ti, b, lr, hh, d, exp + seq_at(c, P, ti, b, lr, hh, d));
        if (memcmp(exp, tb->s2h_send, tb->seq_bytes) != 0) {
            fprintf(stderr, "  [%s] rank %u, tensor %u: the seq->head send buffer was modified\n", c->name, p, ti);
            bad++;
        }
        free(exp);
    }
    bufs_free(h, &cb, c->ntensors);
    return bad;
}

/* ================================================================ jobs */

static int rank_cases(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    int bad = 0, ran = 0;
    for (size_t i = 0; i < NCASES; i++) {
        if (cases[i].P != (uint32_t)nranks)
            continue;
        int b = run_case(h, world, (uint32_t)rank, &cases[i], 1000 + i);
        if (b)
            fprintf(stderr, "rank %d: case \"%s\": %d mismatches\n", rank, cases[i].name, b);
        bad += b;
        ran++;
    }
    CHECK(ran > 0);
    if (bad)
        SP_FAIL("rank %d of %d: %d mismatches in all", rank, nranks, bad);
    return 0;
}

/* World 4 = sp 4 = ring 2 x ulysses 2: Ulysses groups {0,1} {2,3}, ring groups
 * {0,2} {1,3}. The same case runs on both kinds of group at once, with data
 * that differs per group, so a rank that reaches into the other group shows. */
static const tcase_t mesh_case = {
    "mesh GQA 4q/2kv fp32", 2, SPC_F32, BSHD, 2, 9, 2, 3, { Q(4, 8), KV(2, 8), KVS(2, 4) }, MEM_ARENA,
};

static int rank_mesh(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    spc_mesh_spec_t spec = { .struct_size = sizeof spec, .sp = 4, .ulysses = 2, .ring = 2, .heads = 4, .kv_heads = 2 };
    spc_mesh_t m;
    CHECK_OK(h, spc_mesh_create(h, &spec, &m));
    CHECK_EQ(m.dp, 1);
    CHECK_EQ(m.sp, 4);
    CHECK_EQ(m.ulysses, 2);
    CHECK_EQ(m.ring, 2);
    CHECK_EQ(m.ulysses_rank, rank % 2);
    CHECK_EQ(m.ring_rank, rank / 2);
    CHECK_EQ(m.sp_rank, rank);
    CHECK(m.ulysses_group != world && m.ring_group != world && m.ulysses_group != m.ring_group);

    int bad = run_case(h, m.ulysses_group, m.ulysses_rank, &mesh_case, 7000 + m.ring_rank);
    bad += run_case(h, m.ring_group, m.ring_rank, &mesh_case, 8000 + m.ulysses_rank);
    if (bad)
        SP_FAIL("rank %d: %d mismatches on mesh groups", rank, bad);
    CHECK_OK(h, spc_barrier(h, world, TIMEOUT_MS));
    return 0;
}

/* Ranks that pass different descriptors are refused, and the group goes on. */
static int rank_mismatch(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    float *send = spc_alloc(h, 4096), *recv = spc_alloc(h, 4096);
    CHECK(send && recv);
    memset(send, 0, 4096);
    spc_alltoall_desc_t d;
    memset(&d, 0, sizeof d);
    d.struct_size = sizeof d;
    d.group = world;
    d.dtype = SPC_F32;
    d.direction = SPC_SEQ_TO_HEAD;
    d.layout = SPC_LAYOUT_BSHD;
    d.batch = 1;
    d.seq_len = rank == 1 ? 9 : 8;
    d.ntensors = 1;
    d.tensors[0] = (spc_a2a_tensor_t){ send, recv, (uint32_t)nranks, 4, SPC_HEADS_Q, 0 };
    spc_status_t st = spc_alltoall(h, &d, TIMEOUT_MS);
    if (st == SPC_OK)
        SP_FAIL("rank %d: seq_len 9 on rank 1 and 8 elsewhere was accepted", rank);
    if (rank == 0)
        printf("mismatched seq_len: %s (%s)\n", spc_status_name(st), spc_last_error(h));

    /* Five tensors whose last, in more_tensors, differs on rank 1: MISMATCH naming it. */
    d.seq_len = 8;
    d.ntensors = 5;
    for (uint32_t i = 1; i < 5; i++)
        *desc_tensor(&d, i) = (spc_a2a_tensor_t){ send + 64 * i, recv + 64 * i, (uint32_t)nranks, 1, SPC_HEADS_Q, 0 };
    desc_tensor(&d, 4)->heads = rank == 1 ? 2 * (uint32_t)nranks : (uint32_t)nranks;
    st = spc_alltoall(h, &d, TIMEOUT_MS);
    CHECK_EQ(st, SPC_ERR_MISMATCH);
    CHECK_CONTAINS(spc_last_error(h), "tensor 4 heads");
    if (rank == 0)
        printf("mismatched tensor 4: %s (%s)\n", spc_status_name(st), spc_last_error(h));

    /* Refused before submission: nine tensors, and five in a descriptor too short for more_tensors. */
    desc_tensor(&d, 4)->heads = (uint32_t)nranks;
    d.ntensors = SPC_A2A_MAX_TENSORS + 1;
    CHECK_EQ(spc_alltoall(h, &d, TIMEOUT_MS), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(h), "all-to-all of 9 tensors; 1 to 8");
    d.ntensors = 5;
    d.struct_size = offsetof(spc_alltoall_desc_t, more_tensors);
    CHECK_EQ(spc_alltoall(h, &d, TIMEOUT_MS), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(spc_last_error(h), "has no more_tensors");

    spc_free(h, send);
    spc_free(h, recv);
    int bad = run_case(h, world, (uint32_t)rank, &cases[4], 99);   /* a 3-rank case */
    if (bad)
        SP_FAIL("rank %d: %d mismatches after a refused op", rank, bad);
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(int argc, char **argv)
{
    setenv("SPC_ARENA_BYTES", "67108864", 1);
    sp_test_daemon_t d;
    sp_test_start(&d, argc, argv);
    double t0 = now_s();

    static const int Ps[] = { 2, 3, 4, 8 };
    for (size_t i = 0; i < sizeof Ps / sizeof Ps[0]; i++) {
        double t = now_s();
        sp_test_run_job(Ps[i], rank_cases, NULL);
        printf("P=%d: ok (%.2f s)\n", Ps[i], now_s() - t);
        fflush(stdout);
    }
    double t = now_s();
    sp_test_run_job(4, rank_mesh, NULL);
    printf("mesh ulysses/ring groups: ok (%.2f s)\n", now_s() - t);
    t = now_s();
    CHECK_EQ(cases[4].P, 3);
    sp_test_run_job(3, rank_mismatch, NULL);
    printf("mismatched descriptors: ok (%.2f s)\n", now_s() - t);

    CHECK_EQ(sp_test_cluster_stop(), 0);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("alltoall: ok (%.2f s)\n", now_s() - t0);
    return 0;
}
