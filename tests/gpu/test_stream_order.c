/*
 * Stream order through a real spd: rank processes on one GPU put ops on their
 * own CUDA streams (spc_stream_create, spc_set_stream) and never wait on the
 * host between them. Each CUDA stream is made slow on purpose before every op
 * (a host function that sleeps, then the copy of the op's input), so an op
 * that did not wait for its stream's "ready" would read the old input, and a
 * copy after it that did not wait for "done" would read the old output. Every
 * result is compared with a reference computed here from every rank's inputs.
 *
 *   order      20 all-reduces per rank on one stream, inputs changing each
 *              time, one synchronize at the end (P = 2, 4);
 *   groups     one stream carrying ops on a mesh's Ulysses and ring groups and
 *              on the world, in one order on every rank, whose collectives
 *              complete matching in other orders (P = 4);
 *   two streams a main and a side stream per rank, the side one waiting for the
 *              main one's all-reduce before a ring shift that is matched first
 *              (P = 4): each client stream has its own lane in spd;
 *   alltoall   a bf16 GQA all-to-all on a stream, bit for bit (P = 2, 4);
 *   mismatch   ranks disagreeing on an op: both hear it, and the streams go on;
 *   late       a rank whose stream does not reach the op within its timeout:
 *              named to the others, its stream broken, the daemon serving;
 *              the op after it on the streams, submitted before spd gave up,
 *              fails too (CANCELED there, PEER_REFUSED on the other rank),
 *              never OK on the input the late rank never wrote;
 *   crossed    ranks putting two groups' ops on their streams in opposite
 *              orders: one op fails saying so; nothing hangs;
 *   death      a rank killed while spd's stream waits for it: the other hears
 *              PEER_LOST and its stream goes on;
 *   first launch a host-synchronous op whose kernel spd never launched, run
 *              while spd's lane waits 5 s for a stalled rank's stream: it
 *              completes during the stall (spd loads its kernels eagerly);
 *   daemon     spd killed while a rank's CUDA stream waits for an op, and
 *              no spd back within the rank's reconnect window (500 ms): the
 *              library releases the stream, which reports DAEMON_LOST
 *              (test_restart_stream_gpu has the spd that comes back).
 *
 * Needs a GPU; without one it says why and exits 77 (skipped).
 */
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "sp_gpu_regions.h"
#include "sp_kern_cases.h"
#include "sp_kern_cuda.h"

#define N_ELEMS (4u << 20)   /* 16 MiB of fp32: a sum takes long enough for a missed wait to show */

static float input_of(int rank, int iter, uint32_t i)
{
    return (float)((rank + 1) * 1000 + iter) + (float)(i % 7);
}

static cudaStream_t new_stream(void)
{
    cudaStream_t cs;
    CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    return cs;
}

static void *dev_alloc(spc_handle_t *h, uint64_t n, spc_region_t *r)
{
    void *d;
    CUDA_CHECK(cudaMalloc(&d, n));
    CUDA_CHECK(cudaMemset(d, 0x5A, n));
    CUDA_CHECK(cudaDeviceSynchronize());
    CHECK_OK(h, spc_register_device(h, d, n, r));
    return d;
}

/* ================================================================ order */

#define ITERS 20

