/*
 * stream.h — device tasks on the daemon's GPU streams, and the stream order of
 * clients' ops (stream.c says how). The engine reaches them through the GPU
 * layer's transport ops (sp_gpu_install, core/transport.h) and keeps their
 * state only as a pointer (eng->gpu_sched); the control plane opens and closes
 * streams, and reads the counts.
 */
#ifndef SP_STREAM_H
#define SP_STREAM_H

#include <stdbool.h>
#include <stdint.h>

#include "base/err.h"
#include "core/client.h"
#include "core/engine.h"
#include "core/exec.h"
#include "sp_topo.h"

/* Device tasks on the daemon's streams at once. Beyond it, matched tasks wait:
 * the driver's launch queue is finite, and a launch that blocks on it, behind
 * a wait for a client's stream, must never stall spd. */
#define SP_GPU_FLIGHT_MAX 32

/* A device task on the daemon's streams. */
typedef struct sp_gpu_flight {
    sp_task_t          *task;
    struct sp_gpu_mark *mark;        /* on its first rank's GPU, after everything of it */
    struct sp_gpu_mark *joined[SP_TOPO_MAX_GPUS];   /* each other GPU's part, which the mark waited for */
    uint32_t            njoined;
    struct sp_gpu_hstage *staged;    /* pinned host memory its inputs were staged through */
    uint64_t            deadline_ns;
    int                 gpu;
    bool                warned;
    bool                forced;      /* taken as run (spd exiting) */
} sp_gpu_flight_t;

/* A stream task matched before its turn, with the time it gives up. */
typedef struct sp_gpu_parked {
    sp_task_t *task;
    uint64_t   deadline_ns;
} sp_gpu_parked_t;

/* The GPU layer's state in an engine (eng->gpu_sched, made by sp_gpu_install,
 * freed by its cleanup op): what runs on the daemon's streams and what waits
 * for them, and the counts status and metrics show. Under the engine lock. */
typedef struct sp_gpu_sched {
    sp_gpu_flight_t  flight[SP_GPU_FLIGHT_MAX];   /* in the order they were put there */
    uint32_t         nflight;
    sp_task_t      **held;           /* host-synchronous tasks waiting for room */
    uint32_t         nheld, held_cap;
    sp_gpu_parked_t *parked;
    uint32_t         nparked, parked_cap;
    bool             stopping;       /* spd is going: nothing more starts */
    uint64_t         stream_ops, stream_timeouts;
    uint64_t         multi_ops;      /* tasks started on several GPUs */
    uint64_t         staged_ops;     /* of them, those that staged an input through host memory */
    /* Clients' GPU allocations (gpu_import.c): open now, ever opened, and opened
     * again because an address came back with another buffer id. */
    uint32_t         imports;
    uint64_t         imports_total, reimports;
} sp_gpu_sched_t;

/* What status and metrics show of the GPU layer; zeros where it is absent. */
typedef struct sp_gpu_counts {
    uint64_t imports, imports_total, reimports;
    uint64_t streams;                /* clients' streams open */
    uint64_t stream_ops;             /* ops started in stream order, ever */
    uint64_t stream_timeouts;
    uint64_t multi_ops, staged_ops;  /* tasks started on several GPUs; those staged through host memory */
    uint64_t tasks;                  /* on a GPU, or waiting for their turn */
    uint64_t gpus_failed;            /* out of service: their context failed (sp_gpu_fault) */
    uint64_t lanes;                  /* spd's streams open, on every GPU */
    uint64_t lanes_max;              /* on any one GPU (gpu_lanes_max, within the hardware queues) */
    uint64_t lanes_refused;          /* streams refused past lanes_max, ever */
} sp_gpu_counts_t;

/* One seq of a client stream between consumed and started. */
typedef struct sp_stream_slot {
    sp_task_t *task;          /* matched and waiting for its turn; NULL: not yet */
    bool       failed;        /* completed without running: only its done is owed */
    bool       settled;       /* not yet consumed: a stream taken back says the spd before failed it (its
                               * client took the completion); taken as failed when its turn comes */
} sp_stream_slot_t;

/* A client's GPU stream: the order its ops start in, and its semaphores
 * (c->v.sems[slot], c->sems_dptr in the daemon). */
