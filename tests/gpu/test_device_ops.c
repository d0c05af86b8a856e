/*
 * Ops on device regions through a real spd, P = 2 and 4 rank processes on one
 * GPU, each with its own cudaMalloc'd buffers registered with
 * spc_register_device; every result copied back and compared bit for bit with
 * the host references (kernels/host) computed here from every rank's inputs:
 *
 *   alltoall   seq->head and back: fp32 with padding rows and dummy heads; bf16
 *              GQA (q and k in one op, KV replicated when P exceeds its heads);
 *              GatedDeltaNet's q, k, v, beta and gate in one op (fp32, two head
 *              counts padded with dummy heads, beta and gate of head dim 1);
 *              eight bf16 tensors, KV ones replicated;
 *   shift      cyclic and linear;
 *   allreduce  fp32 and fp64 sums (fp64 in place); fp16 and bf16 through fp32,
 *              arbitrary bit patterns;
 *   reduce_scatter  fp32 sum, bf16 max, fp16 sum (16-bit: arbitrary bit
 *              patterns): block r of the rank-order fold, through fp32;
 *   alltoallv  counts of their own per pair of ranks, empty blocks, and with
 *              P = 4 a rank that sends and receives nothing;
 *   allgather, broadcast;
 *   refusals   a mix of host and device tensors, naming the rank; an fp64
 *              tensor off its 8-byte alignment (fp32 at the same byte then
 *              runs, right: the GPU path is unharmed);
 *   reuse      an allocation freed and made again at the same address, registered
 *              again: the daemon re-imports it and the op sees the new memory;
 *   death      a rank killed while the others wait in a device op: they get
 *              PEER_LOST, its imports close, the daemon keeps serving.
 *
 * Needs a GPU; without one it says why and exits 77 (skipped).
 */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sp_gpu_regions.h"
#include "sp_gpu_alltoallv.h"
#include "sp_kern_cases.h"
#include "sp_kern_cuda.h"

/* ================================================================ all-to-all */

#define MAXT SPC_A2A_MAX_TENSORS

typedef struct a2a_case {
    const char *name;
    spc_dtype_t dtype;
    uint32_t batch, seq_len, kv_heads, ntensors;
    uint32_t heads[MAXT], head_dim[MAXT], kind[MAXT];
} a2a_case_t;

#define Q_ SPC_HEADS_Q
#define KV SPC_HEADS_KV
static const a2a_case_t a2a_cases[] = {
    { "fp32, padding rows, dummy heads", SPC_F32, 2, 13, 0, 1, { 6 }, { 8 }, { Q_ } },
    { "bf16 GQA q+k, KV replicated past 2 ranks", SPC_BF16, 1, 16, 2, 2, { 8, 2 }, { 16, 8 }, { Q_, KV } },
    { "fp32 GatedDeltaNet q, k, v, beta, gate", SPC_F32, 2, 13, 0, 5, { 5, 5, 10, 10, 10 }, { 8, 8, 16, 1, 1 },
      { Q_, Q_, Q_, Q_, Q_ } },
    { "bf16 eight tensors, KV replicated", SPC_BF16, 1, 11, 2, 8, { 8, 2, 2, 8, 6, 4, 2, 1 },
      { 8, 8, 4, 1, 2, 16, 1, 8 }, { Q_, KV, KV, Q_, Q_, Q_, KV, KV } },
};
#undef Q_
#undef KV

/* Tensor i of a descriptor: the first four in tensors, the rest in more_tensors. */
static spc_a2a_tensor_t *desc_tensor(spc_alltoall_desc_t *d, uint32_t i)
{
    return i < 4 ? &d->tensors[i] : &d->more_tensors[i - 4];
}

static sp_kern_a2a_desc_t kdesc(const a2a_case_t *c, uint32_t i, uint32_t dir, uint32_t P)
{
    return (sp_kern_a2a_desc_t){ dir, SP_KERN_BSHD, c->batch, c->seq_len, c->heads[i], c->head_dim[i], c->kind[i],
                                 c->kv_heads, P, (uint32_t)c->dtype, 0 };
}

