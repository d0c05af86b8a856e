/*
 * Causal attention computed the sequence-parallel way, through spd, against full
 * causal attention computed in one process:
 *
 *   1. zigzag Ring-Attention over the world group (P = 2 and 4): each rank takes
 *      its zigzag shard (spc_zigzag_split) and global positions
 *      (spc_zigzag_positions), rotates K and V with one spc_ishift per step,
 *      double buffered, the next rotation submitted before computing on the
 *      current block, and merges the blocks' outputs by their log-sum-exp. The
 *      parent merges the ranks' outputs back (spc_zigzag_merge) and checks the
 *      whole sequence as well.
 *   2. the hybrid on a mesh of 4 ranks, sp = 4 = ulysses 2 x ring 2: zigzag over
 *      the ring, each ring shard split by rows across its Ulysses pair,
 *      all-to-all seq->head (q, k, v in one op), Ring-Attention over the ring on
 *      the local heads, all-to-all head->seq (output and LSE in one op).
 *
 * The causal mask always comes from global positions, which the test tracks
 * explicitly through every stage rather than assuming them.
 *
 * Tolerance: fp32 with online softmax against a float64 reference; an element
 * passes when |got - ref| <= 1e-5 * max(|ref|, max |ref| over its row and head).
 */
#include <math.h>

#include "sp_test.h"

#define WAIT_MS 10000
#define RTOL    1e-5

#define MAX_S 64
#define MAX_H 4
#define MAX_D 32
#define MAX_P 4

/* ------------------------------------------------------------------ data */

enum { Q, K, V };

/* Element idx of tensor `which` ([S, H, D], B = 1), uniform in [-1.5, 1.5). */
static float input(int which, uint64_t idx, uint32_t salt)
{
    uint64_t x = (uint64_t)(which + 1) * 0x9E3779B97F4A7C15ull ^ (idx + 1) * 0xBF58476D1CE4E5B9ull ^
                 (uint64_t)(salt + 1) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    x *= 0xD6E8FEB86659FD93ull;
    x ^= x >> 29;
    return (float)(((double)(x >> 40) / (double)(1ull << 24)) * 3.0 - 1.5);
}

static void make_inputs(float *q, float *k, float *v, uint64_t S, uint32_t H, uint32_t D, uint32_t salt)
{
    for (uint64_t i = 0; i < S * H * D; i++) {
        q[i] = input(Q, i, salt);
        k[i] = input(K, i, salt);
        v[i] = input(V, i, salt);
    }
}

/* The zigzag position of local row i of rank r, from the layout's definition:
 * 2P chunks of c rows, rank r holds chunks r and 2P-1-r. */
static int64_t zigzag_pos(uint64_t S, uint32_t P, uint32_t r, uint64_t i)
{
    uint64_t c = S / (2 * P);
    return (int64_t)(i < c ? r * c + i : (2 * P - 1 - r) * c + (i - c));
}

/* Full causal attention in float64: out [S, H, D], lse [S, H]. */
static void reference(const float *q, const float *k, const float *v, uint64_t S, uint32_t H, uint32_t D,
                      double *out, double *lse)
{
    double scale = 1.0 / sqrt((double)D), sc[MAX_S];
    for (uint64_t i = 0; i < S; i++)
        for (uint32_t h = 0; h < H; h++) {
            double m = -INFINITY;
            for (uint64_t j = 0; j <= i; j++) {
                double s = 0;
                for (uint32_t e = 0; e < D; e++)
                    s += (double)q[(i * H + h) * D + e] * (double)k[(j * H + h) * D + e];
                sc[j] = s * scale;
                m = fmax(m, sc[j]);
            }
            double l = 0;
            double *o = &out[(i * H + h) * D];
            for (uint32_t e = 0; e < D; e++)
                o[e] = 0;
            for (uint64_t j = 0; j <= i; j++) {
                double p = exp(sc[j] - m);
                l += p;
                for (uint32_t e = 0; e < D; e++)
                    o[e] += p * (double)v[(j * H + h) * D + e];
            }
            for (uint32_t e = 0; e < D; e++)
                o[e] /= l;
            lse[i * H + h] = m + log(l);
        }
}

