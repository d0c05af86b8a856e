/*
 * One rank per GPU through a real spd on a node of several GPUs: P = 2, 4 and
 * 8 rank processes, rank r on GPU r % G (G the GPUs there, up to P), each with
 * its own CUDA stream, put a seq->head all-to-all, a ring shift, an fp32
 * all-reduce and one in place on it in turn, 4 rounds with no wait on the
 * host: each round's input copied in on the stream before the op, the result
 * copied out after it and both buffers overwritten right after that, one rank
 * in turn held 20 ms before its copy. So an op that started before every
 * rank's ready would read an old input, and a done written before every GPU
 * had read would let an input be overwritten under a reading GPU. Every result
 * is compared with a reference computed here from every rank's inputs.
 * `spctl status` is printed: which path each pair of GPUs takes.
 *
 * Needs two GPUs; with fewer it says why and exits 77 (skipped). The same
 * path runs without a GPU in test_multigpu_stub.
 */
#include "sp_gpu_regions.h"

#define ROUNDS 4
#define SLOC   256u    /* rows per rank */
#define HPR    4u      /* heads per rank */
#define D      128u    /* head dim */

enum { OP_A2A, OP_SHIFT, OP_ALLREDUCE, OP_ALLREDUCE_IN_PLACE, NOPS };

static int ngpus;

static float value(int rank, int round, uint32_t i)
{
    return (float)((rank + 1) * 100000 + round * 1000) + (float)(i % 512);
}

static float reference(int kind, int P, int r, int round, uint32_t i)
{
    switch (kind) {
    case OP_A2A: {
        uint32_t d = i % D, j = (i / D) % HPR, s = i / (D * HPR);
        uint32_t q = s / SLOC, row = s % SLOC;
        return value((int)q, round, (row * HPR * (uint32_t)P + (uint32_t)r * HPR + j) * D + d);
    }
    case OP_SHIFT:
        return value((r + P - 1) % P, round, i);
    default: {
        float sum = 0;
        for (int q = 0; q < P; q++)
            sum += value(q, round, i);
        return sum;
    }
    }
}

static const char *op_name(int kind)
{
    return kind == OP_A2A ? "all-to-all" : kind == OP_SHIFT ? "shift" : kind == OP_ALLREDUCE ? "all-reduce"
                                                                    : "all-reduce in place";
}

static void submit(spc_handle_t *h, spc_group_t world, int P, int kind, float *in, float *out)
{
    const uint32_t n = SLOC * HPR * (uint32_t)P * D;
    if (kind == OP_A2A) {
        spc_alltoall_desc_t d = SPC_ALLTOALL_DESC_INIT;
        d.group = world;
        d.dtype = SPC_F32;
        d.direction = SPC_SEQ_TO_HEAD;
        d.layout = SPC_LAYOUT_BSHD;
        d.batch = 1;
        d.seq_len = SLOC * (uint32_t)P;
        d.ntensors = 1;
        d.tensors[0] = (spc_a2a_tensor_t){ .send = in, .recv = out, .heads = HPR * (uint32_t)P, .head_dim = D };
        CHECK_OK(h, spc_alltoall(h, &d, 30000));
    } else if (kind == OP_SHIFT) {
        spc_shift_desc_t sd = { .struct_size = sizeof sd, .group = world, .ntensors = 1 };
        sd.tensors[0].send = in;
        sd.tensors[0].recv = out;
        sd.tensors[0].bytes = n * sizeof(float);
        CHECK_OK(h, spc_shift(h, &sd, 30000));
    } else {
        CHECK_OK(h, spc_allreduce(h, world, in, kind == OP_ALLREDUCE_IN_PLACE ? in : out, n, SPC_F32, SPC_SUM,
                                  30000));
    }
}

