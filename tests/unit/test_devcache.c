/*
 * The decisions of libspclient's device registration cache (client/src/
 * devcache.c), over a fake driver and a fake spd: devcache.c is compiled into
 * this test, and the driver's answers (what memory a pointer lies in, which
 * chunk is mapped where) and spc_register_device / spc_deregister are played
 * below, so what only a GPU makes (cudaMalloc memory) and what would take a
 * thousand chunks is checked on every machine. test_device_cover_stub runs the
 * cache through libspclient and a real spd over the stand-in driver.
 *
 *   allocation   one registration per cudaMalloc allocation, whatever views
 *                of it ops name;
 *   reuse        an allocation freed and made again at its address (another
 *                buffer id) is registered afresh, the old one dropped;
 *   overlap      a bigger allocation over a freed one's range: the stale
 *                registration goes first, so spd never sees two overlap;
 *   spd dropped  spd already dropped the old region (BAD_REGION): no error;
 *   lru          the cache bounded, the entry every op names kept;
 *   refusals     memory that is not device memory, a span past its allocation;
 *   too long     cuMem: a span over the edge of a 600-chunk registration
 *                reaching 1100 chunks gets its own run; within one op, LIMIT.
 */
#include <stdarg.h>

#include "internal.h"
#include "sp_test.h"

/* ================================================================ the fake driver */

typedef struct fake_alloc {
    uint64_t base, size, id;
    bool     live;
} fake_alloc_t;

static fake_alloc_t allocs[64];
static uint32_t nallocs;
static uint64_t next_id = 1;

/* One cuMem reservation of VN chunks of VC bytes at VBASE; ids[i] is the
 * buffer id of the mapping of chunk i, 0 where nothing is mapped. */
#define VBASE 0x10000000ull
#define VC    0x1000ull
#define VN    1100u
static uint64_t vids[VN];

static void fake_malloc(uint64_t base, uint64_t size)
{
    CHECK(nallocs < 64);
    allocs[nallocs++] = (fake_alloc_t){ .base = base, .size = size, .id = next_id++, .live = true };
}

static void fake_free(uint64_t base)
{
    for (uint32_t i = 0; i < nallocs; i++)
        if (allocs[i].live && allocs[i].base == base)
            allocs[i].live = false;
}

static void fake_vmm_map_all(void)
{
    for (uint32_t i = 0; i < VN; i++)
        vids[i] = next_id++;
}

spc_status_t spc__cuda_load(spc_handle_t *h)
{
    return SPC_OK;
}

bool spc__cuda_where(uint64_t p, spc__cuda_where_t *w_p)
{
    for (uint32_t i = 0; i < nallocs; i++) {
        const fake_alloc_t *a = &allocs[i];
        if (a->live && a->base <= p && p < a->base + a->size) {
            *w_p = (spc__cuda_where_t){ .base = a->base, .size = a->size, .buffer_id = a->id };
            return true;
        }
    }
    if (p < VBASE || p >= VBASE + VN * VC)
        return false;
    *w_p = (spc__cuda_where_t){ .base = VBASE, .size = VN * VC, .buffer_id = vids[(p - VBASE) / VC], .vmm = true };
    return true;
}

bool spc__cuda_chunk_ids(uint64_t at, uint64_t *buffer_id_p, uint64_t *block_id_p)
{
    if (at < VBASE || at >= VBASE + VN * VC || vids[(at - VBASE) / VC] == 0)
        return false;
    *buffer_id_p = vids[(at - VBASE) / VC];
    *block_id_p = 7;
    return true;
}

spc_status_t spc__cuda_chunk_at(spc_handle_t *h, int device, uint64_t at, spc__cuda_chunk_t *c_p)
{
    uint64_t id, block;
    if (!spc__cuda_chunk_ids(at, &id, &block))
        return spc__fail(h, SPC_ERR_OUT_OF_BOUNDS, "nothing mapped at 0x%llx", (unsigned long long)at);
    uint64_t base = at - (at - VBASE) % VC;
    *c_p = (spc__cuda_chunk_t){ .base = base, .size = VC, .buffer_id = id, .block_id = block };
    return SPC_OK;
}

/* ================================================================ the fake spd */

typedef struct fake_region {
    spc_region_t id;
    uint64_t     base, size;
} fake_region_t;

static fake_region_t regions[64];
static uint32_t nregions, register_calls;
static spc_region_t next_region = 1;

