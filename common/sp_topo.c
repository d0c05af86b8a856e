/* sp_topo.c — the topology model and its text format. See sp_topo.h. */
#include "sp_topo.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "sp_err.h"
#include "sp_text.h"

#define TOPO_FILE_MAX (64u << 20)


/* Grows an array of `size`-byte items to hold n + 1. */
static bool reserve(void **arr, uint32_t *cap, uint32_t n, size_t size)
{
    if (n < *cap)
        return true;
    uint32_t c = *cap ? *cap * 2 : 4;
    void *p = realloc(*arr, (size_t)c * size);
    if (p == NULL)
        return false;
    *arr = p;
    *cap = c;
    return true;
}

/* ---------------------------------------------------------------- building */

spc_status_t sp_topo_create(sp_topo_t **topo_p)
{
    sp_topo_t *t = calloc(1, sizeof *t);
    if (t == NULL)
        return SPC_ERR_NO_MEMORY;
    *topo_p = t;
    return SPC_OK;
}

static void node_cleanup(sp_topo_node_t *n)
{
    for (uint32_t i = 0; i < n->nnuma; i++)
        free(n->numa[i].cpus);
    free(n->numa);
    free(n->nics);
    free(n->gpus);
    free(n->p2p);
}

void sp_topo_free(sp_topo_t *topo)
{
    if (topo == NULL)
        return;
    for (uint32_t i = 0; i < topo->nnodes; i++)
        node_cleanup(&topo->nodes[i]);
    free(topo->nodes);
    free(topo);
}

/* Names are one token of the format: printable, no spaces, no comment sign. */
static bool name_valid(const char *what, const char *name, char *err, size_t errlen)
{
    size_t n = strlen(name);
    if (n == 0 || n >= SP_TOPO_NAME_MAX) {
        sp_errf(err, errlen, "%s name '%.80s' must have 1 to %d bytes", what, name, SP_TOPO_NAME_MAX - 1);
        return false;
    }
    for (const char *p = name; *p; p++) {
        if (!isgraph((unsigned char)*p) || *p == '#') {
            sp_errf(err, errlen, "%s name '%s' has a character other than printable ones without spaces and '#'",
                 what, name);
            return false;
        }
    }
    return true;
}

int sp_topo_cpus_valid(const char *s)
{
    if (*s == '\0')
        return 1;
    for (;;) {
        char *end;
        if (!isdigit((unsigned char)*s))
            return 0;
        errno = 0;
        unsigned long lo = strtoul(s, &end, 10), hi = lo;
        if (errno != 0 || lo > 1u << 20)
            return 0;
        s = end;
        if (*s == '-') {
            s++;
            if (!isdigit((unsigned char)*s))
                return 0;
            hi = strtoul(s, &end, 10);
            if (errno != 0 || hi > 1u << 20 || hi < lo)
                return 0;
            s = end;
        }
        if (*s == '\0')
            return 1;
        if (*s != ',')
            return 0;
        s++;
    }
}

const sp_topo_numa_t *sp_topo_find_numa(const sp_topo_node_t *node, int32_t id)
{
    for (uint32_t i = 0; i < node->nnuma; i++)
        if (node->numa[i].id == id)
            return &node->numa[i];
    return NULL;
}

/* A NUMA reference of a nic or gpu: -1 (unknown) or a declared NUMA node. */
static bool numa_ref_valid(const sp_topo_node_t *node, const char *what, int32_t numa, char *err, size_t errlen)
{
    if (numa == -1 || (numa >= 0 && sp_topo_find_numa(node, numa) != NULL))
        return true;
    sp_errf(err, errlen, "%s: numa %" PRId32 " is not a NUMA node of node %s (declare it with a numa line first)", what,
         numa, node->name);
    return false;
}

const sp_topo_node_t *sp_topo_find_node(const sp_topo_t *topo, const char *name)
{
    for (uint32_t i = 0; i < topo->nnodes; i++)
        if (strcmp(topo->nodes[i].name, name) == 0)
            return &topo->nodes[i];
    return NULL;
}

const sp_topo_gpu_t *sp_topo_find_gpu(const sp_topo_node_t *node, int32_t index)
{
    for (uint32_t i = 0; i < node->ngpus; i++)
        if (node->gpus[i].index == index)
            return &node->gpus[i];
    return NULL;
}

/* Appends a node whose name the caller has checked. */
static spc_status_t node_append(sp_topo_t *topo, const char *name, sp_topo_node_t **node_p, char *err, size_t errlen)
{
    if (topo->nnodes >= SP_TOPO_MAX_NODES) {
        sp_errf(err, errlen, "node %s: more than %d nodes", name, SP_TOPO_MAX_NODES);
        return SPC_ERR_LIMIT;
    }
    if (!reserve((void **)&topo->nodes, &topo->nodes_cap, topo->nnodes, sizeof *topo->nodes)) {
        sp_errf(err, errlen, "out of memory");
        return SPC_ERR_NO_MEMORY;
    }
    sp_topo_node_t *n = &topo->nodes[topo->nnodes++];
    memset(n, 0, sizeof *n);
    snprintf(n->name, sizeof n->name, "%s", name);
    if (node_p != NULL)
        *node_p = n;
    return SPC_OK;
}

