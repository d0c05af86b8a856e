/*
 * `spctl plan` (client/spctl/plan.c over common/sp_place.c), run as a program:
 * no daemon. Its byte counts are checked against numbers worked out by hand
 * below from the model of common/sp_place.h (Table 1 of seeds/000, counted
 * exactly), in text and in JSON; refusals; a 512-node cluster answered at once.
 *
 * The model, per rank, per attention layer, forward and backward:
 *   unit    = batch x ceil(seq / sp) x (hidden / heads) x dtype bytes x layers
 *   Ulysses = (ulysses - 1) peers x 4 (Lq + Lkv) units
 *   Ring    = 4 (ring - 1) x ulysses x Lkv units, all to the next ring rank
 * Lq, Lkv: query and kv heads a rank holds after seq->head.
 */
#include "sp_test.h"

static char out[1 << 16];

static int plan(const char *args)
{
    return sp_test_run(out, sizeof out, "%s plan %s 2>&1", sp_test_spctl_bin(), args);
}

static void plan_ok(const char *args)
{
    int rc = plan(args);
    if (rc != 0)
        SP_FAIL("spctl plan %s: exit %d:\n%s", args, rc, out);
}

/* The "key":value of a flat JSON field anywhere in out. */
static long long jint(const char *key)
{
    char k[96];
    snprintf(k, sizeof k, "\"%s\":", key);
    const char *p = strstr(out, k);
    if (p == NULL)
        SP_FAIL("no %s in %s", k, out);
    return strtoll(p + strlen(k), NULL, 10);
}

/* 2 nodes x 8 GPUs, sp 16, 32 heads, 8 kv heads, seq 128 Ki, hidden 4096, bf16. */
static void test_two_nodes(void)
{
    const char *args = "--nodes 2 --gpus-per-node 8 --sp 16 --heads 32 --kv-heads 8 --seq 131072 --hidden 4096";
    plan_ok(args);
    printf("$ spctl plan %s\n%s", args, out);
    CHECK_CONTAINS(out, "mesh       dp 1 x sp 16 (ulysses 8 x ring 2), heads 32, kv_heads 8\n");
    CHECK_CONTAINS(out, "why        dp 1 x sp 16 (ulysses 8 x ring 2); ulysses 8: the fewest inter-node bytes with "
                        "its all-to-all inside a node; slowest GPU link of the 2 ulysses groups: NVLink in 2\n");
    CHECK_CONTAINS(out, "a rank holds 4 query and 1 kv heads after seq->head\n");
    CHECK_CONTAINS(out, "first: ranks 0 1 2 3 4 5 6 7 (all on node0)\n");
    CHECK_CONTAINS(out, "first: ranks 0 8 (on node0 node1)\n");
    CHECK_CONTAINS(out, "16 x 1        32/16       +0%     1536           0              its all-to-all would "
                        "span nodes\n");
    /*
     * unit = 1 x (131072 / 16 = 8192) x (4096 / 32 = 128) x 2 = 2097152 B.
     * Ulysses 8: Lq = 32 / 8 = 4, Lkv = 8 / 8 = 1; a rank sends 7 x 4 x (4 + 1)
     *   = 140 units inside its node; 16 ranks: 2240 units = 4697620480 B.
     * Ring 2: a rank sends 4 x 1 x 8 x 1 = 32 units to the other node; 16 ranks:
     *   512 units = 1073741824 B.
     * Busiest rank: 140 x 2097152 = 293601280 B intra, 32 x 2097152 = 67108864 B inter.
     */
    CHECK_CONTAINS(out, "unit = one head of one rank's rows = 2097152 bytes\n");
    CHECK_CONTAINS(out, "intra-node   4697620480 B (4.38 GiB)      0 B                          "
                        "4697620480 B (4.38 GiB)\n");
    CHECK_CONTAINS(out, "inter-node   0 B                          1073741824 B (1.00 GiB)      "
                        "1073741824 B (1.00 GiB)\n");
    CHECK_CONTAINS(out, "busiest rank: 293601280 B (280.00 MiB) intra-node, 67108864 B (64.00 MiB) inter-node\n");

    char cmd[256];
    snprintf(cmd, sizeof cmd, "%s --json", args);
    plan_ok(cmd);
    CHECK(out[0] == '{');
    CHECK_EQ(jint("world"), 16);
    CHECK_EQ(jint("ulysses"), 8);
    CHECK_EQ(jint("ring"), 2);
    CHECK_EQ(jint("unit_bytes"), 2097152);
    CHECK_EQ(jint("ulysses_intra_node"), 4697620480LL);
    CHECK_EQ(jint("ulysses_inter_node"), 0);
    CHECK_EQ(jint("ring_intra_node"), 0);
    CHECK_EQ(jint("ring_inter_node"), 1073741824LL);
    CHECK_EQ(jint("intra_node"), 4697620480LL);
    CHECK_EQ(jint("inter_node"), 1073741824LL);
    CHECK_EQ(jint("busiest_rank_intra_node"), 293601280LL);
    CHECK_EQ(jint("busiest_rank_inter_node"), 67108864LL);
    CHECK_CONTAINS(out, "\"first_ulysses_group\":[0,1,2,3,4,5,6,7],\"first_ring\":[0,8],");
    CHECK_CONTAINS(out, "{\"ulysses\":16,\"ring\":1,\"q_heads\":32,\"kv_heads\":16,\"dummy_pct\":0,"
                        "\"groups_across_nodes\":1,\"inter_node_units\":1536,\"inter_domain_units\":0,"
                        "\"chosen\":false,\"refused\":\"its all-to-all would span nodes\"}");
    /* --json before the command says the same, but for the time it took. */
    static char first[sizeof out];
    CHECK(strstr(out, "\"plan_ms\":") != NULL);
    snprintf(first, sizeof first, "%.*s", (int)(strstr(out, "\"plan_ms\":") - out), out);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json plan %s", sp_test_spctl_bin(), args), 0);
    CHECK(strstr(out, "\"plan_ms\":") != NULL);
    *strstr(out, "\"plan_ms\":") = '\0';
    CHECK_STREQ(out, first);
}