static int rank_main(spc_handle_t *h, spc_group_t world, int rank, int P, void *arg)
{
    const int gpu = rank % ngpus;
    const uint32_t n = SLOC * HPR * (uint32_t)P * D;
    const uint64_t bytes = n * sizeof(float);
    CUDA_CHECK(cudaSetDevice(gpu));
    cudaStream_t cs;
    CUDA_CHECK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
    spc_stream_t *s;
    CHECK_OK(h, spc_stream_create(h, cs, &s));
    CHECK_OK(h, spc_set_stream(h, s));
    spc_region_t rin, rout;
    float *in = dev_put(h, NULL, bytes, &rin), *out = dev_put(h, NULL, bytes, &rout);
    float *inputs, *results;
    CUDA_CHECK(cudaMallocHost((void **)&inputs, ROUNDS * bytes));
    CUDA_CHECK(cudaMallocHost((void **)&results, ROUNDS * bytes));
    for (int round = 0; round < ROUNDS; round++)
        for (uint32_t i = 0; i < n; i++)
            inputs[(size_t)round * n + i] = value(rank, round, i);

    /* Everything is enqueued without a wait on the host. */
    for (int round = 0; round < ROUNDS; round++) {
        const int kind = round % NOPS;
        float *result = kind == OP_ALLREDUCE_IN_PLACE ? in : out;
        sp_gpu_stall(cs, round % P == rank ? 20 : 1);
        CUDA_CHECK(cudaMemcpyAsync(in, inputs + (size_t)round * n, bytes, cudaMemcpyHostToDevice, cs));
        submit(h, world, P, kind, in, out);
        CUDA_CHECK(cudaMemcpyAsync(results + (size_t)round * n, result, bytes, cudaMemcpyDeviceToHost, cs));
        CUDA_CHECK(cudaMemsetAsync(in, 0xFF, bytes, cs));    /* NaN: what a GPU still reading would see */
        CUDA_CHECK(cudaMemsetAsync(out, 0xFF, bytes, cs));
    }
    CHECK_OK(h, spc_stream_synchronize(s));
    for (int round = 0; round < ROUNDS; round++) {
        const int kind = round % NOPS;
        for (uint32_t i = 0; i < n; i++) {
            float want = reference(kind, P, rank, round, i), got = results[(size_t)round * n + i];
            if (got != want)
                SP_FAIL("P = %d, rank %d on GPU %d, round %d (%s), element %u of %u: %g from spd, %g expected", P,
                        rank, gpu, round, op_name(kind), i, n, got, want);
        }
    }
    CHECK_OK(h, spc_stream_destroy(s));
    dev_drop(h, in, rin);
    dev_drop(h, out, rout);
    CUDA_CHECK(cudaFreeHost(inputs));
    CUDA_CHECK(cudaFreeHost(results));
    CUDA_CHECK(cudaStreamDestroy(cs));
    return 0;
}

/* How many GPUs there are, asked in a child: CUDA must not start in this
 * process before it forks the ranks. */
static int gpu_count(void *arg)
{
    int n = 0;
    if (sp_gpu_test_usable() != 0 || cudaGetDeviceCount(&n) != cudaSuccess)
        return 0;
    return n > 8 ? 8 : n;
}

int main(void)
{
    ngpus = sp_test_wait(sp_test_fork(gpu_count, NULL), 60000);
    if (ngpus < 2) {
        fprintf(stderr, "skipped: one rank per GPU needs two GPUs, this machine has %d\n", ngpus);
        return SP_TEST_SKIP;
    }
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    char out[16384];
    CHECK_EQ(sp_test_run(out, sizeof out, "%s status", sp_test_spctl_bin()), 0);
    printf("$ spctl status\n%s", out);
    for (int P = 2; P <= 8; P *= 2) {
        sp_test_run_job(P, rank_main, NULL);
        printf("P = %d on %d GPUs: all-to-all, shift, all-reduce and in place, %d rounds in stream order: bit for "
               "bit\n", P, P < ngpus ? P : ngpus, ROUNDS);
    }
    spc_handle_t *q = sp_test_attach();
    if (!sp_test_wait_status(q, "gpu_streams", 0, 5000) || !sp_test_wait_status(q, "gpu_tasks", 0, 5000))
        SP_FAIL("streams or GPU tasks left after every rank went");
    spc_detach(q);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("ok\n");
    return 0;
}
