/*
 * test_ulysses_attn.c — Ulysses attention through spd gives the same bits as
 * full attention in one process (fp32).
 *
 * Every process generates the full q [B, S, H, D], k and v [B, S, K, D] from the
 * same seed. Each rank of P:
 *   1. takes its rows of q, k, v (S_loc = ceil(S / P), padding rows NaN, which
 *      seq->head must drop) into arena buffers;
 *   2. runs one seq->head all-to-all of q (query heads, K groups), k and v
 *      (key/value heads), and checks that every real local head it received is
 *      the full tensor's head (a first diagnosis when step 5 fails);
 *   3. runs causal softmax attention for its local query heads over the whole
 *      sequence, each with the local KV head it maps to by the dealing rules;
 *   4. runs one head->seq all-to-all of the output (query heads again);
 *   5. compares its rows with the same attention function run over all heads of
 *      the full tensors, with memcmp; padding rows must be zero.
 * The attention function is one non-inlined function with a fixed loop order,
 * so the same inputs give the same bits wherever it runs.
 *
 * Cases: P = 2 and 4, heads divisible by P, dummy heads (6 heads on 4 ranks,
 * and a GQA group of 3 query heads split over 2 ranks), GQA (8 query / 2 KV
 * heads on 4 ranks: each KV head replicated to 2 ranks), MQA, both layouts,
 * sequence lengths that P does not divide, one case large enough that spd
 * splits its copies into chunks.
 */
#include <math.h>
#include <time.h>

#include "sp_test.h"

#define TIMEOUT_MS 20000

typedef struct acase {
    const char *name;
    uint32_t    P, B, S, H, K, D, layout;
} acase_t;

static const acase_t cases[] = {
    { "4 heads, B=2",                         2, 2, 16, 4, 4, 16, SPC_LAYOUT_BSHD },
    { "GQA 4q/2kv, S=15, SBHD",               2, 1, 15, 4, 2, 8,  SPC_LAYOUT_SBHD },
    { "8 heads, S=30",                        4, 1, 30, 8, 8, 16, SPC_LAYOUT_BSHD },
    { "6 heads (2 dummies), S=19",            4, 2, 19, 6, 6, 8,  SPC_LAYOUT_BSHD },
    { "GQA 8q/2kv (kv replicated x2)",        4, 2, 24, 8, 2, 16, SPC_LAYOUT_BSHD },
    { "GQA 6q/2kv (dummy q in group), SBHD",  4, 1, 20, 6, 2, 8,  SPC_LAYOUT_SBHD },
    { "MQA 4q/1kv (kv replicated x4), SBHD",  4, 2, 21, 4, 1, 8,  SPC_LAYOUT_SBHD },
    { "GQA 8q/2kv, S=255, D=32 (chunked)",    4, 2, 255, 8, 2, 32, SPC_LAYOUT_BSHD },
};
#define NCASES (sizeof cases / sizeof cases[0])

/* ================================================================ data */

static uint64_t mix64(uint64_t x)
{
    x ^= x >> 31;
    x *= 0xD6E8FEB86659FD93ull;
    x ^= x >> 29;
    x *= 0x9E3779B97F4A7C15ull;
    x ^= x >> 32;
    return x;
}

/* A value in [-2, 2) for element (tensor, b, s, h, d). */
static float value(uint64_t salt, uint32_t tensor, uint32_t b, uint32_t s, uint32_t h, uint32_t d)
{
    uint64_t x = mix64(salt * 0x9E3779B97F4A7C15ull ^ mix64(((uint64_t)tensor << 56) ^ ((uint64_t)b << 44) ^
                                                           ((uint64_t)s << 24) ^ ((uint64_t)h << 12) ^ d));
    return (float)((double)(x >> 40) / (double)(1ull << 24) * 4.0 - 2.0);
}

/* Element (b, s, h, d) of an array of `rows` rows and H heads, in elements. */
static size_t eoff(uint32_t layout, uint32_t B, uint32_t rows, uint32_t H, uint32_t D, uint32_t b, uint32_t s,
                   uint32_t h, uint32_t d)
{
    if (layout == SPC_LAYOUT_BSHD)
        return (((size_t)b * rows + s) * H + h) * D + d;
    return (((size_t)s * B + b) * H + h) * D + d;
}

/* ================================================================ dealing (from the contract) */

