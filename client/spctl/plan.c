/*
 * plan.c — `spctl plan`: how a mesh would be placed on a cluster and how many
 * bytes each kind of link would carry per training step. It needs no daemon:
 * the placement and the communication model are common/sp_place.h's, the same
 * code spd builds meshes with.
 *
 *   spctl plan --nodes N --gpus-per-node G --heads H [--kv-heads K] [--sp S]
 *              [--ulysses U] [--ring R] [--numa-per-node M] [--island-size I]
 *              [--topology FILE [--ranks-per-node R]] [--order block|round-robin]
 *              [--seq L --hidden D] [--dtype T] [--batch B] [--layers N] [--json]
 *
 * The cluster is N synthetic nodes of G GPUs (a `cluster` line of sp_topo.h:
 * M NUMA nodes, NVLink islands of I GPUs; by default 2 NUMA nodes and one
 * island per node, as on NVSwitch machines) or the nodes of a topology file.
 * There is one rank per GPU, or R host ranks on a node without GPUs, numbered
 * node by node (block) or across the nodes (round-robin) as launchers do.
 */
#include <inttypes.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "sp_place.h"
#include "sp_topo.h"
#include "spctl.h"

static void plan_usage(FILE *out)
{
    fprintf(out,
            "usage: spctl plan (--nodes N --gpus-per-node G | --topology FILE) --heads H [options]\n"
            "  --nodes N, --gpus-per-node G   a cluster of N nodes of G GPUs, one rank per GPU\n"
            "  --numa-per-node M              NUMA nodes per node (default 2, 1 for one GPU)\n"
            "  --island-size I                GPUs per NVLink island (default G: one per node; 0: none)\n"
            "  --topology FILE                the nodes of a topology file (`spctl topo` writes one)\n"
            "  --ranks-per-node R             host ranks on a file's nodes without GPUs (default 1)\n"
            "  --order block|round-robin      rank r on node r / G (default) or on node r %% N\n"
            "  --sp S                         sequence-parallel degree (default: every rank)\n"
            "  --ulysses U, --ring R          degrees (default: chosen, as spd chooses them)\n"
            "  --heads H, --kv-heads K        attention heads, kv heads (default K = H)\n"
            "  --seq L, --hidden D            sequence length and hidden size: traffic in bytes\n"
            "                                 (without them, in units of one head of one rank's rows)\n"
            "  --dtype bf16|fp16|fp32|fp64|fp8  (default bf16)\n"
            "  --batch B, --layers N          (default 1, 1)\n"
            "  --json                         one JSON object\n"
            "Traffic is per training step (forward and backward), Table 1 of seeds/000 counted\n"
            "exactly (common/sp_place.h): the all-to-all of q, k, v, o and their gradients inside\n"
            "each Ulysses group, k and v forward and dk and dv backward round each ring.\n");
}

typedef struct plan_args {
    uint64_t    nodes, gpus, numa, island, ranks_per_node, sp, ulysses, ring, heads, kv, seq, hidden, batch, layers;
    bool        have_nodes, have_gpus, have_numa, have_island, have_rpn, have_seq, have_hidden;
    const char *topology, *dtype;
    uint32_t    dtype_bytes;
    bool        round_robin;
    int         json;
} plan_args_t;

static const struct {
    const char *name;
    uint32_t    bytes;
} dtypes[] = { { "bf16", 2 }, { "fp16", 2 }, { "fp32", 4 }, { "fp64", 8 }, { "fp8", 1 } };

static bool parse_u64(const char *opt, const char *v, uint64_t lo, uint64_t hi, uint64_t *out)
{
    char *end;
    unsigned long long x = strtoull(v, &end, 10);
    if (*v == '\0' || *v == '-' || *end != '\0' || x < lo || x > hi) {
        fprintf(stderr, "spctl plan: %s '%s' is not an integer in [%" PRIu64 ", %" PRIu64 "]\n", opt, v, lo, hi);
        return false;
    }
    *out = x;
    return true;
}

