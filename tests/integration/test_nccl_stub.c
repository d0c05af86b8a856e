/*
 * Device ops across daemons without a GPU: two spd_stub daemons linked on
 * loopback, each a node, on the stand-in driver (tests/stubcuda) and the
 * stand-in NCCL (tests/stubnccl), which carries their bytes over sockets as
 * stand-in kernels; rank processes with tensors in stand-in device memory.
 * The whole path runs: ids over the peer links, communicators, groups of
 * sends and receives, xdev.c's plans and kernels. Every result is compared
 * byte for byte with host references computed here from every rank's inputs:
 *
 *   ops        P = 2, 3 and 4 ranks over the two daemons (1+1, 2+1, 2+2):
 *              the cases of sp_xdev_cases.h (alltoall both ways, every case
 *              of sp_kern_cases.h for P and two multi-tensor ones; shift
 *              cyclic, linear, reversed on a second channel; allreduce fp32,
 *              fp64 in place, bf16, fp16, bf16 max; allgather; broadcast from
 *              either daemon) and alltoallv, host-synchronous; then 8 fp32
 *              all-reduces in client streams' order, each input written and
 *              each result read by stand-in kernels on the rank's stream,
 *              some ranks' streams stalled, one synchronize at the end;
 *              then the last rank (node-1's) holds its stream 1.5 s past an
 *              op's 300 ms timeout: it gets TIMEOUT saying its stream did not
 *              reach the op, every other rank a failure, never OK; new streams
 *              then give the right sum; spd's ops_failed counts exactly those;
 *   fresh      an op that fails (past gpu_device_staging_bytes) between two
 *              that run: the failure aborts the communicator and the next op
 *              runs, right, on a fresh one (node-0's log says so);
 *   lost       node-1 SIGKILLed while its rank and node-0's exchange 16 MiB
 *              all-gathers: node-0's rank gets PEER_LOST naming node-1; node-0
 *              then serves a new job (device and host ops), its
 *              communicators gone.
 * After each job every communicator is gone from both daemons.
 */
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include "sp_stub_regions.h"
#include "sp_gpu_alltoallv.h"
#include "sp_xdev_cases.h"

#define NODES 2
#define TMO   60000

static sp_test_daemon_t nodes[NODES];
static char dir[64] = "/tmp/spd-nccl-stub-XXXXXX", secret[128];
static char job_id[SPC_JOB_ID_MAX];

static int node_of(int rank, int P)
{
    return rank * NODES / P;
}

static void gpu_bind(int gpu)
{
    void *ctx;
    CHECK_EQ(cuDevicePrimaryCtxRetain(&ctx, gpu), STUB_SUCCESS);
    CHECK_EQ(cuCtxSetCurrent(ctx), STUB_SUCCESS);
}

/* ================================================================ stream order across the daemons */

#define STREAM_ITERS 8
#define STREAM_N     (64u << 10)

/* Small integers: every sum over the ranks is exact in fp32. */
static float stream_input(int rank, int iter, uint32_t i)
{
    return (float)((rank + 1) * 1000 + iter) + (float)(i % 7);
}

typedef struct fill {
    float *p;
    int    rank, iter;
} fill_t;

static void fill_run(void *arg)
{
    const fill_t *f = arg;
    for (uint32_t i = 0; i < STREAM_N; i++)
        f->p[i] = stream_input(f->rank, f->iter, i);
}

static void sleep_run(void *arg)
{
    usleep((useconds_t)(intptr_t)arg * 1000);
}

/* x = rank + 1 everywhere, written on the stream. */
static void ones_run(void *arg)
{
    const fill_t *f = arg;
    for (uint32_t i = 0; i < STREAM_N; i++)
        f->p[i] = (float)(f->rank + 1);
}

/*
 * order: each input written on the rank's stream just before its all-reduce,
 * each whole result copied out just after (cuMemcpyDtoHAsync), some ranks'
 * streams stalled, nothing waited for on the host until the end: an op that
 * did not wait for its ranks' ready would sum an old input, a copy that did
 * not wait for its done would read an old result. late: the last rank
 * (node-1's) holds its stream 1.5 s past the op's 300 ms timeout: it hears
 * TIMEOUT saying its stream did not reach the op, every other rank a failure
 * (node-1 gave up on it, or the transfers timed out), never OK; its stream is
 * broken, and new streams on every rank then give the right sum. Returns how
 * many of this rank's ops spd counts as failed.
 */