/* Pure Ulysses on one node: the seed's 8/N bs L d, times (N - 1) / N. */
static void test_pure_ulysses(void)
{
    plan_ok("--nodes 1 --gpus-per-node 8 --heads 8 --seq 8192 --hidden 1024 --dtype fp32 --batch 2 --layers 3 "
            "--json");
    /*
     * unit = 2 x (8192 / 8 = 1024) x (1024 / 8 = 128) x 4 x 3 = 3145728 B; Lq = Lkv = 1.
     * A rank sends 7 x 4 x (1 + 1) = 56 units; 8 ranks: 448 units = 1409286144 B.
     * Seed: 8 / 8 x 2 x 8192 x 1024 = 16777216 elements a rank, x 7/8 = 14680064,
     * x 4 B x 3 layers = 176160768 B; x 8 ranks = 1409286144 B.
     */
    CHECK_EQ(jint("ulysses"), 8);
    CHECK_EQ(jint("ring"), 1);
    CHECK_EQ(jint("unit_bytes"), 3145728);
    CHECK_EQ(jint("ulysses_intra_node"), 1409286144LL);
    CHECK_EQ(jint("busiest_rank_intra_node"), 176160768LL);
    CHECK_EQ(jint("ring_intra_node"), 0);
    CHECK_EQ(jint("inter_node"), 0);
}

/* Pure ring over 4 nodes of one GPU, GQA 8 / 2: the seed's 4 bs L d with kv width. */
static void test_pure_ring(void)
{
    plan_ok("--nodes 4 --gpus-per-node 1 --heads 8 --kv-heads 2 --seq 4096 --hidden 512 --json");
    /*
     * Every Ulysses degree above 1 spans nodes: ulysses 1 x ring 4.
     * unit = 1 x (4096 / 4 = 1024) x (512 / 8 = 64) x 2 = 131072 B; Lkv = 2.
     * A rank sends 4 x 3 x 1 x 2 = 24 units to the next node; 4 ranks: 96 units
     * = 12582912 B. Seed: 4 x 3/4 x 4096 x (2 x 64) = 1572864 elements a rank,
     * x 2 B = 3145728 B = 24 units.
     */
    CHECK_EQ(jint("ulysses"), 1);
    CHECK_EQ(jint("ring"), 4);
    CHECK_EQ(jint("ring_inter_node"), 12582912);
    CHECK_EQ(jint("busiest_rank_inter_node"), 3145728);
    CHECK_EQ(jint("ulysses_intra_node"), 0);
    CHECK_EQ(jint("intra_node"), 0);
    CHECK_EQ(jint("ring_hops_between_nodes"), 4);
}