spc_status_t spc_register_device(spc_handle_t *h, const void *dptr, size_t bytes, spc_region_t *region_p)
{
    uint64_t base = (uintptr_t)dptr;
    register_calls++;
    for (uint32_t i = 0; i < nregions; i++)
        if (base < regions[i].base + regions[i].size && regions[i].base < base + bytes)
            return spc__fail(h, SPC_ERR_INVALID_ARG, "overlaps region %u", regions[i].id);
    CHECK(nregions < 64);
    regions[nregions++] = (fake_region_t){ .id = next_region, .base = base, .size = bytes };
    *region_p = next_region++;
    return SPC_OK;
}

spc_status_t spc_deregister(spc_handle_t *h, spc_region_t region)
{
    for (uint32_t i = 0; i < nregions; i++) {
        if (regions[i].id == region) {
            regions[i] = regions[--nregions];
            return SPC_OK;
        }
    }
    return SPC_ERR_BAD_REGION;
}

/* spd's regions as "base+size" by address: "0x10000+0x2000 0x40000+0x1000". */
static const char *registered(void)
{
    static char out[1024];
    fake_region_t sorted[64];
    memcpy(sorted, regions, nregions * sizeof sorted[0]);
    for (uint32_t i = 1; i < nregions; i++)
        for (uint32_t j = i; j > 0 && sorted[j - 1].base > sorted[j].base; j--) {
            fake_region_t t = sorted[j];
            sorted[j] = sorted[j - 1];
            sorted[j - 1] = t;
        }
    size_t len = 0;
    out[0] = '\0';
    for (uint32_t i = 0; i < nregions; i++)
        len += (size_t)snprintf(out + len, sizeof out - len, "%s0x%llx+0x%llx", i ? " " : "",
                                (unsigned long long)sorted[i].base, (unsigned long long)sorted[i].size);
    return out;
}

/* ================================================================ the rest of libspclient */

spc_status_t spc__fail(spc_handle_t *h, spc_status_t st, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(h->last_error, sizeof h->last_error, fmt, ap);
    va_end(ap);
    return st;
}

/* No request is ever in flight here (the handle has none). */
void spc__reap(spc_handle_t *h)
{
}

void spc__wait_while(spc_request_t *req, uint8_t state, int wait_ms)
{
    SP_FAIL("no request is in flight in this test");
}

spc_status_t spc__struct_put(spc_handle_t *h, const char *type, void *dst, size_t first_size, size_t size,
                             size_t align, const void *src)
{
    CHECK_EQ(*(size_t *)dst, size);
    memcpy((char *)dst + sizeof(size_t), (const char *)src + sizeof(size_t), size - sizeof(size_t));
    return SPC_OK;
}

/* ================================================================ the tests */

static spc_handle_t *fresh(void)
{
    static spc_handle_t h;
    spc__devcache_free(h.devcache);
    memset(&h, 0, sizeof h);
    memset(allocs, 0, sizeof allocs);
    memset(vids, 0, sizeof vids);
    nallocs = nregions = register_calls = 0;
    return &h;
}

static spc_status_t cover2(spc_handle_t *h, uint64_t p0, uint64_t n0, uint64_t p1, uint64_t n1)
{
    spc_device_span_t s[2] = { { (const void *)(uintptr_t)p0, n0 }, { (const void *)(uintptr_t)p1, n1 } };
    return spc_device_cover(h, s, n1 ? 2 : 1, NULL);
}

static spc_device_cache_info_t info(spc_handle_t *h)
{
    spc_device_cache_info_t i = SPC_DEVICE_CACHE_INFO_INIT;
    CHECK_OK(h, spc_device_cache_info(h, &i));
    return i;
}

static void test_allocation(void)
{
    spc_handle_t *h = fresh();
    fake_malloc(0x10000, 0x2000);
    CHECK_OK(h, cover2(h, 0x10000, 0x100, 0x10080, 0x100));   /* overlapping views */
    CHECK_OK(h, cover2(h, 0x11000, 0x1000, 0, 0));
    CHECK_STREQ(registered(), "0x10000+0x2000");
    CHECK_EQ(info(h).registrations, 1);
    printf("allocation: one registration\n");
}

static void test_reuse(void)
{
    spc_handle_t *h = fresh();
    fake_malloc(0x10000, 0x2000);
    CHECK_OK(h, cover2(h, 0x10000, 0x100, 0, 0));
    fake_free(0x10000);
    fake_malloc(0x10000, 0x2000);                             /* same address, new buffer id */
    CHECK_OK(h, cover2(h, 0x10000, 0x100, 0, 0));
    CHECK_STREQ(registered(), "0x10000+0x2000");
    CHECK_EQ(info(h).registrations, 2);
    CHECK_EQ(info(h).dropped, 1);
    printf("reuse: registered afresh\n");
}

