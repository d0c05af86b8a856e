/*
 * devcache.c — the handle's cache of device registrations (spc_device_cover).
 *
 * Contract: after spc_device_cover(spans) every span lies whole in one live
 * device registration of the handle; registrations never overlap; a
 * registration is dropped when its memory is gone (checked by buffer id and
 * memory block id), replaced by a longer one when a cuMem span crosses its
 * edge, or evicted past the limit, and the last two happen only once no
 * request in flight names it. docs/architecture.md ("Device memory") tells
 * the rules and why.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define DEVCACHE_DEFAULT_LIMIT 256

/* A registration: [base, base + size) as `region`. */
typedef struct dc_entry {
    uint64_t           base, size;
    uint64_t           buffer_id;   /* a cudaMalloc allocation's */
    spc_region_t       region;
    int                device;      /* this process's ordinal */
    uint64_t           last_used;   /* the cache's clock when an op last named it */
    spc__cuda_chunk_t *chunks;      /* cuMem memory: nchunks, in address order; NULL for cudaMalloc */
    uint32_t           nchunks;
} dc_entry_t;

struct spc__devcache {
    dc_entry_t *e;                  /* unordered; bases are unique as registrations never overlap */
    uint32_t    n, cap;
    uint32_t    limit;
    uint64_t    clock;
    uint64_t    registrations, dropped, merged;
};

static uint64_t entry_end(const dc_entry_t *e)
{
    return e->base + e->size;
}

static spc__devcache_t *cache_get(spc_handle_t *h)
{
    if (h->devcache == NULL) {
        h->devcache = calloc(1, sizeof *h->devcache);
        if (h->devcache != NULL)
            h->devcache->limit = DEVCACHE_DEFAULT_LIMIT;
    }
    return h->devcache;
}

void spc__devcache_free(spc__devcache_t *c)
{
    if (c == NULL)
        return;
    for (uint32_t i = 0; i < c->n; i++)
        free(c->e[i].chunks);
    free(c->e);
    free(c);
}

static dc_entry_t *find_base(spc__devcache_t *c, uint64_t base)
{
    for (uint32_t i = 0; i < c->n; i++)
        if (c->e[i].base == base)
            return &c->e[i];
    return NULL;
}

/* The registration that holds [lo, hi) whole, or NULL. */
static dc_entry_t *find_containing(spc__devcache_t *c, uint64_t lo, uint64_t hi)
{
    for (uint32_t i = 0; i < c->n; i++)
        if (c->e[i].base <= lo && hi <= entry_end(&c->e[i]))
            return &c->e[i];
    return NULL;
}

/* Takes entry e out of the cache (the caller deregisters it). */
static void entry_remove(spc__devcache_t *c, dc_entry_t *e)
{
    free(e->chunks);
    *e = c->e[--c->n];
}

void spc__devcache_forget(spc_handle_t *h, spc_region_t region)
{
    spc__devcache_t *c = h->devcache;
    for (uint32_t i = 0; c != NULL && i < c->n; i++) {
        if (c->e[i].region == region) {
            entry_remove(c, &c->e[i]);
            return;
        }
    }
}

/* ================================================================ what ops name */

/* A request in flight (held or released) that names `region`, or NULL. */
static spc_request_t *named_in_flight(spc_handle_t *h, spc_region_t region)
{
    for (uint32_t i = 0; h->reqs != NULL && i < h->layout.cq_entries; i++) {
        spc_request_t *r = &h->reqs[i];
        if (r->state != REQ_INFLIGHT && r->state != REQ_ORPHAN)
            continue;
        for (uint32_t k = 0; k < r->nregions; k++)
            if (r->regions[k] == region)
                return r;
    }
    return NULL;
}

/* Returns once no request in flight names `region`. Such a request was
 * submitted before the op now being covered, so on ranks that submit in one
 * order it completes without it (or fails at its match deadline); a request
 * its caller holds keeps its outcome for spc_wait. A stream op completes when
 * spd ran it, which needs nothing of this thread. */
static void wait_unnamed(spc_handle_t *h, spc_region_t region)
{
    spc_request_t *r;
    while ((r = named_in_flight(h, region)) != NULL)
        spc__wait_while(r, r->state, -1);
}

/* ================================================================ registering and dropping */

/* Drops e: out of the cache, then deregistered. spd drops by itself the
 * regions of memory it saw made again at the same address, so BAD_REGION is
 * no error here. */
static spc_status_t entry_drop(spc_handle_t *h, spc__devcache_t *c, dc_entry_t *e)
{
    spc_region_t region = e->region;
    entry_remove(c, e);
    spc_status_t st = spc_deregister(h, region);
    return st == SPC_ERR_BAD_REGION ? SPC_OK : st;
}