static void test_a2a(spc_handle_t *h, spc_group_t world, int rank, int P, const a2a_case_t *c, int tag)
{
    void *dseq[MAXT], *dhead[MAXT], *dback[MAXT];
    spc_region_t rs[MAXT], rh[MAXT], rb[MAXT];
    uint8_t *want_head[MAXT][8], *want_back[MAXT];
    uint64_t seq_bytes[MAXT], head_bytes[MAXT];

    for (uint32_t i = 0; i < c->ntensors; i++) {
        sp_kern_a2a_desc_t s2h = kdesc(c, i, SP_KERN_SEQ_TO_HEAD, (uint32_t)P);
        sp_kern_a2a_desc_t h2s = kdesc(c, i, SP_KERN_HEAD_TO_SEQ, (uint32_t)P);
        sp_kern_a2a_geom_t g;
        CHECK_EQ(sp_kern_a2a_geom(&g, &s2h, (uint32_t)rank), 0);
        seq_bytes[i] = sp_kern_a2a_src_bytes(&g);
        head_bytes[i] = sp_kern_a2a_out_bytes(&g);
        /* Every rank's inputs, made here from its seed, and every rank's head side. */
        uint8_t *in[8];
        for (int q = 0; q < P; q++) {
            uint64_t st = seed_of(q, tag * 8 + (int)i);
            in[q] = malloc(seq_bytes[i]);
            sp_kern_fill(in[q], seq_bytes[i], &st);
        }
        for (int q = 0; q < P; q++) {
            want_head[i][q] = malloc(head_bytes[i]);
            CHECK_EQ(sp_kern_a2a_host(want_head[i][q], (const void *const *)in, &s2h, (uint32_t)q), 0);
        }
        want_back[i] = malloc(seq_bytes[i]);
        CHECK_EQ(sp_kern_a2a_host(want_back[i], (const void *const *)want_head[i], &h2s, (uint32_t)rank), 0);
        dseq[i] = dev_put(h, in[rank], seq_bytes[i], &rs[i]);
        dhead[i] = dev_put(h, NULL, head_bytes[i], &rh[i]);
        dback[i] = dev_put(h, NULL, seq_bytes[i], &rb[i]);
        for (int q = 0; q < P; q++)
            free(in[q]);
    }
    spc_alltoall_desc_t d = { .struct_size = sizeof d, .group = world, .dtype = c->dtype,
                              .direction = SPC_SEQ_TO_HEAD, .layout = SPC_LAYOUT_BSHD, .batch = c->batch,
                              .seq_len = c->seq_len, .kv_heads = c->kv_heads, .ntensors = c->ntensors };
    for (uint32_t i = 0; i < c->ntensors; i++)
        *desc_tensor(&d, i) = (spc_a2a_tensor_t){ dseq[i], dhead[i], c->heads[i], c->head_dim[i], c->kind[i], 0 };
    CHECK_OK(h, spc_alltoall(h, &d, 30000));
    char what[160];
    for (uint32_t i = 0; i < c->ntensors; i++) {
        snprintf(what, sizeof what, "alltoall seq->head, %s, tensor %u, P %d", c->name, i, P);
        dev_check(dhead[i], want_head[i][rank], head_bytes[i], what, rank);
    }
    d.direction = SPC_HEAD_TO_SEQ;
    for (uint32_t i = 0; i < c->ntensors; i++)
        *desc_tensor(&d, i) = (spc_a2a_tensor_t){ dhead[i], dback[i], c->heads[i], c->head_dim[i], c->kind[i], 0 };
    CHECK_OK(h, spc_alltoall(h, &d, 30000));
    for (uint32_t i = 0; i < c->ntensors; i++) {
        snprintf(what, sizeof what, "alltoall head->seq, %s, tensor %u, P %d", c->name, i, P);
        dev_check(dback[i], want_back[i], seq_bytes[i], what, rank);
        dev_drop(h, dseq[i], rs[i]);
        dev_drop(h, dhead[i], rh[i]);
        dev_drop(h, dback[i], rb[i]);
        for (int q = 0; q < P; q++)
            free(want_head[i][q]);
        free(want_back[i]);
    }
}

/* ================================================================ shift, collectives */

