/*
 * server.h — the control plane: the libuv loop, the Unix socket, sessions.
 */
#ifndef SP_SERVER_H
#define SP_SERVER_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "base/config.h"
#include "base/err.h"
#include "gpu/devices.h"
#include "core/engine.h"
#include "gpu/gpu.h"
#include "cluster/peer.h"

/* spd's exit status after SIGUSR2 (server.c): 75, EX_TEMPFAIL. Not 0, so that
 * systemd's Restart=on-failure starts the next spd at once. */
#define SP_EXIT_RESTART 75
#include "obs/metrics.h"
#include "sp_msg.h"

typedef struct sp_session sp_session_t;

typedef struct sp_server {
    uv_loop_t         *loop;
    sp_engine_t       *eng;
    sp_config_t       *cfg;            /* its live options change on SIGHUP (sp_server_reload) */
    const sp_config_args_t *cfg_args;  /* where cfg was read from, read again on SIGHUP */
    char               socket_path[108];
    char               node[64];
    long               allow_gid;
    sp_devices_t       devices;
    sp_peers_t         peers;          /* the other daemons (peer.c) */
    struct sp_metrics_http *metrics_http;   /* GET /metrics (metrics_http.c); NULL: off */
    uv_poll_t          net_poll;       /* the UCX worker's fd, while the progress thread sleeps */
    bool               net_polling;
    uv_timer_t         grace_timer;    /* at the end of the next node wait (peer_restart_grace_ms); with net_poll */
    struct sp_name_lookup *lookups;    /* named joins looking for their name's home (cluster_names.c) */
    uint32_t           nlookups;
    uint64_t           lookup_round;   /* the last round asked, of any lookup */
    uv_timer_t         lookup_tick;    /* every name_lookup_ms while lookups wait */
    bool               lookup_clock;   /* lookup_tick is initialised */

    uv_pipe_t          listener;
    bool               listening;
    uv_poll_t          signals;        /* reads the signals spd blocks (sp_server_block_signals) */
    int                signal_fd;
    uv_timer_t         watchdog;
    uv_timer_t         drain_timer;
    uv_async_t         async;
    uint64_t           watchdog_usec;
    uint64_t           watchdog_beat;

    sp_session_t      *sessions;
    uint32_t           nsessions;
    uint64_t           refused[SP_REFUSED_REASONS];   /* hellos refused, by reason (obs/metrics.h) */
    uint32_t           protocol_max;                  /* the highest client protocol served (protocol_max) */
    uint32_t           by_protocol[SP_PROTOCOL_VERSION + 1];   /* sessions by the protocol chosen; [0]: no hello yet */
    uint64_t           started_ns;
    bool               draining;
    bool               closing;
} sp_server_t;

/* Blocks SIGTERM, SIGINT, SIGHUP and SIGUSR2, which spd reads from a signalfd
 * on its loop: call first in main, before any thread exists. */
void sp_server_block_signals(void);

/* Binds the socket (creating its directory), sets up signals and timers.
 * SPC_OK, or the error (logged where it was seen) in e, nothing of the server
 * left on the loop. */
spc_status_t sp_server_init(sp_server_t *srv, uv_loop_t *loop, sp_engine_t *eng, sp_config_t *cfg,
                            const sp_config_args_t *cfg_args, const char *node, const char *socket_path, sp_err_t *e);
/* Reads the configuration again as it was read at start (file, environment,
 * --set) and applies the options that can change live (sp_option_t.live); the
 * others keep their values until the next start, and the log says which
 * differ. A configuration whose options disagree is refused whole, logged.
 * Reopens the log file. Loop thread (SIGHUP). */
void sp_server_reload(sp_server_t *srv);
/* Runs the loop until shutdown has finished. */
int sp_server_run(sp_server_t *srv);

/*
 * The checks of one request that come before anything acts on it: no
 * descriptor taken, no lock, no driver (the fuzzer of tests/fuzz calls them
 * without a daemon). A RegisterDeviceReq: the handle, UUID and bus id lengths,
 * then the range and the chunk list (sp_region_check_device); on SPC_OK *x
 * describes it and *chunks_p is its cuMem chunks (descriptor numbers still the
 * client's; NULL for CUDA IPC), which the caller frees. A StreamCreateReq: the
 * UUID and bus id lengths. Otherwise the error in e.
 */
spc_status_t sp_server_check_register_device(const Spd__RegisterDeviceReq *r, sp_gpu_export_t *x,
                                             sp_gpu_chunk_t **chunks_p, sp_err_t *e);
spc_status_t sp_server_check_stream_create(const Spd__StreamCreateReq *r, sp_err_t *e);

/* What the metrics are rendered from (obs/metrics.h): parts of the server that
 * live as long as it does. */
sp_metrics_source_t sp_server_metrics_source(sp_server_t *srv);

#endif /* SP_SERVER_H */