/* Returns 0, or the exit code (2) after saying what is wrong. */
static int parse_args(int argc, char **argv, plan_args_t *a)
{
    static const struct {
        const char *name;
        size_t      off;
        size_t      seen;       /* offset of its have_ flag, or SIZE_MAX */
        uint64_t    lo, hi;
    } nums[] = {
#define NUM(n, f, h, lo, hi) { n, offsetof(plan_args_t, f), h, lo, hi }
#define HAVE(f) offsetof(plan_args_t, f)
        NUM("--nodes", nodes, HAVE(have_nodes), 1, SP_TOPO_MAX_NODES),
        NUM("--gpus-per-node", gpus, HAVE(have_gpus), 1, SP_TOPO_MAX_GPUS),
        NUM("--numa-per-node", numa, HAVE(have_numa), 1, SP_TOPO_MAX_NUMA),
        NUM("--island-size", island, HAVE(have_island), 0, SP_TOPO_MAX_GPUS),
        NUM("--ranks-per-node", ranks_per_node, HAVE(have_rpn), 1, 4096),
        NUM("--sp", sp, SIZE_MAX, 1, SP_PLACE_MAX_WORLD),
        NUM("--ulysses", ulysses, SIZE_MAX, 1, SP_PLACE_MAX_WORLD),
        NUM("--ring", ring, SIZE_MAX, 1, SP_PLACE_MAX_WORLD),
        NUM("--heads", heads, SIZE_MAX, 1, 65536),
        NUM("--kv-heads", kv, SIZE_MAX, 1, 65536),
        NUM("--seq", seq, HAVE(have_seq), 1, 1ull << 40),
        NUM("--hidden", hidden, HAVE(have_hidden), 1, 1ull << 24),
        NUM("--batch", batch, SIZE_MAX, 1, 1ull << 20),
        NUM("--layers", layers, SIZE_MAX, 1, 1ull << 16),
#undef NUM
#undef HAVE
    };

    *a = (plan_args_t){ .batch = 1, .layers = 1, .ranks_per_node = 1, .dtype = "bf16", .dtype_bytes = 2 };
    for (int i = 1; i < argc; i++) {
        const char *opt = argv[i], *val = NULL;
        char name[32];
        const char *eq = strchr(opt, '=');
        if (strncmp(opt, "--", 2) == 0 && eq != NULL && (size_t)(eq - opt) < sizeof name) {
            snprintf(name, sizeof name, "%.*s", (int)(eq - opt), opt);
            opt = name;
            val = eq + 1;
        }
        if (strcmp(opt, "--json") == 0 && val == NULL) {
            a->json = 1;
            continue;
        }
        if (strcmp(opt, "--help") == 0 || strcmp(opt, "-h") == 0) {
            plan_usage(stdout);
            exit(0);
        }
        if (val == NULL) {
            if (i + 1 >= argc) {
                fprintf(stderr, "spctl plan: %s needs a value\n", opt);
                plan_usage(stderr);
                return 2;
            }
            val = argv[++i];
        }
        bool known = false;
        for (size_t k = 0; k < sizeof nums / sizeof nums[0] && !known; k++) {
            if (strcmp(opt, nums[k].name) != 0)
                continue;
            known = true;
            if (!parse_u64(opt, val, nums[k].lo, nums[k].hi, (uint64_t *)((char *)a + nums[k].off)))
                return 2;
            if (nums[k].seen != SIZE_MAX)
                *(bool *)((char *)a + nums[k].seen) = true;
        }
        if (known)
            continue;
        if (strcmp(opt, "--topology") == 0) {
            a->topology = val;
        } else if (strcmp(opt, "--order") == 0 && (strcmp(val, "block") == 0 || strcmp(val, "round-robin") == 0)) {
            a->round_robin = val[0] == 'r';
        } else if (strcmp(opt, "--dtype") == 0) {
            size_t k = 0;
            while (k < sizeof dtypes / sizeof dtypes[0] && strcmp(val, dtypes[k].name) != 0)
                k++;
            if (k == sizeof dtypes / sizeof dtypes[0]) {
                fprintf(stderr, "spctl plan: --dtype '%s' is not one of bf16, fp16, fp32, fp64, fp8\n", val);
                return 2;
            }
            a->dtype = dtypes[k].name;
            a->dtype_bytes = dtypes[k].bytes;
        } else {
            fprintf(stderr, "spctl plan: unknown option '%s %s'\n", opt, val);
            plan_usage(stderr);
            return 2;
        }
    }
    if (a->topology != NULL && (a->have_nodes || a->have_gpus || a->have_numa || a->have_island)) {
        fprintf(stderr, "spctl plan: --topology describes the nodes; --nodes, --gpus-per-node, --numa-per-node and "
                        "--island-size do not go with it\n");
        return 2;
    }
    if (a->topology == NULL && (!a->have_nodes || !a->have_gpus)) {
        fprintf(stderr, "spctl plan: give --nodes and --gpus-per-node, or --topology\n");
        plan_usage(stderr);
        return 2;
    }
    if (a->heads == 0) {
        fprintf(stderr, "spctl plan: give --heads\n");
        return 2;
    }
    if (a->have_seq != a->have_hidden) {
        fprintf(stderr, "spctl plan: --seq and --hidden go together (traffic in bytes needs both)\n");
        return 2;
    }
    return 0;
}

