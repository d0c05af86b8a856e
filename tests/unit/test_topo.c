/* The topology model and its text format (common/sp_topo.c): a round trip that
 * changes nothing, bad lines refused naming the line, `cluster` expansion. */
#include <sys/stat.h>

#include "sp_test.h"
#include "sp_topo.h"

static char *dump_text(const sp_topo_t *t)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    CHECK(f != NULL);
    sp_topo_dump(t, f);
    CHECK(fclose(f) == 0);
    return buf;
}

static sp_topo_t *parse_ok(const char *text)
{
    sp_topo_t *t = NULL;
    char err[512] = "";
    spc_status_t st = sp_topo_parse(text, "t", &t, err, sizeof err);
    if (st != SPC_OK)
        SP_FAIL("parse: %s: %s", spc_status_name(st), err);
    CHECK(t != NULL);
    return t;
}

/* Hand-written text with every feature, read, dumped, read back, dumped again. */
static void test_roundtrip(void)
{
    const char *text =
        "# two nodes, written by hand\n"
        "\n"
        "node a01.example   # the first\n"
        "numa 0 cpus 0-7,16-23\n"
        "numa 1 cpus 8-15,24-31\n"
        "numa 2\n"                                  /* memory only */
        "nic eth0 numa 0 speed 25000\n"
        "nic ib0 speed 400000 numa 1\n"             /* keys in any order */
        "nic bond0\n"
        "gpu 0 bus 0000:1B:00.0 numa 0 island 0\n"  /* upper case, as CUDA writes it */
        "gpu 1 bus 0000:1c:00.0 numa 0 island 0\n"
        "gpu 2 numa 1\n"
        "  gpu 3\tisland 1  \n"
        "node b\n"
        "numa 3 cpus 5\n";
    const char *canonical =
        "node a01.example\n"
        "numa 0 cpus 0-7,16-23\n"
        "numa 1 cpus 8-15,24-31\n"
        "numa 2\n"
        "nic eth0 numa 0 speed 25000\n"
        "nic ib0 numa 1 speed 400000\n"
        "nic bond0\n"
        "gpu 0 bus 0000:1b:00.0 numa 0 island 0\n"
        "gpu 1 bus 0000:1c:00.0 numa 0 island 0\n"
        "gpu 2 numa 1\n"
        "gpu 3 island 1\n"
        "node b\n"
        "numa 3 cpus 5\n";

    sp_topo_t *t = parse_ok(text);
    CHECK_EQ(t->nnodes, 2);
    const sp_topo_node_t *a = sp_topo_find_node(t, "a01.example");
    CHECK(a != NULL && a == &t->nodes[0]);
    CHECK_EQ(a->nnuma, 3);
    CHECK_EQ(a->nnics, 3);
    CHECK_EQ(a->ngpus, 4);
    CHECK_STREQ(a->numa[1].cpus, "8-15,24-31");
    CHECK_STREQ(a->numa[2].cpus, "");
    CHECK_EQ(a->nics[1].numa, 1);
    CHECK_EQ(a->nics[1].speed_mbps, 400000);
    CHECK_EQ(a->nics[2].numa, -1);
    CHECK_EQ(a->nics[2].speed_mbps, -1);
    CHECK_STREQ(a->gpus[0].bus, "0000:1b:00.0");
    CHECK_EQ(a->gpus[2].island, -1);
    CHECK_EQ(sp_topo_find_gpu(a, 3)->island, 1);
    CHECK_EQ(sp_topo_find_gpu(a, 3)->numa, -1);
    CHECK(sp_topo_find_gpu(a, 4) == NULL);
    CHECK(sp_topo_find_numa(a, 2) != NULL && sp_topo_find_numa(a, 3) == NULL);
    CHECK(sp_topo_find_node(t, "c") == NULL);

    char *d1 = dump_text(t);
    CHECK_STREQ(d1, canonical);
    sp_topo_t *t2 = parse_ok(d1);
    char *d2 = dump_text(t2);
    CHECK_STREQ(d2, d1);
    free(d1);
    free(d2);
    sp_topo_free(t);
    sp_topo_free(t2);

    /* Empty text is an empty topology; free accepts NULL. */
    t = parse_ok("# nothing\n\n");
    CHECK_EQ(t->nnodes, 0);
    sp_topo_free(t);
    sp_topo_free(NULL);
}