spc_status_t sp_topo_add_node(sp_topo_t *topo, const char *name, sp_topo_node_t **node_p, char *err, size_t errlen)
{
    if (!name_valid("node", name, err, errlen))
        return SPC_ERR_INVALID_ARG;
    if (sp_topo_find_node(topo, name) != NULL) {
        sp_errf(err, errlen, "node %s: a node of that name exists already", name);
        return SPC_ERR_INVALID_ARG;
    }
    return node_append(topo, name, node_p, err, errlen);
}

spc_status_t sp_topo_add_numa(sp_topo_node_t *node, int32_t id, const char *cpus, char *err, size_t errlen)
{
    if (id < 0 || id > SP_TOPO_MAX_ID) {
        sp_errf(err, errlen, "numa %" PRId32 ": the id must be in [0, %d]", id, SP_TOPO_MAX_ID);
        return SPC_ERR_INVALID_ARG;
    }
    if (!sp_topo_cpus_valid(cpus)) {
        sp_errf(err, errlen, "numa %" PRId32 ": cpus '%.80s' is not a CPU list like 0-7,16-23", id, cpus);
        return SPC_ERR_INVALID_ARG;
    }
    if (sp_topo_find_numa(node, id) != NULL) {
        sp_errf(err, errlen, "numa %" PRId32 ": node %s has that NUMA node already", id, node->name);
        return SPC_ERR_INVALID_ARG;
    }
    if (node->nnuma >= SP_TOPO_MAX_NUMA) {
        sp_errf(err, errlen, "numa %" PRId32 ": node %s has %d NUMA nodes already", id, node->name, SP_TOPO_MAX_NUMA);
        return SPC_ERR_LIMIT;
    }
    char *copy = strdup(cpus);
    if (copy == NULL || !reserve((void **)&node->numa, &node->numa_cap, node->nnuma, sizeof *node->numa)) {
        free(copy);
        sp_errf(err, errlen, "out of memory");
        return SPC_ERR_NO_MEMORY;
    }
    node->numa[node->nnuma++] = (sp_topo_numa_t){ .id = id, .cpus = copy };
    return SPC_OK;
}

spc_status_t sp_topo_add_nic(sp_topo_node_t *node, const char *name, int32_t numa, int64_t speed_mbps, char *err,
                             size_t errlen)
{
    char what[SP_TOPO_NAME_MAX + 8];
    if (!name_valid("nic", name, err, errlen))
        return SPC_ERR_INVALID_ARG;
    snprintf(what, sizeof what, "nic %s", name);
    if (!numa_ref_valid(node, what, numa, err, errlen))
        return SPC_ERR_INVALID_ARG;
    if (speed_mbps < -1 || speed_mbps == 0 || speed_mbps > 100000000) {
        sp_errf(err, errlen, "%s: speed %" PRId64 " Mb/s is outside [1, 100000000]", what, speed_mbps);
        return SPC_ERR_INVALID_ARG;
    }
    for (uint32_t i = 0; i < node->nnics; i++) {
        if (strcmp(node->nics[i].name, name) == 0) {
            sp_errf(err, errlen, "%s: node %s has that NIC already", what, node->name);
            return SPC_ERR_INVALID_ARG;
        }
    }
    if (node->nnics >= SP_TOPO_MAX_NICS) {
        sp_errf(err, errlen, "%s: node %s has %d NICs already", what, node->name, SP_TOPO_MAX_NICS);
        return SPC_ERR_LIMIT;
    }
    if (!reserve((void **)&node->nics, &node->nics_cap, node->nnics, sizeof *node->nics)) {
        sp_errf(err, errlen, "out of memory");
        return SPC_ERR_NO_MEMORY;
    }
    sp_topo_nic_t *n = &node->nics[node->nnics++];
    snprintf(n->name, sizeof n->name, "%s", name);
    n->numa = numa;
    n->speed_mbps = speed_mbps;
    return SPC_OK;
}

spc_status_t sp_topo_add_gpu(sp_topo_node_t *node, int32_t index, const char *bus, int32_t numa, int32_t island,
                             char *err, size_t errlen)
{
    char what[32];
    snprintf(what, sizeof what, "gpu %" PRId32, index);
    if (index < 0 || index > SP_TOPO_MAX_ID) {
        sp_errf(err, errlen, "%s: the index must be in [0, %d]", what, SP_TOPO_MAX_ID);
        return SPC_ERR_INVALID_ARG;
    }
    size_t blen = strlen(bus);
    if (blen >= SP_TOPO_BUS_MAX || strspn(bus, "0123456789abcdefABCDEF:.") != blen) {
        sp_errf(err, errlen, "%s: bus '%.80s' is not a PCI bus id like 0000:1b:00.0", what, bus);
        return SPC_ERR_INVALID_ARG;
    }
    if (!numa_ref_valid(node, what, numa, err, errlen))
        return SPC_ERR_INVALID_ARG;
    if (island < -1 || island > SP_TOPO_MAX_ID) {
        sp_errf(err, errlen, "%s: island %" PRId32 " is outside [0, %d]", what, island, SP_TOPO_MAX_ID);
        return SPC_ERR_INVALID_ARG;
    }
    if (sp_topo_find_gpu(node, index) != NULL) {
        sp_errf(err, errlen, "%s: node %s has that GPU already", what, node->name);
        return SPC_ERR_INVALID_ARG;
    }
    if (node->ngpus >= SP_TOPO_MAX_GPUS) {
        sp_errf(err, errlen, "%s: node %s has %d GPUs already", what, node->name, SP_TOPO_MAX_GPUS);
        return SPC_ERR_LIMIT;
    }
    if (!reserve((void **)&node->gpus, &node->gpus_cap, node->ngpus, sizeof *node->gpus)) {
        sp_errf(err, errlen, "out of memory");
        return SPC_ERR_NO_MEMORY;
    }
    sp_topo_gpu_t *g = &node->gpus[node->ngpus++];
    g->index = index;
    /* Sysfs writes bus ids in lower case, the CUDA driver in upper: keep one spelling. */
    for (size_t i = 0; i <= blen; i++)
        g->bus[i] = (char)tolower((unsigned char)bus[i]);
    g->numa = numa;
    g->island = island;
    return SPC_OK;
}