static void test_shift(spc_handle_t *h, spc_group_t world, int rank, int P, uint32_t flags)
{
    const uint64_t n = 4096 + 12;
    uint8_t *mine = malloc(n), *want = calloc(1, n);
    uint64_t st = seed_of(rank, 100), sp = seed_of((rank + P - 1) % P, 100);
    sp_kern_fill(mine, n, &st);
    if (!((flags & SPC_SHIFT_LINEAR) && rank == 0))
        sp_kern_fill(want, n, &sp);
    spc_region_t rs, rr;
    void *ds = dev_put(h, mine, n, &rs), *dr = dev_put(h, NULL, n, &rr);
    spc_shift_desc_t d = { .struct_size = sizeof d, .group = world, .flags = flags, .ntensors = 1 };
    d.tensors[0].send = ds;
    d.tensors[0].recv = dr;
    d.tensors[0].bytes = n;
    CHECK_OK(h, spc_shift(h, &d, 30000));
    dev_check(dr, want, n, flags ? "linear shift" : "cyclic shift", rank);
    dev_drop(h, ds, rs);
    dev_drop(h, dr, rr);
    free(mine);
    free(want);
}

/* Finite values whose rank-order sums are exact neither in fp32 nor trivially. */
static void fill_values(void *p, uint64_t n, spc_dtype_t dt, int rank)
{
    for (uint64_t i = 0; i < n; i++) {
        double v = ((double)((i * 2654435761u + (uint64_t)rank * 97u) % 100003u) - 50000.0) / 7.0;
        if (dt == SPC_F32)
            ((float *)p)[i] = (float)v;
        else
            ((double *)p)[i] = v;
    }
}

static void test_allreduce(spc_handle_t *h, spc_group_t world, int rank, int P, spc_dtype_t dt, bool in_place)
{
    const uint64_t n = 100000 + 3;
    const size_t es = dt == SPC_F32 ? 4 : 8;
    uint8_t *x = malloc(n * es), *acc = malloc(n * es);
    fill_values(acc, n, dt, 0);
    for (int q = 1; q < P; q++) {
        fill_values(x, n, dt, q);
        CHECK_EQ(sp_kern_reduce(acc, x, n, (unsigned)dt, SP_KERN_SUM), 0);
    }
    fill_values(x, n, dt, rank);
    spc_region_t rs, rr;
    void *ds = dev_put(h, x, n * es, &rs), *dr = ds;
    if (!in_place)
        dr = dev_put(h, NULL, n * es, &rr);
    CHECK_OK(h, spc_allreduce(h, world, ds, dr, n, dt, SPC_SUM, 30000));
    dev_check(dr, acc, n * es, dt == SPC_F32 ? "allreduce fp32" : "allreduce fp64 in place", rank);
    dev_drop(h, ds, rs);
    if (!in_place)
        dev_drop(h, dr, rr);
    free(x);
    free(acc);
}

/* fp16 and bf16: arbitrary bit patterns (NaNs and infinities among them) folded
 * in fp32 in rank order and rounded once, on the GPU as the host reference does. */
static void test_allreduce16(spc_handle_t *h, spc_group_t world, int rank, int P, spc_dtype_t dt, spc_redop_t op)
{
    const uint64_t n = 50000 + 1;
    uint8_t *x = malloc(n * 2), *want = malloc(n * 2);
    float *acc = malloc(n * sizeof *acc);
    for (int q = 0; q < P; q++) {
        uint64_t st = seed_of(q, 300 + (int)dt * 10 + (int)op);
        sp_kern_fill(x, n * 2, &st);
        if (q == 0)
            CHECK_EQ(sp_kern_widen(acc, x, n, (unsigned)dt), 0);
        else
            CHECK_EQ(sp_kern_reduce_widen(acc, x, n, (unsigned)dt, (unsigned)op), 0);
    }
    CHECK_EQ(sp_kern_narrow(want, acc, n, (unsigned)dt), 0);
    uint64_t st = seed_of(rank, 300 + (int)dt * 10 + (int)op);
    sp_kern_fill(x, n * 2, &st);
    spc_region_t rs, rr;
    void *ds = dev_put(h, x, n * 2, &rs), *dr = dev_put(h, NULL, n * 2, &rr);
    CHECK_OK(h, spc_allreduce(h, world, ds, dr, n, dt, op, 30000));
    dev_check(dr, want, n * 2, dt == SPC_BF16 ? "allreduce bf16" : "allreduce fp16", rank);
    dev_drop(h, ds, rs);
    dev_drop(h, dr, rr);
    free(x);
    free(want);
    free(acc);
}