typedef struct sp_dstream {
    uint32_t          slot;
    int               gpu;
    bool              broken;        /* refuses ops; its done is poisoned once nothing of it runs */
    uint64_t          gave_up_at;    /* its ready was poisoned there: no input of this seq or later came; 0: none */
    bool              closing;       /* given back while ops were in flight: freed after them */
    bool              late_writes;   /* a lane of spd's that did not drain may still write its done */
    uint64_t          consumed;      /* the last seq taken from the SQ */
    uint64_t          started;       /* the last seq on the daemon's stream, or settled without running */
    sp_stream_slot_t *win;           /* [win_mask + 1], by seq: (started, consumed] */
    uint32_t          win_mask;
    uint32_t          nflight;       /* its tasks on the daemon's stream, oldest first: */
    uint32_t          flight_head;
    uint64_t          flight_seq[SP_GPU_FLIGHT_MAX];
    uint64_t          flight_owed[SP_GPU_FLIGHT_MAX];   /* done to store once that task ran (failed seqs after it) */
    uint64_t          ops;           /* ops started on it */
    uint64_t          done_ns;       /* its latest task here finished (its done passed): the next op's timeout
                                      * runs for its client's stream from then at the earliest */
    struct sp_gpu_lane *lane;        /* the daemon's stream for the tasks it leads */
    struct sp_gpu_mark *last_mark;   /* its latest task's, while that runs: a task on another lane waits for it */
    char              broken_detail[160];
} sp_dstream_t;

/* Stream order for device ops (spclient.h "GPU streams"). Every call holds the lock. */
spc_status_t sp_stream_open(sp_engine_t *eng, sp_client_t *c, const char *pci_bus_id, const uint8_t *uuid,
                            int client_ordinal, uint32_t *slot_p, sp_err_t *e);
/* A stream of a client taken over from the spd before (spd.proto, StreamCreateReq.resume), back at its slot:
 * its ops go on after `done`, the nsettled ops of `settled` (ascending, past done) taken as failed in their
 * turn; `ready` is what the client saw in the page. */
spc_status_t sp_stream_resume(sp_engine_t *eng, sp_client_t *c, const char *pci_bus_id, const uint8_t *uuid,
                              int client_ordinal, uint32_t slot, uint64_t ready, uint64_t done,
                              const uint64_t *settled, size_t nsettled, sp_err_t *e);
spc_status_t sp_stream_close(sp_engine_t *eng, sp_client_t *c, uint32_t slot, sp_err_t *e);
/* A stream op taken from the SQ: takes its place on its stream, or records why not. */
void sp_stream_consume(sp_engine_t *eng, sp_op_t *op);
/* After sp_op_validate (of an op its stream took): it must be on device memory of the stream's GPU. */
void sp_stream_validate(sp_op_t *op);
/* An op completes without having started: its done is owed in stream order. */
void sp_stream_op_unstarted(sp_engine_t *eng, sp_op_t *op);
/* A matched device task from the ready list: started on the daemon's stream
 * when every rank's stream has reached it, else parked in their windows. */
void sp_stream_task_ready(sp_engine_t *eng, sp_task_t *t);
/* Completes tasks whose kernels have run and gives up on ranks whose streams
 * miss the op's timeout. Returns the tasks completed. */
int  sp_stream_poll(sp_engine_t *eng, uint64_t now);
/* A client's end: its streams are broken and their semaphores poisoned, so no
 * stream (its own, the daemon's) waits for it any more. */
void sp_stream_client_gone(sp_engine_t *eng, sp_client_t *c);
/* Frees a client's streams and unregisters its semaphores (nothing of it runs). */
void sp_stream_client_free(sp_client_t *c);
/* Tasks on a GPU, or parked: nothing rings when they can move, so the progress thread polls. */
bool sp_stream_busy(sp_engine_t *eng);
/* spd is going: every stream's done is poisoned; tasks not started are aborted. */
void sp_stream_shutdown(sp_engine_t *eng);
/* After the progress thread stopped: lets what is on the GPU run out. */
void sp_stream_stop(sp_engine_t *eng);
/* Frees eng->gpu_sched (nothing of the GPU layer runs, no client is left). */
void sp_stream_cleanup(sp_engine_t *eng);
/* The counts of eng's GPU layer. Caller holds the lock. */
sp_gpu_counts_t sp_gpu_counts(const sp_engine_t *eng);

#endif /* SP_STREAM_H */