typedef struct bad {
    const char *text;
    spc_status_t st;
    const char *msg;      /* the whole message must contain this */
} bad_t;

static void test_bad_lines(void)
{
    static char many[4096];
    size_t off = (size_t)snprintf(many, sizeof many, "node a\n");
    for (int g = 0; g <= SP_TOPO_MAX_GPUS; g++)
        off += (size_t)snprintf(many + off, sizeof many - off, "gpu %d\n", g);
    static char longname[128];
    snprintf(longname, sizeof longname, "node %0*d\n", SP_TOPO_NAME_MAX, 7);

    const bad_t bad[] = {
        { "node a\nnuma x cpus 0-1\n", SPC_ERR_INVALID_ARG, "t:2: numa 'x' is not an id in [0, 65535]" },
        { "numa 0 cpus 0\n", SPC_ERR_INVALID_ARG, "t:1: 'numa' line outside a node" },
        { "node a\nnuma 0 cpus 3-1\n", SPC_ERR_INVALID_ARG, "t:2: numa 0: cpus '3-1' is not a CPU list" },
        { "node a\nnuma 0 cpus 1,,2\n", SPC_ERR_INVALID_ARG, "t:2: numa 0: cpus '1,,2' is not a CPU list" },
        { "node a\nnuma 0\nnuma 0\n", SPC_ERR_INVALID_ARG, "t:3: numa 0: node a has that NUMA node already" },
        { "node a\n\nnode a\n", SPC_ERR_INVALID_ARG, "t:3: node a: a node of that name exists already" },
        { "node a b\n", SPC_ERR_INVALID_ARG, "t:1: expected 'node NAME'" },
        { longname, SPC_ERR_INVALID_ARG, "t:1: node name '0000" },
        { "node a\ngpu 0 numa 1\n", SPC_ERR_INVALID_ARG,
          "t:2: gpu 0: numa 1 is not a NUMA node of node a (declare it with a numa line first)" },
        { "node a\ngpu 0 bus zz:00\n", SPC_ERR_INVALID_ARG, "t:2: gpu 0: bus 'zz:00' is not a PCI bus id" },
        { "node a\ngpu 0\ngpu 0\n", SPC_ERR_INVALID_ARG, "t:3: gpu 0: node a has that GPU already" },
        { "node a\ngpu -1\n", SPC_ERR_INVALID_ARG, "t:2: gpu '-1' is not an index" },
        { "node a\nnic eth0 speed fast\n", SPC_ERR_INVALID_ARG,
          "t:2: speed 'fast' is not an integer in [1, 100000000]" },
        { "node a\nnic eth0 numa\n", SPC_ERR_INVALID_ARG, "t:2: 'numa' has no value" },
        { "node a\nnic eth0\nnic eth0\n", SPC_ERR_INVALID_ARG, "t:3: nic eth0: node a has that NIC already" },
        { "node a\ngpu 0 color red\n", SPC_ERR_INVALID_ARG,
          "t:2: unknown key 'color' (expected: bus numa island)" },
        { "node a\n\n# c\ngpu 0 island 1 island 2\n", SPC_ERR_INVALID_ARG, "t:4: 'island' given twice" },
        { "node a\nnic\n", SPC_ERR_INVALID_ARG, "t:2: 'nic' needs a value" },
        { "frob 1\n", SPC_ERR_INVALID_ARG, "t:1: unknown keyword 'frob' (node, numa, nic, gpu, p2p, cluster)" },
        { "cluster nodes 0 gpus-per-node 8\n", SPC_ERR_INVALID_ARG, "t:1: nodes '0' is not an integer in [1, 16384]" },
        { "cluster nodes 2\n", SPC_ERR_INVALID_ARG, "t:1: expected 'cluster nodes N gpus-per-node G ...'" },
        { "cluster nodes 2 gpus-per-node 65\n", SPC_ERR_INVALID_ARG,
          "t:1: gpus-per-node '65' is not an integer in [0, 64]" },
        { "node n1\ncluster nodes 4 gpus-per-node 1 prefix n\n", SPC_ERR_INVALID_ARG,
          "t:2: cluster: node n1 exists already (use another prefix)" },
        { "cluster nodes 2 gpus-per-node 1\ngpu 5\n", SPC_ERR_INVALID_ARG, "t:2: 'gpu' line outside a node" },
        { "cluster nodes 10000 gpus-per-node 1\ncluster nodes 10000 gpus-per-node 1 prefix x\n", SPC_ERR_LIMIT,
          "t:2: cluster: 10000 nodes (with the 10000 already there) is outside [1, 16384]" },
        { many, SPC_ERR_LIMIT, "t:66: gpu 64: node a has 64 GPUs already" },
        { "node a\ngpu 0\np2p 0 1\n", SPC_ERR_INVALID_ARG,
          "t:3: p2p 0 1: node a has no GPU 1 (declare it with a gpu line first)" },
        { "node a\np2p 0 1 link nvl\ngpu 0\ngpu 1\n", SPC_ERR_INVALID_ARG, "t:2: p2p 0 1: node a has no GPU 0" },
        { "node a\ngpu 0\np2p 0 0\n", SPC_ERR_INVALID_ARG, "t:3: p2p 0 0: a GPU and itself are not a pair" },
        { "node a\ngpu 0\ngpu 1\np2p 0 1\np2p 0 1 access 1\n", SPC_ERR_INVALID_ARG,
          "t:5: p2p 0 1: node a has that pair already" },
        { "node a\ngpu 0\ngpu 1\np2p 0 1 link nvlink\n", SPC_ERR_INVALID_ARG,
          "t:4: link 'nvlink' is none of nvl, pix, pxb, phb, sys" },
        { "node a\ngpu 0\ngpu 1\np2p 0 1 access yes\n", SPC_ERR_INVALID_ARG,
          "t:4: access 'yes' is not an integer in [0, 1]" },
        { "node a\ngpu 0\ngpu 1\np2p 0 1 atomics 2\n", SPC_ERR_INVALID_ARG,
          "t:4: atomics '2' is not an integer in [0, 1]" },
        { "node a\ngpu 0\ngpu 1\np2p 0 1 perf-rank -1\n", SPC_ERR_INVALID_ARG,
          "t:4: perf-rank '-1' is not an integer in [0, 65535]" },
        { "node a\ngpu 0\ngpu 1\np2p 0\n", SPC_ERR_INVALID_ARG,
          "t:4: expected 'p2p FROM TO [link L] [access 0|1] [perf-rank R] [atomics 0|1]'" },
        { "node a\ngpu 0\ngpu 1\np2p 0 x\n", SPC_ERR_INVALID_ARG, "t:4: p2p '0' 'x': the GPUs must be indexes" },
        { "node a\ngpu 0\ngpu 1\np2p 0 1 speed 5\n", SPC_ERR_INVALID_ARG,
          "t:4: unknown key 'speed' (expected: link access perf-rank atomics)" },
        { "node a\ngpu 0\ngpu 1\np2p 0 1 access\n", SPC_ERR_INVALID_ARG, "t:4: 'access' has no value" },
        { "p2p 0 1\n", SPC_ERR_INVALID_ARG, "t:1: 'p2p' line outside a node" },
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        sp_topo_t *t = (sp_topo_t *)&bad;   /* must stay untouched */
        char err[512] = "";
        spc_status_t st = sp_topo_parse(bad[i].text, "t", &t, err, sizeof err);
        if (st != bad[i].st || strstr(err, bad[i].msg) == NULL)
            SP_FAIL("case %zu: got %s \"%s\", expected %s with \"%s\"", i, spc_status_name(st), err,
                    spc_status_name(bad[i].st), bad[i].msg);
        CHECK(t == (sp_topo_t *)&bad);
    }
}

