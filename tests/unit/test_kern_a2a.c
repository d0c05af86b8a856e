/*
 * The host references of kernels/ (the ones tests/gpu compares the CUDA kernels
 * with) against loops written here:
 *
 *   all-to-all  every rank's output of every case of sp_kern_cases.h, both
 *               directions, against the daemon's loop (daemon/core/exec.c run_a2a:
 *               owners' rows scattered to, or gathered from, the holders that
 *               sp_heads_real names, replicas summed with sp_kern_reduce or
 *               widen / reduce_widen / narrow), outputs prefilled so that every
 *               byte must be written; and the round trip seq->head->seq;
 *   shift       the source rank of every rank, cyclic, linear, reversed;
 *   zigzag      split against rank r's chunks r and 2P-1-r, merge undoing it;
 *   pad         against the definition, and unpad undoing pad;
 *   LSE merge   against the formula in long double (a few ulps), the -inf and
 *               NaN rules exactly, and in place.
 */
#include <math.h>

#include "sp_kern.h"
#include "sp_kern_cases.h"
#include "sp_kern_merge.h"
#include "sp_kern_seq.h"
#include "sp_test.h"
#include "sp_ulysses.h"

#define FILL 0x5A

static uint64_t rng_state = 0x243F6A8885A308D3ull;

static uint32_t elem_size(uint32_t dtype)
{
    return dtype == SP_KERN_U8 ? 1 : dtype == SP_KERN_F16 || dtype == SP_KERN_BF16 ? 2
         : dtype == SP_KERN_F64 || dtype == SP_KERN_I64 ? 8 : 4;
}

/* ================================================================ all-to-all */

static uint64_t row_of(const sp_kern_case_t *c, uint64_t b, uint64_t s, uint64_t rows)
{
    return c->layout == SP_KERN_BSHD ? b * rows + s : s * c->batch + b;
}

/* The daemon's way: every rank's output at once, owner row by owner row. */
static void daemon_a2a(const sp_kern_case_t *c, uint32_t dir, uint8_t **in, uint8_t **out)
{
    sp_heads_plan_t pl;
    CHECK(sp_heads_plan(&pl, c->heads, c->kind, c->kv_heads, c->ranks));
    const uint32_t P = c->ranks, S = c->seq_len, S_loc = sp_rows_local(S, P), es = elem_size(c->dtype);
    const uint64_t head = (uint64_t)c->head_dim * es, wide = c->heads * head, narrow = pl.local * head;
    const bool s2h = dir == SP_KERN_SEQ_TO_HEAD;
    const bool sum = !s2h && pl.replicate && (c->flags & SP_KERN_A2A_SUM_REPLICAS);
    for (uint32_t o = 0; o < P; o++) {
        uint8_t *seq = s2h ? in[o] : out[o];
        uint32_t rows = sp_rows_real(S, P, o);
        for (uint64_t b = 0; b < c->batch; b++) {
            for (uint64_t s = 0; s < rows; s++) {
                uint8_t *srow = seq + row_of(c, b, s, S_loc) * wide;
                uint64_t hoff = row_of(c, b, (uint64_t)o * S_loc + s, S) * narrow;
                for (uint32_t q = 0; q < P; q++) {
                    uint32_t first, nreal = sp_heads_real(&pl, q, &first);
                    if (s2h) {
                        memcpy(out[q] + hoff, srow + first * head, nreal * head);
                        memset(out[q] + hoff + nreal * head, 0, narrow - nreal * head);
                    } else if (!sp_heads_primary(&pl, q) || nreal == 0) {
                        continue;
                    } else if (!sum) {
                        memcpy(srow + first * head, in[q] + hoff, nreal * head);
                    } else if (sp_kern_acc_dtype(c->dtype) == c->dtype) {
                        memcpy(srow + first * head, in[q] + hoff, head);
                        for (uint32_t k = 1; k < pl.replicas; k++)
                            CHECK_EQ(sp_kern_reduce(srow + first * head, in[q + k] + hoff, c->head_dim, c->dtype,
                                                    SP_KERN_SUM), 0);
                    } else {
                        float acc[256];
                        CHECK(c->head_dim <= 256);
                        sp_kern_widen(acc, in[q] + hoff, c->head_dim, c->dtype);
                        for (uint32_t k = 1; k < pl.replicas; k++)
                            sp_kern_reduce_widen(acc, in[q + k] + hoff, c->head_dim, c->dtype, SP_KERN_SUM);
                        sp_kern_narrow(srow + first * head, acc, c->head_dim, c->dtype);
                    }
                }
            }
            if (!s2h)
                for (uint64_t s = rows; s < S_loc; s++)
                    memset(seq + row_of(c, b, s, S_loc) * wide, 0, wide);
        }
    }
}

