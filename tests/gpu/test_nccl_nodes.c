/*
 * Device ops across daemons, through NCCL: two spd on loopback, each playing a
 * node, with P = 2, 3 and 4 rank processes spread over them (1+1, 2+1, 2+2),
 * every rank on the one GPU of this machine. Each daemon is its own NCCL host
 * (spd sets NCCL_HOSTID to its node name), so NCCL joins them with its socket
 * transport over loopback, as it would two nodes. Every result is copied back
 * and compared bit for bit with host references computed here from every
 * rank's inputs (kernels/host; the cases of sp_xdev_cases.h, which
 * test_nccl_stub runs without a GPU):
 *
 *   alltoall   seq->head and back, one tensor, every case of sp_kern_cases.h
 *              for this P (both layouts, padding rows, dummy heads, GQA, MQA,
 *              KV replicated with and without summed replicas, every type),
 *              q+k in one op, and GatedDeltaNet's q, k, v, beta and gate in
 *              one op (two head counts, dummy heads, k replicated on 4 ranks,
 *              its gradient's replicas summed);
 *   shift      cyclic and linear on channel 0, reversed with two tensors of
 *              other sizes on channel 1 (a second communicator);
 *   allreduce  fp32, fp64 in place, fp16 and bf16 through fp32, bf16 max:
 *              bit for bit, as on one node (spd folds in rank order on every
 *              daemon);
 *   allgather, broadcast from a root on either daemon;
 *   alltoallv  counts of their own per pair, empty blocks, and with P = 3
 *              and 4 a rank that sends and receives nothing: each block
 *              straight from its sender's send into its receiver's receive;
 *   stream     ops in client streams' order across the daemons: 8 fp32
 *              all-reduces of 4 MiB on each rank's CUDA stream, each input
 *              copied in and parts of each result copied out on the stream,
 *              some ranks' streams stalled, one synchronize at the end: every
 *              result right (an op that did not wait for a rank's ready, or a
 *              copy that did not wait for its done, would show); then the last
 *              rank (node-1's) holds its stream 1.5 s past an op's 300 ms
 *              timeout: it gets TIMEOUT saying its stream did not reach the op,
 *              every other rank a failure (node-1 gave up on it, or its NCCL
 *              wait timed out), never OK; its stream is broken, and new
 *              streams on every rank then give the right sum. spd's ops_failed
 *              counts exactly those late ops.
 *
 * Then the failures:
 *   lost       node-1 SIGKILLed while its rank and node-0's exchange 256 MiB
 *              all-gathers: node-0's rank gets PEER_LOST naming node-1, never
 *              a hang; node-0 then serves a new job (device and host ops);
 *   no NCCL    two fresh daemons told to load an NCCL that is not there: a
 *              device op across them is refused on each rank with the reason,
 *              and a host op across them still runs.
 *   cap        two fresh daemons with gpu_device_staging_bytes at its least
 *              (1 MiB): an fp32 all-reduce of 2 MiB a rank, one rank each,
 *              would stage the other daemon's input in 2 MiB of GPU memory: it
 *              is refused on both ranks with LIMIT naming the option; the next
 *              all-reduce, of 64 KiB, runs on the same daemons and is right.
 *
 * Exits 77 (skipped) with the reason when there is no usable GPU, or when the
 * daemons cannot load NCCL.
 */
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "sp_gpu_regions.h"
#include "sp_gpu_alltoallv.h"
#include "sp_kern_cuda.h"
#include "sp_xdev_cases.h"

#define NODES    2
#define MAXP     4
#define TMO      60000
#define MISSING  "/nonexistent/spd-test/libnccl.so.2"

static sp_test_daemon_t nodes[NODES];
static char dir[64] = "/tmp/spd-nccl-XXXXXX", secret[128];
static char job_id[SPC_JOB_ID_MAX];

static int node_of(int rank, int P)
{
    return rank * NODES / P;
}

/* ================================================================ jobs over the two daemons */

enum scenario { OPS, KILL, NO_NCCL, CAP };

typedef struct rank_arg {
    int rank, P, scenario;
} rank_arg_t;

/* What the ranks of the kill scenario tell the parent. */
typedef struct kill_state {
    volatile int warm[NODES];     /* the communicator works: the big ops begin */
    volatile int done;            /* rank 0's all-gathers, before one failed */
    volatile int status;
    char         detail[256];
} kill_state_t;
static kill_state_t *ks;

