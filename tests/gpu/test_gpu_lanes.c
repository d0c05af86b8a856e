/*
 * spd's lanes on one GPU, each on a hardware queue of its own: one client's
 * stream is stalled before a stream-ordered all-reduce, so spd's lane for it
 * waits (cuStreamWaitValue64) at the head of its queue for a ready that comes
 * only after the stall. Beside it, 30 other clients' streams (31 lanes in all,
 * spd's own stream the 32nd queue) each run an all-reduce, and every one must
 * complete while the stall holds. Were the lanes more than the queues
 * CUDA_DEVICE_MAX_CONNECTIONS gives (8 unless set), the lanes sharing the
 * stalled lane's queue would wait out the stall behind its wait. One stream
 * more is refused (SPC_ERR_LIMIT, naming gpu_lanes_max), and spd serves on.
 *
 * Each client is a handle of this process in a one-rank job of its own, so
 * nothing but the GPU's queues orders one's op after another's.
 *
 * Needs a GPU; without one it says why and exits 77 (skipped).
 */
#include "sp_gpu_test.h"

#define LANES    31
#define N_ELEMS  4096u
#define STALL_MS 6000

struct client {
    spc_handle_t *h;
    spc_group_t   world;
    cudaStream_t  cs;
    spc_stream_t *s;
    float        *x, *y;
};

static float input_of(int c, uint32_t i)
{
    return (float)(c * 100 + (int)(i % 89));
}

static void client_open(struct client *c, int i)
{
    char name[32];
    spc_region_t r;
    c->h = sp_test_attach();
    snprintf(name, sizeof name, "lanes-%d", i);
    CHECK_OK(c->h, spc_job_join_named(c->h, name, "gpu-lanes-test", 1, 0, 20000, &c->world));
    CUDA_CHECK(cudaStreamCreateWithFlags(&c->cs, cudaStreamNonBlocking));
    CHECK_OK(c->h, spc_stream_create(c->h, c->cs, &c->s));
    CUDA_CHECK(cudaMalloc((void **)&c->x, N_ELEMS * sizeof(float)));
    CUDA_CHECK(cudaMalloc((void **)&c->y, N_ELEMS * sizeof(float)));
    CHECK_OK(c->h, spc_register_device(c->h, c->x, N_ELEMS * sizeof(float), &r));
    CHECK_OK(c->h, spc_register_device(c->h, c->y, N_ELEMS * sizeof(float), &r));
    float host[N_ELEMS];
    for (uint32_t k = 0; k < N_ELEMS; k++)
        host[k] = input_of(i, k);
    CUDA_CHECK(cudaMemcpy(c->x, host, sizeof host, cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemset(c->y, 0, N_ELEMS * sizeof(float)));
}

/* The all-reduce of a one-rank job: y must be x. */
static void client_check(const struct client *c, int i)
{
    float host[N_ELEMS];
    CUDA_CHECK(cudaMemcpy(host, c->y, sizeof host, cudaMemcpyDeviceToHost));
    for (uint32_t k = 0; k < N_ELEMS; k++)
        if (host[k] != input_of(i, k))
            SP_FAIL("client %d: element %u is %g, want %g", i, k, host[k], input_of(i, k));
}

static int lanes_main(void *arg)
{
    (void)arg;
    CUDA_CHECK(cudaSetDevice(0));
    static struct client c[LANES];
    for (int i = 0; i < LANES; i++)
        client_open(&c[i], i);

    /* One more stream is past gpu_lanes_max: refused, saying so. */
    cudaStream_t extra_cs;
    spc_stream_t *extra;
    CUDA_CHECK(cudaStreamCreateWithFlags(&extra_cs, cudaStreamNonBlocking));
    CHECK_ST(c[0].h, spc_stream_create(c[0].h, extra_cs, &extra), SPC_ERR_LIMIT);
    CHECK_CONTAINS(spc_last_error(c[0].h), "gpu_lanes_max");
    printf("lanes: stream %d refused: %s\n", LANES + 1, spc_last_error(c[0].h));

    /* Client 0's lane waits at its queue's head for the stall's end. */
    spc_request_t *req[LANES];
    sp_gpu_stall(c[0].cs, STALL_MS);
    for (int i = 0; i < LANES; i++) {
        CHECK_OK(c[i].h, spc_set_stream(c[i].h, c[i].s));
        CHECK_OK(c[i].h, sp_gpu_stream_allreduce(c[i].h, c[i].world, c[i].x, c[i].y, N_ELEMS, 30000, &req[i]));
    }
    uint64_t t0 = sp_test_now_ms();
    for (int i = 1; i < LANES; i++) {
        CUDA_CHECK(cudaStreamSynchronize(c[i].cs));
        client_check(&c[i], i);
    }
    uint64_t others_ms = sp_test_now_ms() - t0;
    if (cudaStreamQuery(c[0].cs) != cudaErrorNotReady)
        SP_FAIL("the stalled stream finished before the others were checked: the stall proves nothing");
    if (others_ms >= STALL_MS / 2)
        SP_FAIL("the other %d lanes' all-reduces took %llu ms, during a %d ms stall of lane 0's stream: a lane "
                "shares the stalled one's hardware queue", LANES - 1, (unsigned long long)others_ms, STALL_MS);
    CUDA_CHECK(cudaStreamSynchronize(c[0].cs));
    client_check(&c[0], 0);
    for (int i = 0; i < LANES; i++) {
        CHECK_OK(c[i].h, spc_wait(req[i], 10000));
        spc_request_release(req[i]);
        CHECK_OK(c[i].h, spc_set_stream(c[i].h, NULL));
        CHECK_OK(c[i].h, spc_stream_destroy(c[i].s));
        spc_detach(c[i].h);
    }
    printf("lanes: %d lanes beside one stalled %d ms: their all-reduces right in %llu ms\n", LANES - 1, STALL_MS,
           (unsigned long long)others_ms);
    return 0;
}

int main(void)
{
    if (sp_gpu_test_probe() == SP_TEST_SKIP)
        return SP_TEST_SKIP;
    unsetenv("CUDA_DEVICE_MAX_CONNECTIONS");   /* spd's own choice: 32 */
    sp_test_daemon_t d;
    sp_test_daemon_start(&d, NULL);
    CHECK_EQ(sp_test_wait(sp_test_fork(lanes_main, NULL), 120000), 0);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
    printf("ok\n");
    return 0;
}
