/*
 * gpu_import.c — clients' GPU memory opened in the daemon (gpu.h says how):
 * a cudaMalloc allocation over CUDA IPC, or cuMem chunks imported from their
 * file descriptors and mapped back to back in one range of the daemon's; the
 * imports a client holds, found again by what the client says the memory is,
 * and counted, the last reference closing one; and the same memory made
 * reachable from the other GPUs whose kernels read it (sp_gpu_import_on).
 * Engine lock held.
 */
#include "gpu/gpu.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "core/client.h"
#include "core/engine.h"
#include "gpu/devices.h"
#include "gpu/gpu_int.h"
#include "gpu/stream.h"

#ifdef SP_HAVE_CUDA

struct sp_gpu_import {
    sp_gpu_import_t *next;        /* owner->imports while listed */
    sp_client_t     *owner;       /* valid while listed: a client's end unlists its imports */
    uint64_t         owner_id;
    bool             listed;
    uint32_t         refs;
    /* What the client said the memory is: found again, and told apart, by it. */
    uint64_t         base, size, buffer_id;
    uint32_t         nchunks;     /* 0: a cudaMalloc allocation, opened over IPC */
    sp_gpu_chunk_t  *chunks;      /* cuMem: offsets, sizes and ids (fds -1) */
    int              dev;         /* the daemon's ordinal */
    CUdeviceptr      dptr;        /* the memory's base in the daemon */
    /* Other GPUs that read it (sp_gpu_import_on): a cudaMalloc allocation is
     * opened once more in each one's context, at its own address there; a cuMem
     * range is given each one's access at dptr. */
    uint8_t          ipc_handle[SP_GPU_IPC_HANDLE_BYTES];
    uint64_t         readers;     /* bit d: reachable from GPU d */
    CUdeviceptr      at[SP_TOPO_MAX_GPUS];   /* the base in GPU d's context; dptr for dev */
};

