/*
 * Device ops across daemons whose ranks sit on several GPUs of each node (the
 * 8-GPU node, one rank per GPU, in small), without a GPU: two spd_stub
 * daemons linked on loopback, each a node with two stand-in GPUs
 * (SPD_STUB_CUDA_GPUS=2), over the stand-in NCCL; four ranks, one per GPU
 * (rank r on node r / 2, GPU r % 2). Each daemon is one NCCL rank on GPU 0,
 * its lowest rank's: its rank on GPU 1 is reached over peer access where the
 * two GPUs have it, and staged through pinned host memory where they do not.
 * The stand-in driver refuses a kernel, and the stand-in NCCL a transfer,
 * that touches memory its GPU cannot reach. Every result is compared byte for
 * byte with a host reference computed here from every rank's inputs:
 *
 *   p2p, apart  with peer access between GPUs 0 and 1 (SPD_STUB_CUDA_P2P
 *               "0=1"), then without: host-synchronous, the cases of
 *               sp_xdev_cases.h (alltoall both ways, every case for P = 4;
 *               shifts on two channels; allreduce fp32, fp64 in place, bf16;
 *               allgather; broadcast from either daemon) and alltoallv; then
 *               allreduce, allgather, reduce-scatter, shift, broadcast from
 *               rank 1 (the rank off its daemon's NCCL GPU), alltoall
 *               seq->head and back, once host-synchronous and once in each
 *               rank's CUDA stream's order, each input written and each
 *               output read on that stream, one rank's stream stalled before
 *               each op: an op that ran before a rank's ready would read an
 *               old input, a done written before an output would let the
 *               copy read an old result. Each node makes one communicator
 *               per channel (the NCCL GPU stays the same from op to op), and
 *               stages through host memory only without peer access;
 *   limit       without peer access and gpu_host_staging_bytes at 3 MiB: an
 *               all-reduce whose rank on GPU 1 would stage 4 MiB is refused
 *               with LIMIT naming the option on every rank, between two that
 *               run right.
 */
#include <unistd.h>

#include "sp_stub_regions.h"
#include "sp_gpu_alltoallv.h"
#include "sp_xdev_cases.h"

#define NODES 2
#define P     4      /* ranks: two on each node */
#define TMO   60000

static sp_test_daemon_t nodes[NODES];
static char dir[64] = "/tmp/spd-nccl-gpus-stub-XXXXXX", secret[128];
static char job_id[SPC_JOB_ID_MAX];

static int node_of(int rank)
{
    return rank / 2;
}

static int gpu_of(int rank)
{
    return rank % 2;
}

static void gpu_bind(int gpu)
{
    void *ctx;
    CHECK_EQ(cuDevicePrimaryCtxRetain(&ctx, gpu), STUB_SUCCESS);
    CHECK_EQ(cuCtxSetCurrent(ctx), STUB_SUCCESS);
}

/* ================================================================ one op of each kind */

/* Rank q's n bytes for op `tag`. */
static uint8_t *rank_bytes(int q, int tag, uint64_t n)
{
    uint8_t *p = malloc(n + 1);
    uint64_t st = seed_of(q, tag);
    CHECK(p != NULL);
    sp_kern_fill(p, n, &st);
    return p;
}

/* Rank q's n floats for op `tag`: small integers, so every sum is exact. */
static float *rank_ints(int q, int tag, uint64_t n)
{
    float *p = malloc(n * sizeof *p + 1);
    CHECK(p != NULL);
    for (uint64_t i = 0; i < n; i++)
        p[i] = (float)((q + 1) * 100 + tag) + (float)(i % 13);
    return p;
}

enum { S_ALLREDUCE, S_ALLGATHER, S_REDUCE_SCATTER, S_SHIFT, S_BROADCAST, S_S2H, S_H2S, S_N };

#define BCAST_ROOT 1   /* node-0's rank on GPU 1: its input is staged or read over peer access */

