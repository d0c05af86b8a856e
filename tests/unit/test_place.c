/*
 * Placement (common/sp_place.c): degrees, groups and their explanation.
 *
 * Every placement here is checked for consistency: each kind of group
 * partitions the world, a rank's coordinates are its positions in its groups,
 * and an sp group is exactly its rings' ranks and exactly its Ulysses groups'
 * ranks. Cases: one node (the layout of spclient.h, unchanged, with the degrees
 * meshes have always chosen), two nodes of 8 with ranks numbered round-robin,
 * odd and prime rank counts, dummy heads, replicated kv heads, refusals, and a
 * sweep of shapes in which no chosen Ulysses group ever spans nodes.
 */
#include "sp_place.h"
#include "sp_test.h"

/* ---------------------------------------------------------------- helpers */

static sp_topo_t *topo_of(const char *text)
{
    sp_topo_t *t;
    char err[256];
    if (sp_topo_parse(text, "topo", &t, err, sizeof err) != SPC_OK)
        SP_FAIL("topology: %s", err);
    return t;
}

/* Ranks on every GPU of every node: block order (rank r on node r / G) or
 * round-robin (rank r on node r % N). */
static sp_place_loc_t *gpu_locs(const sp_topo_t *t, bool round_robin, uint32_t *world_p)
{
    uint32_t n = t->nnodes, g = t->nodes[0].ngpus, world = n * g;
    sp_place_loc_t *locs = calloc(world, sizeof *locs);
    CHECK(locs != NULL);
    for (uint32_t r = 0; r < world; r++) {
        uint32_t node = round_robin ? r % n : r / g, gpu = round_robin ? r / n : r % g;
        locs[r] = (sp_place_loc_t){ .node = node, .gpu = t->nodes[node].gpus[gpu].index, .numa = -1 };
    }
    *world_p = world;
    return locs;
}

/* Ranks on one node, nothing known about where on it: what the daemon sees. */
static sp_place_loc_t *local_locs(uint32_t world)
{
    sp_place_loc_t *locs = calloc(world, sizeof *locs);
    CHECK(locs != NULL);
    for (uint32_t r = 0; r < world; r++)
        locs[r] = (sp_place_loc_t){ .node = 0, .gpu = -1, .numa = -1 };
    return locs;
}

static sp_place_t *place_ok(const sp_topo_t *t, const sp_place_loc_t *locs, uint32_t world, sp_place_spec_t spec)
{
    sp_place_t *p = NULL;
    char err[256];
    spc_status_t st = sp_place_compute(t, locs, world, &spec, &p, err, sizeof err);
    if (st != SPC_OK)
        SP_FAIL("place %u ranks, sp %u ulysses %u ring %u heads %u kv %u: %s: %s", world, spec.sp, spec.ulysses,
                spec.ring, spec.heads, spec.kv_heads, spc_status_name(st), err);
    return p;
}

static void check_consistent(const sp_place_t *p)
{
    uint32_t world = p->world, *g = malloc(world * sizeof *g), *seen = calloc(world, sizeof *seen);
    CHECK(g != NULL && seen != NULL);
    CHECK_EQ((uint64_t)p->dp * p->sp, world);
    CHECK_EQ((uint64_t)p->ulysses * p->ring, p->sp);
    const uint32_t size[SP_PLACE_KINDS] = { p->dp, p->sp, p->ulysses, p->ring };
    for (int k = 0; k < SP_PLACE_KINDS; k++) {
        memset(seen, 0, world * sizeof *seen);
        CHECK_EQ((uint64_t)sp_place_ngroups(p, k) * size[k], world);
        for (uint32_t i = 0; i < sp_place_ngroups(p, k); i++) {
            CHECK_EQ(sp_place_group(p, k, i, g), size[k]);
            for (uint32_t m = 0; m < size[k]; m++) {
                CHECK(g[m] < world);
                seen[g[m]]++;
                /* The member's coordinates say the same. */
                uint32_t coords[SP_PLACE_KINDS], index[SP_PLACE_KINDS];
                sp_place_coords(p, g[m], coords, index);
                CHECK_EQ(coords[k], m);
                CHECK_EQ(index[k], i);
            }
        }
        for (uint32_t r = 0; r < world; r++)
            if (seen[r] != 1)
                SP_FAIL("kind %d: rank %u is in %u groups", k, r, seen[r]);
    }
    /* sp group d = its Ulysses groups' ranks = its rings' ranks. */
    for (uint32_t d = 0; d < p->dp; d++) {
        memset(seen, 0, world * sizeof *seen);
        sp_place_group(p, SP_PLACE_SP, d, g);
        for (uint32_t s = 0; s < p->sp; s++)
            seen[g[s]] = 1;
        for (uint32_t k = 0; k < p->ring; k++) {
            sp_place_group(p, SP_PLACE_ULYSSES, d * p->ring + k, g);
            for (uint32_t j = 0; j < p->ulysses; j++)
                CHECK_EQ(seen[g[j]]++, 1);
        }
        for (uint32_t j = 0; j < p->ulysses; j++) {
            sp_place_group(p, SP_PLACE_RING, d * p->ulysses + j, g);
            for (uint32_t k = 0; k < p->ring; k++)
                CHECK_EQ(seen[g[k]]++, 2);
        }
    }
    free(g);
    free(seen);
}

