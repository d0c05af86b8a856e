/*
 * sp_xdev_cases.h — device ops across daemons, each result checked byte for
 * byte against a host reference computed here from every rank's inputs
 * (kernels/host): the cases test_nccl_nodes (a GPU and NCCL) and
 * test_nccl_stub (the stand-in driver and NCCL) both run, each rank calling
 * them with its group over P ranks:
 *
 *   run_a2a_cases     alltoall seq->head and back, every case of
 *                     sp_kern_cases.h for this P, q+k in one op, and
 *                     GatedDeltaNet's five tensors in one op;
 *   test_shift        cyclic, linear, reversed with two tensors, on a channel;
 *   test_allreduce    fp32, fp64 (in place or not), folded in rank order;
 *   test_allreduce16  fp16 and bf16 through fp32, any reduction;
 *   test_gather_bcast allgather, broadcast from the last rank and from rank 0.
 *
 * The includer first defines the device memory they run on: dev_put,
 * dev_write, dev_check, dev_drop and seed_of (tests/gpu/sp_gpu_regions.h on a
 * GPU, tests/stubcuda/sp_stub_regions.h on the stand-in).
 */
#ifndef SP_XDEV_CASES_H
#define SP_XDEV_CASES_H

#include "sp_kern.h"
#include "sp_kern_cases.h"

#define SP_XDEV_MAXP 4
#define SP_XDEV_TMO  60000

/* ================================================================ all-to-all */

/* One all-to-all of up to SPC_A2A_MAX_TENSORS tensors, there and back. */
typedef struct a2a_case {
    const char *name;
    uint32_t    dtype, layout, batch, seq_len, kv_heads, ntensors;
    uint32_t    heads[SPC_A2A_MAX_TENSORS], head_dim[SPC_A2A_MAX_TENSORS], kind[SPC_A2A_MAX_TENSORS], flags[SPC_A2A_MAX_TENSORS];
} a2a_case_t;

/* Tensor i of a descriptor: the first four in tensors, the rest in more_tensors. */
static spc_a2a_tensor_t *desc_tensor(spc_alltoall_desc_t *d, uint32_t i)
{
    return i < 4 ? &d->tensors[i] : &d->more_tensors[i - 4];
}

static sp_kern_a2a_desc_t kdesc(const a2a_case_t *c, uint32_t i, uint32_t direction, uint32_t P)
{
    return (sp_kern_a2a_desc_t){ direction, c->layout, c->batch, c->seq_len, c->heads[i], c->head_dim[i], c->kind[i],
                                 c->kv_heads, P, c->dtype, direction == SP_KERN_HEAD_TO_SEQ ? c->flags[i] : 0 };
}

/* Whether every tensor of c can be dealt to P ranks (the daemon refuses the rest). */
static bool a2a_valid(const a2a_case_t *c, uint32_t P)
{
    for (uint32_t i = 0; i < c->ntensors; i++) {
        sp_kern_a2a_geom_t g;
        sp_kern_a2a_desc_t s2h = kdesc(c, i, SP_KERN_SEQ_TO_HEAD, P), h2s = kdesc(c, i, SP_KERN_HEAD_TO_SEQ, P);
        if (sp_kern_a2a_geom(&g, &s2h, 0) != 0 || sp_kern_a2a_geom(&g, &h2s, 0) != 0)
            return false;
    }
    return true;
}

