/*
 * fuzz_validate.h — the input of fuzz_validate, shared with the seed writer.
 *
 *   offset 0           u8 group size - 1 (the group has 1 to 64 ranks)
 *   offset 1           u8 flags: FV_F_WORLD, FV_F_NODES
 *   offset 2..7        ignored
 *   offset 8           op A: struct sp_sqe, then struct sp_sq_args
 *   offset 8 + 1088    op B: the same (absent: B is A)
 *
 * Short inputs are read as if zero-filled. The ops are a fake client's (rank
 * 0's op A, every other rank's op B), whose regions are fv_regions: host and
 * GPU memory, without a daemon, a segment or a GPU behind them.
 */
#ifndef SP_FUZZ_VALIDATE_H
#define SP_FUZZ_VALIDATE_H

#include <stdint.h>

#include "core/mem.h"

#define FV_HDR_BYTES   8u
#define FV_OP_BYTES    (sizeof(struct sp_sqe) + sizeof(struct sp_sq_args))
#define FV_INPUT_BYTES (FV_HDR_BYTES + 2 * FV_OP_BYTES)
#define FV_MAX_RANKS   64u

#define FV_F_WORLD     1u   /* the group is the job's world (else a group of other job ranks) */
#define FV_F_NODES     2u   /* the group's ranks alternate between two daemons (else all on this one) */

/* The client's arena (region 0). */
#define FV_ARENA_BYTES (1u << 20)

typedef struct fv_region {
    uint32_t id;
    uint8_t  kind;      /* enum sp_region_kind */
    int      gpu;       /* device: the daemon's ordinal of its GPU */
    uint64_t length;
} fv_region_t;

static const fv_region_t fv_regions[] = {
    { 1, SP_REGION_HOST, -1, 1u << 20 },
    { 2, SP_REGION_HOST, -1, UINT64_C(1) << 40 },   /* sizes near overflow stay inside it */
    { 3, SP_REGION_DEVICE, 0, 1u << 20 },
    { 4, SP_REGION_DEVICE, 0, 1u << 20 },
    { 5, SP_REGION_DEVICE, 1, 1u << 20 },
    { UINT32_MAX, SP_REGION_HOST, -1, 4096 },
};
#define FV_NREGIONS (sizeof fv_regions / sizeof fv_regions[0])

#endif /* SP_FUZZ_VALIDATE_H */
