/*
 * mem.c — the memory an operation may touch.
 *
 * A tensor names (region, offset, bytes). Region 0 is the client's arena, which
 * the daemon has mapped: it is used in place. Other regions are ranges the
 * client registered. Host ones are reached with process_vm_readv/writev, which
 * fail cleanly (EFAULT) if the client unmapped the range since. Device ones are
 * slices of GPU memory the daemon imported (gpu.c): a cudaMalloc allocation, or
 * a cuMem range of several chunks. The region holds a reference to the import,
 * and the import is found again by what the client says the memory is, so that
 * a second registration of the same memory opens nothing. Every size and offset
 * comes from a client, so every check here is written so it cannot overflow.
 */
#include "engine.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

#include "gpu.h"
#include "log.h"
#include "sp_msg.h"

static const sp_region_t *region_find(const sp_client_t *c, uint32_t id)
{
    for (uint32_t i = 0; i < c->nregions; i++)
        if (c->regions[i].id == id)
            return &c->regions[i];
    return NULL;
}

spc_status_t sp_mem_check(const sp_client_t *c, const struct sp_tensor_ref *t, uint64_t need,
                          char *detail, size_t len)
{
    uint64_t size;

    if (t->region == SP_REGION_ARENA) {
        size = c->layout.arena_bytes;
    } else {
        const sp_region_t *r = region_find(c, t->region);
        if (r == NULL) {
            snprintf(detail, len, "region %u is not registered by this client", t->region);
            return SPC_ERR_BAD_REGION;
        }
        size = r->length;
    }
    /* offset + need <= size, written without the sum */
    if (t->offset > size || need > size - t->offset) {
        snprintf(detail, len, "%" PRIu64 " bytes at offset %" PRIu64 " exceed region %u (%" PRIu64 " bytes)",
                 need, t->offset, t->region, size);
        return SPC_ERR_OUT_OF_BOUNDS;
    }
    return SPC_OK;
}

void *sp_mem_direct(const sp_client_t *c, const struct sp_tensor_ref *t)
{
    return t->region == SP_REGION_ARENA ? c->v.arena + t->offset : NULL;
}

const sp_region_t *sp_mem_device(const sp_client_t *c, const struct sp_tensor_ref *t)
{
    const sp_region_t *r = t->region == SP_REGION_ARENA ? NULL : region_find(c, t->region);
    return r != NULL && r->kind == SP_REGION_DEVICE ? r : NULL;
}

uint64_t sp_mem_remote_addr(const sp_client_t *c, const struct sp_tensor_ref *t)
{
    const sp_region_t *r = region_find(c, t->region);
    return r != NULL ? r->addr + t->offset : 0;
}

/* process_vm_readv/writev may move fewer bytes than asked; loop until done. */
spc_status_t sp_mem_vm_copy(const sp_client_t *c, uint64_t remote, void *local, uint64_t len, bool write,
                            char *detail, size_t dlen)
{
    uint64_t done = 0;
    while (done < len) {
        struct iovec l = { (char *)local + done, len - done };
        struct iovec r = { (void *)(uintptr_t)(remote + done), len - done };
        ssize_t n = write ? process_vm_writev(c->pid, &l, 1, &r, 1, 0)
                          : process_vm_readv(c->pid, &l, 1, &r, 1, 0);
        if (n <= 0) {
            int err = n < 0 ? errno : EFAULT;
            snprintf(detail, dlen, "cannot %s %" PRIu64 " bytes at 0x%" PRIx64 " of pid %d: %s",
                     write ? "write" : "read", len - done, remote + done, (int)c->pid, strerror(err));
            sp_warn(MEM, "client %" PRIu64 ": %s", c->id, detail);
            return err == EPERM ? SPC_ERR_PERMISSION : SPC_ERR_BAD_REGION;
        }
        done += (uint64_t)n;
    }
    return SPC_OK;
}

/* ---------------------------------------------------------------- registration */

/* The checks every registration passes: a sane range, the limit, no overlap
 * (host and device addresses share the client's one address space). */