static void test_overlap(void)
{
    spc_handle_t *h = fresh();
    fake_malloc(0x10000, 0x1000);
    fake_malloc(0x40000, 0x1000);
    CHECK_OK(h, cover2(h, 0x10000, 0x10, 0x40000, 0x10));
    fake_free(0x10000);
    fake_malloc(0x8000, 0x4000);                              /* covers the old 0x10000 */
    CHECK_OK(h, cover2(h, 0x8000, 0x10, 0, 0));
    CHECK_STREQ(registered(), "0x8000+0x4000 0x40000+0x1000");
    CHECK_EQ(info(h).dropped, 1);
    printf("overlap: the stale registration goes first\n");
}

static void test_spd_dropped(void)
{
    spc_handle_t *h = fresh();
    fake_malloc(0x10000, 0x1000);
    CHECK_OK(h, cover2(h, 0x10000, 0x10, 0, 0));
    nregions = 0;                                             /* spd dropped it by itself */
    fake_free(0x10000);
    fake_malloc(0x10000, 0x1000);
    CHECK_OK(h, cover2(h, 0x10000, 0x10, 0, 0));
    CHECK_STREQ(registered(), "0x10000+0x1000");
    printf("spd dropped: BAD_REGION on the way is no error\n");
}

static void test_lru(void)
{
    spc_handle_t *h = fresh();
    CHECK_OK(h, spc_device_cache_limit(h, 4));
    for (uint64_t i = 0; i < 10; i++)
        fake_malloc(0x100000 * (i + 1), 0x1000);
    for (uint64_t i = 0; i < 10; i++) {                       /* the first stays hot */
        CHECK_OK(h, cover2(h, 0x100000 * (i + 1), 0x10, 0x100000, 0x10));
        CHECK(info(h).regions <= 4);
    }
    CHECK_CONTAINS(registered(), "0x100000+0x1000");
    CHECK_EQ(nregions, info(h).regions);
    CHECK_EQ(info(h).registrations, 10);
    spc_device_entry_t e[8];
    CHECK_EQ(spc_device_cache_entries(h, e, 8), nregions);
    CHECK_EQ(e[0].base, 0x100000);                            /* by address */
    CHECK_EQ(e[0].chunks, 0);
    printf("lru: bounded, the hot one kept\n");
}

static void test_refusals(void)
{
    spc_handle_t *h = fresh();
    fake_malloc(0x10000, 0x1000);
    CHECK_ST(h, cover2(h, 0x90000, 0x10, 0, 0), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(h->last_error, "not in device memory");
    CHECK_ST(h, cover2(h, 0x10800, 0x1000, 0, 0), SPC_ERR_OUT_OF_BOUNDS);
    CHECK_CONTAINS(h->last_error, "runs past its allocation");
    CHECK_EQ(register_calls, 0);
    printf("refusals: %s\n", h->last_error);
}

static void test_too_long(void)
{
    spc_handle_t *h = fresh();
    fake_vmm_map_all();
    CHECK_OK(h, cover2(h, VBASE, 600 * VC, 0, 0));
    CHECK_STREQ(registered(), "0x10000000+0x258000");
    /* Over the edge, reaching chunk 1099: both in one would take 1100 chunks. */
    CHECK_OK(h, cover2(h, VBASE + 599 * VC, 501 * VC, 0, 0));
    CHECK_STREQ(registered(), "0x10257000+0x1f5000");
    CHECK_EQ(info(h).merged, 1);
    CHECK_OK(h, cover2(h, VBASE, 599 * VC, 0, 0));
    CHECK_STREQ(registered(), "0x10000000+0x257000 0x10257000+0x1f5000");
    CHECK_ST(h, cover2(h, VBASE + 100, 16, VBASE + 598 * VC, VC + 16), SPC_ERR_LIMIT);
    CHECK_CONTAINS(h->last_error, "more than the 1024 one registration takes");
    CHECK_STREQ(registered(), "0x10000000+0x257000 0x10257000+0x1f5000");
    spc__devcache_free(h->devcache);
    h->devcache = NULL;
    printf("too long: the span's own run; within one op, LIMIT\n");
}

int main(void)
{
    test_allocation();
    test_reuse();
    test_overlap();
    test_spd_dropped();
    test_lru();
    test_refusals();
    test_too_long();
    printf("devcache: ok\n");
    return 0;
}
