/*
 * fuzz_peer.h — the input of fuzz_peer, shared with the seed writer.
 *
 *   offset 0           u8 group size - 1 (the group has 1 to FP_MAX_RANKS ranks)
 *   offset 1           u8 the job: FP_NODES(b) daemons, and the flags
 *                      FP_F_BLOCKS, FP_F_SUBGROUP
 *   offset 2..7        ignored
 *   offset 8           the message's header (sp_wire_hdr_t), as UCX gives it
 *   then               its payload, to the end of the input
 *
 * An input shorter than a header is given whole as the header (which is then
 * refused). The daemons are named by fp_node_name: "fuzz-node-0" is the one
 * receiving, the others are its peers. Job rank r sits on daemon
 * r * nodes / world (FP_F_BLOCKS) or r % nodes. The group is the world, or
 * (FP_F_SUBGROUP) job ranks 1, 3, 5, ... of a world of 2P + 1.
 */
#ifndef SP_FUZZ_PEER_H
#define SP_FUZZ_PEER_H

#include <stdint.h>
#include <stdio.h>

#include "cluster/net_wire.h"

#define FP_HDR_BYTES   8u
#define FP_MAX_RANKS   8u
#define FP_MAX_NODES   4u

#define FP_NODES(b)    (2u + ((b) & 3u) % 3u)   /* bits 0-1: 2, 3 or 4 daemons */
#define FP_F_BLOCKS    4u    /* job ranks in blocks, one per daemon (else dealt round robin) */
#define FP_F_SUBGROUP  8u    /* every other rank of a larger world (else the world) */

static inline void fp_node_name(char *buf, size_t len, uint32_t node)
{
    snprintf(buf, len, "fuzz-node-%u", node);
}

static inline uint32_t fp_world(uint32_t P, uint8_t flags)
{
    return (flags & FP_F_SUBGROUP) ? 2 * P + 1 : P;
}

/* The daemon of job rank r. */
static inline uint32_t fp_node_of(uint32_t r, uint32_t world, uint8_t flags)
{
    uint32_t nodes = FP_NODES(flags);
    return (flags & FP_F_BLOCKS) ? r * nodes / world : r % nodes;
}

/* The job rank of group rank q. */
static inline uint32_t fp_job_rank(uint32_t q, uint8_t flags)
{
    return (flags & FP_F_SUBGROUP) ? 2 * q + 1 : q;
}

#endif /* SP_FUZZ_PEER_H */
