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
 *               those of sp_xdev_ops.h (allreduce, allgather, reduce-scatter,
 *               shift, broadcast from rank 1, the rank off its daemon's NCCL
 *               GPU, alltoall seq->head and back), once host-synchronous and
 *               once in each rank's CUDA stream's order, each input copied in
 *               and each output out on that stream, one rank's stream
 *               stalled before each op. Each node makes one communicator
 *               per channel (the NCCL GPU stays the same from op to op), and
 *               counts its ops on several GPUs (gpu_multi_ops), all of them
 *               staged through host memory without peer access and none with
 *               it (gpu_staged_ops);
 *   limit       without peer access and gpu_host_staging_bytes at 3 MiB: an
 *               all-reduce whose rank on GPU 1 would stage 4 MiB is refused
 *               with LIMIT naming the option on every rank, between two that
 *               run right.
 */
#include "sp_stub_regions.h"
#include "sp_gpu_alltoallv.h"
#include "sp_xdev_cases.h"
#include "sp_xdev_ops.h"

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
    sops_sync(h, world, rank, P);
    sops_stream(h, world, rank, P);
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
    float *x = sop_ints(rank, 0, big), *want = malloc(small * sizeof *want);
    CHECK(want != NULL);
    for (uint64_t i = 0; i < small; i++)
        want[i] = 0;
    for (int q = 0; q < P; q++) {
        float *xq = sop_ints(q, 0, small);
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
    setenv("SPD_STUB_CUDA_P2P", p2p, 1);
    sp_test_node_pair_start(nodes, secret);
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
        CHECK_EQ(sp_test_log_count(&nodes[i], "communicator from op"), 2);
        CHECK_EQ(sp_test_log_count(&nodes[i], "communicator from op.* on GPU 0$"), 2);
        /* Its parts of the ops ran on both GPUs; staged exactly where they lack peer access. */
        int64_t multi = sp_test_json_int(out, "gpu_multi_ops"), staged_ops = sp_test_json_int(out, "gpu_staged_ops");
        CHECK(multi > 0);
        CHECK_EQ(staged_ops, staged ? multi : 0);
    }
    printf("%s: two nodes of two GPUs, a rank on each: every op right, one communicator per channel on GPU 0, "
           "%s\n", *p2p ? "peer access" : "no peer access", staged ? "staged through host memory" : "nothing staged");
    sp_test_node_pair_stop(nodes);
}

static void scenario_limit(void)
{
    setenv("SPD_GPU_HOST_STAGING_BYTES", "3M", 1);
    start_nodes("");
    unsetenv("SPD_GPU_HOST_STAGING_BYTES");
    run_job(LIMIT, 60000);
    printf("limit: an all-reduce past gpu_host_staging_bytes refused with LIMIT on every rank, the next right\n");
    sp_test_node_pair_stop(nodes);
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
