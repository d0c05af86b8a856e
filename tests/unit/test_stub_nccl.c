/*
 * The stand-in NCCL (tests/stubnccl) on its own, between rank processes on the
 * stand-in driver: what test_nccl_stub relies on it to do as NCCL does.
 *
 *   exchange   two ranks, non-blocking communicators (ncclInProgress, then
 *              ncclSuccess from ncclCommGetAsyncError), one group in which
 *              each sends 8 MiB then receives 8 MiB (no deadlock), then two
 *              sends of different sizes matched in order by two receives;
 *              every byte checked;
 *   lost       rank 1 exits after the init: rank 0's receive ends and its
 *              communicator reports ncclRemoteError, ncclGetLastError saying
 *              the peer closed its connection;
 *   abort      rank 0 alone in a communicator of 2: ncclCommAbort stops the
 *              init at once; then with rank 1 there but silent, a queued
 *              receive ends once rank 0 aborts (its stream drains);
 *   mismatch   rank 0 sends 100 bytes where rank 1 receives 200: rank 1's
 *              communicator reports ncclInvalidUsage;
 *   unreachable  a buffer on stand-in GPU 1 sent on GPU 0's stream, no peer
 *              access between them: ncclGroupEnd fails with
 *              ncclUnhandledCudaError, as the kernel would fault on hardware.
 */
#include <nccl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "sp_test.h"
#include "stub_cuda.h"

#define MB8 (8u << 20)

enum { EXCHANGE, LOST, ABORT, MISMATCH };

typedef struct rank_arg {
    int          rank, scenario;
    ncclUniqueId id;
} rank_arg_t;

static void gpu_bind(int gpu)
{
    void *ctx;
    CHECK_EQ(cuDevicePrimaryCtxRetain(&ctx, gpu), STUB_SUCCESS);
    CHECK_EQ(cuCtxSetCurrent(ctx), STUB_SUCCESS);
}

static uint8_t *dev_alloc(size_t n)
{
    stub_ptr_t p;
    CHECK_EQ(cuMemAlloc_v2(&p, n), STUB_SUCCESS);
    return (uint8_t *)(uintptr_t)p;
}

static uint8_t byte_of(int from, size_t i)
{
    return (uint8_t)((i * 2654435761u) >> 7) ^ (uint8_t)(from * 0x5b);
}

/* A non-blocking communicator, polled until it is ready (or fails, returned). */
static ncclResult_t comm_make(ncclComm_t *c, int nranks, ncclUniqueId id, int rank)
{
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(c, nranks, id, rank, &cfg);
    CHECK(r == ncclInProgress || r == ncclSuccess);
    ncclResult_t st = ncclInProgress;
    for (int k = 0; k < 20000 && st == ncclInProgress; k++) {
        CHECK_EQ(ncclCommGetAsyncError(*c, &st), ncclSuccess);
        if (st == ncclInProgress)
            usleep(1000);
    }
    return st;
}

static void check_bytes(const uint8_t *got, int from, size_t n, size_t skip, const char *what)
{
    for (size_t i = 0; i < n; i++)
        if (got[i] != byte_of(from, i + skip))
            SP_FAIL("%s: byte %zu of %zu is 0x%02x, want 0x%02x", what, i, n, got[i], byte_of(from, i + skip));
}