/* The cluster: from the file, or a `cluster` line's nodes. */
static sp_topo_t *plan_cluster(const plan_args_t *a)
{
    sp_topo_t *topo = NULL;
    char err[512];
    spc_status_t st;
    if (a->topology != NULL) {
        st = sp_topo_load(a->topology, &topo, err, sizeof err);
        if (st == SPC_OK && topo->nnodes == 0) {
            snprintf(err, sizeof err, "%s: no nodes", a->topology);
            sp_topo_free(topo);
            st = SPC_ERR_INVALID_ARG;
        }
    } else {
        sp_topo_cluster_t c = { .nodes = (uint32_t)a->nodes, .gpus_per_node = (uint32_t)a->gpus,
                                .numa_per_node = (uint32_t)(a->have_numa ? a->numa : a->gpus > 1 ? 2 : 1),
                                .island_size = (uint32_t)(a->have_island ? a->island : a->gpus),
                                .nic_speed_mbps = -1 };
        if ((st = sp_topo_create(&topo)) == SPC_OK && (st = sp_topo_add_cluster(topo, &c, err, sizeof err)) != SPC_OK)
            sp_topo_free(topo);
    }
    if (st != SPC_OK) {
        fprintf(stderr, "spctl plan: %s\n", err);
        return NULL;
    }
    return topo;
}

/* Where each rank runs: every GPU, or ranks_per_node host ranks spread over a
 * GPU-less node's NUMA nodes in blocks; numbered node by node or round-robin. */
static sp_place_loc_t *plan_ranks(const sp_topo_t *topo, const plan_args_t *a, uint32_t *world_p)
{
    uint64_t world = 0;
    uint32_t most = 0;
    for (uint32_t n = 0; n < topo->nnodes; n++) {
        uint32_t k = topo->nodes[n].ngpus ? topo->nodes[n].ngpus : (uint32_t)a->ranks_per_node;
        world += k;
        most = k > most ? k : most;
    }
    if (world > SP_PLACE_MAX_WORLD) {
        fprintf(stderr, "spctl plan: %" PRIu64 " ranks is more than %u\n", world, SP_PLACE_MAX_WORLD);
        return NULL;
    }
    sp_place_loc_t *locs = malloc(world * sizeof *locs);
    if (locs == NULL) {
        fprintf(stderr, "spctl plan: out of memory\n");
        return NULL;
    }
    uint32_t r = 0;
    /* Block: node by node. Round-robin: the k-th rank of every node, then the (k+1)-th. */
    for (uint32_t k = 0; k < (a->round_robin ? most : 1); k++) {
        for (uint32_t n = 0; n < topo->nnodes; n++) {
            const sp_topo_node_t *node = &topo->nodes[n];
            uint32_t count = node->ngpus ? node->ngpus : (uint32_t)a->ranks_per_node;
            uint32_t from = a->round_robin ? k : 0, to = a->round_robin ? k + 1 : count;
            for (uint32_t i = from; i < to && i < count; i++) {
                if (node->ngpus)
                    locs[r++] = (sp_place_loc_t){ .node = n, .gpu = node->gpus[i].index, .numa = -1 };
                else
                    locs[r++] = (sp_place_loc_t){ .node = n, .gpu = -1,
                                                  .numa = node->nnuma ? node->numa[i * node->nnuma / count].id : -1 };
            }
        }
    }
    *world_p = (uint32_t)world;
    return locs;
}

/* ---------------------------------------------------------------- output */

static void human(uint64_t b, char *buf, size_t len)
{
    static const char *const unit[] = { "B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB" };
    double v = (double)b;
    int u = 0;
    while (v >= 1024 && u < 6) {
        v /= 1024;
        u++;
    }
    if (u == 0)
        snprintf(buf, len, "%" PRIu64 " B", b);
    else
        snprintf(buf, len, "%" PRIu64 " B (%.2f %s)", b, v, unit[u]);
}

