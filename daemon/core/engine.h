/*
 * engine.h — the daemon's data plane: the engine's state, shared by the loop
 * and the progress thread, and the progress thread itself. What it drives
 * declares its own types (client.h, mem.h, job.h, coll.h, mesh.h, exec.h, ...).
 * Rules: that state is touched only under sp_engine.lock; completions are
 * posted only under it (one CQ producer); data moves with it dropped, and a
 * task pins the clients it uses. The layers above are reached only through
 * core/transport.h. The story (threads, the path of one op):
 * docs/architecture.md, "The engine: lock and progress thread".
 */
#ifndef SP_ENGINE_H
#define SP_ENGINE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

#include "sp_topo.h"
#include "spclient/status.h"
#include "base/config.h"
#include "core/job.h"
#include "core/stats.h"

#define SP_ENDED_JOBS 64     /* job ids remembered after their end */

typedef struct sp_engine sp_engine_t;
typedef struct sp_client sp_client_t;
typedef struct sp_job sp_job_t;
typedef struct sp_task sp_task_t;
typedef struct sp_nccl sp_nccl_t;

/* Progress → loop notifications, drained by the loop's uv_async callback. */
typedef struct sp_engine_events {
    uint64_t *doomed_ids;         /* clients to disconnect */
    uint32_t  ndoomed, cap;
    bool      drained;            /* draining and nothing left in flight */
} sp_engine_events_t;

struct sp_engine {
    pthread_mutex_t  lock;
    const sp_config_t *cfg;
    char             node[64];
    const sp_topo_t *topo;               /* this node, as node 0 (main.c owns it); NULL: not known */

    sp_client_t     *clients;
    uint32_t         nclients;
    uint64_t         next_client_id;
    sp_job_t        *jobs;
    uint32_t         njobs;
    /* The ids of the last jobs that ended, so that a late join hears "ended"
     * rather than "no such job". A ring: ended_next is the next slot to write. */
    char             ended_jobs[SP_ENDED_JOBS][SP_JOB_ID_MAX];
    uint32_t         ended_next;
    sp_node_wait_t  *node_waits;         /* daemons whose return complete jobs wait for (job.c) */
    uint32_t         next_group_id;
    uint32_t         next_region_id;
    /* The node's resume key (auth.h, tickets), which the server reads or makes
     * at start-up; resume_key_set false: no job can be resumed here. */
    uint8_t          resume_key[SP_AUTH_KEY_BYTES];
    bool             resume_key_set;
    uint64_t         next_deadline_ns;   /* earliest collective deadline; UINT64_MAX: none */

    /* The progress thread sleeps in epoll on every client's wake_fd and on
     * kick_fd, which the daemon's other threads write to (sp_engine_kick). */
    int              wake_epfd;
    int              kick_fd;

    /* Completions posted while wakes are held (sp_engine_wakes_hold): the
     * clients whose waiters are woken at the release. */
    uint32_t         wake_hold;
    sp_client_t     *wake_due;

    /* Progress thread. */
    pthread_t        thread;
    bool             thread_started;
    atomic_bool      stop;
    atomic_bool      draining;
    bool             sleeping;           /* the progress thread armed the wake flags (under the lock) */
    _Atomic uint64_t heartbeat;          /* bumped every pass and every wake */
    int              progress_cpu;       /* where the progress thread runs now */
    bool             stacked;            /* a pass woke a client sleeping on that CPU */
    int64_t          max_sleep_ns;       /* cap from the watchdog; 0: none */

    /* Collectives ready to run, in the order they became ready (tasks run one
     * at a time, so ops on a group execute in order). */
    sp_task_t       *ready, *ready_tail;
    sp_client_t     *zombies;            /* destroyed while pinned */
    struct sp_workers *workers;          /* copy helpers (workers.c) */
    uint32_t         copy_threads;       /* threads a large copy uses, the progress thread included */
    bool             mem_via_proc;       /* client memory through /proc/<pid>/mem (mem.c) */
    uint64_t         stream_min_bytes;   /* tasks writing this much use streaming stores */
    uint32_t         ncpus;              /* CPUs the daemon may run on */
    /* Registered memory's staging (exec.c), at most staging_bytes, kept from
     * task to task while they come. The progress thread's alone. */
    uint8_t         *stage;
    uint64_t         stage_cap, stage_used_ns;

