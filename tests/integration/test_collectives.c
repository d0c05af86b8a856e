/*
 * Allreduce over every element type, allgather, broadcast and barrier across real
 * ranks of a real spd, checked against references this file computes on its own:
 *
 *   1. fp16 and bf16: the sum is the fp32 fold in rank order ((x0 + x1) + x2 ...,
 *      each x widened exactly), rounded once to 16 bits to nearest, ties to even;
 *      max and min too. The conversions are written here and checked against
 *      _Float16 and the float bit pattern before anything relies on them. Some
 *      inputs give other bits when rounded after every step (or when summed in
 *      wider arithmetic), so the single fp32 rounding is what is proven.
 *   2. int32 and int64: sums wrap modulo 2^n (the reference adds unsigned), max, min.
 *   3. The token-weighted mean loss with one rank holding no valid token, and a
 *      DPO loss whose per-sequence log-prob sums are split over ranks.
 *   4. Allgather in rank order, on the world and on the groups of a mesh: first
 *      through spc_submit with the receive extent stated (the daemon alone), then
 *      through spc_allgather() (the helper on top).
 *   5. Broadcast from every root (an 8 MiB one takes the daemon's multi-threaded
 *      copy path) and a barrier that really holds every rank.
 *   6. A 16 MiB in-place fp32 allreduce, and a 2 MiB bf16 one, element for
 *      element against the rank-order fold.
 *
 * Every rank must hold the same bits, and a rerun must give them again.
 */
#include <math.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <unistd.h>

#include "sp_test.h"

#define MAXR 4
#define TMO  10000    /* ms: every op here completes far sooner */

/* A well-mixed hash of three small integers: the inputs of every test. */
static uint64_t mix3(uint64_t a, uint64_t b, uint64_t c)
{
    uint64_t x = (a + 1) * 0x9E3779B97F4A7C15ull ^ (b + 1) * 0xBF58476D1CE4E5B9ull ^ (c + 1) * 0x94D049BB133111EBull;
    x ^= x >> 31;
    x *= 0xD6E8FEB86659FD93ull;
    x ^= x >> 29;
    x *= 0x9E3779B97F4A7C15ull;
    x ^= x >> 32;
    return x;
}

/* ================================================================ 16-bit floats, by hand */

/* A binary16-like format: sign, exponent field of 15 - (p - 1) bits, p - 1 stored
 * significand bits, exponent bias emax. */
typedef struct fmt16 {
    const char *name;
    spc_dtype_t dt;
    int         p;       /* significand bits with the hidden one */
    int         emax;    /* also the bias */
} fmt16_t;

static const fmt16_t FP16 = { "fp16", SPC_F16, 11, 15 };
static const fmt16_t BF16 = { "bf16", SPC_BF16, 8, 127 };
static const fmt16_t *const FMTS[2] = { &FP16, &BF16 };

static uint16_t h_inf(const fmt16_t *f)
{
    int m = f->p - 1;
    return (uint16_t)(((1u << (15 - m)) - 1) << m);
}

static bool h_isnan(const fmt16_t *f, uint16_t b)
{
    return (b & h_inf(f)) == h_inf(f) && (b & ((1u << (f->p - 1)) - 1)) != 0;
}

/* The exact float value of 16-bit pattern b (every fp16 and bf16 value is a float). */
static float h_widen(const fmt16_t *f, uint16_t b)
{
    int m = f->p - 1;
    unsigned e = (b & h_inf(f)) >> m, man = b & ((1u << m) - 1);
    float s = (b & 0x8000) ? -1.0f : 1.0f;
    if ((b & h_inf(f)) == h_inf(f))
        return man ? NAN : s * INFINITY;
    if (e == 0)
        return s * ldexpf((float)man, 1 - f->emax - m);
    return s * ldexpf((float)(man | (1u << m)), (int)e - f->emax - m);
}

/*
 * x rounded to the format, to nearest, ties to even. Arithmetic rather than bit
 * tricks: scale x (exactly, by a power of two) so that one unit in the last place
 * of the result is 1, and let rint (round half to even in the default rounding
 * mode) pick the integer. A significand that rounds up to 2^p carries into the
 * exponent field, and from the largest exponent into infinity, as it should.
 * Takes a double so that a double sum can be rounded once too (every float is a
 * double, exactly).
 */
static uint16_t h_narrow(const fmt16_t *f, double x)
{
    const int m = f->p - 1, emin = 1 - f->emax;
    if (isnan(x))
        return (uint16_t)(h_inf(f) | (1u << (m - 1)));
    uint16_t sign = signbit(x) ? 0x8000 : 0;
    double a = fabs(x);
    if (isinf(a))
        return sign | h_inf(f);
    if (a == 0)
        return sign;
    int E;
    (void)frexp(a, &E);
    int e = E - 1;   /* 2^e <= a < 2^(e + 1) */
    if (e > f->emax)
        return sign | h_inf(f);
    if (e < emin) {  /* subnormal: units of 2^(emin - m); 2^m units is the smallest normal */
        double q = rint(ldexp(a, m - emin));
        return sign | (uint16_t)q;
    }
    double q = rint(ldexp(a, m - e));   /* in [2^m, 2^(m + 1)] */
    unsigned bits = ((unsigned)(e + f->emax) << m) + ((unsigned)q - (1u << m));
    return sign | (uint16_t)bits;
}

static uint32_t f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* bf16 the usual way, from the float bits: add just under half a unit plus the
 * evenness bit, then truncate. Used only to check h_narrow. */