/* Group `kind` 0's ranks, at most 16 of them, and the nodes they run on. */
static void text_group(const sp_place_t *p, const sp_topo_t *topo, const sp_place_loc_t *locs, int kind,
                       uint32_t *buf)
{
    uint32_t n = sp_place_group(p, kind, 0, buf), shown = n > 16 ? 16 : n;
    bool one_node = true;
    printf("ranks");
    for (uint32_t i = 0; i < shown; i++)
        printf(" %u", buf[i]);
    if (shown < n)
        printf(" ... (%u in all)", n);
    for (uint32_t i = 1; i < n; i++)
        one_node &= locs[buf[i]].node == locs[buf[0]].node;
    if (one_node) {
        printf(" (all on %s)\n", topo->nodes[locs[buf[0]].node].name);
        return;
    }
    printf(" (on");
    for (uint32_t i = 0; i < shown; i++)
        printf(" %s", topo->nodes[locs[buf[i]].node].name);
    printf("%s)\n", shown < n ? " ..." : "");
}

static void text_cluster(const sp_topo_t *topo, const plan_args_t *a, uint32_t world)
{
    if (a->topology != NULL)
        printf("cluster    %u nodes from %s, %u ranks numbered %s\n", topo->nnodes, a->topology, world,
               a->round_robin ? "round-robin across the nodes" : "node by node");
    else
        printf("cluster    %" PRIu64 " nodes x %" PRIu64 " GPUs (%u NUMA nodes, %s), %u ranks numbered %s\n",
               a->nodes, a->gpus, topo->nodes[0].nnuma,
               topo->nodes[0].gpus[0].island < 0 ? "no NVLink" :
               a->have_island && a->island != a->gpus ? "NVLink islands" : "one NVLink island a node",
               world, a->round_robin ? "round-robin across the nodes" : "node by node");
}

static void text_plan(const sp_place_t *p, const sp_topo_t *topo, const sp_place_loc_t *locs, const plan_args_t *a,
                      const sp_place_traffic_t *tr, bool bytes, double ms)
{
    uint32_t *buf = malloc(p->world * sizeof *buf);
    if (buf == NULL)
        return;
    text_cluster(topo, a, p->world);
    printf("mesh       dp %u x sp %u (ulysses %u x ring %u), heads %u, kv_heads %u\n", p->dp, p->sp, p->ulysses,
           p->ring, p->heads, p->kv_heads);
    printf("why        %s\n", p->explain);
    printf("heads      a rank holds %u query and %u kv heads after seq->head", p->q_local, p->kv_local);
    if (p->q_dummies || p->kv_dummies)
        printf(" (dummies over a Ulysses group: %u query, %u kv)", p->q_dummies, p->kv_dummies);
    if (p->kv_heads < p->ulysses)
        printf(" (kv heads replicated %u times)", p->ulysses / p->kv_heads);
    printf("\nulysses    %u groups of %u, %u across nodes; first: ", sp_place_ngroups(p, SP_PLACE_ULYSSES), p->ulysses,
           p->ulysses_spanning);
    text_group(p, topo, locs, SP_PLACE_ULYSSES, buf);
    printf("ring       %u rings of %u, %u of %u hops between nodes; first: ", sp_place_ngroups(p, SP_PLACE_RING),
           p->ring, p->ring_hops_inter, p->ring_hops);
    text_group(p, topo, locs, SP_PLACE_RING, buf);
    if (p->dp > 1) {
        printf("dp         %u groups of %u; first: ", sp_place_ngroups(p, SP_PLACE_DP), p->dp);
        text_group(p, topo, locs, SP_PLACE_DP, buf);
    }
    if (p->chosen) {
        /* Units of one head of one rank's rows; "domains" are NVLink islands or NUMA nodes inside a node. */
        printf("candidates %-13s %-11s %-7s %-14s %s\n", "ulysses x ring", "heads q/kv", "dummies", "inter-node",
               "inter-domain (units)");
        for (uint32_t i = 0; i < p->ncand; i++) {
            const sp_place_cand_t *c = &p->cand[i];
            char deg[32], heads[32], pct[16];
            snprintf(deg, sizeof deg, "%u x %u", c->ulysses, c->ring);
            if (c->q_heads == 0) {
                printf("           %-13s %s\n", deg, c->refused);
                continue;
            }
            snprintf(heads, sizeof heads, "%u/%u", c->q_heads, c->kv_heads);
            snprintf(pct, sizeof pct, "+%u%%", c->dummy_pct);
            const char *verdict = c->ulysses == p->ulysses ? "chosen" : c->refused ? c->refused : NULL;
            printf("           %-13s %-11s %-7s %-14" PRIu64 " ", deg, heads, pct, c->inter_node);
            if (verdict != NULL)
                printf("%-14" PRIu64 " %s\n", c->inter_domain, verdict);
            else
                printf("%" PRIu64 "\n", c->inter_domain);
        }
    }
    if (bytes)
        printf("traffic    per training step (forward and backward) of %" PRIu64 " attention layer%s, batch %" PRIu64
               ", seq %" PRIu64 " (%" PRIu64 " rows a rank), hidden %" PRIu64 " (head dim %" PRIu64 "), %s;\n"
               "           unit = one head of one rank's rows = %" PRIu64 " bytes\n",
               a->layers, a->layers == 1 ? "" : "s", a->batch, a->seq, (a->seq + p->sp - 1) / p->sp, a->hidden,
               a->hidden / p->heads, a->dtype, tr->unit_bytes);
    else
        printf("traffic    per training step of one attention layer, in units of one head of one rank's rows\n"
               "           (give --seq and --hidden for bytes)\n");
    char u[64], r[64], t[64];
    static const char *const link[SP_LINKS] = { "intra-node", "inter-node" };
    printf("           %-12s %-28s %-28s %s\n", "", "ulysses (all-to-all)", "ring (k, v / dk, dv)", "total");
    for (int l = 0; l < SP_LINKS; l++) {
        human(tr->ulysses[l], u, sizeof u);
        human(tr->ring[l], r, sizeof r);
        human(tr->total[l], t, sizeof t);
        if (!bytes) {
            snprintf(u, sizeof u, "%" PRIu64, tr->ulysses[l]);
            snprintf(r, sizeof r, "%" PRIu64, tr->ring[l]);
            snprintf(t, sizeof t, "%" PRIu64, tr->total[l]);
        }
        printf("           %-12s %-28s %-28s %s\n", link[l], u, r, t);
    }
    if (bytes) {
        human(tr->rank_max[SP_LINK_INTRA], u, sizeof u);
        human(tr->rank_max[SP_LINK_INTER], r, sizeof r);
    } else {
        snprintf(u, sizeof u, "%" PRIu64, tr->rank_max[SP_LINK_INTRA]);
        snprintf(r, sizeof r, "%" PRIu64, tr->rank_max[SP_LINK_INTER]);
    }
    printf("           busiest rank: %s intra-node, %s inter-node\n", u, r);
    printf("planned    in %.2f ms\n", ms);
    free(buf);
}

