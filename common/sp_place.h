/*
 * sp_place.h — placement: which job ranks form the Ulysses, ring, sp and dp
 * groups of a mesh, chosen from where the ranks run; and the communication
 * model that says how many bytes each kind of link carries per training step.
 * A pure function of its inputs: the daemon builds a mesh's groups with it
 * (daemon/core/mesh.c) and `spctl plan` answers for clusters no test machine has.
 *
 * The mesh: world = dp x sp, sp = ring x ulysses. A mesh has `world` slots;
 * slot  dp_rank * sp + ring_rank * ulysses + ulysses_rank  holds one job rank.
 * Placement decides which rank goes in which slot:
 *
 *   1. Ranks are sorted by where they run: node, then, for a rank whose GPU
 *      is known, its GPU's place in the node's link order, else its NUMA
 *      node; then job rank. The link order groups the node's GPUs by the links
 *      between them (sp_topo_gpu_link: p2p lines, else what islands and NUMA
 *      nodes imply), coarsest first: across sockets, one host bridge, PCIe
 *      bridges, one PCIe switch, NVLink, then by index. Slot i takes the i-th
 *      rank. So a Ulysses group (consecutive slots) sits inside a node and,
 *      where it fits, on GPUs joined by the best links there are: all NVLink
 *      before one PCIe switch before one root before across sockets. The
 *      ring of each Ulysses position runs across the Ulysses groups of its sp
 *      group; dp is outermost. A GPU's fast domain, for rule 2, is its group
 *      at the fastest link that joins any two GPUs of its node (NVLink
 *      islands, else PCIe switches, ...). The explanation ends with the
 *      slowest link inside each Ulysses group where the topology states
 *      them (p2p lines, islands). Ranks numbered in any
 *      order (round-robin across nodes, say) land the same way. When nothing
 *      distinguishes the ranks (one node, locations unknown) slot i holds rank
 *      i, which is the layout spclient.h documents for one node.
 *
 *   2. Degrees left to choose (ulysses = ring = 0) come from the head counts
 *      and that placement. A candidate ulysses degree u (a divisor of sp) must
 *      hold the heads: u <= heads, and a multiple of kv_heads when it has fewer
 *      (each kv head is then replicated u / kv_heads times). It may need dummy
 *      heads (sp_ulysses.h: heads padded to whole kv groups per rank) only when
 *      they add at most SP_PLACE_MAX_DUMMY_PCT percent to the all-to-all bytes,
 *      and its all-to-all must not span nodes. Of those, the one with the
 *      fewest bytes between nodes (the communication model below) wins, then
 *      the fewest between fast domains or NUMA nodes inside nodes, then one without
 *      dummies, then the largest. Dummy heads thus win only where they keep
 *      traffic off slower links; on one node, where every candidate ties, the
 *      choice is the largest divisor of sp that divides the heads without
 *      dummies and fits the kv heads, as spclient.h promises. Ring takes the
 *      rest: ring = sp / ulysses.
 *
 * The communication model (sp_place_traffic) is Table 1 and §4.2 of
 * seeds/000 (Communication Analysis), per attention layer, forward and
 * backward, counted as bytes that leave a rank:
 *
 *   unit   = batch x ceil(seq / sp) x head_dim x dtype bytes: one head of one
 *            rank's rows (the sequence is padded to sp rows each, as spd does)
 *   Lq, Lkv = query and kv heads a rank holds after seq->head (sp_heads_plan:
 *            dummies and kv replicas included)
 *   Ulysses: to each of the ulysses - 1 other ranks of its group, a rank sends
 *            Lq units of q, o, do and dq and Lkv units of k, v, dk and dv:
 *            4 (Lq + Lkv) units per peer.
 *   Ring:    to its next ring rank, a rank sends its k and v blocks forward and
 *            dk and dv backward, ring - 1 times each; a block is the Ulysses
 *            group's rows of its kv heads, ulysses x Lkv units:
 *            4 (ring - 1) ulysses Lkv units.
 *
 * With heads = kv_heads and no dummies this is the seed's rows exactly, short
 * of the (P - 1) / P factors its O() drops: Ulysses 8 (N - 1) / N^2 bs L d for
 * N = sp = ulysses (seed: 8/N bs L d), Ring 4 (N - 1) / N bs L d (seed: 4 bs L
 * d), USP the sum of both parts with ulysses and ring (seed: (8 + 4 sp_cp)/N
 * bs L d); dummy heads scale the Ulysses part by H_pad / H (Dummy-Head-Ulysses
 * row); GQA sends kv_heads-wide k and v (replicated when fewer than ulysses).
 * The seed's Ring row counts k, v forward and dk, dv backward; a backward that
 * rotates k and v again instead of keeping them (spclient.attention does, to
 * save memory) sends half as much again on the ring. The gradient all-reduce
 * of dp is not sequence-parallel traffic and is not counted.
 *
 * A rank's bytes go to its peers; a peer on another node makes them
 * inter-node bytes, else intra-node ones.
 */
#ifndef SP_PLACE_H
#define SP_PLACE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sp_topo.h"
#include "spclient/status.h"

#define SP_PLACE_MAX_WORLD      (1u << 22)
#define SP_PLACE_MAX_DUMMY_PCT  25          /* extra all-to-all bytes dummy heads may cost */
#define SP_PLACE_EXPLAIN_BYTES  256         /* sp_mesh_t and spc_mesh_t carry this much */

typedef struct sp_place_spec {
    uint32_t sp, ulysses, ring, heads, kv_heads;   /* ulysses, ring: 0 = choose; kv_heads: 0 = heads */
} sp_place_spec_t;