static int order_main(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    CUDA_CHECK(cudaSetDevice(0));
    cudaStream_t cs = new_stream();
    spc_stream_t *s;
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_set_stream(h, s));

    const uint64_t bytes = N_ELEMS * sizeof(float);
    spc_region_t rx, ry;
    float *x = dev_alloc(h, bytes, &rx), *y = dev_alloc(h, bytes, &ry);
    float *in, *out;
    CUDA_CHECK(cudaMallocHost((void **)&in, ITERS * bytes));
    CUDA_CHECK(cudaMallocHost((void **)&out, ITERS * sizeof(float) * 4));
    for (int it = 0; it < ITERS; it++)
        for (uint32_t i = 0; i < N_ELEMS; i++)
            in[(size_t)it * N_ELEMS + i] = input_of(rank, it, i);

    /* Everything below is enqueued without a wait on the host. */
    for (int it = 0; it < ITERS; it++) {
        sp_gpu_stall(cs, it % 4 == rank % 4 ? 20 : 1);
        CUDA_CHECK(cudaMemcpyAsync(x, in + (size_t)it * N_ELEMS, bytes, cudaMemcpyHostToDevice, cs));
        CHECK_OK(h, spc_allreduce(h, world, x, y, N_ELEMS, SPC_F32, SPC_SUM, 30000));
        /* Three early elements and the last: each written by the sum, none by the copy. */
        CUDA_CHECK(cudaMemcpyAsync(out + it * 4, y, 3 * sizeof(float), cudaMemcpyDeviceToHost, cs));
        CUDA_CHECK(cudaMemcpyAsync(out + it * 4 + 3, y + N_ELEMS - 1, sizeof(float), cudaMemcpyDeviceToHost, cs));
    }
    CHECK_EQ(spc_stream_seq(s), ITERS);
    CHECK_OK(h, spc_stream_synchronize(s));
    for (int it = 0; it < ITERS; it++) {
        uint32_t idx[4] = { 0, 1, 2, N_ELEMS - 1 };
        for (int k = 0; k < 4; k++) {
            float want = 0;
            for (int q = 0; q < P; q++)
                want += input_of(q, it, idx[k]);
            if (out[it * 4 + k] != want)
                SP_FAIL("rank %d, op %d, element %u: %g from spd, %g expected (the stream order was not kept)", rank,
                        it, idx[k], out[it * 4 + k], want);
        }
    }
    CHECK_OK(h, spc_stream_destroy(s));
    CHECK(spc_get_stream(h) == NULL);
    CHECK_OK(h, spc_deregister(h, rx));
    CHECK_OK(h, spc_deregister(h, ry));
    CUDA_CHECK(cudaFree(x));
    CUDA_CHECK(cudaFree(y));
    CUDA_CHECK(cudaFreeHost(in));
    CUDA_CHECK(cudaFreeHost(out));
    CUDA_CHECK(cudaStreamDestroy(cs));
    return 0;
}

/* ================================================================ groups */

static int groups_main(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    CUDA_CHECK(cudaSetDevice(0));
    spc_mesh_spec_t spec = { .struct_size = sizeof spec, .sp = 4, .ulysses = 2, .ring = 2, .heads = 2 };
    spc_mesh_t m;
    CHECK_OK(h, spc_mesh_create(h, &spec, &m));
    CHECK_EQ((uint32_t)rank, m.ring_rank * 2 + m.ulysses_rank);   /* one node: Ulysses innermost */
    cudaStream_t cs = new_stream();
    spc_stream_t *s;
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_set_stream(h, s));

    const uint32_t n = 1u << 16;
    const uint64_t bytes = n * sizeof(float);
    spc_region_t r1, r2, r3, r4;
    float *a = dev_alloc(h, bytes, &r1), *b = dev_alloc(h, bytes, &r2), *c = dev_alloc(h, bytes, &r3),
          *d = dev_alloc(h, bytes, &r4);
    float *host, got[3];
    CUDA_CHECK(cudaMallocHost((void **)&host, bytes));
    for (uint32_t i = 0; i < n; i++)
        host[i] = (float)(rank + 1);
    /* Rank-dependent stalls make each group's collective complete matching
     * at another time on each rank. */
    sp_gpu_stall(cs, 5 * ((rank * 3) % 4));
    CUDA_CHECK(cudaMemcpyAsync(a, host, bytes, cudaMemcpyHostToDevice, cs));
    CHECK_OK(h, spc_allreduce(h, m.ulysses_group, a, b, n, SPC_F32, SPC_SUM, 30000));   /* b = sum over ulysses */
    sp_gpu_stall(cs, 5 * ((rank + 1) % 4));
    spc_shift_desc_t sd = { .struct_size = sizeof sd, .group = m.ring_group, .ntensors = 1 };
    sd.tensors[0].send = b;
    sd.tensors[0].recv = c;
    sd.tensors[0].bytes = bytes;
    CHECK_OK(h, spc_shift(h, &sd, 30000));                                               /* c = b of ring rank - 1 */
    CHECK_OK(h, spc_allreduce(h, world, c, d, n, SPC_F32, SPC_SUM, 30000));              /* d = sum of every c */
    CUDA_CHECK(cudaMemcpyAsync(&got[0], b + n - 1, sizeof(float), cudaMemcpyDeviceToHost, cs));
    CUDA_CHECK(cudaMemcpyAsync(&got[1], c, sizeof(float), cudaMemcpyDeviceToHost, cs));
    CUDA_CHECK(cudaMemcpyAsync(&got[2], d + n / 2, sizeof(float), cudaMemcpyDeviceToHost, cs));
    CHECK_OK(h, spc_stream_synchronize(s));

    /* The references, from the mesh's own coordinates. Mesh ranks: rank =
     * ring_rank * ulysses + ulysses_rank (one sp group). */
    float ulysses_sum[4], want_b, want_c, want_d = 0;
    for (uint32_t q = 0; q < 4; q++) {
        uint32_t base = q - q % 2;
        ulysses_sum[q] = (float)(base + 1) + (float)(base + 2);
    }
    want_b = ulysses_sum[rank];
    uint32_t from = ((m.ring_rank + 1) % 2) * 2 + m.ulysses_rank;   /* ring rank - 1 of 2 is the other one */
    want_c = ulysses_sum[from];
    for (uint32_t q = 0; q < 4; q++)
        want_d += ulysses_sum[q];
    if (got[0] != want_b || got[1] != want_c || got[2] != want_d)
        SP_FAIL("rank %d: ulysses sum %g (want %g), shifted %g (want %g), world sum %g (want %g)", rank, got[0], want_b,
                got[1], want_c, got[2], want_d);
    CHECK_OK(h, spc_stream_destroy(s));
    CUDA_CHECK(cudaFreeHost(host));
    return 0;
}

