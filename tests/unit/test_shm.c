/*
 * The shared-memory layout and the ring protocol (proto/sp_shm.h, sp_futex.h).
 *
 * Two threads play client and daemon over a real memfd mapping, with the very
 * helpers and the sleep/wake handshake both sides use. The consumer sleeps with a
 * long futex timeout: a lost wake-up would show as a wait that timed out, and the
 * test counts those (there must be none).
 */
#include <errno.h>
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include "sp_futex.h"
#include "sp_shm.h"
#include "sp_test.h"

static void test_layout(void)
{
    /* Every layout spd serves: today's, and the previous one's smaller argument slots. */
    for (uint32_t version = SP_SEG_VERSION_MIN; version <= SP_SEG_VERSION; version++)
    for (uint32_t sq = SP_SQ_MIN_ENTRIES; sq <= SP_SQ_MAX_ENTRIES; sq *= 2) {
        struct sp_seg_hdr h;
        sp_seg_layout(&h, version, sq, (1u << 20) + 1);
        CHECK_EQ(h.version, version);
        CHECK_EQ(sp_seg_slot_bytes(version), version == 4 ? 1024u : 2048u);
        CHECK_EQ(sp_seg_slot_tensors(version), version == 4 ? 8u : 16u);
        CHECK_EQ(h.cq_entries, 2 * sq);
        CHECK_EQ(h.arena_bytes, (1u << 20) + SP_PAGE);   /* rounded up to pages */
        uint64_t parts[][2] = {
            { 0, SP_PAGE },
            { h.wake_off, sizeof(struct sp_wake) },
            { h.sem_off, SP_STREAMS_MAX * sizeof(struct sp_stream_sem) },
            { h.sq_off, sizeof(struct sp_ring) },
            { h.sqe_off, sq * sizeof(struct sp_sqe) },
            { h.sq_args_off, (uint64_t)sq * sp_seg_slot_bytes(version) },
            { h.cq_off, sizeof(struct sp_ring) },
            { h.cqe_off, h.cq_entries * sizeof(struct sp_cqe) },
            { h.cq_detail_off, (uint64_t)h.cq_entries * SP_DETAIL_BYTES },
            { h.arena_off, h.arena_bytes },
        };
        size_t n = sizeof parts / sizeof parts[0];
        for (size_t i = 0; i < n; i++) {
            CHECK(parts[i][0] % SP_CACHELINE == 0);
            CHECK(parts[i][0] + parts[i][1] <= h.segment_bytes);
            for (size_t k = i + 1; k < n; k++)
                CHECK(parts[i][0] + parts[i][1] <= parts[k][0] || parts[k][0] + parts[k][1] <= parts[i][0]);
        }
        CHECK(h.arena_off % SP_PAGE == 0);
        CHECK(h.sem_off % SP_PAGE == 0);   /* both sides register exactly this page with CUDA */
        CHECK_EQ(h.segment_bytes, h.arena_off + h.arena_bytes);
    }
}

static void test_counters_wrap(void)
{
    struct sp_ring r;
    atomic_store(&r.head, UINT32_MAX - 2);
    atomic_store(&r.tail, 3);               /* tail wrapped past zero */
    CHECK_EQ(sp_ring_ready(&r, UINT32_MAX - 2), 6);
    CHECK_EQ(sp_ring_used(&r, 3), 6);
}

enum { ITEMS = 200000, ENTRIES = 16 };

struct chan {
    struct sp_ring ring;
    uint64_t slots[ENTRIES];
    alignas(64) _Atomic uint32_t need_wakeup;
    alignas(64) _Atomic uint32_t futex;
    long timed_out_waits;
    long sleeps;
};

static void *consumer(void *arg)
{
    struct chan *c = arg;
    uint32_t head = 0;
    uint64_t expect = 0;
    while (expect < ITEMS) {
        uint32_t ready = sp_ring_ready(&c->ring, head);
        if (ready > 0) {
            for (uint32_t i = 0; i < ready; i++) {
                uint64_t v = c->slots[(head + i) % ENTRIES];
                if (v != expect)
                    SP_FAIL("consumer read %llu, expected %llu", (unsigned long long)v, (unsigned long long)expect);
                expect++;
            }
            head += ready;
            sp_store_release(&c->ring.head, head);
            continue;
        }
        /* The daemon's sleep: flag, barrier, re-check, wait. */
        uint32_t seen = sp_load_acquire(&c->futex);
        sp_store_relaxed(&c->need_wakeup, 1);
        sp_smp_mb();
        if (sp_ring_ready(&c->ring, head) == 0) {
            c->sleeps++;
            if (sp_futex_wait(&c->futex, seen, 2000000000LL) == -ETIMEDOUT)
                c->timed_out_waits++;
        }
        sp_store_relaxed(&c->need_wakeup, 0);
    }
    return NULL;
}

static void test_spsc(void)
{
    struct chan *c = mmap(NULL, sizeof *c, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    CHECK(c != MAP_FAILED);
    pthread_t t;
    pthread_create(&t, NULL, consumer, c);
    uint32_t tail = 0;
    for (uint64_t v = 0; v < ITEMS; v++) {
        while (sp_ring_used(&c->ring, tail) == ENTRIES)
            sp_cpu_relax();
        c->slots[tail % ENTRIES] = v;
        tail++;
        /* The client's submit: publish, barrier, wake only if asked. */
        sp_store_release(&c->ring.tail, tail);
        sp_smp_mb();
        if (sp_load_relaxed(&c->need_wakeup))
            sp_futex_bump_wake(&c->futex);
        if (v % 1000 == 0)
            usleep(50);   /* let the consumer fall asleep now and then */
    }
    pthread_join(t, NULL);
    printf("spsc: %d items, consumer slept %ld times, %ld waits timed out\n", ITEMS, c->sleeps, c->timed_out_waits);
    CHECK(c->sleeps > 0);                 /* the sleep path was exercised */
    CHECK_EQ(c->timed_out_waits, 0);      /* and no wake-up was lost */
    munmap(c, sizeof *c);
}

int main(void)
{
    test_layout();
    test_counters_wrap();
    test_spsc();
    printf("shm: ok\n");
    return 0;
}