/* One op of this rank: its input (written into `in` before the op; NULL for
 * the head->seq all-to-all, which reads the seq->head one's output), its
 * output (`out`; the broadcast's is its buffer), and what the output must
 * hold. */
typedef struct sop {
    const char  *what;
    void        *in, *out;         /* device */
    spc_region_t rin, rout;
    uint8_t     *src, *want, *got; /* host */
    uint64_t     in_bytes, out_bytes;
} sop_t;

/* An all-to-all of sp_kern_cases.h for P ranks, both ways. */
static const sp_kern_case_t *a2a_case(void)
{
    for (size_t k = 0; k < SP_KERN_NCASES; k++)
        if (sp_kern_cases[k].ranks == P && strncmp(sp_kern_cases[k].name, "large", 5) != 0)
            return &sp_kern_cases[k];
    SP_FAIL("no all-to-all case for %d ranks", P);
}

static sp_kern_a2a_desc_t a2a_kdesc(const sp_kern_case_t *kc, uint32_t direction)
{
    return (sp_kern_a2a_desc_t){ direction, kc->layout, kc->batch, kc->seq_len, kc->heads, kc->head_dim, kc->kind,
                                 kc->kv_heads, P, kc->dtype, direction == SP_KERN_HEAD_TO_SEQ ? kc->flags : 0 };
}

/* Device buffers of in_bytes and out_bytes (out the same as in where
 * out_bytes is 0), and host room for the result. */
static void sop_buffers(spc_handle_t *h, sop_t *o, const char *what, uint64_t in_bytes, uint64_t out_bytes)
{
    o->what = what;
    o->in_bytes = in_bytes;
    o->in = dev_put(h, NULL, in_bytes, &o->rin);
    o->out_bytes = out_bytes ? out_bytes : in_bytes;
    if (out_bytes != 0)
        o->out = dev_put(h, NULL, out_bytes, &o->rout);
    else
        o->out = o->in;
    o->got = malloc(o->out_bytes + 1);
    o->want = malloc(o->out_bytes + 1);
    CHECK(o->got != NULL && o->want != NULL);
}