static uint16_t bf16_from_bits(float x)
{
    uint32_t u = f32_bits(x);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

#ifdef __FLT16_MAX__
static uint16_t fp16_from_compiler(float x)
{
    _Float16 h = (_Float16)x;
    uint16_t b;
    memcpy(&b, &h, sizeof b);
    return b;
}
static float fp16_to_compiler(uint16_t b)
{
    _Float16 h;
    memcpy(&h, &b, sizeof h);
    return (float)h;
}
#endif

static void check_narrow_one(const fmt16_t *f, float x)
{
    if (isnan(x))
        return;
    uint16_t mine = h_narrow(f, x), other;
    if (f->dt == SPC_BF16) {
        other = bf16_from_bits(x);
    } else {
#ifdef __FLT16_MAX__
        other = fp16_from_compiler(x);
#else
        return;
#endif
    }
    if (mine != other)
        SP_FAIL("%s(%a): mine 0x%04x, reference 0x%04x", f->name, (double)x, mine, other);
}

/* The references below are only as good as these conversions: check them against
 * known values, against each other's inverse, and against a second method, on
 * every 16-bit value and at and around every tie. */
static void check_conversions(void)
{
    static const struct { const fmt16_t *f; float x; uint16_t bits; } known[] = {
        { &FP16, 1.0f, 0x3C00 },       { &FP16, -2.0f, 0xC000 },      { &FP16, 65504.0f, 0x7BFF },
        { &FP16, 65519.0f, 0x7BFF },   { &FP16, 65520.0f, 0x7C00 },   { &FP16, 0x1p-24f, 0x0001 },
        { &FP16, 0x1p-25f, 0x0000 },   { &FP16, 0x1.8p-25f, 0x0001 }, { &FP16, 0x3p-25f, 0x0002 },
        { &FP16, 0x1p-14f, 0x0400 },   { &FP16, 0x1.ffcp-15f, 0x0400 }, { &FP16, 0x1.002p0f, 0x3C00 },
        { &FP16, 0x1.006p0f, 0x3C02 }, { &FP16, 2049.0f, 0x6800 },    { &FP16, 2051.0f, 0x6802 },
        { &FP16, -0.0f, 0x8000 },      { &BF16, 1.0f, 0x3F80 },       { &BF16, 0x1.01p0f, 0x3F80 },
        { &BF16, 0x1.03p0f, 0x3F82 },  { &BF16, 257.0f, 0x4380 },     { &BF16, 3.0e38f, 0x7F62 },
        { &BF16, 0x1.ffp127f, 0x7F80 }, { &BF16, 0x1p-133f, 0x0001 }, { &BF16, 0x1p-134f, 0x0000 },
        { &BF16, -0x1p-126f, 0x8080 },
    };
    for (size_t k = 0; k < sizeof known / sizeof known[0]; k++) {
        uint16_t got = h_narrow(known[k].f, known[k].x);
        if (got != known[k].bits)
            SP_FAIL("%s(%a) = 0x%04x, expected 0x%04x", known[k].f->name, (double)known[k].x, got, known[k].bits);
    }
    for (int fi = 0; fi < 2; fi++) {
        const fmt16_t *f = FMTS[fi];
        for (uint32_t b = 0; b <= 0xFFFF; b++) {
            uint16_t h = (uint16_t)b;
            if (h_isnan(f, h)) {
                CHECK(isnan(h_widen(f, h)));
                continue;
            }
            float x = h_widen(f, h);
            if (f->dt == SPC_BF16)
                CHECK_EQ(f32_bits(x), (uint32_t)h << 16);   /* bf16 is the top half of a float */
#ifdef __FLT16_MAX__
            else
                CHECK_EQ(f32_bits(x), f32_bits(fp16_to_compiler(h)));
#endif
            CHECK_EQ(h_narrow(f, x), h);
            check_narrow_one(f, x);
            /* The tie between h and the next value away from zero, and either side of it. */
            uint16_t up = (uint16_t)(h + 1);
            if ((h & 0x7FFF) >= (h_inf(f) & 0x7FFF) || (up & 0x8000) != (h & 0x8000))
                continue;
            float y = h_widen(f, up), mid = x + (y - x) / 2;   /* exact: one more bit */
            if (isinf(y))
                mid = x + (x - h_widen(f, (uint16_t)(h - 1))) / 2;   /* the overflow threshold */
            check_narrow_one(f, mid);
            check_narrow_one(f, nextafterf(mid, 0.0f));
            check_narrow_one(f, nextafterf(mid, 2 * mid));
        }
        for (uint64_t k = 0; k < (1u << 20); k++) {
            uint32_t u = (uint32_t)mix3(fi, k, 99);
            float x;
            memcpy(&x, &u, sizeof x);
            check_narrow_one(f, x);
        }
    }
}

/* ================================================================ 1. fp16 / bf16 allreduce */

#define NH (1000 + 7)
#define TAIL 8          /* guard elements past the count: nothing may write them */

static const spc_redop_t REDOPS[3] = { SPC_SUM, SPC_MAX, SPC_MIN };
static const char *const REDOP_NAMES[3] = { "sum", "max", "min" };

/*
 * Rank `rank`'s element i. The first few are chosen by hand; the rest are random,
 * half of them near 1 (sums of similar magnitudes round often), the others over a
 * wide range, with some subnormals.
 */
static uint16_t h_input(const fmt16_t *f, int op, int rank, int i, int salt)
{
    const bool fp16 = f->dt == SPC_F16;
    if (op == 0) {
        switch (i) {
        case 0: /* 1 + h + h + ... with h half a unit of 1: rounding after every step
                 * stays at 1; rounding once gives 1 + 1 unit (3 ranks), 1 + 2 (4 ranks) */
            return h_narrow(f, rank == 0 ? 1.0f : ldexpf(1.0f, -f->p));
        case 1: /* -0 everywhere sums to -0 */
            return 0x8000;
        case 2: /* 3 - 3 + 0 ... is +0 */
            return h_narrow(f, rank == 0 ? 3.0f : rank == 1 ? -3.0f : 0.0f);
        case 3: /* past the largest finite value: infinity */
            return h_narrow(f, fp16 ? 40000.0f : 0x1.8p127f);
        case 4: /* the smallest subnormal, once per rank: exact */
            return 0x0001;
        case 5: { /* big + 1 is a tie of the 16-bit format that fp32 holds exactly; the tiny
                   * third term is lost in fp32 (tie: round to even, down) but would tip
                   * a wider accumulator (double) up */
            float big = fp16 ? 2048.0f : 256.0f, tiny = fp16 ? 0x1p-24f : 0x1p-20f;
            return h_narrow(f, rank == 0 ? big : rank == 1 ? 1.0f : rank == 2 ? tiny : 0.0f);
        }
        }
    } else {
        switch (i) {
        case 0: /* a NaN on rank 1 makes the max and the min NaN */
            if (rank == 1)
                return (uint16_t)(h_inf(f) | (1u << (f->p - 2)));
            break;
        case 1: /* -inf and +inf */
            if (rank <= 1)
                return (uint16_t)(h_inf(f) | (rank == 0 ? 0x8000 : 0));
            break;
        case 2: /* the same value everywhere */
            return h_narrow(f, 0.75f);
        }
    }
    uint64_t x = mix3((uint64_t)salt * 16 + (uint64_t)op * 4 + (uint64_t)f->dt, (uint64_t)rank, (uint64_t)i);
    const int m = f->p - 1;
    unsigned man = (unsigned)(x >> 8) & ((1u << m) - 1);
    unsigned mode = (unsigned)(x >> 40) % 4, r = (unsigned)(x >> 44);
    int e;
    if (mode < 2)
        e = f->emax + (int)(r % 5) - 2;
    else if (mode == 2)
        e = fp16 ? 1 + (int)(r % 29) : f->emax - 40 + (int)(r % 80);
    else
        e = 0;
    if (e == 0 && man == 0)
        man = 1;
    return (uint16_t)((x & 1 ? 0x8000u : 0u) | ((unsigned)e << m) | man);
}

/* The rank-order fold in fp32, rounded to 16 bits once (or, with per_step, after
 * every step: what the daemon must not do). max and min propagate NaN. */
static uint16_t h_ref(const fmt16_t *f, int op, int P, int i, int salt, bool per_step)
{
    float acc = h_widen(f, h_input(f, op, 0, i, salt));
    for (int k = 1; k < P; k++) {
        float x = h_widen(f, h_input(f, op, k, i, salt));
        if (op == 0) {
            acc = acc + x;
            if (per_step)
                acc = h_widen(f, h_narrow(f, acc));
        } else if (isnan(acc) || isnan(x)) {
            acc = NAN;
        } else {
            acc = op == 1 ? fmaxf(acc, x) : fminf(acc, x);
        }
    }
    return h_narrow(f, acc);
}

/* The same fold in double, rounded once: what a wider accumulator would give. */
static uint16_t h_ref_double(const fmt16_t *f, int P, int i, int salt)
{
    double acc = h_widen(f, h_input(f, 0, 0, i, salt));
    for (int k = 1; k < P; k++)
        acc += h_widen(f, h_input(f, 0, k, i, salt));
    return h_narrow(f, acc);
}

static bool h_same(const fmt16_t *f, uint16_t got, uint16_t want)
{
    return h_isnan(f, want) ? h_isnan(f, got) : got == want;
}

struct half_results {
    uint16_t v[2][3][MAXR][NH];
};
static struct half_results *hres;

static int rank_half(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    const int salt = *(const int *)arg;
    uint16_t *send[2][3], *recv[2][3];
    spc_request_t *req[2][3];

    for (int fi = 0; fi < 2; fi++) {
        for (int op = 0; op < 3; op++) {
            send[fi][op] = spc_alloc(h, (NH + TAIL) * sizeof(uint16_t));
            CHECK(send[fi][op] != NULL);
            /* The sum goes out of place (the input must survive), max and min in place. */
            recv[fi][op] = op == 0 ? spc_alloc(h, (NH + TAIL) * sizeof(uint16_t)) : send[fi][op];
            CHECK(recv[fi][op] != NULL);
            for (int i = 0; i < NH + TAIL; i++)
                send[fi][op][i] = i < NH ? h_input(FMTS[fi], op, rank, i, salt) : 0xABCD;
            if (op == 0)
                for (int i = 0; i < NH + TAIL; i++)
                    recv[fi][op][i] = i < NH ? 0xEEEE : 0xABCD;
        }
    }
    /* Six ops in flight before the first wait. */
    for (int fi = 0; fi < 2; fi++)
        for (int op = 0; op < 3; op++)
            CHECK_OK(h, spc_iallreduce(h, world, send[fi][op], recv[fi][op], NH, FMTS[fi]->dt, REDOPS[op],
                                       &req[fi][op]));
    for (int fi = 0; fi < 2; fi++)
        for (int op = 0; op < 3; op++) {
            spc_status_t st = spc_wait(req[fi][op], TMO);
            if (st != SPC_OK)
                SP_FAIL("rank %d: %s %s allreduce: %s (%s)", rank, FMTS[fi]->name, REDOP_NAMES[op],
                        spc_status_name(st), spc_request_detail(req[fi][op]));
            spc_request_release(req[fi][op]);
        }

    for (int fi = 0; fi < 2; fi++) {
        const fmt16_t *f = FMTS[fi];
        for (int op = 0; op < 3; op++) {
            int bad = 0, first = -1;
            for (int i = 0; i < NH; i++) {
                if (!h_same(f, recv[fi][op][i], h_ref(f, op, P, i, salt, false)) && bad++ == 0)
                    first = i;
                if (op == 0 && send[fi][op][i] != h_input(f, op, rank, i, salt))
                    SP_FAIL("rank %d: %s sum wrote its send buffer at %d", rank, f->name, i);
            }
            if (bad) {
                char in[128] = "";
                for (int k = 0, off = 0; k < P; k++)
                    off += snprintf(in + off, sizeof in - (size_t)off, " 0x%04x", h_input(f, op, k, first, salt));
                SP_FAIL("P=%d rank %d: %s %s: %d of %d elements differ from the fp32 rank-order fold; first at %d: "
                        "inputs%s, expected 0x%04x, got 0x%04x",
                        P, rank, f->name, REDOP_NAMES[op], bad, NH, first, in, h_ref(f, op, P, first, salt, false),
                        recv[fi][op][first]);
            }
            for (int i = NH; i < NH + TAIL; i++) {
                CHECK_EQ(recv[fi][op][i], 0xABCD);
                CHECK_EQ(send[fi][op][i], 0xABCD);
            }
            memcpy(hres->v[fi][op][rank], recv[fi][op], NH * sizeof(uint16_t));
        }
    }
    for (int fi = 0; fi < 2; fi++)
        for (int op = 0; op < 3; op++) {
            if (op == 0)
                spc_free(h, recv[fi][op]);
            spc_free(h, send[fi][op]);
        }
    return 0;
}

static void test_half(void)
{
    struct half_results *first = sp_test_shared(sizeof *first);
    int salt = 3;
    for (int P = 1; P <= MAXR; P++) {
        memset(hres, 0, sizeof *hres);
        sp_test_run_job(P, rank_half, &salt);
        for (int fi = 0; fi < 2; fi++)
            for (int op = 0; op < 3; op++)
                for (int r = 1; r < P; r++)
                    CHECK(memcmp(hres->v[fi][op][r], hres->v[fi][op][0], sizeof hres->v[fi][op][0]) == 0);
        /* The inputs have teeth: rounding after every step, or summing in double,
         * gives other bits for some elements, and the daemon matched neither. */
        for (int fi = 0; fi < 2; fi++) {
            const fmt16_t *f = FMTS[fi];
            int per_step = 0, wide = 0;
            for (int i = 0; i < NH; i++) {
                per_step += h_ref(f, 0, P, i, salt, true) != hres->v[fi][0][0][i];
                wide += h_ref_double(f, P, i, salt) != hres->v[fi][0][0][i];
            }
            printf("P=%d %s sum: %d of %d elements differ when rounded after every step, %d when summed in double\n",
                   P, f->name, per_step, NH, wide);
            if (P >= 3) {
                CHECK(per_step > 0);
                CHECK(wide > 0);
            }
        }
        if (P >= 3) {   /* a rerun gives the same bits */
            memcpy(first, hres, sizeof *first);
            sp_test_run_job(P, rank_half, &salt);
            CHECK(memcmp(first, hres, sizeof *first) == 0);
        }
    }
    munmap(first, sizeof *first);
}

/* ================================================================ 2. int32 / int64 allreduce */

#define NI (1000 + 7)

static uint64_t i_input(int bits, int op, int rank, int i)
{
    switch (i) {
    case 0: /* the largest value everywhere: the sum wraps (to -P for int32, ...) */
        if (op == 0)
            return bits == 32 ? (uint64_t)INT32_MAX : (uint64_t)INT64_MAX;
        break;
    case 1: /* the smallest: sums to 0 or the smallest again */
        if (op == 0)
            return bits == 32 ? (uint64_t)(uint32_t)INT32_MIN : (uint64_t)INT64_MIN;
        break;
    case 2: /* both extremes: max and min find them */
        if (rank <= 1)
            return rank == 0 ? (bits == 32 ? (uint64_t)(uint32_t)INT32_MIN : (uint64_t)INT64_MIN)
                             : (bits == 32 ? (uint64_t)INT32_MAX : (uint64_t)INT64_MAX);
        break;
    }
    uint64_t x = mix3((uint64_t)bits * 4 + (uint64_t)op, (uint64_t)rank, (uint64_t)i);
    if ((x & 3) == 0)   /* small values of both signs too, where max and min are not just the sign */
        x = (uint64_t)((int64_t)((x >> 8) % 2001) - 1000);
    return bits == 32 ? (uint32_t)x : x;
}

static int64_t i_as_signed(int bits, uint64_t u)
{
    if (bits == 32) {
        int32_t v;
        uint32_t w = (uint32_t)u;
        memcpy(&v, &w, sizeof v);
        return v;
    }
    int64_t v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static int64_t i_ref(int bits, int op, int P, int i)
{
    uint64_t acc = i_input(bits, op, 0, i);
    for (int k = 1; k < P; k++) {
        uint64_t x = i_input(bits, op, k, i);
        if (op == 0)
            acc = bits == 32 ? (uint32_t)(acc + x) : acc + x;   /* unsigned: wraps, defined */
        else if (op == 1 ? i_as_signed(bits, x) > i_as_signed(bits, acc) : i_as_signed(bits, x) < i_as_signed(bits, acc))
            acc = x;
    }
    return i_as_signed(bits, acc);
}

static int rank_int(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    int32_t *a32[3];
    int64_t *a64[3];
    for (int op = 0; op < 3; op++) {
        a32[op] = spc_alloc(h, NI * sizeof(int32_t));
        a64[op] = spc_alloc(h, NI * sizeof(int64_t));
        CHECK(a32[op] != NULL && a64[op] != NULL);
        for (int i = 0; i < NI; i++) {
            a32[op][i] = (int32_t)i_as_signed(32, i_input(32, op, rank, i));
            a64[op][i] = i_as_signed(64, i_input(64, op, rank, i));
        }
        CHECK_OK(h, spc_allreduce(h, world, a32[op], a32[op], NI, SPC_I32, REDOPS[op], TMO));
        CHECK_OK(h, spc_allreduce(h, world, a64[op], a64[op], NI, SPC_I64, REDOPS[op], TMO));
    }
    int wrapped = 0;
    for (int op = 0; op < 3; op++)
        for (int i = 0; i < NI; i++) {
            int64_t w32 = i_ref(32, op, P, i), w64 = i_ref(64, op, P, i);
            if (a32[op][i] != w32)
                SP_FAIL("P=%d rank %d: int32 %s at %d: expected %" PRId64 ", got %" PRId32, P, rank,
                        REDOP_NAMES[op], i, w32, a32[op][i]);
            if (a64[op][i] != w64)
                SP_FAIL("P=%d rank %d: int64 %s at %d: expected %" PRId64 ", got %" PRId64, P, rank,
                        REDOP_NAMES[op], i, w64, a64[op][i]);
            if (op == 0) {   /* the true sum, to count how many wrapped */
                int64_t s = 0;
                for (int k = 0; k < P; k++)
                    s += i_as_signed(32, i_input(32, 0, k, i));
                wrapped += s != w32;
            }
        }
    if (P >= 2)
        CHECK(wrapped > 0);
    return 0;
}

/* ================================================================ 3. losses */

#define NTOK (1000 + 7)

struct loss_cfg {
    int zero_rank;   /* the rank whose shard holds no valid token */
};

static int shard_lo(int n, int P, int r) { return (int)((int64_t)n * r / P); }

static bool tok_valid(const struct loss_cfg *c, int P, int t)
{
    if (t >= shard_lo(NTOK, P, c->zero_rank) && t < shard_lo(NTOK, P, c->zero_rank + 1))
        return false;   /* this rank's shard is all padding */
    return mix3(7, 0, (uint64_t)t) % 5 != 0;   /* and one token in five is masked anywhere */
}

/* Per-token losses that are multiples of 2^-10 (fp64) or 2^-6 (fp32) and small:
 * every partial and total sum is exact, whatever the order, so the distributed
 * loss must equal the single-process one to the bit. */
static double tok_loss64(int t) { return (double)(1 + mix3(7, 1, (uint64_t)t) % 16383) / 1024.0; }
static float tok_loss32(int t) { return (float)(1 + mix3(7, 2, (uint64_t)t) % 255) / 64.0f; }

/* DPO: B pairs; a sequence of L positions, the prompt first (no loss there), then
 * the response, then padding. log-probs are not dyadic: sums depend on order. */
#define DPO_B 3
#define DPO_L 509
#define DPO_BETA 0.1

static double dpo_logp(int b, int k, int t)   /* k: 0 policy chosen, 1 policy rejected, 2 ref chosen, 3 ref rejected */
{
    uint64_t x = mix3(11, (uint64_t)(b * 4 + k), (uint64_t)t);
    return log((double)((x >> 11) + 1) / 0x1p53);
}

static bool dpo_mask(int b, int k, int t)
{
    int prompt = DPO_L / 2 + 1 + b * 13;   /* with 2 or more ranks, rank 0 holds only prompt */
    int end = k % 2 == 0 ? DPO_L - b * 7 : DPO_L - 50 - b * 11;   /* chosen and rejected end apart */
    return t >= prompt && t < end;
}

/* -log(sigmoid(z)), in the form that does not overflow. */
static double neg_log_sigmoid(double z)
{
    return z >= 0 ? log1p(exp(-z)) : -z + log1p(exp(z));
}

static double dpo_loss(const double s[4])
{
    return neg_log_sigmoid(DPO_BETA * ((s[0] - s[2]) - (s[1] - s[3])));
}

/* Rank r's partial log-prob sums of pair b. */
static void dpo_part(int b, int P, int r, double s[4])
{
    for (int k = 0; k < 4; k++) {
        s[k] = 0;
        for (int t = shard_lo(DPO_L, P, r); t < shard_lo(DPO_L, P, r + 1); t++)
            if (dpo_mask(b, k, t))
                s[k] += dpo_logp(b, k, t);
    }
}

static int rank_loss(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    const struct loss_cfg *c = arg;
    const int lo = shard_lo(NTOK, P, rank), hi = shard_lo(NTOK, P, rank + 1);

    /* Token-weighted mean: each rank sums its shard; the mean is taken after the allreduce. */
    double *l64 = spc_alloc(h, 2 * sizeof *l64);
    float *l32 = spc_alloc(h, 2 * sizeof *l32);
    CHECK(l64 != NULL && l32 != NULL);
    l64[0] = l64[1] = 0;
    l32[0] = l32[1] = 0;
    for (int t = lo; t < hi; t++)
        if (tok_valid(c, P, t)) {
            l64[0] += tok_loss64(t);
            l64[1] += 1;
            l32[0] += tok_loss32(t);
            l32[1] += 1;
        }
    if (rank == c->zero_rank)
        CHECK(l64[1] == 0 && l64[0] == 0 && l32[1] == 0);   /* its own mean would be 0/0 */
    CHECK_OK(h, spc_allreduce(h, world, l64, l64, 2, SPC_F64, SPC_SUM, TMO));
    CHECK_OK(h, spc_allreduce(h, world, l32, l32, 2, SPC_F32, SPC_SUM, TMO));

    /* One process over every token, forwards and backwards (exact: the same). */
    double f64 = 0, b64 = 0, n = 0;
    float f32 = 0;
    for (int t = 0; t < NTOK; t++)
        if (tok_valid(c, P, t)) {
            f64 += tok_loss64(t);
            f32 += tok_loss32(t);
            n += 1;
        }
    for (int t = NTOK - 1; t >= 0; t--)
        if (tok_valid(c, P, t))
            b64 += tok_loss64(t);
    CHECK(f64 == b64);
    double loss64 = l64[0] / l64[1], want64 = f64 / n;
    float loss32 = l32[0] / l32[1], want32 = f32 / (float)n;
    if (!isfinite(loss64) || !isfinite(loss32) || loss64 != want64 || loss32 != want32 || l64[1] != n)
        SP_FAIL("P=%d rank %d%s: mean loss fp64 %a (sum %a over %g tokens), fp32 %a; expected %a (sum %a over %g), "
                "%a", P, rank, rank == c->zero_rank ? " (no tokens)" : "", loss64, l64[0], l64[1], (double)loss32,
                want64, f64, n, (double)want32);

    /* DPO: the four per-sequence sums of every pair, partial on each rank. */
    double *s = spc_alloc(h, DPO_B * 4 * sizeof *s);
    CHECK(s != NULL);
    for (int b = 0; b < DPO_B; b++)
        dpo_part(b, P, rank, &s[4 * b]);
    if (P >= 2 && rank == 0)
        for (int k = 0; k < DPO_B * 4; k++)
            CHECK(s[k] == 0);   /* all prompt: contributes exact zeros */
    CHECK_OK(h, spc_allreduce(h, world, s, s, DPO_B * 4, SPC_F64, SPC_SUM, TMO));
    for (int b = 0; b < DPO_B; b++) {
        /* The same partial sums folded in rank order: the same bits. */
        double want[4], part[4], flat[4] = { 0, 0, 0, 0 };
        dpo_part(b, P, 0, want);
        for (int r = 1; r < P; r++) {
            dpo_part(b, P, r, part);
            for (int k = 0; k < 4; k++)
                want[k] = want[k] + part[k];
        }
        for (int k = 0; k < 4; k++)
            for (int t = 0; t < DPO_L; t++)
                if (dpo_mask(b, k, t))
                    flat[k] += dpo_logp(b, k, t);
        double got = dpo_loss(&s[4 * b]), ref = dpo_loss(want), one = dpo_loss(flat);
        for (int k = 0; k < 4; k++)
            if (memcmp(&s[4 * b + k], &want[k], sizeof want[k]) != 0)
                SP_FAIL("P=%d rank %d: DPO pair %d sum %d: expected %a, got %a", P, rank, b, k, want[k], s[4 * b + k]);
        if (!isfinite(got) || memcmp(&got, &ref, sizeof got) != 0)
            SP_FAIL("P=%d rank %d: DPO loss of pair %d: expected %a, got %a", P, rank, b, ref, got);
        /* And the single-process loss, whose sums take another order: equal up to rounding. */
        if (fabs(got - one) > 1e-12 * fmax(1.0, fabs(one)))
            SP_FAIL("P=%d rank %d: DPO loss of pair %d: %.17g, single-process %.17g", P, rank, b, got, one);
    }
    spc_free(h, s);
    spc_free(h, l64);
    spc_free(h, l32);
    return 0;
}

static void test_losses(void)
{
    for (int P = 1; P <= MAXR; P++) {
        /* P = 1 has no rank to spare: every token then counts. */
        struct loss_cfg c = { .zero_rank = P == 1 ? 1 : P / 2 };
        sp_test_run_job(P, rank_loss, &c);
    }
}

/* ================================================================ 4. allgather */

#define AG_POS  257          /* position ids per rank */
#define AG_U8   13
#define AG_BIG  (256 * 1024) /* int32s per rank: 1 MiB, the multi-threaded path */
#define AG_REG  1000

/*
 * One allgather, through the public helper or (helper false) through spc_submit
 * with the receive extent stated: gsize x count elements. The second form reaches
 * the daemon whatever the helper does with the extent, so the daemon's gather is
 * checked on its own, and the helper on top of it.
 */
static spc_status_t gather(spc_handle_t *h, bool helper, spc_group_t g, uint32_t gsize, const void *send, void *recv,
                           uint64_t count, spc_dtype_t dt)
{
    if (helper)
        return spc_allgather(h, g, send, recv, count, dt, TMO);
    spc_op_t op = { .struct_size = sizeof op, .opcode = SPC_OP_ALLGATHER, .group = g, .dtype = dt, .count = count,
                    .ntensors = 2 };
    op.tensors[0].ptr = (void *)send;
    op.tensors[1].ptr = recv;
    op.tensors[1].bytes = count * spc_dtype_size(dt) * gsize;
    spc_status_t st = sp_test_submit_wait(h, &op, TMO);
    if (st != SPC_OK)
        fprintf(stderr, "allgather of %" PRIu64 " %s over a group of %u: %s\n", count, spc_dtype_name(dt), gsize,
                spc_status_name(st));
    return st;
}

static int rank_gather(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    const bool helper = *(const bool *)arg;
    /* Position ids: rank r holds positions r * n ... (r + 1) * n - 1; the gather is 0, 1, 2, ... */
    int64_t *pos = spc_alloc(h, AG_POS * sizeof *pos), *all = spc_alloc(h, (P * AG_POS + TAIL) * sizeof *all);
    CHECK(pos != NULL && all != NULL);
    for (int j = 0; j < AG_POS; j++)
        pos[j] = (int64_t)rank * AG_POS + j;
    for (int j = 0; j < P * AG_POS + TAIL; j++)
        all[j] = -7;
    CHECK_OK(h, gather(h, helper, world, (uint32_t)P, pos, all, AG_POS, SPC_I64));
    for (int j = 0; j < P * AG_POS; j++)
        if (all[j] != j)
            SP_FAIL("P=%d rank %d: gathered position %d is %" PRId64, P, rank, j, all[j]);
    for (int j = P * AG_POS; j < P * AG_POS + TAIL; j++)
        CHECK_EQ(all[j], -7);
    for (int j = 0; j < AG_POS; j++)
        CHECK_EQ(pos[j], (int64_t)rank * AG_POS + j);

    /* Bytes, an odd count: every slot starts at an odd offset. */
    uint8_t *b = spc_alloc(h, AG_U8), *ball = spc_alloc(h, P * AG_U8 + TAIL);
    CHECK(b != NULL && ball != NULL);
    for (int j = 0; j < AG_U8; j++)
        b[j] = (uint8_t)(rank * 31 + j * 7 + 1);
    memset(ball, 0xA5, P * AG_U8 + TAIL);
    CHECK_OK(h, gather(h, helper, world, (uint32_t)P, b, ball, AG_U8, SPC_U8));
    for (int r = 0; r < P; r++)
        for (int j = 0; j < AG_U8; j++)
            CHECK_EQ(ball[r * AG_U8 + j], (uint8_t)(r * 31 + j * 7 + 1));
    for (int j = P * AG_U8; j < P * AG_U8 + TAIL; j++)
        CHECK_EQ(ball[j], 0xA5);

    /* bf16 bits pass through untouched (a gather never converts). */
    uint16_t *hb = spc_alloc(h, 5 * sizeof *hb), *hall = spc_alloc(h, P * 5 * sizeof *hall);
    CHECK(hb != NULL && hall != NULL);
    for (int j = 0; j < 5; j++)
        hb[j] = (uint16_t)(0x7F81 + rank * 5 + j);   /* NaN patterns with payloads */
    CHECK_OK(h, gather(h, helper, world, (uint32_t)P, hb, hall, 5, SPC_BF16));
    for (int j = 0; j < P * 5; j++)
        CHECK_EQ(hall[j], 0x7F81 + j);

    /* 1 MiB per rank. */
    int32_t *big = spc_alloc(h, AG_BIG * sizeof *big), *bigall = spc_alloc(h, (size_t)P * AG_BIG * sizeof *bigall);
    CHECK(big != NULL && bigall != NULL);
    for (int j = 0; j < AG_BIG; j++)
        big[j] = (int32_t)(mix3(5, (uint64_t)rank, (uint64_t)j) >> 33);
    memset(bigall, 0xFF, (size_t)P * AG_BIG * sizeof *bigall);
    CHECK_OK(h, gather(h, helper, world, (uint32_t)P, big, bigall, AG_BIG, SPC_I32));
    for (int r = 0; r < P; r++)
        for (int j = 0; j < AG_BIG; j++)
            if (bigall[(size_t)r * AG_BIG + j] != (int32_t)(mix3(5, (uint64_t)r, (uint64_t)j) >> 33))
                SP_FAIL("P=%d rank %d: large gather: slot %d element %d is %" PRId32, P, rank, r, j,
                        bigall[(size_t)r * AG_BIG + j]);

    /* Registered memory on both sides: staged by the daemon, not in the arena. */
    int64_t *rs = malloc(AG_REG * sizeof *rs), *rr = malloc((size_t)P * AG_REG * sizeof *rr);
    CHECK(rs != NULL && rr != NULL);
    spc_region_t gs, gr;
    CHECK_OK(h, spc_register(h, rs, AG_REG * sizeof *rs, &gs));
    CHECK_OK(h, spc_register(h, rr, (size_t)P * AG_REG * sizeof *rr, &gr));
    for (int j = 0; j < AG_REG; j++)
        rs[j] = -((int64_t)rank * 1000000 + j);
    for (int j = 0; j < P * AG_REG; j++)
        rr[j] = 1;
    CHECK_OK(h, gather(h, helper, world, (uint32_t)P, rs, rr, AG_REG, SPC_I64));
    for (int r = 0; r < P; r++)
        for (int j = 0; j < AG_REG; j++)
            CHECK_EQ(rr[r * AG_REG + j], -((int64_t)r * 1000000 + j));
    CHECK_OK(h, spc_deregister(h, gs));
    CHECK_OK(h, spc_deregister(h, gr));
    free(rs);
    free(rr);

    spc_free(h, pos);
    spc_free(h, all);
    spc_free(h, b);
    spc_free(h, ball);
    spc_free(h, hb);
    spc_free(h, hall);
    spc_free(h, big);
    spc_free(h, bigall);
    return 0;
}

/* World 4 as sp 4 = ring 2 x ulysses 2: rank = ring_rank * 2 + ulysses_rank, so
 * ring group u is ranks {u, u + 2} and Ulysses group q is {2q, 2q + 1}. Gathering
 * the job ranks over a group lists its members in group-rank order. */
static int rank_mesh(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    const bool helper = *(const bool *)arg;
    spc_mesh_spec_t spec = { .struct_size = sizeof spec, .sp = 4, .ulysses = 2, .ring = 2, .heads = 8, .kv_heads = 8 };
    spc_mesh_t m;
    CHECK_OK(h, spc_mesh_create(h, &spec, &m));
    CHECK_EQ(m.dp, 1);
    CHECK_EQ(m.ulysses, 2);
    CHECK_EQ(m.ring, 2);
    CHECK_EQ(m.ring_rank * 2 + m.ulysses_rank, rank);

    int64_t *me = spc_alloc(h, sizeof *me), *got = spc_alloc(h, 4 * sizeof *got);
    CHECK(me != NULL && got != NULL);
    *me = rank;
    const struct { spc_group_t g; int n; int64_t first, stride; const char *name; } groups[] = {
        { m.ring_group, 2, m.ulysses_rank, 2, "ring" },
        { m.ulysses_group, 2, 2 * (int64_t)m.ring_rank, 1, "ulysses" },
        { m.sp_group, 4, 0, 1, "sp" },
        { m.dp_group, 1, rank, 1, "dp" },
    };
    for (size_t k = 0; k < sizeof groups / sizeof groups[0]; k++) {
        for (int j = 0; j < 4; j++)
            got[j] = -1;
        CHECK_OK(h, gather(h, helper, groups[k].g, (uint32_t)groups[k].n, me, got, 1, SPC_I64));
        for (int j = 0; j < 4; j++) {
            int64_t want = j < groups[k].n ? groups[k].first + j * groups[k].stride : -1;
            if (got[j] != want)
                SP_FAIL("rank %d: allgather over the %s group: slot %d is %" PRId64 ", expected %" PRId64, rank,
                        groups[k].name, j, got[j], want);
        }
    }
    /* And a reduction over the ring group sums just its two members. */
    *me = rank;
    CHECK_OK(h, spc_allreduce(h, m.ring_group, me, me, 1, SPC_I64, SPC_SUM, TMO));
    CHECK_EQ(*me, 2 * m.ulysses_rank + 2);
    return 0;
}

/* ================================================================ 5. broadcast, barrier */

#define BC_BIG (1u << 20)   /* int64s: 8 MiB */

struct bc_shared {
    _Atomic int arrived[8][MAXR];
};
static struct bc_shared *bcs;

/* Root `root`'s n bytes for case t. */
static void bc_fill(uint8_t *dst, size_t n, int root, int t)
{
    for (size_t j = 0; j < n; j += 8) {
        uint64_t w = mix3(13 + (uint64_t)t, (uint64_t)root, j / 8);
        memcpy(dst + j, &w, n - j < 8 ? n - j : 8);
    }
}

static int rank_bcast(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    static const struct { spc_dtype_t dt; uint64_t count; } cases[] = {
        { SPC_F32, 1001 }, { SPC_BF16, 7 }, { SPC_U8, 3 }, { SPC_F64, 1 }, { SPC_I64, BC_BIG },
    };
    const int nc = (int)(sizeof cases / sizeof cases[0]);
    for (int root = 0; root < P; root++) {
        for (int t = 0; t < nc; t++) {
            size_t es = spc_dtype_size(cases[t].dt), n = cases[t].count * es;
            uint8_t *buf = spc_alloc(h, n + TAIL), *want = malloc(n);
            CHECK(buf != NULL && want != NULL);
            bc_fill(want, n, root, t);
            if (rank == root)
                memcpy(buf, want, n);
            else
                memset(buf, 0x5A, n);
            memset(buf + n, 0xC3, TAIL);
            CHECK_OK(h, spc_broadcast(h, world, buf, cases[t].count, cases[t].dt, (uint32_t)root, TMO));
            if (memcmp(buf, want, n) != 0) {
                size_t j = 0;
                while (buf[j] == want[j])
                    j++;
                SP_FAIL("P=%d rank %d: broadcast of %" PRIu64 " %s from root %d: byte %zu is 0x%02x, expected "
                        "0x%02x", P, rank, cases[t].count, spc_dtype_name(cases[t].dt), root, j, buf[j], want[j]);
            }
            for (size_t j = n; j < n + TAIL; j++)
                CHECK_EQ(buf[j], 0xC3);
            free(want);
            spc_free(h, buf);
        }
        /* Into registered memory (staged), from root's registered memory. */
        int32_t *reg = malloc(777 * sizeof *reg);
        CHECK(reg != NULL);
        spc_region_t g;
        CHECK_OK(h, spc_register(h, reg, 777 * sizeof *reg, &g));
        for (int j = 0; j < 777; j++)
            reg[j] = rank == root ? root * 1000 + j : -1;
        CHECK_OK(h, spc_broadcast(h, world, reg, 777, SPC_I32, (uint32_t)root, TMO));
        for (int j = 0; j < 777; j++)
            CHECK_EQ(reg[j], root * 1000 + j);
        CHECK_OK(h, spc_deregister(h, g));
        free(reg);
    }
    /* A root outside the group is refused. */
    int32_t *x = spc_alloc(h, sizeof *x);
    CHECK(x != NULL);
    CHECK_ST(h, spc_broadcast(h, world, x, 1, SPC_I32, (uint32_t)P, TMO), SPC_ERR_INVALID_ARG);
    spc_free(h, x);

    /* Barrier: nobody leaves one before everybody has reached it. The last rank
     * comes late on purpose (skew, not settling): the others must wait for it. */
    for (int gen = 0; gen < 8; gen++) {
        if (rank == P - 1 && gen % 2 == 0)
            usleep(5000);
        atomic_store(&bcs->arrived[gen][rank], 1);
        CHECK_OK(h, spc_barrier(h, world, TMO));
        for (int r = 0; r < P; r++)
            if (atomic_load(&bcs->arrived[gen][r]) != 1)
                SP_FAIL("P=%d rank %d: left barrier %d before rank %d reached it", P, rank, gen, r);
    }
    return 0;
}

/* ================================================================ 6. large allreduce */

#define NL (4u << 20)          /* fp32: 16 MiB */
#define NLB ((1u << 20) + 3)   /* bf16: 2 MiB and a bit */

/* Values over 2^-10 .. 2^10 with both signs and full significands: their fp32
 * sums round, and depend on the order. */
static float l_value(int rank, uint32_t i)
{
    uint64_t x = mix3(17, (uint64_t)rank, i);
    float m = (float)((x >> 8) & 0x7FFFFF) / 0x1p23f + 1.0f;
    return (x & 1 ? -1.0f : 1.0f) * ldexpf(m, (int)((x >> 40) % 21) - 10);
}

struct large_results {
    uint64_t hash[MAXR];
    int      reverse_differs;
};
static struct large_results *lres;

static uint64_t fnv(const void *p, size_t n)
{
    const uint8_t *b = p;
    uint64_t hsh = 0xCBF29CE484222325ull;
    for (size_t i = 0; i < n; i++)
        hsh = (hsh ^ b[i]) * 0x100000001B3ull;
    return hsh;
}

static int rank_large(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    float *x = spc_alloc(h, NL * sizeof *x);
    uint16_t *hb = spc_alloc(h, NLB * sizeof *hb);
    CHECK(x != NULL && hb != NULL);
    for (uint32_t i = 0; i < NL; i++)
        x[i] = l_value(rank, i);
    for (uint32_t i = 0; i < NLB; i++)
        hb[i] = h_input(&BF16, 0, rank, (int)(i % 4096 + 8), (int)(i / 4096));   /* past the hand-made elements */
    spc_request_t *r[2];
    CHECK_OK(h, spc_iallreduce(h, world, x, x, NL, SPC_F32, SPC_SUM, &r[0]));
    CHECK_OK(h, spc_iallreduce(h, world, hb, hb, NLB, SPC_BF16, SPC_SUM, &r[1]));
    for (int k = 0; k < 2; k++) {
        CHECK_OK(h, spc_wait(r[k], TMO));
        spc_request_release(r[k]);
    }
    int bad = 0, first = -1, rev = 0;
    for (uint32_t i = 0; i < NL; i++) {
        float want = l_value(0, i);
        for (int k = 1; k < P; k++)
            want = want + l_value(k, i);
        if (f32_bits(want) != f32_bits(x[i]) && bad++ == 0)
            first = (int)i;
        if (rank == 0 && P >= 3) {
            float back = l_value(P - 1, i);
            for (int k = P - 2; k >= 0; k--)
                back = back + l_value(k, i);
            rev += back != want;
        }
    }
    if (bad) {
        float want = l_value(0, (uint32_t)first);
        for (int k = 1; k < P; k++)
            want = want + l_value(k, (uint32_t)first);
        SP_FAIL("P=%d rank %d: fp32 allreduce of %u: %d elements differ from the rank-order fold; first at %d: "
                "expected %a, got %a", P, rank, NL, bad, first, (double)want, (double)x[first]);
    }
    for (uint32_t i = 0; i < NLB; i++) {
        int e = (int)(i % 4096 + 8), s = (int)(i / 4096);
        uint16_t want = h_ref(&BF16, 0, P, e, s, false);
        if (!h_same(&BF16, hb[i], want))
            SP_FAIL("P=%d rank %d: bf16 allreduce of %u: element %u: expected 0x%04x, got 0x%04x", P, rank, NLB, i,
                    want, hb[i]);
    }
    lres->hash[rank] = fnv(x, NL * sizeof *x) ^ fnv(hb, NLB * sizeof *hb) * 31;
    if (rank == 0)
        lres->reverse_differs = rev;
    spc_free(h, x);
    spc_free(h, hb);
    return 0;
}

static void test_large(void)
{
    for (int P = 2; P <= 3; P++) {
        memset(lres, 0, sizeof *lres);
        sp_test_run_job(P, rank_large, NULL);
        for (int r = 1; r < P; r++)
            CHECK_EQ(lres->hash[r], lres->hash[0]);
        if (P >= 3) {
            printf("P=%d: %d of %u large fp32 sums differ when taken in reverse rank order\n", P,
                   lres->reverse_differs, NL);
            CHECK(lres->reverse_differs > 0);
            uint64_t before = lres->hash[0];
            sp_test_run_job(P, rank_large, NULL);
            CHECK_EQ(lres->hash[0], before);   /* a rerun gives the same bits */
        }
    }
}

/* ================================================================ main */

int main(int argc, char **argv)
{
    uint64_t t0 = sp_test_now_ms();
    check_conversions();

    sp_test_daemon_t d;
    sp_test_start(&d, argc, argv);
    hres = sp_test_shared(sizeof *hres);
    lres = sp_test_shared(sizeof *lres);
    bcs = sp_test_shared(sizeof *bcs);

    test_half();
    for (int P = 1; P <= MAXR; P++)
        sp_test_run_job(P, rank_int, NULL);
    test_losses();
    bool helper = false;
    for (int P = 1; P <= MAXR; P++)
        sp_test_run_job(P, rank_gather, &helper);
    sp_test_run_job(4, rank_mesh, &helper);
    for (int P = 1; P <= MAXR; P++) {
        memset(bcs, 0, sizeof *bcs);
        sp_test_run_job(P, rank_bcast, NULL);
    }
    test_large();
    /* Last, so that a fault of the helper alone leaves the daemon's results above in the log. */
    printf("the same gathers through spc_allgather()\n");
    helper = true;
    for (int P = 1; P <= MAXR; P++)
        sp_test_run_job(P, rank_gather, &helper);
    sp_test_run_job(4, rank_mesh, &helper);

    CHECK_EQ(sp_test_cluster_stop(), 0);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("collectives: ok (%" PRIu64 " ms)\n", sp_test_now_ms() - t0);
    return 0;
}
