/*
 * devices.h — what this node offers: GPUs and transports, as `spctl status` shows.
 */
#ifndef SP_DEVICES_H
#define SP_DEVICES_H

#include "sp_topo.h"

#define SP_MAX_GPUS_SHOWN 16

typedef struct sp_devices {
    int  gpu_count;                          /* -1: could not look */
    char gpu_names[SP_MAX_GPUS_SHOWN][96];
    char gpu_bus[SP_TOPO_MAX_GPUS][SP_TOPO_BUS_MAX];   /* PCI bus ids, by driver index; "" when not known */
    char gpu_status[160];                    /* why there are none, or the driver version */
    char shm[64];
    char ucx[96];
    char nccl[160];
} sp_devices_t;

/* Looks once, at startup, before any thread is started (it forks). Logs what it
 * found. nccl_library: the config's (empty: the build's, then the loader's). */
void sp_devices_probe(sp_devices_t *d, const char *nccl_library);

#endif /* SP_DEVICES_H */