    sp_engine_events_t events;
    void           (*notify)(void *arg); /* wakes the loop (uv_async_send) */
    void            *notify_arg;

    /* The transports that carry out the engine's work above it, and their
     * state, which only they read (core/transport.h); NULL: absent. */
    const struct sp_transport_ops *gpu_ops;    /* imports and client streams (gpu/) */
    const struct sp_transport_ops *net_ops;    /* host data across daemons (cluster/net.c) */
    const struct sp_transport_ops *xdev_ops;   /* device data across daemons (cluster/nccl.c) */
    struct sp_gpu_sched *gpu_sched;            /* gpu/stream.h */
    struct sp_net   *net;
    sp_nccl_t       *nccl;
    /* A rank of this daemon left a job that has ranks on other daemons (before
     * the world was complete: its join is taken back). The server tells them.
     * Called with the lock held, on the loop thread. */
    void           (*on_member_left)(void *arg, sp_job_t *job, uint32_t rank, bool complete, const char *why);
    void            *hook_arg;

    uint64_t         ops_total, ops_failed, bytes_moved;
    uint64_t         clients_resumed;    /* clients of the spd before this one taken over (spd.proto, Resume) */
    uint64_t         started_ns;
    sp_stats_t       stats;              /* per op kind and group, and the flight recorders (stats.c) */
};

/* ---------------------------------------------------------------- engine.c */

int  sp_engine_init(sp_engine_t *eng, const sp_config_t *cfg, const char *node);
void sp_engine_cleanup(sp_engine_t *eng);
int  sp_engine_start(sp_engine_t *eng);
/* Stops the progress thread; call after sp_engine_shutdown. */
void sp_engine_stop(sp_engine_t *eng);
/* Stops for a restart (SIGUSR2): the progress thread and the copy workers as
 * sp_engine_stop does, but ops still with a transport's thread (NCCL) are not
 * failed: those whose exchange is under way finish (for a while), the others
 * their ranks give to the next spd. Returns with the engine lock held, for
 * the caller to keep until it exits, so that no thread completes anything
 * more. */
void sp_engine_halt(sp_engine_t *eng);
/* Wakes the progress thread (after the loop changed something it must see). */
void sp_engine_kick(sp_engine_t *eng);

/* Refuses new collectives from now on; in-flight ones may finish. */
void sp_engine_drain(sp_engine_t *eng);
/* Fails everything still in flight with SPC_ERR_SHUTTING_DOWN and tells every
 * client the daemon is gone. Caller holds the lock. */
void sp_engine_shutdown_locked(sp_engine_t *eng);
/* Ops consumed and not completed, over all clients. Caller holds the lock. */
uint32_t sp_engine_inflight_locked(sp_engine_t *eng);

/*
 * The completions of one collective are published together: between a hold
 * and its release, posting a completion wakes nobody; the release wakes every
 * client that got one. A rank woken at once would run on, and take the CPU from
 * the thread still posting the others' completions; an spd killed in that
 * window leaves its ranks disagreeing on what completed (a new spd fails that
 * collective: docs/architecture.md, "Restarting spd under running jobs"). Holds
 * nest. Caller holds the lock from the hold to the release.
 */
void sp_engine_wakes_hold(sp_engine_t *eng);
void sp_engine_wakes_release(sp_engine_t *eng);

/* Clients that broke the protocol, or that spd can serve no longer, are handed
 * to the loop through this; it tells them st and why, and drops them. Caller
 * holds the lock. */
void sp_engine_doom(sp_engine_t *eng, sp_client_t *c, spc_status_t st, const char *why);

uint64_t sp_now_ns(void);

#endif /* SP_ENGINE_H */
