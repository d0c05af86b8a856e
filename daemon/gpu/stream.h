/*
 * stream.h — device tasks on the daemon's GPU streams, and the stream order of
 * clients' ops (stream.c says how). The engine reaches them through the GPU
 * layer's transport ops (sp_gpu_ops, core/transport.h); the control plane
 * opens and closes streams.
 */
#ifndef SP_STREAM_H
#define SP_STREAM_H

#include <stdbool.h>
#include <stdint.h>

#include "base/err.h"
#include "core/client.h"
#include "core/engine.h"
#include "core/exec.h"

/* One seq of a client stream between consumed and started. */
typedef struct sp_stream_slot {
    sp_task_t *task;          /* matched and waiting for its turn; NULL: not yet */
    bool       failed;        /* completed without running: only its done is owed */
} sp_stream_slot_t;

/* A client's GPU stream: the order its ops start in, and its semaphores
 * (c->v.sems[slot], c->sems_dptr in the daemon). */
typedef struct sp_dstream {
    uint32_t          slot;
    int               gpu;
    bool              broken;        /* refuses ops; its done is poisoned once nothing of it runs */
    uint64_t          gave_up_at;    /* its ready was poisoned there: no input of this seq or later came; 0: none */
    bool              closing;       /* given back while ops were in flight: freed after them */
    uint64_t          consumed;      /* the last seq taken from the SQ */
    uint64_t          started;       /* the last seq on the daemon's stream, or settled without running */
    sp_stream_slot_t *win;           /* [win_mask + 1], by seq: (started, consumed] */
    uint32_t          win_mask;
    uint32_t          nflight;       /* its tasks on the daemon's stream, oldest first: */
    uint32_t          flight_head;
    uint64_t          flight_seq[SP_GPU_FLIGHT_MAX];
    uint64_t          flight_owed[SP_GPU_FLIGHT_MAX];   /* done to store once that task ran (failed seqs after it) */
    uint64_t          ops;           /* ops started on it */
    struct sp_gpu_lane *lane;        /* the daemon's stream for the tasks it leads */
    struct sp_gpu_mark *last_mark;   /* its latest task's, while that runs: a task on another lane waits for it */
    char              broken_detail[160];
} sp_dstream_t;

/* Stream order for device ops (spclient.h "GPU streams"). Every call holds the lock. */
spc_status_t sp_stream_open(sp_engine_t *eng, sp_client_t *c, const char *pci_bus_id, const uint8_t *uuid,
                            int client_ordinal, uint32_t *slot_p, sp_err_t *e);
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
/* spd is going: every stream's done is poisoned; tasks not started are aborted. */
void sp_stream_shutdown(sp_engine_t *eng);
/* After the progress thread stopped: lets what is on the GPU run out, frees the rest. */
void sp_stream_cleanup(sp_engine_t *eng);

#endif /* SP_STREAM_H */