/*
 * p2p lines: read in any key order, dumped after the gpu lines in the order
 * read, read back to the same text; the link between two GPUs (the slower
 * direction, else what the gpu lines imply) and the route an op takes.
 */
static void test_p2p(void)
{
    const char *text =
        "node box\n"
        "numa 0\n"
        "numa 1\n"
        "gpu 0 numa 0 island 0\n"
        "gpu 1 numa 0 island 0\n"
        "gpu 2 numa 0\n"
        "gpu 3 numa 1\n"
        "p2p 0 1 atomics 1 perf-rank 0 access 1 link nvl\n"
        "p2p 1 0 link nvl access 1\n"
        "p2p 0 2 link pix access 1 perf-rank 1 atomics 0\n"
        "p2p 2 0 link pxb\n"
        "p2p 2 3 link sys access 0\n"
        "p2p 1 2\n";
    const char *canonical =
        "node box\n"
        "numa 0\n"
        "numa 1\n"
        "gpu 0 numa 0 island 0\n"
        "gpu 1 numa 0 island 0\n"
        "gpu 2 numa 0\n"
        "gpu 3 numa 1\n"
        "p2p 0 1 link nvl access 1 perf-rank 0 atomics 1\n"
        "p2p 1 0 link nvl access 1\n"
        "p2p 0 2 link pix access 1 perf-rank 1 atomics 0\n"
        "p2p 2 0 link pxb\n"
        "p2p 2 3 link sys access 0\n"
        "p2p 1 2\n";
    sp_topo_t *t = parse_ok(text);
    const sp_topo_node_t *n = &t->nodes[0];
    CHECK_EQ(n->np2p, 6);
    const sp_topo_p2p_t *p = sp_topo_find_p2p(n, 0, 2);
    CHECK(p != NULL);
    CHECK_EQ(p->link, SP_TOPO_LINK_PIX);
    CHECK_EQ(p->access, 1);
    CHECK_EQ(p->perf_rank, 1);
    CHECK_EQ(p->atomics, 0);
    p = sp_topo_find_p2p(n, 1, 2);
    CHECK(p != NULL && p->link == SP_TOPO_LINK_UNKNOWN && p->access == -1 && p->perf_rank == -1 && p->atomics == -1);
    CHECK(sp_topo_find_p2p(n, 3, 2) == NULL);
    char *d1 = dump_text(t);
    CHECK_STREQ(d1, canonical);
    sp_topo_t *t2 = parse_ok(d1);
    char *d2 = dump_text(t2);
    CHECK_STREQ(d2, d1);
    free(d1);
    free(d2);
    sp_topo_free(t2);

    /* Links: both directions say, the slower counts; one says; none says: the gpu lines. */
    CHECK_EQ(sp_topo_gpu_link(n, 0, 1), SP_TOPO_LINK_NVL);
    CHECK_EQ(sp_topo_gpu_link(n, 0, 2), SP_TOPO_LINK_PXB);
    CHECK_EQ(sp_topo_gpu_link(n, 2, 0), SP_TOPO_LINK_PXB);
    CHECK_EQ(sp_topo_gpu_link(n, 3, 2), SP_TOPO_LINK_SYS);
    CHECK_EQ(sp_topo_gpu_link(n, 1, 2), SP_TOPO_LINK_PHB);   /* the p2p line says nothing: one NUMA node */
    CHECK_EQ(sp_topo_gpu_link(n, 1, 3), SP_TOPO_LINK_SYS);   /* two NUMA nodes */
    CHECK_EQ(sp_topo_gpu_link(n, 1, 1), SP_TOPO_LINK_UNKNOWN);
    CHECK_EQ(sp_topo_gpu_link(n, 1, 9), SP_TOPO_LINK_UNKNOWN);
    CHECK_STREQ(sp_topo_link_name(SP_TOPO_LINK_PHB), "phb");
    CHECK_STREQ(sp_topo_link_name(SP_TOPO_LINK_UNKNOWN), "unknown");

    /* Routes. */
    char why[256];
    CHECK_EQ(sp_topo_p2p_route(n, 0, 1, why, sizeof why), SP_TOPO_ROUTE_PEER);
    CHECK_STREQ(why, "peer access over NVLink (nvl, performance rank 0, native atomics)");
    CHECK_EQ(sp_topo_p2p_route(n, 0, 2, why, sizeof why), SP_TOPO_ROUTE_PEER);
    CHECK_STREQ(why, "peer access over PCIe through PCIe bridges below one root port (pxb, performance rank 1, "
                     "no native atomics)");
    CHECK_EQ(sp_topo_p2p_route(n, 2, 3, why, sizeof why), SP_TOPO_ROUTE_STAGED);
    CHECK_STREQ(why, "staged through host memory: GPU 2 cannot map GPU 3's memory (no peer access; they are joined "
                     "by the link between CPU sockets, sys)");
    CHECK_EQ(sp_topo_p2p_route(n, 2, 0, why, sizeof why), SP_TOPO_ROUTE_UNKNOWN);
    CHECK_STREQ(why, "unknown: the topology does not say whether GPU 2 can map GPU 0's memory");
    CHECK_EQ(sp_topo_p2p_route(n, 3, 2, NULL, 0), SP_TOPO_ROUTE_UNKNOWN);
    sp_topo_free(t);

    /* Bus ids as drivers write them, found as the format writes them. */
    char bus[SP_TOPO_BUS_MAX];
    CHECK(sp_topo_bus_id("00000000:1B:00.0", bus));
    CHECK_STREQ(bus, "0000:1b:00.0");
    CHECK(sp_topo_bus_id("0000:9C:00.0", bus));
    CHECK_STREQ(bus, "0000:9c:00.0");
    CHECK(!sp_topo_bus_id("", bus));
    CHECK(!sp_topo_bus_id("0000:1b:00.0/../x", bus));
    CHECK(!sp_topo_bus_id("0000:0000:0000:0000:0000:0000:00.0", bus));
    CHECK_STREQ(bus, "0000:9c:00.0");   /* untouched */
    t = parse_ok("node n\ngpu 3 bus 0000:9c:00.0\ngpu 4\n");
    CHECK_EQ(sp_topo_find_gpu_bus(&t->nodes[0], bus)->index, 3);
    CHECK(sp_topo_find_gpu_bus(&t->nodes[0], "") == NULL);
    CHECK(sp_topo_find_gpu_bus(&t->nodes[0], "0000:1b:00.0") == NULL);
    sp_topo_free(t);

    /* Peer access over an unknown path. */
    t = parse_ok("node n\ngpu 0\ngpu 1\np2p 0 1 access 1\n");
    CHECK_EQ(sp_topo_p2p_route(&t->nodes[0], 0, 1, why, sizeof why), SP_TOPO_ROUTE_PEER);
    CHECK_STREQ(why, "peer access (the link is unknown)");
    sp_topo_free(t);
}