static const char *const LINK_NAME[SP_TOPO_LINKS] = { "nvl", "pix", "pxb", "phb", "sys" };
static const char *const LINK_WORDS[SP_TOPO_LINKS] = {
    "NVLink", "one PCIe switch", "PCIe bridges below one root port", "a CPU's PCIe host bridge",
    "the link between CPU sockets",
};

const char *sp_topo_link_name(int link)
{
    return link >= 0 && link < SP_TOPO_LINKS ? LINK_NAME[link] : "unknown";
}

const char *sp_topo_link_words(int link)
{
    return link >= 0 && link < SP_TOPO_LINKS ? LINK_WORDS[link] : "an unknown link";
}

const sp_topo_gpu_t *sp_topo_find_gpu_bus(const sp_topo_node_t *node, const char *bus)
{
    for (uint32_t i = 0; i < node->ngpus; i++)
        if (bus[0] != '\0' && strcmp(node->gpus[i].bus, bus) == 0)
            return &node->gpus[i];
    return NULL;
}

bool sp_topo_bus_id(const char *id, char out[SP_TOPO_BUS_MAX])
{
    size_t len = strnlen(id, SP_TOPO_BUS_MAX);
    if (len == 0 || len >= SP_TOPO_BUS_MAX || strspn(id, "0123456789abcdefABCDEF:.") != len)
        return false;
    /* Some drivers write a 32-bit PCI domain (00000000:1b:00.0); sysfs writes 16 bits. */
    if (len == 16 && strncmp(id, "0000", 4) == 0)
        id += 4;
    size_t k = 0;
    for (; id[k]; k++)
        out[k] = (char)tolower((unsigned char)id[k]);
    out[k] = '\0';
    return true;
}

const sp_topo_p2p_t *sp_topo_find_p2p(const sp_topo_node_t *node, int32_t from, int32_t to)
{
    for (uint32_t i = 0; i < node->np2p; i++)
        if (node->p2p[i].from == from && node->p2p[i].to == to)
            return &node->p2p[i];
    return NULL;
}

spc_status_t sp_topo_add_p2p(sp_topo_node_t *node, const sp_topo_p2p_t *p, char *err, size_t errlen)
{
    char what[48];
    snprintf(what, sizeof what, "p2p %" PRId32 " %" PRId32, p->from, p->to);
    if (sp_topo_find_gpu(node, p->from) == NULL || sp_topo_find_gpu(node, p->to) == NULL) {
        sp_errf(err, errlen, "%s: node %s has no GPU %" PRId32 " (declare it with a gpu line first)", what, node->name,
                sp_topo_find_gpu(node, p->from) == NULL ? p->from : p->to);
        return SPC_ERR_INVALID_ARG;
    }
    if (p->from == p->to) {
        sp_errf(err, errlen, "%s: a GPU and itself are not a pair", what);
        return SPC_ERR_INVALID_ARG;
    }
    if (p->link < SP_TOPO_LINK_UNKNOWN || p->link >= SP_TOPO_LINKS || p->access < -1 || p->access > 1 ||
        p->atomics < -1 || p->atomics > 1 || p->perf_rank < -1 || p->perf_rank > SP_TOPO_MAX_ID) {
        sp_errf(err, errlen, "%s: link %d, access %d, atomics %d or perf-rank %d out of range", what, (int)p->link,
                (int)p->access, (int)p->atomics, (int)p->perf_rank);
        return SPC_ERR_INVALID_ARG;
    }
    if (sp_topo_find_p2p(node, p->from, p->to) != NULL) {
        sp_errf(err, errlen, "%s: node %s has that pair already", what, node->name);
        return SPC_ERR_INVALID_ARG;
    }
    /* At most every ordered pair of the node's GPUs, which the two checks above bound. */
    if (!reserve((void **)&node->p2p, &node->p2p_cap, node->np2p, sizeof *node->p2p)) {
        sp_errf(err, errlen, "out of memory");
        return SPC_ERR_NO_MEMORY;
    }
    node->p2p[node->np2p++] = *p;
    return SPC_OK;
}