static void check_bytes(const uint8_t *got, const uint8_t *want, uint64_t n, const char *what, const char *name,
                        uint32_t rank)
{
    for (uint64_t i = 0; i < n; i++)
        if (got[i] != want[i])
            SP_FAIL("%s, case \"%s\", rank %u: byte %" PRIu64 " of %" PRIu64 " is 0x%02x, expected 0x%02x", what,
                    name, rank, i, n, got[i], want[i]);
}

static void test_a2a_case(const sp_kern_case_t *c)
{
    const uint32_t P = c->ranks;
    uint8_t *in[2][8], *ref[2][8], *got[2][8];
    uint64_t in_bytes[2], out_bytes[2];
    for (uint32_t dir = 0; dir < 2; dir++) {
        sp_kern_a2a_desc_t d = sp_kern_case_desc(c, dir);
        sp_kern_a2a_geom_t g;
        CHECK_EQ(sp_kern_a2a_geom(&g, &d, 0), 0);
        in_bytes[dir] = sp_kern_a2a_src_bytes(&g);
        out_bytes[dir] = sp_kern_a2a_out_bytes(&g);
        for (uint32_t q = 0; q < P; q++) {
            sp_kern_a2a_geom_t gq;
            CHECK_EQ(sp_kern_a2a_geom(&gq, &d, q), 0);
            CHECK_EQ(sp_kern_a2a_out_bytes(&gq), out_bytes[dir]);
            in[dir][q] = malloc(in_bytes[dir]);
            ref[dir][q] = malloc(out_bytes[dir]);
            got[dir][q] = malloc(out_bytes[dir]);
            sp_kern_fill(in[dir][q], in_bytes[dir], &rng_state);
            memset(ref[dir][q], FILL, out_bytes[dir]);
            memset(got[dir][q], FILL, out_bytes[dir]);
        }
        daemon_a2a(c, dir, in[dir], ref[dir]);
        for (uint32_t q = 0; q < P; q++) {
            CHECK_EQ(sp_kern_a2a_host(got[dir][q], (const void *const *)in[dir], &d, q), 0);
            check_bytes(got[dir][q], ref[dir][q], out_bytes[dir], dir ? "head->seq" : "seq->head", c->name, q);
        }
    }
    /* Round trip: head->seq of seq->head's outputs gives the input's real rows
     * back (a sum of replicas is that of r equal copies: compared with the
     * daemon's loop above instead), and zeros in the padding rows. */
    if (!(c->flags & SP_KERN_A2A_SUM_REPLICAS)) {
        sp_kern_a2a_desc_t d = sp_kern_case_desc(c, SP_KERN_HEAD_TO_SEQ);
        uint32_t S_loc = sp_rows_local(c->seq_len, P);
        uint64_t row = (uint64_t)c->heads * c->head_dim * elem_size(c->dtype);
        uint8_t *back = malloc(in_bytes[0]);
        for (uint32_t o = 0; o < P; o++) {
            CHECK_EQ(sp_kern_a2a_host(back, (const void *const *)got[0], &d, o), 0);
            uint32_t real = sp_rows_real(c->seq_len, P, o);
            for (uint64_t b = 0; b < c->batch; b++)
                for (uint64_t s = 0; s < S_loc; s++) {
                    uint64_t off = row_of(c, b, s, S_loc) * row;
                    if (s < real) {
                        check_bytes(back + off, in[0][o] + off, row, "round trip", c->name, o);
                    } else {
                        for (uint64_t i = 0; i < row; i++)
                            CHECK_EQ(back[off + i], 0);
                    }
                }
        }
        free(back);
    }
    for (uint32_t dir = 0; dir < 2; dir++)
        for (uint32_t q = 0; q < P; q++) {
            free(in[dir][q]);
            free(ref[dir][q]);
            free(got[dir][q]);
        }
}

