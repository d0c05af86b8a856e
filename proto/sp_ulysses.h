/*
 * sp_ulysses.h — how a Ulysses all-to-all deals heads and rows to ranks.
 *
 * The rule (the contract is in spclient.h, spc_alltoall_desc_t): a tensor's H
 * heads form n groups of g = H / n consecutive heads (a query tensor: n =
 * kv_heads; a key/value tensor: n = H, g = 1).
 *
 *   n >= P   groups are padded with dummy groups to a multiple of P; rank p holds
 *            padded heads [p L, (p + 1) L), L = (n_pad / P) g; those past H are dummies.
 *   n <  P   P = r n; rank p works on group p / r. A key/value head is replicated
 *            to the r ranks (L = 1); a query group's g heads are padded to a
 *            multiple of r and split: rank p holds group heads [s L, (s + 1) L),
 *            s = p mod r, L = ceil(g / r); those past g are dummies.
 *
 * Either way a rank's real heads are one run of consecutive source heads
 * followed by dummies, so every (row, rank) pair is one memcpy and one memset.
 */
#ifndef SP_ULYSSES_H
#define SP_ULYSSES_H

#include <stdbool.h>
#include <stdint.h>

#include "sp_shm.h"

typedef struct sp_heads_plan {
    uint32_t heads;       /* H */
    uint32_t groups;      /* n */
    uint32_t per_group;   /* g */
    uint32_t ranks;       /* P */
    uint32_t local;       /* L: heads each rank holds after seq->head, dummies included */
    uint32_t replicas;    /* r: ranks sharing a group (1 when n >= P) */
    bool     replicate;   /* key/value heads copied to r ranks */
} sp_heads_plan_t;

/* Fills *pl; returns false when the combination is invalid. */
static inline bool sp_heads_plan(sp_heads_plan_t *pl, uint32_t heads, uint32_t kind, uint32_t kv_heads,
                                 uint32_t ranks)
{
    uint32_t n = kind == SP_HEADS_KV ? heads : (kv_heads ? kv_heads : heads);
    if (heads == 0 || ranks == 0 || n == 0 || heads % n != 0 || kind > SP_HEADS_KV)
        return false;
    pl->heads = heads;
    pl->groups = n;
    pl->per_group = heads / n;
    pl->ranks = ranks;
    pl->replicate = false;
    if (n >= ranks) {
        pl->replicas = 1;
        pl->local = (n + ranks - 1) / ranks * pl->per_group;
        return true;
    }
    if (ranks % n != 0)
        return false;
    pl->replicas = ranks / n;
    pl->replicate = kind == SP_HEADS_KV;
    pl->local = pl->replicate ? 1 : (pl->per_group + pl->replicas - 1) / pl->replicas;
    return true;
}

/* Rank p's real heads: `count` consecutive source heads from *first (0 when the
 * rank holds only dummies); its other local - count heads are dummies. */
static inline uint32_t sp_heads_real(const sp_heads_plan_t *pl, uint32_t p, uint32_t *first)
{
    if (pl->replicas == 1) {
        uint32_t lo = p * pl->local;
        *first = lo;
        if (lo >= pl->heads)
            return 0;
        return pl->heads - lo < pl->local ? pl->heads - lo : pl->local;
    }
    uint32_t group = p / pl->replicas, slice = p % pl->replicas;
    if (pl->replicate) {
        *first = group;
        return 1;
    }
    uint32_t lo = slice * pl->local;
    *first = group * pl->per_group + lo;
    if (lo >= pl->per_group)
        return 0;
    return pl->per_group - lo < pl->local ? pl->per_group - lo : pl->local;
}

/* Whether rank p's copy of its heads is the one head->seq takes back (the first
 * replica; every rank when nothing is replicated). */
static inline bool sp_heads_primary(const sp_heads_plan_t *pl, uint32_t p)
{
    return !pl->replicate || p % pl->replicas == 0;
}

/* Rows: S_loc = ceil(S / P); rank p holds global rows [p S_loc, ...), of which
 * this many are real (the rest is padding). */
static inline uint32_t sp_rows_local(uint32_t seq_len, uint32_t ranks)
{
    return (uint32_t)(((uint64_t)seq_len + ranks - 1) / ranks);
}

static inline uint32_t sp_rows_real(uint32_t seq_len, uint32_t ranks, uint32_t p)
{
    uint64_t loc = sp_rows_local(seq_len, ranks), lo = (uint64_t)p * loc;
    if (lo >= seq_len)
        return 0;
    return (uint32_t)(seq_len - lo < loc ? seq_len - lo : loc);
}

#endif /* SP_ULYSSES_H */
