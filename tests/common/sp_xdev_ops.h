/*
 * sp_xdev_ops.h — one device op of each kind across daemons, each rank's
 * output checked byte for byte against a host reference computed here from
 * every rank's inputs: allreduce (fp32, exact), allgather, reduce-scatter,
 * cyclic shift, broadcast from rank 1, alltoall seq->head and back (the
 * second reading the first's output), run host-synchronous (sops_sync) and
 * in the order of a CUDA stream of each rank (sops_stream): there each input
 * is copied in on the stream and each output copied out on it, one rank's
 * stream stalled 20 ms before each op, nothing waited for on the host until
 * the end, so an op that ran before a rank's ready would read an old input,
 * and a done written before an output would let the copy read an old result.
 * test_nccl_gpus_stub (the stand-in driver and NCCL) and test_nccl_gpus (GPUs
 * and NCCL) run them over ranks on several GPUs of each daemon.
 *
 * The includer first defines the device memory and streams they run on:
 * dev_put, dev_write, dev_check, dev_drop, seed_of, stream_make, stream_stall,
 * stream_copy_in, stream_copy_out, stream_destroy, host_pinned, host_unpin
 * (tests/gpu/sp_gpu_regions.h
 * on a GPU, tests/stubcuda/sp_stub_regions.h on the stand-in), and includes
 * sp_xdev_cases.h.
 */
#ifndef SP_XDEV_OPS_H
#define SP_XDEV_OPS_H

#include "sp_kern.h"
#include "sp_kern_cases.h"

enum { S_ALLREDUCE, S_ALLGATHER, S_REDUCE_SCATTER, S_SHIFT, S_BROADCAST, S_S2H, S_H2S, S_N };

#define SOP_BCAST_ROOT 1   /* with two ranks a daemon, the first daemon's second: off its NCCL GPU */

/* One op of this rank: its input (copied into `in` before the op; NULL for
 * the head->seq all-to-all, which reads the seq->head one's output), its
 * output (`out`; the broadcast's is its buffer), and what the output must
 * hold. */
typedef struct sop {
    const char  *what;
    void        *in, *out;         /* device */
    spc_region_t rin, rout;
    uint8_t     *src, *want;       /* host */
    uint64_t     in_bytes, out_bytes;
} sop_t;

/* Rank q's n bytes for op `tag`. */
static uint8_t *sop_bytes(int q, int tag, uint64_t n)
{
    uint8_t *p = malloc(n + 1);
    uint64_t st = seed_of(q, tag);
    CHECK(p != NULL);
    sp_kern_fill(p, n, &st);
    return p;
}

/* Rank q's n floats for op `tag`: small integers, so every sum is exact. */
static float *sop_ints(int q, int tag, uint64_t n)
{
    float *p = malloc(n * sizeof *p + 1);
    CHECK(p != NULL);
    for (uint64_t i = 0; i < n; i++)
        p[i] = (float)((q + 1) * 100 + tag) + (float)(i % 13);
    return p;
}

/* The first all-to-all case of sp_kern_cases.h for P ranks, both ways. */
static const sp_kern_case_t *sop_a2a_case(int P)
{
    for (size_t k = 0; k < SP_KERN_NCASES; k++)
        if ((int)sp_kern_cases[k].ranks == P && strncmp(sp_kern_cases[k].name, "large", 5) != 0)
            return &sp_kern_cases[k];
    SP_FAIL("no all-to-all case for %d ranks", P);
}

static sp_kern_a2a_desc_t sop_kdesc(const sp_kern_case_t *kc, uint32_t direction, int P)
{
    return (sp_kern_a2a_desc_t){ direction, kc->layout, kc->batch, kc->seq_len, kc->heads, kc->head_dim, kc->kind,
                                 kc->kv_heads, (uint32_t)P, kc->dtype,
                                 direction == SP_KERN_HEAD_TO_SEQ ? kc->flags : 0 };
}

/* Device buffers of in_bytes and out_bytes (out the same as in where
 * out_bytes is 0), and host room for the reference. */
static void sop_buffers(spc_handle_t *h, sop_t *o, const char *what, uint64_t in_bytes, uint64_t out_bytes)
{
    o->what = what;
    o->in_bytes = in_bytes;
    o->in = dev_put(h, NULL, in_bytes, &o->rin);
    o->out_bytes = out_bytes ? out_bytes : in_bytes;
    o->out = out_bytes ? dev_put(h, NULL, out_bytes, &o->rout) : o->in;
    o->want = malloc(o->out_bytes + 1);
    CHECK(o->want != NULL);
}

