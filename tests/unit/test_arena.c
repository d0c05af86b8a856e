/* The client's arena allocator (client/src/arena.c) against a byte map. */
#include "internal.h"
#include "sp_test.h"

#define SIZE (1u << 20)

static uint8_t owner[SIZE];   /* 0 free, else the id of the allocation holding the byte */

int main(void)
{
    spc__arena_t a;
    CHECK_EQ(spc__arena_init(&a, SIZE), 0);

    /* Whole arena, then nothing more. */
    uint64_t off = spc__arena_alloc(&a, SIZE, 64);
    CHECK_EQ(off, 0);
    CHECK_EQ(spc__arena_alloc(&a, 1, 64), UINT64_MAX);
    CHECK_EQ(spc__arena_free(&a, 0), 0);
    CHECK_EQ(spc__arena_free(&a, 0), -1);        /* double free is refused */
    CHECK_EQ(spc__arena_free(&a, 64), -1);       /* not a block start */
    CHECK_EQ(a.used, 0);
    CHECK_EQ(a.nblocks, 1);                      /* merged back into one */

    /* Which allocation a byte is in: up to what was asked, not the rounding,
     * and nothing once freed. */
    uint64_t start, asked;
    uint64_t b100 = spc__arena_alloc(&a, 100, 64), b64 = spc__arena_alloc(&a, 64, 64);
    CHECK_EQ(b64, b100 + 128);
    CHECK(spc__arena_find(&a, b100, &start, &asked));
    CHECK_EQ(start, b100);
    CHECK_EQ(asked, 100);
    CHECK(spc__arena_find(&a, b100 + 99, &start, &asked));
    CHECK(!spc__arena_find(&a, b100 + 100, &start, &asked));   /* the rounding */
    CHECK(spc__arena_find(&a, b64 + 63, &start, &asked));
    CHECK_EQ(start, b64);
    CHECK(!spc__arena_find(&a, b64 + 64, &start, &asked));     /* free space */
    CHECK_EQ(spc__arena_free(&a, b100), 0);
    CHECK(!spc__arena_find(&a, b100, &start, &asked));
    CHECK_EQ(spc__arena_free(&a, b64), 0);
    CHECK(!spc__arena_find(&a, SIZE, &start, &asked));

    /* Random allocations and frees, checked byte for byte: no overlap, alignment
     * kept, and after freeing all the arena is one block again. */
    enum { SLOTS = 64 };
    uint64_t offs[SLOTS], sizes[SLOTS];
    memset(offs, 0xff, sizeof offs);
    srand(1);
    for (int it = 0; it < 20000; it++) {
        int s = rand() % SLOTS;
        if (offs[s] != UINT64_MAX) {
            for (uint64_t i = 0; i < sizes[s]; i++)
                CHECK_EQ(owner[offs[s] + i], s + 1);
            memset(owner + offs[s], 0, sizes[s]);
            CHECK_EQ(spc__arena_free(&a, offs[s]), 0);
            offs[s] = UINT64_MAX;
            continue;
        }
        uint64_t bytes = 1 + (uint64_t)(rand() % 40000);
        uint64_t align = rand() % 2 ? 4096 : 64;
        uint64_t o = spc__arena_alloc(&a, bytes, align);
        if (o == UINT64_MAX)
            continue;
        CHECK_EQ(o % align, 0);
        CHECK(o + bytes <= SIZE);
        for (uint64_t i = 0; i < bytes; i++)
            CHECK_EQ(owner[o + i], 0);
        memset(owner + o, s + 1, bytes);
        uint64_t at = o + (uint64_t)rand() % bytes;
        CHECK(spc__arena_find(&a, at, &start, &asked));
        CHECK_EQ(start, o);
        CHECK_EQ(asked, bytes);
        offs[s] = o;
        sizes[s] = bytes;
    }
    for (int s = 0; s < SLOTS; s++)
        if (offs[s] != UINT64_MAX)
            CHECK_EQ(spc__arena_free(&a, offs[s]), 0);
    CHECK_EQ(a.used, 0);
    CHECK_EQ(a.nblocks, 1);
    CHECK_EQ(spc__arena_alloc(&a, SIZE, 64), 0);
    spc__arena_cleanup(&a);
    printf("arena: ok\n");
    return 0;
}
