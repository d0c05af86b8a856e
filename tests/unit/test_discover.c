/*
 * Discovery of this node (daemon/cluster/topo.c) in fake sysfs trees built here: NUMA
 * nodes and their CPUs, the fallback to the online CPUs, NICs (lo and
 * device-less ones left out, NUMA node and speed when readable), GPUs from the
 * driver's bus ids; and reading this node from a topology file.
 */
#include <errno.h>
#include <sys/stat.h>
#include <unistd.h>

#include "sp_test.h"
#include "cluster/topo.h"

static char root[64];

static void mkdirs(const char *rel)
{
    char path[512];
    snprintf(path, sizeof path, "%s/%s", root, rel);
    for (char *p = path + strlen(root) + 1; *p; p++) {
        if (*p == '/') {
            *p = '\0';
            CHECK(mkdir(path, 0755) == 0 || errno == EEXIST);
            *p = '/';
        }
    }
    CHECK(mkdir(path, 0755) == 0 || errno == EEXIST);
}

static void put(const char *rel, const char *text)
{
    char path[512], dir[512];
    snprintf(dir, sizeof dir, "%s", rel);
    char *slash = strrchr(dir, '/');
    if (slash != NULL) {
        *slash = '\0';
        mkdirs(dir);
    }
    snprintf(path, sizeof path, "%s/%s", root, rel);
    FILE *f = fopen(path, "w");
    CHECK(f != NULL);
    fputs(text, f);
    fclose(f);
}

static char *dump_text(const sp_topo_t *t)
{
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    sp_topo_dump(t, f);
    fclose(f);
    return buf;
}

static void rm_tree(const char *dir)
{
    char cmd[128];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0);
}

static sp_topo_t *discover(const char *sys, const char *node, const sp_devices_t *dev)
{
    sp_topo_t *t = NULL;
    sp_err_t e = SP_ERR_INIT;
    spc_status_t st = sp_topo_discover(sys, node, dev, &t, &e);
    if (st != SPC_OK)
        SP_FAIL("discover %s: %s: %s", sys, spc_status_name(st), e.msg);
    CHECK_EQ(t->nnodes, 1);
    return t;
}

/* A two-socket machine with two physical NICs, one down, and two GPUs. */
static void test_two_sockets(void)
{
    char sys[128];
    snprintf(sys, sizeof sys, "%s/sys", root);
    put("sys/devices/system/node/node1/cpulist", "8-15,24-31\n");
    put("sys/devices/system/node/node0/cpulist", "0-7,16-23\n");
    put("sys/devices/system/node/possible", "0-1\n");           /* not a node */
    mkdirs("sys/devices/system/node/power");
    put("sys/devices/system/cpu/online", "0-31\n");             /* not used: there are nodes */
    mkdirs("sys/class/net/lo");                                 /* loopback: no device link anyway */
    put("sys/class/net/lo/speed", "10\n");
    put("sys/class/net/eth1/device/numa_node", "1\n");
    put("sys/class/net/eth1/speed", "100000\n");
    put("sys/class/net/eth0/device/numa_node", "0\n");
    put("sys/class/net/eth0/speed", "-1\n");                    /* link down */
    put("sys/class/net/ib0/device/vendor", "0x15b3\n");         /* no numa_node, no speed: unknown */
    put("sys/class/net/docker0/speed", "10000\n");              /* a bridge: no device */
    put("sys/class/net/veth1/speed", "10000\n");
    put("sys/class/net/bonding_masters", "\n");
    put("sys/class/net/eth9/device/numa_node", "7\n");          /* a NUMA node the machine does not have */
    put("sys/bus/pci/devices/0000:1b:00.0/numa_node", "0\n");
    put("sys/bus/pci/devices/0000:9c:00.0/numa_node", "1\n");

    sp_devices_t dev;
    memset(&dev, 0, sizeof dev);
    dev.gpu_count = 3;
    snprintf(dev.gpu_bus[0], sizeof dev.gpu_bus[0], "0000:1B:00.0");
    snprintf(dev.gpu_bus[1], sizeof dev.gpu_bus[1], "00000000:9C:00.0");   /* a 32-bit domain */
    snprintf(dev.gpu_bus[2], sizeof dev.gpu_bus[2], "0000:aa:00.0");       /* not in sysfs */

    sp_topo_t *t = discover(sys, "gpu node 7", &dev);
    char *text = dump_text(t);
    printf("%s", text);
    CHECK_STREQ(text,
                "node gpu_node_7\n"
                "numa 0 cpus 0-7,16-23\n"
                "numa 1 cpus 8-15,24-31\n"
                "nic eth0 numa 0\n"
                "nic eth1 numa 1 speed 100000\n"
                "nic eth9\n"
                "nic ib0\n"
                "gpu 0 bus 0000:1b:00.0 numa 0\n"
                "gpu 1 bus 0000:9c:00.0 numa 1\n"
                "gpu 2 bus 0000:aa:00.0\n");
    /* What discovery writes, the format reads back to the same text. */
    sp_topo_t *back;
    char err[256];
    CHECK_EQ(sp_topo_parse(text, "dump", &back, err, sizeof err), SPC_OK);
    char *again = dump_text(back);
    CHECK_STREQ(again, text);
    free(again);
    free(text);
    sp_topo_free(back);
    sp_topo_free(t);

    /* No CUDA driver: no GPUs. */
    dev.gpu_count = 0;
    t = discover(sys, "n", &dev);
    CHECK_EQ(t->nodes[0].ngpus, 0);
    CHECK_EQ(t->nodes[0].nnics, 4);
    sp_topo_free(t);
}