/* ================================================================ two streams */

/* The pattern of an overlapped ring: the main stream's all-reduce on the
 * Ulysses group, then, on a side stream that waits for the main one there, a
 * shift on the ring group. Odd ranks come late to the all-reduce, so the ring
 * group's shift (ranks 0 and 2, both early) is matched first: were spd's
 * stream one queue, that shift would wait there for rank 0's side stream,
 * which waits for the all-reduce queued behind it. */
static int lanes_main(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    CUDA_CHECK(cudaSetDevice(0));
    spc_mesh_spec_t spec = { .struct_size = sizeof spec, .sp = 4, .ulysses = 2, .ring = 2, .heads = 2 };
    spc_mesh_t m;
    CHECK_OK(h, spc_mesh_create(h, &spec, &m));
    CHECK_EQ((uint32_t)rank, m.ring_rank * 2 + m.ulysses_rank);
    cudaStream_t main_cs = new_stream(), side_cs = new_stream();
    spc_stream_t *main_s, *side_s;
    CHECK_OK(h, spc_stream_create(h, main_cs, &main_s));
    CHECK_OK(h, spc_stream_create(h, side_cs, &side_s));
    cudaEvent_t ev;
    CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));

    enum { ROUNDS = 4 };
    const uint32_t n = 1u << 14;
    const uint64_t bytes = n * sizeof(float);
    spc_region_t rr[3];
    float *x = dev_alloc(h, ROUNDS * bytes, &rr[0]), *y = dev_alloc(h, ROUNDS * bytes, &rr[1]),
          *z = dev_alloc(h, ROUNDS * bytes, &rr[2]);
    float *host, got[ROUNDS][2];
    CUDA_CHECK(cudaMallocHost((void **)&host, ROUNDS * bytes));
    for (int k = 0; k < ROUNDS; k++)
        for (uint32_t i = 0; i < n; i++)
            host[(size_t)k * n + i] = (float)(100 * k + rank + 1);
    for (int k = 0; k < ROUNDS; k++) {
        float *xk = x + (size_t)k * n, *yk = y + (size_t)k * n, *zk = z + (size_t)k * n;
        if (rank % 2 == 1)
            usleep(100000);   /* late to the all-reduce */
        CUDA_CHECK(cudaMemcpyAsync(xk, host + (size_t)k * n, bytes, cudaMemcpyHostToDevice, main_cs));
        CHECK_OK(h, spc_set_stream(h, main_s));
        CHECK_OK(h, spc_allreduce(h, m.ulysses_group, xk, yk, n, SPC_F32, SPC_SUM, 30000));
        CUDA_CHECK(cudaEventRecord(ev, main_cs));
        CUDA_CHECK(cudaStreamWaitEvent(side_cs, ev, 0));
        CHECK_OK(h, spc_set_stream(h, side_s));
        spc_shift_desc_t sd = { .struct_size = sizeof sd, .group = m.ring_group, .channel = 1, .ntensors = 1 };
        sd.tensors[0].send = xk;
        sd.tensors[0].recv = zk;
        sd.tensors[0].bytes = bytes;
        CHECK_OK(h, spc_shift(h, &sd, 30000));
        CUDA_CHECK(cudaEventRecord(ev, side_cs));
        CUDA_CHECK(cudaStreamWaitEvent(main_cs, ev, 0));   /* the next round's work waits for the shift */
        CUDA_CHECK(cudaMemcpyAsync(&got[k][0], yk + n - 1, sizeof(float), cudaMemcpyDeviceToHost, main_cs));
        CUDA_CHECK(cudaMemcpyAsync(&got[k][1], zk + n / 3, sizeof(float), cudaMemcpyDeviceToHost, main_cs));
    }
    CHECK_OK(h, spc_stream_synchronize(side_s));
    CHECK_OK(h, spc_stream_synchronize(main_s));
    uint32_t partner = ((m.ring_rank + 1) % 2) * 2 + m.ulysses_rank;
    for (int k = 0; k < ROUNDS; k++) {
        uint32_t base = (uint32_t)rank - (uint32_t)rank % 2;
        float want_y = (float)(100 * k + base + 1) + (float)(100 * k + base + 2);
        float want_z = (float)(100 * k + partner + 1);
        if (got[k][0] != want_y || got[k][1] != want_z)
            SP_FAIL("rank %d round %d: ulysses sum %g (want %g), shifted %g (want %g)", rank, k, got[k][0], want_y,
                    got[k][1], want_z);
    }
    CHECK_OK(h, spc_stream_destroy(side_s));
    CHECK_OK(h, spc_stream_destroy(main_s));
    CUDA_CHECK(cudaFreeHost(host));
    CUDA_CHECK(cudaEventDestroy(ev));
    return 0;
}