/* Nodes of each Ulysses group's ranks: returns the groups over more than one node. */
static uint32_t spanning_ulysses(const sp_place_t *p, const sp_place_loc_t *locs)
{
    uint32_t *g = malloc(p->ulysses * sizeof *g), n = 0;
    for (uint32_t i = 0; i < sp_place_ngroups(p, SP_PLACE_ULYSSES); i++) {
        sp_place_group(p, SP_PLACE_ULYSSES, i, g);
        for (uint32_t j = 1; j < p->ulysses; j++) {
            if (locs[g[j]].node != locs[g[0]].node) {
                n++;
                break;
            }
        }
    }
    free(g);
    return n;
}

static void check_group(const sp_place_t *p, int kind, uint32_t index, const uint32_t *want, uint32_t n)
{
    uint32_t g[64];
    CHECK_EQ(sp_place_group(p, kind, index, g), n);
    for (uint32_t i = 0; i < n; i++)
        if (g[i] != want[i])
            SP_FAIL("kind %d group %u member %u: rank %u, expected %u", kind, index, i, g[i], want[i]);
}

/* ---------------------------------------------------------------- one node */

typedef struct one_node {
    uint32_t    world, sp, ulysses, ring, heads, kv_heads, want_u, want_ring;
    const char *explain;
} one_node_t;

/* The cases of tests/integration/test_mesh.c: the degrees and explanations
 * meshes gave before placement, which they must still give. */
static const one_node_t one_node[] = {
    { 4, 4, 2, 2, 8, 2, 2, 2, "dp 1 x sp 4 (ulysses 2 x ring 2); ulysses 2: as asked" },
    { 8, 4, 2, 2, 8, 8, 2, 2, "dp 2 x sp 4 (ulysses 2 x ring 2)" },
    { 8, 8, 0, 0, 28, 4, 4, 2, "dp 1 x sp 8 (ulysses 4 x ring 2); ulysses 4: the largest divisor of sp that "
                                "divides the heads without dummies and fits the kv heads" },
    { 4, 4, 0, 0, 7, 0, 1, 4, "(ulysses 1 x ring 4)" },
    { 8, 8, 0, 0, 12, 2, 4, 2, "kv heads replicated 2 times" },
    { 8, 4, 0, 0, 8, 1, 4, 1, "dp 2 x sp 4 (ulysses 4 x ring 1); ulysses 4: the largest divisor of sp that divides "
                               "the heads without dummies and fits the kv heads; kv heads replicated 4 times" },
    { 4, 4, 0, 4, 8, 8, 1, 4, "ulysses 1: sp / ring" },
    { 4, 4, 2, 0, 8, 8, 2, 2, "(ulysses 2 x ring 2); ulysses 2: as asked" },
    { 4, 4, 4, 1, 6, 6, 4, 1, "2 dummy heads pad 6 to 8 and 2 dummy kv heads pad 6 to 8 (+33% all-to-all bytes)" },
    { 3, 3, 0, 0, 6, 0, 3, 1, "(ulysses 3 x ring 1)" },
    { 3, 3, 0, 0, 4, 0, 1, 3, "(ulysses 1 x ring 3)" },
    { 5, 5, 0, 0, 10, 0, 5, 1, "(ulysses 5 x ring 1)" },
    { 5, 5, 0, 0, 8, 0, 1, 5, "(ulysses 1 x ring 5)" },
    { 6, 3, 0, 0, 9, 3, 3, 1, "dp 2 x sp 3 (ulysses 3 x ring 1)" },
    { 5, 1, 0, 0, 4, 0, 1, 1, "dp 5 x sp 1" },
    /* GQA groups are dealt whole: 6 kv heads on 4 ranks pad to 8, and their 12 query heads to 16. */
    { 4, 4, 4, 0, 12, 6, 4, 1, "4 dummy heads pad 12 to 16 and 2 dummy kv heads pad 6 to 8 (+33% all-to-all bytes)" },
};