/* Local heads of a tensor of H heads in n groups (kind: SPC_HEADS_*) on P ranks. */
static uint32_t deal_hloc(uint32_t H, uint32_t n, uint32_t kind, uint32_t P)
{
    uint32_t g = H / n;
    if (n >= P)
        return (n + P - 1) / P * g;
    if (kind == SPC_HEADS_KV)
        return 1;
    uint32_t r = P / n;
    return (g + r - 1) / r;
}

/* The real head that local head k of rank p holds; -1: a dummy. */
static int64_t deal_head(uint32_t H, uint32_t n, uint32_t kind, uint32_t P, uint32_t p, uint32_t k)
{
    uint32_t g = H / n, hloc = deal_hloc(H, n, kind, P);
    if (n >= P) {
        uint32_t j = p * hloc + k;
        return j < H ? (int64_t)j : -1;
    }
    uint32_t r = P / n, u = p / r, s = p % r;
    if (kind == SPC_HEADS_KV)
        return u;
    uint32_t i = s * hloc + k;
    return i < g ? (int64_t)(u * g + i) : -1;
}

/* ================================================================ attention */

/*
 * Causal softmax attention: for each batch, query head h (with KV head
 * kv_of[h]; < 0 writes zeros) and query row i: scores against key rows 0..i,
 * their max, exp, sum, the weighted sum of value rows, divided by the sum.
 * Not inlined, so the full reference and the ranks run the very same code.
 */
__attribute__((noinline)) static void attention(const float *q, const float *k, const float *v, float *o,
                                                uint32_t layout, uint32_t B, uint32_t S, uint32_t Hq, uint32_t Hk,
                                                uint32_t D, const int32_t *kv_of)
{
    float *p = malloc(S * sizeof *p);
    CHECK(p != NULL);
    const float scale = 1.0f / sqrtf((float)D);
    for (uint32_t b = 0; b < B; b++)
        for (uint32_t h = 0; h < Hq; h++)
            for (uint32_t i = 0; i < S; i++) {
                float *oi = o + eoff(layout, B, S, Hq, D, b, i, h, 0);
                if (kv_of[h] < 0) {
                    memset(oi, 0, D * sizeof *oi);
                    continue;
                }
                uint32_t kh = (uint32_t)kv_of[h];
                const float *qi = q + eoff(layout, B, S, Hq, D, b, i, h, 0);
                float mx = -INFINITY;
                for (uint32_t j = 0; j <= i; j++) {
                    const float *kj = k + eoff(layout, B, S, Hk, D, b, j, kh, 0);
                    float s = 0.0f;
                    for (uint32_t d = 0; d < D; d++)
                        s += qi[d] * kj[d];
                    s *= scale;
                    p[j] = s;
                    if (s > mx)
                        mx = s;
                }
                float sum = 0.0f;
                for (uint32_t j = 0; j <= i; j++) {
                    p[j] = expf(p[j] - mx);
                    sum += p[j];
                }
                for (uint32_t d = 0; d < D; d++) {
                    float acc = 0.0f;
                    for (uint32_t j = 0; j <= i; j++)
                        acc += p[j] * v[eoff(layout, B, S, Hk, D, b, j, kh, d)];
                    oi[d] = acc / sum;
                }
            }
    free(p);
}

/* ================================================================ one case */

static float *full_tensor(const acase_t *c, uint64_t salt, uint32_t tensor, uint32_t H)
{
    float *x = malloc((size_t)c->B * c->S * H * c->D * sizeof *x);
    CHECK(x != NULL);
    for (uint32_t b = 0; b < c->B; b++)
        for (uint32_t s = 0; s < c->S; s++)
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t d = 0; d < c->D; d++)
                    x[eoff(c->layout, c->B, c->S, H, c->D, b, s, h, d)] = value(salt, tensor, b, s, h, d);
    return x;
}

static float *arena_floats(spc_handle_t *h, size_t n)
{
    float *p = spc_alloc(h, n * sizeof *p);
    if (p == NULL)
        SP_FAIL("spc_alloc(%zu floats): %s", n, spc_last_error(h));
    return p;
}