/* Registers [base, base + size); takes chunks (freed on failure). *e_p: the new entry. */
static spc_status_t entry_add(spc_handle_t *h, spc__devcache_t *c, uint64_t base, uint64_t size, uint64_t buffer_id,
                              int device, spc__cuda_chunk_t *chunks, uint32_t nchunks, dc_entry_t **e_p)
{
    spc_region_t region;
    if (c->n == c->cap) {
        uint32_t cap = c->cap ? 2 * c->cap : 16;
        dc_entry_t *n = realloc(c->e, cap * sizeof *n);
        if (n == NULL) {
            free(chunks);
            return spc__fail(h, SPC_ERR_NO_MEMORY, "out of memory");
        }
        c->e = n;
        c->cap = cap;
    }
    spc_status_t st = spc_register_device(h, (const void *)(uintptr_t)base, size, &region);
    if (st != SPC_OK) {
        free(chunks);
        return st;
    }
    c->registrations++;
    dc_entry_t *e = &c->e[c->n++];
    *e = (dc_entry_t){ .base = base, .size = size, .buffer_id = buffer_id, .region = region, .device = device,
                       .chunks = chunks, .nchunks = nchunks };
    *e_p = e;
    return SPC_OK;
}

/* Whether the mapping at chunk k's base is still k's: the same mapping (buffer
 * id) of the same physical allocation (memory block id). */
static bool chunk_same(const spc__cuda_chunk_t *k)
{
    uint64_t id, block;
    return spc__cuda_chunk_ids(k->base, &id, &block) && id == k->buffer_id && block == k->block_id;
}

/* Whether every chunk of e that [lo, hi) touches is still the one registered. */
static bool chunks_same(const dc_entry_t *e, uint64_t lo, uint64_t hi)
{
    uint32_t a = 0, b = e->nchunks;
    while (b - a > 1) {                      /* the last chunk starting at or before lo */
        uint32_t m = a + (b - a) / 2;
        if (e->chunks[m].base <= lo)
            a = m;
        else
            b = m;
    }
    for (uint32_t i = a; i < e->nchunks && e->chunks[i].base < hi; i++)
        if (!chunk_same(&e->chunks[i]))
            return false;
    return true;
}

/* Whether e's memory was freed or replaced: a cudaMalloc allocation gone or
 * made again, a cuMem chunk unmapped or mapped anew. */
static bool entry_gone(const dc_entry_t *e)
{
    if (e->chunks != NULL)
        return !chunks_same(e, e->base, entry_end(e));
    spc__cuda_where_t w;
    return !spc__cuda_where(e->base, &w) || w.vmm || w.base != e->base || w.size != e->size ||
           w.buffer_id != e->buffer_id;
}

/* Drops every registration whose memory is gone, so that spd keeps no freed
 * memory imported and a new registration never overlaps a stale one. */
static spc_status_t sweep(spc_handle_t *h, spc__devcache_t *c)
{
    for (uint32_t i = c->n; i-- > 0;) {
        if (entry_gone(&c->e[i])) {
            spc_status_t st = entry_drop(h, c, &c->e[i]);
            if (st != SPC_OK)
                return st;
            c->dropped++;
        }
    }
    return SPC_OK;
}

/* ================================================================ cudaMalloc memory */

static spc_status_t cover_alloc(spc_handle_t *h, spc__devcache_t *c, uint32_t i, uint64_t p, uint64_t bytes,
                                const spc__cuda_where_t *w, dc_entry_t **e_p)
{
    if (p - w->base > w->size || bytes > w->size - (p - w->base))
        return spc__fail(h, SPC_ERR_OUT_OF_BOUNDS, "span %u at 0x%llx of %llu bytes runs past its allocation "
                         "(0x%llx + %llu bytes)", i, (unsigned long long)p, (unsigned long long)bytes,
                         (unsigned long long)w->base, (unsigned long long)w->size);
    dc_entry_t *e = find_base(c, w->base);
    if (e != NULL && e->chunks == NULL && e->size == w->size && e->buffer_id == w->buffer_id) {
        *e_p = e;
        return SPC_OK;
    }
    spc_status_t st = sweep(h, c);
    if (st != SPC_OK)
        return st;
    return entry_add(h, c, w->base, w->size, w->buffer_id, w->device, NULL, 0, e_p);
}

/* ================================================================ cuMem memory */

/* The chunks mapped back to back over [lo, hi), in address order, into *run_p
 * (the caller frees it). Span i at p of `bytes` names the tensor in messages. */