/* What two gpu lines imply about the link between their GPUs. */
static int implied_link(const sp_topo_gpu_t *a, const sp_topo_gpu_t *b)
{
    if (a->island >= 0 && a->island == b->island)
        return SP_TOPO_LINK_NVL;
    if (a->numa < 0 || b->numa < 0)
        return SP_TOPO_LINK_UNKNOWN;
    return a->numa == b->numa ? SP_TOPO_LINK_PHB : SP_TOPO_LINK_SYS;
}

int sp_topo_gpu_link(const sp_topo_node_t *node, int32_t a, int32_t b)
{
    const sp_topo_gpu_t *ga = sp_topo_find_gpu(node, a), *gb = sp_topo_find_gpu(node, b);
    if (ga == NULL || gb == NULL || a == b)
        return SP_TOPO_LINK_UNKNOWN;
    const sp_topo_p2p_t *ab = sp_topo_find_p2p(node, a, b), *ba = sp_topo_find_p2p(node, b, a);
    int x = ab != NULL ? ab->link : SP_TOPO_LINK_UNKNOWN, y = ba != NULL ? ba->link : SP_TOPO_LINK_UNKNOWN;
    if (x != SP_TOPO_LINK_UNKNOWN || y != SP_TOPO_LINK_UNKNOWN)
        return x > y ? x : y;
    return implied_link(ga, gb);
}

/* The position of the GPU with driver index `index` in node->gpus, or -1. */
static int gpu_pos(const sp_topo_node_t *node, int32_t index)
{
    for (uint32_t k = 0; k < node->ngpus; k++)
        if (node->gpus[k].index == index)
            return (int)k;
    return -1;
}

void sp_topo_link_matrix(const sp_topo_node_t *node, bool stated, int8_t link[SP_TOPO_MAX_GPUS][SP_TOPO_MAX_GPUS])
{
    uint32_t n = node->ngpus;
    /* What each direction's p2p line says, then the slower of the two. */
    for (uint32_t a = 0; a < n; a++)
        for (uint32_t b = 0; b < n; b++)
            link[a][b] = SP_TOPO_LINK_UNKNOWN;
    for (uint32_t i = 0; i < node->np2p; i++) {
        int a = gpu_pos(node, node->p2p[i].from), b = gpu_pos(node, node->p2p[i].to);
        link[a][b] = (int8_t)node->p2p[i].link;   /* add_p2p checked both GPUs */
    }
    for (uint32_t a = 0; a < n; a++) {
        for (uint32_t b = a + 1; b < n; b++) {
            int x = link[a][b] > link[b][a] ? link[a][b] : link[b][a];
            if (x == SP_TOPO_LINK_UNKNOWN) {
                x = implied_link(&node->gpus[a], &node->gpus[b]);
                if (stated && x != SP_TOPO_LINK_NVL)
                    x = SP_TOPO_LINK_UNKNOWN;
            }
            link[a][b] = link[b][a] = (int8_t)x;
        }
    }
}

sp_topo_route_t sp_topo_p2p_route(const sp_topo_node_t *node, int32_t from, int32_t to, char *why, size_t whylen)
{
    char buf[256];
    const sp_topo_p2p_t *p = sp_topo_find_p2p(node, from, to);
    int link = sp_topo_gpu_link(node, from, to);
    size_t off;

    if (why == NULL) {
        why = buf;
        whylen = sizeof buf;
    }
    if (p != NULL && p->access == 0) {
        off = sp_add_text(why, whylen, 0, "staged through host memory: GPU %" PRId32 " cannot map GPU %" PRId32
                       "'s memory (no peer access", from, to);
        if (link != SP_TOPO_LINK_UNKNOWN)
            off = sp_add_text(why, whylen, off, "; they are joined by %s, %s", sp_topo_link_words(link), LINK_NAME[link]);
        sp_add_text(why, whylen, off, ")");
        return SP_TOPO_ROUTE_STAGED;
    }
    /* NVLink is peer access by construction; over PCIe only the driver can say. */
    if ((p == NULL || p->access < 0) && link != SP_TOPO_LINK_NVL) {
        snprintf(why, whylen, "unknown: the topology does not say whether GPU %" PRId32 " can map GPU %" PRId32
                 "'s memory", from, to);
        return SP_TOPO_ROUTE_UNKNOWN;
    }
    if (link == SP_TOPO_LINK_NVL)
        off = sp_add_text(why, whylen, 0, "peer access over NVLink (nvl");
    else if (link == SP_TOPO_LINK_UNKNOWN)
        off = sp_add_text(why, whylen, 0, "peer access (the link is unknown");
    else
        off = sp_add_text(why, whylen, 0, "peer access over PCIe through %s (%s", sp_topo_link_words(link),
                       LINK_NAME[link]);
    if (p != NULL && p->perf_rank >= 0)
        off = sp_add_text(why, whylen, off, ", performance rank %" PRId32, p->perf_rank);
    if (p != NULL && p->atomics >= 0)
        off = sp_add_text(why, whylen, off, ", %s atomics", p->atomics ? "native" : "no native");
    sp_add_text(why, whylen, off, ")");
    return SP_TOPO_ROUTE_PEER;
}

