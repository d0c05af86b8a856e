/*
 * sp_topo.h — the topology of nodes: NUMA nodes, NICs and GPUs, and the text
 * format daemons and operators exchange it in. No I/O besides sp_topo_load and
 * the dump's FILE; no logging: errors come back as a status and a message.
 *
 * A daemon discovers its own node (daemon/cluster/topo.c) or reads it from a file; the
 * placement (sp_place.h) and `spctl plan` work on a whole cluster of them, so
 * that placement is testable without the hardware and can be planned for
 * clusters far larger than any test machine.
 *
 * The text format: one item per line, `#` starts a comment, blank lines are
 * ignored. Every line is a keyword, a value, then optional `key value` pairs:
 *
 *   node NAME                          starts a node; the lines below describe it
 *   numa ID [cpus LIST]                a NUMA node; LIST like 0-7,16-23 (none: no CPUs)
 *   nic NAME [numa ID] [speed MBPS]    a network interface, its NUMA node and link speed
 *   gpu INDEX [bus BUSID] [numa ID] [island ID]
 *                                      a GPU: its driver index, PCI bus id, NUMA node
 *                                      and NVLink island (GPUs of one island reach each
 *                                      other over NVLink/NVSwitch)
 *   p2p FROM TO [link L] [access A] [perf-rank R] [atomics A]
 *                                      what GPU FROM has of GPU TO (driver indexes,
 *                                      both declared by gpu lines first): the link
 *                                      between them (L below), whether FROM can map
 *                                      TO's memory (access 1 or 0:
 *                                      cuDeviceCanAccessPeer), the driver's
 *                                      performance rank of that access (0 is the
 *                                      best) and whether atomics across it are
 *                                      native (1 or 0); one line per ordered pair
 *   cluster nodes N gpus-per-node G [numa-per-node M] [island-size I]
 *           [cpus-per-numa C] [nics-per-node K] [nic-speed MBPS] [prefix P]
 *                                      N synthetic nodes named P0, P1, ... (P: "node"),
 *                                      each with M NUMA nodes of C CPUs (M: 1, C: none),
 *                                      G GPUs spread over the NUMA nodes in blocks,
 *                                      islands of I consecutive GPUs (0, the default:
 *                                      no NVLink), and K NICs nic0.. spread likewise
 *
 * The links, best first, with NCCL's names for them (its topology detection
 * classifies paths the same way):
 *
 *   nvl   NVLink, directly or through NVSwitches
 *   pix   PCIe through one switch
 *   pxb   PCIe through several switches or bridges, below one root port's
 *         host bridge without crossing it
 *   phb   PCIe through a CPU's host bridge (root complex): the same socket
 *   sys   across the link between CPU sockets
 *
 * An omitted field is unknown (-1 in memory) and is omitted again by the dump.
 * A nic's or gpu's NUMA node must be declared (by a numa line) before it. The
 * dump writes every node out explicitly, `cluster` lines expanded, in the order
 * they were read; loading a dump and dumping it again gives the same text.
 *
 * The dump writes p2p lines after the node's gpu lines, in the order read.
 *
 * Limits: SP_TOPO_MAX_NODES nodes; per node SP_TOPO_MAX_NUMA NUMA nodes,
 * SP_TOPO_MAX_NICS NICs and SP_TOPO_MAX_GPUS GPUs (and so at most
 * SP_TOPO_MAX_GPUS x (SP_TOPO_MAX_GPUS - 1) p2p lines); names of at most
 * SP_TOPO_NAME_MAX - 1 printable bytes without spaces or '#'.
 */
#ifndef SP_TOPO_H
#define SP_TOPO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "spclient/status.h"

#define SP_TOPO_MAX_NODES  16384
#define SP_TOPO_MAX_NUMA   64
#define SP_TOPO_MAX_NICS   256
#define SP_TOPO_MAX_GPUS   64
#define SP_TOPO_MAX_ID     65535    /* NUMA node ids, GPU indexes, island ids */
#define SP_TOPO_NAME_MAX   64       /* node and NIC names, with the NUL */
#define SP_TOPO_BUS_MAX    32       /* PCI bus id "0000:1b:00.0", with the NUL */

typedef struct sp_topo_numa {
    int32_t id;
    char   *cpus;                    /* "0-7,16-23"; "" when it has none */
} sp_topo_numa_t;