static int rank_main(void *p)
{
    const rank_arg_t *ra = p;
    const int me = ra->rank, peer = 1 - me;
    gpu_bind(0);
    void *s;
    CHECK_EQ(cuStreamCreate(&s, 1), STUB_SUCCESS);
    ncclComm_t c;
    ncclResult_t st;
    switch (ra->scenario) {
    case EXCHANGE: {
        CHECK_EQ(comm_make(&c, 2, ra->id, me), ncclSuccess);
        uint8_t *out = dev_alloc(MB8), *in = dev_alloc(MB8);
        for (size_t i = 0; i < MB8; i++)
            out[i] = byte_of(me, i);
        /* Both send first: one kernel moves both ways at once. */
        CHECK_EQ(ncclGroupStart(), ncclSuccess);
        CHECK_EQ(ncclSend(out, MB8, ncclUint8, peer, c, s), ncclSuccess);
        CHECK_EQ(ncclRecv(in, MB8, ncclUint8, peer, c, s), ncclSuccess);
        CHECK_EQ(ncclGroupEnd(), ncclSuccess);
        CHECK_EQ(cuStreamSynchronize(s), STUB_SUCCESS);
        CHECK_EQ(ncclCommGetAsyncError(c, &st), ncclSuccess);
        CHECK_EQ(st, ncclSuccess);
        check_bytes(in, peer, MB8, 0, "8 MiB each way in one group");
        /* Two sends outside a group, fp32 and then bytes: received in that order. */
        memset(in, 0, MB8);
        if (me == 0) {
            CHECK_EQ(ncclSend(out, 1000, ncclFloat32, peer, c, s), ncclSuccess);
            CHECK_EQ(ncclSend(out + 4000, 333, ncclUint8, peer, c, s), ncclSuccess);
        } else {
            CHECK_EQ(ncclRecv(in, 1000, ncclFloat32, peer, c, s), ncclSuccess);
            CHECK_EQ(ncclRecv(in + 4000, 333, ncclUint8, peer, c, s), ncclSuccess);
        }
        CHECK_EQ(cuStreamSynchronize(s), STUB_SUCCESS);
        CHECK_EQ(ncclCommGetAsyncError(c, &st), ncclSuccess);
        CHECK_EQ(st, ncclSuccess);
        if (me == 1)
            check_bytes(in, peer, 4333, 0, "two sends matched in order");
        CHECK_EQ(ncclCommDestroy(c), ncclSuccess);
        break;
    }
    case LOST: {
        CHECK_EQ(comm_make(&c, 2, ra->id, me), ncclSuccess);
        if (me == 1)
            _exit(0);   /* gone, its socket closed by the kernel */
        uint8_t *in = dev_alloc(MB8);
        CHECK_EQ(ncclRecv(in, MB8, ncclUint8, peer, c, s), ncclSuccess);
        CHECK_EQ(cuStreamSynchronize(s), STUB_SUCCESS);   /* the kernel ended */
        CHECK_EQ(ncclCommGetAsyncError(c, &st), ncclSuccess);
        CHECK_EQ(st, ncclRemoteError);
        CHECK_CONTAINS(ncclGetLastError(c), "closed its connection");
        printf("lost: %s: %s\n", ncclGetErrorString(st), ncclGetLastError(c));
        CHECK_EQ(ncclCommAbort(c), ncclSuccess);
        break;
    }
    case ABORT: {
        CHECK_EQ(comm_make(&c, 2, ra->id, me), ncclSuccess);
        if (me == 1) {
            sleep(3);   /* silent: rank 0 aborts before this ends */
            break;
        }
        uint8_t *in = dev_alloc(4096);
        CHECK_EQ(ncclRecv(in, 4096, ncclUint8, peer, c, s), ncclSuccess);
        CHECK_EQ(cuStreamQuery(s), 600);   /* CUDA_ERROR_NOT_READY: the receive waits */
        uint64_t t0 = sp_test_now_ms();
        CHECK_EQ(ncclCommAbort(c), ncclSuccess);
        CHECK_EQ(cuStreamSynchronize(s), STUB_SUCCESS);
        CHECK(sp_test_now_ms() - t0 < 1000);
        printf("abort: a queued receive ended %d ms after ncclCommAbort\n", (int)(sp_test_now_ms() - t0));
        break;
    }
    case MISMATCH: {
        CHECK_EQ(comm_make(&c, 2, ra->id, me), ncclSuccess);
        uint8_t *buf = dev_alloc(200);
        CHECK_EQ(me == 0 ? ncclSend(buf, 100, ncclUint8, peer, c, s) : ncclRecv(buf, 200, ncclUint8, peer, c, s),
                 ncclSuccess);
        CHECK_EQ(cuStreamSynchronize(s), STUB_SUCCESS);
        if (me == 1) {
            CHECK_EQ(ncclCommGetAsyncError(c, &st), ncclSuccess);
            CHECK_EQ(st, ncclInvalidUsage);
            CHECK_CONTAINS(ncclGetLastError(c), "sent 100 bytes where this rank receives 200");
        }
        CHECK_EQ(ncclCommAbort(c), ncclSuccess);
        break;
    }
    }
    return 0;
}

