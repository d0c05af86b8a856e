/*
 * region.c — clients' GPU memory as regions, and the GPU layer's part in the
 * engine.
 *
 * A device registration is checked here, then imported (gpu_import.c) or its import
 * reused, and the region goes into the client's list like a host one (mem.c).
 * The engine lets go of device regions, drives client streams (stream.c) and
 * hands over device tasks through the table this layer fills in and
 * sp_gpu_install gives it (core/transport.h): the core never names a function
 * of the GPU layer.
 */
#include "gpu/gpu.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "base/log.h"
#include "core/client.h"
#include "core/engine.h"
#include "core/mem.h"
#include "core/transport.h"
#include "gpu/stream.h"
#include "sp_msg.h"

/* A cuMem range's chunk list: at most SP_DEVICE_MAX_CHUNKS chunks, in order,
 * back to back from offset 0 to the range's size, none empty, each with a
 * descriptor number. */
static spc_status_t chunks_check(const sp_gpu_export_t *x, sp_err_t *e)
{
    uint64_t end = 0;   /* where the chunks so far end; never past x->size */

    if (x->nchunks > SP_DEVICE_MAX_CHUNKS)
        return sp_err_set(e, SPC_ERR_LIMIT, "%u chunks in one cuMem registration: at most %u (register a shorter "
                          "range)", x->nchunks, SP_DEVICE_MAX_CHUNKS);
    for (uint32_t i = 0; i < x->nchunks; i++) {
        const sp_gpu_chunk_t *ch = &x->chunks[i];
        if (ch->fd < 0)
            return sp_err_set(e, SPC_ERR_INVALID_ARG, "chunk %u: bad descriptor number %d", i, ch->fd);
        if (ch->size == 0 || ch->offset != end)
            return sp_err_set(e, SPC_ERR_INVALID_ARG, "chunk %u (offset %" PRIu64 ", %" PRIu64 " bytes) %s: chunks "
                              "must be listed in address order, back to back from offset 0", i, ch->offset, ch->size,
                              ch->size == 0 ? "is empty" : ch->offset < end ? "overlaps the one before" : "leaves a "
                              "gap after the one before");
        if (ch->size > x->size - end)
            return sp_err_set(e, SPC_ERR_INVALID_ARG, "chunk %u (offset %" PRIu64 ", %" PRIu64 " bytes) runs past the "
                              "range's %" PRIu64 " bytes", i, ch->offset, ch->size, x->size);
        end += ch->size;
    }
    if (end != x->size)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "the chunks cover %" PRIu64 " of the range's %" PRIu64 " bytes", end,
                          x->size);
    return SPC_OK;
}

spc_status_t sp_region_check_device(const sp_gpu_export_t *x, uint64_t offset, uint64_t length, sp_err_t *e)
{
    if (x->base == 0 || x->size == 0 || x->base + x->size < x->base || length == 0 || offset > x->size ||
        length > x->size - offset)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "bad device range: %" PRIu64 " bytes at offset %" PRIu64 " of an "
                          "allocation of %" PRIu64 " bytes at 0x%" PRIx64, length, offset, x->size, x->base);
    if ((x->ipc_handle == NULL) == (x->nchunks == 0))
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "device memory is either a cudaMalloc allocation (an IPC handle) or "
                          "a cuMem range (chunks): this request has %s", x->ipc_handle == NULL ? "neither" : "both");
    return x->nchunks > 0 ? chunks_check(x, e) : SPC_OK;
}

/*
 * Device registration:
 *   - checks what the client sent (a range inside the memory, a sound chunk
 *     list) before the driver sees any of it;
 *   - drops every import that x contradicts: memory the client freed, whose
 *     addresses now hold other memory (a cudaMalloc allocation of another
 *     buffer id; a cuMem chunk unmapped and mapped anew). Its regions named
 *     freed memory and go with it;
 *   - reuses the import of exactly this memory when there is one, or imports it.
 * cuMem ranges that share a chunk agree where they meet: each is an import of
 * its own, and registering one leaves the other be.
 */
spc_status_t sp_region_add_device(sp_engine_t *eng, sp_client_t *c, const sp_gpu_export_t *x, uint64_t offset,
                                  uint64_t length, uint32_t want, uint32_t *id_p, sp_err_t *e)
{
    sp_gpu_import_t *imp;
    char what[128];

    spc_status_t st = sp_region_check_device(x, offset, length, e);
    if (st != SPC_OK)
        return st;
    while ((imp = sp_gpu_import_stale(c, x)) != NULL) {
        sp_gpu_import_describe(imp, what, sizeof what);
        sp_warn(MEM, "client %" PRIu64 ": the %s was freed and reused (other memory is at 0x%" PRIx64 " now): its "
                "import and regions are dropped, the new memory is imported", c->id, what, x->base);
        sp_gpu_import_unlist(imp);
        sp_regions_drop_import(eng, c, imp);   /* may close imp: it is not used past here */
        eng->gpu_sched->reimports++;
    }
    st = sp_region_admit(eng, c, x->base + offset, length, e);
    if (st != SPC_OK)
        return st;
    imp = sp_gpu_import_match(c, x);
    if (imp != NULL) {
        sp_gpu_import_ref(imp);
    } else if ((st = sp_gpu_import_open(eng, c, x, &imp, e)) != SPC_OK) {
        return st;
    }
    sp_region_t r = { .kind = SP_REGION_DEVICE, .id = want, .addr = x->base + offset, .length = length, .import = imp,
                      .dptr = sp_gpu_import_ptr(imp) + offset, .gpu = sp_gpu_import_device(imp) };
    st = sp_region_insert(eng, c, &r, id_p, e);
    if (st != SPC_OK)
        sp_gpu_import_unref(eng, imp);
    return st;
}

/* ---------------------------------------------------------------- the engine's ops */

/* A device region goes: its reference to the import with it. */
static void gpu_region_drop(sp_engine_t *eng, sp_region_t *r)
{
    sp_gpu_import_unref(eng, r->import);
}

/* A client's regions are gone: its imports still held by a running task close
 * when it lets go, and are found through the client no more. */
static void gpu_regions_gone(sp_client_t *c)
{
    while (c->imports != NULL)
        sp_gpu_import_unlist(c->imports);
}

static const sp_transport_ops_t gpu_ops = {
    .shutdown     = sp_stream_shutdown,
    .stop         = sp_stream_stop,
    .cleanup      = sp_stream_cleanup,
    .progress     = sp_stream_poll,
    .busy         = sp_stream_busy,
    .client_gone  = sp_stream_client_gone,
    .client_free  = sp_stream_client_free,
    .region_drop  = gpu_region_drop,
    .regions_gone = gpu_regions_gone,
    .op_consume   = sp_stream_consume,
    .op_validate  = sp_stream_validate,
    .op_unstarted = sp_stream_op_unstarted,
    .task_ready   = sp_stream_task_ready,
    .import_ref   = sp_gpu_import_ref,
    .import_unref = sp_gpu_import_unref,
};

spc_status_t sp_gpu_install(sp_engine_t *eng, sp_err_t *e)
{
    eng->gpu_sched = calloc(1, sizeof *eng->gpu_sched);
    if (eng->gpu_sched == NULL)
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory setting up the GPU layer");
    eng->gpu_ops = &gpu_ops;
    sp_gpu_hstage_limit((uint64_t)eng->cfg->gpu_host_staging_bytes);
    sp_gpu_stage_limit((uint64_t)eng->cfg->gpu_device_staging_bytes);
    sp_gpu_lane_limit((int)eng->cfg->gpu_lanes_max);
    return SPC_OK;
}