static void test_a2a(spc_handle_t *h, spc_group_t world, int rank, int P, const a2a_case_t *c, int tag)
{
    void *dseq[SPC_A2A_MAX_TENSORS], *dhead[SPC_A2A_MAX_TENSORS], *dback[SPC_A2A_MAX_TENSORS];
    spc_region_t rs[SPC_A2A_MAX_TENSORS], rh[SPC_A2A_MAX_TENSORS], rb[SPC_A2A_MAX_TENSORS];
    uint8_t *want_head[SPC_A2A_MAX_TENSORS][SP_XDEV_MAXP], *want_back[SPC_A2A_MAX_TENSORS];
    uint64_t seq_bytes[SPC_A2A_MAX_TENSORS], head_bytes[SPC_A2A_MAX_TENSORS];

    for (uint32_t i = 0; i < c->ntensors; i++) {
        sp_kern_a2a_desc_t s2h = kdesc(c, i, SP_KERN_SEQ_TO_HEAD, (uint32_t)P);
        sp_kern_a2a_desc_t h2s = kdesc(c, i, SP_KERN_HEAD_TO_SEQ, (uint32_t)P);
        sp_kern_a2a_geom_t g;
        CHECK_EQ(sp_kern_a2a_geom(&g, &s2h, (uint32_t)rank), 0);
        seq_bytes[i] = sp_kern_a2a_src_bytes(&g);
        head_bytes[i] = sp_kern_a2a_out_bytes(&g);
        uint8_t *in[SP_XDEV_MAXP];
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
    spc_alltoall_desc_t d = { .struct_size = sizeof d, .group = world, .dtype = (spc_dtype_t)c->dtype,
                              .direction = SPC_SEQ_TO_HEAD, .layout = c->layout, .batch = c->batch,
                              .seq_len = c->seq_len, .kv_heads = c->kv_heads, .ntensors = c->ntensors };
    for (uint32_t i = 0; i < c->ntensors; i++)
        *desc_tensor(&d, i) = (spc_a2a_tensor_t){ dseq[i], dhead[i], c->heads[i], c->head_dim[i], c->kind[i], 0 };
    CHECK_OK(h, spc_alltoall(h, &d, SP_XDEV_TMO));
    char what[160];
    for (uint32_t i = 0; i < c->ntensors; i++) {
        snprintf(what, sizeof what, "alltoall seq->head, %s, tensor %u, P %d", c->name, i, P);
        dev_check(dhead[i], want_head[i][rank], head_bytes[i], what, rank);
    }
    d.direction = SPC_HEAD_TO_SEQ;
    for (uint32_t i = 0; i < c->ntensors; i++)
        *desc_tensor(&d, i) = (spc_a2a_tensor_t){ dhead[i], dback[i], c->heads[i], c->head_dim[i], c->kind[i],
                                                  c->flags[i] };
    CHECK_OK(h, spc_alltoall(h, &d, SP_XDEV_TMO));
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

/* Every case of sp_kern_cases.h for this P, then q and k in one op, and GatedDeltaNet's five. */
static int run_a2a_cases(spc_handle_t *h, spc_group_t world, int rank, int P)
{
    int ran = 0;
    for (size_t k = 0; k < SP_KERN_NCASES; k++) {
        const sp_kern_case_t *kc = &sp_kern_cases[k];
        if ((int)kc->ranks != P)
            continue;
        a2a_case_t c = { kc->name, kc->dtype, kc->layout, kc->batch, kc->seq_len, kc->kv_heads, 1,
                         { kc->heads }, { kc->head_dim }, { kc->kind }, { kc->flags } };
        if (!a2a_valid(&c, (uint32_t)P))
            continue;
        test_a2a(h, world, rank, P, &c, (int)k);
        ran++;
    }
    const a2a_case_t qk = { "bf16 GQA q+k, KV replicated past 2 ranks", SPC_BF16, SP_KERN_BSHD, 1, 16, 2, 2,
                            { 8, 2 }, { 16, 8 }, { SPC_HEADS_Q, SPC_HEADS_KV }, { 0, SPC_A2A_SUM_REPLICAS } };
    if (a2a_valid(&qk, (uint32_t)P)) {
        test_a2a(h, world, rank, P, &qk, 100);
        ran++;
    }
    /* k has 2 heads: replicated on 4 ranks, 1 per rank on 2; q's 5 heads take dummies on 2 and 4, v's 10 on 4. */
    const a2a_case_t gdn = { "fp32 GatedDeltaNet q, k, v, beta, gate", SPC_F32, SP_KERN_SBHD, 2, 13, 0, 5,
                             { 5, 2, 10, 10, 10 }, { 8, 8, 16, 1, 1 },
                             { SPC_HEADS_Q, SPC_HEADS_KV, SPC_HEADS_Q, SPC_HEADS_Q, SPC_HEADS_Q },
                             { 0, SPC_A2A_SUM_REPLICAS, 0, 0, 0 } };
    if (a2a_valid(&gdn, (uint32_t)P)) {
        test_a2a(h, world, rank, P, &gdn, 101);
        ran++;
    }
    return ran;
}

/* ================================================================ shift, collectives */

static void test_shift(spc_handle_t *h, spc_group_t world, int rank, int P, uint32_t channel, uint32_t flags,
                       uint32_t ntensors)
{
    const uint64_t sizes[2] = { 4096 + 12, 1000 + 3 };
    void *ds[2], *dr[2];
    spc_region_t rs[2], rr[2];
    uint8_t *want[2];
    int from = flags & SPC_SHIFT_REVERSE ? (rank + 1) % P : (rank + P - 1) % P;
    bool edge = (flags & SPC_SHIFT_LINEAR) && (flags & SPC_SHIFT_REVERSE ? rank == P - 1 : rank == 0);
    spc_shift_desc_t d = { .struct_size = sizeof d, .group = world, .channel = channel, .flags = flags,
                           .ntensors = ntensors };
    for (uint32_t i = 0; i < ntensors; i++) {
        uint64_t n = sizes[i];
        uint8_t *mine = malloc(n);
        uint64_t st = seed_of(rank, 100 + (int)i), sf = seed_of(from, 100 + (int)i);
        sp_kern_fill(mine, n, &st);
        want[i] = calloc(1, n);
        if (!edge)
            sp_kern_fill(want[i], n, &sf);
        ds[i] = dev_put(h, mine, n, &rs[i]);
        dr[i] = dev_put(h, NULL, n, &rr[i]);
        d.tensors[i].send = ds[i];
        d.tensors[i].recv = dr[i];
        d.tensors[i].bytes = n;
        free(mine);
    }
    CHECK_OK(h, spc_shift(h, &d, SP_XDEV_TMO));
    for (uint32_t i = 0; i < ntensors; i++) {
        char what[96];
        snprintf(what, sizeof what, "shift (channel %u, flags 0x%x) tensor %u", channel, flags, i);
        dev_check(dr[i], want[i], sizes[i], what, rank);
        dev_drop(h, ds[i], rs[i]);
        dev_drop(h, dr[i], rr[i]);
        free(want[i]);
    }
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
    CHECK_OK(h, spc_allreduce(h, world, ds, dr, n, dt, SPC_SUM, SP_XDEV_TMO));
    dev_check(dr, acc, n * es, dt == SPC_F32 ? "allreduce fp32" : "allreduce fp64 in place", rank);
    dev_drop(h, ds, rs);
    if (!in_place)
        dev_drop(h, dr, rr);
    free(x);
    free(acc);
}

/* fp16 and bf16: arbitrary bit patterns folded in fp32 in rank order, rounded once. */
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
    CHECK_OK(h, spc_allreduce(h, world, ds, dr, n, dt, op, SP_XDEV_TMO));
    dev_check(dr, want, n * 2, dt == SPC_BF16 ? "allreduce bf16" : "allreduce fp16", rank);
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
    CHECK_OK(h, spc_allgather(h, world, ds, dr, count, SPC_F32, SP_XDEV_TMO));
    dev_check(dr, all, n * (uint64_t)P, "allgather", rank);
    /* From the last rank (node-1's), then from rank 0 (node-0's). */
    CHECK_OK(h, spc_broadcast(h, world, ds, count, SPC_F32, (uint32_t)(P - 1), SP_XDEV_TMO));
    dev_check(ds, all + n * (uint64_t)(P - 1), n, "broadcast from the last rank", rank);
    dev_write(ds, all + n * (uint64_t)rank, n);
    CHECK_OK(h, spc_broadcast(h, world, ds, count, SPC_F32, 0, SP_XDEV_TMO));
    dev_check(ds, all, n, "broadcast from rank 0", rank);
    dev_drop(h, ds, rs);
    dev_drop(h, dr, rr);
    free(all);
}

#endif /* SP_XDEV_CASES_H */