static void test_one_node(void)
{
    sp_topo_t *t = topo_of("node here\nnuma 0 cpus 0-1\n");
    for (size_t i = 0; i < sizeof one_node / sizeof one_node[0]; i++) {
        const one_node_t *c = &one_node[i];
        sp_place_loc_t *locs = local_locs(c->world);
        sp_place_spec_t spec = { c->sp, c->ulysses, c->ring, c->heads, c->kv_heads };
        for (int with_topo = 0; with_topo < 2; with_topo++) {
            sp_place_t *p = place_ok(with_topo ? t : NULL, locs, c->world, spec);
            if (p->ulysses != c->want_u || p->ring != c->want_ring)
                SP_FAIL("case %zu: ulysses %u x ring %u, expected %u x %u (%s)", i, p->ulysses, p->ring, c->want_u,
                        c->want_ring, p->explain);
            CHECK_CONTAINS(p->explain, c->explain);
            CHECK_EQ(p->chosen, c->ulysses == 0 && c->ring == 0);
            check_consistent(p);
            /* The layout of one node: slot i holds rank i. */
            for (uint32_t r = 0; r < c->world; r++) {
                uint32_t coords[SP_PLACE_KINDS];
                sp_place_coords(p, r, coords, NULL);
                CHECK_EQ(p->order[r], r);
                CHECK_EQ(r, coords[SP_PLACE_DP] * p->sp + coords[SP_PLACE_RING] * p->ulysses +
                                coords[SP_PLACE_ULYSSES]);
            }
            CHECK_EQ(p->ulysses_spanning, 0);
            CHECK_EQ(p->ring_hops_inter, 0);
            sp_place_free(p);
        }
        free(locs);
    }

    /* 8 ranks, sp 8, ulysses 2 x ring 4: the groups spelled out. */
    sp_place_loc_t *locs = local_locs(8);
    sp_place_t *p = place_ok(t, locs, 8, (sp_place_spec_t){ .sp = 8, .ulysses = 2, .heads = 8 });
    check_group(p, SP_PLACE_ULYSSES, 0, (const uint32_t[]){ 0, 1 }, 2);
    check_group(p, SP_PLACE_ULYSSES, 3, (const uint32_t[]){ 6, 7 }, 2);
    check_group(p, SP_PLACE_RING, 0, (const uint32_t[]){ 0, 2, 4, 6 }, 4);
    check_group(p, SP_PLACE_RING, 1, (const uint32_t[]){ 1, 3, 5, 7 }, 4);
    check_group(p, SP_PLACE_SP, 0, (const uint32_t[]){ 0, 1, 2, 3, 4, 5, 6, 7 }, 8);
    check_group(p, SP_PLACE_DP, 5, (const uint32_t[]){ 5 }, 1);
    sp_place_free(p);
    free(locs);
    sp_topo_free(t);
}

/* ---------------------------------------------------------------- several nodes */

/* 16 ranks on 2 nodes of 8, numbered round-robin: rank r on node r % 2. */
static void test_round_robin(void)
{
    sp_topo_t *t = topo_of("cluster nodes 2 gpus-per-node 8 numa-per-node 2 island-size 8\n");
    uint32_t world;
    sp_place_loc_t *locs = gpu_locs(t, true, &world);
    CHECK_EQ(world, 16);
    CHECK_EQ(locs[3].node, 1);
    CHECK_EQ(locs[3].gpu, 1);

    /* 32 heads, 8 kv heads: Ulysses 8 inside each node, a ring of 2 across. */
    sp_place_t *p = place_ok(t, locs, world, (sp_place_spec_t){ .sp = 16, .heads = 32, .kv_heads = 8 });
    printf("  %s\n", p->explain);
    CHECK_EQ(p->ulysses, 8);
    CHECK_EQ(p->ring, 2);
    CHECK_CONTAINS(p->explain, "dp 1 x sp 16 (ulysses 8 x ring 2); ulysses 8: the fewest inter-node bytes with its "
                               "all-to-all inside a node");
    check_consistent(p);
    CHECK_EQ(spanning_ulysses(p, locs), 0);
    /* Node 0's ranks are the even ones, in GPU order; each ring pairs GPU g of both nodes. */
    check_group(p, SP_PLACE_ULYSSES, 0, (const uint32_t[]){ 0, 2, 4, 6, 8, 10, 12, 14 }, 8);
    check_group(p, SP_PLACE_ULYSSES, 1, (const uint32_t[]){ 1, 3, 5, 7, 9, 11, 13, 15 }, 8);
    check_group(p, SP_PLACE_RING, 3, (const uint32_t[]){ 6, 7 }, 2);
    CHECK_EQ(p->ring_hops, 16);
    CHECK_EQ(p->ring_hops_inter, 16);
    /* The candidates: 16 spans nodes; 8 sends the fewest bytes between them. */
    CHECK_EQ(p->ncand, 5);
    CHECK_EQ(p->cand[4].ulysses, 16);
    CHECK_STREQ(p->cand[4].refused, "its all-to-all would span nodes");
    CHECK(p->cand[3].refused == NULL);
    for (uint32_t i = 0; i < 3; i++)
        CHECK(p->cand[i].inter_node > p->cand[3].inter_node);
    sp_place_free(p);

    /* Explicit degrees keep their word: ulysses 16 spans both nodes, and says so. */
    p = place_ok(t, locs, world, (sp_place_spec_t){ .sp = 16, .ulysses = 16, .heads = 32, .kv_heads = 8 });
    check_consistent(p);
    CHECK_EQ(p->ulysses_spanning, 1);
    CHECK_CONTAINS(p->explain, "ulysses 16: as asked; kv heads replicated 2 times; 1 of 1 ulysses groups span nodes");
    sp_place_free(p);

    /* dp 2 x sp 8: each sp group is one node, whatever the numbering. */
    p = place_ok(t, locs, world, (sp_place_spec_t){ .sp = 8, .heads = 32, .kv_heads = 8 });
    check_consistent(p);
    CHECK_EQ(p->dp, 2);
    CHECK_EQ(p->ulysses, 8);
    check_group(p, SP_PLACE_SP, 1, (const uint32_t[]){ 1, 3, 5, 7, 9, 11, 13, 15 }, 8);
    check_group(p, SP_PLACE_DP, 2, (const uint32_t[]){ 4, 5 }, 2);
    CHECK_CONTAINS(p->explain, "the largest divisor of sp");
    sp_place_free(p);
    free(locs);
    sp_topo_free(t);
}