/* This rank's ops, with their host references; `tag` tells runs apart. */
static void sops_make(spc_handle_t *h, sop_t *s, int rank, int P, int tag)
{
    const uint64_t nr = 4099, ng = 1031, ns = 517, nb = 777, shift_bytes = 4096 + 12;
    memset(s, 0, S_N * sizeof *s);

    sop_buffers(h, &s[S_ALLREDUCE], "allreduce", nr * 4, nr * 4);
    float *sum = (float *)s[S_ALLREDUCE].want;
    for (int q = 0; q < P; q++) {
        float *x = sop_ints(q, tag, nr);
        for (uint64_t i = 0; i < nr; i++)
            sum[i] = q == 0 ? x[i] : sum[i] + x[i];
        if (q == rank)
            s[S_ALLREDUCE].src = (uint8_t *)x;
        else
            free(x);
    }

    sop_buffers(h, &s[S_ALLGATHER], "allgather", ng * 4, ng * 4 * (uint64_t)P);
    for (int q = 0; q < P; q++) {
        uint8_t *x = sop_bytes(q, tag + 1, ng * 4);
        memcpy(s[S_ALLGATHER].want + ng * 4 * (uint64_t)q, x, ng * 4);
        if (q == rank)
            s[S_ALLGATHER].src = x;
        else
            free(x);
    }

    sop_buffers(h, &s[S_REDUCE_SCATTER], "reduce_scatter", ns * 4 * (uint64_t)P, ns * 4);
    float *block = (float *)s[S_REDUCE_SCATTER].want;
    for (int q = 0; q < P; q++) {
        float *x = sop_ints(q, tag + 2, ns * (uint64_t)P);
        for (uint64_t i = 0; i < ns; i++)
            block[i] = q == 0 ? x[(uint64_t)rank * ns + i] : block[i] + x[(uint64_t)rank * ns + i];
        if (q == rank)
            s[S_REDUCE_SCATTER].src = (uint8_t *)x;
        else
            free(x);
    }

    sop_buffers(h, &s[S_SHIFT], "cyclic shift", shift_bytes, shift_bytes);
    s[S_SHIFT].src = sop_bytes(rank, tag + 3, shift_bytes);
    uint8_t *prev = sop_bytes((rank + P - 1) % P, tag + 3, shift_bytes);
    memcpy(s[S_SHIFT].want, prev, shift_bytes);
    free(prev);

    sop_buffers(h, &s[S_BROADCAST], "broadcast from rank 1", nb * 4, 0);
    s[S_BROADCAST].src = sop_bytes(rank, tag + 4, nb * 4);
    uint8_t *root = sop_bytes(SOP_BCAST_ROOT, tag + 4, nb * 4);
    memcpy(s[S_BROADCAST].want, root, nb * 4);
    free(root);

    const sp_kern_case_t *kc = sop_a2a_case(P);
    sp_kern_a2a_desc_t s2h = sop_kdesc(kc, SP_KERN_SEQ_TO_HEAD, P), h2s = sop_kdesc(kc, SP_KERN_HEAD_TO_SEQ, P);
    sp_kern_a2a_geom_t g;
    CHECK_EQ(sp_kern_a2a_geom(&g, &s2h, (uint32_t)rank), 0);
    const uint64_t seq_bytes = sp_kern_a2a_src_bytes(&g), head_bytes = sp_kern_a2a_out_bytes(&g);
    uint8_t *seq[SP_XDEV_MAXP], *head[SP_XDEV_MAXP];
    for (int q = 0; q < P; q++)
        seq[q] = sop_bytes(q, tag + 5, seq_bytes);
    for (int q = 0; q < P; q++) {
        head[q] = malloc(head_bytes);
        CHECK_EQ(sp_kern_a2a_host(head[q], (const void *const *)seq, &s2h, (uint32_t)q), 0);
    }
    sop_buffers(h, &s[S_S2H], "alltoall seq->head", seq_bytes, head_bytes);
    s[S_S2H].src = seq[rank];
    memcpy(s[S_S2H].want, head[rank], head_bytes);
    /* And back, from the seq->head output. */
    s[S_H2S] = (sop_t){ .what = "alltoall head->seq", .in = s[S_S2H].out, .in_bytes = head_bytes,
                        .out_bytes = seq_bytes };
    s[S_H2S].out = dev_put(h, NULL, seq_bytes, &s[S_H2S].rout);
    s[S_H2S].want = malloc(seq_bytes);
    CHECK(s[S_H2S].want != NULL);
    CHECK_EQ(sp_kern_a2a_host(s[S_H2S].want, (const void *const *)head, &h2s, (uint32_t)rank), 0);
    for (int q = 0; q < P; q++) {
        if (q != rank)
            free(seq[q]);
        free(head[q]);
    }
}

static void sops_free(spc_handle_t *h, sop_t *s)
{
    for (int k = 0; k < S_N; k++) {
        if (k != S_H2S)   /* its input is the seq->head one's output */
            dev_drop(h, s[k].in, s[k].rin);
        if (s[k].out != s[k].in)
            dev_drop(h, s[k].out, s[k].rout);
        free(s[k].src);
        free(s[k].want);
    }
}