/* This rank's ops, with their host references; `tag` tells runs apart. */
static void sops_make(spc_handle_t *h, sop_t *s, int rank, int tag)
{
    const uint64_t nr = 4099, ng = 1031, ns = 517, nb = 777, shift_bytes = 4096 + 12;
    memset(s, 0, S_N * sizeof *s);

    sop_buffers(h, &s[S_ALLREDUCE], "allreduce", nr * 4, nr * 4);
    float *sum = (float *)s[S_ALLREDUCE].want;
    for (int q = 0; q < P; q++) {
        float *x = rank_ints(q, tag, nr);
        for (uint64_t i = 0; i < nr; i++)
            sum[i] = q == 0 ? x[i] : sum[i] + x[i];
        if (q == rank)
            s[S_ALLREDUCE].src = (uint8_t *)x;
        else
            free(x);
    }

    sop_buffers(h, &s[S_ALLGATHER], "allgather", ng * 4, ng * 4 * P);
    for (int q = 0; q < P; q++) {
        uint8_t *x = rank_bytes(q, tag + 1, ng * 4);
        memcpy(s[S_ALLGATHER].want + ng * 4 * (uint64_t)q, x, ng * 4);
        if (q == rank)
            s[S_ALLGATHER].src = x;
        else
            free(x);
    }

    sop_buffers(h, &s[S_REDUCE_SCATTER], "reduce_scatter", ns * 4 * P, ns * 4);
    float *block = (float *)s[S_REDUCE_SCATTER].want;
    for (int q = 0; q < P; q++) {
        float *x = rank_ints(q, tag + 2, ns * P);
        for (uint64_t i = 0; i < ns; i++)
            block[i] = q == 0 ? x[rank * ns + i] : block[i] + x[rank * ns + i];
        if (q == rank)
            s[S_REDUCE_SCATTER].src = (uint8_t *)x;
        else
            free(x);
    }

    sop_buffers(h, &s[S_SHIFT], "cyclic shift", shift_bytes, shift_bytes);
    s[S_SHIFT].src = rank_bytes(rank, tag + 3, shift_bytes);
    uint8_t *prev = rank_bytes((rank + P - 1) % P, tag + 3, shift_bytes);
    memcpy(s[S_SHIFT].want, prev, shift_bytes);
    free(prev);

    sop_buffers(h, &s[S_BROADCAST], "broadcast from rank 1", nb * 4, 0);
    s[S_BROADCAST].src = rank_bytes(rank, tag + 4, nb * 4);
    uint8_t *root = rank_bytes(BCAST_ROOT, tag + 4, nb * 4);
    memcpy(s[S_BROADCAST].want, root, nb * 4);
    free(root);

    const sp_kern_case_t *kc = a2a_case();
    sp_kern_a2a_desc_t s2h = a2a_kdesc(kc, SP_KERN_SEQ_TO_HEAD), h2s = a2a_kdesc(kc, SP_KERN_HEAD_TO_SEQ);
    sp_kern_a2a_geom_t g;
    CHECK_EQ(sp_kern_a2a_geom(&g, &s2h, (uint32_t)rank), 0);
    const uint64_t seq_bytes = sp_kern_a2a_src_bytes(&g), head_bytes = sp_kern_a2a_out_bytes(&g);
    uint8_t *seq[P], *head[P];
    for (int q = 0; q < P; q++)
        seq[q] = rank_bytes(q, tag + 5, seq_bytes);
    for (int q = 0; q < P; q++) {
        head[q] = malloc(head_bytes);
        CHECK_EQ(sp_kern_a2a_host(head[q], (const void *const *)seq, &s2h, (uint32_t)q), 0);
    }
    sop_buffers(h, &s[S_S2H], "alltoall seq->head", seq_bytes, head_bytes);
    s[S_S2H].src = seq[rank];
    memcpy(s[S_S2H].want, head[rank], head_bytes);
    /* Back from the seq->head output: its input is that op's. */
    s[S_H2S] = (sop_t){ .what = "alltoall head->seq", .in = s[S_S2H].out, .in_bytes = head_bytes,
                        .out_bytes = seq_bytes };
    s[S_H2S].out = dev_put(h, NULL, seq_bytes, &s[S_H2S].rout);
    s[S_H2S].got = malloc(seq_bytes);
    s[S_H2S].want = malloc(seq_bytes);
    CHECK(s[S_H2S].got != NULL && s[S_H2S].want != NULL);
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
        free(s[k].got);
    }
}

/* Submits op k (host-synchronous, or enqueued on the current stream). */
static void sop_submit(spc_handle_t *h, spc_group_t world, sop_t *s, int k)
{
    sop_t *o = &s[k];
    switch (k) {
    case S_ALLREDUCE:
        CHECK_OK(h, spc_allreduce(h, world, o->in, o->out, o->in_bytes / 4, SPC_F32, SPC_SUM, TMO));
        break;
    case S_ALLGATHER:
        CHECK_OK(h, spc_allgather(h, world, o->in, o->out, o->in_bytes / 4, SPC_F32, TMO));
        break;
    case S_REDUCE_SCATTER:
        CHECK_OK(h, spc_reduce_scatter(h, world, o->in, o->out, o->out_bytes / 4, SPC_F32, SPC_SUM, TMO));
        break;
    case S_SHIFT: {
        spc_shift_desc_t d = { .struct_size = sizeof d, .group = world, .ntensors = 1 };
        d.tensors[0].send = o->in;
        d.tensors[0].recv = o->out;
        d.tensors[0].bytes = o->in_bytes;
        CHECK_OK(h, spc_shift(h, &d, TMO));
        break;
    }
    case S_BROADCAST:
        CHECK_OK(h, spc_broadcast(h, world, o->in, o->in_bytes / 4, SPC_F32, BCAST_ROOT, TMO));
        break;
    default: {
        const sp_kern_case_t *kc = a2a_case();
        spc_alltoall_desc_t d = { .struct_size = sizeof d, .group = world, .dtype = (spc_dtype_t)kc->dtype,
                                  .direction = k == S_S2H ? SPC_SEQ_TO_HEAD : SPC_HEAD_TO_SEQ,
                                  .layout = kc->layout, .batch = kc->batch, .seq_len = kc->seq_len,
                                  .kv_heads = kc->kv_heads, .ntensors = 1 };
        d.tensors[0] = (spc_a2a_tensor_t){ o->in, o->out, kc->heads, kc->head_dim, kc->kind,
                                           k == S_H2S ? kc->flags : 0 };
        CHECK_OK(h, spc_alltoall(h, &d, TMO));
        break;
    }
    }
}