/* Rank p's rows of a full tensor; padding rows NaN. */
static void take_rows(const acase_t *c, const float *full, float *local, uint32_t H, uint32_t p, uint32_t sl)
{
    for (uint32_t b = 0; b < c->B; b++)
        for (uint32_t lr = 0; lr < sl; lr++)
            for (uint32_t h = 0; h < H; h++) {
                uint32_t row = p * sl + lr;
                float *dst = local + eoff(c->layout, c->B, sl, H, c->D, b, lr, h, 0);
                if (row < c->S)
                    memcpy(dst, full + eoff(c->layout, c->B, c->S, H, c->D, b, row, h, 0), c->D * sizeof *dst);
                else
                    for (uint32_t d = 0; d < c->D; d++)
                        dst[d] = NAN;
            }
}

/* Checks that each real local head of a head-side tensor is the full tensor's head. */
static int check_heads(const acase_t *c, const char *what, const float *full, const float *local, uint32_t H,
                       uint32_t n, uint32_t kind, uint32_t p)
{
    uint32_t hloc = deal_hloc(H, n, kind, c->P);
    int bad = 0;
    for (uint32_t k = 0; k < hloc; k++) {
        int64_t j = deal_head(H, n, kind, c->P, p, k);
        if (j < 0)
            continue;
        for (uint32_t b = 0; b < c->B; b++)
            for (uint32_t s = 0; s < c->S; s++) {
                const float *got = local + eoff(c->layout, c->B, c->S, hloc, c->D, b, s, k, 0);
                const float *want = full + eoff(c->layout, c->B, c->S, H, c->D, b, s, (uint32_t)j, 0);
                if (memcmp(got, want, c->D * sizeof *got) != 0 && bad++ < 4)
                    fprintf(stderr, "  [%s] rank %u: seq->head %s local head %u (head %lld), b=%u row %u differs\n",
                            c->name, p, what, k, (long long)j, b, s);
            }
    }
    return bad;
}