/* The ops of the OPS scenario meant to fail, by the daemon of their rank: spd counts them in ops_failed. */
static int *expect_failed;

/* ================================================================ stream order across the daemons */

/* Small integers: every sum over the ranks is exact in fp32. */
static float stream_input(int rank, int iter, uint64_t i)
{
    return (float)((rank + 1) * 1000 + iter) + (float)(i % 7);
}

/* Element i of y (on the device) must be 1 + 2 + ... + P (every rank's x holds its rank + 1). */
static void check_stream_sum(cudaStream_t cs, const float *y, uint64_t i, int P, int rank, const char *what)
{
    float got;
    CUDA_CHECK(cudaMemcpyAsync(&got, y + i, sizeof got, cudaMemcpyDeviceToHost, cs));
    CUDA_CHECK(cudaStreamSynchronize(cs));
    if (got != (float)(P * (P + 1) / 2))
        SP_FAIL("rank %d, P %d, %s: element %" PRIu64 " is %g, want %g", rank, P, what, i, got,
                (float)(P * (P + 1) / 2));
}

#define STREAM_ITERS 8
#define STREAM_N     (1u << 20)   /* 4 MiB of fp32: long enough for a missed wait to show */

/*
 * Ops in client streams' order across the daemons. order: all-reduces on each
 * rank's stream, each input copied in just before on the stream, parts of each
 * result copied out just after, stalls on some ranks, one synchronize at the
 * end: an op that did not wait for its ranks' ready would sum old inputs, a
 * copy that did not wait for done would read an old result. late: the last
 * rank (node-1's) holds its stream past the op's timeout: it hears TIMEOUT,
 * every other rank a failure (node-1 gave up on it, or its NCCL wait timed
 * out), and a new stream then works on every rank. Returns how many of this
 * rank's ops spd counts as failed.
 */