static spc_status_t walk(spc_handle_t *h, int device, uint32_t i, uint64_t p, uint64_t bytes, uint64_t lo, uint64_t hi,
                         spc__cuda_chunk_t **run_p, uint32_t *n_p)
{
    spc__cuda_chunk_t *run = NULL;
    uint32_t n = 0, cap = 0;
    for (uint64_t at = lo; at < hi;) {
        if (n == cap) {
            cap = cap ? 2 * cap : 8;
            spc__cuda_chunk_t *r = realloc(run, cap * sizeof *r);
            if (r == NULL) {
                free(run);
                return spc__fail(h, SPC_ERR_NO_MEMORY, "out of memory");
            }
            run = r;
        }
        spc_status_t st = spc__cuda_chunk_at(h, device, at, &run[n]);
        if (st != SPC_OK) {
            free(run);
            if (st == SPC_ERR_OUT_OF_BOUNDS)
                spc__fail(h, st, "span %u at 0x%llx of %llu bytes lies in cuMem address space with nothing mapped at "
                          "0x%llx: spd can reach only mapped memory", i, (unsigned long long)p,
                          (unsigned long long)bytes, (unsigned long long)at);
            return st;
        }
        at = run[n].base + run[n].size;
        n++;
    }
    *run_p = run;
    *n_p = n;
    return SPC_OK;
}

/* Removes base from the op's set of used bases. */
static void used_discard(uint64_t *used, uint32_t *nused, uint64_t base)
{
    for (uint32_t k = 0; k < *nused; k++)
        if (used[k] == base)
            used[k] = used[--*nused];
}

static bool used_has(const uint64_t *used, uint32_t nused, uint64_t base)
{
    for (uint32_t k = 0; k < nused; k++)
        if (used[k] == base)
            return true;
    return false;
}

/*
 * The cuMem registration that holds span i, [p, p + bytes), made if need be:
 *   - a registration that holds it whole, every chunk under the span still
 *     the one registered (else it is dropped);
 *   - else the run of chunks under the span, after a sweep; where the run
 *     overlaps registrations (a tensor across the edge of one), one run over
 *     all of them replaces them (mapped back to back, as all are sound after
 *     the sweep), unless that passes the chunks one registration takes: then
 *     the span's own run replaces them, or, where another span of the op lies
 *     in one of them (`used`), the op is refused. The replaced ones go once no
 *     request in flight names them, and leave `used`.
 */
static spc_status_t cover_vmm(spc_handle_t *h, spc__devcache_t *c, uint32_t i, uint64_t p, uint64_t bytes,
                              const spc__cuda_where_t *w, uint64_t *used, uint32_t *nused, dc_entry_t **e_p)
{
    const uint64_t end = p + bytes;
    spc_status_t st;
    dc_entry_t *e = find_containing(c, p, end);
    if (e != NULL && e->chunks != NULL) {
        if (chunks_same(e, p, end)) {
            *e_p = e;
            return SPC_OK;
        }
        if ((st = entry_drop(h, c, e)) != SPC_OK)    /* a chunk under the span was unmapped or mapped anew */
            return st;
        c->dropped++;
    }
    if ((st = sweep(h, c)) != SPC_OK)
        return st;
    spc__cuda_chunk_t *run;
    uint32_t n;
    if ((st = walk(h, w->device, i, p, bytes, p, end, &run, &n)) != SPC_OK)
        return st;
    uint64_t lo = run[0].base, hi = run[n - 1].base + run[n - 1].size;

    /* The registrations the run overlaps, and the extent of all together. */
    uint64_t mlo = lo, mhi = hi;
    bool over_used = false, over = false;
    for (uint32_t k = 0; k < c->n; k++) {
        const dc_entry_t *o = &c->e[k];
        if (o->chunks == NULL || o->base >= hi || entry_end(o) <= lo)
            continue;
        over = true;
        over_used |= used_has(used, *nused, o->base);
        mlo = o->base < mlo ? o->base : mlo;
        mhi = entry_end(o) > mhi ? entry_end(o) : mhi;
    }
    if (over) {
        spc__cuda_chunk_t *merged;
        uint32_t nmerged;
        if ((st = walk(h, w->device, i, p, bytes, mlo, mhi, &merged, &nmerged)) != SPC_OK) {
            free(run);
            return st;
        }
        if (nmerged > SP_DEVICE_MAX_CHUNKS) {
            free(merged);
            if (over_used) {
                free(run);
                return spc__fail(h, SPC_ERR_LIMIT, "span %u at 0x%llx of %llu bytes overlaps the cuMem registration "
                                 "of another span of the op, and one over both would span %u chunks, more than the %u "
                                 "one registration takes", i, (unsigned long long)p, (unsigned long long)bytes,
                                 nmerged, SP_DEVICE_MAX_CHUNKS);
            }
        } else {
            free(run);
            run = merged;
            n = nmerged;
        }
        for (uint32_t k = c->n; k-- > 0;) {
            dc_entry_t *o = &c->e[k];
            if (o->chunks == NULL || o->base >= hi || entry_end(o) <= lo)
                continue;
            uint64_t base = o->base;
            wait_unnamed(h, o->region);
            if ((st = entry_drop(h, c, find_base(c, base))) != SPC_OK) {
                free(run);
                return st;
            }
            used_discard(used, nused, base);
            c->merged++;
            k = c->n;                        /* the waits reaped, the drop moved entries: look again */
        }
    }
    uint64_t base = run[0].base;
    return entry_add(h, c, base, run[n - 1].base + run[n - 1].size - base, 0, w->device, run, n, e_p);
}