static void sops_check(const sop_t *s, int rank, const char *how)
{
    char what[128];
    for (int k = 0; k < S_N; k++) {
        snprintf(what, sizeof what, "%s, %s", s[k].what, how);
        compare(s[k].got, s[k].want, s[k].out_bytes, what, rank);
    }
}

/* Each op in turn, its input written and its output read on the host. */
static void sops_sync(spc_handle_t *h, spc_group_t world, int rank)
{
    sop_t s[S_N];
    sops_make(h, s, rank, 10);
    for (int k = 0; k < S_N; k++) {
        if (s[k].src != NULL)
            dev_write(s[k].in, s[k].src, s[k].in_bytes);
        sop_submit(h, world, s, k);
        memcpy(s[k].got, s[k].out, s[k].out_bytes);
    }
    sops_check(s, rank, "host-synchronous");
    sops_free(h, s);
}

static void fill_run(void *arg)
{
    const sop_t *o = arg;
    memcpy(o->in, o->src, o->in_bytes);
}

static void sleep_run(void *arg)
{
    usleep((useconds_t)(intptr_t)arg * 1000);
}

/* Every op enqueued on the rank's stream behind the write of its input (op k
 * stalled 20 ms on rank k % P first), its output copied out behind it, and
 * nothing waited for on the host until the end. */
static void sops_stream(spc_handle_t *h, spc_group_t world, int rank)
{
    sop_t s[S_N];
    void *cs;
    spc_stream_t *st;
    sops_make(h, s, rank, 20);
    CHECK_EQ(cuStreamCreate(&cs, 1), STUB_SUCCESS);
    CHECK_OK(h, spc_stream_create(h, cs, &st));
    CHECK_OK(h, spc_set_stream(h, st));
    for (int k = 0; k < S_N; k++) {
        if (s[k].src != NULL) {
            CHECK_EQ(cuLaunchHostFunc(cs, sleep_run, (void *)(intptr_t)(k % P == rank ? 20 : 1)), STUB_SUCCESS);
            CHECK_EQ(cuLaunchHostFunc(cs, fill_run, &s[k]), STUB_SUCCESS);
        }
        sop_submit(h, world, s, k);   /* enqueued: returns at once */
        CHECK_EQ(cuMemcpyDtoHAsync_v2(s[k].got, (stub_ptr_t)(uintptr_t)s[k].out, s[k].out_bytes, cs), STUB_SUCCESS);
    }
    CHECK_EQ(spc_stream_seq(st), S_N);
    CHECK_OK(h, spc_stream_synchronize(st));
    CHECK_OK(h, spc_set_stream(h, NULL));
    sops_check(s, rank, "in stream order");
    CHECK_OK(h, spc_stream_destroy(st));
    CHECK_EQ(cuStreamDestroy_v2(cs), STUB_SUCCESS);
    sops_free(h, s);
}