static int test_stream_across(spc_handle_t *h, spc_group_t world, int rank, int P)
{
    const uint64_t bytes = (uint64_t)STREAM_N * sizeof(float);
    spc_region_t rx, ry;
    float *x = dev_put(h, NULL, bytes, &rx), *y = dev_put(h, NULL, bytes, &ry);
    float *in, *out;
    CUDA_CHECK(cudaMallocHost((void **)&in, STREAM_ITERS * bytes));
    CUDA_CHECK(cudaMallocHost((void **)&out, STREAM_ITERS * 4 * sizeof(float)));
    for (int it = 0; it < STREAM_ITERS; it++)
        for (uint64_t i = 0; i < STREAM_N; i++)
            in[(size_t)it * STREAM_N + i] = stream_input(rank, it, i);

    /* order: everything enqueued without a wait on the host. */
    cudaStream_t cs;
    CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    spc_stream_t *s;
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_set_stream(h, s));
    for (int it = 0; it < STREAM_ITERS; it++) {
        sp_gpu_stall(cs, it % P == rank ? 20 : 1);
        CUDA_CHECK(cudaMemcpyAsync(x, in + (size_t)it * STREAM_N, bytes, cudaMemcpyHostToDevice, cs));
        CHECK_OK(h, spc_allreduce(h, world, x, y, STREAM_N, SPC_F32, SPC_SUM, TMO));   /* enqueued: returns at once */
        /* Three early elements and the last: each written by the sum, none by the copy in. */
        CUDA_CHECK(cudaMemcpyAsync(out + it * 4, y, 3 * sizeof(float), cudaMemcpyDeviceToHost, cs));
        CUDA_CHECK(cudaMemcpyAsync(out + it * 4 + 3, y + STREAM_N - 1, sizeof(float), cudaMemcpyDeviceToHost, cs));
    }
    CHECK_EQ(spc_stream_seq(s), STREAM_ITERS);
    CHECK_OK(h, spc_stream_synchronize(s));
    for (int it = 0; it < STREAM_ITERS; it++) {
        const uint64_t idx[4] = { 0, 1, 2, STREAM_N - 1 };
        for (int k = 0; k < 4; k++) {
            float want = 0;
            for (int q = 0; q < P; q++)
                want += stream_input(q, it, idx[k]);
            if (out[it * 4 + k] != want)
                SP_FAIL("rank %d, P %d, stream op %d across daemons, element %" PRIu64 ": %g from spd, %g expected "
                        "(the stream order was not kept)", rank, P, it, idx[k], out[it * 4 + k], want);
        }
    }
    CHECK_OK(h, spc_stream_destroy(s));
    CHECK(spc_get_stream(h) == NULL);
    CUDA_CHECK(cudaStreamDestroy(cs));

    /* late: every x holds rank + 1; the last rank's stream is held 1.5 s, the op's timeout is 300 ms. */
    for (uint64_t i = 0; i < STREAM_N; i++)
        in[i] = (float)(rank + 1);
    CUDA_CHECK(cudaMemcpy(x, in, bytes, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaDeviceSynchronize());
    const uint64_t n = 1024;
    const bool late = rank == P - 1;
    CHECK_EQ(node_of(P - 1, P), 1);
    CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_set_stream(h, s));
    if (late)
        sp_gpu_stall(cs, 1500);
    spc_request_t *req;
    CHECK_OK(h, sp_gpu_stream_allreduce(h, world, x, y, n, 300, &req));
    spc_status_t st = spc_wait(req, 10000);
    printf("P = %d, rank %d (node-%d), late rank %d: %s: %s\n", P, rank, node_of(rank, P), P - 1,
           spc_status_name(st), spc_request_detail(req));
    if (late) {
        if (st != SPC_ERR_TIMEOUT)
            SP_FAIL("rank %d, P %d, its stream late: %s (%s); want SPC_ERR_TIMEOUT", rank, P, spc_status_name(st),
                    spc_request_detail(req));
        CHECK_CONTAINS(spc_request_detail(req), "did not reach");
    } else if (st == SPC_OK || st == SPC_IN_PROGRESS) {
        SP_FAIL("rank %d, P %d: %s with rank %d's stream late; want the op failed (PEER_REFUSED or TIMEOUT)", rank, P,
                spc_status_name(st), P - 1);
    }
    spc_request_release(req);
    CHECK_ST(h, spc_stream_synchronize(s), st);   /* the stream holds the op's error */
    /* The late rank's stream is broken: destroyed, saying what it was. The
     * others' went on. */
    CHECK_ST(h, spc_stream_destroy(s), late ? SPC_ERR_CANCELED : SPC_OK);
    CHECK(spc_get_stream(h) == NULL);
    CUDA_CHECK(cudaStreamDestroy(cs));

    /* A new stream on every rank: stream order across the daemons works again. */
    CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_set_stream(h, s));
    CUDA_CHECK(cudaMemsetAsync(y, 0, bytes, cs));
    sp_gpu_stall(cs, late ? 20 : 1);
    CHECK_OK(h, spc_allreduce(h, world, x, y, n, SPC_F32, SPC_SUM, TMO));
    CHECK_OK(h, spc_stream_synchronize(s));
    check_stream_sum(cs, y, 0, P, rank, "after a late rank, on new streams");
    check_stream_sum(cs, y, n - 1, P, rank, "after a late rank, on new streams");
    CHECK_OK(h, spc_stream_destroy(s));
    CUDA_CHECK(cudaStreamDestroy(cs));

    dev_drop(h, x, rx);
    dev_drop(h, y, ry);
    CUDA_CHECK(cudaFreeHost(in));
    CUDA_CHECK(cudaFreeHost(out));
    return 1;   /* the late op */
}

static void run_ops(spc_handle_t *h, spc_group_t world, int rank, int P)
{
    int cases = run_a2a_cases(h, world, rank, P);
    test_shift(h, world, rank, P, 0, 0, 1);
    test_shift(h, world, rank, P, 0, SPC_SHIFT_LINEAR, 1);
    test_shift(h, world, rank, P, 1, SPC_SHIFT_REVERSE, 2);
    test_allreduce(h, world, rank, P, SPC_F32, false);
    test_allreduce(h, world, rank, P, SPC_F64, true);
    test_allreduce16(h, world, rank, P, SPC_BF16, SPC_SUM);
    test_allreduce16(h, world, rank, P, SPC_F16, SPC_SUM);
    test_allreduce16(h, world, rank, P, SPC_BF16, SPC_MAX);
    test_gather_bcast(h, world, rank, P);
    dev_alltoallv(h, world, rank, P, 0);
    dev_alltoallv(h, world, rank, P, 2);
    int failed = test_stream_across(h, world, rank, P);
    __atomic_add_fetch(&expect_failed[node_of(rank, P)], failed, __ATOMIC_SEQ_CST);
    if (rank == 0)
        printf("P = %d (%d + %d ranks): %d alltoall cases there and back, shifts on 2 channels, allreduce (fp32, fp64, "
               "fp16, bf16, max), allgather, broadcast, alltoallv: bit for bit; %d all-reduces in stream order across daemons: "
               "right; a late rank failed on every rank, new streams then right\n", P, (P + 1) / 2,
               P - (P + 1) / 2, cases, STREAM_ITERS);
}