/* Opens a cudaMalloc allocation's IPC handle: *dptr_p is its base in the daemon. */
static spc_status_t ipc_open(const sp_client_t *c, const sp_gpu_export_t *x, int dev, CUdeviceptr *dptr_p,
                             sp_err_t *e)
{
    CUipcMemHandle handle;

    memcpy(handle.reserved, x->ipc_handle, sizeof handle.reserved);
    CUresult rc = sp_cu.ipc_open(dptr_p, handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    if (rc != CUDA_SUCCESS) {
        sp_err_set(e, SPC_ERR_DEVICE, "cannot open the IPC handle of 0x%" PRIx64 " (%" PRIu64 " bytes) of pid %d on "
                   "GPU %d: %s (error %d)", x->base, x->size, (int)c->pid, dev, sp_cu_msg(rc), (int)rc);
        sp_warn(MEM, "client %" PRIu64 ": %s", c->id, e->msg);
        return e->status;
    }
    return SPC_OK;
}

/* A failed step of vmm_map, logged with the driver's message. */
static spc_status_t vmm_fail(const sp_client_t *c, const sp_gpu_export_t *x, uint32_t i, const char *what,
                             CUresult rc, sp_err_t *e)
{
    sp_err_set(e, SPC_ERR_DEVICE, "cuMem range 0x%" PRIx64 " of pid %d, chunk %u of %u (+%" PRIu64 ", %" PRIu64
               " bytes): %s: %s (error %d)", x->base, (int)c->pid, i, x->nchunks, x->chunks[i].offset,
               x->chunks[i].size, what, sp_cu_msg(rc), (int)rc);
    sp_warn(MEM, "client %" PRIu64 ": %s", c->id, e->msg);
    return e->status;
}

/*
 * Maps a client's cuMem range into the daemon, device dev's context current:
 *   - imports each chunk's descriptor (cuMemImportFromShareableHandle) and
 *     checks its offset and size against the allocation's granularity, which
 *     cuMemMap requires;
 *   - reserves one range of x->size bytes, aligned as the coarsest chunk needs;
 *   - maps each chunk at its offset and lets device dev read and write it;
 *   - releases the imported handles: the mappings keep the memory until
 *     vmm_unmap (cuMemRelease frees it only when no mapping is left).
 * On failure everything done so far is undone.
 */
static spc_status_t vmm_map(const sp_client_t *c, const sp_gpu_export_t *x, int dev, CUdeviceptr *va_p, sp_err_t *e)
{
    CUmemGenericAllocationHandle *h = calloc(x->nchunks, sizeof *h);
    CUdeviceptr va = 0;
    uint32_t imported = 0, mapped = 0;
    size_t align = 0;
    spc_status_t st = SPC_OK;
    CUresult rc;

    if (h == NULL)
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    for (uint32_t i = 0; i < x->nchunks; i++) {
        const sp_gpu_chunk_t *ch = &x->chunks[i];
        CUmemAllocationProp prop;
        size_t g = 0;
        rc = sp_cu.mem_import(&h[i], (void *)(uintptr_t)ch->fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        if (rc != CUDA_SUCCESS) {
            st = vmm_fail(c, x, i, "cuMemImportFromShareableHandle", rc, e);
            goto undo;
        }
        imported = i + 1;
        memset(&prop, 0, sizeof prop);
        if ((rc = sp_cu.mem_props(&prop, h[i])) == CUDA_SUCCESS) {
            /* Asked for the daemon's device: the handle's location names the
             * client's ordinal of the GPU, which need not be the daemon's. */
            prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
            prop.location.id = dev;
            rc = sp_cu.mem_granularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
        }
        if (rc != CUDA_SUCCESS) {
            st = vmm_fail(c, x, i, "the allocation's granularity", rc, e);
            goto undo;
        }
        if (g == 0 || ch->offset % g != 0 || ch->size % g != 0) {
            st = sp_err_set(e, SPC_ERR_INVALID_ARG, "cuMem range 0x%" PRIx64 ", chunk %u: offset %" PRIu64 " and size %"
                            PRIu64 " must be multiples of the allocation granularity (%zu bytes)", x->base, i,
                            ch->offset, ch->size, g);
            goto undo;
        }
        if (g > align)
            align = g;
    }
    /* cuMemAddressReserve takes a power of two, or 0 for its default. */
    rc = sp_cu.mem_reserve(&va, x->size, (align & (align - 1)) == 0 ? align : 0, 0, 0);
    if (rc != CUDA_SUCCESS) {
        va = 0;
        st = sp_err_set(e, SPC_ERR_DEVICE, "cannot reserve %" PRIu64 " bytes of address space for the cuMem range 0x%"
                        PRIx64 " of pid %d: %s (error %d)", x->size, x->base, (int)c->pid, sp_cu_msg(rc), (int)rc);
        sp_warn(MEM, "client %" PRIu64 ": %s", c->id, e->msg);
        goto undo;
    }
    for (uint32_t i = 0; i < x->nchunks; i++) {
        const sp_gpu_chunk_t *ch = &x->chunks[i];
        CUmemAccessDesc access;
        memset(&access, 0, sizeof access);
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = dev;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        if ((rc = sp_cu.mem_map(va + ch->offset, ch->size, 0, h[i], 0)) != CUDA_SUCCESS) {
            st = vmm_fail(c, x, i, "cuMemMap", rc, e);
            goto undo;
        }
        mapped = i + 1;
        if ((rc = sp_cu.mem_set_access(va + ch->offset, ch->size, &access, 1)) != CUDA_SUCCESS) {
            st = vmm_fail(c, x, i, "cuMemSetAccess", rc, e);
            goto undo;
        }
    }
    for (uint32_t i = 0; i < x->nchunks; i++)
        sp_cu.mem_release(h[i]);
    free(h);
    *va_p = va;
    return SPC_OK;

undo:
    while (mapped-- > 0)
        sp_cu.mem_unmap(va + x->chunks[mapped].offset, x->chunks[mapped].size);
    if (va != 0)
        sp_cu.mem_addr_free(va, x->size);
    while (imported-- > 0)
        sp_cu.mem_release(h[imported]);
    free(h);
    return st;
}

/* Undoes vmm_map, device imp->dev's context current: each chunk is unmapped
 * (cuMemUnmap takes a whole mapping), then the range is given back. */
static void vmm_unmap(const sp_gpu_import_t *imp)
{
    CUresult rc;
    for (uint32_t i = 0; i < imp->nchunks; i++) {
        rc = sp_cu.mem_unmap(imp->dptr + imp->chunks[i].offset, imp->chunks[i].size);
        if (rc != CUDA_SUCCESS)
            sp_error(MEM, "client %" PRIu64 ": cuMemUnmap of chunk %u of the cuMem range 0x%" PRIx64 ": %s (error %d)",
                     imp->owner_id, i, imp->base, sp_cu_msg(rc), (int)rc);
    }
    rc = sp_cu.mem_addr_free(imp->dptr, imp->size);
    if (rc != CUDA_SUCCESS)
        sp_error(MEM, "client %" PRIu64 ": cuMemAddressFree of the cuMem range 0x%" PRIx64 ": %s (error %d)",
                 imp->owner_id, imp->base, sp_cu_msg(rc), (int)rc);
}

spc_status_t sp_gpu_import_open(sp_engine_t *eng, sp_client_t *c, const sp_gpu_export_t *x,
                                sp_gpu_import_t **imp_p, sp_err_t *e)
{
    CUdeviceptr dptr;
    int dev;

    const char *missing = sp_cu_missing();
    if (missing != NULL)
        return sp_err_set(e, SPC_ERR_NO_DEVICE, "spd cannot import GPU memory: %s", missing);
    spc_status_t st = sp_gpu_dev_find(x->pci_bus_id, x->uuid, x->device, &dev, e);
    if (st == SPC_OK)
        st = sp_gpu_dev_open(dev, e);
    if (st == SPC_OK)
        st = sp_gpu_dev_enter(dev, e);
    if (st != SPC_OK)
        return st;
    sp_gpu_import_t *imp = calloc(1, sizeof *imp);
    sp_gpu_chunk_t *chunks = x->nchunks ? calloc(x->nchunks, sizeof *chunks) : NULL;
    if (imp == NULL || (x->nchunks && chunks == NULL)) {
        free(imp);
        free(chunks);
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    }
    st = x->nchunks ? vmm_map(c, x, dev, &dptr, e) : ipc_open(c, x, dev, &dptr, e);
    if (st != SPC_OK) {
        free(imp);
        free(chunks);
        return st;
    }
    for (uint32_t i = 0; i < x->nchunks; i++)
        chunks[i] = (sp_gpu_chunk_t){ x->chunks[i].offset, x->chunks[i].size, x->chunks[i].buffer_id,
                                      x->chunks[i].block_id, -1 };
    *imp = (sp_gpu_import_t){ .next = c->imports, .owner = c, .owner_id = c->id, .listed = true, .refs = 1,
                              .base = x->base, .size = x->size, .buffer_id = x->buffer_id, .nchunks = x->nchunks,
                              .chunks = chunks, .dev = dev, .dptr = dptr, .readers = 1ull << dev };
    imp->at[dev] = dptr;
    if (x->ipc_handle != NULL)
        memcpy(imp->ipc_handle, x->ipc_handle, sizeof imp->ipc_handle);
    c->imports = imp;
    eng->gpu_sched->imports++;
    eng->gpu_sched->imports_total++;
    char what[128];
    sp_gpu_import_describe(imp, what, sizeof what);
    sp_info(MEM, "client %" PRIu64 ": imported %s on GPU %d", c->id, what, dev);
    *imp_p = imp;
    return SPC_OK;
}

/* [a, a + an) and [b, b + bn) share a byte. Neither sum wraps: region.c checked
 * every export, and imports are made of checked exports. */
static bool overlaps(uint64_t a, uint64_t an, uint64_t b, uint64_t bn)
{
    return a < b + bn && b < a + an;
}

/* Whether two chunks at the same address are the same memory: the same extent,
 * the same mapping (buffer id) of the same physical allocation (block id). */
static bool chunk_same(const sp_gpu_chunk_t *a, const sp_gpu_chunk_t *b)
{
    return a->size == b->size && a->buffer_id == b->buffer_id && a->block_id == b->block_id;
}

/* Whether imp was made of the memory x describes wherever their addresses
 * meet (trivially, where they do not). */
static bool import_agrees(const sp_gpu_import_t *imp, const sp_gpu_export_t *x)
{
    if (!overlaps(imp->base, imp->size, x->base, x->size))
        return true;
    /* A cudaMalloc allocation on either side: live allocations do not overlap,
     * so only the same allocation agrees. */
    if (imp->nchunks == 0 || x->nchunks == 0)
        return imp->nchunks == x->nchunks && imp->base == x->base && imp->size == x->size &&
               imp->buffer_id == x->buffer_id;
    /* Two cuMem ranges: chunks that meet must be the same chunk. Both lists are
     * in address order and back to back, so one walk over both finds every
     * pair that meets. */
    uint32_t i = 0, j = 0;
    while (i < imp->nchunks && j < x->nchunks) {
        const sp_gpu_chunk_t *a = &imp->chunks[i], *b = &x->chunks[j];
        uint64_t as = imp->base + a->offset, bs = x->base + b->offset;
        if (overlaps(as, a->size, bs, b->size) && (as != bs || !chunk_same(a, b)))
            return false;
        if (as + a->size <= bs + b->size)
            i++;
        else
            j++;
    }
    return true;
}

/* Whether imp is exactly the memory x describes. */
static bool import_same(const sp_gpu_import_t *imp, const sp_gpu_export_t *x)
{
    if (imp->base != x->base || imp->size != x->size || imp->nchunks != x->nchunks)
        return false;
    if (imp->nchunks == 0)
        return imp->buffer_id == x->buffer_id;
    for (uint32_t i = 0; i < imp->nchunks; i++)
        if (imp->chunks[i].offset != x->chunks[i].offset || !chunk_same(&imp->chunks[i], &x->chunks[i]))
            return false;
    return true;
}

sp_gpu_import_t *sp_gpu_import_match(const sp_client_t *c, const sp_gpu_export_t *x)
{
    for (sp_gpu_import_t *imp = c->imports; imp != NULL; imp = imp->next)
        if (import_same(imp, x))
            return imp;
    return NULL;
}

sp_gpu_import_t *sp_gpu_import_stale(const sp_client_t *c, const sp_gpu_export_t *x)
{
    for (sp_gpu_import_t *imp = c->imports; imp != NULL; imp = imp->next)
        if (!import_agrees(imp, x))
            return imp;
    return NULL;
}

void sp_gpu_import_describe(const sp_gpu_import_t *imp, char *buf, size_t len)
{
    if (imp->nchunks == 0)
        snprintf(buf, len, "allocation 0x%" PRIx64 " (%" PRIu64 " bytes, buffer id %" PRIu64 ")", imp->base,
                 imp->size, imp->buffer_id);
    else
        snprintf(buf, len, "cuMem range 0x%" PRIx64 " (%" PRIu64 " bytes in %u chunk%s)", imp->base, imp->size,
                 imp->nchunks, imp->nchunks == 1 ? "" : "s");
}

void sp_gpu_import_unlist(sp_gpu_import_t *imp)
{
    if (!imp->listed)
        return;
    sp_gpu_import_t **pp = &imp->owner->imports;
    while (*pp != imp)
        pp = &(*pp)->next;
    *pp = imp->next;
    imp->next = NULL;
    imp->listed = false;
}

/*
 * Makes imp reachable from GPU dev, once: a cuMem range gets dev's read/write
 * access on every chunk (the mappings are the daemon's, one range for every
 * device); a cudaMalloc allocation is opened again in dev's context, with
 * peer access enabled lazily, as CUDA IPC allows one open per device. Where dev
 * cannot map imp's GPU's memory the driver refuses, and so does this.
 */
static spc_status_t reader_open(sp_gpu_import_t *imp, int dev, sp_err_t *e)
{
    char what[128];
    CUresult rc = CUDA_SUCCESS;
    if (imp->nchunks > 0) {
        CUmemAccessDesc access;
        memset(&access, 0, sizeof access);
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
        access.location.id = dev;
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
        for (uint32_t i = 0; i < imp->nchunks && rc == CUDA_SUCCESS; i++)
            rc = sp_cu.mem_set_access(imp->dptr + imp->chunks[i].offset, imp->chunks[i].size, &access, 1);
        if (rc == CUDA_SUCCESS)
            imp->at[dev] = imp->dptr;
    } else {
        CUipcMemHandle handle;
        memcpy(handle.reserved, imp->ipc_handle, sizeof handle.reserved);
        rc = sp_cu.ipc_open(&imp->at[dev], handle, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
    }
    if (rc == CUDA_SUCCESS) {
        imp->readers |= 1ull << dev;
        return SPC_OK;
    }
    imp->at[dev] = 0;
    sp_gpu_import_describe(imp, what, sizeof what);
    sp_err_set(e, SPC_ERR_DEVICE, "GPU %d cannot reach the %s on GPU %d of client %" PRIu64 " (%s): %s (error %d)",
               dev, what, imp->dev, imp->owner_id, imp->nchunks ? "cuMemSetAccess" : "cuIpcOpenMemHandle",
               sp_cu_msg(rc), (int)rc);
    sp_warn(MEM, "%s", e->msg);
    return e->status;
}

spc_status_t sp_gpu_import_on(sp_gpu_import_t *imp, int dev, uint64_t *dptr_p, sp_err_t *e)
{
    if (!(imp->readers & (1ull << dev))) {
        spc_status_t st = sp_gpu_dev_open(dev, e);
        if (st == SPC_OK)
            st = sp_gpu_dev_enter(dev, e);
        if (st == SPC_OK)
            st = reader_open(imp, dev, e);
        if (st != SPC_OK)
            return st;
        sp_info(MEM, "client %" PRIu64 ": the %s0x%" PRIx64 " of GPU %d is reachable from GPU %d", imp->owner_id,
                imp->nchunks ? "cuMem range " : "allocation ", imp->base, imp->dev, dev);
    }
    *dptr_p = imp->at[dev];
    return SPC_OK;
}

/* Closes what sp_gpu_import_on opened for other GPUs. A cuMem range's access
 * goes with its mappings (vmm_unmap). */
static void readers_close(sp_gpu_import_t *imp)
{
    sp_err_t e = SP_ERR_INIT;   /* logged where it arose */
    for (int d = 0; d < SP_TOPO_MAX_GPUS && imp->nchunks == 0; d++) {
        if (d == imp->dev || !(imp->readers & (1ull << d)) || sp_gpu_dev_enter(d, &e) != SPC_OK)
            continue;
        CUresult rc = sp_cu.ipc_close(imp->at[d]);
        if (rc != CUDA_SUCCESS)
            sp_error(MEM, "client %" PRIu64 ": cuIpcCloseMemHandle(0x%" PRIx64 ") on GPU %d: %s (error %d)",
                     imp->owner_id, imp->base, d, sp_cu_msg(rc), (int)rc);
    }
}

void sp_gpu_import_ref(sp_gpu_import_t *imp)
{
    imp->refs++;
}

void sp_gpu_import_unref(sp_engine_t *eng, sp_gpu_import_t *imp)
{
    sp_err_t e = SP_ERR_INIT;   /* logged where it arose */

    if (--imp->refs > 0)
        return;
    sp_gpu_import_unlist(imp);
    readers_close(imp);
    if (sp_gpu_dev_enter(imp->dev, &e) == SPC_OK) {
        if (imp->nchunks > 0) {
            vmm_unmap(imp);
        } else {
            CUresult rc = sp_cu.ipc_close(imp->dptr);
            if (rc != CUDA_SUCCESS)
                sp_error(MEM, "client %" PRIu64 ": cuIpcCloseMemHandle(0x%" PRIx64 "): %s (error %d)", imp->owner_id,
                         imp->base, sp_cu_msg(rc), (int)rc);
        }
    }
    eng->gpu_sched->imports--;
    sp_info(MEM, "client %" PRIu64 ": closed the import of %s0x%" PRIx64, imp->owner_id,
            imp->nchunks ? "the cuMem range " : "", imp->base);
    free(imp->chunks);
    free(imp);
}

uint64_t sp_gpu_import_ptr(const sp_gpu_import_t *imp)       { return imp->dptr; }
int      sp_gpu_import_device(const sp_gpu_import_t *imp)    { return imp->dev; }

#else /* !SP_HAVE_CUDA: no import ever opens. */

struct sp_gpu_import {
    int unused;
};

spc_status_t sp_gpu_import_open(sp_engine_t *eng, sp_client_t *c, const sp_gpu_export_t *x,
                                sp_gpu_import_t **imp_p, sp_err_t *e)
{
    return sp_err_set(e, SPC_ERR_NO_DEVICE, "spd cannot import GPU memory: it was built without CUDA");
}

/* No import ever exists in this build, so the calls below never get one. */
sp_gpu_import_t *sp_gpu_import_match(const sp_client_t *c, const sp_gpu_export_t *x) { return NULL; }
sp_gpu_import_t *sp_gpu_import_stale(const sp_client_t *c, const sp_gpu_export_t *x) { return NULL; }
void sp_gpu_import_describe(const sp_gpu_import_t *imp, char *buf, size_t len) { snprintf(buf, len, "none"); }
void sp_gpu_import_unlist(sp_gpu_import_t *imp) {}
void sp_gpu_import_ref(sp_gpu_import_t *imp) {}
void sp_gpu_import_unref(sp_engine_t *eng, sp_gpu_import_t *imp) {}
uint64_t sp_gpu_import_ptr(const sp_gpu_import_t *imp) { return 0; }
spc_status_t sp_gpu_import_on(sp_gpu_import_t *imp, int dev, uint64_t *dptr_p, sp_err_t *e)
{
    return sp_err_set(e, SPC_ERR_NO_DEVICE, "spd was built without CUDA");
}
int      sp_gpu_import_device(const sp_gpu_import_t *imp) { return -1; }

#endif /* SP_HAVE_CUDA */