/* Compares one row (all H heads) of output and LSE with the reference row at
 * global position g; returns the largest scaled error seen and fails past RTOL. */
static double compare_row(const float *out, const float *lse, const double *ref_out, const double *ref_lse,
                          int64_t g, uint32_t H, uint32_t D, const char *what, uint64_t row)
{
    double worst = 0;
    for (uint32_t h = 0; h < H; h++) {
        const double *r = &ref_out[((uint64_t)g * H + h) * D];
        double rmax = 0;
        for (uint32_t e = 0; e < D; e++)
            rmax = fmax(rmax, fabs(r[e]));
        for (uint32_t e = 0; e < D; e++) {
            double got = out[(row * H + h) * D + e];
            double err = fabs(got - r[e]) / fmax(fabs(r[e]), rmax);
            if (!(err <= RTOL))
                SP_FAIL("%s: row %llu (position %lld) head %u dim %u: %.9g, reference %.9g (error %.3g)", what,
                        (unsigned long long)row, (long long)g, h, e, got, r[e], err);
            worst = fmax(worst, err);
        }
        double gl = lse[row * H + h], rl = ref_lse[(uint64_t)g * H + h];
        double err = fabs(gl - rl) / fmax(fabs(rl), 1.0);
        if (!(err <= RTOL))
            SP_FAIL("%s: row %llu (position %lld) head %u: LSE %.9g, reference %.9g (error %.3g)", what,
                    (unsigned long long)row, (long long)g, h, gl, rl, err);
        worst = fmax(worst, err);
    }
    return worst;
}

static void *must_alloc(spc_handle_t *h, uint64_t bytes)
{
    void *p = spc_alloc(h, bytes);
    if (p == NULL)
        SP_FAIL("spc_alloc(%llu) returned NULL", (unsigned long long)bytes);
    return p;
}

/* ------------------------------------------------------------------ Ring-Attention */

/*
 * One causal attention block in fp32: queries q [L, Hl, D] at qpos against keys
 * and values [L, Hl, D] at kpos, with an online softmax over the keys. Writes
 * out [L, Hl, D] and lse [L, Hl]; a query that sees no key gets lse = -inf and
 * out = 0.
 */
static void block_attn(const float *q, const float *k, const float *v, const int64_t *qpos, const int64_t *kpos,
                       uint64_t L, uint32_t Hl, uint32_t D, float *out, float *lse)
{
    float scale = 1.0f / sqrtf((float)D), acc[MAX_D];
    for (uint64_t i = 0; i < L; i++)
        for (uint32_t h = 0; h < Hl; h++) {
            const float *qi = &q[(i * Hl + h) * D];
            float m = -INFINITY, l = 0;
            for (uint32_t e = 0; e < D; e++)
                acc[e] = 0;
            for (uint64_t j = 0; j < L; j++) {
                if (kpos[j] > qpos[i])
                    continue;
                const float *kj = &k[(j * Hl + h) * D], *vj = &v[(j * Hl + h) * D];
                float s = 0;
                for (uint32_t e = 0; e < D; e++)
                    s += qi[e] * kj[e];
                s *= scale;
                if (s > m) {
                    float corr = expf(m - s);   /* 0 for the first key */
                    l *= corr;
                    for (uint32_t e = 0; e < D; e++)
                        acc[e] *= corr;
                    m = s;
                }
                float p = expf(s - m);
                l += p;
                for (uint32_t e = 0; e < D; e++)
                    acc[e] += p * vj[e];
            }
            float *o = &out[(i * Hl + h) * D];
            for (uint32_t e = 0; e < D; e++)
                o[e] = l > 0 ? acc[e] / l : 0.0f;
            lse[i * Hl + h] = l > 0 ? m + logf(l) : -INFINITY;
        }
}