/* A GPU in a fake PCIe tree: its device directory under `chain` (from the host
 * bridge down, the device last), its NUMA node, and the bus link to it. */
static void pci_gpu(const char *chain, const char *numa)
{
    char rel[512], link[512], target[512];
    const char *bus = strrchr(chain, '/') + 1;
    snprintf(rel, sizeof rel, "pcie/devices/%s/numa_node", chain);
    put(rel, numa);
    mkdirs("pcie/bus/pci/devices");
    snprintf(link, sizeof link, "%s/pcie/bus/pci/devices/%s", root, bus);
    snprintf(target, sizeof target, "../../../devices/%s", chain);
    CHECK(symlink(target, link) == 0);
}

static void peer(sp_devices_t *dev, int a, int b, int access, int atomics, int rank)
{
    dev->gpu_peer[a][b] = dev->gpu_peer[b][a] = (sp_gpu_peer_t){ .access = (int8_t)access,
                                                                   .atomics = (int8_t)atomics, .perf_rank = rank };
}

/*
 * Links between GPUs: two sockets; on socket 0, host bridge pci0000:17 with a
 * switch below root port 17:01.0 holding GPUs 0 and 1 and, one switch lower,
 * GPU 2, and GPU 3 alone below root port 17:02.0; on socket 1, GPU 4 below
 * host bridge pci0000:9a; GPU 5 not in sysfs. The driver says 0 and 1 have
 * peer access with native atomics (NVLink), 0-2 and 1-2 peer access without.
 */
