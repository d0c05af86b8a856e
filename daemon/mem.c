/*
 * mem.c — the memory an operation may touch.
 *
 * A tensor names (region, offset, bytes). Region 0 is the client's arena, which
 * the daemon has mapped: it is used in place. Other regions are ranges the
 * client registered. Host ones are reached with process_vm_readv/writev, which
 * fail cleanly (EFAULT) if the client unmapped the range since. Device ones are
 * slices of a GPU allocation the daemon imported (gpu.c): the region holds a
 * reference to the import, and the import is found again by (client, base) so
 * that a second registration of the same allocation opens nothing. Every size
 * and offset comes from a client, so every check here is written so it cannot
 * overflow.
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

/*
 * Device registration:
 *   - checks what the client sent (handle and UUID lengths, a range inside the
 *     allocation) before the driver sees any of it;
 *   - reuses the import of the allocation at x->base when its buffer id and
 *     size are the ones sent;
 *   - otherwise the allocation was freed and the address reused: the stale
 *     import is taken out (its regions named freed memory and go with it) and
 *     the new allocation is imported.
 */
spc_status_t sp_region_add_device(sp_engine_t *eng, sp_client_t *c, const sp_gpu_export_t *x, uint64_t offset,
                                  uint64_t length, uint32_t *id_p, char *err, size_t errlen)
{
    sp_gpu_import_t *imp;

    if (x->base == 0 || x->size == 0 || length == 0 || offset > x->size || length > x->size - offset) {
        snprintf(err, errlen, "bad device range: %" PRIu64 " bytes at offset %" PRIu64 " of an allocation of %" PRIu64
                 " bytes at 0x%" PRIx64, length, offset, x->size, x->base);
        return SPC_ERR_INVALID_ARG;
    }
    imp = sp_gpu_import_find(c, x->base);
    if (imp != NULL && (sp_gpu_import_buffer_id(imp) != x->buffer_id || sp_gpu_import_size(imp) != x->size)) {
        sp_warn(MEM, "client %" PRIu64 ": the allocation at 0x%" PRIx64 " was freed and reused (buffer id %" PRIu64
                " -> %" PRIu64 "): its old import and regions are dropped, the new one is imported", c->id, x->base,
                sp_gpu_import_buffer_id(imp), x->buffer_id);
        sp_gpu_import_unlist(imp);
        for (uint32_t i = c->nregions; i-- > 0;)
            if (c->regions[i].import == imp)
                region_drop(eng, c, i);   /* may close imp: it is not used past here */
        eng->gpu_reimports++;
        imp = NULL;
    }
    spc_status_t st = region_admit(eng, c, x->base + offset, length, err, errlen);
    if (st != SPC_OK)
        return st;
    if (imp != NULL) {
        sp_gpu_import_ref(imp);
    } else if ((st = sp_gpu_import_open(eng, c, x, &imp, err, errlen)) != SPC_OK) {
        return st;
    }
    sp_region_t r = { .kind = SP_REGION_DEVICE, .addr = x->base + offset, .length = length, .import = imp,
                      .dptr = sp_gpu_import_ptr(imp) + offset };
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
