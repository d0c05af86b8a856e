/*
 * spbench-gpu-procs — spd on one GPU driven by P client processes (2, 4 and 8 by
 * default), every figure beside a bound or baseline measured in the same run.
 *
 *   spbench-gpu-procs alltoall [--procs P,...] [--seq S,...] [--heads H] [--dim D]
 *                              [--direction seq2head|head2seq|both] [--iters K] [--batches B]
 *                              [COMMON]
 *   spbench-gpu-procs latency  [--procs P,...] [--iters N] [--depth D] [--batches B] [COMMON]
 *   COMMON: [--gpus N] [--json | --json-file FILE] [--spd PATH] [--set KEY=VALUE]...
 *           [--point-timeout SECONDS] [--keep]
 *
 * The program starts its own spd (the one of this build, or --spd; --set options go
 * to it) in a fresh directory, waits for its READY=1, and for each point forks P
 * rank processes that attach, join a new job, cudaSetDevice(0), cudaMalloc their
 * buffers and register them with spc_register_device; with --gpus N, rank r
 * takes GPU r mod N instead (one rank per GPU at P = N). The parent never touches
 * CUDA: a process that forks after CUDA has started gives its children a broken
 * runtime. A point whose ranks are still running after --point-timeout (default
 * 600 s) is killed and fails; --keep leaves spd's directory and log behind.
 *
 * alltoall: the Ulysses all-to-all of one bf16 BSHD tensor, [1, S/P, H, D] per rank
 * (default S = 16384 and 131072, H = 32, D = 128), seq->head unless --direction
 * says otherwise, through spd (which runs the fused kernel on its own stream,
 * reading every rank's imported buffer). Two modes:
 *   host-sync  no stream: each of K iterations (default 50, after 5 warm-up ones)
 *              is a barrier, then spc_alltoall timed on every rank; an iteration
 *              counts as its slowest rank's time; the median is reported;
 *   stream     spc_set_stream on a CUDA stream of the rank: a batch is a barrier,
 *              then K spc_alltoall enqueued back to back and one
 *              cudaStreamSynchronize; per-op time = batch time / K, the slowest
 *              rank's; median of B batches (default 5, after one warm-up batch).
 * Beside them, the copy bound as spbench-gpu defines it: rank 0 times, with CUDA
 * events, P cudaMemcpyAsync device to device of one rank's output bytes each (the
 * P * out bytes the op writes); medians of K, taken before and after the spd
 * modes with the faster kept. With --gpus N the slices come from buffers on the
 * ranks' GPUs (rank q's on GPU q mod N), peer to peer (cudaMemcpyPeerAsync,
 * peer access enabled where the GPUs have it): what rank 0's output reads. GB/s = (bytes read + bytes written) / time, 1e9
 * bytes/s; "% of bound" = copy time / spd time (goal: 90 % or more).
 *
 * latency: an 8-byte allreduce (fp64 x 1, SUM) of device buffers through spd:
 *   host-sync         no stream: N ops (default 2000, after 200 warm-up ones), each
 *                     timed alone;
 *   stream            spc_set_stream: N times {spc_allreduce; cudaStreamSynchronize},
 *                     each timed alone;
 *   stream-pipelined  B batches (default 20, after a warm-up one) of D ops (default
 *                     100) enqueued back to back, then one cudaStreamSynchronize;
 *                     per-op = batch time / D, the slowest rank's, median of B.
 * The loops of host-sync and stream run in lock step across ranks (an op completes
 * on none before every rank has submitted it); rank 0's times are reported, median
 * and 99th percentile. The baseline, in rank 0's process on the same GPU: the same
 * loops with an in-process launch, in place of the op, of the kernel spd runs for
 * it (the whole P-rank all-reduce of one fp64 in one launch, on P pairs of rank 0's
 * own buffers); measured before and after, the faster kept.
 * "added" = spd - baseline; the goal for the stream modes is 10 us or less (an
 * IPC-event design, with a host handshake per op, paid 150-190 us). --procs 1 is
 * the deployment spd is built for, one rank per GPU: only that rank's context and
 * spd's share the GPU, where P ranks on one GPU add a context switch per rank.
 *
 * Correctness, once per mode of every point: before a mode the receive buffers are
 * overwritten with a pattern no result has; after it, the all-to-all's output is
 * compared with a host reference on whole rows (the first and last, those at the
 * ranks' chunk boundaries, a few chosen at random), and the allreduce's result
 * with the sum of the ranks' inputs. A stream mode also needs spc_stream_query and
 * spc_stream_destroy to say SPC_OK, and spc_stream_seq to count every op it
 * submitted (none went host-synchronously). The parent then checks that spd counted at
 * least the ops the ranks submitted, and no failed op. A mode that fails any of
 * this prints FAILED with the reason instead of a figure, and the program exits 1.
 *
 * --json prints one JSON object per line (one per mode of a point) instead of the
 * table; --json-file writes them to FILE beside the table. Exit status: 0, 1 (a
 * point failed), 2 (usage), 77 (no usable GPU: skipped, with the reason).
 */
#include <cuda_runtime.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "sp_kern_cuda.h"
#include "spclient/spclient.h"

#define PROG "spbench-gpu-procs"

#define MAX_PROCS  16
#define MAX_LIST   8
#define MAX_SETS   16
#define OP_TIMEOUT_MS 60000
#define ARENA_BYTES   (1u << 20)   /* the ranks' buffers are all on the GPU */

#define A2A_WARMUP 5
#define LAT_WARMUP 200

/* ================================================================ small things */

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

typedef struct stats {
    double median_us, p99_us;
} stats_t;

/* Sorts v in place. */
static stats_t summarize(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    stats_t s = { .median_us = n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2 };
    int k = (int)ceil(0.99 * n) - 1;
    s.p99_us = v[k < 0 ? 0 : k];
    return s;
}

/* "2,4,8" into out[]; every value in [lo, hi]. Returns the count, or -1. */
static int parse_list(const char *s, unsigned *out, unsigned lo, unsigned hi)
{
    int n = 0;
    while (*s != '\0') {
        char *end;
        errno = 0;
        unsigned long v = strtoul(s, &end, 10);
        if (end == s || errno != 0 || v < lo || v > hi || n == MAX_LIST || (*end != ',' && *end != '\0'))
            return -1;
        out[n++] = (unsigned)v;
        s = *end == ',' ? end + 1 : end;
    }
    return n;
}

/* The reason may hold anything a library said: keep the JSON valid. */
static void json_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s != '\0'; s++) {
        unsigned char ch = (unsigned char)*s;
        if (ch == '"' || ch == '\\')
            fprintf(f, "\\%c", ch);
        else if (ch < 0x20)
            fprintf(f, "\\u%04x", ch);
        else
            fputc(ch, f);
    }
    fputc('"', f);
}

/* ================================================================ what ranks and parent share */

enum { MODE_SYNC, MODE_STREAM, MODE_PIPE, NMODES };

static const char *const mode_names[NMODES] = { "host-sync", "stream", "stream-pipelined" };

static const char *where(int mode)
{
    return mode >= 0 ? mode_names[mode] : "outside the modes";
}

/*
 * One point's shared anonymous memory, mapped before the ranks are forked.
 * Ranks write their own slots; the parent reads after every rank has exited.
 * samples[(mode * procs + rank) * cap + i].
 */
typedef struct shared {
    int      cap;                        /* samples per (mode, rank) */
    int      nsamples[NMODES];           /* per (mode, rank), written when the mode is done */
    bool     ok[NMODES][MAX_PROCS];      /* the rank finished the mode and its result was right */
    uint64_t ops[MAX_PROCS];             /* ops the rank submitted to spd */
    double   bound_us[2];                /* before and after the modes: alltoall's copy bound; latency's
                                            baseline, one launch at a time */
    double   base_pipe_us[2];            /* latency: the baseline, pipelined */
    int      at[MAX_PROCS];              /* the mode each rank is in; -1 outside them */
    double   fail_at[MAX_PROCS];         /* when the rank failed (0: it did not) */
    char     fail[MAX_PROCS][320];       /* why */
    double   samples[];
} shared_t;