/* 6 ranks on 2 nodes of 3: Ulysses 3 with a dummy head beats a ring of 6. */
static void test_odd(void)
{
    sp_topo_t *t = topo_of("cluster nodes 2 gpus-per-node 3\n");
    uint32_t world;
    sp_place_loc_t *locs = gpu_locs(t, false, &world);
    sp_place_t *p = place_ok(t, locs, world, (sp_place_spec_t){ .sp = 6, .heads = 8 });
    printf("  %s\n", p->explain);
    check_consistent(p);
    CHECK_EQ(p->ulysses, 3);
    CHECK_EQ(p->ring, 2);
    CHECK_STREQ(p->explain, "dp 1 x sp 6 (ulysses 3 x ring 2); ulysses 3: the fewest inter-node bytes with its "
                            "all-to-all inside a node; 1 dummy head pads 8 to 9 and 1 dummy kv head pads 8 to 9 "
                            "(+12% all-to-all bytes)");
    check_group(p, SP_PLACE_ULYSSES, 1, (const uint32_t[]){ 3, 4, 5 }, 3);
    /*
     * Units (one head of one rank's rows) sent between the nodes:
     *   ulysses 1 (ring 6): each rank sends 4 x 5 x 1 x 8 = 160 to its next;
     *     two of the six hops (2 -> 3, 5 -> 0) cross: 320.
     *   ulysses 2: group {2, 3} would span the nodes: refused.
     *   ulysses 3 (ring 2): 3 heads each (9 with the dummy); every rank's ring
     *     peer is on the other node: 6 x 4 x 1 x 3 x 3 = 216.
     *   ulysses 6: 8 heads padded to 12 add 50%: refused.
     */
    CHECK_EQ(p->ncand, 4);
    CHECK_EQ(p->cand[0].inter_node, 320);
    CHECK_STREQ(p->cand[1].refused, "its all-to-all would span nodes");
    CHECK_EQ(p->cand[2].inter_node, 216);
    CHECK_EQ(p->cand[2].dummy_pct, 12);
    CHECK_STREQ(p->cand[3].refused, "dummy heads would add more than 25% to the all-to-all bytes");
    sp_place_free(p);

    /* 6 heads fit 3 ranks without dummies. */
    p = place_ok(t, locs, world, (sp_place_spec_t){ .sp = 6, .heads = 6 });
    check_consistent(p);
    CHECK_EQ(p->ulysses, 3);
    CHECK(strstr(p->explain, "dummy") == NULL);
    sp_place_free(p);

    /* Ulysses 2 asked for: one group straddles the nodes, and the explanation says so. */
    p = place_ok(t, locs, world, (sp_place_spec_t){ .sp = 6, .ulysses = 2, .heads = 8 });
    check_consistent(p);
    CHECK_EQ(spanning_ulysses(p, locs), 1);
    CHECK_CONTAINS(p->explain, "; 1 of 3 ulysses groups span nodes");
    sp_place_free(p);
    free(locs);
    sp_topo_free(t);

    /* 12 ranks, 3 nodes of 4, 24 heads / 8 kv: Ulysses 4 per node, a ring of 3 nodes. */
    t = topo_of("cluster nodes 3 gpus-per-node 4 numa-per-node 2 island-size 4\n");
    locs = gpu_locs(t, true, &world);
    p = place_ok(t, locs, world, (sp_place_spec_t){ .sp = 12, .heads = 24, .kv_heads = 8 });
    printf("  %s\n", p->explain);
    check_consistent(p);
    CHECK_EQ(p->ulysses, 4);
    CHECK_EQ(p->ring, 3);
    CHECK_EQ(spanning_ulysses(p, locs), 0);
    check_group(p, SP_PLACE_ULYSSES, 2, (const uint32_t[]){ 2, 5, 8, 11 }, 4);
    sp_place_free(p);
    free(locs);
    sp_topo_free(t);
}

