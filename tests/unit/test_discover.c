/*
 * Discovery of this node (daemon/cluster/topo.c) in fake sysfs trees built here: NUMA
 * nodes and their CPUs, the fallback to the online CPUs, NICs (lo and
 * device-less ones left out, NUMA node and speed when readable), GPUs from the
 * driver's bus ids; and reading this node from a topology file.
 */
#include <errno.h>
#include <sys/stat.h>

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
    test_load_node();
    printf("topology file: ok\n");
    rm_tree(root);
    return 0;
}