static shared_t *shared_map(int procs, int cap)
{
    size_t bytes = sizeof(shared_t) + (size_t)NMODES * (size_t)procs * (size_t)cap * sizeof(double);
    shared_t *sh = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (sh == MAP_FAILED) {
        fprintf(stderr, PROG ": mmap of %zu bytes: %s\n", bytes, strerror(errno));
        exit(1);
    }
    sh->cap = cap;
    return sh;
}

static void shared_unmap(shared_t *sh, int procs)
{
    munmap(sh, sizeof(shared_t) + (size_t)NMODES * (size_t)procs * (size_t)sh->cap * sizeof(double));
}

static double *samples(shared_t *sh, int procs, int mode, int rank)
{
    return &sh->samples[((size_t)mode * (size_t)procs + (size_t)rank) * (size_t)sh->cap];
}

/* ================================================================ a rank */

typedef struct rank_ctx {
    int           rank, procs;
    shared_t     *sh;
    spc_handle_t *h;
    spc_group_t   world;
    int           mode;    /* the mode running, for messages; -1 outside them */
} rank_ctx_t;

/* Where the rank is, for its messages and for the parent's, should it hang. */
static void rank_enter(rank_ctx_t *c, int mode)
{
    c->mode = mode;
    c->sh->at[c->rank] = mode;
}

/* Says why on stderr and in the shared page, then exits: spd tells the other
 * ranks (PEER_LOST) at once, so nobody waits for a timeout. */
__attribute__((format(printf, 2, 3), noreturn)) static void rank_fail(rank_ctx_t *c, const char *fmt, ...)
{
    char *why = c->sh->fail[c->rank];
    size_t len = sizeof c->sh->fail[c->rank];
    int n = snprintf(why, len, "rank %d of %d, %s: ", c->rank, c->procs, where(c->mode));
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why + n, len - (size_t)n, fmt, ap);
    va_end(ap);
    c->sh->fail_at[c->rank] = now_us();
    fprintf(stderr, PROG ": %s\n", why);
    exit(1);
}