/* ================================================================ cover */

/* One pass: covers each span, the registrations found or made marked used. */
static spc_status_t cover_pass(spc_handle_t *h, spc__devcache_t *c, const spc_device_span_t *spans, uint32_t nspans,
                               uint64_t *used, uint32_t *nused)
{
    *nused = 0;
    for (uint32_t i = 0; i < nspans; i++) {
        const uint64_t p = (uintptr_t)spans[i].ptr, bytes = spans[i].bytes;
        spc__cuda_where_t w;
        dc_entry_t *e;
        if (bytes == 0)
            continue;
        if (!spc__cuda_where(p, &w))
            return spc__fail(h, SPC_ERR_INVALID_ARG, "span %u at 0x%llx is not in device memory the driver knows "
                             "(host and managed memory go through the host path)", i, (unsigned long long)p);
        spc_status_t st = w.vmm ? cover_vmm(h, c, i, p, bytes, &w, used, nused, &e)
                                : cover_alloc(h, c, i, p, bytes, &w, &e);
        if (st != SPC_OK)
            return st;
        e->last_used = ++c->clock;
        if (!used_has(used, *nused, e->base))
            used[(*nused)++] = e->base;
    }
    return SPC_OK;
}

/* The least recently used registration that the op does not use and, when
 * `unnamed`, that no request in flight names; NULL when there is none. */
static dc_entry_t *lru_victim(spc_handle_t *h, spc__devcache_t *c, const uint64_t *used, uint32_t nused, bool unnamed)
{
    dc_entry_t *lru = NULL;
    for (uint32_t k = 0; k < c->n; k++) {
        dc_entry_t *e = &c->e[k];
        if ((lru == NULL || e->last_used < lru->last_used) && !used_has(used, nused, e->base) &&
            (!unnamed || named_in_flight(h, e->region) == NULL))
            lru = e;
    }
    return lru;
}

/* Past the limit, deregisters the least recently used quarter, none that the
 * op uses: first those no request in flight names; where they run short, the
 * others once their requests are done, so the bound holds even while a
 * stream runs ahead of spd. */
static spc_status_t evict(spc_handle_t *h, spc__devcache_t *c, const uint64_t *used, uint32_t nused)
{
    if (c->n <= c->limit)
        return SPC_OK;
    spc__reap(h);                            /* requests done but not yet reaped name nothing */
    for (uint32_t left = c->n / 4 > 0 ? c->n / 4 : 1; left > 0; left--) {
        dc_entry_t *e = lru_victim(h, c, used, nused, true);
        if (e == NULL && (e = lru_victim(h, c, used, nused, false)) != NULL) {
            uint64_t base = e->base;
            wait_unnamed(h, e->region);
            e = find_base(c, base);          /* still there unless deregistered by hand meanwhile */
        }
        if (e == NULL)
            break;
        spc_status_t st = entry_drop(h, c, e);
        if (st != SPC_OK)
            return st;
    }
    return SPC_OK;
}

/* Registrations, dropped and made, and the requests in flight looked at:
 * under the handle's lock, as the stream watcher may take the client over. */
