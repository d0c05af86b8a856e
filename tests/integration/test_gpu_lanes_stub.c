/*
 * spd's streams on a GPU stop at its hardware queues, without a GPU: a client
 * on the stand-in driver (tests/stubcuda) opens CUDA streams with spd until a
 * GPU has gpu_lanes_max of them; the next is refused with SPC_ERR_LIMIT,
 * naming the option and the GPU (spctl status and the metrics count it), while
 * a stream on the other GPU still opens.
 * Once one is destroyed, another opens, and a stream-ordered all-reduce on it
 * is right. Then spd runs with CUDA_DEVICE_MAX_CONNECTIONS=3 in its
 * environment: it keeps that value, and the queues it leaves (two, one being
 * spd's own stream's) bound the lanes below gpu_lanes_max.
 *
 * Skipped (77) where spd was built without CUDA.
 */
#include <unistd.h>

#include "sp_test.h"
#include "stub_cuda.h"

#define N 1024u   /* floats in the all-reduce */

static void gpu_bind(int gpu)
{
    void *ctx;
    CHECK_EQ(cuDevicePrimaryCtxRetain(&ctx, gpu), STUB_SUCCESS);
    CHECK_EQ(cuCtxSetCurrent(ctx), STUB_SUCCESS);
}

/* A stream of the stand-in on `gpu`, opened with spd: the status spd gave. */
static spc_status_t stream_open(spc_handle_t *h, int gpu, void **cs, spc_stream_t **s)
{
    gpu_bind(gpu);
    CHECK_EQ(cuStreamCreate(cs, 0), STUB_SUCCESS);
    return spc_stream_create(h, *cs, s);
}

/* An all-reduce of one rank in the order of s: its output is its input. */
static void stream_allreduce(spc_handle_t *h, spc_group_t world, spc_stream_t *s)
{
    stub_ptr_t in, out;
    spc_region_t r;
    gpu_bind(0);
    CHECK_EQ(cuMemAlloc_v2(&in, N * sizeof(float)), STUB_SUCCESS);
    CHECK_EQ(cuMemAlloc_v2(&out, N * sizeof(float)), STUB_SUCCESS);
    CHECK_OK(h, spc_register_device(h, (void *)(uintptr_t)in, N * sizeof(float), &r));
    CHECK_OK(h, spc_register_device(h, (void *)(uintptr_t)out, N * sizeof(float), &r));
    float *fin = (float *)(uintptr_t)in, *fout = (float *)(uintptr_t)out;
    for (uint32_t i = 0; i < N; i++) {
        fin[i] = (float)(i % 251) - 100.0f;
        fout[i] = -1;
    }
    CHECK_OK(h, spc_set_stream(h, s));
    CHECK_OK(h, spc_allreduce(h, world, fin, fout, N, SPC_F32, SPC_SUM, 20000));
    CHECK_OK(h, spc_stream_synchronize(s));
    CHECK_OK(h, spc_set_stream(h, NULL));
    for (uint32_t i = 0; i < N; i++)
        if (fout[i] != (float)(i % 251) - 100.0f)
            SP_FAIL("stream-ordered all-reduce on the reopened lane: [%u] is %g", i, fout[i]);
}

/* Opens streams on GPU 0 until spd refuses one: it must refuse the (lanes+1)th,
 * saying `why`. The streams stay open; their count is returned. */
static int fill_gpu0(spc_handle_t *h, int lanes, const char *why, void **cs, spc_stream_t **s)
{
    for (int i = 0; i < lanes; i++)
        CHECK_OK(h, stream_open(h, 0, &cs[i], &s[i]));
    void *extra_cs;
    spc_stream_t *extra;
    CHECK_ST(h, stream_open(h, 0, &extra_cs, &extra), SPC_ERR_LIMIT);
    CHECK_CONTAINS(spc_last_error(h), "GPU 0 has");
    CHECK_CONTAINS(spc_last_error(h), why);
    printf("lanes: stream %d on GPU 0 refused: %s\n", lanes + 1, spc_last_error(h));
    return lanes;
}