/* Merges a block's (bo, blse) into the running (out, lse) by log-sum-exp. */
static void lse_merge(float *out, float *lse, const float *bo, const float *blse, uint64_t L, uint32_t Hl,
                      uint32_t D)
{
    for (uint64_t n = 0; n < L * Hl; n++) {
        if (blse[n] == -INFINITY)
            continue;
        if (lse[n] == -INFINITY) {
            memcpy(&out[n * D], &bo[n * D], D * sizeof *out);
            lse[n] = blse[n];
            continue;
        }
        float hi = fmaxf(lse[n], blse[n]), lo = fminf(lse[n], blse[n]);
        float merged = hi + log1pf(expf(lo - hi));
        float wa = expf(lse[n] - merged), wb = expf(blse[n] - merged);
        for (uint32_t e = 0; e < D; e++)
            out[n * D + e] = wa * out[n * D + e] + wb * bo[n * D + e];
        lse[n] = merged;
    }
}

/*
 * Ring-Attention over `group` (P ranks, this one ring rank r): q, k, v are this
 * rank's [L, Hl, D] rows, qpos their global positions, kvpos[j * L ...] the
 * global positions of ring rank j's rows. K and V travel together in one shift
 * per step, from rank j to j + 1, so at step s this rank holds rank r - s's
 * block. Writes out [L, Hl, D] and lse [L, Hl].
 */
static void ring_attention(spc_handle_t *h, spc_group_t group, uint32_t P, uint32_t r, uint64_t L, uint32_t Hl,
                           uint32_t D, const float *q, const float *k, const float *v, const int64_t *qpos,
                           const int64_t *kvpos, float *out, float *lse, const char *what)
{
    uint64_t n = L * Hl * D, bytes = n * sizeof(float);
    float *kv[2] = { must_alloc(h, 2 * bytes), must_alloc(h, 2 * bytes) };   /* K then V */
    float *bo = malloc(bytes), *blse = malloc(L * Hl * sizeof *blse);
    CHECK(bo != NULL && blse != NULL);
    memcpy(kv[0], k, bytes);
    memcpy(kv[0] + n, v, bytes);
    for (uint64_t i = 0; i < n; i++)
        out[i] = 0;
    for (uint64_t i = 0; i < L * Hl; i++)
        lse[i] = -INFINITY;

    for (uint32_t s = 0; s < P; s++) {
        uint32_t cur = s % 2, nxt = 1 - cur, src = (r + P - s) % P;
        spc_request_t *req = NULL;
        if (s + 1 < P) {
            spc_shift_desc_t d = { .struct_size = sizeof d, .group = group, .channel = 0, .ntensors = 2,
                                   .timeout_ms = WAIT_MS };
            d.tensors[0].send = kv[cur];
            d.tensors[0].recv = kv[nxt];
            d.tensors[0].bytes = bytes;
            d.tensors[1].send = kv[cur] + n;
            d.tensors[1].recv = kv[nxt] + n;
            d.tensors[1].bytes = bytes;
            CHECK_OK(h, spc_ishift(h, &d, &req));
        }
        block_attn(q, kv[cur], kv[cur] + n, qpos, &kvpos[src * L], L, Hl, D, bo, blse);
        lse_merge(out, lse, bo, blse, L, Hl, D);
        if (req != NULL) {
            spc_status_t st = spc_wait(req, WAIT_MS);
            if (st != SPC_OK)
                SP_FAIL("%s: K/V rotation %u: %s (%s)", what, s, spc_status_name(st),
                        st == SPC_IN_PROGRESS ? "still in flight" : spc_request_detail(req));
            spc_request_release(req);
        }
    }
    for (uint64_t i = 0; i < L * Hl; i++)
        CHECK(isfinite(lse[i]));   /* every query sees at least itself */
    free(bo);
    free(blse);
    spc_free(h, kv[0]);
    spc_free(h, kv[1]);
}

/* ------------------------------------------------------------------ the shared state */

struct cfg {
    uint32_t P, H, D, c, salt;   /* S = 2 P c (ring); hybrid: P is the ring degree, 2 */
};