/* Drops the nodes past `keep` (a cluster line that failed half way). */
static void truncate_nodes(sp_topo_t *topo, uint32_t keep)
{
    while (topo->nnodes > keep)
        node_cleanup(&topo->nodes[--topo->nnodes]);
}

spc_status_t sp_topo_add_cluster(sp_topo_t *topo, const sp_topo_cluster_t *c, char *err, size_t errlen)
{
    const char *prefix = c->prefix ? c->prefix : "node";
    uint32_t m = c->numa_per_node ? c->numa_per_node : 1;

    if (c->nodes == 0 || c->nodes > SP_TOPO_MAX_NODES || topo->nnodes + c->nodes > SP_TOPO_MAX_NODES) {
        sp_errf(err, errlen, "cluster: %u nodes (with the %u already there) is outside [1, %d]", c->nodes, topo->nnodes,
             SP_TOPO_MAX_NODES);
        return c->nodes == 0 ? SPC_ERR_INVALID_ARG : SPC_ERR_LIMIT;
    }
    if (c->gpus_per_node > SP_TOPO_MAX_GPUS || m > SP_TOPO_MAX_NUMA || c->nics_per_node > SP_TOPO_MAX_NICS) {
        sp_errf(err, errlen, "cluster: at most %d gpus-per-node, %d numa-per-node and %d nics-per-node",
             SP_TOPO_MAX_GPUS, SP_TOPO_MAX_NUMA, SP_TOPO_MAX_NICS);
        return SPC_ERR_LIMIT;
    }
    if (c->cpus_per_numa > 65536) {
        sp_errf(err, errlen, "cluster: cpus-per-numa %u is over 65536", c->cpus_per_numa);
        return SPC_ERR_INVALID_ARG;
    }
    if (strlen(prefix) + 6 >= SP_TOPO_NAME_MAX) {
        sp_errf(err, errlen, "cluster: prefix '%.80s' is longer than %d bytes", prefix, SP_TOPO_NAME_MAX - 7);
        return SPC_ERR_INVALID_ARG;
    }
    if (!name_valid("cluster: prefix", prefix, err, errlen))
        return SPC_ERR_INVALID_ARG;
    /* The names are prefix0 .. prefix(N-1): one pass over the nodes there finds
     * a clash, where checking each new name would take N x nodes comparisons. */
    size_t plen = strlen(prefix);
    for (uint32_t i = 0; i < topo->nnodes; i++) {
        const char *name = topo->nodes[i].name, *num = name + plen;
        if (strncmp(name, prefix, plen) != 0 || !isdigit((unsigned char)*num) || (num[0] == '0' && num[1] != '\0') ||
            strspn(num, "0123456789") != strlen(num) || strlen(num) > 5 || strtoul(num, NULL, 10) >= c->nodes)
            continue;
        sp_errf(err, errlen, "cluster: node %s exists already (use another prefix)", name);
        return SPC_ERR_INVALID_ARG;
    }

    uint32_t keep = topo->nnodes;
    spc_status_t st = SPC_OK;
    for (uint32_t i = 0; i < c->nodes && st == SPC_OK; i++) {
        char name[SP_TOPO_NAME_MAX], cpus[64], nic[16];
        sp_topo_node_t *n;
        snprintf(name, sizeof name, "%s%u", prefix, i);
        if ((st = node_append(topo, name, &n, err, errlen)) != SPC_OK)
            break;
        for (uint32_t k = 0; k < m && st == SPC_OK; k++) {
            if (c->cpus_per_numa == 0)
                cpus[0] = '\0';
            else
                snprintf(cpus, sizeof cpus, "%u-%u", k * c->cpus_per_numa, (k + 1) * c->cpus_per_numa - 1);
            st = sp_topo_add_numa(n, (int32_t)k, cpus, err, errlen);
        }
        /* Blocks: item j of n sits on NUMA node j * m / n, as GPUs and NICs do on
         * two-socket machines (the first half on socket 0). */
        for (uint32_t j = 0; j < c->nics_per_node && st == SPC_OK; j++) {
            snprintf(nic, sizeof nic, "nic%u", j);
            st = sp_topo_add_nic(n, nic, (int32_t)(j * m / c->nics_per_node), c->nic_speed_mbps, err, errlen);
        }
        for (uint32_t g = 0; g < c->gpus_per_node && st == SPC_OK; g++)
            st = sp_topo_add_gpu(n, (int32_t)g, "", (int32_t)(g * m / c->gpus_per_node),
                                 c->island_size ? (int32_t)(g / c->island_size) : -1, err, errlen);
    }
    if (st != SPC_OK)
        truncate_nodes(topo, keep);
    return st;
}

void sp_topo_keep_node(sp_topo_t *topo, uint32_t index)
{
    sp_topo_node_t mine = topo->nodes[index];
    topo->nodes[index] = topo->nodes[0];
    topo->nodes[0] = mine;
    while (topo->nnodes > 1)
        node_cleanup(&topo->nodes[--topo->nnodes]);
}

/* ---------------------------------------------------------------- the text format */

#define MAX_TOKENS 32