/* ================================================================ the ranks */

enum scenario { OPS, LIMIT };

typedef struct rank_arg {
    int rank, scenario;
} rank_arg_t;

static void run_ops(spc_handle_t *h, spc_group_t world, int rank)
{
    int cases = run_a2a_cases(h, world, rank, P);
    test_shift(h, world, rank, P, 0, 0, 1);
    test_shift(h, world, rank, P, 0, SPC_SHIFT_LINEAR, 1);
    test_shift(h, world, rank, P, 1, SPC_SHIFT_REVERSE, 2);
    test_allreduce(h, world, rank, P, SPC_F32, false);
    test_allreduce(h, world, rank, P, SPC_F64, true);
    test_allreduce16(h, world, rank, P, SPC_BF16, SPC_SUM);
    test_gather_bcast(h, world, rank, P);
    dev_alltoallv(h, world, rank, P, 0);
    sops_sync(h, world, rank);
    sops_stream(h, world, rank);
    if (rank == 0)
        printf("%d alltoall cases there and back, shifts, allreduce, allgather, broadcast, alltoallv; allreduce, "
               "allgather, reduce_scatter, shift, broadcast, alltoall both ways host-synchronous and in stream "
               "order: byte for byte\n", cases);
}

/* A right all-reduce of 64 KiB, one of 2 MiB that would stage 2 MiB in and 2
 * MiB out for the rank on GPU 1, past gpu_host_staging_bytes (3 MiB), then
 * the small one right again within what is kept. */
static void run_limit(spc_handle_t *h, spc_group_t world, int rank)
{
    const uint64_t big = 512ull << 10, small = 16ull << 10;
    spc_region_t rx, ry;
    float *x = rank_ints(rank, 0, big), *want = malloc(small * sizeof *want);
    CHECK(want != NULL);
    for (uint64_t i = 0; i < small; i++)
        want[i] = 0;
    for (int q = 0; q < P; q++) {
        float *xq = rank_ints(q, 0, small);
        for (uint64_t i = 0; i < small; i++)
            want[i] += xq[i];
        free(xq);
    }
    void *dx = dev_put(h, x, big * sizeof *x, &rx), *dy = dev_put(h, NULL, big * sizeof *x, &ry);
    CHECK_OK(h, spc_allreduce(h, world, dx, dy, small, SPC_F32, SPC_SUM, TMO));
    dev_check(dy, want, small * sizeof *want, "all-reduce before the refused one", rank);
    CHECK_ST(h, spc_allreduce(h, world, dx, dy, big, SPC_F32, SPC_SUM, TMO), SPC_ERR_LIMIT);
    CHECK_CONTAINS(spc_last_error(h), "gpu_host_staging_bytes");
    memset(dy, 0, small * sizeof *x);
    CHECK_OK(h, spc_allreduce(h, world, dx, dy, small, SPC_F32, SPC_SUM, TMO));
    dev_check(dy, want, small * sizeof *want, "all-reduce after the refused one", rank);
    dev_drop(h, dx, rx);
    dev_drop(h, dy, ry);
    free(x);
    free(want);
}

static int rank_main(void *p)
{
    const rank_arg_t *ra = p;
    setenv("SPC_SOCKET", nodes[node_of(ra->rank)].sock, 1);
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, P, (uint32_t)ra->rank, 20000, &world));
    gpu_bind(gpu_of(ra->rank));
    if (ra->scenario == OPS)
        run_ops(h, world, ra->rank);
    else
        run_limit(h, world, ra->rank);
    spc_detach(h);
    return 0;
}

/* ================================================================ the daemons */