/* Written by the parent before the job (reference) and by ranks (outputs). */
struct shared {
    double ref_out[MAX_S * MAX_H * MAX_D];
    double ref_lse[MAX_S * MAX_H];
    float  out[MAX_P][MAX_S * MAX_H * MAX_D];   /* each rank's local rows */
    float  lse[MAX_P][MAX_S * MAX_H];
    double worst[MAX_P];
};

static struct shared *sh;

/* ------------------------------------------------------------------ 1: ring over the world */

static int rank_ring(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    const struct cfg *c = arg;
    uint32_t P = (uint32_t)nranks, r = (uint32_t)rank, H = c->H, D = c->D;
    uint64_t S = 2ull * P * c->c, L = S / P, row = (uint64_t)H * D, n = L * row;
    char what[96];
    snprintf(what, sizeof what, "ring P=%u H=%u D=%u S=%llu rank %u", P, H, D, (unsigned long long)S, r);

    float *full[3], *loc[3];
    for (int t = 0; t < 3; t++) {
        full[t] = malloc(S * row * sizeof(float));
        CHECK(full[t] != NULL);
    }
    make_inputs(full[Q], full[K], full[V], S, H, D, c->salt);

    /* Positions: the library's, checked against the layout's definition. */
    int64_t *kvpos = malloc(P * L * sizeof *kvpos);
    CHECK(kvpos != NULL);
    for (uint32_t j = 0; j < P; j++) {
        CHECK_OK(h, spc_zigzag_positions(S, P, j, &kvpos[j * L]));
        for (uint64_t i = 0; i < L; i++)
            if (kvpos[j * L + i] != zigzag_pos(S, P, j, i))
                SP_FAIL("%s: spc_zigzag_positions(rank %u)[%llu] = %lld, expected %lld", what, j,
                        (unsigned long long)i, (long long)kvpos[j * L + i], (long long)zigzag_pos(S, P, j, i));
    }
    const int64_t *qpos = &kvpos[r * L];

    /* The shard: split, and each local row is the full row at its position. */
    for (int t = 0; t < 3; t++) {
        loc[t] = must_alloc(h, n * sizeof(float));
        CHECK_OK(h, spc_zigzag_split(full[t], loc[t], 1, S, row * sizeof(float), P, r));
        for (uint64_t i = 0; i < L; i++)
            if (memcmp(&loc[t][i * row], &full[t][(uint64_t)qpos[i] * row], row * sizeof(float)) != 0)
                SP_FAIL("%s: spc_zigzag_split row %llu is not global row %lld", what, (unsigned long long)i,
                        (long long)qpos[i]);
    }

    float *out = must_alloc(h, n * sizeof(float)), *lse = must_alloc(h, L * H * sizeof(float));
    ring_attention(h, world, P, r, L, H, D, loc[Q], loc[K], loc[V], qpos, kvpos, out, lse, what);

    double worst = 0;
    for (uint64_t i = 0; i < L; i++)
        worst = fmax(worst, compare_row(out, lse, sh->ref_out, sh->ref_lse, qpos[i], H, D, what, i));
    memcpy(sh->out[r], out, n * sizeof(float));
    memcpy(sh->lse[r], lse, L * H * sizeof(float));
    sh->worst[r] = worst;

    for (int t = 0; t < 3; t++)
        free(full[t]);
    free(kvpos);
    CHECK_OK(h, spc_barrier(h, world, WAIT_MS));
    return 0;
}