static int test_stream_across(spc_handle_t *h, spc_group_t world, int rank, int P)
{
    const uint64_t bytes = (uint64_t)STREAM_N * sizeof(float);
    spc_region_t rx, ry;
    float *x = dev_put(h, NULL, bytes, &rx), *y = dev_put(h, NULL, bytes, &ry);
    float *out = malloc(STREAM_ITERS * bytes);
    fill_t fills[STREAM_ITERS];
    CHECK(out != NULL);
    void *cs;
    CHECK_EQ(cuStreamCreate(&cs, 1), STUB_SUCCESS);
    spc_stream_t *s;
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_set_stream(h, s));
    for (int it = 0; it < STREAM_ITERS; it++) {
        fills[it] = (fill_t){ x, rank, it };
        CHECK_EQ(cuLaunchHostFunc(cs, sleep_run, (void *)(intptr_t)(it % P == rank ? 20 : 1)), STUB_SUCCESS);
        CHECK_EQ(cuLaunchHostFunc(cs, fill_run, &fills[it]), STUB_SUCCESS);
        CHECK_OK(h, spc_allreduce(h, world, x, y, STREAM_N, SPC_F32, SPC_SUM, TMO));   /* enqueued: returns at once */
        CHECK_EQ(cuMemcpyDtoHAsync_v2(out + (size_t)it * STREAM_N, (stub_ptr_t)(uintptr_t)y, bytes, cs), STUB_SUCCESS);
    }
    CHECK_EQ(spc_stream_seq(s), STREAM_ITERS);
    CHECK_OK(h, spc_stream_synchronize(s));
    for (int it = 0; it < STREAM_ITERS; it++)
        for (uint32_t i = 0; i < STREAM_N; i++) {
            float want = 0;
            for (int q = 0; q < P; q++)
                want += stream_input(q, it, i);
            if (out[(size_t)it * STREAM_N + i] != want)
                SP_FAIL("rank %d, P %d, stream op %d across daemons, element %u: %g from spd, %g expected (the "
                        "stream order was not kept)", rank, P, it, i, out[(size_t)it * STREAM_N + i], want);
        }
    CHECK_OK(h, spc_stream_destroy(s));
    CHECK_EQ(cuStreamDestroy_v2(cs), STUB_SUCCESS);

    /* late */
    const bool late = rank == P - 1;
    CHECK_EQ(node_of(P - 1, P), 1);
    fill_t ones = { x, rank, 0 };
    CHECK_EQ(cuStreamCreate(&cs, 1), STUB_SUCCESS);
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_set_stream(h, s));
    CHECK_EQ(cuLaunchHostFunc(cs, ones_run, &ones), STUB_SUCCESS);
    if (late)
        CHECK_EQ(cuLaunchHostFunc(cs, sleep_run, (void *)(intptr_t)1500), STUB_SUCCESS);
    spc_op_t op = { .struct_size = sizeof op, .opcode = SPC_OP_ALLREDUCE, .group = world, .dtype = SPC_F32,
                    .redop = SPC_SUM, .count = STREAM_N, .ntensors = 2, .timeout_ms = 300 };
    op.tensors[0].ptr = x;
    op.tensors[1].ptr = y;
    spc_request_t *req;
    CHECK_OK(h, spc_submit(h, &op, &req));
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
    CHECK_ST(h, spc_stream_destroy(s), late ? SPC_ERR_CANCELED : SPC_OK);
    CHECK(spc_get_stream(h) == NULL);
    CHECK_EQ(cuStreamDestroy_v2(cs), STUB_SUCCESS);

    /* A new stream on every rank: stream order across the daemons works again. */
    CHECK_EQ(cuStreamCreate(&cs, 1), STUB_SUCCESS);
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_set_stream(h, s));
    CHECK_EQ(cuLaunchHostFunc(cs, sleep_run, (void *)(intptr_t)(late ? 20 : 1)), STUB_SUCCESS);
    CHECK_OK(h, spc_allreduce(h, world, x, y, STREAM_N, SPC_F32, SPC_SUM, TMO));
    CHECK_OK(h, spc_stream_synchronize(s));
    for (uint32_t i = 0; i < STREAM_N; i++)
        if (y[i] != (float)(P * (P + 1) / 2))
            SP_FAIL("rank %d, P %d, after a late rank, on new streams: element %u is %g, want %g", rank, P, i, y[i],
                    (float)(P * (P + 1) / 2));
    CHECK_OK(h, spc_stream_destroy(s));
    CHECK_EQ(cuStreamDestroy_v2(cs), STUB_SUCCESS);

    dev_drop(h, x, rx);
    dev_drop(h, y, ry);
    free(out);
    return 1;   /* the late op */
}

/* ================================================================ the ranks */

enum scenario { OPS, FRESH, KILL };

typedef struct rank_arg {
    int rank, P, scenario;
} rank_arg_t;

