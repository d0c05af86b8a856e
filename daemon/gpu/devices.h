/*
 * devices.h — what this node offers: GPUs and transports, as `spctl status` shows.
 */
#ifndef SP_DEVICES_H
#define SP_DEVICES_H

#include <stdbool.h>
#include <stdint.h>

#include "sp_topo.h"

#define SP_MAX_GPUS_SHOWN 16

/* What the driver says of one GPU's access to another. */
typedef struct sp_gpu_peer {
    int8_t  access;                          /* cuDeviceCanAccessPeer: 1 or 0; -1: it did not answer */
    int8_t  atomics;                         /* ..._NATIVE_ATOMIC_SUPPORTED: 1 or 0; -1 */
    int32_t perf_rank;                       /* ..._PERFORMANCE_RANK, 0 best; -1 */
} sp_gpu_peer_t;

typedef struct sp_devices {
    int  gpu_count;                          /* -1: could not look */
    char gpu_names[SP_MAX_GPUS_SHOWN][96];
    char gpu_bus[SP_TOPO_MAX_GPUS][SP_TOPO_BUS_MAX];   /* PCI bus ids, by driver index; "" when not known */
    bool gpu_peers_asked;                    /* gpu_peer holds the driver's answers */
    sp_gpu_peer_t gpu_peer[SP_TOPO_MAX_GPUS][SP_TOPO_MAX_GPUS];   /* [from][to], from != to */
    char gpu_status[160];                    /* why there are none, or the driver version */
    char shm[64];
    char ucx[96];
    char nccl[160];
} sp_devices_t;

/* Looks once, at startup, before any thread is started (it forks). Logs what it
 * found. nccl_library: the config's (empty: the build's, then the loader's). */
void sp_devices_probe(sp_devices_t *d, const char *nccl_library);

#endif /* SP_DEVICES_H */