/* ================================================================ alltoall */

static int a2a_main(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    CUDA_CHECK(cudaSetDevice(0));
    cudaStream_t cs = new_stream();
    spc_stream_t *s;
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_set_stream(h, s));

    const uint32_t heads = 8, kv = 2, dim = 16, S = 40;
    sp_kern_a2a_desc_t kd = { SP_KERN_SEQ_TO_HEAD, SP_KERN_BSHD, 1, S, heads, dim, SP_KERN_HEADS_Q, kv, (uint32_t)P,
                              SP_KERN_BF16, 0 };
    sp_kern_a2a_geom_t g;
    CHECK_EQ(sp_kern_a2a_geom(&g, &kd, (uint32_t)rank), 0);
    uint64_t in_bytes = sp_kern_a2a_src_bytes(&g), out_bytes = sp_kern_a2a_out_bytes(&g);
    uint8_t *in[8];
    for (int q = 0; q < P; q++) {
        uint64_t st = 0xABCDEFull * (uint64_t)(q + 1);
        in[q] = malloc(in_bytes);
        sp_kern_fill(in[q], in_bytes, &st);
    }
    uint8_t *want = malloc(out_bytes), *got;
    CHECK_EQ(sp_kern_a2a_host(want, (const void *const *)in, &kd, (uint32_t)rank), 0);
    CUDA_CHECK(cudaMallocHost((void **)&got, out_bytes));
    spc_region_t rs, rh;
    void *dseq = dev_alloc(h, in_bytes, &rs), *dhead = dev_alloc(h, out_bytes, &rh);
    uint8_t *pinned;
    CUDA_CHECK(cudaMallocHost((void **)&pinned, in_bytes));
    memcpy(pinned, in[rank], in_bytes);

    sp_gpu_stall(cs, 20);
    CUDA_CHECK(cudaMemcpyAsync(dseq, pinned, in_bytes, cudaMemcpyHostToDevice, cs));
    spc_alltoall_desc_t d = { .struct_size = sizeof d, .group = world, .dtype = SPC_BF16,
                              .direction = SPC_SEQ_TO_HEAD, .layout = SPC_LAYOUT_BSHD, .batch = 1, .seq_len = S,
                              .kv_heads = kv, .ntensors = 1 };
    d.tensors[0] = (spc_a2a_tensor_t){ dseq, dhead, heads, dim, SPC_HEADS_Q, 0 };
    CHECK_OK(h, spc_alltoall(h, &d, 30000));
    CUDA_CHECK(cudaMemcpyAsync(got, dhead, out_bytes, cudaMemcpyDeviceToHost, cs));
    CHECK_OK(h, spc_stream_synchronize(s));
    for (uint64_t i = 0; i < out_bytes; i++)
        if (got[i] != want[i])
            SP_FAIL("rank %d, P %d: alltoall byte %" PRIu64 " of %" PRIu64 " is 0x%02x, the host reference 0x%02x",
                    rank, P, i, out_bytes, got[i], want[i]);
    CHECK_OK(h, spc_stream_destroy(s));
    for (int q = 0; q < P; q++)
        free(in[q]);
    free(want);
    CUDA_CHECK(cudaFreeHost(got));
    CUDA_CHECK(cudaFreeHost(pinned));
    return 0;
}

