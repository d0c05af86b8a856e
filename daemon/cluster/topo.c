/* topo.c — this node's topology, from /sys or a topology file. See topo.h. */
#include "cluster/topo.h"

#include <ctype.h>
#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/err.h"


/* Reads a small sysfs file into buf without its trailing newline; false when unreadable. */
static bool read_text(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool read_text(char *buf, size_t len, const char *fmt, ...)
{
    char path[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(path, sizeof path, fmt, ap);
    va_end(ap);
    FILE *f = fopen(path, "re");
    if (f == NULL)
        return false;
    bool ok = fgets(buf, (int)len, f) != NULL;
    fclose(f);
    if (!ok)
        return false;
    buf[strcspn(buf, "\n")] = '\0';
    return true;
}

/* An integer file (numa_node, speed); `dflt` when unreadable or not a number. */
static long read_long(long dflt, const char *path_fmt, const char *a, const char *b)
{
    char buf[64], *end;
    if (!read_text(buf, sizeof buf, path_fmt, a, b))
        return dflt;
    errno = 0;
    long v = strtol(buf, &end, 10);
    return end == buf || *end != '\0' || errno != 0 ? dflt : v;
}

static int cmp_long(const void *a, const void *b)
{
    long x = *(const long *)a, y = *(const long *)b;
    return x < y ? -1 : x > y;
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp((const char *)a, (const char *)b);
}

/* NUMA nodes, in id order; one node 0 with the online CPUs when sysfs has none. */
static spc_status_t discover_numa(const char *sysfs, sp_topo_node_t *node, sp_err_t *e)
{
    char path[4096], cpus[4096];
    long ids[SP_TOPO_MAX_NUMA];
    size_t n = 0;

    snprintf(path, sizeof path, "%s/devices/system/node", sysfs);
    DIR *d = opendir(path);
    for (struct dirent *de; d != NULL && n < SP_TOPO_MAX_NUMA && (de = readdir(d)) != NULL;) {
        const char *num = de->d_name + 4;
        if (strncmp(de->d_name, "node", 4) == 0 && isdigit((unsigned char)*num) &&
            strspn(num, "0123456789") == strlen(num) && strlen(num) <= 5)
            ids[n++] = strtol(num, NULL, 10);
    }
    if (d != NULL)
        closedir(d);
    qsort(ids, n, sizeof *ids, cmp_long);

    spc_status_t st = SPC_OK;
    for (size_t i = 0; i < n && st == SPC_OK; i++) {
        snprintf(path, sizeof path, "%s/devices/system/node/node%ld", sysfs, ids[i]);
        if (!read_text(cpus, sizeof cpus, "%s/cpulist", path) || !sp_topo_cpus_valid(cpus))
            cpus[0] = '\0';
        st = sp_err_from(e, sp_topo_add_numa(node, (int32_t)ids[i], cpus, SP_ERR_BUF(e)));
    }
    if (n == 0) {
        /* Kernels built without NUMA have no node directory: the machine is one node. */
        if (!read_text(cpus, sizeof cpus, "%s/devices/system/cpu/online", sysfs) || !sp_topo_cpus_valid(cpus))
            cpus[0] = '\0';
        st = sp_err_from(e, sp_topo_add_numa(node, 0, cpus, SP_ERR_BUF(e)));
    }
    return st;
}

/* A NUMA node sysfs names, if this node has it; else unknown. */
static int32_t known_numa(const sp_topo_node_t *node, long numa)
{
    return numa >= 0 && numa <= SP_TOPO_MAX_ID && sp_topo_find_numa(node, (int32_t)numa) != NULL ? (int32_t)numa : -1;
}

/* Interfaces backed by a device, in name order (readdir's order is the hash's). */
static spc_status_t discover_nics(const char *sysfs, sp_topo_node_t *node, sp_err_t *e)
{
    char path[4096], (*names)[SP_TOPO_NAME_MAX] = NULL;
    size_t n = 0, cap = 0;
    struct stat sb;
    spc_status_t st = SPC_OK;

    snprintf(path, sizeof path, "%s/class/net", sysfs);
    DIR *d = opendir(path);
    for (struct dirent *de; d != NULL && n < SP_TOPO_MAX_NICS && (de = readdir(d)) != NULL;) {
        if (de->d_name[0] == '.' || strcmp(de->d_name, "lo") == 0 || strlen(de->d_name) >= SP_TOPO_NAME_MAX)
            continue;
        /* Bridges, veths, tunnels and bonds have no device: they are not links of their own. */
        snprintf(path, sizeof path, "%s/class/net/%s/device", sysfs, de->d_name);
        if (stat(path, &sb) != 0)
            continue;
        if (n == cap) {
            size_t c = cap ? cap * 2 : 8;
            void *p = realloc(names, c * sizeof *names);
            if (p == NULL) {
                st = sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
                break;
            }
            names = p;
            cap = c;
        }
        snprintf(names[n++], sizeof names[0], "%s", de->d_name);
    }
    if (d != NULL)
        closedir(d);
    if (st == SPC_OK && n > 1)
        qsort(names, n, sizeof *names, cmp_name);
    for (size_t i = 0; i < n && st == SPC_OK; i++) {
        long numa = read_long(-1, "%s/class/net/%s/device/numa_node", sysfs, names[i]);
        /* Down links and virtual NICs read -1 or fail with EINVAL: unknown. */
        long speed = read_long(-1, "%s/class/net/%s/speed", sysfs, names[i]);
        st = sp_err_from(e, sp_topo_add_nic(node, names[i], known_numa(node, numa),
                                            speed > 0 && speed <= 100000000 ? speed : -1, SP_ERR_BUF(e)));
        if (st == SPC_ERR_INVALID_ARG)
            st = SPC_OK;   /* a name the format cannot hold: left out */
    }
    free(names);
    return st;
}

/* ---------------------------------------------------------------- GPUs and the links between them */

#define PCI_DEPTH 16   /* bridges from a host bridge to a device: 4 or 5 on real machines */

/* Where a PCI device sits: its host bridge (root complex) and the functions
 * from the root port down to the device itself. */
typedef struct pci_path {
    char root[SP_TOPO_NAME_MAX];                /* "pci0000:17"; "" when unknown */
    char hop[PCI_DEPTH][SP_TOPO_BUS_MAX];       /* "0000:17:01.0", ..., the device */
    int  n;
} pci_path_t;

/*
 * Reads a device's place in the PCIe tree from the link
 * sysfs/bus/pci/devices/BUS, which points into
 * sysfs/devices/pciDDDD:BB/<root port>/<switch ports>.../BUS. Where the link
 * is missing or points elsewhere (a fake or partial sysfs, a virtual bus),
 * the path stays unknown, and so do the PCIe links of the device.
 */
static void read_pci_path(const char *sysfs, const char *bus, pci_path_t *p)
{
    char path[4096], *real = NULL, *top = NULL;

    memset(p, 0, sizeof *p);
    snprintf(path, sizeof path, "%s/bus/pci/devices/%s", sysfs, bus);
    if (bus[0] == '\0' || (real = realpath(path, NULL)) == NULL || (top = realpath(sysfs, NULL)) == NULL)
        goto out;
    size_t tlen = strlen(top);
    if (strncmp(real, top, tlen) != 0 || strncmp(real + tlen, "/devices/pci", 12) != 0)
        goto out;
    char *save = NULL;
    char *tok = strtok_r(real + tlen + strlen("/devices/"), "/", &save);
    snprintf(p->root, sizeof p->root, "%s", tok);
    while ((tok = strtok_r(NULL, "/", &save)) != NULL && p->n < PCI_DEPTH)
        snprintf(p->hop[p->n++], sizeof p->hop[0], "%s", tok);
    /* The path must end at the device, or it says nothing about it. */
    if (p->n == 0 || strcmp(p->hop[p->n - 1], bus) != 0)
        memset(p, 0, sizeof *p);
out:
    free(real);
    free(top);
}

/*
 * The PCIe link between two devices, as NCCL's topology detection names it:
 * under different host bridges, phb where both are on one NUMA node (or
 * where sysfs does not say: one socket is the likelier) and sys where they
 * are on two; under one host bridge, phb where their paths part at it (each
 * under its own root port), pix where they meet inside one switch (each one
 * downstream port below the meeting point), pxb where more bridges lie
 * between them.
 */
static int pcie_link(const pci_path_t *a, const pci_path_t *b, int32_t numa_a, int32_t numa_b)
{
    if (a->root[0] == '\0' || b->root[0] == '\0')
        return SP_TOPO_LINK_UNKNOWN;
    if (strcmp(a->root, b->root) != 0)
        return numa_a >= 0 && numa_b >= 0 && numa_a != numa_b ? SP_TOPO_LINK_SYS : SP_TOPO_LINK_PHB;
    int c = 0;
    while (c < a->n && c < b->n && strcmp(a->hop[c], b->hop[c]) == 0)
        c++;
    if (c == 0)
        return SP_TOPO_LINK_PHB;
    return a->n - c <= 2 && b->n - c <= 2 ? SP_TOPO_LINK_PIX : SP_TOPO_LINK_PXB;
}

/* The lowest index of i's NVLink island (its component over nvl links), or -1
 * when it has no NVLink peer. */
static int32_t island_of(int n, int i, const int link[][SP_TOPO_MAX_GPUS])
{
    bool seen[SP_TOPO_MAX_GPUS] = { false };
    int stack[SP_TOPO_MAX_GPUS], top = 0, low = i;
    bool any = false;
    seen[i] = true;
    stack[top++] = i;
    while (top > 0) {
        int g = stack[--top];
        for (int k = 0; k < n; k++) {
            if (seen[k] || link[g][k] != SP_TOPO_LINK_NVL)
                continue;
            any = true;
            seen[k] = true;
            stack[top++] = k;
            low = k < low ? k : low;
        }
    }
    return any ? low : -1;
}

/*
 * The GPU hook: GPUs are what the CUDA driver reported at start-up (devices.c:
 * driver index and PCI bus id; none without a driver or in a build without
 * CUDA), each with the NUMA node sysfs gives its PCI device
 * (sysfs/bus/pci/devices/BUS/numa_node; unknown where missing or -1). Each
 * ordered pair gets a p2p line from two sources:
 *
 *   - the driver, at start-up (sp_gpu_probe): whether one GPU can map the
 *     other's memory, the performance rank of that access and whether atomics
 *     across it are native. Peer access with native atomics is NVLink (or
 *     NVSwitch): the driver grants native atomics between peers over NVLink
 *     and not over PCIe. (NVML says it directly, with
 *     nvmlDeviceGetP2PStatus(NVML_P2P_CAPS_INDEX_NVLINK), but spd does not
 *     load NVML.)
 *   - sysfs: the PCIe path of each GPU (read_pci_path), compared pairwise
 *     (pcie_link), where the link is not NVLink.
 *
 * Without the driver's answers the pairs say only the PCIe link; a pair of
 * which neither source knows anything gets no line. A GPU with NVLink peers
 * gets their island: the lowest index among them and itself.
 */
static spc_status_t sp_topo_gpus_hook(const char *sysfs, const sp_devices_t *dev, sp_topo_node_t *node, sp_err_t *e)
{
    static pci_path_t path[SP_TOPO_MAX_GPUS];   /* 40 KB: off the stack; start-up is one thread */
    int link[SP_TOPO_MAX_GPUS][SP_TOPO_MAX_GPUS];
    int32_t numa[SP_TOPO_MAX_GPUS];
    char bus[SP_TOPO_MAX_GPUS][SP_TOPO_BUS_MAX];
    int n = dev->gpu_count < SP_TOPO_MAX_GPUS ? dev->gpu_count : SP_TOPO_MAX_GPUS;
    spc_status_t st = SPC_OK;

    for (int i = 0; i < n; i++) {
        if (!sp_topo_bus_id(dev->gpu_bus[i], bus[i]))   /* a bus id the driver wrote oddly: unknown */
            bus[i][0] = '\0';
        long nn = bus[i][0] ? read_long(-1, "%s/bus/pci/devices/%s/numa_node", sysfs, bus[i]) : -1;
        numa[i] = known_numa(node, nn);
        read_pci_path(sysfs, bus[i], &path[i]);
    }
    for (int i = 0; i < n; i++) {
        for (int j = 0; j < n; j++) {
            const sp_gpu_peer_t *p = &dev->gpu_peer[i][j];
            bool nvlink = dev->gpu_peers_asked && p->access == 1 && p->atomics == 1;
            link[i][j] = i == j ? SP_TOPO_LINK_UNKNOWN
                         : nvlink ? SP_TOPO_LINK_NVL : pcie_link(&path[i], &path[j], numa[i], numa[j]);
        }
    }
    for (int i = 0; i < n && st == SPC_OK; i++) {
        int32_t island = island_of(n, i, (const int (*)[SP_TOPO_MAX_GPUS])link);
        st = sp_err_from(e, sp_topo_add_gpu(node, i, bus[i], numa[i], island, SP_ERR_BUF(e)));
    }
    for (int i = 0; i < n && st == SPC_OK; i++) {
        for (int j = 0; j < n && st == SPC_OK; j++) {
            const sp_gpu_peer_t *p = &dev->gpu_peer[i][j];
            sp_topo_p2p_t l = { .from = i, .to = j, .link = link[i][j], .access = -1, .perf_rank = -1, .atomics = -1 };
            if (i == j)
                continue;
            if (dev->gpu_peers_asked) {
                l.access = p->access;
                l.perf_rank = p->perf_rank;
                l.atomics = p->atomics;
            }
            if (l.link == SP_TOPO_LINK_UNKNOWN && l.access < 0 && l.perf_rank < 0 && l.atomics < 0)
                continue;
            st = sp_err_from(e, sp_topo_add_p2p(node, &l, SP_ERR_BUF(e)));
        }
    }
    return st;
}

spc_status_t sp_topo_discover(const char *sysfs, const char *node, const sp_devices_t *dev, sp_topo_t **topo_p,
                              sp_err_t *e)
{
    char name[SP_TOPO_NAME_MAX];
    sp_topo_t *topo;
    sp_topo_node_t *n;

    /* node_name may hold spaces; the format's names cannot. */
    snprintf(name, sizeof name, "%s", node[0] ? node : "localhost");
    for (char *p = name; *p; p++)
        if (!isgraph((unsigned char)*p) || *p == '#')
            *p = '_';
    spc_status_t st = sp_topo_create(&topo);
    if (st != SPC_OK)
        return sp_err_set(e, st, "out of memory");
    if ((st = sp_err_from(e, sp_topo_add_node(topo, name, &n, SP_ERR_BUF(e)))) == SPC_OK &&
        (st = discover_numa(sysfs, n, e)) == SPC_OK &&
        (st = discover_nics(sysfs, n, e)) == SPC_OK)
        st = sp_topo_gpus_hook(sysfs, dev, n, e);
    if (st != SPC_OK) {
        sp_topo_free(topo);
        return st;
    }
    *topo_p = topo;
    return SPC_OK;
}

spc_status_t sp_topo_load_node(const char *path, const char *node, sp_topo_t **topo_p, sp_err_t *e)
{
    sp_topo_t *topo;
    spc_status_t st = sp_err_from(e, sp_topo_load(path, &topo, SP_ERR_BUF(e)));
    if (st != SPC_OK)
        return st;
    uint32_t keep = 0;
    if (topo->nnodes != 1) {
        const sp_topo_node_t *n = sp_topo_find_node(topo, node);
        if (n == NULL) {
            sp_err_set(e, SPC_ERR_NOT_FOUND, "%s: %u nodes and none named '%s' (give this node's name as node_name, "
                       "or a file of one node)", path, topo->nnodes, node);
            sp_topo_free(topo);
            return e->status;
        }
        keep = (uint32_t)(n - topo->nodes);
    }
    sp_topo_keep_node(topo, keep);
    *topo_p = topo;
    return SPC_OK;
}
