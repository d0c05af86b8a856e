/*
 * topo.h — this node's topology: discovered from /sys, or read from the
 * topology file the config names (topology_file). The model and its text
 * format are common/sp_topo.h; `spctl topo` shows the result.
 */
#ifndef SP_DAEMON_TOPO_H
#define SP_DAEMON_TOPO_H

#include <stddef.h>

#include "base/err.h"
#include "gpu/devices.h"
#include "sp_topo.h"
#include "spclient/status.h"

/*
 * Discovers this node under `sysfs` (the mount point, "/sys"; tests give a
 * fake tree): every sysfs/devices/system/node/nodeN with its cpulist (one
 * NUMA node 0 with sysfs/devices/system/cpu/online when there is none), every
 * interface of sysfs/class/net backed by a device (lo and virtual ones have
 * no `device` link), with its NUMA node and speed where sysfs says them, and
 * the GPUs of `dev` (see sp_topo_gpus_hook in topo.c). `node` names the node;
 * characters the format cannot hold become '_'. What cannot be read stays
 * unknown; only running out of memory fails. Returns SPC_OK with a one-node
 * topology in *topo_p, or SPC_ERR_NO_MEMORY.
 */
spc_status_t sp_topo_discover(const char *sysfs, const char *node, const sp_devices_t *dev, sp_topo_t **topo_p,
                              sp_err_t *e);

/*
 * Reads this node from a topology file: the file's only node, else its node
 * named `node`. Returns SPC_OK with a one-node topology in *topo_p, or an error
 * in e (the file's own, with its line; or that no node matches).
 */
spc_status_t sp_topo_load_node(const char *path, const char *node, sp_topo_t **topo_p, sp_err_t *e);

#endif /* SP_DAEMON_TOPO_H */
