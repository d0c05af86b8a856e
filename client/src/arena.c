/*
 * arena.c — first-fit allocation over the shared arena.
 *
 * Trainers allocate few, large buffers (activations, K/V blocks), so a sorted
 * array of blocks with first fit and neighbour merging is simple and fast
 * enough; each call is O(blocks).
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

int spc__arena_init(spc__arena_t *a, uint64_t size)
{
    memset(a, 0, sizeof *a);
    a->blocks = malloc(16 * sizeof *a->blocks);
    if (a->blocks == NULL)
        return -1;
    a->cap = 16;
    a->size = size;
    if (size > 0)
        a->blocks[a->nblocks++] = (spc__block_t){ .off = 0, .size = size, .used = false };
    return 0;
}

void spc__arena_cleanup(spc__arena_t *a)
{
    free(a->blocks);
    memset(a, 0, sizeof *a);
}

/* Room for `extra` more blocks, reserved before anything is changed so that an
 * allocation either happens whole or not at all. */
static int reserve(spc__arena_t *a, uint32_t extra)
{
    if (a->nblocks + extra <= a->cap)
        return 0;
    uint32_t cap = a->cap * 2;
    while (cap < a->nblocks + extra)
        cap *= 2;
    spc__block_t *p = realloc(a->blocks, cap * sizeof *p);
    if (p == NULL)
        return -1;
    a->blocks = p;
    a->cap = cap;
    return 0;
}

static void insert_at(spc__arena_t *a, uint32_t i, spc__block_t b)
{
    memmove(&a->blocks[i + 1], &a->blocks[i], (a->nblocks - i) * sizeof a->blocks[0]);
    a->blocks[i] = b;
    a->nblocks++;
}

static void remove_at(spc__arena_t *a, uint32_t i)
{
    memmove(&a->blocks[i], &a->blocks[i + 1], (a->nblocks - i - 1) * sizeof a->blocks[0]);
    a->nblocks--;
}

uint64_t spc__arena_alloc(spc__arena_t *a, uint64_t bytes, uint64_t align)
{
    if (bytes == 0)
        bytes = 1;
    if (bytes > a->size || reserve(a, 2) != 0)
        return UINT64_MAX;
    uint64_t asked = bytes;
    bytes = (bytes + 63) & ~(uint64_t)63;   /* keeps every block start 64-byte aligned */

    for (uint32_t i = 0; i < a->nblocks; i++) {
        spc__block_t b = a->blocks[i];
        if (b.used)
            continue;
        uint64_t start = (b.off + align - 1) & ~(align - 1);
        uint64_t end = b.off + b.size;
        if (start > end || end - start < bytes)
            continue;
        uint32_t at = i;
        if (start > b.off) {           /* keep the alignment gap as a free block */
            a->blocks[i].size = start - b.off;
            insert_at(a, ++at, (spc__block_t){ .off = start, .size = bytes, .asked = asked, .used = true });
        } else {
            a->blocks[i] = (spc__block_t){ .off = start, .size = bytes, .asked = asked, .used = true };
        }
        if (start + bytes < end)
            insert_at(a, at + 1, (spc__block_t){ .off = start + bytes, .size = end - start - bytes, .used = false });
        a->used += bytes;
        return start;
    }
    return UINT64_MAX;
}

/* The index of the first block that starts at or after off. */
static uint32_t lower_bound(const spc__arena_t *a, uint64_t off)
{
    uint32_t lo = 0, hi = a->nblocks;
    while (lo < hi) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (a->blocks[mid].off < off)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

int spc__arena_free(spc__arena_t *a, uint64_t off)
{
    uint32_t lo = lower_bound(a, off);
    if (lo == a->nblocks || a->blocks[lo].off != off || !a->blocks[lo].used)
        return -1;
    a->blocks[lo].used = false;
    a->used -= a->blocks[lo].size;
    if (lo + 1 < a->nblocks && !a->blocks[lo + 1].used) {
        a->blocks[lo].size += a->blocks[lo + 1].size;
        remove_at(a, lo + 1);
    }
    if (lo > 0 && !a->blocks[lo - 1].used) {
        a->blocks[lo - 1].size += a->blocks[lo].size;
        remove_at(a, lo);
    }
    return 0;
}

/* The rounding past what was asked belongs to no one: an op that needs it is
 * as wrong as one that runs into the next block, and is told so. */
bool spc__arena_find(const spc__arena_t *a, uint64_t off, uint64_t *start_p, uint64_t *asked_p)
{
    uint32_t i = lower_bound(a, off);
    if (i == a->nblocks || a->blocks[i].off != off) {
        if (i == 0)
            return false;
        i--;   /* the block that starts before off */
    }
    const spc__block_t *b = &a->blocks[i];
    if (!b->used || off - b->off >= b->asked)
        return false;
    *start_p = b->off;
    *asked_p = b->asked;
    return true;
}