static void test_links(void)
{
    char sys[128];
    snprintf(sys, sizeof sys, "%s/pcie", root);
    put("pcie/devices/system/node/node0/cpulist", "0-7\n");
    put("pcie/devices/system/node/node1/cpulist", "8-15\n");
    pci_gpu("pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:00.0/0000:1b:00.0", "0\n");
    pci_gpu("pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:04.0/0000:1c:00.0", "0\n");
    pci_gpu("pci0000:17/0000:17:01.0/0000:18:00.0/0000:19:08.0/0000:1d:00.0/0000:1e:00.0/0000:1f:00.0", "0\n");
    pci_gpu("pci0000:17/0000:17:02.0/0000:2a:00.0", "0\n");
    pci_gpu("pci0000:9a/0000:9a:01.0/0000:9c:00.0", "1\n");

    static sp_devices_t dev;
    memset(&dev, 0, sizeof dev);
    dev.gpu_count = 6;
    const char *buses[] = { "0000:1B:00.0", "0000:1C:00.0", "0000:1F:00.0", "0000:2A:00.0", "0000:9C:00.0",
                            "0000:c0:00.0" };
    for (int i = 0; i < 6; i++)
        snprintf(dev.gpu_bus[i], sizeof dev.gpu_bus[i], "%s", buses[i]);

    /* Without the driver's answers: the PCIe links alone, nothing for GPU 5. */
    sp_topo_t *t = discover(sys, "links", &dev);
    char *text = dump_text(t);
    printf("%s", text);
    const sp_topo_node_t *n = &t->nodes[0];
    CHECK_EQ(n->np2p, 20);
    CHECK_CONTAINS(text, "gpu 0 bus 0000:1b:00.0 numa 0\n");
    CHECK_CONTAINS(text, "gpu 5 bus 0000:c0:00.0\n");
    CHECK_CONTAINS(text, "p2p 0 1 link pix\n");
    CHECK_CONTAINS(text, "p2p 1 0 link pix\n");
    CHECK_CONTAINS(text, "p2p 0 2 link pxb\n");
    CHECK_CONTAINS(text, "p2p 2 1 link pxb\n");
    CHECK_CONTAINS(text, "p2p 0 3 link phb\n");
    CHECK_CONTAINS(text, "p2p 3 2 link phb\n");
    CHECK_CONTAINS(text, "p2p 0 4 link sys\n");
    CHECK_CONTAINS(text, "p2p 4 3 link sys\n");
    CHECK(strstr(text, "p2p 5") == NULL && strstr(text, " 5 link") == NULL);
    free(text);
    sp_topo_free(t);

    /* With them: NVLink where peers have native atomics, islands, and every pair of the driver's. */
    dev.gpu_peers_asked = true;
    for (int i = 0; i < 6; i++)
        for (int j = 0; j < 6; j++)
            dev.gpu_peer[i][j] = (sp_gpu_peer_t){ .access = 0, .atomics = 0, .perf_rank = 0 };
    peer(&dev, 0, 1, 1, 1, 0);
    peer(&dev, 0, 2, 1, 0, 1);
    peer(&dev, 1, 2, 1, 0, 1);
    t = discover(sys, "links", &dev);
    text = dump_text(t);
    printf("%s", text);
    n = &t->nodes[0];
    CHECK_EQ(n->np2p, 30);
    CHECK_CONTAINS(text, "gpu 0 bus 0000:1b:00.0 numa 0 island 0\n");
    CHECK_CONTAINS(text, "gpu 1 bus 0000:1c:00.0 numa 0 island 0\n");
    CHECK_CONTAINS(text, "gpu 2 bus 0000:1f:00.0 numa 0\n");
    CHECK_CONTAINS(text, "p2p 0 1 link nvl access 1 perf-rank 0 atomics 1\n");
    CHECK_CONTAINS(text, "p2p 1 0 link nvl access 1 perf-rank 0 atomics 1\n");
    CHECK_CONTAINS(text, "p2p 2 0 link pxb access 1 perf-rank 1 atomics 0\n");
    CHECK_CONTAINS(text, "p2p 3 0 link phb access 0 perf-rank 0 atomics 0\n");
    CHECK_CONTAINS(text, "p2p 4 2 link sys access 0 perf-rank 0 atomics 0\n");
    CHECK_CONTAINS(text, "p2p 5 0 access 0 perf-rank 0 atomics 0\n");
    char why[256];
    CHECK_EQ(sp_topo_p2p_route(n, 1, 2, why, sizeof why), SP_TOPO_ROUTE_PEER);
    CHECK_STREQ(why, "peer access over PCIe through PCIe bridges below one root port (pxb, performance rank 1, no "
                     "native atomics)");
    CHECK_EQ(sp_topo_p2p_route(n, 4, 0, why, sizeof why), SP_TOPO_ROUTE_STAGED);
    sp_topo_t *back;
    char err[256];
    CHECK_EQ(sp_topo_parse(text, "dump", &back, err, sizeof err), SPC_OK);
    char *again = dump_text(back);
    CHECK_STREQ(again, text);
    free(again);
    sp_topo_free(back);
    free(text);
    sp_topo_free(t);

    /* A driver with no GPUs: no pairs. */
    dev.gpu_count = 0;
    t = discover(sys, "links", &dev);
    CHECK_EQ(t->nodes[0].ngpus, 0);
    CHECK_EQ(t->nodes[0].np2p, 0);
    sp_topo_free(t);
}