/* A prime count: a pure ring when chosen, pure Ulysses with dummies when asked. */
static void test_prime(void)
{
    sp_place_loc_t *locs = local_locs(7);
    sp_place_t *p = place_ok(NULL, locs, 7, (sp_place_spec_t){ .sp = 7, .heads = 32, .kv_heads = 8 });
    check_consistent(p);
    CHECK_STREQ(p->explain, "dp 1 x sp 7 (ulysses 1 x ring 7); ulysses 1: the largest divisor of sp that divides "
                            "the heads without dummies and fits the kv heads");
    /* Ulysses 7 was weighed: 8 kv heads pad to 14, 32 query heads to 56. */
    CHECK_EQ(p->ncand, 2);
    CHECK_EQ(p->cand[1].q_heads, 56);
    CHECK_EQ(p->cand[1].kv_heads, 14);
    CHECK_STREQ(p->cand[1].refused, "dummy heads would add more than 25% to the all-to-all bytes");
    sp_place_free(p);

    /* 28 heads MHA: ulysses 7 fits exactly. */
    p = place_ok(NULL, locs, 7, (sp_place_spec_t){ .sp = 7, .heads = 28 });
    CHECK_EQ(p->ulysses, 7);
    sp_place_free(p);

    /* Pure Ulysses asked (ring 1) with 32 heads: 3 dummies, and so explained. */
    p = place_ok(NULL, locs, 7, (sp_place_spec_t){ .sp = 7, .ring = 1, .heads = 32 });
    check_consistent(p);
    CHECK_EQ(p->ulysses, 7);
    CHECK_STREQ(p->explain, "dp 1 x sp 7 (ulysses 7 x ring 1); ulysses 7: sp / ring; 3 dummy heads pad 32 to 35 and "
                            "3 dummy kv heads pad 32 to 35 (+9% all-to-all bytes)");
    CHECK_EQ(p->q_local, 5);
    CHECK_EQ(p->q_dummies, 3);
    sp_place_free(p);
    free(locs);

    /* 7 nodes of one GPU each: every Ulysses degree above 1 spans nodes, so a ring of 7. */
    sp_topo_t *t = topo_of("cluster nodes 7 gpus-per-node 1\n");
    uint32_t world;
    locs = gpu_locs(t, false, &world);
    p = place_ok(t, locs, world, (sp_place_spec_t){ .sp = 7, .heads = 28 });
    check_consistent(p);
    CHECK_EQ(p->ulysses, 1);
    CHECK_EQ(p->ring_hops_inter, 7);
    CHECK_STREQ(p->cand[1].refused, "its all-to-all would span nodes");
    sp_place_free(p);
    free(locs);
    sp_topo_free(t);
}

/* Heads that do not divide: dummy heads where they keep traffic off the network. */
static void test_dummies_and_replication(void)
{
    sp_topo_t *t = topo_of("cluster nodes 2 gpus-per-node 8 numa-per-node 2 island-size 8\n");
    uint32_t world;
    sp_place_loc_t *locs = gpu_locs(t, false, &world);
    /*
     * 28 heads (MHA) on sp 16. Units between nodes:
     *   ulysses 4 (ring 4): 7 kv heads a rank; 4 x 3 x 4 x 7 = 336 each, half the
     *     ranks' next ring rank on the other node: 8 x 336 = 2688.
     *   ulysses 8 (ring 2): 28 heads pad to 32, 4 a rank; 4 x 1 x 8 x 4 = 128
     *     each, every ring peer on the other node: 16 x 128 = 2048.
     */
    sp_place_t *p = place_ok(t, locs, world, (sp_place_spec_t){ .sp = 16, .heads = 28 });
    printf("  %s\n", p->explain);
    check_consistent(p);
    CHECK_EQ(p->ulysses, 8);
    CHECK_EQ(p->cand[2].ulysses, 4);
    CHECK_EQ(p->cand[2].inter_node, 2688);
    CHECK_EQ(p->cand[3].inter_node, 2048);
    CHECK_CONTAINS(p->explain, "ulysses 8: the fewest inter-node bytes with its all-to-all inside a node; "
                               "4 dummy heads pad 28 to 32 and 4 dummy kv heads pad 28 to 32 (+14% "
                               "all-to-all bytes)");
    sp_place_free(p);

    /* Same, but one node: dummies buy nothing there, so no dummies (ulysses 4). */
    sp_place_loc_t *one = local_locs(16);
    p = place_ok(NULL, one, 16, (sp_place_spec_t){ .sp = 16, .heads = 28 });
    CHECK_EQ(p->ulysses, 4);
    CHECK(strstr(p->explain, "dummy") == NULL);
    sp_place_free(p);

    /* kv heads fewer than ulysses: replicated, and said. */
    p = place_ok(t, locs, world, (sp_place_spec_t){ .sp = 16, .ulysses = 8, .heads = 32, .kv_heads = 2 });
    check_consistent(p);
    CHECK_EQ(p->kv_local, 1);
    CHECK_EQ(p->q_local, 4);
    CHECK_CONTAINS(p->explain, "; kv heads replicated 4 times");
    sp_place_free(p);
    p = place_ok(NULL, one, 8, (sp_place_spec_t){ .sp = 8, .heads = 12, .kv_heads = 2 });
    CHECK_EQ(p->ulysses, 4);
    CHECK_CONTAINS(p->explain, "kv heads replicated 2 times");
    sp_place_free(p);
    free(one);
    free(locs);
    sp_topo_free(t);
}

