/*
 * Device ops across daemons whose ranks sit on several GPUs of each node,
 * through NCCL: two spd on loopback, each playing a node of this machine's
 * first two GPUs, four rank processes, one per GPU (rank r on node r / 2, GPU
 * r % 2), as on 8-GPU nodes with one rank per GPU and a group spanning nodes.
 * Each daemon is one NCCL rank on GPU 0 (its lowest rank's) and reaches its
 * rank on GPU 1 over peer access, or through pinned host memory where the two
 * GPUs have none. Each daemon is its own NCCL host (spd sets NCCL_HOSTID to
 * its node name), joined over loopback sockets as test_nccl_nodes does. Every
 * result is copied back and compared bit for bit with host references
 * computed here from every rank's inputs:
 *
 *   ops     the cases of sp_xdev_cases.h (alltoall seq->head and back, every
 *           case of sp_kern_cases.h for P = 4, q+k and GatedDeltaNet's five
 *           tensors in one op; shifts on two channels; allreduce fp32, fp64
 *           in place, bf16; allgather; broadcast from either daemon),
 *           alltoallv, and those of sp_xdev_ops.h (allreduce, allgather,
 *           reduce-scatter, shift, broadcast from rank 1, the rank off its
 *           daemon's NCCL GPU, alltoall both ways) host-synchronous and in
 *           each rank's CUDA stream's order, one rank's stream stalled before
 *           each op; no op fails, and each node makes one communicator per
 *           channel, on GPU 0.
 *
 * `spctl status` is printed: whether the two GPUs have peer access, so which
 * of the two ways ran. test_nccl_gpus_stub runs both over the stand-in driver
 * and NCCL. Needs two GPUs and NCCL; otherwise it says why and exits 77.
 */
#include "sp_gpu_regions.h"
#include "sp_gpu_alltoallv.h"
#include "sp_kern_cuda.h"
#include "sp_xdev_cases.h"
#include "sp_xdev_ops.h"

#define NODES 2
#define P     4      /* ranks: two on each node, one per GPU */

static sp_test_daemon_t nodes[NODES];
static char dir[64] = "/tmp/spd-nccl-gpus-XXXXXX", secret[128];
static char job_id[SPC_JOB_ID_MAX];

static int rank_main(void *arg)
{
    const int rank = (int)(intptr_t)arg;
    setenv("SPC_SOCKET", nodes[rank / 2].sock, 1);
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, P, (uint32_t)rank, 20000, &world));
    CUDA_CHECK(cudaSetDevice(rank % 2));
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
               "order: bit for bit\n", cases);
    spc_detach(h);
    return 0;
}

/* How many GPUs there are, asked in a child: CUDA must not start in this
 * process before it forks the ranks. */
static int gpu_count(void *arg)
{
    int n = 0;
    (void)arg;
    if (sp_gpu_test_usable() != 0 || cudaGetDeviceCount(&n) != cudaSuccess)
        return 0;
    return n > 8 ? 8 : n;
}

int main(void)
{
    int ngpus = sp_test_wait(sp_test_fork(gpu_count, NULL), 60000);
    if (ngpus < 2) {
        fprintf(stderr, "skipped: a rank per GPU on each of two daemons needs two GPUs, this machine has %d\n",
                ngpus);
        return SP_TEST_SKIP;
    }
    /* NCCL between daemons on one host: its socket transport over loopback. */
    setenv("NCCL_SOCKET_IFNAME", "lo", 0);
    setenv("NCCL_IB_DISABLE", "1", 0);
    setenv("NCCL_P2P_DISABLE", "1", 0);
    setenv("NCCL_SHM_DISABLE", "1", 0);
    setenv("NCCL_DEBUG", "WARN", 0);
    unsetenv("NCCL_HOSTID");   /* spd sets it per daemon */
    CHECK(mkdtemp(dir) != NULL);
    sp_test_secret_file(dir, "secret", "two daemons, two GPUs each, 2026\n", secret, sizeof secret);

    sp_test_node_pair_start(nodes, secret);
    char out[16384], nccl[512];
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s status", sp_test_spctl_bin(), nodes[0].sock), 0);
    printf("$ spctl status (node-0)\n%s", out);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --socket %s --json status", sp_test_spctl_bin(), nodes[0].sock), 0);
    sp_test_json_str(out, "transport_nccl", nccl, sizeof nccl);
    if (strstr(nccl, "refused") != NULL) {
        fprintf(stderr, "skipped: the daemons cannot run device ops across daemons: %s\n", nccl);
        sp_test_node_pair_stop(nodes);
        sp_test_run(out, sizeof out, "rm -rf %s", dir);
        return SP_TEST_SKIP;
    }

    setenv("SPC_SOCKET", nodes[0].sock, 1);
    spc_handle_t *owner = sp_test_attach();
    CHECK_OK(owner, spc_job_create(owner, job_id, sizeof job_id));
    pid_t pids[P];
    for (int r = 0; r < P; r++)
        pids[r] = sp_test_fork(rank_main, (void *)(intptr_t)r);
    sp_test_wait_all_ok(pids, P, 600000);
    spc_detach(owner);

    for (int i = 0; i < NODES; i++) {
        sp_test_node_status(&nodes[i], out, sizeof out);
        CHECK_EQ(sp_test_json_int(out, "ops_failed"), 0);
        CHECK_EQ(sp_test_log_count(&nodes[i], "communicator from op"), 2);   /* channels 0 and 1, each kept */
        CHECK_EQ(sp_test_log_count(&nodes[i], "communicator from op.* on GPU 0$"), 2);
    }
    int staged = sp_test_log_count(&nodes[0], "pinned host memory for staging between GPUs") > 0;
    printf("two nodes of GPUs 0 and 1, a rank on each: every op right, one communicator per channel on GPU 0, "
           "GPU 1's tensors %s\n", staged ? "staged through pinned host memory" : "reached over peer access");
    sp_test_node_pair_stop(nodes);
    sp_test_run(out, sizeof out, "rm -rf %s", dir);
    printf("nccl_gpus: ok\n");
    return 0;
}