/* Runs case 1 for one configuration; returns the worst error seen. */
static double run_ring(const struct cfg *c)
{
    uint32_t P = c->P, H = c->H, D = c->D;
    uint64_t S = 2ull * P * c->c, row = (uint64_t)H * D;
    CHECK(S <= MAX_S && H <= MAX_H && D <= MAX_D && P <= MAX_P);
    float *q = malloc(S * row * sizeof *q), *k = malloc(S * row * sizeof *k), *v = malloc(S * row * sizeof *v);
    CHECK(q && k && v);
    make_inputs(q, k, v, S, H, D, c->salt);
    memset(sh, 0, sizeof *sh);
    reference(q, k, v, S, H, D, sh->ref_out, sh->ref_lse);

    sp_test_run_job((int)P, rank_ring, (void *)c);

    /* Merged back, the ranks' rows cover the sequence once, in order. */
    const void *outs[MAX_P], *lses[MAX_P];
    for (uint32_t r = 0; r < P; r++) {
        outs[r] = sh->out[r];
        lses[r] = sh->lse[r];
    }
    float *out = malloc(S * row * sizeof *out), *lse = malloc(S * H * sizeof *lse);
    CHECK(out && lse);
    CHECK_OK(NULL, spc_zigzag_merge(outs, out, 1, S, row * sizeof(float), P));
    CHECK_OK(NULL, spc_zigzag_merge(lses, lse, 1, S, H * sizeof(float), P));
    char what[96];
    snprintf(what, sizeof what, "ring P=%u H=%u D=%u S=%llu, merged", P, H, D, (unsigned long long)S);
    double worst = 0;
    for (uint64_t i = 0; i < S; i++)
        worst = fmax(worst, compare_row(out, lse, sh->ref_out, sh->ref_lse, (int64_t)i, H, D, what, i));
    for (uint32_t r = 0; r < P; r++)
        worst = fmax(worst, sh->worst[r]);
    free(q);
    free(k);
    free(v);
    free(out);
    free(lse);
    return worst;
}

/* ------------------------------------------------------------------ 2: the hybrid */

#define HYB_SP 4
#define HYB_U  2
#define HYB_R  2

/*
 * Row bookkeeping, with PR = ring degree, U = Ulysses degree, L = S / PR rows per
 * ring shard and Lu = L / U rows per rank:
 *
 *   ring shard of ring rank rr:   zigzag rows, position zz(rr, i), i < L
 *   rank (rr, u) before seq->head: shard rows [u Lu, (u + 1) Lu)
 *   after seq->head:              the rows of ulysses ranks 0..U-1 of ring rank
 *                                 rr, concatenated in group-rank order
 *   after head->seq:              rank (rr, u)'s own rows again
 *
 * held_pos() and gathered_pos() compute these from the definitions, stage by
 * stage, rather than assuming that the gathered rows are the zigzag shard.
 */
static void held_pos(uint64_t S, uint32_t PR, uint32_t U, uint32_t rr, uint32_t u, int64_t *pos)
{
    uint64_t L = S / PR, Lu = L / U;
    for (uint64_t i = 0; i < Lu; i++)
        pos[i] = zigzag_pos(S, PR, rr, u * Lu + i);
}

static void gathered_pos(uint64_t S, uint32_t PR, uint32_t U, uint32_t rr, int64_t *pos)
{
    uint64_t Lu = S / PR / U;
    for (uint32_t u = 0; u < U; u++)
        held_pos(S, PR, U, rr, u, &pos[u * Lu]);
}

