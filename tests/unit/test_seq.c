/* The sequence helpers (client/src/seq.c) against references written here by
 * other formulas: zigzag split/merge/positions, cu_seqlens, and the Ulysses
 * heads-per-rank rule. */
#include "sp_test.h"

/* A small deterministic generator, so failures reproduce. */
static uint32_t rng_state = 12345;
static uint32_t rng(void)
{
    rng_state = rng_state * 1103515245u + 12345u;
    return rng_state >> 8;
}

/* ================================================================ zigzag */

/* Where global row g lives, worked out from the row rather than from the rank:
 * chunk k = g / c is early (k < P, owner k, first half) or late (owner 2P-1-k,
 * second half). */
static void zz_owner(uint64_t g, uint64_t c, uint32_t P, uint32_t *rank, uint64_t *lrow)
{
    uint64_t k = g / c;
    if (k < P) {
        *rank = (uint32_t)k;
        *lrow = g % c;
    } else {
        *rank = (uint32_t)(2 * P - 1 - k);
        *lrow = c + g % c;
    }
}

/* Splits a random full array on every rank, checks each byte against zz_owner,
 * checks every local byte was accounted for, then merges back byte for byte. */
static void check_zigzag(uint32_t P, uint64_t outer, uint64_t seq_len, uint64_t rb)
{
    uint64_t c = seq_len / (2 * P), lrows = 2 * c;
    size_t full_bytes = outer * seq_len * rb, local_bytes = outer * lrows * rb;
    uint8_t *full = malloc(full_bytes), *back = malloc(full_bytes);
    uint8_t **locals = calloc(P, sizeof *locals), **seen = calloc(P, sizeof *seen);
    CHECK(full && back && locals && seen);
    for (size_t i = 0; i < full_bytes; i++)
        full[i] = (uint8_t)rng();
    for (uint32_t r = 0; r < P; r++) {
        locals[r] = malloc(local_bytes);
        seen[r] = calloc(local_bytes ? local_bytes : 1, 1);
        CHECK(locals[r] && seen[r]);
        memset(locals[r], 0xA5, local_bytes);
        CHECK_OK(NULL, spc_zigzag_split(full, locals[r], outer, seq_len, rb, P, r));
    }
    for (uint64_t o = 0; o < outer; o++) {
        for (uint64_t g = 0; g < seq_len; g++) {
            uint32_t r;
            uint64_t lrow;
            zz_owner(g, c, P, &r, &lrow);
            CHECK(r < P && lrow < lrows);
            size_t lo = (o * lrows + lrow) * rb, fo = (o * seq_len + g) * rb;
            for (uint64_t b = 0; b < rb; b++) {
                if (locals[r][lo + b] != full[fo + b])
                    SP_FAIL("P=%u outer=%" PRIu64 " S=%" PRIu64 " rb=%" PRIu64 ": row %" PRIu64
                            " byte %" PRIu64 " not at rank %u local row %" PRIu64,
                            P, outer, seq_len, rb, g, b, r, lrow);
                CHECK_EQ(seen[r][lo + b], 0);
                seen[r][lo + b] = 1;
            }
        }
    }
    for (uint32_t r = 0; r < P; r++)
        for (size_t i = 0; i < local_bytes; i++)
            CHECK_EQ(seen[r][i], 1);

    memset(back, 0xEE, full_bytes);
    CHECK_OK(NULL, spc_zigzag_merge((const void *const *)locals, back, outer, seq_len, rb, P));
    CHECK(memcmp(back, full, full_bytes) == 0);

    for (uint32_t r = 0; r < P; r++) {
        free(locals[r]);
        free(seen[r]);
    }
    free(locals);
    free(seen);
    free(full);
    free(back);
}

/* positions must equal split applied to an iota array. */
static void check_positions(uint32_t P, uint64_t seq_len)
{
    uint64_t n = seq_len / P;
    int64_t *iota = malloc(seq_len * sizeof *iota), *want = malloc(n * sizeof *want);
    int64_t *got = malloc(n * sizeof *got);
    CHECK(iota && want && got);
    for (uint64_t g = 0; g < seq_len; g++)
        iota[g] = (int64_t)g;
    for (uint32_t r = 0; r < P; r++) {
        CHECK_OK(NULL, spc_zigzag_split(iota, want, 1, seq_len, sizeof *iota, P, r));
        memset(got, 0xff, n * sizeof *got);
        CHECK_OK(NULL, spc_zigzag_positions(seq_len, P, r, got));
        for (uint64_t j = 0; j < n; j++)
            CHECK_EQ(got[j], want[j]);
    }
    free(iota);
    free(want);
    free(got);
}