static spc_status_t cover_locked(spc_handle_t *h, const spc_device_span_t *spans, uint32_t nspans,
                                 spc_region_t *regions_p)
{
    spc_status_t st = spc__cuda_load(h);
    if (st != SPC_OK)
        return st;
    spc__devcache_t *c = cache_get(h);
    uint64_t *used = malloc((nspans ? nspans : 1) * sizeof *used);
    if (c == NULL || used == NULL) {
        free(used);
        return spc__fail(h, SPC_ERR_NO_MEMORY, "out of memory");
    }
    uint32_t nused;
    st = cover_pass(h, c, spans, nspans, used, &nused);
    /* A cuMem registration is found sound for the chunks under a span only; a
     * later span's miss sweeps every registration whole and may drop it (a
     * chunk elsewhere in it remapped). After a sweep all are sound, so a
     * second pass finds each span covered. */
    for (uint32_t i = 0; i < nspans && st == SPC_OK; i++) {
        uint64_t p = (uintptr_t)spans[i].ptr;
        if (spans[i].bytes > 0 && find_containing(c, p, p + spans[i].bytes) == NULL) {
            st = cover_pass(h, c, spans, nspans, used, &nused);
            break;
        }
    }
    if (st == SPC_OK)
        st = evict(h, c, used, nused);
    free(used);
    if (st != SPC_OK || regions_p == NULL)
        return st;
    for (uint32_t i = 0; i < nspans; i++) {
        uint64_t p = (uintptr_t)spans[i].ptr;
        const dc_entry_t *e = spans[i].bytes > 0 ? find_containing(c, p, p + spans[i].bytes) : NULL;
        regions_p[i] = e != NULL ? e->region : SPC_REGION_ARENA;
    }
    return SPC_OK;
}

spc_status_t spc_device_cover(spc_handle_t *h, const spc_device_span_t *spans, uint32_t nspans,
                              spc_region_t *regions_p)
{
    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    if (spans == NULL && nspans > 0)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "spans is NULL");
    if (h->control_only)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "control-only handles cannot register memory");
    for (uint32_t i = 0; i < nspans; i++)
        if (spans[i].bytes > UINT64_MAX - (uintptr_t)spans[i].ptr)
            return spc__fail(h, SPC_ERR_OUT_OF_BOUNDS, "span %u wraps around the address space", i);
    spc__lock(h);
    spc_status_t st = cover_locked(h, spans, nspans, regions_p);
    spc__unlock(h);
    return st;
}

/* ================================================================ the rest of the API */

spc_status_t spc_device_cache_limit(spc_handle_t *h, uint32_t max_regions)
{
    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    if (max_regions == 0)
        return spc__fail(h, SPC_ERR_INVALID_ARG, "max_regions must be at least 1");
    spc__devcache_t *c = cache_get(h);
    if (c == NULL)
        return spc__fail(h, SPC_ERR_NO_MEMORY, "out of memory");
    c->limit = max_regions;
    return SPC_OK;
}

spc_status_t spc_device_cache_info(spc_handle_t *h, spc_device_cache_info_t *info_p)
{
    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    const spc__devcache_t *c = h->devcache;
    spc_device_cache_info_t info = SPC_DEVICE_CACHE_INFO_INIT;
    if (c != NULL) {
        info.regions = c->n;
        info.limit = c->limit;
        info.registrations = c->registrations;
        info.dropped = c->dropped;
        info.merged = c->merged;
    } else {
        info.limit = DEVCACHE_DEFAULT_LIMIT;
    }
    return spc__struct_write(h, spc_device_cache_info_t, info_p, merged, &info);
}

static int by_base(const void *a, const void *b)
{
    const spc_device_entry_t *x = a, *y = b;
    return x->base < y->base ? -1 : x->base > y->base;
}

uint32_t spc_device_cache_entries(const spc_handle_t *h, spc_device_entry_t *out, uint32_t cap)
{
    const spc__devcache_t *c = h != NULL ? h->devcache : NULL;
    if (c == NULL)
        return 0;
    spc_device_entry_t *all = malloc((c->n ? c->n : 1) * sizeof *all);
    if (all == NULL)
        return 0;
    for (uint32_t i = 0; i < c->n; i++)
        all[i] = (spc_device_entry_t){ .base = c->e[i].base, .size = c->e[i].size, .region = c->e[i].region,
                                       .chunks = c->e[i].nchunks };
    qsort(all, c->n, sizeof *all, by_base);
    if (out != NULL)
        memcpy(out, all, (cap < c->n ? cap : c->n) * sizeof *all);
    free(all);
    return c->n;
}

spc_status_t spc_device_cache_clear(spc_handle_t *h)
{
    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    spc__lock(h);
    spc__devcache_t *c = h->devcache;
    spc_status_t st = SPC_OK;
    while (c != NULL && c->n > 0 && st == SPC_OK) {
        uint64_t base = c->e[c->n - 1].base;
        wait_unnamed(h, c->e[c->n - 1].region);
        dc_entry_t *e = find_base(c, base);
        if (e != NULL)                       /* else forgotten meanwhile */
            st = entry_drop(h, c, e);
    }
    spc__unlock(h);
    return st;
}