/* NVLink islands inside a node: the fastest domain holds the Ulysses group. */
static void test_islands(void)
{
    /* One node, two islands of 4, ranks numbered across them (rank r on GPU (r % 2) * 4 + r / 2). */
    sp_topo_t *t = topo_of("cluster nodes 1 gpus-per-node 8 numa-per-node 2 island-size 4\n");
    sp_place_loc_t locs[8];
    for (uint32_t r = 0; r < 8; r++)
        locs[r] = (sp_place_loc_t){ .node = 0, .gpu = (int32_t)((r % 2) * 4 + r / 2), .numa = -1 };
    sp_place_t *p = place_ok(t, locs, 8, (sp_place_spec_t){ .sp = 8, .heads = 32, .kv_heads = 8 });
    printf("  %s\n", p->explain);
    check_consistent(p);
    CHECK_EQ(p->ulysses, 4);
    CHECK_CONTAINS(p->explain, "ulysses 4: the fewest bytes between NVLink islands, PCIe switches or NUMA nodes with "
                               "its all-to-all inside a node; slowest GPU link of the 2 ulysses groups: NVLink in 2");
    check_group(p, SP_PLACE_ULYSSES, 0, (const uint32_t[]){ 0, 2, 4, 6 }, 4);
    check_group(p, SP_PLACE_ULYSSES, 1, (const uint32_t[]){ 1, 3, 5, 7 }, 4);
    sp_place_free(p);
    sp_topo_free(t);

    /* Host ranks with NUMA nodes known: the same, by NUMA node. */
    t = topo_of("node h\nnuma 0 cpus 0-3\nnuma 1 cpus 4-7\n");
    for (uint32_t r = 0; r < 4; r++)
        locs[r] = (sp_place_loc_t){ .node = 0, .gpu = -1, .numa = (int32_t)(r % 2) };
    p = place_ok(t, locs, 4, (sp_place_spec_t){ .sp = 4, .ulysses = 2, .heads = 4 });
    check_group(p, SP_PLACE_ULYSSES, 0, (const uint32_t[]){ 0, 2 }, 2);
    check_group(p, SP_PLACE_RING, 0, (const uint32_t[]){ 0, 1 }, 2);
    sp_place_free(p);
    sp_topo_free(t);
}

/* ---------------------------------------------------------------- links between GPUs */

/* One node of 8 GPUs on one NUMA node, with a p2p line each way for every pair
 * of a link link_of(a, b) chooses, peer access everywhere. */
static sp_topo_t *links_node(const char *(*link_of)(int a, int b))
{
    static char text[16384];
    size_t off = (size_t)snprintf(text, sizeof text, "node box\nnuma 0\n");
    for (int g = 0; g < 8; g++)
        off += (size_t)snprintf(text + off, sizeof text - off, "gpu %d numa 0\n", g);
    for (int a = 0; a < 8; a++)
        for (int b = 0; b < 8; b++)
            if (a != b)
                off += (size_t)snprintf(text + off, sizeof text - off, "p2p %d %d link %s access 1\n", a, b,
                                        link_of(a, b));
    CHECK(off < sizeof text);
    return topo_of(text);
}

/* Two NVLink islands of 4 whose GPUs interleave: 0 2 4 6 and 1 3 5 7; PCIe
 * through the host bridge between them. */
static const char *two_islands(int a, int b)
{
    return a % 2 == b % 2 ? "nvl" : "phb";
}

/* PCIe only: two switches, 0 1 4 5 below one and 2 3 6 7 below the other. */
static const char *two_switches(int a, int b)
{
    return (a / 2) % 2 == (b / 2) % 2 ? "pix" : "phb";
}

/* NVLink pairs 0-4, 1-5, 2-6, 3-7; pairs 0-4 and 1-5 below one switch, 2-6 and
 * 3-7 below another, on the other socket. */
static const char *pairs_switches_sockets(int a, int b)
{
    if (a % 4 == b % 4)
        return "nvl";
    return (a % 4) / 2 == (b % 4) / 2 ? "pix" : "sys";
}

/* Placement by the links between GPUs (p2p lines): Ulysses groups go on the
 * GPUs with the best links, whatever their indexes, and the explanation says
 * which link is the slowest in each group. */