/* Submits op k: host-synchronous, or enqueued on the current stream. */
static void sop_submit(spc_handle_t *h, spc_group_t world, const sop_t *s, int k, int P)
{
    const sop_t *o = &s[k];
    switch (k) {
    case S_ALLREDUCE:
        CHECK_OK(h, spc_allreduce(h, world, o->in, o->out, o->in_bytes / 4, SPC_F32, SPC_SUM, SP_XDEV_TMO));
        break;
    case S_ALLGATHER:
        CHECK_OK(h, spc_allgather(h, world, o->in, o->out, o->in_bytes / 4, SPC_F32, SP_XDEV_TMO));
        break;
    case S_REDUCE_SCATTER:
        CHECK_OK(h, spc_reduce_scatter(h, world, o->in, o->out, o->out_bytes / 4, SPC_F32, SPC_SUM, SP_XDEV_TMO));
        break;
    case S_SHIFT: {
        spc_shift_desc_t d = { .struct_size = sizeof d, .group = world, .ntensors = 1 };
        d.tensors[0].send = o->in;
        d.tensors[0].recv = o->out;
        d.tensors[0].bytes = o->in_bytes;
        CHECK_OK(h, spc_shift(h, &d, SP_XDEV_TMO));
        break;
    }
    case S_BROADCAST:
        CHECK_OK(h, spc_broadcast(h, world, o->in, o->in_bytes / 4, SPC_F32, SOP_BCAST_ROOT, SP_XDEV_TMO));
        break;
    default: {
        const sp_kern_case_t *kc = sop_a2a_case(P);
        spc_alltoall_desc_t d = { .struct_size = sizeof d, .group = world, .dtype = (spc_dtype_t)kc->dtype,
                                  .direction = k == S_S2H ? SPC_SEQ_TO_HEAD : SPC_HEAD_TO_SEQ,
                                  .layout = kc->layout, .batch = kc->batch, .seq_len = kc->seq_len,
                                  .kv_heads = kc->kv_heads, .ntensors = 1 };
        d.tensors[0] = (spc_a2a_tensor_t){ o->in, o->out, kc->heads, kc->head_dim, kc->kind,
                                           k == S_H2S ? kc->flags : 0 };
        CHECK_OK(h, spc_alltoall(h, &d, SP_XDEV_TMO));
        break;
    }
    }
}

/* Each op in turn, its input written and its output read on the host. */
static void sops_sync(spc_handle_t *h, spc_group_t world, int rank, int P)
{
    sop_t s[S_N];
    char what[128];
    sops_make(h, s, rank, P, 10);
    for (int k = 0; k < S_N; k++) {
        if (s[k].src != NULL)
            dev_write(s[k].in, s[k].src, s[k].in_bytes);
        sop_submit(h, world, s, k, P);
        snprintf(what, sizeof what, "%s, host-synchronous", s[k].what);
        dev_check(s[k].out, s[k].want, s[k].out_bytes, what, rank);
    }
    sops_free(h, s);
}

/* Every op enqueued on the rank's stream behind the copy of its input (op k
 * stalled 20 ms on rank k % P first), its output copied out behind it, both
 * through pinned host memory so that neither copy waits on the host. */
static void sops_stream(spc_handle_t *h, spc_group_t world, int rank, int P)
{
    sop_t s[S_N];
    uint8_t *in_h[S_N], *out_h[S_N];
    char what[128];
    spc_stream_t *st;
    sops_make(h, s, rank, P, 20);
    void *cs = stream_make();
    CHECK_OK(h, spc_stream_create(h, cs, &st));
    CHECK_OK(h, spc_set_stream(h, st));
    for (int k = 0; k < S_N; k++) {
        in_h[k] = NULL;
        if (s[k].src != NULL) {
            in_h[k] = host_pinned(s[k].in_bytes);
            memcpy(in_h[k], s[k].src, s[k].in_bytes);
            stream_stall(cs, k % P == rank ? 20 : 1);
            stream_copy_in(cs, s[k].in, in_h[k], s[k].in_bytes);
        }
        sop_submit(h, world, s, k, P);   /* enqueued: returns at once */
        out_h[k] = host_pinned(s[k].out_bytes);
        stream_copy_out(cs, out_h[k], s[k].out, s[k].out_bytes);
    }
    CHECK_EQ(spc_stream_seq(st), S_N);
    CHECK_OK(h, spc_stream_synchronize(st));
    CHECK_OK(h, spc_set_stream(h, NULL));
    for (int k = 0; k < S_N; k++) {
        snprintf(what, sizeof what, "%s, in stream order", s[k].what);
        compare(out_h[k], s[k].want, s[k].out_bytes, what, rank);
        host_unpin(in_h[k]);
        host_unpin(out_h[k]);
    }
    CHECK_OK(h, spc_stream_destroy(st));
    stream_destroy(cs);
    sops_free(h, s);
}

#endif /* SP_XDEV_OPS_H */