/* fp32: finite values, as test_allreduce's; 16-bit: arbitrary bit patterns. */
static void rs_fill(void *x, uint64_t n, spc_dtype_t dt, spc_redop_t op, int rank)
{
    if (dt == SPC_F32) {
        fill_values(x, n, dt, rank);
        return;
    }
    uint64_t st = seed_of(rank, 400 + (int)dt * 10 + (int)op);
    sp_kern_fill(x, n * 2, &st);
}

/* Rank `rank` receives block `rank` of the fold of every rank's P blocks. */
static void test_reduce_scatter(spc_handle_t *h, spc_group_t world, int rank, int P, spc_dtype_t dt, spc_redop_t op)
{
    const uint64_t count = 20000 + 1, es = dt == SPC_F32 ? 4 : 2, n = count * (uint64_t)P;
    const bool widen = dt != SPC_F32;
    uint8_t *x = malloc(n * es), *want = malloc(n * es);
    float *acc = malloc(n * sizeof *acc);
    for (int q = 0; q < P; q++) {
        rs_fill(x, n, dt, op, q);
        if (q == 0 && widen)
            CHECK_EQ(sp_kern_widen(acc, x, n, (unsigned)dt), 0);
        else if (q == 0)
            memcpy(want, x, n * es);
        else if (widen)
            CHECK_EQ(sp_kern_reduce_widen(acc, x, n, (unsigned)dt, (unsigned)op), 0);
        else
            CHECK_EQ(sp_kern_reduce(want, x, n, (unsigned)dt, (unsigned)op), 0);
    }
    if (widen)
        CHECK_EQ(sp_kern_narrow(want, acc, n, (unsigned)dt), 0);
    rs_fill(x, n, dt, op, rank);
    spc_region_t rs, rr;
    void *ds = dev_put(h, x, n * es, &rs), *dr = dev_put(h, NULL, count * es, &rr);
    CHECK_OK(h, spc_reduce_scatter(h, world, ds, dr, count, dt, op, 30000));
    dev_check(dr, want + (uint64_t)rank * count * es, count * es, "reduce_scatter", rank);
    dev_drop(h, ds, rs);
    dev_drop(h, dr, rr);
    free(x);
    free(want);
    free(acc);
}

static void test_gather_bcast(spc_handle_t *h, spc_group_t world, int rank, int P)
{
    const uint64_t count = 257, n = count * 4;
    uint8_t *all = malloc(n * (uint64_t)P);
    for (int q = 0; q < P; q++) {
        uint64_t st = seed_of(q, 200);
        sp_kern_fill(all + n * (uint64_t)q, n, &st);
    }
    spc_region_t rs, rr;
    void *ds = dev_put(h, all + n * (uint64_t)rank, n, &rs), *dr = dev_put(h, NULL, n * (uint64_t)P, &rr);
    CHECK_OK(h, spc_allgather(h, world, ds, dr, count, SPC_F32, 30000));
    dev_check(dr, all, n * (uint64_t)P, "allgather", rank);
    /* Broadcast from rank 1: the others' buffers start out as their own data. */
    CHECK_OK(h, spc_broadcast(h, world, ds, count, SPC_F32, 1, 30000));
    dev_check(ds, all + n, n, "broadcast from rank 1", rank);
    dev_drop(h, ds, rs);
    dev_drop(h, dr, rr);
    free(all);
}

/* A host tensor beside a device one: refused before any byte moves, every rank
 * told which rank. */
static void test_refusals(spc_handle_t *h, spc_group_t world, int rank, int P)
{
    const uint64_t count = 64;
    spc_region_t rs, rr;
    void *ds = dev_put(h, NULL, count * 4, &rs);
    float *host = spc_alloc(h, count * 4);
    void *recv = host;
    if (rank != P - 1)
        recv = dev_put(h, NULL, count * 4, &rr);
    CHECK(spc_allreduce(h, world, ds, recv, count, SPC_F32, SPC_SUM, 30000) != SPC_OK);
    char who[40];
    snprintf(who, sizeof who, "rank %d's request was refused", P - 1);
    if (rank != P - 1)
        CHECK_CONTAINS(spc_last_error(h), who);
    CHECK_CONTAINS(spc_last_error(h), "mixes memories");
    if (rank != P - 1)
        dev_drop(h, recv, rr);
    spc_free(h, host);
    dev_drop(h, ds, rs);
}