static spc_status_t region_admit(const sp_engine_t *eng, const sp_client_t *c, uint64_t addr, uint64_t length,
                                 char *err, size_t errlen)
{
    if (length == 0 || addr == 0 || addr + length < addr) {
        snprintf(err, errlen, "bad range 0x%" PRIx64 " + %" PRIu64, addr, length);
        return SPC_ERR_INVALID_ARG;
    }
    if (c->nregions >= (uint64_t)eng->cfg->max_registrations) {
        snprintf(err, errlen, "client already has %u registrations (max_registrations)", c->nregions);
        return SPC_ERR_LIMIT;
    }
    for (uint32_t i = 0; i < c->nregions; i++) {
        const sp_region_t *r = &c->regions[i];
        if (addr < r->addr + r->length && r->addr < addr + length) {
            snprintf(err, errlen, "range overlaps region %u", r->id);
            return SPC_ERR_INVALID_ARG;
        }
    }
    return SPC_OK;
}

/* Gives *r an id and appends it to c's regions. */
static spc_status_t region_insert(sp_engine_t *eng, sp_client_t *c, sp_region_t *r, uint32_t *id_p, char *err,
                                  size_t errlen)
{
    if (c->nregions == c->regions_cap) {
        uint32_t cap = c->regions_cap ? c->regions_cap * 2 : 8;
        sp_region_t *n = realloc(c->regions, cap * sizeof *n);
        if (n == NULL) {
            snprintf(err, errlen, "out of memory");
            return SPC_ERR_NO_MEMORY;
        }
        c->regions = n;
        c->regions_cap = cap;
    }
    r->id = eng->next_region_id++;
    if (eng->next_region_id == 0)
        eng->next_region_id = 1;
    c->regions[c->nregions++] = *r;
    c->registered_bytes += r->length;
    if (r->kind == SP_REGION_DEVICE) {
        c->device_regions++;
        c->device_bytes += r->length;
    }
    sp_debug(MEM, "client %" PRIu64 ": %s region %u = 0x%" PRIx64 " + %" PRIu64, c->id,
             r->kind == SP_REGION_DEVICE ? "device" : "host", r->id, r->addr, r->length);
    *id_p = r->id;
    return SPC_OK;
}

/* Takes region i out of c's list, dropping its import reference. */
static void region_drop(sp_engine_t *eng, sp_client_t *c, uint32_t i)
{
    sp_region_t r = c->regions[i];
    c->regions[i] = c->regions[--c->nregions];
    c->registered_bytes -= r.length;
    if (r.kind == SP_REGION_DEVICE) {
        c->device_regions--;
        c->device_bytes -= r.length;
        sp_gpu_import_unref(eng, r.import);
    }
}

spc_status_t sp_region_add(sp_engine_t *eng, sp_client_t *c, uint64_t addr, uint64_t length,
                           uint32_t *id_p, char *err, size_t errlen)
{
    uint8_t probe;

    spc_status_t admit = region_admit(eng, c, addr, length, err, errlen);
    if (admit != SPC_OK)
        return admit;
    /* The first and the last byte must be reachable now; later faults are caught
     * on each access. */
    sp_region_t tmp = { .kind = SP_REGION_HOST, .addr = addr, .length = length };
    spc_status_t st = sp_mem_vm_copy(c, addr, &probe, 1, false, err, errlen);
    if (st == SPC_OK)
        st = sp_mem_vm_copy(c, addr + length - 1, &probe, 1, false, err, errlen);
    if (st != SPC_OK)
        return st;

    return region_insert(eng, c, &tmp, id_p, err, errlen);
}

/* A cuMem range's chunk list: at most SP_DEVICE_MAX_CHUNKS chunks, in order,
 * back to back from offset 0 to the range's size, none empty, each with a
 * descriptor number. */
static spc_status_t chunks_check(const sp_gpu_export_t *x, char *err, size_t errlen)
{
    uint64_t end = 0;   /* where the chunks so far end; never past x->size */

    if (x->nchunks > SP_DEVICE_MAX_CHUNKS) {
        snprintf(err, errlen, "%u chunks in one cuMem registration: at most %u (register a shorter range)",
                 x->nchunks, SP_DEVICE_MAX_CHUNKS);
        return SPC_ERR_LIMIT;
    }
    for (uint32_t i = 0; i < x->nchunks; i++) {
        const sp_gpu_chunk_t *ch = &x->chunks[i];
        if (ch->fd < 0) {
            snprintf(err, errlen, "chunk %u: bad descriptor number %d", i, ch->fd);
            return SPC_ERR_INVALID_ARG;
        }
        if (ch->size == 0 || ch->offset != end) {
            snprintf(err, errlen, "chunk %u (offset %" PRIu64 ", %" PRIu64 " bytes) %s: chunks must be listed in "
                     "address order, back to back from offset 0", i, ch->offset, ch->size,
                     ch->size == 0 ? "is empty" : ch->offset < end ? "overlaps the one before" :
                     "leaves a gap after the one before");
            return SPC_ERR_INVALID_ARG;
        }
        if (ch->size > x->size - end) {
            snprintf(err, errlen, "chunk %u (offset %" PRIu64 ", %" PRIu64 " bytes) runs past the range's %" PRIu64
                     " bytes", i, ch->offset, ch->size, x->size);
            return SPC_ERR_INVALID_ARG;
        }
        end += ch->size;
    }
    if (end != x->size) {
        snprintf(err, errlen, "the chunks cover %" PRIu64 " of the range's %" PRIu64 " bytes", end, x->size);
        return SPC_ERR_INVALID_ARG;
    }
    return SPC_OK;
}