/* Two ranks, one per daemon: all-gathers of 256 MiB until node-1 dies. */
static void run_kill(spc_handle_t *h, spc_group_t world, int rank)
{
    const uint64_t count = 64ull << 20;   /* fp32: 256 MiB a rank */
    spc_region_t rs, rr, rw;
    float one = 1.0f;
    void *dw = dev_put(h, &one, sizeof one, &rw);
    void *ds = dev_put(h, NULL, count * 4, &rs), *dr = dev_put(h, NULL, 2 * count * 4, &rr);
    CHECK_OK(h, spc_allreduce(h, world, dw, dw, 1, SPC_F32, SPC_SUM, TMO));   /* the communicator, made */
    ks->warm[rank] = 1;
    spc_status_t st = SPC_OK;
    int k;
    for (k = 0; k < 500 && st == SPC_OK; k++)
        st = spc_allgather(h, world, ds, dr, count, SPC_F32, TMO);
    if (rank == 0) {
        ks->done = k - 1;
        ks->status = st;
        snprintf(ks->detail, sizeof ks->detail, "%s", spc_last_error(h));
        if (st != SPC_ERR_PEER_LOST)
            SP_FAIL("rank 0: %s after %d all-gathers, expected SPC_ERR_PEER_LOST (%s)", spc_status_name(st), k - 1,
                    spc_last_error(h));
        CHECK_CONTAINS(spc_last_error(h), "node node-1 lost");
        dev_drop(h, ds, rs);
        dev_drop(h, dr, rr);
        dev_drop(h, dw, rw);
    }
}

static void run_no_nccl(spc_handle_t *h, spc_group_t world, int rank)
{
    spc_region_t r;
    float x[16] = { 0 };
    void *d = dev_put(h, x, sizeof x, &r);
    CHECK_ST(h, spc_allreduce(h, world, d, d, 16, SPC_F32, SPC_SUM, TMO), SPC_ERR_NO_DEVICE);
    CHECK_CONTAINS(spc_last_error(h), "needs NCCL");
    CHECK_CONTAINS(spc_last_error(h), MISSING);
    char why[256];
    snprintf(why, sizeof why, "%s", spc_last_error(h));
    dev_drop(h, d, r);
    /* Host memory still crosses the daemons. */
    int64_t *y = spc_alloc(h, sizeof *y);
    *y = rank + 1;
    CHECK_OK(h, spc_allreduce(h, world, y, y, 1, SPC_I64, SPC_SUM, TMO));
    CHECK_EQ(*y, 3);
    if (rank == 0)
        printf("no NCCL: refused as \"%s\"; host ops still cross\n", why);
}

/* Past gpu_device_staging_bytes (1 MiB on both daemons), then within it. */
static void run_cap(spc_handle_t *h, spc_group_t world, int rank)
{
    const uint64_t big = 512ull << 10, small = 16ull << 10;   /* fp32: 2 MiB and 64 KiB */
    spc_region_t r;
    float *x = malloc(big * sizeof *x);
    for (uint64_t i = 0; i < big; i++)
        x[i] = (float)(rank + 1) * (float)(i % 1000);
    void *d = dev_put(h, x, big * sizeof *x, &r);
    CHECK_ST(h, spc_allreduce(h, world, d, d, big, SPC_F32, SPC_SUM, TMO), SPC_ERR_LIMIT);
    CHECK_CONTAINS(spc_last_error(h), "gpu_device_staging_bytes");
    char why[256];
    snprintf(why, sizeof why, "%s", spc_last_error(h));
    CHECK_OK(h, spc_allreduce(h, world, d, d, small, SPC_F32, SPC_SUM, TMO));
    for (uint64_t i = 0; i < small; i++)
        x[i] = 3.0f * (float)(i % 1000);   /* ranks 1 and 2: exact in fp32 */
    dev_check(d, x, small * sizeof *x, "all-reduce within gpu_device_staging_bytes", rank);
    dev_drop(h, d, r);
    free(x);
    if (rank == 0)
        printf("cap: refused as \"%s\"; the next all-reduce within it right\n", why);
}