static void test_zigzag(void)
{
    static const uint32_t Ps[] = {1, 2, 3, 4, 8};
    static const uint64_t outers[] = {1, 3};
    static const uint64_t rbs[] = {1, 7, 13, 64};
    for (size_t i = 0; i < sizeof Ps / sizeof Ps[0]; i++) {
        uint32_t P = Ps[i];
        for (uint64_t mult = 1; mult <= 3; mult++) {
            uint64_t S = 2 * P * mult;
            for (size_t j = 0; j < sizeof outers / sizeof outers[0]; j++)
                for (size_t k = 0; k < sizeof rbs / sizeof rbs[0]; k++)
                    check_zigzag(P, outers[j], S, rbs[k]);
            check_positions(P, S);
        }
    }

    /* A worked example: S = 8, P = 2, chunks of 2 rows. */
    int64_t pos[4];
    CHECK_OK(NULL, spc_zigzag_positions(8, 2, 0, pos));
    CHECK(pos[0] == 0 && pos[1] == 1 && pos[2] == 6 && pos[3] == 7);
    CHECK_OK(NULL, spc_zigzag_positions(8, 2, 1, pos));
    CHECK(pos[0] == 2 && pos[1] == 3 && pos[2] == 4 && pos[3] == 5);

    /* Invalid inputs. */
    uint8_t full[64] = {0}, local[64] = {0};
    const void *locals[2] = {local, local};
    const void *one_null[2] = {local, NULL};
    CHECK_ST(NULL, spc_zigzag_split(full, local, 1, 6, 1, 2, 0), SPC_ERR_INVALID_ARG);   /* 6 % 4 */
    CHECK_ST(NULL, spc_zigzag_split(full, local, 1, 8, 1, 2, 2), SPC_ERR_INVALID_ARG);   /* rank == P */
    CHECK_ST(NULL, spc_zigzag_split(full, local, 1, 8, 1, 0, 0), SPC_ERR_INVALID_ARG);   /* P == 0 */
    CHECK_ST(NULL, spc_zigzag_split(NULL, local, 1, 8, 1, 2, 0), SPC_ERR_INVALID_ARG);
    CHECK_ST(NULL, spc_zigzag_split(full, NULL, 1, 8, 1, 2, 0), SPC_ERR_INVALID_ARG);
    CHECK_ST(NULL, spc_zigzag_split(full, local, UINT64_MAX, 8, 1 << 20, 2, 0), SPC_ERR_INVALID_ARG);
    CHECK_ST(NULL, spc_zigzag_merge(locals, full, 1, 6, 1, 2), SPC_ERR_INVALID_ARG);
    CHECK_ST(NULL, spc_zigzag_merge(locals, full, 1, 8, 1, 0), SPC_ERR_INVALID_ARG);
    CHECK_ST(NULL, spc_zigzag_merge(NULL, full, 1, 8, 1, 2), SPC_ERR_INVALID_ARG);
    CHECK_ST(NULL, spc_zigzag_merge(locals, NULL, 1, 8, 1, 2), SPC_ERR_INVALID_ARG);
    memset(full, 0x5a, sizeof full);
    CHECK_ST(NULL, spc_zigzag_merge(one_null, full, 1, 8, 1, 2), SPC_ERR_INVALID_ARG);
    CHECK_EQ(full[0], 0x5a);   /* nothing written on failure */
    CHECK_ST(NULL, spc_zigzag_positions(6, 2, 0, pos), SPC_ERR_INVALID_ARG);
    CHECK_ST(NULL, spc_zigzag_positions(8, 2, 2, pos), SPC_ERR_INVALID_ARG);
    CHECK_ST(NULL, spc_zigzag_positions(8, 0, 0, pos), SPC_ERR_INVALID_ARG);
    CHECK_ST(NULL, spc_zigzag_positions(8, 2, 0, NULL), SPC_ERR_INVALID_ARG);
}

/* ================================================================ cu_seqlens */