static void test_gpu_links(void)
{
    sp_place_loc_t locs[8];
    for (uint32_t r = 0; r < 8; r++)
        locs[r] = (sp_place_loc_t){ .node = 0, .gpu = (int32_t)r, .numa = -1 };

    /* 8 GPUs as two NVLink islands of 4: ulysses 4 chosen, one island each. */
    sp_topo_t *t = links_node(two_islands);
    sp_place_t *p = place_ok(t, locs, 8, (sp_place_spec_t){ .sp = 8, .heads = 32, .kv_heads = 8 });
    printf("  two islands: %s\n", p->explain);
    check_consistent(p);
    CHECK_EQ(p->ulysses, 4);
    CHECK_STREQ(p->explain, "dp 1 x sp 8 (ulysses 4 x ring 2); ulysses 4: the fewest bytes between NVLink islands, "
                            "PCIe switches or NUMA nodes with its all-to-all inside a node; slowest GPU link of the 2 "
                            "ulysses groups: NVLink in 2");
    check_group(p, SP_PLACE_ULYSSES, 0, (const uint32_t[]){ 0, 2, 4, 6 }, 4);
    check_group(p, SP_PLACE_ULYSSES, 1, (const uint32_t[]){ 1, 3, 5, 7 }, 4);
    check_group(p, SP_PLACE_RING, 0, (const uint32_t[]){ 0, 1 }, 2);
    sp_place_free(p);
    /* Ulysses 2 asked: pairs inside the islands. */
    p = place_ok(t, locs, 8, (sp_place_spec_t){ .sp = 8, .ulysses = 2, .heads = 32, .kv_heads = 8 });
    CHECK_CONTAINS(p->explain, "; slowest GPU link of the 4 ulysses groups: NVLink in 4");
    check_group(p, SP_PLACE_ULYSSES, 1, (const uint32_t[]){ 4, 6 }, 2);
    sp_place_free(p);
    /* Ulysses 8 asked: both islands, joined through the host bridge. */
    p = place_ok(t, locs, 8, (sp_place_spec_t){ .sp = 8, .ulysses = 8, .heads = 32, .kv_heads = 8 });
    CHECK_CONTAINS(p->explain, "; slowest GPU link of the 1 ulysses groups: a CPU's PCIe host bridge in 1");
    sp_place_free(p);
    sp_topo_free(t);

    /* A PCIe-only box with two switches: one switch per Ulysses group. */
    t = links_node(two_switches);
    p = place_ok(t, locs, 8, (sp_place_spec_t){ .sp = 8, .heads = 32, .kv_heads = 8 });
    printf("  two switches: %s\n", p->explain);
    check_consistent(p);
    CHECK_EQ(p->ulysses, 4);
    CHECK_CONTAINS(p->explain, "ulysses 4: the fewest bytes between NVLink islands, PCIe switches or NUMA nodes");
    CHECK_CONTAINS(p->explain, "; slowest GPU link of the 2 ulysses groups: one PCIe switch in 2");
    check_group(p, SP_PLACE_ULYSSES, 0, (const uint32_t[]){ 0, 1, 4, 5 }, 4);
    check_group(p, SP_PLACE_ULYSSES, 1, (const uint32_t[]){ 2, 3, 6, 7 }, 4);
    sp_place_free(p);
    sp_topo_free(t);

    /* NVLink pairs below switches on two sockets: the pairs first, then the
     * switch, then the socket; ranks numbered in any order land the same. */
    t = links_node(pairs_switches_sockets);
    for (uint32_t r = 0; r < 8; r++)
        locs[r].gpu = (int32_t)(7 - r);
    p = place_ok(t, locs, 8, (sp_place_spec_t){ .sp = 8, .ulysses = 2, .heads = 32, .kv_heads = 8 });
    printf("  pairs, switches, sockets: %s\n", p->explain);
    CHECK_CONTAINS(p->explain, "; slowest GPU link of the 4 ulysses groups: NVLink in 4");
    check_group(p, SP_PLACE_ULYSSES, 0, (const uint32_t[]){ 7, 3 }, 2);   /* GPUs 0 and 4 */
    check_group(p, SP_PLACE_ULYSSES, 1, (const uint32_t[]){ 6, 2 }, 2);   /* GPUs 1 and 5 */
    sp_place_free(p);
    p = place_ok(t, locs, 8, (sp_place_spec_t){ .sp = 8, .ulysses = 4, .heads = 32, .kv_heads = 8 });
    CHECK_CONTAINS(p->explain, "; slowest GPU link of the 2 ulysses groups: one PCIe switch in 2");
    check_group(p, SP_PLACE_ULYSSES, 0, (const uint32_t[]){ 7, 3, 6, 2 }, 4);
    check_group(p, SP_PLACE_ULYSSES, 1, (const uint32_t[]){ 5, 1, 4, 0 }, 4);
    sp_place_free(p);
    p = place_ok(t, locs, 8, (sp_place_spec_t){ .sp = 8, .ulysses = 8, .heads = 32, .kv_heads = 8 });
    CHECK_CONTAINS(p->explain, "; slowest GPU link of the 1 ulysses groups: the link between CPU sockets in 1");
    sp_place_free(p);
    sp_topo_free(t);

    /* Links the topology does not state (only NUMA nodes) are not claimed;
     * a group with one unknown pair says so. */
    t = topo_of("node n\nnuma 0\ngpu 0 numa 0\ngpu 1 numa 0\ngpu 2 numa 0\ngpu 3 numa 0\n"
                "p2p 0 1 link nvl\n");
    for (uint32_t r = 0; r < 4; r++)
        locs[r].gpu = (int32_t)r;
    p = place_ok(t, locs, 4, (sp_place_spec_t){ .sp = 4, .ulysses = 2, .heads = 4 });
    CHECK_CONTAINS(p->explain, "; slowest GPU link of the 2 ulysses groups: NVLink in 1, unknown in 1");
    sp_place_free(p);
    t->nodes[0].np2p = 0;
    p = place_ok(t, locs, 4, (sp_place_spec_t){ .sp = 4, .ulysses = 2, .heads = 4 });
    CHECK(strstr(p->explain, "GPU link") == NULL);
    sp_place_free(p);
    sp_topo_free(t);
}

/* ---------------------------------------------------------------- refusals */