static void run(sp_test_daemon_t *d, int lanes, const char *why)
{
    sp_test_daemon_start(d, NULL);
    spc_handle_t *h = sp_test_attach();
    spc_query_result_t *r;
    CHECK_OK(h, spc_query(h, "status", "", &r));
    long f = spc_query_find(r, 0, "gpu_status");
    CHECK(f >= 0);
    bool no_cuda = strstr(spc_query_str(r, 0, (size_t)f), "built without CUDA") != NULL;
    spc_query_free(r);
    if (no_cuda) {
        fprintf(stderr, "skipped: spd was built without CUDA\n");
        spc_detach(h);
        sp_test_daemon_stop(d);
        sp_test_daemon_cleanup(d);
        exit(SP_TEST_SKIP);
    }
    spc_group_t world;
    CHECK_OK(h, spc_job_join_named(h, "lanes", "lanes-test", 1, 0, 20000, &world));

    void *cs[32];
    spc_stream_t *s[32];
    int n = fill_gpu0(h, lanes, why, cs, s);
    /* What an operator sees: the lanes open, the bound, one refused. */
    CHECK_EQ(sp_test_status_int(h, "gpu_lanes"), lanes);
    CHECK_EQ(sp_test_status_int(h, "gpu_lanes_max"), lanes);
    CHECK_EQ(sp_test_status_int(h, "gpu_lanes_refused"), 1);
    static char metrics[1 << 17];
    char line[64];
    CHECK_EQ(sp_test_run(metrics, sizeof metrics, "%s --socket %s metrics", sp_test_spctl_bin(), d->sock), 0);
    snprintf(line, sizeof line, "\nspd_gpu_lanes %d\n", lanes);
    CHECK_CONTAINS(metrics, line);
    CHECK_CONTAINS(metrics, "\nspd_gpu_lanes_refused_total 1\n");

    /* The bound is per GPU: GPU 1 still has its lanes, for another client of
     * this process too. */
    spc_handle_t *h1 = sp_test_attach();
    spc_group_t world1;
    CHECK_OK(h1, spc_job_join_named(h1, "lanes-gpu1", "lanes-test", 1, 0, 20000, &world1));
    void *cs1;
    spc_stream_t *s1;
    CHECK_OK(h1, stream_open(h1, 1, &cs1, &s1));
    CHECK_OK(h1, spc_stream_destroy(s1));
    spc_detach(h1);

    /* A lane given back is there for the next stream, and it serves. */
    CHECK_OK(h, spc_stream_destroy(s[n - 1]));
    CHECK_OK(h, stream_open(h, 0, &cs[n - 1], &s[n - 1]));
    stream_allreduce(h, world, s[n - 1]);
    for (int i = 0; i < n; i++)
        CHECK_OK(h, spc_stream_destroy(s[i]));
    spc_detach(h);
    CHECK_EQ(sp_test_daemon_stop(d), 0);
    sp_test_daemon_cleanup(d);
}

int main(void)
{
    sp_test_use_stub_cuda(SP_STUB_CUDA_DIR);
    setenv("SP_TEST_SPD", SPD_STUB_BIN, 1);
    setenv("SPD_STUB_CUDA_GPUS", "2", 1);
    sp_test_daemon_t d;

    setenv("SPD_GPU_LANES_MAX", "3", 1);
    run(&d, 3, "gpu_lanes_max 3");
    unsetenv("SPD_GPU_LANES_MAX");

    setenv("CUDA_DEVICE_MAX_CONNECTIONS", "3", 1);
    run(&d, 2, "CUDA_DEVICE_MAX_CONNECTIONS 3");
    unsetenv("CUDA_DEVICE_MAX_CONNECTIONS");

    printf("gpu_lanes_stub: streams past gpu_lanes_max, and past the hardware queues of "
           "CUDA_DEVICE_MAX_CONNECTIONS, refused saying why; other GPUs and freed lanes still serve\n");
    return 0;
}