/* Runs spc_cu_seqlens on pos[n] and compares with the expected offsets. */
static void check_cu(const int64_t *pos, uint64_t n, const int32_t *want, uint64_t want_docs, int32_t want_max)
{
    int32_t cu[64];
    uint64_t ndocs = 0;
    int32_t max_len = -1;
    memset(cu, 0x7f, sizeof cu);
    CHECK_OK(NULL, spc_cu_seqlens(pos, n, cu, want_docs + 1, &ndocs, &max_len));   /* exact room */
    CHECK_EQ(ndocs, want_docs);
    CHECK_EQ(max_len, want_max);
    for (uint64_t i = 0; i <= want_docs; i++)
        CHECK_EQ(cu[i], want[i]);
    CHECK_EQ(cu[want_docs + 1], 0x7f7f7f7f);   /* nothing past the last offset */
    /* The counts are optional. */
    CHECK_OK(NULL, spc_cu_seqlens(pos, n, cu, 64, NULL, NULL));
    /* One slot short is refused, leaving the outputs alone. */
    ndocs = 999;
    max_len = -1;
    CHECK_ST(NULL, spc_cu_seqlens(pos, n, cu, want_docs, &ndocs, &max_len), SPC_ERR_INVALID_ARG);
    CHECK_EQ(ndocs, 999);
    CHECK_EQ(max_len, -1);
}

/* Random documents: positions built from chosen lengths (the first one may begin
 * mid-document, as on a shard), and the expected offsets from the same lengths. */
static void check_cu_random(void)
{
    for (int it = 0; it < 200; it++) {
        int64_t pos[512];
        int32_t want[64];
        uint64_t n = 0, docs = 0;
        int32_t max_len = 0;
        want[0] = 0;
        while (docs < 40) {
            uint64_t len = 1 + rng() % 12;
            if (n + len > sizeof pos / sizeof pos[0])
                break;
            /* The first document starts anywhere; the next ones start at 0. */
            int64_t first = docs == 0 ? (int64_t)(rng() % 5) : 0;
            for (uint64_t j = 0; j < len; j++)
                pos[n + j] = first + (int64_t)j;
            n += len;
            want[++docs] = (int32_t)n;
            if ((int32_t)len > max_len)
                max_len = (int32_t)len;
            if (rng() % 8 == 0)
                break;
        }
        check_cu(pos, n, want, docs, max_len);
    }
}

static void test_cu_seqlens(void)
{
    /* Packed documents of 3, 2 and 4. */
    static const int64_t packed[] = {0, 1, 2, 0, 1, 0, 1, 2, 3};
    static const int32_t packed_cu[] = {0, 3, 5, 9};
    check_cu(packed, 9, packed_cu, 3, 4);

    /* One document. */
    static const int64_t single[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9};
    static const int32_t single_cu[] = {0, 10};
    check_cu(single, 10, single_cu, 1, 10);

    /* Documents of length 1. */
    static const int64_t ones[] = {0, 0, 0, 0};
    static const int32_t ones_cu[] = {0, 1, 2, 3, 4};
    check_cu(ones, 4, ones_cu, 4, 1);

    /* A shard that begins mid-document: row 0 still starts one. */
    static const int64_t mid[] = {5, 6, 7, 0, 1};
    static const int32_t mid_cu[] = {0, 3, 5};
    check_cu(mid, 5, mid_cu, 2, 3);

    /* A jump that is not to 0 also starts a document, as does going backwards. */
    static const int64_t jumps[] = {0, 1, 2, 7, 8, 3, 4, 4};
    static const int32_t jumps_cu[] = {0, 3, 5, 7, 8};
    check_cu(jumps, 8, jumps_cu, 4, 3);

    /* Position 0 starts a document even when it follows -1 (padding ids). */
    static const int64_t neg[] = {3, -1, 0, 1};
    static const int32_t neg_cu[] = {0, 1, 2, 4};
    check_cu(neg, 4, neg_cu, 3, 2);

    /* Extremes of int64 must not overflow prev + 1. */
    static const int64_t big[] = {INT64_MAX - 1, INT64_MAX, INT64_MIN, INT64_MIN + 1};
    static const int32_t big_cu[] = {0, 2, 4};
    check_cu(big, 4, big_cu, 2, 2);

    check_cu_random();

    /* Invalid inputs. */
    int32_t cu[8];
    CHECK_ST(NULL, spc_cu_seqlens(packed, 0, cu, 8, NULL, NULL), SPC_ERR_INVALID_ARG);
    CHECK_ST(NULL, spc_cu_seqlens(NULL, 9, cu, 8, NULL, NULL), SPC_ERR_INVALID_ARG);
    CHECK_ST(NULL, spc_cu_seqlens(packed, 9, NULL, 8, NULL, NULL), SPC_ERR_INVALID_ARG);
    CHECK_ST(NULL, spc_cu_seqlens(packed, 9, cu, 0, NULL, NULL), SPC_ERR_INVALID_ARG);
    CHECK_ST(NULL, spc_cu_seqlens(packed, 9, cu, 1, NULL, NULL), SPC_ERR_INVALID_ARG);
}