/* A kernel without NUMA: one node 0 with the online CPUs. And no sysfs at all. */
static void test_fallbacks(void)
{
    char sys[128];
    snprintf(sys, sizeof sys, "%s/flat", root);
    put("flat/devices/system/cpu/online", "0-3\n");
    put("flat/class/net/enp1s0/device/numa_node", "-1\n");
    put("flat/class/net/enp1s0/speed", "25000\n");
    sp_devices_t dev;
    memset(&dev, 0, sizeof dev);
    sp_topo_t *t = discover(sys, "flat", &dev);
    char *text = dump_text(t);
    CHECK_STREQ(text, "node flat\nnuma 0 cpus 0-3\nnic enp1s0 speed 25000\n");
    free(text);
    sp_topo_free(t);

    snprintf(sys, sizeof sys, "%s/none", root);
    t = discover(sys, "", &dev);
    text = dump_text(t);
    CHECK_STREQ(text, "node localhost\nnuma 0\n");
    free(text);
    sp_topo_free(t);

    /* This machine's own /sys: whatever it holds, it reads back. */
    t = discover("/sys", "self", &dev);
    text = dump_text(t);
    printf("this machine:\n%s", text);
    CHECK(t->nodes[0].nnuma >= 1);
    sp_topo_t *back;
    char err[256];
    CHECK_EQ(sp_topo_parse(text, "self", &back, err, sizeof err), SPC_OK);
    free(text);
    sp_topo_free(back);
    sp_topo_free(t);
}

static void test_load_node(void)
{
    char path[128];
    sp_err_t e = SP_ERR_INIT;
    sp_topo_t *t = NULL;
    snprintf(path, sizeof path, "%s/cluster.topo", root);
    put("cluster.topo", "node a\nnuma 0 cpus 0-1\nnode b\nnuma 0 cpus 0-3\ngpu 0 numa 0\nnode c\n");
    CHECK_EQ(sp_topo_load_node(path, "b", &t, &e), SPC_OK);
    char *text = dump_text(t);
    CHECK_STREQ(text, "node b\nnuma 0 cpus 0-3\ngpu 0 numa 0\n");
    free(text);
    sp_topo_free(t);
    t = NULL;
    CHECK_EQ(sp_topo_load_node(path, "z", &t, &e), SPC_ERR_NOT_FOUND);
    CHECK_EQ(e.status, SPC_ERR_NOT_FOUND);
    CHECK_CONTAINS(e.msg, "cluster.topo: 3 nodes and none named 'z'");
    CHECK(t == NULL);

    /* One node: it is this node, whatever its name. */
    put("one.topo", "node elsewhere\nnuma 0\n");
    snprintf(path, sizeof path, "%s/one.topo", root);
    CHECK_EQ(sp_topo_load_node(path, "here", &t, &e), SPC_OK);
    CHECK_STREQ(t->nodes[0].name, "elsewhere");
    sp_topo_free(t);

    put("bad.topo", "node x\nnuma 0\ngpu zero\n");
    snprintf(path, sizeof path, "%s/bad.topo", root);
    CHECK_EQ(sp_topo_load_node(path, "x", &t, &e), SPC_ERR_INVALID_ARG);
    CHECK_EQ(e.status, SPC_ERR_INVALID_ARG);
    CHECK_CONTAINS(e.msg, "bad.topo:3: gpu 'zero' is not an index");
}

int main(void)
{
    snprintf(root, sizeof root, "/tmp/sp-sysfs-XXXXXX");
    CHECK(mkdtemp(root) != NULL);
    test_two_sockets();
    printf("two sockets: ok\n");
    test_fallbacks();
    printf("fallbacks: ok\n");
    test_links();
    printf("links between GPUs: ok\n");
    test_load_node();
    printf("topology file: ok\n");
    rm_tree(root);
    return 0;
}