static void test_a2a(void)
{
    for (size_t i = 0; i < SP_KERN_NCASES; i++)
        test_a2a_case(&sp_kern_cases[i]);

    /* What the references refuse: heads that cannot be dealt, a rank past P, a
     * sum of u8 replicas (the daemon's sp_kern_reduce takes no u8). */
    sp_kern_a2a_geom_t g;
    sp_kern_a2a_desc_t d = { SP_KERN_HEAD_TO_SEQ, SP_KERN_BSHD, 1, 8, 3, 4, SP_KERN_HEADS_KV, 0, 2, SP_KERN_F32, 0 };
    CHECK_EQ(sp_kern_a2a_geom(&g, &d, 0), 0);
    d.ranks = 4;   /* 3 KV heads on 4 ranks */
    CHECK_EQ(sp_kern_a2a_geom(&g, &d, 0), -1);
    d.ranks = 6;
    CHECK_EQ(sp_kern_a2a_geom(&g, &d, 6), -1);
    d.heads = 1;
    d.dtype = SP_KERN_U8;
    CHECK_EQ(sp_kern_a2a_geom(&g, &d, 0), 0);
    d.flags = SP_KERN_A2A_SUM_REPLICAS;
    CHECK_EQ(sp_kern_a2a_geom(&g, &d, 0), -1);
    d.dtype = 0;
    d.flags = 0;
    CHECK_EQ(sp_kern_a2a_geom(&g, &d, 0), -1);
}

/* ================================================================ shift, zigzag, pad */

static void test_shift(void)
{
    for (uint32_t r = 0; r < 4; r++) {
        CHECK_EQ(sp_kern_shift_source(r, 4, 0), (r + 3) % 4);
        CHECK_EQ(sp_kern_shift_source(r, 4, SP_KERN_SHIFT_REVERSE), (r + 1) % 4);
        CHECK_EQ(sp_kern_shift_source(r, 4, SP_KERN_SHIFT_LINEAR), r == 0 ? -1 : (int64_t)r - 1);
        CHECK_EQ(sp_kern_shift_source(r, 4, SP_KERN_SHIFT_LINEAR | SP_KERN_SHIFT_REVERSE), r == 3 ? -1 : (int64_t)r + 1);
    }
    CHECK_EQ(sp_kern_shift_source(0, 1, 0), 0);
    uint8_t a[37], b[37];
    sp_kern_fill(a, sizeof a, &rng_state);
    sp_kern_shift_host(b, a, sizeof a);
    CHECK(memcmp(a, b, sizeof a) == 0);
    sp_kern_shift_host(b, NULL, sizeof b);
    for (size_t i = 0; i < sizeof b; i++)
        CHECK_EQ(b[i], 0);
}

static void test_zigzag(void)
{
    const uint32_t shapes[][4] = { /* P, B, S, row bytes */
        { 1, 2, 6, 4 }, { 2, 2, 8, 12 }, { 3, 1, 12, 8 }, { 4, 3, 16, 6 }, { 8, 2, 48, 16 },
    };
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++)
        for (uint32_t layout = SP_KERN_BSHD; layout <= SP_KERN_SBHD; layout++) {
            const uint32_t P = shapes[k][0], B = shapes[k][1], S = shapes[k][2], rb = shapes[k][3], C = S / (2 * P);
            sp_kern_zigzag_t z = { layout, B, S, P, rb, 0 };
            uint64_t n = (uint64_t)B * S * rb;
            uint8_t *x = malloc(n), *y = malloc(n), *back = malloc(n);
            sp_kern_fill(x, n, &rng_state);
            CHECK_EQ(sp_kern_zigzag_host(y, x, &z), 0);
            /* Rank r's 2C rows of the split: chunk r, then chunk 2P - 1 - r. */
            for (uint32_t b = 0; b < B; b++)
                for (uint32_t r = 0; r < P; r++)
                    for (uint32_t i = 0; i < 2 * C; i++) {
                        uint32_t chunk = i < C ? r : 2 * P - 1 - r, from = chunk * C + i % C;
                        uint64_t yo = (layout == SP_KERN_BSHD ? (uint64_t)b * S + r * 2 * C + i
                                                              : ((uint64_t)r * 2 * C + i) * B + b) * rb;
                        uint64_t xo = (layout == SP_KERN_BSHD ? (uint64_t)b * S + from : (uint64_t)from * B + b) * rb;
                        CHECK(memcmp(y + yo, x + xo, rb) == 0);
                    }
            z.merge = 1;
            CHECK_EQ(sp_kern_zigzag_host(back, y, &z), 0);
            CHECK(memcmp(back, x, n) == 0);
            free(x);
            free(y);
            free(back);
        }
    sp_kern_zigzag_t bad = { SP_KERN_BSHD, 1, 10, 2, 4, 0 };   /* 10 rows are not 4 chunks */
    uint8_t buf[40];
    CHECK_EQ(sp_kern_zigzag_host(buf, buf, &bad), -1);
}