static void json_group(const sp_place_t *p, int kind, uint32_t *buf)
{
    uint32_t n = sp_place_group(p, kind, 0, buf);
    putchar('[');
    for (uint32_t i = 0; i < n; i++)
        printf("%s%u", i ? "," : "", buf[i]);
    putchar(']');
}

static void json_plan(const sp_place_t *p, const sp_topo_t *topo, const plan_args_t *a, const sp_place_traffic_t *tr,
                      bool bytes, double ms)
{
    uint32_t *buf = malloc(p->world * sizeof *buf);
    if (buf == NULL)
        return;
    printf("{\"nodes\":%u,", topo->nnodes);
    if (a->topology != NULL) {
        printf("\"topology\":");
        spctl_json_string(a->topology);
    } else {
        printf("\"gpus_per_node\":%" PRIu64 ",\"numa_per_node\":%u,\"island_size\":%d", a->gpus,
               topo->nodes[0].nnuma, topo->nodes[0].gpus[0].island < 0 ? 0 : (int)(a->have_island ? a->island : a->gpus));
    }
    printf(",\"order\":\"%s\",\"world\":%u,\"dp\":%u,\"sp\":%u,\"ulysses\":%u,\"ring\":%u,\"heads\":%u,"
           "\"kv_heads\":%u,\"chosen\":%s,\"q_heads_per_rank\":%u,\"kv_heads_per_rank\":%u,\"dummy_heads\":%u,"
           "\"kv_dummy_heads\":%u,\"explain\":", a->round_robin ? "round-robin" : "block", p->world, p->dp, p->sp,
           p->ulysses, p->ring, p->heads, p->kv_heads, p->chosen ? "true" : "false", p->q_local, p->kv_local,
           p->q_dummies, p->kv_dummies);
    spctl_json_string(p->explain);
    printf(",\"ulysses_groups\":%u,\"ulysses_groups_across_nodes\":%u,\"rings\":%u,\"ring_hops\":%u,"
           "\"ring_hops_between_nodes\":%u,\"first_ulysses_group\":", sp_place_ngroups(p, SP_PLACE_ULYSSES),
           p->ulysses_spanning, sp_place_ngroups(p, SP_PLACE_RING), p->ring_hops, p->ring_hops_inter);
    json_group(p, SP_PLACE_ULYSSES, buf);
    printf(",\"first_ring\":");
    json_group(p, SP_PLACE_RING, buf);
    printf(",\"first_dp_group\":");
    json_group(p, SP_PLACE_DP, buf);
    printf(",\"candidates\":[");
    for (uint32_t i = 0; i < p->ncand; i++) {
        const sp_place_cand_t *c = &p->cand[i];
        printf("%s{\"ulysses\":%u,\"ring\":%u,\"q_heads\":%u,\"kv_heads\":%u,\"dummy_pct\":%u,"
               "\"groups_across_nodes\":%u,\"inter_node_units\":%" PRIu64 ",\"inter_domain_units\":%" PRIu64
               ",\"chosen\":%s,\"refused\":", i ? "," : "", c->ulysses, c->ring, c->q_heads, c->kv_heads, c->dummy_pct,
               c->spanning, c->inter_node, c->inter_domain, c->ulysses == p->ulysses ? "true" : "false");
        if (c->refused)
            spctl_json_string(c->refused);
        else
            printf("null");
        putchar('}');
    }
    printf("],\"traffic\":{\"unit\":\"%s\"", bytes ? "bytes" : "head-rows");
    if (bytes)
        printf(",\"batch\":%" PRIu64 ",\"seq\":%" PRIu64 ",\"hidden\":%" PRIu64 ",\"layers\":%" PRIu64
               ",\"dtype\":\"%s\",\"unit_bytes\":%" PRIu64, a->batch, a->seq, a->hidden, a->layers, a->dtype,
               tr->unit_bytes);
    static const char *const link[SP_LINKS] = { "intra_node", "inter_node" };
    for (int l = 0; l < SP_LINKS; l++)
        printf(",\"ulysses_%s\":%" PRIu64 ",\"ring_%s\":%" PRIu64 ",\"%s\":%" PRIu64 ",\"busiest_rank_%s\":%" PRIu64,
               link[l], tr->ulysses[l], link[l], tr->ring[l], link[l], tr->total[l], link[l], tr->rank_max[l]);
    printf("},\"plan_ms\":%.3f}\n", ms);
    free(buf);
}