/* What the ranks of the kill scenario tell the parent. */
typedef struct kill_state {
    volatile int warm[NODES];     /* the communicator works: the big ops begin */
    volatile int done;            /* rank 0's all-gathers before one failed */
    volatile int status;
    char         detail[256];
} kill_state_t;
static kill_state_t *ks;

/* The ops of the ops scenario meant to fail, by the daemon of their rank: spd counts them in ops_failed. */
static int *expect_failed;

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
        printf("P = %d (%d + %d ranks): %d alltoall cases there and back, shifts on 2 channels, allreduce (fp32, "
               "fp64, fp16, bf16, max), allgather, broadcast, alltoallv: byte for byte; %d all-reduces in stream "
               "order across daemons: right; a late rank failed on every rank, new streams then right\n", P,
               (P + 1) / 2, P - (P + 1) / 2, cases, STREAM_ITERS);
}

/* A right all-reduce of 64 KiB (fp32), the same of 2 MiB refused past
 * gpu_device_staging_bytes (1 MiB), then the small one right again. */
static void run_fresh(spc_handle_t *h, spc_group_t world, int rank)
{
    const uint64_t big = 512ull << 10, small = 16ull << 10;
    spc_region_t r;
    float *x = malloc(big * sizeof *x), *want = malloc(small * sizeof *want);
    CHECK(x != NULL && want != NULL);
    for (uint64_t i = 0; i < big; i++)
        x[i] = (float)(rank + 1) * (float)(i % 1000);
    for (uint64_t i = 0; i < small; i++)
        want[i] = 3.0f * (float)(i % 1000);   /* ranks 1 and 2: exact in fp32 */
    void *d = dev_put(h, x, big * sizeof *x, &r);
    spc_region_t ry;
    void *dy = dev_put(h, NULL, small * sizeof *x, &ry);
    CHECK_OK(h, spc_allreduce(h, world, d, dy, small, SPC_F32, SPC_SUM, TMO));
    dev_check(dy, want, small * sizeof *want, "all-reduce before the failed one", rank);
    CHECK_ST(h, spc_allreduce(h, world, d, d, big, SPC_F32, SPC_SUM, TMO), SPC_ERR_LIMIT);
    CHECK_CONTAINS(spc_last_error(h), "gpu_device_staging_bytes");
    memset(dy, 0, small * sizeof *x);
    CHECK_OK(h, spc_allreduce(h, world, d, dy, small, SPC_F32, SPC_SUM, TMO));
    dev_check(dy, want, small * sizeof *want, "all-reduce after the failed one", rank);
    dev_drop(h, d, r);
    dev_drop(h, dy, ry);
    free(x);
    free(want);
}