static void test_cluster(void)
{
    sp_topo_t *t = parse_ok("cluster nodes 512 gpus-per-node 8 numa-per-node 2 island-size 4 cpus-per-numa 16 "
                            "nics-per-node 4 nic-speed 200000\n"
                            "node login\n"
                            "numa 0 cpus 0-3\n"
                            "cluster nodes 3 gpus-per-node 3 prefix small-\n");
    CHECK_EQ(t->nnodes, 512 + 1 + 3);
    CHECK_STREQ(t->nodes[0].name, "node0");
    CHECK_STREQ(t->nodes[511].name, "node511");
    CHECK_STREQ(t->nodes[512].name, "login");
    CHECK_STREQ(t->nodes[515].name, "small-2");
    const sp_topo_node_t *n = &t->nodes[300];
    CHECK_EQ(n->ngpus, 8);
    CHECK_EQ(n->nnuma, 2);
    CHECK_EQ(n->nnics, 4);
    /* GPUs 0-3 on NUMA 0 and island 0, 4-7 on NUMA 1 and island 1; NICs likewise. */
    for (int g = 0; g < 8; g++) {
        CHECK_EQ(n->gpus[g].numa, g / 4);
        CHECK_EQ(n->gpus[g].island, g / 4);
        CHECK_STREQ(n->gpus[g].bus, "");
    }
    CHECK_EQ(n->nics[1].numa, 0);
    CHECK_EQ(n->nics[2].numa, 1);
    CHECK_EQ(n->nics[3].speed_mbps, 200000);
    CHECK_STREQ(n->numa[1].cpus, "16-31");
    /* Three GPUs on one NUMA node, no NVLink, no NICs, no CPUs given. */
    const sp_topo_node_t *s = sp_topo_find_node(t, "small-0");
    CHECK(s != NULL);
    CHECK_EQ(s->ngpus, 3);
    CHECK_EQ(s->nnics, 0);
    CHECK_EQ(s->gpus[2].numa, 0);
    CHECK_EQ(s->gpus[2].island, -1);

    /* The dump writes every node out; it reads back to the same dump. */
    char *d1 = dump_text(t);
    const char *node7 =
        "node node7\n"
        "numa 0 cpus 0-15\n"
        "numa 1 cpus 16-31\n"
        "nic nic0 numa 0 speed 200000\n"
        "nic nic1 numa 0 speed 200000\n"
        "nic nic2 numa 1 speed 200000\n"
        "nic nic3 numa 1 speed 200000\n"
        "gpu 0 numa 0 island 0\n"
        "gpu 1 numa 0 island 0\n"
        "gpu 2 numa 0 island 0\n"
        "gpu 3 numa 0 island 0\n"
        "gpu 4 numa 1 island 1\n"
        "gpu 5 numa 1 island 1\n"
        "gpu 6 numa 1 island 1\n"
        "gpu 7 numa 1 island 1\n"
        "node node8\n";
    CHECK_CONTAINS(d1, node7);
    CHECK_CONTAINS(d1, "node login\nnuma 0 cpus 0-3\nnode small-0\nnuma 0\ngpu 0 numa 0\n");
    sp_topo_t *t2 = parse_ok(d1);
    char *d2 = dump_text(t2);
    CHECK_STREQ(d2, d1);
    free(d1);
    free(d2);
    sp_topo_free(t2);
    sp_topo_free(t);

    /* The limits themselves are accepted: 16384 nodes of 64 GPUs. */
    uint64_t t0 = sp_test_now_ms();
    t = parse_ok("cluster nodes 16384 gpus-per-node 64 numa-per-node 8 island-size 8\n");
    CHECK_EQ(t->nnodes, SP_TOPO_MAX_NODES);
    CHECK_EQ(t->nodes[16383].ngpus, SP_TOPO_MAX_GPUS);
    CHECK_EQ(t->nodes[16383].gpus[63].island, 7);
    sp_topo_free(t);
    printf("16384 x 64 GPUs expanded in %" PRIu64 " ms\n", sp_test_now_ms() - t0);
}