/* ---------------------------------------------------------------- the command */

int spctl_plan(int argc, char **argv, int json)
{
    plan_args_t a;
    int rc = parse_args(argc, argv, &a);
    if (rc != 0)
        return rc;
    a.json |= json;

    sp_topo_t *topo = plan_cluster(&a);
    if (topo == NULL)
        return 1;
    uint32_t world;
    sp_place_loc_t *locs = plan_ranks(topo, &a, &world);
    sp_place_t *p = NULL;
    rc = 1;
    if (locs == NULL)
        goto out;

    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    sp_place_spec_t spec = { .sp = (uint32_t)(a.sp ? a.sp : world), .ulysses = (uint32_t)a.ulysses,
                             .ring = (uint32_t)a.ring, .heads = (uint32_t)a.heads, .kv_heads = (uint32_t)a.kv };
    char err[512];
    spc_status_t st = sp_place_compute(topo, locs, world, &spec, &p, err, sizeof err);
    if (st != SPC_OK) {
        fprintf(stderr, "spctl plan: refused: %s\n", err);
        goto out;
    }
    sp_place_dims_t dims = { .batch = a.batch, .seq = a.seq, .hidden = a.hidden, .layers = a.layers,
                             .dtype_bytes = a.dtype_bytes };
    sp_place_traffic_t tr;
    if (sp_place_traffic(p, a.have_seq ? &dims : NULL, &tr, err, sizeof err) != SPC_OK) {
        fprintf(stderr, "spctl plan: %s\n", err);
        goto out;
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double ms = (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
    if (a.json)
        json_plan(p, topo, &a, &tr, a.have_seq, ms);
    else
        text_plan(p, topo, locs, &a, &tr, a.have_seq, ms);
    rc = 0;
out:
    sp_place_free(p);
    free(locs);
    sp_topo_free(topo);
    return rc;
}