/* Round-robin ranks and 28 heads: Ulysses 8 inside each node, with 4 dummy heads. */
static void test_round_robin_dummies(void)
{
    plan_ok("--nodes 2 --gpus-per-node 8 --heads 28 --seq 16384 --hidden 3584 --order round-robin");
    printf("%s", out);
    CHECK_CONTAINS(out, "16 ranks numbered round-robin across the nodes");
    CHECK_CONTAINS(out, "ulysses 8: the fewest inter-node bytes with its all-to-all inside a node; 4 dummy heads pad "
                        "28 to 32 and 4 dummy kv heads pad 28 to 32 (+14% all-to-all bytes)");
    CHECK_CONTAINS(out, "2 groups of 8, 0 across nodes; first: ranks 0 2 4 6 8 10 12 14 (all on node0)\n");
    CHECK_CONTAINS(out, "first: ranks 0 1 (on node0 node1)\n");
    /*
     * unit = 1 x 1024 x 128 x 2 = 262144 B; Lq = Lkv = 32 / 8 = 4.
     * Ulysses: 7 x 4 x (4 + 4) = 224 units a rank, 16 ranks: 3584 units = 939524096 B.
     * Ring 2: 4 x 1 x 8 x 4 = 128 units a rank, 16 ranks: 2048 units = 536870912 B.
     */
    CHECK_CONTAINS(out, "intra-node   939524096 B (896.00 MiB)");
    CHECK_CONTAINS(out, "inter-node   0 B                          536870912 B (512.00 MiB)");
    /* The candidates, in units: ulysses 4 would send 2688 between the nodes, 8 sends 2048. */
    CHECK_CONTAINS(out, "4 x 4         28/28       +0%     2688");
    CHECK_CONTAINS(out, "8 x 2         32/32       +14%    2048           0              chosen\n");
}

/* Host ranks from a topology file, NUMA nodes as domains; units without --seq. */
static void test_topology_file(void)
{
    char path[] = "/tmp/sp-plan-XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0);
    const char *text = "node a\nnuma 0 cpus 0-3\nnuma 1 cpus 4-7\nnode b\nnuma 0 cpus 0-3\nnuma 1 cpus 4-7\n";
    CHECK(write(fd, text, strlen(text)) == (ssize_t)strlen(text));
    close(fd);
    char args[256];
    snprintf(args, sizeof args, "--topology %s --ranks-per-node 4 --heads 8 --json", path);
    plan_ok(args);
    /*
     * Ranks 0-3 on node a (NUMA 0, 0, 1, 1), 4-7 on b. Between the nodes, in units:
     *   ulysses 4 (Lq = Lkv = 2), ring 2 across the nodes: 8 x 4 x 1 x 4 x 2 = 256;
     *   ulysses 2 (Lkv = 4), ring 4, half the hops across: 4 x 4 x 3 x 2 x 4 = 384;
     *   ulysses 1 (Lkv = 8), ring 8, 2 hops across: 2 x 4 x 7 x 8 = 448.
     * Ulysses 4's all-to-all stays in its node: 8 ranks x 3 peers x 4 x (2 + 2) = 384.
     */
    CHECK_EQ(jint("ulysses"), 4);
    CHECK_CONTAINS(out, "\"traffic\":{\"unit\":\"head-rows\",");
    CHECK_EQ(jint("ulysses_intra_node"), 384);
    CHECK_EQ(jint("ring_inter_node"), 256);
    CHECK_CONTAINS(out, "\"ulysses\":2,\"ring\":4,\"q_heads\":8,\"kv_heads\":8,\"dummy_pct\":0,"
                        "\"groups_across_nodes\":0,\"inter_node_units\":384,");
    CHECK_CONTAINS(out, "\"ulysses\":1,\"ring\":8,\"q_heads\":8,\"kv_heads\":8,\"dummy_pct\":0,"
                        "\"groups_across_nodes\":0,\"inter_node_units\":448,");
    CHECK_CONTAINS(out, "\"first_ulysses_group\":[0,1,2,3],\"first_ring\":[0,4],");
    unlink(path);
}