static void test_pad(void)
{
    /* layout, B, rows in, rows out, groups, per group in, per group out, vec bytes */
    const uint32_t shapes[][8] = {
        { SP_KERN_BSHD, 2, 7, 8, 1, 28, 32, 16 },    /* 28 heads for 8 ranks, 7 rows to 8 */
        { SP_KERN_SBHD, 3, 10, 12, 1, 5, 6, 10 },
        { SP_KERN_BSHD, 1, 11, 12, 2, 3, 4, 8 },     /* GQA: groups of 3 query heads padded to 4 */
        { SP_KERN_SBHD, 2, 5, 5, 4, 7, 8, 2 },
        { SP_KERN_BSHD, 2, 9, 9, 1, 4, 4, 6 },       /* nothing to pad */
    };
    for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++) {
        const uint32_t *t = shapes[k];
        sp_kern_pad_t p = { t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7] };
        const uint32_t hin = p.groups * p.per_group_in, hout = p.groups * p.per_group_out;
        uint64_t nin = (uint64_t)p.batch * p.rows_in * hin * p.vec_bytes;
        uint64_t nout = (uint64_t)p.batch * p.rows_out * hout * p.vec_bytes;
        uint8_t *x = malloc(nin), *y = malloc(nout), *back = malloc(nin);
        sp_kern_fill(x, nin, &rng_state);
        memset(y, FILL, nout);
        CHECK_EQ(sp_kern_pad_host(y, x, &p), 0);
        for (uint32_t b = 0; b < p.batch; b++)
            for (uint32_t s = 0; s < p.rows_out; s++)
                for (uint32_t h = 0; h < hout; h++) {
                    uint32_t grp = h / p.per_group_out, w = h % p.per_group_out;
                    uint64_t rout = t[0] == SP_KERN_BSHD ? (uint64_t)b * p.rows_out + s : (uint64_t)s * p.batch + b;
                    const uint8_t *got = y + (rout * hout + h) * p.vec_bytes;
                    if (s < p.rows_in && w < p.per_group_in) {
                        uint64_t rin = t[0] == SP_KERN_BSHD ? (uint64_t)b * p.rows_in + s : (uint64_t)s * p.batch + b;
                        CHECK(memcmp(got, x + (rin * hin + grp * p.per_group_in + w) * p.vec_bytes, p.vec_bytes) == 0);
                    } else {
                        for (uint64_t i = 0; i < p.vec_bytes; i++)
                            CHECK_EQ(got[i], 0);
                    }
                }
        sp_kern_pad_t u = { t[0], t[1], t[3], t[2], t[4], t[6], t[5], t[7] };
        CHECK_EQ(sp_kern_pad_host(back, y, &u), 0);
        CHECK(memcmp(back, x, nin) == 0);
        free(x);
        free(y);
        free(back);
    }
}

/* ================================================================ LSE merge */

static uint32_t bits_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* Distance in ulps between two finite floats of the same sign or zero. */
static int64_t ulps(float a, float b)
{
    int64_t x = (int32_t)bits_of(a), y = (int32_t)bits_of(b);
    if (x < 0)
        x = INT32_MIN - x;
    if (y < 0)
        y = INT32_MIN - y;
    return x > y ? x - y : y - x;
}