static void test_files(void)
{
    char dir[] = "/tmp/sp-topo-XXXXXX", path[128], err[512];
    sp_topo_t *t = NULL;
    CHECK(mkdtemp(dir) != NULL);
    snprintf(path, sizeof path, "%s/none", dir);
    CHECK_EQ(sp_topo_load(path, &t, err, sizeof err), SPC_ERR_NOT_FOUND);
    CHECK_CONTAINS(err, path);
    CHECK_CONTAINS(err, "No such file");

    snprintf(path, sizeof path, "%s/topo", dir);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    fputs("node x\nnuma 0 cpus 0-1\ngpu 0 numa 0\n", f);
    fclose(f);
    CHECK_EQ(sp_topo_load(path, &t, err, sizeof err), SPC_OK);
    CHECK_EQ(t->nnodes, 1);
    CHECK_EQ(t->nodes[0].gpus[0].numa, 0);
    sp_topo_free(t);

    f = fopen(path, "w");
    fputs("node x\nnuma 0 cpus 0-1\ngpu 0 numa 4\n", f);
    fclose(f);
    t = NULL;
    CHECK_EQ(sp_topo_load(path, &t, err, sizeof err), SPC_ERR_INVALID_ARG);
    char want[256];
    snprintf(want, sizeof want, "%s:3: gpu 0: numa 4 is not a NUMA node of node x", path);
    CHECK_CONTAINS(err, want);
    CHECK(t == NULL);
    unlink(path);
    rmdir(dir);
}

int main(void)
{
    test_roundtrip();
    printf("round trip: ok\n");
    test_bad_lines();
    printf("bad lines: ok\n");
    test_p2p();
    printf("p2p: ok\n");
    test_cluster();
    printf("cluster: ok\n");
    test_files();
    printf("files: ok\n");
    return 0;
}