/* An fp64 tensor at byte 4 of its allocation: refused before a kernel could
 * load a misaligned element (a fault would poison the context spd shares with
 * every client of the GPU). fp32 at that byte is aligned and runs, right. */
static void test_misaligned(spc_handle_t *h, spc_group_t world, int rank, int P)
{
    const uint64_t count = 64, n = count * 8 + 8;
    spc_region_t r;
    uint8_t *d = dev_put(h, NULL, n, &r);
    uint8_t *x = rank == P - 1 ? d + 4 : d + 8;
    spc_status_t st = spc_allreduce(h, world, x, x, count, SPC_F64, SPC_SUM, 30000);
    if (rank == P - 1) {
        CHECK_EQ(st, SPC_ERR_INVALID_ARG);
        CHECK_CONTAINS(spc_last_error(h), "not aligned to its 8-byte fp64 elements");
    } else {
        CHECK(st != SPC_OK);
        char who[40];
        snprintf(who, sizeof who, "rank %d's request was refused", P - 1);
        CHECK_CONTAINS(spc_last_error(h), who);
    }
    float *v = malloc(count * 4), *want = malloc(count * 4);
    for (uint64_t i = 0; i < count; i++) {
        v[i] = (float)((rank + 1) * 100 + (int)i);
        want[i] = (float)(P * (P + 1) / 2 * 100 + P * (int)i);
    }
    dev_write(d + 4, v, count * 4);
    CHECK_OK(h, spc_allreduce(h, world, d + 4, d + 4, count, SPC_F32, SPC_SUM, 30000));
    dev_check(d + 4, want, count * 4, "fp32 allreduce at byte 4 after a misaligned fp64 one", rank);
    dev_drop(h, d, r);
    free(v);
    free(want);
}

/* ================================================================ allocator reuse */

static void test_reuse(spc_handle_t *h, spc_group_t world, int rank, int P)
{
    const uint64_t count = 1 << 16, n = count * 4;
    float *x = malloc(n), *want = malloc(n);
    for (uint64_t i = 0; i < count; i++)
        x[i] = (float)(rank + 1);
    void *a, *b;
    spc_region_t ra, rb;
    CUDA_CHECK(cudaMalloc(&a, n));
    CUDA_CHECK(cudaMemset(a, 0, n));
    CUDA_CHECK(cudaDeviceSynchronize());
    CHECK_OK(h, spc_register_device(h, a, n, &ra));
    CHECK_OK(h, spc_allreduce(h, world, a, a, count, SPC_F32, SPC_SUM, 30000));
    /* Freed without deregistering, as a caching allocator's user would. */
    CUDA_CHECK(cudaFree(a));
    CUDA_CHECK(cudaMalloc(&b, n));
    if (b != a)
        SP_FAIL("rank %d: cudaMalloc did not reuse %p (got %p): the reuse case cannot be made here", rank, a, b);
    dev_write(b, x, n);
    int64_t before = sp_test_status_int(h, "gpu_reimports");
    CHECK_OK(h, spc_register_device(h, b, n, &rb));
    CHECK(sp_test_status_int(h, "gpu_reimports") > before);
    CHECK_OK(h, spc_allreduce(h, world, b, b, count, SPC_F32, SPC_SUM, 30000));
    for (uint64_t i = 0; i < count; i++)
        want[i] = (float)(P * (P + 1) / 2);
    dev_check(b, want, n, "allreduce on a reused address", rank);
    dev_drop(h, b, rb);
    free(x);
    free(want);
}