/* Both nodes with two stand-in GPUs, peer access between them as p2p says. */
static void start_nodes(const char *p2p)
{
    char peers[64], rec[2048];
    setenv("SPD_STUB_CUDA_P2P", p2p, 1);
    sp_test_node_start(&nodes[0], "node-0", secret, "127.0.0.1:0", "", 5000);
    snprintf(peers, sizeof peers, "127.0.0.1:%d", sp_test_node_port(&nodes[0]));
    sp_test_node_start(&nodes[1], "node-1", secret, "127.0.0.1:0", peers, 5000);
    sp_test_peer_wait(&nodes[0], "node-1", "up", 10000, rec, sizeof rec);
    sp_test_peer_wait(&nodes[1], "node-0", "up", 10000, rec, sizeof rec);
}

static void stop_nodes(void)
{
    for (int i = NODES - 1; i >= 0; i--) {
        CHECK_EQ(sp_test_daemon_stop(&nodes[i]), 0);
        sp_test_daemon_cleanup(&nodes[i]);
    }
}

static int log_count(int i, const char *what)
{
    char out[64];
    sp_test_run(out, sizeof out, "grep -c '%s' %s", what, nodes[i].log);
    return atoi(out);
}

/* A job of P ranks created on node-0, run to the end. */
static void run_job(int scenario, int timeout_ms)
{
    pid_t pids[P];
    setenv("SPC_SOCKET", nodes[0].sock, 1);
    spc_handle_t *owner = sp_test_attach();
    CHECK_OK(owner, spc_job_create(owner, job_id, sizeof job_id));
    for (int r = 0; r < P; r++) {
        rank_arg_t ra = { r, scenario };
        pids[r] = sp_test_fork(rank_main, &ra);
    }
    sp_test_wait_all_ok(pids, P, timeout_ms);
    spc_detach(owner);
}

static void scenario_ops(const char *p2p, bool staged)
{
    char out[16384];
    start_nodes(p2p);
    run_job(OPS, 150000);
    for (int i = 0; i < NODES; i++) {
        CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s --json status", sp_test_spctl_bin(), nodes[i].sock), 0);
        CHECK_EQ(sp_test_json_int(out, "ops_failed"), 0);
        /* Channels 0 and 1, each one communicator on GPU 0 for every op. */
        CHECK_EQ(log_count(i, "communicator from op"), 2);
        CHECK_EQ(log_count(i, "communicator from op.* on GPU 0$"), 2);
        if (staged != (log_count(i, "pinned host memory for staging between GPUs") > 0))
            SP_FAIL("node-%d %s through pinned host memory with SPD_STUB_CUDA_P2P '%s'", i,
                    staged ? "staged nothing" : "staged", p2p);
    }
    printf("%s: two nodes of two GPUs, a rank on each: every op right, one communicator per channel on GPU 0, "
           "%s\n", *p2p ? "peer access" : "no peer access", staged ? "staged through host memory" : "nothing staged");
    stop_nodes();
}

static void scenario_limit(void)
{
    setenv("SPD_GPU_HOST_STAGING_BYTES", "3M", 1);
    start_nodes("");
    unsetenv("SPD_GPU_HOST_STAGING_BYTES");
    run_job(LIMIT, 60000);
    printf("limit: an all-reduce past gpu_host_staging_bytes refused with LIMIT on every rank, the next right\n");
    stop_nodes();
}

int main(void)
{
    char out[64];
    sp_test_use_stub_cuda(SP_STUB_CUDA_DIR);
    setenv("SP_TEST_SPD", SPD_STUB_BIN, 1);
    setenv("SPD_NCCL_LIBRARY", SP_STUB_NCCL_LIB, 1);
    setenv("SPD_STUB_CUDA_GPUS", "2", 1);
    CHECK(mkdtemp(dir) != NULL);
    sp_test_secret_file(dir, "secret", "two daemons, two stand-in GPUs each\n", secret, sizeof secret);
    scenario_ops("0=1", false);
    scenario_ops("", true);
    scenario_limit();
    sp_test_run(out, sizeof out, "rm -rf %s", dir);
    printf("nccl_gpus_stub: ok\n");
    return 0;
}