static void test_refusals(void)
{
    CHECK_EQ(plan("--nodes 2 --gpus-per-node 8 --sp 3 --heads 32"), 1);
    CHECK_CONTAINS(out, "spctl plan: refused: sp 3 does not divide the world of 16 ranks");
    CHECK_EQ(plan("--nodes 2 --gpus-per-node 8 --ulysses 16 --heads 32 --kv-heads 3"), 1);
    CHECK_CONTAINS(out, "refused: 3 kv_heads do not divide 32 heads");
    CHECK_EQ(plan("--nodes 2 --gpus-per-node 8 --heads 32 --seq 1000 --hidden 100"), 1);
    CHECK_CONTAINS(out, "hidden 100 is not a multiple of the 32 heads");
    CHECK_EQ(plan("--nodes 2 --gpus-per-node 8"), 2);
    CHECK_CONTAINS(out, "give --heads");
    CHECK_EQ(plan("--nodes 2 --heads 8"), 2);
    CHECK_CONTAINS(out, "give --nodes and --gpus-per-node, or --topology");
    CHECK_EQ(plan("--nodes 2 --gpus-per-node 8 --heads 8 --seq 100"), 2);
    CHECK_CONTAINS(out, "--seq and --hidden go together");
    CHECK_EQ(plan("--nodes 2 --gpus-per-node 65 --heads 8"), 2);
    CHECK_CONTAINS(out, "--gpus-per-node '65' is not an integer in [1, 64]");
    CHECK_EQ(plan("--nodes 2 --gpus-per-node 8 --heads 8 --dtype int4"), 2);
    CHECK_CONTAINS(out, "--dtype 'int4' is not one of");
    CHECK_EQ(plan("--topology /nonexistent/t --nodes 2 --heads 8"), 2);
    CHECK_CONTAINS(out, "do not go with it");
    CHECK_EQ(plan("--topology /nonexistent/t --heads 8"), 1);
    CHECK_CONTAINS(out, "/nonexistent/t: No such file or directory");
    CHECK_EQ(plan("--help"), 0);
    CHECK_CONTAINS(out, "usage: spctl plan");
}

/* 512 nodes x 8 GPUs: 4096 ranks placed and counted at once. */
static void test_large(void)
{
    uint64_t t0 = sp_test_now_ms();
    plan_ok("--nodes 512 --gpus-per-node 8 --sp 64 --heads 64 --kv-heads 8 --seq 1048576 --hidden 8192 --json");
    uint64_t ms = sp_test_now_ms() - t0;
    CHECK_EQ(jint("world"), 4096);
    CHECK_EQ(jint("dp"), 64);
    CHECK_EQ(jint("ulysses"), 8);
    CHECK_EQ(jint("ring"), 8);
    CHECK_EQ(jint("ulysses_groups_across_nodes"), 0);
    /*
     * unit = 1 x (1048576 / 64 = 16384) x 128 x 2 = 4194304 B; Lq = 8, Lkv = 1.
     * Ulysses: 7 x 4 x 9 = 252 units a rank; 4096 ranks: 1032192 units.
     * Ring 8 over 8 nodes: 4 x 7 x 8 x 1 = 224 units a rank, all between nodes;
     * 4096 ranks: 917504 units.
     */
    CHECK_EQ(jint("unit_bytes"), 4194304);
    CHECK_EQ(jint("ulysses_intra_node"), 1032192LL * 4194304);
    CHECK_EQ(jint("ring_inter_node"), 917504LL * 4194304);
    printf("512 x 8 GPUs planned in %" PRIu64 " ms (spctl included; the plan itself: %s)\n", ms,
           strstr(out, "\"plan_ms\":"));
    CHECK(ms < 5000);
}

int main(void)
{
    test_two_nodes();
    printf("two nodes: ok\n");
    test_pure_ulysses();
    printf("pure Ulysses: ok\n");
    test_pure_ring();
    printf("pure ring: ok\n");
    test_round_robin_dummies();
    printf("round-robin ranks, dummy heads: ok\n");
    test_topology_file();
    printf("topology file: ok\n");
    test_refusals();
    printf("refusals: ok\n");
    test_large();
    printf("512 nodes: ok\n");
    return 0;
}