/* Splits a line into whitespace-separated tokens, in place; drops a comment. */
static int tokenize(char *line, char **tok)
{
    int n = 0;
    char *hash = strchr(line, '#');
    if (hash != NULL)
        *hash = '\0';
    for (char *p = line; *p;) {
        while (isspace((unsigned char)*p))
            p++;
        if (*p == '\0')
            break;
        if (n == MAX_TOKENS)
            return -1;
        tok[n++] = p;
        while (*p && !isspace((unsigned char)*p))
            p++;
        if (*p)
            *p++ = '\0';
    }
    return n;
}

static bool parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *v_p)
{
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end != '\0' || errno != 0 || v < lo || v > hi)
        return false;
    *v_p = v;
    return true;
}

/* The `key value` pairs after a line's value, checked against what the keyword allows. */
typedef struct kv_spec {
    const char *key;
    bool        number;
    int64_t     lo, hi;
    int64_t     num;      /* out */
    const char *str;      /* out; NULL when absent */
    bool        seen;
} kv_spec_t;

#define KV_NUM(k, min, max) { .key = (k), .number = true, .lo = (min), .hi = (max) }
#define KV_STR(k)           { .key = (k) }

static bool parse_pairs(char **tok, int n, kv_spec_t *spec, int nspec, char *err, size_t errlen)
{
    if (n % 2 != 0) {
        sp_errf(err, errlen, "'%s' has no value", tok[n - 1]);
        return false;
    }
    for (int i = 0; i < n; i += 2) {
        kv_spec_t *s = NULL;
        for (int k = 0; k < nspec; k++)
            if (strcmp(tok[i], spec[k].key) == 0)
                s = &spec[k];
        if (s == NULL) {
            sp_errf(err, errlen, "unknown key '%.64s' (expected:", tok[i]);
            for (int k = 0; k < nspec; k++) {
                size_t off = strlen(err);
                if (off < errlen)
                    snprintf(err + off, errlen - off, " %s", spec[k].key);
            }
            size_t off = strlen(err);
            if (off < errlen)
                snprintf(err + off, errlen - off, ")");
            return false;
        }
        if (s->seen) {
            sp_errf(err, errlen, "'%s' given twice", s->key);
            return false;
        }
        s->seen = true;
        s->str = tok[i + 1];
        if (s->number && !parse_i64(tok[i + 1], s->lo, s->hi, &s->num)) {
            sp_errf(err, errlen, "%s '%.64s' is not an integer in [%" PRId64 ", %" PRId64 "]", s->key, tok[i + 1], s->lo,
                 s->hi);
            return false;
        }
    }
    return true;
}

/* `p2p FROM TO [link L] [access A] [perf-rank R] [atomics A]`. */
static spc_status_t parse_p2p(sp_topo_node_t *node, char **tok, int n, char *err, size_t errlen)
{
    kv_spec_t s[] = { KV_STR("link"), KV_NUM("access", 0, 1), KV_NUM("perf-rank", 0, SP_TOPO_MAX_ID),
                      KV_NUM("atomics", 0, 1) };
    int64_t from, to;
    if (n < 3) {
        sp_errf(err, errlen, "expected 'p2p FROM TO [link L] [access 0|1] [perf-rank R] [atomics 0|1]'");
        return SPC_ERR_INVALID_ARG;
    }
    if (!parse_i64(tok[1], 0, SP_TOPO_MAX_ID, &from) || !parse_i64(tok[2], 0, SP_TOPO_MAX_ID, &to)) {
        sp_errf(err, errlen, "p2p '%.64s' '%.64s': the GPUs must be indexes in [0, %d]", tok[1], tok[2],
                SP_TOPO_MAX_ID);
        return SPC_ERR_INVALID_ARG;
    }
    if (!parse_pairs(tok + 3, n - 3, s, (int)(sizeof s / sizeof s[0]), err, errlen))
        return SPC_ERR_INVALID_ARG;
    sp_topo_p2p_t p = { .from = (int32_t)from, .to = (int32_t)to, .link = SP_TOPO_LINK_UNKNOWN,
                        .access = s[1].seen ? (int32_t)s[1].num : -1, .perf_rank = s[2].seen ? (int32_t)s[2].num : -1,
                        .atomics = s[3].seen ? (int32_t)s[3].num : -1 };
    if (s[0].seen) {
        while (++p.link < SP_TOPO_LINKS && strcmp(s[0].str, LINK_NAME[p.link]) != 0)
            ;
        if (p.link == SP_TOPO_LINKS) {
            sp_errf(err, errlen, "link '%.64s' is none of nvl, pix, pxb, phb, sys", s[0].str);
            return SPC_ERR_INVALID_ARG;
        }
    }
    return sp_topo_add_p2p(node, &p, err, errlen);
}