/* Where one job rank runs. */
typedef struct sp_place_loc {
    uint32_t node;      /* index in the topology's nodes */
    int32_t  gpu;       /* driver index of its GPU on that node; -1: a host rank, or not known */
    int32_t  numa;      /* its NUMA node, for a host rank; -1: not known (a GPU rank: its GPU's) */
} sp_place_loc_t;

enum { SP_PLACE_DP, SP_PLACE_SP, SP_PLACE_ULYSSES, SP_PLACE_RING, SP_PLACE_KINDS };
enum { SP_LINK_INTRA, SP_LINK_INTER, SP_LINKS };   /* intra-node, inter-node */

/* One ulysses degree the choice weighed (every divisor of sp, ascending). */
typedef struct sp_place_cand {
    uint32_t    ulysses, ring;
    uint32_t    q_heads, kv_heads;     /* heads the all-to-all moves: ulysses x Lq, ulysses x Lkv */
    uint32_t    dummies;               /* dummy heads (query and kv) over a Ulysses group */
    uint32_t    dummy_pct;             /* all-to-all bytes they add, percent (rounded down) */
    uint32_t    spanning;              /* Ulysses groups over more than one node */
    uint64_t    inter_node;            /* units sent between nodes */
    uint64_t    inter_domain;          /* units sent between islands or NUMA nodes of one node */
    const char *refused;               /* NULL: eligible; else why not */
} sp_place_cand_t;

typedef struct sp_place {
    uint32_t  world, dp, sp, ulysses, ring, heads, kv_heads;
    uint32_t  q_local, kv_local;       /* Lq, Lkv: heads a rank holds after seq->head */
    uint32_t  q_dummies, kv_dummies;   /* dummy heads over the Ulysses group */
    bool      chosen;                  /* ulysses was chosen here (ulysses = ring = 0 asked) */
    uint32_t *order;                   /* [world]: the job rank in each slot */
    uint32_t *slot;                    /* [world]: the slot of each job rank */
    uint32_t *node;                    /* [world]: the node (topology index) of each slot */
    int32_t  *domain;                  /* [world]: its island or NUMA domain in the node; -1: unknown */
    uint32_t  ulysses_spanning;        /* Ulysses groups over more than one node */
    uint32_t  ring_hops, ring_hops_inter;  /* rank -> next ring rank links, and those between nodes */
    sp_place_cand_t *cand;             /* [ncand] when chosen, else NULL */
    uint32_t  ncand;
    char      explain[SP_PLACE_EXPLAIN_BYTES];
} sp_place_t;

/*
 * Places a job: `world` ranks, rank r running at locs[r] in topo, on the mesh
 * `spec`. On success *place_p is a new placement (free with sp_place_free) with
 * every degree set, the slots filled and `explain` saying the degrees and why
 * ("dp 1 x sp 16 (ulysses 8 x ring 2); ulysses 8: ..."). Returns SPC_OK,
 * SPC_ERR_INVALID_ARG with the reason in err (an invalid spec: sp does not
 * divide the world, ulysses x ring is not sp, kv_heads does not divide heads,
 * ...; or a loc naming no node or GPU of topo), SPC_ERR_LIMIT or
 * SPC_ERR_NO_MEMORY.
 */
spc_status_t sp_place_compute(const sp_topo_t *topo, const sp_place_loc_t *locs, uint32_t world,
                              const sp_place_spec_t *spec, sp_place_t **place_p, char *err, size_t errlen);
void sp_place_free(sp_place_t *p);

/* Groups of a kind: dp groups are indexed by sp_rank, sp groups by dp_rank,
 * Ulysses groups by dp_rank * ring + ring_rank, rings by dp_rank * ulysses +
 * ulysses_rank. */
uint32_t sp_place_ngroups(const sp_place_t *p, int kind);
/* Writes group `index`'s job ranks in group-rank order to ranks[]; returns its size. */
uint32_t sp_place_group(const sp_place_t *p, int kind, uint32_t index, uint32_t *ranks);
/* A job rank's coordinates: coords[kind] is its rank in its group of that kind,
 * and index[kind] (optional) that group's index. */
void sp_place_coords(const sp_place_t *p, uint32_t rank, uint32_t coords[SP_PLACE_KINDS],
                     uint32_t index[SP_PLACE_KINDS]);

/* ---------------------------------------------------------------- the communication model */

typedef struct sp_place_dims {
    uint64_t batch, seq, hidden, layers;
    uint32_t dtype_bytes;
} sp_place_dims_t;

typedef struct sp_place_traffic {
    uint64_t unit_bytes;                   /* batch x ceil(seq / sp) x head_dim x dtype x layers */
    uint64_t ulysses[SP_LINKS];            /* bytes per training step over the whole job */
    uint64_t ring[SP_LINKS];
    uint64_t total[SP_LINKS];
    uint64_t rank_max[SP_LINKS];           /* the busiest rank's bytes */
} sp_place_traffic_t;

/* The bytes the placed mesh sends per training step (forward and backward of
 * `layers` attention layers). hidden must be a multiple of heads. dims NULL:
 * the counts in units (unit_bytes = 1). Returns SPC_OK, or SPC_ERR_INVALID_ARG
 * (a zero or indivisible dimension, or a total past 2^64 bytes) with the reason. */
spc_status_t sp_place_traffic(const sp_place_t *p, const sp_place_dims_t *dims, sp_place_traffic_t *out, char *err,
                              size_t errlen);

#endif /* SP_PLACE_H */