typedef struct sp_topo_nic {
    char    name[SP_TOPO_NAME_MAX];
    int32_t numa;                    /* -1: unknown */
    int64_t speed_mbps;              /* -1: unknown */
} sp_topo_nic_t;

typedef struct sp_topo_gpu {
    int32_t index;                   /* the driver's device index */
    char    bus[SP_TOPO_BUS_MAX];    /* lower case; "" when unknown */
    int32_t numa;                    /* -1: unknown */
    int32_t island;                  /* NVLink island; -1: none or unknown */
} sp_topo_gpu_t;

/* The link between two GPUs, best first (the format's names: sp_topo_link_name). */
typedef enum sp_topo_link {
    SP_TOPO_LINK_UNKNOWN = -1,
    SP_TOPO_LINK_NVL,                /* NVLink or NVSwitch */
    SP_TOPO_LINK_PIX,                /* one PCIe switch */
    SP_TOPO_LINK_PXB,                /* PCIe bridges below one root port */
    SP_TOPO_LINK_PHB,                /* a CPU's PCIe host bridge */
    SP_TOPO_LINK_SYS,                /* across CPU sockets */
    SP_TOPO_LINKS
} sp_topo_link_t;

/* What GPU `from` has of GPU `to` (a `p2p` line). */
typedef struct sp_topo_p2p {
    int32_t from, to;                /* driver indexes of GPUs of the node */
    int32_t link;                    /* sp_topo_link_t */
    int32_t access;                  /* 1: from can map to's memory; 0: it cannot; -1: unknown */
    int32_t perf_rank;               /* the driver's rank of that access, 0 best; -1: unknown */
    int32_t atomics;                 /* 1: native atomics across it; 0: not; -1: unknown */
} sp_topo_p2p_t;

typedef struct sp_topo_node {
    char            name[SP_TOPO_NAME_MAX];
    uint32_t        nnuma, nnics, ngpus, np2p;
    sp_topo_numa_t *numa;
    sp_topo_nic_t  *nics;
    sp_topo_gpu_t  *gpus;
    sp_topo_p2p_t  *p2p;
    uint32_t        numa_cap, nics_cap, gpus_cap, p2p_cap;
} sp_topo_node_t;

typedef struct sp_topo {
    uint32_t        nnodes, nodes_cap;
    sp_topo_node_t *nodes;
} sp_topo_t;

/* Parameters of a `cluster` line. */
typedef struct sp_topo_cluster {
    uint32_t    nodes, gpus_per_node, numa_per_node, island_size, cpus_per_numa, nics_per_node;
    int64_t     nic_speed_mbps;      /* -1: unknown */
    const char *prefix;              /* NULL: "node" */
} sp_topo_cluster_t;

/* An empty topology. Returns SPC_OK or SPC_ERR_NO_MEMORY. */
spc_status_t sp_topo_create(sp_topo_t **topo_p);
/* Frees a topology; accepts NULL and half-built ones. */
void sp_topo_free(sp_topo_t *topo);

/*
 * Building: each call checks its item (names, ranges, limits, duplicates, that
 * a referenced NUMA node exists) and adds it, or leaves the topology as it was
 * and returns SPC_ERR_INVALID_ARG, SPC_ERR_LIMIT or SPC_ERR_NO_MEMORY with the
 * reason in err. *node_p, when given, is set only on success and stays valid
 * until the next node is added.
 */
spc_status_t sp_topo_add_node(sp_topo_t *topo, const char *name, sp_topo_node_t **node_p, char *err, size_t errlen);
spc_status_t sp_topo_add_numa(sp_topo_node_t *node, int32_t id, const char *cpus, char *err, size_t errlen);
spc_status_t sp_topo_add_nic(sp_topo_node_t *node, const char *name, int32_t numa, int64_t speed_mbps, char *err,
                             size_t errlen);
spc_status_t sp_topo_add_gpu(sp_topo_node_t *node, int32_t index, const char *bus, int32_t numa, int32_t island,
                             char *err, size_t errlen);
/* Adds a p2p line: both GPUs declared, not the same one, the pair not there yet. */
spc_status_t sp_topo_add_p2p(sp_topo_node_t *node, const sp_topo_p2p_t *p, char *err, size_t errlen);
/* Adds the nodes of a `cluster` line; all of them or none. */
spc_status_t sp_topo_add_cluster(sp_topo_t *topo, const sp_topo_cluster_t *c, char *err, size_t errlen);