/* ================================================================ refusals and failures */

/* y must hold P * (P + 1) / 2 in element i (every rank wrote its rank + 1). */
static void check_sum(cudaStream_t cs, const float *y, uint32_t i, int P, const char *what)
{
    float got;
    CUDA_CHECK(cudaMemcpyAsync(&got, y + i, sizeof got, cudaMemcpyDeviceToHost, cs));
    CUDA_CHECK(cudaStreamSynchronize(cs));
    if (got != (float)(P * (P + 1) / 2))
        SP_FAIL("%s: %g, want %g", what, got, (float)(P * (P + 1) / 2));
}

static void fill(cudaStream_t cs, float *x, uint32_t n, float v)
{
    float *host;
    CUDA_CHECK(cudaMallocHost((void **)&host, n * sizeof(float)));
    for (uint32_t i = 0; i < n; i++)
        host[i] = v;
    CUDA_CHECK(cudaMemcpyAsync(x, host, n * sizeof(float), cudaMemcpyHostToDevice, cs));
    CUDA_CHECK(cudaStreamSynchronize(cs));
    CUDA_CHECK(cudaFreeHost(host));
}

static int failures_main(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    CUDA_CHECK(cudaSetDevice(0));
    const uint32_t n = 1024;
    cudaStream_t cs = new_stream();
    spc_stream_t *s;
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_set_stream(h, s));
    spc_region_t rx, ry;
    float *x = dev_alloc(h, n * sizeof(float), &rx), *y = dev_alloc(h, n * sizeof(float), &ry);
    fill(cs, x, n, (float)(rank + 1));
    spc_request_t *req;

    /* mismatch: rank 1 counts one element more. Both hear it; done still moves. */
    CHECK_OK(h, sp_gpu_stream_allreduce(h, world, x, y, n - 1 + (uint32_t)rank, 0, &req));
    CHECK_ST(h, spc_stream_synchronize(s), SPC_ERR_MISMATCH);
    CHECK_ST(h, spc_wait(req, 5000), SPC_ERR_MISMATCH);
    spc_request_release(req);
    CHECK_OK(h, spc_allreduce(h, world, x, y, n, SPC_F32, SPC_SUM, 30000));
    CHECK_OK(h, spc_stream_synchronize(s));
    check_sum(cs, y, n - 1, P, "after a mismatch, on the same streams");

    /* A host-memory op while a stream is current runs host-synchronous, as before. */
    double *hx = spc_alloc(h, 8 * sizeof(double));
    for (int i = 0; i < 8; i++)
        hx[i] = rank + 1;
    CHECK_OK(h, spc_allreduce(h, world, hx, hx, 8, SPC_F64, SPC_SUM, 30000));
    CHECK(hx[7] == P * (P + 1) / 2);
    spc_free(h, hx);

    /* late: rank 1's stream is held 1.5 s; the ops' timeout is 300 ms. Two ops
     * go on every stream back to back: the second is already submitted when
     * spd gives up on rank 1's stream at the first, and its wait for that
     * stream's ready passes (poisoned) without rank 1's input. It must fail,
     * never complete OK with what rank 1's buffer held before. */
    CUDA_CHECK(cudaMemsetAsync(y, 0, n * sizeof(float), cs));
    if (rank == 1)
        sp_gpu_stall(cs, 1500);
    spc_request_t *late[2];
    CHECK_OK(h, sp_gpu_stream_allreduce(h, world, x, y, n, 300, &late[0]));
    CHECK_OK(h, sp_gpu_stream_allreduce(h, world, x, y, n, 300, &late[1]));
    spc_status_t want = rank == 1 ? SPC_ERR_TIMEOUT : SPC_ERR_PEER_REFUSED;
    CHECK_ST(h, spc_wait(late[0], 10000), want);
    CHECK_CONTAINS(spc_request_detail(late[0]), "did not reach");
    printf("rank %d, late: %s: %s\n", rank, spc_status_name(want), spc_request_detail(late[0]));
    spc_status_t after = spc_wait(late[1], 10000);
    spc_status_t want_after = rank == 1 ? SPC_ERR_CANCELED : SPC_ERR_PEER_REFUSED;
    printf("rank %d, submitted before the give-up: %s: %s\n", rank, spc_status_name(after),
           spc_request_detail(late[1]));
    if (after != want_after)
        SP_FAIL("rank %d, the op submitted before spd gave up on rank 1's stream: %s (%s); want %s", rank,
                spc_status_name(after), spc_request_detail(late[1]), spc_status_name(want_after));
    CHECK_CONTAINS(spc_request_detail(late[1]), "was given up at");
    spc_request_release(late[0]);
    spc_request_release(late[1]);
    /* The stream holds the first error of the two. */
    CHECK_ST(h, spc_stream_synchronize(s), want);
    if (rank == 1) {
        /* Its stream is broken: refused at once, and says so. */
        CHECK_ST(h, sp_gpu_stream_allreduce(h, world, x, y, n, 0, &req), SPC_ERR_CANCELED);
        CHECK_CONTAINS(spc_last_error(h), "broken");
        CHECK_ST(h, spc_stream_destroy(s), SPC_ERR_CANCELED);   /* destroyed, saying what it was */
        CHECK_OK(h, spc_stream_create(h, cs, &s));
        CHECK_OK(h, spc_set_stream(h, s));
    }
    CHECK_OK(h, spc_allreduce(h, world, x, y, n, SPC_F32, SPC_SUM, 30000));
    CHECK_OK(h, spc_stream_synchronize(s));
    check_sum(cs, y, 0, P, "after a late rank, rank 1 on a new stream");

    /* crossed: the world's op and the Ulysses group's (the same two ranks) in
     * opposite orders. Each waits for the other's turn until one's timeout. */
    spc_mesh_spec_t spec = { .struct_size = sizeof spec, .sp = 2, .ulysses = 2, .ring = 1, .heads = 2 };
    spc_mesh_t m;
    CHECK_OK(h, spc_mesh_create(h, &spec, &m));
    CHECK(m.ulysses_group != world);
    spc_request_t *rq[2];
    spc_group_t order[2] = { rank == 0 ? world : m.ulysses_group, rank == 0 ? m.ulysses_group : world };
    float *ys[2] = { y, x };   /* the second writes x: x is its own input there, which is fine */
    CHECK_OK(h, sp_gpu_stream_allreduce(h, order[0], x, ys[0], n, 500, &rq[0]));
    CHECK_OK(h, sp_gpu_stream_allreduce(h, order[1], x, ys[1], n, 500, &rq[1]));
    spc_status_t st0 = spc_wait(rq[0], 10000), st1 = spc_wait(rq[1], 10000);
    if ((st0 == SPC_OK) == (st1 == SPC_OK))
        SP_FAIL("rank %d, crossed: %s and %s; want exactly one op failed", rank, spc_status_name(st0),
                spc_status_name(st1));
    const char *why = spc_request_detail(st0 == SPC_OK ? rq[1] : rq[0]);
    CHECK_CONTAINS(why, "same order");
    printf("rank %d, crossed: %s\n", rank, why);
    spc_request_release(rq[0]);
    spc_request_release(rq[1]);
    CHECK_ST(h, spc_stream_synchronize(s), st0 == SPC_OK ? st1 : st0);
    fill(cs, x, n, (float)(rank + 1));
    CHECK_OK(h, spc_allreduce(h, world, x, y, n, SPC_F32, SPC_SUM, 30000));
    CHECK_OK(h, spc_stream_synchronize(s));
    check_sum(cs, y, 5, P, "after crossed orders");

    CHECK_OK(h, spc_stream_destroy(s));
    return 0;
}