static int rank_main(void *p)
{
    const rank_arg_t *ra = p;
    setenv("SPC_SOCKET", nodes[node_of(ra->rank, ra->P)].sock, 1);
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, (uint32_t)ra->P, (uint32_t)ra->rank, 20000, &world));
    CUDA_CHECK(cudaSetDevice(0));
    switch (ra->scenario) {
    case OPS:     run_ops(h, world, ra->rank, ra->P); break;
    case KILL:    run_kill(h, world, ra->rank); break;
    case NO_NCCL: run_no_nccl(h, world, ra->rank); break;
    case CAP:     run_cap(h, world, ra->rank); break;
    }
    spc_detach(h);
    return 0;
}

/* A job created on node-0 whose ranks attach to their nodes; the creator stays
 * attached (a job nobody holds ends) until the caller detaches the handle. */
static spc_handle_t *start_job(int P, int scenario, pid_t *pids)
{
    setenv("SPC_SOCKET", nodes[0].sock, 1);
    spc_handle_t *owner = sp_test_attach();
    CHECK_OK(owner, spc_job_create(owner, job_id, sizeof job_id));
    for (int r = 0; r < P; r++) {
        rank_arg_t ra = { r, P, scenario };
        pids[r] = sp_test_fork(rank_main, &ra);
    }
    return owner;
}

/* ================================================================ the daemons */

/* NCCL between daemons on one host needs its network transport: over loopback
 * sockets here, whatever the operator's environment says otherwise. */
static void nccl_env(void)
{
    setenv("NCCL_SOCKET_IFNAME", "lo", 0);
    setenv("NCCL_IB_DISABLE", "1", 0);
    setenv("NCCL_P2P_DISABLE", "1", 0);
    setenv("NCCL_SHM_DISABLE", "1", 0);
    setenv("NCCL_DEBUG", "WARN", 0);
    unsetenv("NCCL_HOSTID");   /* spd sets it per daemon */
}

/* Whether a GPU is usable, asked in a child: CUDA must not start in this
 * process before it forks the ranks. */
static void scenario_ops(void)
{
    pid_t pids[MAXP];
    expect_failed = sp_test_shared(NODES * sizeof *expect_failed);
    for (int P = 2; P <= MAXP; P++) {
        spc_handle_t *owner = start_job(P, OPS, pids);
        sp_test_wait_all_ok(pids, P, 300000);
        spc_detach(owner);
    }
    /* Only the late stream ops failed (one a rank, on its daemon). */
    char out[16384];
    for (int i = 0; i < NODES; i++) {
        sp_test_node_status(&nodes[i], out, sizeof out);
        CHECK_EQ(sp_test_json_int(out, "ops_failed"), __atomic_load_n(&expect_failed[i], __ATOMIC_SEQ_CST));
    }
}

static void scenario_kill(void)
{
    pid_t pids[2];
    char out[16384];
    ks = sp_test_shared(sizeof *ks);
    spc_handle_t *owner = start_job(2, KILL, pids);
    uint64_t deadline = sp_test_now_ms() + 120000;
    while (!(ks->warm[0] && ks->warm[1]) && sp_test_now_ms() < deadline)
        usleep(10000);
    CHECK(ks->warm[0] && ks->warm[1]);
    /* Kill as soon as node-0 has an all-gather with NCCL: mid-transfer, most
     * likely (each moves 256 MiB each way); if not, the next op finds it gone. */
    do
        sp_test_node_status(&nodes[0], out, sizeof out);
    while (sp_test_json_int(out, "nccl_ops_inflight") == 0 && sp_test_now_ms() < deadline);
    CHECK(kill(nodes[1].pid, SIGKILL) == 0);
    CHECK_EQ(sp_test_wait(nodes[1].pid, 10000), -SIGKILL);
    nodes[1].pid = 0;
    CHECK_EQ(sp_test_wait(pids[0], 60000), 0);
    /* Rank 1 lost its daemon: its own calls fail; it is not what is tested. */
    if (sp_test_wait(pids[1], 30000) == -1000)
        printf("rank 1 did not exit with its daemon gone; killed\n");
    spc_detach(owner);
    char grep[256];
    int aborted = sp_test_run(grep, sizeof grep, "grep -c 'communicator aborted' %s", nodes[0].log) == 0;
    printf("lost: node-1 killed after %d all-gathers of rank 0; it got %s (%s); %s\n", ks->done,
           spc_status_name(ks->status), ks->detail,
           aborted ? "node-0 aborted its communicator in flight" : "node-0's op had not reached NCCL");
}