static void run_pair(int scenario, const char *name)
{
    rank_arg_t ra[2];
    pid_t pids[2];
    ncclUniqueId id;
    CHECK_EQ(ncclGetUniqueId(&id), ncclSuccess);   /* the rendezvous runs in this process, as NCCL's root */
    for (int r = 0; r < 2; r++) {
        ra[r] = (rank_arg_t){ r, scenario, id };
        pids[r] = sp_test_fork(rank_main, &ra[r]);
    }
    sp_test_wait_all_ok(pids, 2, 60000);
    printf("%s: ok\n", name);
}

/* Rank 0 of 2 alone: the init waits for rank 1 until the abort stops it. */
static void abort_init(void)
{
    ncclUniqueId id;
    ncclComm_t c;
    CHECK_EQ(ncclGetUniqueId(&id), ncclSuccess);
    gpu_bind(0);
    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    CHECK_EQ(ncclCommInitRankConfig(&c, 2, id, 0, &cfg), ncclInProgress);
    usleep(100000);
    ncclResult_t st;
    CHECK_EQ(ncclCommGetAsyncError(c, &st), ncclSuccess);
    CHECK_EQ(st, ncclInProgress);
    uint64_t t0 = sp_test_now_ms();
    CHECK_EQ(ncclCommAbort(c), ncclSuccess);
    CHECK(sp_test_now_ms() - t0 < 1000);
    printf("abort during init: returned in %d ms\n", (int)(sp_test_now_ms() - t0));
}

/* A buffer of GPU 1 on GPU 0's stream, no peer access: refused at launch.
 * Rank 1 is a child that only joins. */
static void unreachable(void)
{
    ncclUniqueId id;
    ncclComm_t c;
    CHECK_EQ(ncclGetUniqueId(&id), ncclSuccess);
    pid_t child = fork();
    CHECK(child >= 0);
    if (child == 0) {
        ncclComm_t c1;
        CHECK_EQ(ncclCommInitRankConfig(&c1, 2, id, 1, NULL), ncclSuccess);   /* blocking */
        sleep(2);
        _exit(0);
    }
    CHECK_EQ(ncclCommInitRankConfig(&c, 2, id, 0, NULL), ncclSuccess);
    gpu_bind(1);
    uint8_t *far = dev_alloc(4096);
    gpu_bind(0);
    void *s;
    CHECK_EQ(cuStreamCreate(&s, 1), STUB_SUCCESS);
    CHECK_EQ(ncclSend(far, 4096, ncclUint8, 1, c, s), ncclUnhandledCudaError);
    CHECK_CONTAINS(ncclGetLastError(c), "cannot reach");
    printf("unreachable: %s: %s\n", ncclGetErrorString(ncclUnhandledCudaError), ncclGetLastError(c));
    CHECK_EQ(ncclCommAbort(c), ncclSuccess);
    CHECK_EQ(sp_test_wait(child, 10000), 0);
}

int main(void)
{
    setenv("SPD_STUB_CUDA_GPUS", "2", 1);   /* no peer access between them */
    unsetenv("SPD_STUB_CUDA_P2P");
    int v = 0;
    CHECK_EQ(ncclGetVersion(&v), ncclSuccess);
    CHECK_EQ(v, NCCL_VERSION_CODE);
    run_pair(EXCHANGE, "exchange");
    run_pair(LOST, "lost");
    run_pair(ABORT, "abort");
    run_pair(MISMATCH, "mismatch");
    abort_init();
    unreachable();
    printf("stub_nccl: ok\n");
    return 0;
}