/* ================================================================ a kernel's first launch */

#define LAZY_STALL_MS 5000

/*
 * spd's lane for rank 1's stream waits (cuStreamWaitValue64) for a ready that
 * comes only after a 5 s stall on that stream; meanwhile both ranks run a
 * host-synchronous op whose kernel spd has never launched. Run on a fresh spd,
 * so the stream op's own kernel is new too. Were a kernel loaded at its first
 * launch with the context synchronized (CUDA's lazy loading may do that), the
 * progress thread would wait out the stall, and a stream whose ready needed
 * spd would never get there. The host op must complete while the stall holds.
 */
static int first_launch_main(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    CUDA_CHECK(cudaSetDevice(0));
    spc_mesh_spec_t spec = { .struct_size = sizeof spec, .sp = 2, .ulysses = 2, .ring = 1, .heads = 2 };
    spc_mesh_t m;
    CHECK_OK(h, spc_mesh_create(h, &spec, &m));
    const uint32_t n = 1024;
    spc_region_t rx, ry, rb;
    float *x = dev_alloc(h, n * sizeof(float), &rx), *y = dev_alloc(h, n * sizeof(float), &ry);
    double *b = dev_alloc(h, n * sizeof(double), &rb), *hb = malloc(n * sizeof(double));
    for (uint32_t i = 0; i < n; i++)
        hb[i] = (double)((rank + 1) * 10 + (int)(i % 5));
    dev_write(b, hb, n * sizeof(double));
    cudaStream_t cs = new_stream();
    spc_stream_t *s;
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    fill(cs, x, n, (float)(rank + 1));

    CHECK_OK(h, spc_set_stream(h, s));
    if (rank == 1)
        sp_gpu_stall(cs, LAZY_STALL_MS);
    CHECK_OK(h, spc_allreduce(h, world, x, y, n, SPC_F32, SPC_SUM, 30000));   /* enqueued */
    CHECK_OK(h, spc_set_stream(h, NULL));
    CHECK_OK(h, spc_allreduce(h, m.ulysses_group, b, b, n, SPC_F64, SPC_MIN, 30000));
    /* Done while spd's lane still waits for rank 1's stream (every rank's
     * stream waits for the world op's done). */
    if (cudaStreamQuery(cs) != cudaErrorNotReady)
        SP_FAIL("rank %d: the host-synchronous op with a new kernel completed only after the %d ms stall on "
                "rank 1's stream: spd's progress thread waited behind its lane", rank, LAZY_STALL_MS);
    CUDA_CHECK(cudaMemcpy(hb, b, n * sizeof(double), cudaMemcpyDeviceToHost));
    for (uint32_t i = 0; i < n; i++)
        if (hb[i] != (double)(10 + (int)(i % 5)))
            SP_FAIL("rank %d: min of element %u is %g, want %d", rank, i, hb[i], 10 + (int)(i % 5));
    CHECK_OK(h, spc_stream_synchronize(s));
    check_sum(cs, y, n - 1, P, "the stream op after the stall");
    CHECK_OK(h, spc_stream_destroy(s));
    free(hb);
    return 0;
}

