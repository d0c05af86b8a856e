/*
 * mem.c — the memory an operation may touch.
 *
 * A tensor names (region, offset, bytes). Region 0 is the client's arena, which
 * the daemon has mapped: it is used in place. Other regions are ranges the
 * client registered; they are reached with process_vm_readv/writev, which fail
 * cleanly (EFAULT) if the client unmapped the range since. Every size and offset
 * comes from a client, so every check here is written so it cannot overflow.
 */
#include "engine.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

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

spc_status_t sp_region_add(sp_engine_t *eng, sp_client_t *c, uint64_t addr, uint64_t length,
                           uint32_t *id_p, char *err, size_t errlen)
{
    uint8_t probe;

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
    /* The first and the last byte must be reachable now; later faults are caught
     * on each access. */
    sp_region_t tmp = { .id = 0, .addr = addr, .length = length };
    spc_status_t st = sp_mem_vm_copy(c, addr, &probe, 1, false, err, errlen);
    if (st == SPC_OK)
        st = sp_mem_vm_copy(c, addr + length - 1, &probe, 1, false, err, errlen);
    if (st != SPC_OK)
        return st;

    if (c->nregions == c->regions_cap) {
        uint32_t cap = c->regions_cap ? c->regions_cap * 2 : 8;
        sp_region_t *r = realloc(c->regions, cap * sizeof *r);
        if (r == NULL) {
            snprintf(err, errlen, "out of memory");
            return SPC_ERR_NO_MEMORY;
        }
        c->regions = r;
        c->regions_cap = cap;
    }
    tmp.id = eng->next_region_id++;
    if (eng->next_region_id == 0)
        eng->next_region_id = 1;
    c->regions[c->nregions++] = tmp;
    c->registered_bytes += length;
    sp_debug(MEM, "client %" PRIu64 ": region %u = 0x%" PRIx64 " + %" PRIu64, c->id, tmp.id, addr, length);
    *id_p = tmp.id;
    return SPC_OK;
}

spc_status_t sp_region_remove(sp_client_t *c, uint32_t id, char *err, size_t errlen)
{
    for (uint32_t i = 0; i < c->nregions; i++) {
        if (c->regions[i].id == id) {
            c->registered_bytes -= c->regions[i].length;
            c->regions[i] = c->regions[--c->nregions];
            return SPC_OK;
        }
    }
    snprintf(err, errlen, "region %u is not registered by this client", id);
    return SPC_ERR_BAD_REGION;
}