/* Two ranks, one per daemon: all-gathers of 16 MiB until node-1 dies. */
static void run_kill(spc_handle_t *h, spc_group_t world, int rank)
{
    const uint64_t count = 4ull << 20;   /* fp32: 16 MiB a rank */
    spc_region_t rs, rr, rw;
    float one = 1.0f;
    void *dw = dev_put(h, &one, sizeof one, &rw);
    void *ds = dev_put(h, NULL, count * 4, &rs), *dr = dev_put(h, NULL, 2 * count * 4, &rr);
    CHECK_OK(h, spc_allreduce(h, world, dw, dw, 1, SPC_F32, SPC_SUM, TMO));   /* the communicator, made */
    ks->warm[rank] = 1;
    spc_status_t st = SPC_OK;
    int k;
    for (k = 0; k < 100000 && st == SPC_OK; k++)
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

/* node-0 alone, after losing node-1. */
static int survivor(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    gpu_bind(0);
    test_allreduce(h, world, rank, P, SPC_F32, false);
    test_gather_bcast(h, world, rank, P);
    int64_t *y = spc_alloc(h, sizeof *y);
    *y = rank + 1;
    CHECK_OK(h, spc_allreduce(h, world, y, y, 1, SPC_I64, SPC_SUM, TMO));
    CHECK_EQ(*y, P * (P + 1) / 2);
    return 0;
}

static int rank_main(void *p)
{
    const rank_arg_t *ra = p;
    setenv("SPC_SOCKET", nodes[node_of(ra->rank, ra->P)].sock, 1);
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, (uint32_t)ra->P, (uint32_t)ra->rank, 20000, &world));
    gpu_bind(0);
    switch (ra->scenario) {
    case OPS:   run_ops(h, world, ra->rank, ra->P); break;
    case FRESH: run_fresh(h, world, ra->rank); break;
    case KILL:  run_kill(h, world, ra->rank); break;
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

static void scenario_ops(void)
{
    pid_t pids[SP_XDEV_MAXP];
    expect_failed = sp_test_shared(NODES * sizeof *expect_failed);
    for (int P = 2; P <= SP_XDEV_MAXP; P++) {
        spc_handle_t *owner = start_job(P, OPS, pids);
        sp_test_wait_all_ok(pids, P, 150000);
        spc_detach(owner);
    }
    char out[16384];
    for (int i = 0; i < NODES; i++) {
        /* The jobs ended: every communicator went (destroyed, or aborted after a failure). */
        setenv("SPC_SOCKET", nodes[i].sock, 1);
        spc_handle_t *h = sp_test_attach();
        if (!sp_test_wait_status(h, "nccl_comms", 0, 10000))
            SP_FAIL("node-%d still holds NCCL communicators after every job across daemons ended", i);
        spc_detach(h);
        sp_test_node_status(&nodes[i], out, sizeof out);
        CHECK_EQ(sp_test_json_int(out, "ops_failed"), __atomic_load_n(&expect_failed[i], __ATOMIC_SEQ_CST));
    }
}

static void scenario_fresh(void)
{
    pid_t pids[2];
    setenv("SPD_GPU_DEVICE_STAGING_BYTES", "1M", 1);
    sp_test_node_pair_start(nodes, secret);
    unsetenv("SPD_GPU_DEVICE_STAGING_BYTES");
    spc_handle_t *owner = start_job(2, FRESH, pids);
    sp_test_wait_all_ok(pids, 2, 60000);
    spc_detach(owner);
    /* The first op made a communicator, the failed one aborted it, the third made another. */
    CHECK_EQ(sp_test_log_count(&nodes[0], "communicator from op"), 2);
    CHECK(sp_test_log_count(&nodes[0], "communicator aborted") >= 1);
    printf("fresh: an all-reduce refused past gpu_device_staging_bytes aborted the communicator; the next ran "
           "right on a fresh one\n");
    sp_test_node_pair_stop(nodes);
}

static void scenario_kill(void)
{
    pid_t pids[2];
    char out[16384];
    ks = sp_test_shared(sizeof *ks);
    sp_test_node_pair_start(nodes, secret);
    spc_handle_t *owner = start_job(2, KILL, pids);
    uint64_t deadline = sp_test_now_ms() + 60000;
    while (!(ks->warm[0] && ks->warm[1]) && sp_test_now_ms() < deadline)
        usleep(10000);
    CHECK(ks->warm[0] && ks->warm[1]);
    /* Kill as soon as node-0 has an all-gather with NCCL: mid-transfer, most
     * likely; if not, the next op finds it gone. */
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
    printf("lost: node-1 killed after %d all-gathers of rank 0; it got %s (%s)\n", ks->done,
           spc_status_name(ks->status), ks->detail);
    /* node-0 alone serves on: device and host ops, no communicator left. */
    setenv("SPC_SOCKET", nodes[0].sock, 1);
    sp_test_run_job(2, survivor, NULL);
    spc_handle_t *h = sp_test_attach();
    if (!sp_test_wait_status(h, "nccl_comms", 0, 10000))
        SP_FAIL("node-0 still holds NCCL communicators after every job across daemons ended");
    spc_detach(h);
    printf("survivors: node-0 serves device and host ops; no communicator left\n");
    sp_test_node_stop(&nodes[0]);
    sp_test_daemon_cleanup(&nodes[1]);
}

int main(void)
{
    sp_test_use_stub_cuda(SP_STUB_CUDA_DIR);
    setenv("SP_TEST_SPD", SPD_STUB_BIN, 1);
    setenv("SPD_NCCL_LIBRARY", SP_STUB_NCCL_LIB, 1);
    unsetenv("SPD_STUB_CUDA_GPUS");
    CHECK(mkdtemp(dir) != NULL);
    sp_test_secret_file(dir, "secret", "two daemons, one stand-in GPU each\n", secret, sizeof secret);

    sp_test_node_pair_start(nodes, secret);
    char out[16384], nccl[512];
    sp_test_node_status(&nodes[0], out, sizeof out);
    sp_test_json_str(out, "transport_nccl", nccl, sizeof nccl);
    printf("node-0: transport_nccl: %s\n", nccl);
    if (strstr(nccl, "refused") != NULL)
        SP_FAIL("the daemons refuse device ops across daemons on the stand-ins: %s", nccl);
    scenario_ops();
    sp_test_node_pair_stop(nodes);
    scenario_fresh();
    scenario_kill();
    sp_test_run(out, sizeof out, "rm -rf %s", dir);
    printf("nccl_stub: ok\n");
    return 0;
}