/* One line, tokenized. `*node` is the node the item lines belong to. */
static spc_status_t parse_line(sp_topo_t *topo, sp_topo_node_t **node, char **tok, int n, char *err, size_t errlen)
{
    const char *kw = tok[0];
    int64_t v;

    if (strcmp(kw, "node") == 0) {
        if (n != 2) {
            sp_errf(err, errlen, "expected 'node NAME'");
            return SPC_ERR_INVALID_ARG;
        }
        return sp_topo_add_node(topo, tok[1], node, err, errlen);
    }
    if (strcmp(kw, "cluster") == 0) {
        kv_spec_t s[] = {
            KV_NUM("nodes", 1, SP_TOPO_MAX_NODES), KV_NUM("gpus-per-node", 0, SP_TOPO_MAX_GPUS),
            KV_NUM("numa-per-node", 1, SP_TOPO_MAX_NUMA), KV_NUM("island-size", 0, SP_TOPO_MAX_GPUS),
            KV_NUM("cpus-per-numa", 0, 65536), KV_NUM("nics-per-node", 0, SP_TOPO_MAX_NICS),
            KV_NUM("nic-speed", 1, 100000000), KV_STR("prefix"),
        };
        if (!parse_pairs(tok + 1, n - 1, s, (int)(sizeof s / sizeof s[0]), err, errlen))
            return SPC_ERR_INVALID_ARG;
        if (!s[0].seen || !s[1].seen) {
            sp_errf(err, errlen, "expected 'cluster nodes N gpus-per-node G ...'");
            return SPC_ERR_INVALID_ARG;
        }
        sp_topo_cluster_t c = { .nodes = (uint32_t)s[0].num, .gpus_per_node = (uint32_t)s[1].num,
                                .numa_per_node = s[2].seen ? (uint32_t)s[2].num : 1,
                                .island_size = (uint32_t)s[3].num, .cpus_per_numa = (uint32_t)s[4].num,
                                .nics_per_node = (uint32_t)s[5].num, .nic_speed_mbps = s[6].seen ? s[6].num : -1,
                                .prefix = s[7].str };
        /* Item lines after a cluster line would land on its last node by accident. */
        *node = NULL;
        return sp_topo_add_cluster(topo, &c, err, errlen);
    }
    if (strcmp(kw, "numa") != 0 && strcmp(kw, "nic") != 0 && strcmp(kw, "gpu") != 0 && strcmp(kw, "p2p") != 0) {
        sp_errf(err, errlen, "unknown keyword '%.64s' (node, numa, nic, gpu, p2p, cluster)", kw);
        return SPC_ERR_INVALID_ARG;
    }
    if (*node == NULL) {
        sp_errf(err, errlen, "'%s' line outside a node (a 'node NAME' line comes first)", kw);
        return SPC_ERR_INVALID_ARG;
    }
    if (n < 2) {
        sp_errf(err, errlen, "'%s' needs a value", kw);
        return SPC_ERR_INVALID_ARG;
    }
    if (strcmp(kw, "numa") == 0) {
        kv_spec_t s[] = { KV_STR("cpus") };
        if (!parse_i64(tok[1], 0, SP_TOPO_MAX_ID, &v)) {
            sp_errf(err, errlen, "numa '%.64s' is not an id in [0, %d]", tok[1], SP_TOPO_MAX_ID);
            return SPC_ERR_INVALID_ARG;
        }
        if (!parse_pairs(tok + 2, n - 2, s, 1, err, errlen))
            return SPC_ERR_INVALID_ARG;
        return sp_topo_add_numa(*node, (int32_t)v, s[0].str ? s[0].str : "", err, errlen);
    }
    if (strcmp(kw, "nic") == 0) {
        kv_spec_t s[] = { KV_NUM("numa", 0, SP_TOPO_MAX_ID), KV_NUM("speed", 1, 100000000) };
        if (!parse_pairs(tok + 2, n - 2, s, 2, err, errlen))
            return SPC_ERR_INVALID_ARG;
        return sp_topo_add_nic(*node, tok[1], s[0].seen ? (int32_t)s[0].num : -1, s[1].seen ? s[1].num : -1, err,
                               errlen);
    }
    if (strcmp(kw, "p2p") == 0)
        return parse_p2p(*node, tok, n, err, errlen);
    kv_spec_t s[] = { KV_STR("bus"), KV_NUM("numa", 0, SP_TOPO_MAX_ID), KV_NUM("island", 0, SP_TOPO_MAX_ID) };
    if (!parse_i64(tok[1], 0, SP_TOPO_MAX_ID, &v)) {
        sp_errf(err, errlen, "gpu '%.64s' is not an index in [0, %d]", tok[1], SP_TOPO_MAX_ID);
        return SPC_ERR_INVALID_ARG;
    }
    if (!parse_pairs(tok + 2, n - 2, s, 3, err, errlen))
        return SPC_ERR_INVALID_ARG;
    return sp_topo_add_gpu(*node, (int32_t)v, s[0].str ? s[0].str : "", s[1].seen ? (int32_t)s[1].num : -1,
                           s[2].seen ? (int32_t)s[2].num : -1, err, errlen);
}