/* ================================================================ a rank dies */

static char job_id[SPC_JOB_ID_MAX];
static volatile int *shared;   /* [0]: rank 0 submitted; [1]: rank 1 at the point of no return */

static int death_main(void *arg)
{
    int rank = (int)(intptr_t)arg;
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, 2, (uint32_t)rank, 20000, &world));
    CUDA_CHECK(cudaSetDevice(0));
    cudaStream_t cs = new_stream();
    spc_stream_t *s;
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_set_stream(h, s));
    spc_region_t rx, ry;
    float *x = dev_alloc(h, 4096, &rx), *y = dev_alloc(h, 4096, &ry);
    if (rank == 1) {
        /* Its stream never gets to "ready": spd's stream waits for it, until it dies. */
        sp_gpu_stall(cs, 60000);
        CHECK_OK(h, spc_allreduce(h, world, x, y, 1024, SPC_F32, SPC_SUM, 30000));
        shared[1] = 1;
        while (shared[0] == 0)
            usleep(1000);
        usleep(100000);   /* both ops matched, the task on spd's stream */
        raise(SIGKILL);
    }
    CHECK_OK(h, spc_allreduce(h, world, x, y, 1024, SPC_F32, SPC_SUM, 30000));
    shared[0] = 1;
    CHECK_ST(h, spc_stream_synchronize(s), SPC_ERR_PEER_LOST);
    CHECK_CONTAINS(spc_last_error(h), "rank 1");
    printf("death: rank 0 hears: %s\n", spc_last_error(h));
    spc_detach(h);
    return 0;
}

static void test_death(void)
{
    spc_handle_t *q = sp_test_attach();
    CHECK_OK(q, spc_job_create(q, job_id, sizeof job_id));
    shared[0] = shared[1] = 0;
    pid_t pids[2];
    for (int r = 0; r < 2; r++)
        pids[r] = sp_test_fork(death_main, (void *)(intptr_t)r);
    CHECK_EQ(sp_test_wait(pids[1], 60000), -SIGKILL);
    sp_test_wait_all_ok(pids, 1, 60000);
    /* The daemon serves on: a host op in a new job. */
    CHECK_OK(q, spc_noop(q, 5000));
    spc_detach(q);
}

