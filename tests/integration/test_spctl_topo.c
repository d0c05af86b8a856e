/*
 * `spctl topo` against a real spd: a daemon started with topology_file answers
 * with that file's node; one without it answers with what it discovered, which
 * loads back, and which a second daemon then serves from the file unchanged. A
 * bad topology file stops spd at start, naming the line.
 */
#include <sys/stat.h>

#include "sp_test.h"
#include "sp_topo.h"

static char out[65536];

static void write_file(const char *path, const char *text)
{
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    fputs(text, f);
    CHECK(fclose(f) == 0);
}

/* The topology spctl printed, comment lines and all, parsed; its one node. */
static sp_topo_t *parse_out(void)
{
    sp_topo_t *t;
    char err[512];
    if (sp_topo_parse(out, "spctl topo", &t, err, sizeof err) != SPC_OK)
        SP_FAIL("spctl topo printed what does not load: %s\n%s", err, out);
    CHECK_EQ(t->nnodes, 1);
    return t;
}

static void test_from_file(const char *dir)
{
    /* Two nodes: spd serves the one named like it. */
#define NODE_B                                    \
        "node gpu-b\n"                            \
        "numa 0 cpus 0-47,96-143\n"               \
        "numa 1 cpus 48-95,144-191\n"             \
        "nic ib0 numa 0 speed 400000\n"           \
        "nic ib1 numa 1 speed 400000\n"           \
        "nic eno1\n"                              \
        "gpu 0 bus 0000:18:00.0 numa 0 island 0\n" \
        "gpu 1 bus 0000:2a:00.0 numa 0 island 0\n" \
        "gpu 2 bus 0000:9a:00.0 numa 1 island 0\n" \
        "gpu 3 bus 0000:ab:00.0 numa 1 island 0\n" \
        "p2p 0 1 link nvl access 1 perf-rank 0 atomics 1\n" \
        "p2p 2 3 link sys access 0\n"
    /* spd keeps the node named like it from a file of several, as written. */
    const char *cluster = "# a cluster file shared by every node\n"
                          "node gpu-a\nnuma 0 cpus 0-31\ngpu 0 bus 0000:1b:00.0 numa 0 island 0\n" NODE_B;
    const char *node_b = NODE_B;
    char path[256], set_file[300], want[1024];
    snprintf(path, sizeof path, "%s/cluster.topo", dir);
    write_file(path, cluster);
    snprintf(set_file, sizeof set_file, "topology_file=%s", path);

    sp_test_daemon_t d;
    const char *args[] = { "--set", set_file, "--set", "node_name=gpu-b", NULL };
    sp_test_daemon_start(&d, args);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s topo", sp_test_spctl_bin()), 0);
    printf("$ spctl topo   (topology_file=%s)\n%s", path, out);
    snprintf(want, sizeof want, "# node gpu-b: file %s\n%s", path, node_b);
    CHECK_STREQ(out, want);

    CHECK_EQ(sp_test_run(out, sizeof out, "%s topo --json", sp_test_spctl_bin()), 0);
    printf("$ spctl topo --json\n%s", out);
    snprintf(want, sizeof want, "{\"node\":\"gpu-b\",\"source\":\"file\",\"file\":\"%s\",", path);
    CHECK_CONTAINS(out, want);
    CHECK_CONTAINS(out, "\"numa\":[{\"id\":0,\"cpus\":\"0-47,96-143\"},{\"id\":1,\"cpus\":\"48-95,144-191\"}],");
    CHECK_CONTAINS(out, "\"nics\":[{\"name\":\"ib0\",\"numa\":0,\"speed_mbps\":400000},{\"name\":\"ib1\",\"numa\":1,"
                        "\"speed_mbps\":400000},{\"name\":\"eno1\",\"numa\":-1,\"speed_mbps\":-1}],");
    CHECK_CONTAINS(out, "{\"index\":3,\"bus\":\"0000:ab:00.0\",\"numa\":1,\"island\":0}],");
    CHECK_CONTAINS(out, "\"p2p\":[{\"from\":0,\"to\":1,\"link\":\"nvl\",\"access\":1,\"perf_rank\":0,\"atomics\":1},"
                        "{\"from\":2,\"to\":3,\"link\":\"sys\",\"access\":0,\"perf_rank\":-1,\"atomics\":-1}]}\n");
    char first[4096];
    snprintf(first, sizeof first, "%s", out);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --json topo", sp_test_spctl_bin()), 0);
    CHECK_STREQ(out, first);

    /* The query topic itself, as any program sees it. */
    spc_handle_t *h = sp_test_attach();
    spc_query_result_t *r;
    CHECK_OK(h, spc_query(h, "topo", "", &r));
    CHECK_EQ(spc_query_records(r), 1);
    CHECK_EQ(spc_query_int(r, 0, (size_t)spc_query_find(r, 0, "gpus")), 4);
    CHECK_EQ(spc_query_int(r, 0, (size_t)spc_query_find(r, 0, "nics")), 3);
    CHECK_EQ(spc_query_int(r, 0, (size_t)spc_query_find(r, 0, "numa_nodes")), 2);
    CHECK_STREQ(spc_query_str(r, 0, (size_t)spc_query_find(r, 0, "topology")), node_b);
    spc_query_free(r);
    spc_detach(h);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);

    /* A file whose nodes are all someone else's is refused at start, as a
     * configuration error (EX_CONFIG). */
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --set socket=%s/x.sock --set node_name=gpu-z --set %s 2>&1",
                         sp_test_spd_bin(), dir, set_file), 78);
    CHECK_CONTAINS(out, "cluster.topo: 2 nodes and none named 'gpu-z'");

    /* So is a bad line, by its number. */
    snprintf(path, sizeof path, "%s/bad.topo", dir);
    write_file(path, "node x\nnuma 0\ngpu 0 numa 0 island nine\n");
    CHECK_EQ(sp_test_run(out, sizeof out, "%s --set socket=%s/x.sock --set topology_file=%s 2>&1",
                         sp_test_spd_bin(), dir, path), 78);
    CHECK_CONTAINS(out, "bad.topo:3: island 'nine' is not an integer");
}