spc_status_t sp_topo_parse(const char *text, const char *origin, sp_topo_t **topo_p, char *err, size_t errlen)
{
    sp_topo_t *topo;
    sp_topo_node_t *node = NULL;
    char msg[512], *line = NULL;
    size_t cap = 0;
    unsigned lineno = 0;
    spc_status_t st;

    if ((st = sp_topo_create(&topo)) != SPC_OK) {
        sp_errf(err, errlen, "%s: out of memory", origin);
        return st;
    }
    for (const char *p = text; *p && st == SPC_OK;) {
        const char *eol = strchr(p, '\n');
        size_t len = eol ? (size_t)(eol - p) : strlen(p);
        lineno++;
        if (len + 1 > cap) {
            char *l = realloc(line, len + 1);
            if (l == NULL) {
                sp_errf(err, errlen, "%s:%u: out of memory", origin, lineno);
                st = SPC_ERR_NO_MEMORY;
                break;
            }
            line = l;
            cap = len + 1;
        }
        memcpy(line, p, len);
        line[len] = '\0';
        p += len + (eol != NULL);

        char *tok[MAX_TOKENS];
        int n = tokenize(line, tok);
        if (n < 0) {
            sp_errf(err, errlen, "%s:%u: more than %d words", origin, lineno, MAX_TOKENS);
            st = SPC_ERR_INVALID_ARG;
        } else if (n > 0 && (st = parse_line(topo, &node, tok, n, msg, sizeof msg)) != SPC_OK) {
            sp_errf(err, errlen, "%s:%u: %s", origin, lineno, msg);
        }
    }
    free(line);
    if (st != SPC_OK) {
        sp_topo_free(topo);
        return st;
    }
    *topo_p = topo;
    return SPC_OK;
}

spc_status_t sp_topo_load(const char *path, sp_topo_t **topo_p, char *err, size_t errlen)
{
    FILE *f = fopen(path, "re");
    if (f == NULL) {
        sp_errf(err, errlen, "%s: %s", path, strerror(errno));
        return errno == ENOENT ? SPC_ERR_NOT_FOUND : SPC_ERR_INVALID_ARG;
    }
    spc_status_t st = SPC_OK;
    char *text = NULL;
    size_t len = 0, cap = 0, got;
    do {
        if (len + 4096 + 1 > cap) {
            cap = cap ? cap * 2 : 65536;
            char *t = realloc(text, cap);
            if (t == NULL) {
                sp_errf(err, errlen, "%s: out of memory", path);
                st = SPC_ERR_NO_MEMORY;
                goto out;
            }
            text = t;
        }
        got = fread(text + len, 1, cap - len - 1, f);
        len += got;
        if (len > TOPO_FILE_MAX) {
            sp_errf(err, errlen, "%s: larger than %u MiB", path, TOPO_FILE_MAX >> 20);
            st = SPC_ERR_LIMIT;
            goto out;
        }
    } while (got > 0);
    if (ferror(f)) {
        sp_errf(err, errlen, "%s: read error", path);
        st = SPC_ERR_INVALID_ARG;
        goto out;
    }
    text[len] = '\0';
    if (memchr(text, '\0', len) != NULL) {
        sp_errf(err, errlen, "%s: not a text file (it holds a NUL byte)", path);
        st = SPC_ERR_INVALID_ARG;
        goto out;
    }
    st = sp_topo_parse(text, path, topo_p, err, errlen);
out:
    free(text);
    fclose(f);
    return st;
}

void sp_topo_dump_node(const sp_topo_node_t *node, FILE *out)
{
    fprintf(out, "node %s\n", node->name);
    for (uint32_t i = 0; i < node->nnuma; i++) {
        const sp_topo_numa_t *m = &node->numa[i];
        fprintf(out, "numa %" PRId32 "%s%s\n", m->id, m->cpus[0] ? " cpus " : "", m->cpus);
    }
    for (uint32_t i = 0; i < node->nnics; i++) {
        const sp_topo_nic_t *n = &node->nics[i];
        fprintf(out, "nic %s", n->name);
        if (n->numa >= 0)
            fprintf(out, " numa %" PRId32, n->numa);
        if (n->speed_mbps > 0)
            fprintf(out, " speed %" PRId64, n->speed_mbps);
        fputc('\n', out);
    }
    for (uint32_t i = 0; i < node->ngpus; i++) {
        const sp_topo_gpu_t *g = &node->gpus[i];
        fprintf(out, "gpu %" PRId32, g->index);
        if (g->bus[0])
            fprintf(out, " bus %s", g->bus);
        if (g->numa >= 0)
            fprintf(out, " numa %" PRId32, g->numa);
        if (g->island >= 0)
            fprintf(out, " island %" PRId32, g->island);
        fputc('\n', out);
    }
    for (uint32_t i = 0; i < node->np2p; i++) {
        const sp_topo_p2p_t *p = &node->p2p[i];
        fprintf(out, "p2p %" PRId32 " %" PRId32, p->from, p->to);
        if (p->link >= 0)
            fprintf(out, " link %s", LINK_NAME[p->link]);
        if (p->access >= 0)
            fprintf(out, " access %" PRId32, p->access);
        if (p->perf_rank >= 0)
            fprintf(out, " perf-rank %" PRId32, p->perf_rank);
        if (p->atomics >= 0)
            fprintf(out, " atomics %" PRId32, p->atomics);
        fputc('\n', out);
    }
}

void sp_topo_dump(const sp_topo_t *topo, FILE *out)
{
    for (uint32_t i = 0; i < topo->nnodes; i++)
        sp_topo_dump_node(&topo->nodes[i], out);
}