static int rank_hybrid(spc_handle_t *h, spc_group_t world, int rank, int nranks, void *arg)
{
    const struct cfg *c = arg;
    uint32_t H = c->H, D = c->D;
    uint64_t S = 2ull * HYB_R * c->c, L = S / HYB_R, Lu = L / HYB_U, row = (uint64_t)H * D;
    char what[128];

    spc_mesh_spec_t spec = { .struct_size = sizeof spec, .sp = HYB_SP, .ulysses = HYB_U, .ring = HYB_R,
                             .heads = H, .kv_heads = H };
    spc_mesh_t m;
    CHECK_OK(h, spc_mesh_create(h, &spec, &m));
    CHECK_EQ(m.dp, 1);
    CHECK_EQ(m.sp, HYB_SP);
    CHECK_EQ(m.ulysses, HYB_U);
    CHECK_EQ(m.ring, HYB_R);
    CHECK_EQ(m.dp_rank, 0);
    CHECK_EQ(m.ring_rank * HYB_U + m.ulysses_rank, rank);   /* ulysses innermost */
    uint32_t rr = m.ring_rank, u = m.ulysses_rank;
    snprintf(what, sizeof what, "hybrid H=%u D=%u S=%llu rank %d (ring %u, ulysses %u)", H, D,
             (unsigned long long)S, rank, rr, u);

    uint32_t Hl = spc_a2a_local_heads(H, SPC_HEADS_Q, 0, HYB_U);
    CHECK_EQ(Hl, H / HYB_U);
    CHECK_EQ(spc_a2a_local_heads(H, SPC_HEADS_KV, 0, HYB_U), Hl);

    float *full[3];
    for (int t = 0; t < 3; t++) {
        full[t] = malloc(S * row * sizeof(float));
        CHECK(full[t] != NULL);
    }
    make_inputs(full[Q], full[K], full[V], S, H, D, c->salt);

    /* Stage 1: zigzag over the ring, then this rank's rows of the shard. */
    int64_t zz[MAX_S], mine[MAX_S];
    CHECK_OK(h, spc_zigzag_positions(S, HYB_R, rr, zz));
    for (uint64_t i = 0; i < L; i++)
        CHECK_EQ(zz[i], zigzag_pos(S, HYB_R, rr, i));
    held_pos(S, HYB_R, HYB_U, rr, u, mine);
    float *shard = malloc(L * row * sizeof *shard);
    CHECK(shard != NULL);
    float *send[3], *recv[3];
    for (int t = 0; t < 3; t++) {
        CHECK_OK(h, spc_zigzag_split(full[t], shard, 1, S, row * sizeof(float), HYB_R, rr));
        send[t] = must_alloc(h, Lu * row * sizeof(float));
        recv[t] = must_alloc(h, L * Hl * D * sizeof(float));
        memcpy(send[t], &shard[u * Lu * row], Lu * row * sizeof(float));
        for (uint64_t i = 0; i < Lu; i++)
            if (memcmp(&send[t][i * row], &full[t][(uint64_t)mine[i] * row], row * sizeof(float)) != 0)
                SP_FAIL("%s: local row %llu is not global row %lld", what, (unsigned long long)i, (long long)mine[i]);
    }

    /* Stage 2: seq->head on the Ulysses pair, q, k and v in one op. */
    spc_alltoall_desc_t a = { .struct_size = sizeof a, .group = m.ulysses_group, .dtype = SPC_F32,
                              .direction = SPC_SEQ_TO_HEAD, .layout = SPC_LAYOUT_BSHD, .batch = 1,
                              .seq_len = (uint32_t)L, .kv_heads = 0, .ntensors = 3, .timeout_ms = WAIT_MS };
    for (int t = 0; t < 3; t++)
        a.tensors[t] = (spc_a2a_tensor_t){ .send = send[t], .recv = recv[t], .heads = H, .head_dim = D,
                                           .kind = t == Q ? SPC_HEADS_Q : SPC_HEADS_KV };
    CHECK_OK(h, spc_alltoall(h, &a, WAIT_MS));

    /* Now: the ring shard's rows as the Ulysses ranks held them, heads [u Hl, (u + 1) Hl). */
    int64_t *kvpos = malloc(HYB_R * L * sizeof *kvpos);
    CHECK(kvpos != NULL);
    for (uint32_t j = 0; j < HYB_R; j++)
        gathered_pos(S, HYB_R, HYB_U, j, &kvpos[j * L]);
    const int64_t *qpos = &kvpos[rr * L];
    for (int t = 0; t < 3; t++)
        for (uint64_t i = 0; i < L; i++)
            for (uint32_t hl = 0; hl < Hl; hl++)
                if (memcmp(&recv[t][(i * Hl + hl) * D], &full[t][(uint64_t)qpos[i] * row + (u * Hl + hl) * D],
                           D * sizeof(float)) != 0)
                    SP_FAIL("%s: after seq->head, tensor %c row %llu head %u is not global row %lld head %u", what,
                            "qkv"[t], (unsigned long long)i, hl, (long long)qpos[i], u * Hl + hl);

    /* Stage 3: Ring-Attention over the ring on the local heads. */
    float *hout = must_alloc(h, L * Hl * D * sizeof(float)), *hlse = must_alloc(h, L * Hl * sizeof(float));
    ring_attention(h, m.ring_group, HYB_R, rr, L, Hl, D, recv[Q], recv[K], recv[V], qpos, kvpos, hout, hlse, what);

    /* Stage 4: head->seq, output and LSE (a head dim of 1) in one op. */
    float *out = must_alloc(h, Lu * row * sizeof(float)), *lse = must_alloc(h, Lu * H * sizeof(float));
    a.direction = SPC_HEAD_TO_SEQ;
    a.ntensors = 2;
    a.tensors[0] = (spc_a2a_tensor_t){ .send = hout, .recv = out, .heads = H, .head_dim = D, .kind = SPC_HEADS_Q };
    a.tensors[1] = (spc_a2a_tensor_t){ .send = hlse, .recv = lse, .heads = H, .head_dim = 1, .kind = SPC_HEADS_Q };
    CHECK_OK(h, spc_alltoall(h, &a, WAIT_MS));

    double worst = 0;
    for (uint64_t i = 0; i < Lu; i++)
        worst = fmax(worst, compare_row(out, lse, sh->ref_out, sh->ref_lse, mine[i], H, D, what, i));
    sh->worst[rank] = worst;

    for (int t = 0; t < 3; t++)
        free(full[t]);
    free(shard);
    free(kvpos);
    CHECK_OK(h, spc_barrier(h, world, WAIT_MS));
    return 0;
}