/* ================================================================ the daemon dies */

static int daemon_death_main(void *arg)
{
    int rank = (int)(intptr_t)arg;
    setenv("SPC_RECONNECT_MS", "500", 1);   /* no spd comes back */
    spc_handle_t *h = sp_test_attach();
    spc_group_t world;
    CHECK_OK(h, spc_job_join(h, job_id, 2, (uint32_t)rank, 20000, &world));
    CUDA_CHECK(cudaSetDevice(0));
    if (rank == 1) {
        /* Never submits; kills spd once rank 0's stream waits in the op. */
        while (shared[0] == 0)
            usleep(1000);
        usleep(100000);
        kill(spc_daemon_pid(h), SIGKILL);
        return 0;
    }
    cudaStream_t cs = new_stream();
    spc_stream_t *s;
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_set_stream(h, s));
    spc_region_t rx, ry;
    float *x = dev_alloc(h, 4096, &rx), *y = dev_alloc(h, 4096, &ry);
    CHECK_OK(h, spc_allreduce(h, world, x, y, 1024, SPC_F32, SPC_SUM, 30000));
    shared[0] = 1;
    /* A plain CUDA wait: only the library's watcher can release it. */
    uint64_t t0 = sp_test_now_ms();
    CUDA_CHECK(cudaStreamSynchronize(cs));
    printf("daemon killed: the CUDA stream went on after %" PRIu64 " ms\n", sp_test_now_ms() - t0);
    CHECK_ST(h, spc_stream_query(s), SPC_ERR_DAEMON_LOST);
    CHECK_CONTAINS(spc_last_error(h), "no spd took it over within 500 ms");
    spc_detach(h);
    return 0;
}

static void test_daemon_death(sp_test_daemon_t *d)
{
    spc_handle_t *q = sp_test_attach();
    CHECK_OK(q, spc_job_create(q, job_id, sizeof job_id));
    shared[0] = 0;
    pid_t pids[2];
    for (int r = 0; r < 2; r++)
        pids[r] = sp_test_fork(daemon_death_main, (void *)(intptr_t)r);
    sp_test_wait_all_ok(pids, 2, 60000);
    spc_detach(q);
    CHECK_EQ(sp_test_daemon_stop(d), -SIGKILL);
}

/* Whether a GPU is usable, asked in a child: CUDA must not start in this
 * process before it forks the ranks. */
int main(void)
{
    if (sp_gpu_test_probe() == SP_TEST_SKIP)
        return SP_TEST_SKIP;
    shared = sp_test_shared(2 * sizeof(int));

    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    for (int P = 2; P <= 4; P += 2) {
        sp_test_run_job(P, order_main, NULL);
        printf("P = %d: %d stream-ordered all-reduces, one synchronize: every result right\n", P, ITERS);
        sp_test_run_job(P, a2a_main, NULL);
        printf("P = %d: stream-ordered bf16 GQA all-to-all: bit for bit\n", P);
    }
    sp_test_run_job(4, groups_main, NULL);
    printf("P = 4: Ulysses, ring and world ops on one stream: right\n");
    sp_test_run_job(4, lanes_main, NULL);
    printf("P = 4: a main and a side stream per rank, the side's ring shift matched first: right, no wait\n");
    sp_test_run_job(2, failures_main, NULL);
    printf("mismatch, late rank, crossed orders: errors said, streams went on\n");
    test_death();
    /* Every stream given back or gone with its client; nothing left on the GPU. */
    spc_handle_t *q = sp_test_attach();
    if (!sp_test_wait_status(q, "gpu_streams", 0, 5000) || !sp_test_wait_status(q, "gpu_tasks", 0, 5000))
        SP_FAIL("streams or GPU tasks left after every rank went");
    spc_detach(q);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);

    sp_test_daemon_start(&d, NULL);
    sp_test_run_job(2, first_launch_main, NULL);
    printf("first launch: a new kernel ran while spd's lane waited %d ms for a rank's stream\n", LAZY_STALL_MS);
    test_daemon_death(&d);
    sp_test_daemon_cleanup(&d);
    printf("ok\n");
    return 0;
}