static void test_refusals(void)
{
    static const struct {
        uint32_t    world, sp, ulysses, ring, heads, kv_heads;
        const char *reason;
    } bad[] = {
        { 4, 3, 0, 0, 8, 0, "sp 3 does not divide the world of 4 ranks" },
        { 4, 0, 0, 0, 8, 0, "sp 0 does not divide the world of 4 ranks" },
        { 4, 8, 0, 0, 8, 0, "sp 8 does not divide the world of 4 ranks" },
        { 4, 4, 2, 1, 8, 0, "ulysses 2 x ring 1 is not sp 4" },
        { 4, 4, 3, 0, 6, 0, "ulysses 3 and ring 0 must divide sp 4" },
        { 4, 4, 2, 2, 8, 3, "3 kv_heads do not divide 8 heads" },
        { 4, 4, 2, 2, 4, 8, "8 kv_heads do not divide 4 heads" },
        { 4, 4, 4, 1, 6, 3, "ulysses 4 cannot replicate 3 kv heads evenly" },
        { 4, 4, 4, 1, 2, 2, "ulysses 4 exceeds the 2 heads" },
        { 4, 4, 2, 2, 0, 0, "heads must be positive" },
        { 0, 1, 0, 0, 8, 0, "a world of 0 ranks is outside [1, 4194304]" },
    };
    sp_place_loc_t *locs = local_locs(4);
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        sp_place_spec_t spec = { bad[i].sp, bad[i].ulysses, bad[i].ring, bad[i].heads, bad[i].kv_heads };
        sp_place_t *p = (sp_place_t *)&bad;
        char err[256] = "";
        spc_status_t st = sp_place_compute(NULL, locs, bad[i].world, &spec, &p, err, sizeof err);
        if (st != SPC_ERR_INVALID_ARG || strstr(err, bad[i].reason) == NULL)
            SP_FAIL("case %zu: %s \"%s\", expected SPC_ERR_INVALID_ARG with \"%s\"", i, spc_status_name(st), err,
                    bad[i].reason);
        CHECK(p == (sp_place_t *)&bad);   /* untouched */
    }

    /* Locations that name no node, GPU or NUMA node of the topology. */
    sp_topo_t *t = topo_of("node a\nnuma 0\ngpu 0 numa 0\n");
    sp_place_spec_t spec = { .sp = 2, .heads = 2 };
    sp_place_loc_t two[2] = { { 0, 0, -1 }, { 1, 0, -1 } };
    sp_place_t *p = NULL;
    char err[256];
    CHECK_EQ(sp_place_compute(t, two, 2, &spec, &p, err, sizeof err), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(err, "rank 1: node 1 is not in the topology (1 nodes)");
    two[1] = (sp_place_loc_t){ 0, 3, -1 };
    CHECK_EQ(sp_place_compute(t, two, 2, &spec, &p, err, sizeof err), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(err, "rank 1: node a has no GPU 3");
    two[1] = (sp_place_loc_t){ 0, -1, 2 };
    CHECK_EQ(sp_place_compute(t, two, 2, &spec, &p, err, sizeof err), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(err, "rank 1: node a has no NUMA node 2");
    CHECK_EQ(sp_place_compute(NULL, two, 2, &spec, &p, err, sizeof err), SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(err, "without a topology");
    CHECK(p == NULL);
    sp_topo_free(t);
    free(locs);
}

/* ---------------------------------------------------------------- a sweep */

/* Shapes of every kind: chosen degrees are consistent and never span nodes. */
static void test_sweep(void)
{
    static const uint32_t heads[][2] = { { 32, 8 }, { 28, 4 }, { 12, 2 }, { 7, 7 }, { 64, 1 }, { 40, 40 } };
    uint32_t placements = 0;
    for (uint32_t nodes = 1; nodes <= 5; nodes++) {
        for (uint32_t gpus = 1; gpus <= 8; gpus++) {
            char text[160];
            snprintf(text, sizeof text, "cluster nodes %u gpus-per-node %u numa-per-node 2 island-size %u\n", nodes,
                     gpus, gpus > 4 ? 4 : 0);
            sp_topo_t *t = topo_of(text);
            for (int rr = 0; rr < 2; rr++) {
                uint32_t world;
                sp_place_loc_t *locs = gpu_locs(t, rr, &world);
                for (uint32_t sp = 1; sp <= world; sp++) {
                    if (world % sp != 0)
                        continue;
                    for (size_t h = 0; h < sizeof heads / sizeof heads[0]; h++) {
                        sp_place_t *p = place_ok(t, locs, world,
                                                 (sp_place_spec_t){ .sp = sp, .heads = heads[h][0],
                                                                    .kv_heads = heads[h][1] });
                        check_consistent(p);
                        if (spanning_ulysses(p, locs) != 0)
                            SP_FAIL("%u nodes x %u, sp %u, %u/%u heads: %s", nodes, gpus, sp, heads[h][0],
                                    heads[h][1], p->explain);
                        CHECK_EQ(p->ulysses_spanning, 0);
                        sp_place_free(p);
                        placements++;
                    }
                }
                free(locs);
            }
            sp_topo_free(t);
        }
    }
    printf("  %u placements consistent, none spanning nodes\n", placements);
}

int main(void)
{
    test_one_node();
    printf("one node: ok\n");
    test_round_robin();
    printf("two nodes, round-robin ranks: ok\n");
    test_odd();
    printf("odd counts: ok\n");
    test_prime();
    printf("prime count: ok\n");
    test_dummies_and_replication();
    printf("dummy heads and kv replication: ok\n");
    test_islands();
    printf("islands and NUMA nodes: ok\n");
    test_gpu_links();
    printf("links between GPUs: ok\n");
    test_refusals();
    printf("refusals: ok\n");
    test_sweep();
    printf("sweep: ok\n");
    return 0;
}