static void test_merge(void)
{
    enum { B = 2, S = 33, H = 3, D = 20 };
    const uint64_t n = (uint64_t)B * S * H * D, nl = (uint64_t)B * H * S;
    float *oa = malloc(n * 4), *ob = malloc(n * 4), *out = malloc(n * 4), *la = malloc(nl * 4), *lb = malloc(nl * 4),
          *lse = malloc(nl * 4);
    for (uint64_t i = 0; i < n; i++) {
        oa[i] = (float)((int64_t)(sp_kern_rng(&rng_state) % 2000001) - 1000000) / 1e5f;
        ob[i] = (float)((int64_t)(sp_kern_rng(&rng_state) % 2000001) - 1000000) / 1e5f;
    }
    for (uint64_t i = 0; i < nl; i++) {
        /* lse over a wide range, equal on both sides now and then, -inf and NaN on either. */
        uint64_t x = sp_kern_rng(&rng_state);
        la[i] = (float)((int64_t)(x % 4001) - 2000) / 37.0f;
        lb[i] = x % 11 == 0 ? la[i] : (float)((int64_t)((x >> 20) % 4001) - 2000) / 37.0f;
        if (x % 13 == 0)
            la[i] = -INFINITY;
        if (x % 17 == 0)
            lb[i] = -INFINITY;
        if (x % 101 == 0)
            lb[i] = NAN;
    }
    for (uint32_t layout = SP_KERN_BSHD; layout <= SP_KERN_SBHD; layout++) {
        sp_kern_lse_merge_t m = { layout, B, S, H, D };
        CHECK_EQ(sp_kern_lse_merge_host(out, lse, oa, la, ob, lb, &m), 0);
        int64_t worst_lse = 0, worst_out = 0;
        for (uint32_t b = 0; b < B; b++)
            for (uint32_t h = 0; h < H; h++)
                for (uint32_t s = 0; s < S; s++) {
                    uint64_t li = ((uint64_t)b * H + h) * S + s;
                    uint64_t o = ((layout == SP_KERN_BSHD ? (uint64_t)b * S + s : (uint64_t)s * B + b) * H + h) * D;
                    float a = la[li], c = lb[li];
                    if (isnan(a) || isnan(c)) {
                        CHECK_EQ(bits_of(lse[li]), 0x7fc00000u);
                        for (uint32_t i = 0; i < D; i++)
                            CHECK_EQ(bits_of(out[o + i]), 0x7fc00000u);
                        continue;
                    }
                    if (a == -INFINITY || c == -INFINITY) {
                        CHECK_EQ(bits_of(lse[li]), bits_of(a == -INFINITY ? c : a));
                        for (uint32_t i = 0; i < D; i++)
                            CHECK_EQ(bits_of(out[o + i]), a == -INFINITY && c == -INFINITY ? 0u
                                                          : bits_of(a == -INFINITY ? ob[o + i] : oa[o + i]));
                        continue;
                    }
                    long double mx = a > c ? a : c, ea = expl((long double)a - mx), ec = expl((long double)c - mx);
                    int64_t d = ulps(lse[li], (float)(mx + logl(ea + ec)));
                    worst_lse = d > worst_lse ? d : worst_lse;
                    for (uint32_t i = 0; i < D; i++) {
                        long double want = (oa[o + i] * ea + ob[o + i] * ec) / (ea + ec);
                        /* Relative to the larger term: a difference of near-equal terms loses the rest. */
                        long double scale = fmaxl(fabsl(oa[o + i]), fabsl(ob[o + i]));
                        long double err = fabsl(out[o + i] - want) / (scale * 0x1p-24L);
                        worst_out = err > worst_out ? (int64_t)ceill(err) : worst_out;
                    }
                }
        if (worst_lse > 2 || worst_out > 4)
            SP_FAIL("LSE merge off the formula: lse by %" PRId64 " ulps, out by %" PRId64 " ulps of the larger term",
                    worst_lse, worst_out);
        /* In place gives the same bits. */
        float *oa2 = malloc(n * 4), *la2 = malloc(nl * 4);
        memcpy(oa2, oa, n * 4);
        memcpy(la2, la, nl * 4);
        CHECK_EQ(sp_kern_lse_merge_host(oa2, la2, oa2, la2, ob, lb, &m), 0);
        CHECK(memcmp(oa2, out, n * 4) == 0);
        CHECK(memcmp(la2, lse, nl * 4) == 0);
        free(oa2);
        free(la2);
    }
    free(oa);
    free(ob);
    free(out);
    free(la);
    free(lb);
    free(lse);
}

int main(void)
{
    test_a2a();
    test_shift();
    test_zigzag();
    test_pad();
    test_merge();
    printf("kern_a2a: %zu all-to-all cases match the daemon's loop; shift, zigzag, pad and LSE merge pass\n",
           (size_t)SP_KERN_NCASES);
    return 0;
}