static int run_case(spc_handle_t *h, spc_group_t group, uint32_t p, const acase_t *c, uint64_t salt)
{
    uint32_t P = c->P, B = c->B, S = c->S, H = c->H, K = c->K, D = c->D, sl = (S + P - 1) / P;
    uint32_t hq = deal_hloc(H, K, SPC_HEADS_Q, P), hk = deal_hloc(K, K, SPC_HEADS_KV, P);
    int bad = 0;

    float *q = full_tensor(c, salt, 0, H), *k = full_tensor(c, salt, 1, K), *v = full_tensor(c, salt, 2, K);

    /* 1. This rank's rows. */
    float *qs = arena_floats(h, (size_t)B * sl * H * D), *ks = arena_floats(h, (size_t)B * sl * K * D);
    float *vs = arena_floats(h, (size_t)B * sl * K * D);
    take_rows(c, q, qs, H, p, sl);
    take_rows(c, k, ks, K, p, sl);
    take_rows(c, v, vs, K, p, sl);

    /* 2. seq->head of q, k and v in one op. */
    float *qh = arena_floats(h, (size_t)B * S * hq * D), *kh = arena_floats(h, (size_t)B * S * hk * D);
    float *vh = arena_floats(h, (size_t)B * S * hk * D);
    spc_alltoall_desc_t d = {
        .struct_size = sizeof d, .group = group, .dtype = SPC_F32, .direction = SPC_SEQ_TO_HEAD,
        .layout = c->layout, .batch = B, .seq_len = S, .kv_heads = K, .ntensors = 3,
        .tensors = {
            { qs, qh, H, D, SPC_HEADS_Q, 0 },
            { ks, kh, K, D, SPC_HEADS_KV, 0 },
            { vs, vh, K, D, SPC_HEADS_KV, 0 },
        },
        .timeout_ms = TIMEOUT_MS,
    };
    CHECK_OK(h, spc_alltoall(h, &d, TIMEOUT_MS));
    bad += check_heads(c, "q", q, qh, H, K, SPC_HEADS_Q, p);
    bad += check_heads(c, "k", k, kh, K, K, SPC_HEADS_KV, p);
    bad += check_heads(c, "v", v, vh, K, K, SPC_HEADS_KV, p);

    /* 3. Attention over the local heads: local query head i -> its real head ->
     * that head's KV head (h / (H / K)) -> where this rank holds it. */
    int32_t kv_of[64];
    CHECK(hq <= 64);
    for (uint32_t i = 0; i < hq; i++) {
        int64_t real = deal_head(H, K, SPC_HEADS_Q, P, p, i);
        kv_of[i] = -1;
        if (real < 0)
            continue;     /* a dummy: its output is dropped */
        int64_t kv = real / (H / K);
        for (uint32_t j = 0; j < hk; j++)
            if (deal_head(K, K, SPC_HEADS_KV, P, p, j) == kv)
                kv_of[i] = (int32_t)j;
        if (kv_of[i] < 0)
            SP_FAIL("[%s] rank %u holds query head %lld but not its KV head %lld", c->name, p, (long long)real,
                    (long long)kv);
    }
    float *oh = arena_floats(h, (size_t)B * S * hq * D);
    attention(qh, kh, vh, oh, c->layout, B, S, hq, hk, D, kv_of);

    /* 4. head->seq of the output. */
    float *os = arena_floats(h, (size_t)B * sl * H * D);
    memset(os, 0x5A, (size_t)B * sl * H * D * sizeof *os);
    spc_alltoall_desc_t o = {
        .struct_size = sizeof o, .group = group, .dtype = SPC_F32, .direction = SPC_HEAD_TO_SEQ,
        .layout = c->layout, .batch = B, .seq_len = S, .kv_heads = K, .ntensors = 1,
        .tensors = { { oh, os, H, D, SPC_HEADS_Q, 0 } },
        .timeout_ms = TIMEOUT_MS,
    };
    CHECK_OK(h, spc_alltoall(h, &o, TIMEOUT_MS));

    /* 5. Full attention here, and the comparison. */
    int32_t kv_full[64];
    CHECK(H <= 64);
    for (uint32_t i = 0; i < H; i++)
        kv_full[i] = (int32_t)(i / (H / K));
    float *of = malloc((size_t)B * S * H * D * sizeof *of);
    CHECK(of != NULL);
    attention(q, k, v, of, c->layout, B, S, H, K, D, kv_full);
    float zero[256] = { 0 };
    CHECK(D <= 256);
    for (uint32_t b = 0; b < B; b++)
        for (uint32_t lr = 0; lr < sl; lr++)
            for (uint32_t i = 0; i < H; i++) {
                uint32_t row = p * sl + lr;
                const float *got = os + eoff(c->layout, B, sl, H, D, b, lr, i, 0);
                const float *want = row < S ? of + eoff(c->layout, B, S, H, D, b, row, i, 0) : zero;
                if (memcmp(got, want, D * sizeof *got) != 0) {
                    if (bad++ < 6) {
                        uint32_t e = 0;
                        while (e < D && memcmp(&got[e], &want[e], sizeof *got) == 0)
                            e++;
                        fprintf(stderr, "  [%s] rank %u/%u: b=%u row %u%s head %u: d=%u expected %a, got %a\n",
                                c->name, p, P, b, row, row < S ? "" : " (padding)", i, e, (double)want[e],
                                (double)got[e]);
                    }
                }
            }

    free(of);
    spc_free(h, os);
    spc_free(h, oh);
    spc_free(h, vh);
    spc_free(h, kh);
    spc_free(h, qh);
    spc_free(h, vs);
    spc_free(h, ks);
    spc_free(h, qs);
    free(v);
    free(k);
    free(q);
    return bad;
}

static int rank_cases(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    int bad = 0;
    for (size_t i = 0; i < NCASES; i++) {
        if (cases[i].P != (uint32_t)nranks)
            continue;
        int b = run_case(h, world, (uint32_t)rank, &cases[i], 500 + i);
        if (b)
            fprintf(stderr, "rank %d: case \"%s\": %d mismatches\n", rank, cases[i].name, b);
        bad += b;
    }
    if (bad)
        SP_FAIL("rank %d of %d: %d mismatches in all", rank, nranks, bad);
    return 0;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

int main(void)
{
    setenv("SPC_ARENA_BYTES", "67108864", 1);
    sp_test_daemon_t dm;
    sp_test_daemon_start(&dm, NULL);
    double t0 = now_s();
    static const int Ps[] = { 2, 4 };
    for (size_t i = 0; i < sizeof Ps / sizeof Ps[0]; i++) {
        double t = now_s();
        sp_test_run_job(Ps[i], rank_cases, NULL);
        printf("P=%d: ok (%.2f s)\n", Ps[i], now_s() - t);
        fflush(stdout);
    }
    CHECK_EQ(sp_test_daemon_stop(&dm), 0);
    sp_test_daemon_cleanup(&dm);
    printf("ulysses attention: ok (%.2f s)\n", now_s() - t0);
    return 0;
}