#define CUDA_OR_FAIL(c, call)                                                                \
    do {                                                                                     \
        cudaError_t e_ = (call);                                                             \
        if (e_ != cudaSuccess)                                                               \
            rank_fail(c, "%s: %s", #call, cudaGetErrorString(e_));                           \
    } while (0)

#define SPC_OR_FAIL(c, call)                                                                 \
    do {                                                                                     \
        spc_status_t st_ = (call);                                                           \
        if (st_ != SPC_OK)                                                                   \
            rank_fail(c, "%s: %s: %s", #call, spc_status_name(st_), spc_last_error((c)->h)); \
    } while (0)

/* A barrier names no tensor, so it is host-synchronous even while a stream is
 * current: the ranks leave it together. */
static void rank_barrier(rank_ctx_t *c)
{
    c->sh->ops[c->rank]++;
    SPC_OR_FAIL(c, spc_barrier(c->h, c->world, OP_TIMEOUT_MS));
}

/* The stream's errors since the last call: none is allowed. */
static void stream_check(rank_ctx_t *c, spc_stream_t *s)
{
    SPC_OR_FAIL(c, spc_stream_query(s));
}

/* Every op of a stream mode went through the stream: an op the library sent
 * host-synchronously instead would be timed under the wrong name. Then the
 * stream is destroyed, which waits for its completions and says their errors. */
static void stream_finish(rank_ctx_t *c, spc_stream_t *s, uint64_t ops)
{
    if (spc_stream_seq(s) != ops)
        rank_fail(c, "%" PRIu64 " ops went through the stream, %" PRIu64 " were submitted", spc_stream_seq(s), ops);
    SPC_OR_FAIL(c, spc_stream_destroy(s));
}

static void *dev_alloc(rank_ctx_t *c, uint64_t bytes, spc_region_t *region_p)
{
    void *d;
    CUDA_OR_FAIL(c, cudaMalloc(&d, bytes));
    if (region_p != NULL)
        SPC_OR_FAIL(c, spc_register_device(c->h, d, bytes, region_p));
    return d;
}

static void dev_free(rank_ctx_t *c, void *d, const spc_region_t *region)
{
    if (region != NULL)
        SPC_OR_FAIL(c, spc_deregister(c->h, *region));
    CUDA_OR_FAIL(c, cudaFree(d));
}

/* ================================================================ alltoall */

typedef struct a2a_point {
    unsigned procs, seq, heads, dim;
    uint32_t direction;       /* spc_a2a_direction_t */
    int      iters, batches;
} a2a_point_t;

/*
 * The full tensor X[S, H, D] both layouts hold slices of: rank r's sequence
 * side is rows [r * S/P, (r + 1) * S/P) of every head, its head side heads
 * [r * H/P, (r + 1) * H/P) of every row. Each element is a bf16 bit pattern
 * from a hash of its place, exponent below all ones (finite, so no copy can
 * canonicalize it) and never 0xFFFF, the pattern receive buffers start with.
 */
static uint16_t a2a_value(uint64_t row, uint32_t head, uint32_t d)
{
    uint32_t x = ((uint32_t)row * 0x9E3779B1u ^ head * 0x85EBCA77u ^ d * 0xC2B2AE3Du) + 0x6A09E667u;
    x ^= x >> 15;
    x *= 0x2C1B3C6Du;
    x ^= x >> 12;
    return (uint16_t)(x & 0xBFFFu);
}

typedef struct a2a_geom {
    uint64_t s_loc, hl, bytes;   /* rows and heads per rank; bytes of each side (they are equal) */
} a2a_geom_t;

static a2a_geom_t a2a_geom(const a2a_point_t *pt)
{
    a2a_geom_t g = { .s_loc = pt->seq / pt->procs, .hl = pt->heads / pt->procs };
    g.bytes = g.s_loc * pt->heads * pt->dim * 2;
    return g;
}

/* Row i of rank r's sequence side (all H heads) or head side (its H/P heads). */
static void a2a_row(uint16_t *out, const a2a_point_t *pt, const a2a_geom_t *g, int rank, bool seq_side, uint64_t i)
{
    uint32_t nh = seq_side ? pt->heads : (uint32_t)g->hl, h0 = seq_side ? 0 : (uint32_t)(rank * g->hl);
    uint64_t row = seq_side ? (uint64_t)rank * g->s_loc + i : i;
    for (uint32_t h = 0; h < nh; h++)
        for (uint32_t d = 0; d < pt->dim; d++)
            out[(uint64_t)h * pt->dim + d] = a2a_value(row, h0 + h, d);
}

/* The input side is the sequence side for seq->head. */
static bool a2a_input_is_seq(const a2a_point_t *pt)
{
    return pt->direction == SPC_SEQ_TO_HEAD;
}

static void a2a_fill(rank_ctx_t *c, const a2a_point_t *pt, const a2a_geom_t *g, void *dsend)
{
    bool seq_side = a2a_input_is_seq(pt);
    uint64_t rows = seq_side ? g->s_loc : pt->seq, row_elems = g->bytes / 2 / rows;
    uint16_t *x = malloc(g->bytes);
    if (x == NULL)
        rank_fail(c, "malloc of %" PRIu64 " bytes", g->bytes);
    for (uint64_t i = 0; i < rows; i++)
        a2a_row(x + i * row_elems, pt, g, c->rank, seq_side, i);
    CUDA_OR_FAIL(c, cudaMemcpy(dsend, x, g->bytes, cudaMemcpyHostToDevice));
    free(x);
}

/* Whole output rows against the reference: the ends, the ranks' chunk
 * boundaries (seq->head), and a few at random. */
static void a2a_check(rank_ctx_t *c, const a2a_point_t *pt, const a2a_geom_t *g, const void *drecv)
{
    bool seq_side = !a2a_input_is_seq(pt);
    uint64_t rows = seq_side ? g->s_loc : pt->seq, row_elems = g->bytes / 2 / rows;
    uint64_t pick[8 + 2 * MAX_PROCS + 8];
    int n = 0;
    pick[n++] = 0;
    pick[n++] = rows - 1;
    pick[n++] = rows / 2;
    if (!seq_side)
        for (unsigned q = 1; q < pt->procs; q++) {
            pick[n++] = q * g->s_loc - 1;
            pick[n++] = q * g->s_loc;
        }
    uint64_t lcg = 0x9E3779B97F4A7C15ull * (uint64_t)(c->rank + 1) + (uint64_t)c->mode;
    for (int k = 0; k < 8; k++) {
        lcg = lcg * 6364136223846793005ull + 1442695040888963407ull;
        pick[n++] = (lcg >> 17) % rows;
    }
    uint16_t *got = malloc(row_elems * 2), *want = malloc(row_elems * 2);
    if (got == NULL || want == NULL)
        rank_fail(c, "malloc of 2 rows");
    for (int k = 0; k < n; k++) {
        uint64_t i = pick[k];
        CUDA_OR_FAIL(c, cudaMemcpy(got, (const uint16_t *)drecv + i * row_elems, row_elems * 2,
                                   cudaMemcpyDeviceToHost));
        a2a_row(want, pt, g, c->rank, seq_side, i);
        for (uint64_t e = 0; e < row_elems; e++)
            if (got[e] != want[e])
                rank_fail(c, "wrong output: local row %" PRIu64 ", head %" PRIu64 ", column %" PRIu64
                             ": 0x%04x, want 0x%04x (%s)",
                          i, e / pt->dim, e % pt->dim, got[e], want[e],
                          got[e] == 0xFFFF ? "never written" : "misplaced");
    }
    free(got);
    free(want);
}

/* GPUs the ranks take (--gpus): rank r on GPU r mod gpus. */
static int gpus = 1;

/* Rank 0, between the others' barriers: the copy bound of spbench-gpu; on
 * several GPUs, each slice from a buffer on its rank's GPU. */
static void a2a_bound(rank_ctx_t *c, const a2a_point_t *pt, const a2a_geom_t *g, int slot)
{
    uint64_t total = g->bytes * pt->procs;
    void *src = dev_alloc(c, total, NULL), *dst = dev_alloc(c, total, NULL);
    void *far[MAX_PROCS] = { NULL };   /* slices on other GPUs */
    for (unsigned q = 0; q < pt->procs && gpus > 1; q++) {
        int dev = (int)q % gpus;
        if (dev == 0)
            continue;
        CUDA_OR_FAIL(c, cudaSetDevice(dev));
        far[q] = dev_alloc(c, g->bytes, NULL);
        CUDA_OR_FAIL(c, cudaMemset(far[q], 0x3c, g->bytes));
        CUDA_OR_FAIL(c, cudaDeviceSynchronize());
        CUDA_OR_FAIL(c, cudaSetDevice(0));
        if (cudaDeviceEnablePeerAccess(dev, 0) != cudaSuccess)   /* else the driver stages the copy itself */
            (void)cudaGetLastError();
    }
    cudaStream_t st;
    cudaEvent_t e0, e1;
    CUDA_OR_FAIL(c, cudaMemset(src, 0x3c, total));
    CUDA_OR_FAIL(c, cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
    CUDA_OR_FAIL(c, cudaEventCreate(&e0));
    CUDA_OR_FAIL(c, cudaEventCreate(&e1));
    CUDA_OR_FAIL(c, cudaDeviceSynchronize());
    double *t = malloc((size_t)pt->iters * sizeof *t);
    for (int i = -A2A_WARMUP; i < pt->iters; i++) {
        CUDA_OR_FAIL(c, cudaEventRecord(e0, st));
        for (unsigned r = 0; r < pt->procs; r++) {
            if (far[r] != NULL)
                CUDA_OR_FAIL(c, cudaMemcpyPeerAsync((char *)dst + r * g->bytes, 0, far[r], (int)r % gpus, g->bytes,
                                                    st));
            else
                CUDA_OR_FAIL(c, cudaMemcpyAsync((char *)dst + r * g->bytes, (char *)src + r * g->bytes, g->bytes,
                                                cudaMemcpyDeviceToDevice, st));
        }
        CUDA_OR_FAIL(c, cudaEventRecord(e1, st));
        CUDA_OR_FAIL(c, cudaEventSynchronize(e1));
        float ms;
        CUDA_OR_FAIL(c, cudaEventElapsedTime(&ms, e0, e1));
        if (i >= 0)
            t[i] = ms * 1000.0;
    }
    c->sh->bound_us[slot] = summarize(t, pt->iters).median_us;
    free(t);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
    cudaStreamDestroy(st);
    dev_free(c, src, NULL);
    dev_free(c, dst, NULL);
    for (unsigned q = 0; q < pt->procs; q++)
        if (far[q] != NULL)
            CUDA_OR_FAIL(c, cudaFree(far[q]));
}

static void a2a_overwrite(rank_ctx_t *c, void *drecv, uint64_t bytes)
{
    CUDA_OR_FAIL(c, cudaMemset(drecv, 0xFF, bytes));
    CUDA_OR_FAIL(c, cudaDeviceSynchronize());
}

static void a2a_rank(rank_ctx_t *c, const a2a_point_t *pt)
{
    a2a_geom_t g = a2a_geom(pt);
    spc_region_t rs, rr;
    void *dsend = dev_alloc(c, g.bytes, &rs), *drecv = dev_alloc(c, g.bytes, &rr);
    a2a_fill(c, pt, &g, dsend);
    spc_alltoall_desc_t d = {
        .struct_size = sizeof d,
        .group = c->world,
        .dtype = SPC_BF16,
        .direction = pt->direction,
        .layout = SPC_LAYOUT_BSHD,
        .batch = 1,
        .seq_len = pt->seq,
        .ntensors = 1,
        .tensors = { { .send = dsend, .recv = drecv, .heads = pt->heads, .head_dim = pt->dim, .kind = SPC_HEADS_Q } },
        .timeout_ms = OP_TIMEOUT_MS,
    };
    rank_barrier(c);
    if (c->rank == 0)
        a2a_bound(c, pt, &g, 0);
    rank_barrier(c);

    /* host-sync: a barrier, then the op, timed on every rank. */
    rank_enter(c, MODE_SYNC);
    a2a_overwrite(c, drecv, g.bytes);
    double *s = samples(c->sh, c->procs, MODE_SYNC, c->rank);
    for (int i = -A2A_WARMUP; i < pt->iters; i++) {
        rank_barrier(c);
        double t0 = now_us();
        c->sh->ops[c->rank]++;
        SPC_OR_FAIL(c, spc_alltoall(c->h, &d, OP_TIMEOUT_MS));
        if (i >= 0)
            s[i] = now_us() - t0;
    }
    a2a_check(c, pt, &g, drecv);
    c->sh->nsamples[MODE_SYNC] = pt->iters;
    c->sh->ok[MODE_SYNC][c->rank] = true;

    /* stream: batches of K ops enqueued back to back, one stream synchronize. */
    rank_enter(c, MODE_STREAM);
    a2a_overwrite(c, drecv, g.bytes);
    cudaStream_t cs;
    spc_stream_t *ss;
    CUDA_OR_FAIL(c, cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    SPC_OR_FAIL(c, spc_stream_create(c->h, cs, &ss));
    SPC_OR_FAIL(c, spc_set_stream(c->h, ss));
    s = samples(c->sh, c->procs, MODE_STREAM, c->rank);
    for (int b = -1; b < pt->batches; b++) {
        rank_barrier(c);
        double t0 = now_us();
        for (int i = 0; i < pt->iters; i++) {
            c->sh->ops[c->rank]++;
            SPC_OR_FAIL(c, spc_alltoall(c->h, &d, OP_TIMEOUT_MS));
        }
        CUDA_OR_FAIL(c, cudaStreamSynchronize(cs));
        double t1 = now_us();
        stream_check(c, ss);
        if (b >= 0)
            s[b] = (t1 - t0) / pt->iters;
    }
    stream_finish(c, ss, (uint64_t)(pt->batches + 1) * (uint64_t)pt->iters);
    CUDA_OR_FAIL(c, cudaStreamDestroy(cs));
    a2a_check(c, pt, &g, drecv);
    c->sh->nsamples[MODE_STREAM] = pt->batches;
    c->sh->ok[MODE_STREAM][c->rank] = true;

    rank_enter(c, -1);
    rank_barrier(c);
    if (c->rank == 0)
        a2a_bound(c, pt, &g, 1);
    rank_barrier(c);
    dev_free(c, dsend, &rs);
    dev_free(c, drecv, &rr);
}

/* ================================================================ latency */

typedef struct lat_point {
    unsigned procs;
    int      iters, depth, batches;
} lat_point_t;

/*
 * Rank 0's baseline: the kernel spd launches for the op (the whole all-reduce
 * of P 8-byte sends into P receives, in one launch), on P pairs of buffers of
 * this process, then cudaStreamSynchronize, N times each timed alone; and B
 * batches of D launches then one synchronize, per launch. Medians.
 */
static void launch_allreduce(rank_ctx_t *c, double *const *dst, const double *const *src, cudaStream_t cs)
{
    int rc = sp_kern_allreduce_cuda((void *const *)dst, (const void *const *)src, (uint32_t)c->procs, 1,
                                    SP_KERN_F64, SP_KERN_SUM, cs);
    if (rc != 0)
        rank_fail(c, "sp_kern_allreduce_cuda returned %d", rc);
}

static void lat_baseline(rank_ctx_t *c, const lat_point_t *pt, cudaStream_t cs, int slot)
{
    double *buf = dev_alloc(c, 2 * (uint64_t)c->procs * sizeof *buf, NULL), *dst[MAX_PROCS];
    const double *src[MAX_PROCS];
    for (int r = 0; r < c->procs; r++) {
        src[r] = buf + r;
        dst[r] = buf + c->procs + r;
    }
    CUDA_OR_FAIL(c, cudaMemset(buf, 0, 2 * (uint64_t)c->procs * sizeof *buf));
    CUDA_OR_FAIL(c, cudaDeviceSynchronize());
    int n = pt->iters > pt->batches ? pt->iters : pt->batches;
    double *t = malloc((size_t)n * sizeof *t);
    for (int i = -LAT_WARMUP; i < pt->iters; i++) {
        double t0 = now_us();
        launch_allreduce(c, dst, src, cs);
        CUDA_OR_FAIL(c, cudaStreamSynchronize(cs));
        if (i >= 0)
            t[i] = now_us() - t0;
    }
    c->sh->bound_us[slot] = summarize(t, pt->iters).median_us;
    for (int b = -1; b < pt->batches; b++) {
        double t0 = now_us();
        for (int i = 0; i < pt->depth; i++)
            launch_allreduce(c, dst, src, cs);
        CUDA_OR_FAIL(c, cudaStreamSynchronize(cs));
        if (b >= 0)
            t[b] = (now_us() - t0) / pt->depth;
    }
    c->sh->base_pipe_us[slot] = summarize(t, pt->batches).median_us;
    free(t);
    dev_free(c, buf, NULL);
}

/* Every rank sends rank + 1: the sum is P(P+1)/2, exact in fp64. recv starts at
 * -1 before each mode, a value no sum here has. */
static void lat_reset(rank_ctx_t *c, double *drecv, cudaStream_t cs)
{
    const double minus_one = -1.0;
    CUDA_OR_FAIL(c, cudaMemcpyAsync(drecv, &minus_one, sizeof minus_one, cudaMemcpyHostToDevice, cs));
    CUDA_OR_FAIL(c, cudaStreamSynchronize(cs));
}

static void lat_check(rank_ctx_t *c, const double *drecv, cudaStream_t cs)
{
    double got, want = (double)c->procs * (c->procs + 1) / 2;
    CUDA_OR_FAIL(c, cudaMemcpyAsync(&got, drecv, sizeof got, cudaMemcpyDeviceToHost, cs));
    CUDA_OR_FAIL(c, cudaStreamSynchronize(cs));
    if (got != want)
        rank_fail(c, "allreduce gave %.17g, want %.17g (the sum of 1..%d)%s", got, want, c->procs,
                  got == -1.0 ? ": never written" : "");
}

static void lat_rank(rank_ctx_t *c, const lat_point_t *pt)
{
    spc_region_t rs, rr;
    double *dsend = dev_alloc(c, 8, &rs), *drecv = dev_alloc(c, 8, &rr);
    const double mine = c->rank + 1;
    CUDA_OR_FAIL(c, cudaMemcpy(dsend, &mine, sizeof mine, cudaMemcpyHostToDevice));
    cudaStream_t cs;
    CUDA_OR_FAIL(c, cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    rank_barrier(c);
    if (c->rank == 0)
        lat_baseline(c, pt, cs, 0);
    rank_barrier(c);

    /* host-sync: the op returns when spd's kernels are done. */
    rank_enter(c, MODE_SYNC);
    lat_reset(c, drecv, cs);
    double *s = samples(c->sh, c->procs, MODE_SYNC, c->rank);
    for (int i = -LAT_WARMUP; i < pt->iters; i++) {
        double t0 = now_us();
        c->sh->ops[c->rank]++;
        SPC_OR_FAIL(c, spc_allreduce(c->h, c->world, dsend, drecv, 1, SPC_F64, SPC_SUM, OP_TIMEOUT_MS));
        if (i >= 0)
            s[i] = now_us() - t0;
    }
    lat_check(c, drecv, cs);
    c->sh->nsamples[MODE_SYNC] = pt->iters;
    c->sh->ok[MODE_SYNC][c->rank] = true;

    /* stream: the op enqueued on cs, then the stream synchronized, each timed. */
    rank_enter(c, MODE_STREAM);
    lat_reset(c, drecv, cs);
    spc_stream_t *ss;
    SPC_OR_FAIL(c, spc_stream_create(c->h, cs, &ss));
    SPC_OR_FAIL(c, spc_set_stream(c->h, ss));
    s = samples(c->sh, c->procs, MODE_STREAM, c->rank);
    for (int i = -LAT_WARMUP; i < pt->iters; i++) {
        double t0 = now_us();
        c->sh->ops[c->rank]++;
        SPC_OR_FAIL(c, spc_allreduce(c->h, c->world, dsend, drecv, 1, SPC_F64, SPC_SUM, OP_TIMEOUT_MS));
        CUDA_OR_FAIL(c, cudaStreamSynchronize(cs));
        double t1 = now_us();
        /* Outside the timed part: the op's completion reaped and its status read. */
        stream_check(c, ss);
        if (i >= 0)
            s[i] = t1 - t0;
    }
    lat_check(c, drecv, cs);
    c->sh->nsamples[MODE_STREAM] = pt->iters;
    c->sh->ok[MODE_STREAM][c->rank] = true;

    /* stream-pipelined: D ops enqueued, one synchronize. */
    rank_enter(c, MODE_PIPE);
    lat_reset(c, drecv, cs);
    s = samples(c->sh, c->procs, MODE_PIPE, c->rank);
    for (int b = -1; b < pt->batches; b++) {
        rank_barrier(c);
        double t0 = now_us();
        for (int i = 0; i < pt->depth; i++) {
            c->sh->ops[c->rank]++;
            SPC_OR_FAIL(c, spc_allreduce(c->h, c->world, dsend, drecv, 1, SPC_F64, SPC_SUM, OP_TIMEOUT_MS));
        }
        CUDA_OR_FAIL(c, cudaStreamSynchronize(cs));
        double t1 = now_us();
        stream_check(c, ss);
        if (b >= 0)
            s[b] = (t1 - t0) / pt->depth;
    }
    stream_finish(c, ss, (uint64_t)(LAT_WARMUP + pt->iters) + (uint64_t)(pt->batches + 1) * (uint64_t)pt->depth);
    lat_check(c, drecv, cs);
    c->sh->nsamples[MODE_PIPE] = pt->batches;
    c->sh->ok[MODE_PIPE][c->rank] = true;

    rank_enter(c, -1);
    rank_barrier(c);
    if (c->rank == 0)
        lat_baseline(c, pt, cs, 1);
    rank_barrier(c);
    CUDA_OR_FAIL(c, cudaStreamDestroy(cs));
    dev_free(c, dsend, &rs);
    dev_free(c, drecv, &rr);
}

/* ================================================================ spd */

static struct {
    pid_t pid, owner;   /* owner: the process that started it (forked ranks must not stop it) */
    char  dir[64], sock[128], log[128];
    bool  keep;
} spd;

static void spd_stop(void)
{
    if (spd.pid <= 0 || getpid() != spd.owner)
        return;
    kill(spd.pid, SIGTERM);
    waitpid(spd.pid, NULL, 0);
    spd.pid = 0;
    if (spd.keep) {
        fprintf(stderr, PROG ": spd's log is %s\n", spd.log);
        return;
    }
    char path[160];
    const char *names[] = { "spd.sock", "notify", "spd.log" };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        snprintf(path, sizeof path, "%s/%s", spd.dir, names[i]);
        unlink(path);
    }
    rmdir(spd.dir);
}

/* Starts spd in a fresh directory and returns once it has said READY=1. */
static void spd_start(const char *bin, char *const *sets, int nsets)
{
    snprintf(spd.dir, sizeof spd.dir, "/tmp/spbench-gpu-XXXXXX");
    if (mkdtemp(spd.dir) == NULL) {
        fprintf(stderr, PROG ": mkdtemp: %s\n", strerror(errno));
        exit(1);
    }
    snprintf(spd.sock, sizeof spd.sock, "%s/spd.sock", spd.dir);
    snprintf(spd.log, sizeof spd.log, "%s/spd.log", spd.dir);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s/notify", spd.dir);
    int nfd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (nfd < 0 || bind(nfd, (struct sockaddr *)&sa, sizeof sa) != 0) {
        fprintf(stderr, PROG ": notify socket %s: %s\n", sa.sun_path, strerror(errno));
        exit(1);
    }
    char set_sock[160], set_log[160];
    snprintf(set_sock, sizeof set_sock, "socket=%s", spd.sock);
    snprintf(set_log, sizeof set_log, "log_file=%s", spd.log);
    const char *argv[8 + 2 * MAX_SETS];
    int n = 0;
    argv[n++] = bin;
    argv[n++] = "--set";
    argv[n++] = set_sock;
    argv[n++] = "--set";
    argv[n++] = set_log;
    for (int i = 0; i < nsets; i++) {
        argv[n++] = "--set";
        argv[n++] = sets[i];
    }
    argv[n] = NULL;
    fflush(stdout);
    fflush(stderr);
    spd.owner = getpid();
    spd.pid = fork();
    if (spd.pid < 0) {
        fprintf(stderr, PROG ": fork: %s\n", strerror(errno));
        exit(1);
    }
    if (spd.pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGTERM);   /* never outlives the benchmark */
        setenv("NOTIFY_SOCKET", sa.sun_path, 1);
        execv(bin, (char *const *)argv);
        fprintf(stderr, PROG ": exec %s: %s\n", bin, strerror(errno));
        _exit(127);
    }
    atexit(spd_stop);
    double deadline = now_us() + 15e6;
    char msg[512];
    for (;;) {
        struct pollfd p = { .fd = nfd, .events = POLLIN };
        int rc = poll(&p, 1, 100);
        if (rc > 0) {
            ssize_t len = recv(nfd, msg, sizeof msg - 1, 0);
            if (len > 0) {
                msg[len] = '\0';
                if (strstr(msg, "READY=1") != NULL)
                    break;
            }
        }
        int status;
        if (waitpid(spd.pid, &status, WNOHANG) == spd.pid) {
            fprintf(stderr, PROG ": %s exited (status 0x%x) before it was ready; its log: %s\n", bin, status, spd.log);
            spd.pid = 0;
            spd.keep = true;
            exit(1);
        }
        if (now_us() > deadline) {
            fprintf(stderr, PROG ": %s did not say READY=1 within 15 s; its log: %s\n", bin, spd.log);
            spd.keep = true;
            exit(1);
        }
    }
    close(nfd);
}

/* An integer or string field of spd's status; -1 (or "") when absent. */
static int64_t spd_status(spc_handle_t *h, const char *key, char *str, size_t len)
{
    spc_query_result_t *q;
    int64_t v = -1;
    if (str != NULL)
        snprintf(str, len, "%s", "");
    if (spc_query(h, "status", "", &q) != SPC_OK)
        return -1;
    long f = spc_query_records(q) > 0 ? spc_query_find(q, 0, key) : -1;
    if (f >= 0 && spc_query_kind(q, 0, (size_t)f) == SPC_VALUE_INT)
        v = spc_query_int(q, 0, (size_t)f);
    else if (f >= 0 && str != NULL)
        snprintf(str, len, "%s", spc_query_str(q, 0, (size_t)f));
    spc_query_free(q);
    return v;
}

/* ================================================================ points */

typedef struct bench {
    bool          text;       /* the table on stdout */
    FILE         *json;       /* JSON lines: stdout (--json), a file (--json-file), or NULL */
    int           point_timeout_s;
    spc_handle_t *owner;      /* creates the jobs, reads spd's counters */
    char          device[256];
    int           failures;
} bench_t;

typedef struct point {
    const a2a_point_t *a2a;   /* one of the two */
    const lat_point_t *lat;
    int                procs;
} point_t;

/* Forks the ranks of one point in a new job and waits for them; false when one
 * failed or the point ran out of time (why, on stderr). The shared page holds
 * what each rank got done. */
static bool run_point(bench_t *b, const point_t *pt, shared_t *sh)
{
    char job[SPC_JOB_ID_MAX];
    spc_status_t st = spc_job_create(b->owner, job, sizeof job);
    if (st != SPC_OK) {
        fprintf(stderr, PROG ": job create: %s: %s\n", spc_status_name(st), spc_last_error(b->owner));
        exit(1);
    }
    pid_t pids[MAX_PROCS];
    fflush(stdout);
    fflush(stderr);
    for (int r = 0; r < pt->procs; r++) {
        pids[r] = fork();
        if (pids[r] < 0) {
            fprintf(stderr, PROG ": fork: %s\n", strerror(errno));
            exit(1);
        }
        if (pids[r] > 0)
            continue;
        prctl(PR_SET_PDEATHSIG, SIGKILL);   /* no rank outlives the benchmark */
        rank_ctx_t c = { .rank = r, .procs = pt->procs, .sh = sh };
        rank_enter(&c, -1);
        spc_attach_params_t ap = { .struct_size = sizeof ap, .socket_path = spd.sock, .name = PROG,
                                   .arena_bytes = ARENA_BYTES };
        SPC_OR_FAIL(&c, spc_attach(&ap, &c.h));
        SPC_OR_FAIL(&c, spc_job_join(c.h, job, (uint32_t)pt->procs, (uint32_t)r, 30000, &c.world));
        CUDA_OR_FAIL(&c, cudaSetDevice(r % gpus));
        if (pt->a2a != NULL)
            a2a_rank(&c, pt->a2a);
        else
            lat_rank(&c, pt->lat);
        spc_detach(c.h);
        fflush(stdout);
        _exit(0);
    }
    /* Polling the ranks' exits: there is no portable event for "any of these
     * children, or the deadline". */
    double deadline = now_us() + b->point_timeout_s * 1e6;
    int left = pt->procs;
    bool ok = true;
    while (left > 0) {
        for (int r = 0; r < pt->procs; r++) {
            int status;
            if (pids[r] <= 0 || waitpid(pids[r], &status, WNOHANG) != pids[r])
                continue;
            pids[r] = 0;
            left--;
            ok &= WIFEXITED(status) && WEXITSTATUS(status) == 0;
        }
        if (left > 0 && now_us() > deadline) {
            fprintf(stderr, PROG ": the point ran past --point-timeout %d s: its ranks are killed\n",
                    b->point_timeout_s);
            for (int r = 0; r < pt->procs; r++)
                if (pids[r] > 0) {
                    kill(pids[r], SIGKILL);
                    waitpid(pids[r], NULL, 0);
                    if (sh->fail_at[r] == 0) {
                        snprintf(sh->fail[r], sizeof sh->fail[r], "rank %d of %d, %s: still running after %d s",
                                 r, pt->procs, where(sh->at[r]), b->point_timeout_s);
                        sh->fail_at[r] = now_us();
                    }
                }
            return false;
        }
        if (left > 0)
            usleep(2000);
    }
    return ok;
}

/* The first failure of a point, which the others' PEER_LOST follow. */
static const char *first_failure(const shared_t *sh, int procs)
{
    int first = -1;
    for (int r = 0; r < procs; r++)
        if (sh->fail_at[r] != 0 && (first < 0 || sh->fail_at[r] < sh->fail_at[first]))
            first = r;
    return first < 0 ? "a rank died without saying why (see stderr)" : sh->fail[first];
}

static bool mode_ok(const shared_t *sh, int procs, int mode)
{
    for (int r = 0; r < procs; r++)
        if (!sh->ok[mode][r])
            return false;
    return true;
}

/*
 * A mode's figure: per sample, the slowest rank's (batches, and the iterations
 * that start with a barrier), or rank 0's (the lock-step latency loops).
 */
static stats_t mode_stats(const shared_t *sh, int procs, int mode, bool slowest)
{
    int n = sh->nsamples[mode];
    double *v = malloc((size_t)n * sizeof *v);
    for (int i = 0; i < n; i++) {
        v[i] = samples((shared_t *)sh, procs, mode, 0)[i];
        for (int r = 1; slowest && r < procs; r++)
            v[i] = fmax(v[i], samples((shared_t *)sh, procs, mode, r)[i]);
    }
    stats_t s = summarize(v, n);
    free(v);
    return s;
}

/*
 * spd's counters around a point: every op the ranks submitted must have reached
 * spd, and none failed. Returns false (why, in `why`) otherwise.
 */
static bool spd_counted(bench_t *b, const shared_t *sh, int procs, int64_t total0, int64_t failed0, char *why,
                        size_t len)
{
    int64_t total = spd_status(b->owner, "ops_total", NULL, 0), failed = spd_status(b->owner, "ops_failed", NULL, 0);
    uint64_t submitted = 0;
    for (int r = 0; r < procs; r++)
        submitted += sh->ops[r];
    if (total < 0 || failed < 0 || total0 < 0 || failed0 < 0) {
        snprintf(why, len, "spd's status lacks ops_total or ops_failed");
        return false;
    }
    if (failed != failed0) {
        snprintf(why, len, "spd counted %" PRId64 " failed ops that no rank heard of", failed - failed0);
        return false;
    }
    if ((uint64_t)(total - total0) < submitted) {
        snprintf(why, len, "spd counted %" PRId64 " ops; the ranks submitted %" PRIu64, total - total0, submitted);
        return false;
    }
    return true;
}

/* ================================================================ alltoall: output */

static const char *dir_name(uint32_t direction)
{
    return direction == SPC_SEQ_TO_HEAD ? "seq->head" : "head->seq";
}

#define A2A_GOAL_PCT 90.0

/* Where the ranks are, for the tables' headers. */
static const char *on_gpus(void)
{
    static char text[64];
    if (gpus == 1)
        return "GPU 0";
    snprintf(text, sizeof text, "GPUs 0-%d (rank r on r mod %d)", gpus - 1, gpus);
    return text;
}

static void a2a_header(const bench_t *b, const a2a_point_t *pt)
{
    if (!b->text)
        return;
    printf("# %s; spd started by this run; P rank processes on %s, bf16 BSHD [1, S/P, %u, %u] each.\n"
           "# host-sync: barrier + op, slowest rank, median of %d; stream: %d ops enqueued then one\n"
           "# cudaStreamSynchronize, per op, slowest rank, median of %d batches. copy: rank 0's P D2D\n"
           "# cudaMemcpyAsync of one rank's output each, median of %d, before and after (faster kept).\n"
           "# GB/s = (read + written) / time; %%bound = copy_us / spd_us (goal >= %.0f %%).\n",
           b->device, on_gpus(), pt->heads, pt->dim, pt->iters, pt->iters, pt->batches, pt->iters, A2A_GOAL_PCT);
    printf("%-16s %-9s %2s %7s %9s %10s %8s %10s %8s %8s %7s %s\n", "mode", "direction", "P", "S", "out/rank",
           "spd_us", "GB/s", "copy_us", "GB/s", "spd/copy", "%bound", "goal");
}

/* One mode of a point: s NULL when it failed (why in `failed`); copy_us 0 when
 * there is no bound. */
static void a2a_print(const bench_t *b, const a2a_point_t *pt, int mode, const stats_t *s, double copy_us,
                      const char *failed)
{
    a2a_geom_t g = a2a_geom(pt);
    double moved = 2.0 * pt->procs * (double)g.bytes, pct = s != NULL ? 100.0 * copy_us / s->median_us : 0;
    FILE *j = b->json;
    if (j != NULL) {
        fprintf(j, "{\"bench\":\"alltoall\",\"mode\":\"%s\",\"device\":", mode_names[mode]);
        json_string(j, b->device);
        fprintf(j, ",\"direction\":\"%s\",\"procs\":%u,\"gpus\":%d,\"seq\":%u,\"heads\":%u,\"dim\":%u,"
                   "\"dtype\":\"bf16\",\"layout\":\"BSHD\",\"bytes_per_rank\":%" PRIu64 ",",
                dir_name(pt->direction), pt->procs, gpus, pt->seq, pt->heads, pt->dim, g.bytes);
        if (mode == MODE_SYNC)
            fprintf(j, "\"iters\":%d,\"timing\":\"barrier then op; median over iterations of the slowest rank\",",
                    pt->iters);
        else
            fprintf(j, "\"ops_per_batch\":%d,\"batches\":%d,\"timing\":\"ops enqueued back to back, one "
                       "cudaStreamSynchronize; per op; median over batches of the slowest rank\",",
                    pt->iters, pt->batches);
        if (copy_us > 0)
            fprintf(j, "\"copy_bound_us\":%.3f,\"copy_bound_GBps\":%.3f,", copy_us, moved / copy_us / 1e3);
        else
            fprintf(j, "\"copy_bound_us\":null,\"copy_bound_GBps\":null,");
        if (s == NULL) {
            fprintf(j, "\"spd_us\":null,\"failed\":");
            json_string(j, failed);
            fprintf(j, "}\n");
        } else {
            fprintf(j, "\"spd_us\":%.3f,\"spd_p99_us\":%.3f,\"spd_GBps\":%.3f,\"ratio_vs_bound\":%.4f,"
                       "\"pct_of_bound\":%.2f,\"goal_pct_of_bound\":%.0f,\"goal_met\":%s,\"checked\":true}\n",
                    s->median_us, s->p99_us, moved / s->median_us / 1e3, s->median_us / copy_us, pct, A2A_GOAL_PCT,
                    pct >= A2A_GOAL_PCT ? "true" : "false");
        }
        fflush(j);
    }
    if (!b->text)
        return;
    printf("%-16s %-9s %2u %7u %8.2fM ", mode_names[mode], dir_name(pt->direction), pt->procs, pt->seq,
           g.bytes / 1048576.0);
    if (s == NULL)
        printf("FAILED: %s\n", failed);
    else
        printf("%10.1f %8.0f %10.1f %8.0f %8.3f %6.1f%% %s\n", s->median_us, moved / s->median_us / 1e3, copy_us,
               moved / copy_us / 1e3, s->median_us / copy_us, pct, pct >= A2A_GOAL_PCT ? "met" : "MISSED");
    fflush(stdout);
}

static void a2a_point(bench_t *b, const a2a_point_t *pt)
{
    int cap = pt->iters > pt->batches ? pt->iters : pt->batches;
    shared_t *sh = shared_map((int)pt->procs, cap);
    point_t p = { .a2a = pt, .procs = (int)pt->procs };
    int64_t total0 = spd_status(b->owner, "ops_total", NULL, 0), failed0 = spd_status(b->owner, "ops_failed", NULL, 0);
    bool ok = run_point(b, &p, sh);
    char why[320];
    const char *failed = NULL;
    if (!ok)
        failed = first_failure(sh, p.procs);
    else if (!spd_counted(b, sh, p.procs, total0, failed0, why, sizeof why))
        failed = why;
    /* The bound of a point that failed before its second measurement is its first. */
    double copy_us = sh->bound_us[1] > 0 ? fmin(sh->bound_us[0], sh->bound_us[1]) : sh->bound_us[0];
    for (int mode = MODE_SYNC; mode <= MODE_STREAM; mode++) {
        /* A failed point still shows the modes every rank finished and checked. */
        bool good = (ok ? failed == NULL : mode_ok(sh, p.procs, mode)) && copy_us > 0;
        if (good) {
            stats_t s = mode_stats(sh, p.procs, mode, true);
            a2a_print(b, pt, mode, &s, copy_us, NULL);
        } else {
            a2a_print(b, pt, mode, NULL, copy_us, failed != NULL ? failed : "no copy bound");
        }
    }
    if (failed != NULL)
        b->failures++;
    shared_unmap(sh, p.procs);
}

/* ================================================================ latency: output */

#define LAT_GOAL_US 10.0

static void lat_header(const bench_t *b, const lat_point_t *pt)
{
    if (!b->text)
        return;
    printf("# %s; spd started by this run; 8-byte allreduce (fp64 x 1, SUM) of device buffers,\n"
           "# P rank processes on %s. host-sync, stream: %d ops each timed alone, rank 0's median\n"
           "# and p99. stream-pipelined: %d ops enqueued then one cudaStreamSynchronize, per op, slowest\n"
           "# rank, median of %d batches. base: the same loop in rank 0's process with spd's all-reduce\n"
           "# kernel (P x 8 bytes, one launch) in place of the op, before and after (faster kept).\n"
           "# added = spd_us - base_us; goal for the stream modes: <= %.0f us.\n",
           b->device, on_gpus(), pt->iters, pt->depth, pt->batches, LAT_GOAL_US);
    printf("%-16s %2s %10s %10s %10s %10s %s\n", "mode", "P", "spd_us", "p99_us", "base_us", "added_us", "goal");
}

/* One mode of a point: s NULL when it failed (why in `failed`). */
static void lat_print(const bench_t *b, const lat_point_t *pt, int mode, const stats_t *s, double base_us,
                      const char *failed)
{
    bool goal = mode != MODE_SYNC;
    double added = s != NULL ? s->median_us - base_us : 0;
    FILE *j = b->json;
    if (j != NULL) {
        fprintf(j, "{\"bench\":\"latency\",\"mode\":\"%s\",\"device\":", mode_names[mode]);
        json_string(j, b->device);
        fprintf(j, ",\"procs\":%u,\"gpus\":%d,\"op\":\"allreduce\",\"bytes\":8,\"dtype\":\"fp64\",\"redop\":\"sum\",",
                pt->procs, gpus);
        if (mode == MODE_PIPE)
            fprintf(j, "\"ops_per_batch\":%d,\"batches\":%d,\"timing\":\"ops enqueued back to back, one "
                       "cudaStreamSynchronize; per op; median over batches of the slowest rank\",",
                    pt->depth, pt->batches);
        else
            fprintf(j, "\"iters\":%d,\"timing\":\"each op timed alone%s; rank 0's median\",", pt->iters,
                    mode == MODE_STREAM ? " with its cudaStreamSynchronize" : "");
        fprintf(j, "\"baseline\":\"in-process launch of spd's all-reduce kernel on P x 8 bytes%s\",",
                mode == MODE_PIPE ? ", the same batches" : " + cudaStreamSynchronize");
        fprintf(j, "\"baseline_us\":%.3f,", base_us);
        if (s == NULL) {
            fprintf(j, "\"spd_us\":null,\"failed\":");
            json_string(j, failed);
            fprintf(j, "}\n");
        } else {
            fprintf(j, "\"spd_us\":%.3f,\"spd_p99_us\":%.3f,\"added_us\":%.3f,", s->median_us, s->p99_us, added);
            if (goal)
                fprintf(j, "\"goal_added_us\":%.0f,\"goal_met\":%s,", LAT_GOAL_US,
                        added <= LAT_GOAL_US ? "true" : "false");
            else
                fprintf(j, "\"goal_added_us\":null,\"goal_met\":null,");
            fprintf(j, "\"checked\":true}\n");
        }
        fflush(j);
    }
    if (!b->text)
        return;
    printf("%-16s %2u ", mode_names[mode], pt->procs);
    if (s == NULL)
        printf("FAILED: %s\n", failed);
    else
        printf("%10.2f %10.2f %10.2f %10.2f %s\n", s->median_us, s->p99_us, base_us, added,
               !goal ? "-" : added <= LAT_GOAL_US ? "met" : "MISSED");
    fflush(stdout);
}

static double fmin_set(double a, double b)
{
    return a > 0 && b > 0 ? fmin(a, b) : a > 0 ? a : b;
}

static void lat_point(bench_t *b, const lat_point_t *pt)
{
    int cap = pt->iters > pt->batches ? pt->iters : pt->batches;
    shared_t *sh = shared_map((int)pt->procs, cap);
    point_t p = { .lat = pt, .procs = (int)pt->procs };
    int64_t total0 = spd_status(b->owner, "ops_total", NULL, 0), failed0 = spd_status(b->owner, "ops_failed", NULL, 0);
    bool ok = run_point(b, &p, sh);
    char why[320];
    const char *failed = NULL;
    if (!ok)
        failed = first_failure(sh, p.procs);
    else if (!spd_counted(b, sh, p.procs, total0, failed0, why, sizeof why))
        failed = why;
    double base_sync = fmin_set(sh->bound_us[0], sh->bound_us[1]);
    double base_pipe = fmin_set(sh->base_pipe_us[0], sh->base_pipe_us[1]);
    for (int mode = MODE_SYNC; mode < NMODES; mode++) {
        /* A failed point still shows the modes every rank finished and checked. */
        double base = mode == MODE_PIPE ? base_pipe : base_sync;
        bool good = (ok ? failed == NULL : mode_ok(sh, p.procs, mode)) && base > 0;
        if (good) {
            stats_t s = mode_stats(sh, p.procs, mode, mode == MODE_PIPE);
            lat_print(b, pt, mode, &s, base, NULL);
        } else {
            lat_print(b, pt, mode, NULL, base, failed != NULL ? failed : "no baseline");
        }
    }
    if (failed != NULL)
        b->failures++;
    shared_unmap(sh, p.procs);
}

/* ================================================================ main */

static void usage(FILE *out)
{
    fprintf(out,
            "usage: " PROG " alltoall [--procs P,...] [--seq S,...] [--heads H] [--dim D]\n"
            "                         [--direction seq2head|head2seq|both] [--iters K] [--batches B] [COMMON]\n"
            "       " PROG " latency  [--procs P,...] [--iters N] [--depth D] [--batches B] [COMMON]\n"
            "  COMMON: [--gpus N] [--json | --json-file FILE] [--spd PATH] [--set KEY=VALUE]...\n"
            "          [--point-timeout SECONDS] [--keep]\n"
            "  Starts its own spd (--set options go to it; --keep leaves its log), P rank processes on\n"
            "  GPU 0 (--gpus N: rank r on GPU r mod N) for each P (default 2,4,8). alltoall: bf16\n"
            "  [1, S/P, H, D] (default S 16384,131072, H 32, D 128), K ops per mode (default 50), B stream\n"
            "  batches (default 5), beside the copy bound (peer to peer on several GPUs). latency: 8-byte\n"
            "  allreduce, N ops (default 2000), B batches (default 20) of D (default 100) pipelined,\n"
            "  beside an in-process kernel launch. Exit 77: no usable GPU, or fewer than N.\n");
}

/* Whether a GPU is usable, asked in a child: CUDA must not start in this process,
 * which forks the ranks. The child writes the GPU's name to `name`. */
static int gpu_probe(char *name, size_t len)
{
    char *page = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (page == MAP_FAILED) {
        fprintf(stderr, PROG ": mmap: %s\n", strerror(errno));
        exit(1);
    }
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    if (pid == 0) {
        int n = 0;
        cudaError_t e = cudaGetDeviceCount(&n);
        if (e != cudaSuccess || n == 0) {
            fprintf(stderr, PROG ": skipped: no usable CUDA device (%s)\n",
                    e != cudaSuccess ? cudaGetErrorString(e) : "0 devices");
            _exit(77);
        }
        if (n < gpus) {
            fprintf(stderr, PROG ": skipped: --gpus %d, but this machine has %d GPU%s\n", gpus, n, n == 1 ? "" : "s");
            _exit(77);
        }
        struct cudaDeviceProp prop;
        if ((e = cudaGetDeviceProperties(&prop, 0)) != cudaSuccess) {
            fprintf(stderr, PROG ": cudaGetDeviceProperties: %s\n", cudaGetErrorString(e));
            _exit(1);
        }
        snprintf(page, 4096, "%s, %.0f GiB", prop.name, prop.totalGlobalMem / 1073741824.0);
        _exit(0);
    }
    int status;
    if (pid < 0 || waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) {
        fprintf(stderr, PROG ": the GPU probe did not finish\n");
        exit(1);
    }
    snprintf(name, len, "%s", page);
    munmap(page, 4096);
    return WEXITSTATUS(status);
}

int main(int argc, char **argv)
{
    bool a2a = argc >= 2 && strcmp(argv[1], "alltoall") == 0, lat = argc >= 2 && strcmp(argv[1], "latency") == 0;
    if (!a2a && !lat) {
        bool help = argc >= 2 && strcmp(argv[1], "--help") == 0;
        usage(help ? stdout : stderr);
        return help ? 0 : 2;
    }
    unsigned procs[MAX_LIST] = { 2, 4, 8 }, seqs[MAX_LIST] = { 16384, 131072 }, heads = 32, dim = 128;
    int nprocs = 3, nseqs = 2, iters = a2a ? 50 : 2000, batches = a2a ? 5 : 20, depth = 100, timeout_s = 600;
    uint32_t dirs[2] = { SPC_SEQ_TO_HEAD, SPC_HEAD_TO_SEQ };
    int ndirs = 1;
#ifdef SPBENCH_SPD
    const char *spd_bin = SPBENCH_SPD;
#else
    const char *spd_bin = NULL;
#endif
    char *sets[MAX_SETS];
    int nsets = 0;
    bench_t b = { .text = true };
    const char *json_file = NULL;
    for (int i = 2; i < argc; i++) {
        const char *o = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        unsigned one[MAX_LIST];
        bool bad = false;
        if (strcmp(o, "--json") == 0) {
            b.json = stdout;
            b.text = false;
            continue;
        }
        if (strcmp(o, "--keep") == 0) {
            spd.keep = true;
            continue;
        }
        if (v == NULL) {
            usage(stderr);
            return 2;
        }
        i++;
        if (strcmp(o, "--procs") == 0)
            bad = (nprocs = parse_list(v, procs, 1, MAX_PROCS)) <= 0;
        else if (strcmp(o, "--seq") == 0 && a2a)
            bad = (nseqs = parse_list(v, seqs, 1, 1u << 30)) <= 0;
        else if (strcmp(o, "--heads") == 0 && a2a)
            bad = parse_list(v, one, 1, 4096) != 1 || (heads = one[0]) == 0;
        else if (strcmp(o, "--dim") == 0 && a2a)
            bad = parse_list(v, one, 1, 4096) != 1 || (dim = one[0]) == 0;
        else if (strcmp(o, "--direction") == 0 && a2a) {
            if (strcmp(v, "seq2head") == 0)
                ndirs = 1;
            else if (strcmp(v, "head2seq") == 0)
                dirs[0] = SPC_HEAD_TO_SEQ, ndirs = 1;
            else if (strcmp(v, "both") == 0)
                ndirs = 2;
            else
                bad = true;
        } else if (strcmp(o, "--iters") == 0)
            bad = parse_list(v, one, 1, 1000000) != 1 || (iters = (int)one[0]) == 0;
        else if (strcmp(o, "--batches") == 0)
            bad = parse_list(v, one, 1, 100000) != 1 || (batches = (int)one[0]) == 0;
        else if (strcmp(o, "--depth") == 0 && lat)
            bad = parse_list(v, one, 1, 4096) != 1 || (depth = (int)one[0]) == 0;
        else if (strcmp(o, "--gpus") == 0)
            bad = parse_list(v, one, 1, MAX_PROCS) != 1 || (gpus = (int)one[0]) == 0;
        else if (strcmp(o, "--point-timeout") == 0)
            bad = parse_list(v, one, 1, 86400) != 1 || (timeout_s = (int)one[0]) == 0;
        else if (strcmp(o, "--spd") == 0)
            spd_bin = v;
        else if (strcmp(o, "--json-file") == 0)
            json_file = v;
        else if (strcmp(o, "--set") == 0 && nsets < MAX_SETS && strchr(v, '=') != NULL)
            sets[nsets++] = argv[i];
        else
            bad = true;
        if (bad) {
            fprintf(stderr, PROG ": bad %s %s\n", o, v);
            usage(stderr);
            return 2;
        }
    }
    if (spd_bin == NULL) {
        fprintf(stderr, PROG ": built without the path of spd: pass --spd PATH\n");
        return 2;
    }
    /* Refuse every bad point before measuring any. */
    for (int j = 0; j < nprocs && a2a; j++) {
        for (int k = 0; k < nseqs; k++)
            if (seqs[k] % procs[j] != 0 || heads % procs[j] != 0) {
                fprintf(stderr, PROG ": P = %u must divide S = %u and H = %u (the benchmark takes no padding)\n",
                        procs[j], seqs[k], heads);
                return 2;
            }
    }
    b.point_timeout_s = timeout_s;
    if (json_file != NULL && b.json != NULL) {
        fprintf(stderr, PROG ": --json and --json-file: one or the other\n");
        return 2;
    }
    if (json_file != NULL && (b.json = fopen(json_file, "we")) == NULL) {
        fprintf(stderr, PROG ": %s: %s\n", json_file, strerror(errno));
        return 1;
    }

    int rc = gpu_probe(b.device, sizeof b.device);
    if (rc != 0)
        return rc;
    spd_start(spd_bin, sets, nsets);
    spc_attach_params_t ap = { .struct_size = sizeof ap, .socket_path = spd.sock, .name = PROG,
                               .arena_bytes = ARENA_BYTES };
    spc_status_t st = spc_attach(&ap, &b.owner);
    if (st != SPC_OK) {
        fprintf(stderr, PROG ": attach to %s: %s: %s\n", spd.sock, spc_status_name(st), spc_last_error(NULL));
        return 1;
    }
    char gpu_status[256];
    if (spd_status(b.owner, "gpus", NULL, 0) < 1) {
        spd_status(b.owner, "gpu_status", gpu_status, sizeof gpu_status);
        fprintf(stderr, PROG ": this process sees %s, but spd sees no GPU (gpu_status: %s)\n", b.device, gpu_status);
        return 1;
    }

    if (a2a) {
        a2a_point_t pt = { .heads = heads, .dim = dim, .iters = iters, .batches = batches };
        a2a_header(&b, &pt);
        for (int k = 0; k < nseqs; k++)
            for (int j = 0; j < nprocs; j++)
                for (int d = 0; d < ndirs; d++) {
                    pt.procs = procs[j];
                    pt.seq = seqs[k];
                    pt.direction = dirs[d];
                    a2a_point(&b, &pt);
                }
    } else {
        lat_point_t pt = { .iters = iters, .depth = depth, .batches = batches };
        lat_header(&b, &pt);
        for (int j = 0; j < nprocs; j++) {
            pt.procs = procs[j];
            lat_point(&b, &pt);
        }
    }
    spc_detach(b.owner);
    if (json_file != NULL && fclose(b.json) != 0) {
        fprintf(stderr, PROG ": %s: %s\n", json_file, strerror(errno));
        return 1;
    }
    if (b.failures > 0) {
        fprintf(stderr, PROG ": %d point%s failed (see above)%s\n", b.failures, b.failures == 1 ? "" : "s",
                spd.keep ? "" : "; --keep leaves spd's log");
        return 1;
    }
    return 0;
}