/* ================================================================ Ulysses heads */

static void test_local_heads(void)
{
    static const struct {
        uint32_t heads, kind, kv_heads, P, want;
    } cases[] = {
        /* Q heads, one per group. */
        {28, SPC_HEADS_Q, 0, 8, 4},      /* 28 -> 32 with dummies, 4 each */
        {7, SPC_HEADS_Q, 0, 4, 2},
        {32, SPC_HEADS_Q, 0, 8, 4},
        {8, SPC_HEADS_Q, 0, 1, 8},
        {1, SPC_HEADS_Q, 0, 1, 1},
        {5, SPC_HEADS_Q, 0, 8, 0},       /* 5 groups < 8 ranks, 8 % 5 != 0 */
        {4, SPC_HEADS_Q, 0, 8, 1},       /* 2 ranks per group, 1 head split -> 1 */
        /* KV heads: the groups themselves; kv_heads is ignored. */
        {2, SPC_HEADS_KV, 0, 8, 1},      /* replicated to 4 ranks each */
        {2, SPC_HEADS_KV, 7, 8, 1},
        {8, SPC_HEADS_KV, 0, 8, 1},
        {28, SPC_HEADS_KV, 0, 8, 4},
        {3, SPC_HEADS_KV, 0, 8, 0},
        {1, SPC_HEADS_KV, 0, 8, 1},
        /* GQA queries. */
        {32, SPC_HEADS_Q, 2, 8, 4},      /* g 16, r 4 */
        {28, SPC_HEADS_Q, 4, 8, 4},      /* g 7, r 2: 7 -> 8, 4 each */
        {32, SPC_HEADS_Q, 8, 8, 4},      /* one group per rank */
        {32, SPC_HEADS_Q, 8, 4, 8},      /* two groups per rank */
        {24, SPC_HEADS_Q, 6, 4, 8},      /* 6 groups -> 8, 2 groups of 4 */
        {6, SPC_HEADS_Q, 1, 4, 2},       /* g 6, r 4: 6 -> 8, 2 each */
        {2, SPC_HEADS_Q, 1, 8, 1},       /* g 2, r 8: 2 -> 8, 1 each */
        /* Invalid. */
        {0, SPC_HEADS_Q, 0, 8, 0},       /* no heads */
        {0, SPC_HEADS_KV, 0, 8, 0},
        {8, SPC_HEADS_Q, 0, 0, 0},       /* no ranks */
        {8, SPC_HEADS_KV, 0, 0, 0},
        {28, SPC_HEADS_Q, 3, 8, 0},      /* kv_heads does not divide heads */
        {4, SPC_HEADS_Q, 8, 2, 0},       /* more groups than heads */
        {24, SPC_HEADS_Q, 3, 8, 0},      /* 3 groups < 8 ranks, 8 % 3 != 0 */
        {8, 2, 0, 8, 0},                 /* unknown kind */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        uint32_t got = spc_a2a_local_heads(cases[i].heads, cases[i].kind, cases[i].kv_heads, cases[i].P);
        if (got != cases[i].want)
            SP_FAIL("case %zu: heads %u kind %u kv_heads %u P %u: got %u, want %u", i, cases[i].heads,
                    cases[i].kind, cases[i].kv_heads, cases[i].P, got, cases[i].want);
    }
}

int main(void)
{
    test_zigzag();
    test_cu_seqlens();
    test_local_heads();
    printf("seq: ok\n");
    return 0;
}
