/*
 * The GPU memory spd stages ops across daemons through is bounded per GPU by
 * gpu_device_staging_bytes: daemon/gpu/gpu.c over the stand-in driver
 * (tests/stubcuda), two of its GPUs, the bound at 1 MiB as region.c sets it
 * from the option. Blocks round up to powers of two from 64 KiB and are kept
 * once made, so the free ones count:
 *
 *   - 600 KiB takes a block of 1 MiB on GPU 0, all the bound; given back and
 *     asked again for 300 KiB, the same block serves (nothing new is made);
 *   - while it is held, 64 KiB more on GPU 0 is refused with SPC_ERR_LIMIT
 *     naming the GPU, the option and the bytes, and so is 2 MiB, more than the
 *     bound itself; the refused gets leave nothing counted behind;
 *   - the bound is per GPU: GPU 1 gives its own 1 MiB meanwhile;
 *   - once the block is back, the next get within the bound is served by it,
 *     and its memory holds what is written to it.
 *
 * An op across daemons on GPU memory needs NCCL, which this machine lacks, so
 * the refusal as a client sees it (the op fails on every rank with the detail,
 * and the next one runs) is test_nccl_nodes's, on GPUs.
 */
#include "sp_test.h"

#include "base/config.h"
#include "base/err.h"
#include "gpu/devices.h"
#include "gpu/gpu.h"
#include "gpu/gpu_int.h"

#define KIB 1024ull
#define MIB (1024ull * 1024)

static sp_gpu_stage_t *get_ok(int dev, uint64_t bytes)
{
    sp_err_t e = SP_ERR_INIT;
    sp_gpu_stage_t *s = NULL;
    spc_status_t st = sp_gpu_stage_get(dev, bytes, &s, &e);
    if (st != SPC_OK)
        SP_FAIL("GPU %d: %" PRIu64 " bytes of staging: %s (%s)", dev, bytes, spc_status_name(st), e.msg);
    CHECK(s != NULL && sp_gpu_stage_ptr(s) != NULL);
    return s;
}

static void get_refused(int dev, uint64_t bytes, const char *kept)
{
    sp_err_t e = SP_ERR_INIT;
    sp_gpu_stage_t *s = NULL;
    spc_status_t st = sp_gpu_stage_get(dev, bytes, &s, &e);
    if (st != SPC_ERR_LIMIT)
        SP_FAIL("GPU %d: %" PRIu64 " bytes past the bound gave %s (%s)", dev, bytes, spc_status_name(st), e.msg);
    CHECK(s == NULL);
    char gpu[16];
    snprintf(gpu, sizeof gpu, "GPU %d:", dev);
    CHECK_CONTAINS(e.msg, gpu);
    CHECK_CONTAINS(e.msg, "gpu_device_staging_bytes = 1048576");
    CHECK_CONTAINS(e.msg, kept);
    printf("refused: %s\n", e.msg);
}

int main(void)
{
    setenv("SPD_STUB_CUDA_GPUS", "2", 1);
    sp_devices_t d;
    memset(&d, 0, sizeof d);
    sp_gpu_probe(&d);
    CHECK_EQ(d.gpu_count, 2);
    sp_err_t e = SP_ERR_INIT;
    for (int dev = 0; dev < 2; dev++)
        if (sp_gpu_dev_open(dev, &e) != SPC_OK)
            SP_FAIL("GPU %d: %s", dev, e.msg);

    /* The bound region.c sets, from the option as the option table parses it. */
    sp_config_t cfg;
    sp_config_init(&cfg);
    CHECK_EQ(cfg.gpu_device_staging_bytes, 4ll << 30);
    CHECK_EQ(sp_config_set(&cfg, "gpu_device_staging_bytes", "1M", SP_SRC_CMDLINE, &e), SPC_OK);
    CHECK_EQ(sp_config_set(&cfg, "gpu_device_staging_bytes", "64K", SP_SRC_CMDLINE, &e), SPC_ERR_INVALID_ARG);
    sp_gpu_stage_limit((uint64_t)cfg.gpu_device_staging_bytes);
    sp_config_cleanup(&cfg);

    sp_gpu_stage_t *a = get_ok(0, 600 * KIB);
    void *a_ptr = sp_gpu_stage_ptr(a);
    sp_gpu_stage_put(a);
    a = get_ok(0, 300 * KIB);
    CHECK(sp_gpu_stage_ptr(a) == a_ptr);   /* the free block, not a new one */

    get_refused(0, 64 * KIB, "needs 65536 more bytes of GPU memory; spd keeps 1048576 there");
    get_refused(0, 2 * MIB, "needs 2097152 more bytes of GPU memory; spd keeps 1048576 there");

    sp_gpu_stage_t *b = get_ok(1, MIB);
    get_refused(1, 64 * KIB, "spd keeps 1048576 there");

    sp_gpu_stage_put(a);
    a = get_ok(0, 64 * KIB);
    CHECK(sp_gpu_stage_ptr(a) == a_ptr);
    memset(sp_gpu_stage_ptr(a), 0x5a, MIB);
    CHECK_EQ(((const uint8_t *)sp_gpu_stage_ptr(a))[MIB - 1], 0x5a);
    sp_gpu_stage_put(a);
    sp_gpu_stage_put(b);
    printf("ok\n");
    return 0;
}