static void test_discovered(const char *dir)
{
    sp_test_daemon_t d;
    const char *args[] = { "--set", "node_name=disc-node", NULL };
    sp_test_daemon_start(&d, args);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s topo", sp_test_spctl_bin()), 0);
    printf("$ spctl topo   (discovered)\n%s", out);
    CHECK(strncmp(out, "# node disc-node: discovered\nnode disc-node\nnuma ", 49) == 0);
    sp_topo_t *t = parse_out();
    CHECK_STREQ(t->nodes[0].name, "disc-node");
    CHECK(t->nodes[0].nnuma >= 1);
    sp_topo_free(t);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s topo --json", sp_test_spctl_bin()), 0);
    CHECK_CONTAINS(out, "{\"node\":\"disc-node\",\"source\":\"discovered\",\"file\":\"\",\"numa\":[{\"id\":");

    /* `spctl topo > f` is a file spd loads, and then serves unchanged. */
    char path[256], set_file[300], discovered[8192];
    snprintf(path, sizeof path, "%s/self.topo", dir);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s topo > %s && cat %s", sp_test_spctl_bin(), path, path), 0);
    snprintf(discovered, sizeof discovered, "%s", strchr(out, '\n') + 1);   /* past the comment */
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);

    snprintf(set_file, sizeof set_file, "topology_file=%s", path);
    const char *args2[] = { "--set", set_file, NULL };
    sp_test_daemon_start(&d, args2);
    CHECK_EQ(sp_test_run(out, sizeof out, "%s topo", sp_test_spctl_bin()), 0);
    char want[8500];
    snprintf(want, sizeof want, "# node disc-node: file %s\n%s", path, discovered);
    CHECK_STREQ(out, want);
    CHECK_EQ(sp_test_daemon_stop(&d), 0);
    sp_test_daemon_cleanup(&d);
}

int main(void)
{
    char dir[] = "/tmp/sp-topo-test-XXXXXX";
    CHECK(mkdtemp(dir) != NULL);
    test_from_file(dir);
    printf("topology file: ok\n");
    test_discovered(dir);
    printf("discovered: ok\n");
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
    return 0;
}