spc_status_t sp_region_check_device(const sp_gpu_export_t *x, uint64_t offset, uint64_t length, char *err,
                                    size_t errlen)
{
    if (x->base == 0 || x->size == 0 || x->base + x->size < x->base || length == 0 || offset > x->size ||
        length > x->size - offset) {
        snprintf(err, errlen, "bad device range: %" PRIu64 " bytes at offset %" PRIu64 " of an allocation of %" PRIu64
                 " bytes at 0x%" PRIx64, length, offset, x->size, x->base);
        return SPC_ERR_INVALID_ARG;
    }
    if ((x->ipc_handle == NULL) == (x->nchunks == 0)) {
        snprintf(err, errlen, "device memory is either a cudaMalloc allocation (an IPC handle) or a cuMem range "
                 "(chunks): this request has %s", x->ipc_handle == NULL ? "neither" : "both");
        return SPC_ERR_INVALID_ARG;
    }
    return x->nchunks > 0 ? chunks_check(x, err, errlen) : SPC_OK;
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
                                  uint64_t length, uint32_t *id_p, char *err, size_t errlen)
{
    sp_gpu_import_t *imp;
    char what[128];

    spc_status_t st = sp_region_check_device(x, offset, length, err, errlen);
    if (st != SPC_OK)
        return st;
    while ((imp = sp_gpu_import_stale(c, x)) != NULL) {
        sp_gpu_import_describe(imp, what, sizeof what);
        sp_warn(MEM, "client %" PRIu64 ": the %s was freed and reused (other memory is at 0x%" PRIx64 " now): its "
                "import and regions are dropped, the new memory is imported", c->id, what, x->base);
        sp_gpu_import_unlist(imp);
        for (uint32_t i = c->nregions; i-- > 0;)
            if (c->regions[i].import == imp)
                region_drop(eng, c, i);   /* may close imp: it is not used past here */
        eng->gpu_reimports++;
    }
    st = region_admit(eng, c, x->base + offset, length, err, errlen);
    if (st != SPC_OK)
        return st;
    imp = sp_gpu_import_match(c, x);
    if (imp != NULL) {
        sp_gpu_import_ref(imp);
    } else if ((st = sp_gpu_import_open(eng, c, x, &imp, err, errlen)) != SPC_OK) {
        return st;
    }
    sp_region_t r = { .kind = SP_REGION_DEVICE, .addr = x->base + offset, .length = length, .import = imp,
                      .dptr = sp_gpu_import_ptr(imp) + offset, .gpu = sp_gpu_import_device(imp) };
    st = region_insert(eng, c, &r, id_p, err, errlen);
    if (st != SPC_OK)
        sp_gpu_import_unref(eng, imp);
    return st;
}

void sp_regions_release(sp_engine_t *eng, sp_client_t *c)
{
    while (c->nregions > 0)
        region_drop(eng, c, c->nregions - 1);
    /* Imports still held by a running task close when it lets go; the client
     * must no longer be found through them. */
    while (c->imports != NULL)
        sp_gpu_import_unlist(c->imports);
}

spc_status_t sp_region_remove(sp_engine_t *eng, sp_client_t *c, uint32_t id, char *err, size_t errlen)
{
    for (uint32_t i = 0; i < c->nregions; i++) {
        if (c->regions[i].id == id) {
            region_drop(eng, c, i);
            return SPC_OK;
        }
    }
    snprintf(err, errlen, "region %u is not registered by this client", id);
    return SPC_ERR_BAD_REGION;
}