/* node-0 alone, after losing node-1: device ops on its GPU, host ops. */
static int survivor(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    CUDA_CHECK(cudaSetDevice(0));
    test_allreduce(h, world, rank, P, SPC_F32, false);
    test_gather_bcast(h, world, rank, P);
    int64_t *y = spc_alloc(h, sizeof *y);
    *y = rank + 1;
    CHECK_OK(h, spc_allreduce(h, world, y, y, 1, SPC_I64, SPC_SUM, TMO));
    CHECK_EQ(*y, P * (P + 1) / 2);
    return 0;
}

static void scenario_survivors(void)
{
    setenv("SPC_SOCKET", nodes[0].sock, 1);
    sp_test_run_job(2, survivor, NULL);
    spc_handle_t *h = sp_test_attach();
    /* The lost job's communicator went with it. */
    if (!sp_test_wait_status(h, "nccl_comms", 0, 10000))
        SP_FAIL("node-0 still holds NCCL communicators after every job across daemons ended");
    spc_detach(h);
    printf("survivors: node-0 serves device and host ops; no communicator left\n");
}

static void scenario_no_nccl(void)
{
    pid_t pids[2];
    setenv("SPD_NCCL_LIBRARY", MISSING, 1);
    sp_test_node_pair_start(nodes, secret);
    unsetenv("SPD_NCCL_LIBRARY");
    spc_handle_t *owner = start_job(2, NO_NCCL, pids);
    sp_test_wait_all_ok(pids, 2, 120000);
    spc_detach(owner);
    sp_test_node_pair_stop(nodes);
}

static void scenario_cap(void)
{
    pid_t pids[2];
    setenv("SPD_GPU_DEVICE_STAGING_BYTES", "1M", 1);
    sp_test_node_pair_start(nodes, secret);
    unsetenv("SPD_GPU_DEVICE_STAGING_BYTES");
    spc_handle_t *owner = start_job(2, CAP, pids);
    sp_test_wait_all_ok(pids, 2, 120000);
    spc_detach(owner);
    sp_test_node_pair_stop(nodes);
}

int main(void)
{
    if (sp_gpu_test_probe() == SP_TEST_SKIP)
        return SP_TEST_SKIP;
    nccl_env();
    CHECK(mkdtemp(dir) != NULL);
    sp_test_secret_file(dir, "secret", "two daemons, one GPU, 2026\n", secret, sizeof secret);

    sp_test_node_pair_start(nodes, secret);
    char out[16384], nccl[512];
    sp_test_node_status(&nodes[0], out, sizeof out);
    sp_test_json_str(out, "transport_nccl", nccl, sizeof nccl);
    printf("node-0: transport_nccl: %s\n", nccl);
    if (strstr(nccl, "refused") != NULL) {
        fprintf(stderr, "skipped: the daemons cannot run device ops across daemons: %s\n", nccl);
        sp_test_node_pair_stop(nodes);
        sp_test_run(out, sizeof out, "rm -rf %s", dir);
        return SP_TEST_SKIP;
    }
    scenario_ops();
    scenario_kill();
    scenario_survivors();
    sp_test_node_stop(&nodes[0]);
    sp_test_daemon_cleanup(&nodes[1]);
    scenario_no_nccl();
    scenario_cap();
    sp_test_run(out, sizeof out, "rm -rf %s", dir);
    printf("nccl_nodes: ok\n");
    return 0;
}