static double run_hybrid(const struct cfg *c)
{
    uint32_t H = c->H, D = c->D;
    uint64_t S = 2ull * HYB_R * c->c, row = (uint64_t)H * D;
    CHECK(S <= MAX_S && H <= MAX_H && D <= MAX_D && H % HYB_U == 0);
    float *q = malloc(S * row * sizeof *q), *k = malloc(S * row * sizeof *k), *v = malloc(S * row * sizeof *v);
    CHECK(q && k && v);
    make_inputs(q, k, v, S, H, D, c->salt);
    memset(sh, 0, sizeof *sh);
    reference(q, k, v, S, H, D, sh->ref_out, sh->ref_lse);
    sp_test_run_job(HYB_SP, rank_hybrid, (void *)c);
    double worst = 0;
    for (int r = 0; r < HYB_SP; r++)
        worst = fmax(worst, sh->worst[r]);
    free(q);
    free(k);
    free(v);
    return worst;
}

/* ------------------------------------------------------------------ main */

int main(void)
{
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    sh = sp_test_shared(sizeof *sh);

    static const struct cfg rings[] = {
        { .P = 2, .H = 2, .D = 16, .c = 3, .salt = 1 },
        { .P = 2, .H = 4, .D = 32, .c = 5, .salt = 2 },
        { .P = 4, .H = 3, .D = 24, .c = 2, .salt = 3 },
        { .P = 4, .H = 4, .D = 32, .c = 3, .salt = 4 },
    };
    for (size_t i = 0; i < sizeof rings / sizeof rings[0]; i++) {
        uint64_t t0 = sp_test_now_ms();
        double worst = run_ring(&rings[i]);
        printf("ring P=%u H=%u D=%u S=%u: ok, worst error %.2g, %llu ms\n", rings[i].P, rings[i].H, rings[i].D,
               2 * rings[i].P * rings[i].c, worst, (unsigned long long)(sp_test_now_ms() - t0));
    }

    static const struct cfg hybrids[] = {
        { .P = HYB_R, .H = 4, .D = 16, .c = 3, .salt = 5 },
        { .P = HYB_R, .H = 2, .D = 32, .c = 2, .salt = 6 },
    };
    for (size_t i = 0; i < sizeof hybrids / sizeof hybrids[0]; i++) {
        uint64_t t0 = sp_test_now_ms();
        double worst = run_hybrid(&hybrids[i]);
        printf("hybrid ulysses %d x ring %d, H=%u D=%u S=%u: ok, worst error %.2g, %llu ms\n", HYB_U, HYB_R,
               hybrids[i].H, hybrids[i].D, 2 * HYB_R * hybrids[i].c, worst,
               (unsigned long long)(sp_test_now_ms() - t0));
    }

    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("ring_attn: ok\n");
    return 0;
}