/* Keeps node `index` alone, as node 0, and frees the others (index < nnodes). */
void sp_topo_keep_node(sp_topo_t *topo, uint32_t index);

/* Whether s is a CPU list: "N" or "N-M" (N <= M) items joined by commas, or "". */
int sp_topo_cpus_valid(const char *s);

/*
 * Parses the text format. `origin` names the text in messages ("FILE:LINE:
 * reason"). On success *topo_p is a new topology; on failure nothing is
 * returned and err names the first bad line.
 */
spc_status_t sp_topo_parse(const char *text, const char *origin, sp_topo_t **topo_p, char *err, size_t errlen);
/* Reads and parses a file (at most 64 MiB). */
spc_status_t sp_topo_load(const char *path, sp_topo_t **topo_p, char *err, size_t errlen);

/* Writes the text format: every node, every item, in order. */
void sp_topo_dump(const sp_topo_t *topo, FILE *out);
void sp_topo_dump_node(const sp_topo_node_t *node, FILE *out);

/* The node named `name`, or NULL. */
const sp_topo_node_t *sp_topo_find_node(const sp_topo_t *topo, const char *name);
/* The node's NUMA node `id`, or NULL. */
const sp_topo_numa_t *sp_topo_find_numa(const sp_topo_node_t *node, int32_t id);
/* The node's GPU with driver index `index`, or NULL. */
const sp_topo_gpu_t *sp_topo_find_gpu(const sp_topo_node_t *node, int32_t index);
/* The node's GPU whose bus id is `bus` (as sp_topo_bus_id writes it), or NULL. */
const sp_topo_gpu_t *sp_topo_find_gpu_bus(const sp_topo_node_t *node, const char *bus);
/* A PCI bus id as the driver writes it ("0000:1B:00.0", or with a 32-bit
 * domain "00000000:1B:00.0") as sysfs and the format write it: lower case, a
 * 16-bit domain. False (out untouched) when `id` is not a bus id. */
bool sp_topo_bus_id(const char *id, char out[SP_TOPO_BUS_MAX]);
/* The node's p2p line from GPU `from` to GPU `to`, or NULL. */
const sp_topo_p2p_t *sp_topo_find_p2p(const sp_topo_node_t *node, int32_t from, int32_t to);

/* "nvl", "pix", ...: the format's name of a link; "unknown" for any other value. */
const char *sp_topo_link_name(int link);
/* The link in words for messages: "NVLink", "one PCIe switch", ... */
const char *sp_topo_link_words(int link);

/*
 * The link between GPUs a and b of the node (driver indexes), the slower of
 * the two directions' p2p lines where both say; where neither says, what the
 * gpu lines imply: one NVLink island is nvl, one NUMA node phb, two NUMA nodes
 * sys. SP_TOPO_LINK_UNKNOWN when nothing says.
 */
int sp_topo_gpu_link(const sp_topo_node_t *node, int32_t a, int32_t b);

/*
 * sp_topo_gpu_link for every pair of the node's GPUs at once, by position in
 * node->gpus: link[a][b] for gpus[a] and gpus[b] (SP_TOPO_LINK_UNKNOWN on the
 * diagonal). With `stated` only what the topology says outright counts: p2p
 * lines and NVLink islands, not what NUMA nodes imply.
 */
void sp_topo_link_matrix(const sp_topo_node_t *node, bool stated, int8_t link[SP_TOPO_MAX_GPUS][SP_TOPO_MAX_GPUS]);

/* How an op from GPU `from` to GPU `to` moves data, by the topology. */
typedef enum sp_topo_route {
    SP_TOPO_ROUTE_UNKNOWN,           /* no p2p line, or one that does not say access */
    SP_TOPO_ROUTE_PEER,              /* peer access: kernels on one GPU read the other's memory */
    SP_TOPO_ROUTE_STAGED,            /* no peer access: staged through host memory */
} sp_topo_route_t;

/* The route the topology chooses for from -> to, and in `why` (optional) the
 * reason in words ("peer access over NVLink (performance rank 0, native
 * atomics)", "staged through host memory: GPU 0 cannot map GPU 1's memory (no
 * peer access)"). */
sp_topo_route_t sp_topo_p2p_route(const sp_topo_node_t *node, int32_t from, int32_t to, char *why, size_t whylen);

#endif /* SP_TOPO_H */