static int rank_main(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    CUDA_CHECK(cudaSetDevice(0));
    for (size_t i = 0; i < sizeof a2a_cases / sizeof a2a_cases[0]; i++)
        test_a2a(h, world, rank, P, &a2a_cases[i], (int)i);
    test_shift(h, world, rank, P, 0);
    test_shift(h, world, rank, P, SPC_SHIFT_LINEAR);
    test_allreduce(h, world, rank, P, SPC_F32, false);
    test_allreduce(h, world, rank, P, SPC_F64, true);
    test_allreduce16(h, world, rank, P, SPC_BF16, SPC_SUM);
    test_allreduce16(h, world, rank, P, SPC_F16, SPC_SUM);
    test_allreduce16(h, world, rank, P, SPC_BF16, SPC_MAX);
    test_reduce_scatter(h, world, rank, P, SPC_F32, SPC_SUM);
    test_reduce_scatter(h, world, rank, P, SPC_BF16, SPC_MAX);
    test_reduce_scatter(h, world, rank, P, SPC_F16, SPC_SUM);
    dev_alltoallv(h, world, rank, P, 0);
    dev_alltoallv(h, world, rank, P, 2);
    test_gather_bcast(h, world, rank, P);
    test_refusals(h, world, rank, P);
    test_misaligned(h, world, rank, P);
    test_reuse(h, world, rank, P);
    return 0;
}

/* ================================================================ a rank dies */

static char job_id[SPC_JOB_ID_MAX];

static int death_main(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, 3, (uint32_t)rank, 20000, &world));
    CUDA_CHECK(cudaSetDevice(0));
    spc_region_t r;
    void *d = dev_put(h, NULL, 1 << 20, &r);
    if (rank == 2) {
        /* Dies once both others wait in their device op. */
        if (!sp_test_wait_status(h, "ops_inflight", 2, 20000))
            SP_FAIL("the other ranks' ops never arrived");
        raise(SIGKILL);
    }
    CHECK_ST(h, spc_allreduce(h, world, d, d, 1 << 18, SPC_F32, SPC_SUM, 30000), SPC_ERR_PEER_LOST);
    CHECK_CONTAINS(spc_last_error(h), "rank 2");
    dev_drop(h, d, r);
    spc_detach(h);
    return 0;
}

static void test_death(void)
{
    spc_handle_t *q = sp_test_attach();
    CHECK_OK(q, spc_job_create(q, job_id, sizeof job_id));
    pid_t pids[3];
    for (int r = 0; r < 3; r++)
        pids[r] = sp_test_fork(death_main, (void *)(intptr_t)r);
    CHECK_EQ(sp_test_wait(pids[2], 60000), -SIGKILL);
    sp_test_wait_all_ok(pids, 2, 60000);
    /* Every import is closed: the dead rank's with its client, the others' with
     * their deregistrations. */
    if (!sp_test_wait_status(q, "gpu_imports", 0, 5000))
        SP_FAIL("imports still open after every rank left: %" PRId64, sp_test_status_int(q, "gpu_imports"));
    printf("death: imports ever %" PRId64 ", open %" PRId64 ", re-imports %" PRId64 "\n",
           sp_test_status_int(q, "gpu_imports_total"), sp_test_status_int(q, "gpu_imports"), sp_test_status_int(q, "gpu_reimports"));
    spc_detach(q);
}

/* Whether a GPU is usable, asked in a child: CUDA must not start in this
 * process before it forks the ranks. */
int main(void)
{
    if (sp_gpu_test_probe() == SP_TEST_SKIP)
        return SP_TEST_SKIP;

    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    for (int P = 2; P <= 4; P += 2) {
        sp_test_run_job(P, rank_main, NULL);
        printf("P = %d: alltoall (fp32 dummy heads, bf16 GQA, GatedDeltaNet's five, eight bf16), shift, allreduce (fp32, fp64, fp16, bf16), "
               "reduce_scatter (fp32, bf16, fp16), alltoallv, allgather, "
               "broadcast, refusals (mixed memories, misaligned fp64), reuse: bit for bit\n", P);
    }
    test_death();
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    char out[256];
    CHECK_EQ(sp_test_run(out, sizeof out, "grep -c 'freed and reused' %s", d.log), 0);
    printf("daemon log lines on reused addresses: %s", out);
    CHECK_EQ(sp_test_run(out, sizeof out, "grep -c 'closed the import' %s", d.log), 0);
    printf("daemon log lines on closed imports: %s", out);
    sp_test_daemon_cleanup(&d);
    printf("device_ops: ok\n");
    return 0;
}
