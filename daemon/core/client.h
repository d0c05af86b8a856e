/*
 * client.h — a training process attached to spd (engine.c): its segment and
 * rings, the ops it submits, and what it holds here (regions, streams, its job
 * and groups).
 */
#ifndef SP_CORE_CLIENT_H
#define SP_CORE_CLIENT_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "sp_shm.h"
#include "spclient/status.h"
#include "base/err.h"

typedef struct sp_engine sp_engine_t;
typedef struct sp_client sp_client_t;
typedef struct sp_op sp_op_t;
typedef struct sp_job sp_job_t;
typedef struct sp_stage sp_stage_t;
typedef struct sp_region sp_region_t;
typedef struct sp_membership sp_membership_t;
typedef struct sp_gstats sp_gstats_t;

/* A completion that found the client's CQ full; posted when space frees. */
typedef struct sp_cq_pending {
    struct sp_cq_pending *next;
    struct sp_cqe cqe;
    char detail[SP_DETAIL_BYTES];
} sp_cq_pending_t;

struct sp_client {
    sp_client_t     *next;            /* engine->clients */
    uint64_t         id;
    pid_t            pid;
    uid_t            uid;
    gid_t            gid;
    char             name[64];
    uint64_t         attached_ns;     /* CLOCK_MONOTONIC */
    uint32_t         protocol;        /* the one its hello chose (proto/sp_msg.h): it sets the segment's layout */

    /* The segment, with this side's private copy of its layout: sizes are never
     * read back from memory the client can write. */
    int              seg_fd;
    int              wake_fd;         /* eventfd the client writes to wake the progress thread */
    struct sp_seg_hdr layout;
    struct sp_seg_view v;
    uint32_t         sq_head;         /* our consumer counter */
    uint32_t         sq_mask;
    uint32_t         cq_tail;         /* our producer counter */
    uint32_t         cq_mask;
    sp_cq_pending_t *cq_overflow, *cq_overflow_tail;
    uint32_t         cq_overflow_count;
    bool             wake_due;        /* on the engine's wake_due list (sp_engine_wakes_hold) */
    sp_client_t     *wake_next;
    /* Consumed and not yet completed. inflight + cq_overflow_count never exceeds
     * cq_entries: that bounds the overflow list, and is the back-pressure that
     * leaves further submissions on the SQ. */
    uint32_t         inflight;
    bool             doomed;          /* broke the protocol; the loop will drop it */
    sp_err_t         doom;            /* and what it is told then */

    /* Its memory as spd reaches it (mem.c): /proc/<pid>/mem of the program
     * that attached, or -1 where process_vm_readv/writev serve, or where
     * mem_refusal says why spd may not reach it. image_gone is set by a copy
     * (any thread) that found the program gone. */
    int              mem_fd;
    char             mem_refusal[SP_DETAIL_BYTES];
    atomic_bool      image_gone;

    sp_region_t     *regions;
    uint32_t         nregions, regions_cap;
    uint64_t         registered_bytes;
    uint32_t         device_regions;  /* of nregions, those in GPU memory */
    uint64_t         device_bytes;    /* of registered_bytes, likewise */
    struct sp_gpu_import *imports;    /* its GPU allocations opened here (gpu_import.c) */
    struct sp_dstream *streams[SP_STREAMS_MAX]; /* its GPU streams (gpu/stream.c) */
    uint32_t         nstreams;
    void            *sems_registered; /* the semaphore page as registered with CUDA; NULL: not yet */
    uint64_t         sems_dptr;       /* its device address in the daemon */
    uint32_t         slots_retired;   /* stream slots a late write may still reach: never given again */
    bool             sems_kept;       /* a lane that did not drain may still write the semaphores: the page
                                       * stays registered, and the segment mapped, until spd exits */

    sp_job_t        *job;
    uint32_t         rank;
    sp_membership_t *memb;            /* groups this client belongs to */
    uint32_t         nmemb, memb_cap;

    /* Tasks using this client's memory. While non-zero the client is not freed:
     * a destroyed client becomes a zombie (off the client list, segment still
     * mapped) until the last task lets go. */
    uint32_t         pins;
    bool             zombie;

    uint64_t         ops_submitted, ops_completed, ops_failed;
    uint64_t         bytes_moved;     /* bytes written into this client's buffers */
};

/* One operation: a private copy of what the client submitted. An op of a rank
 * on another daemon (client NULL) is the copy of that daemon's descriptor, its
 * inputs in `stage` (net.c); completing it only frees it. */
struct sp_op {
    sp_op_t             *next;
    sp_client_t         *client;          /* NULL: a rank of another daemon */
    sp_stage_t          *stage;           /* remote: the received message holding its inputs */
    const uint8_t       *rin[SP_MAX_TENSORS];   /* remote: each input tensor, inside stage or own */
    uint8_t             *own[SP_MAX_TENSORS];   /* remote: inputs rebuilt from the slices sent */
    struct sp_sqe        sqe;
    struct sp_tensor_ref tensor[SP_MAX_TENSORS];
    uint64_t             need[SP_MAX_TENSORS];   /* bytes each tensor spans, set by sp_op_validate */
    union {                           /* the argument slot's params, by opcode */
        struct sp_a2a_params a2a;
        struct sp_a2av_params a2av;
        uint8_t              raw[sizeof(((struct sp_sq_args *)0)->params)];
    } params;
    uint64_t             arrive_ns;
    /* Set when the rank's own request is invalid, or its stream refused it
     * (the GPU layer's op_consume): the op still takes its place in the
     * collective (so sequence numbers stay aligned), and the whole collective
     * fails naming this rank. */
    sp_err_t             local;
    /* Where its tensors are (sp_op_validate): all in GPU memory, on the daemon's
     * GPU `gpu`, or all in host memory (device false). */
    bool                 device;
    int                  gpu;
    /* Stream order (sqe.stream != 0): the op holds its place in the stream's
     * window (in_window), and has been put on the daemon's stream (started). */
    bool                 in_window, started;
    /* Accounting (stats.c): the group's record, held while the op is in a
     * collective; when the progress thread took its collective up (rank 0's op). */
    sp_gstats_t         *gs;
    uint64_t             start_ns;
    uint64_t             seq;             /* its collective's sequence number on its channel (coll_place) */
};

/* Creates a client and its segment, and opens its memory (sp_mem_attach);
 * pidfd names pid, and the client does not keep it.
 * Caller holds the lock. On success *c_p is linked into the engine. Returns
 * SPC_OK or the error in e. */
spc_status_t sp_client_create(sp_engine_t *eng, pid_t pid, int pidfd, uid_t uid, gid_t gid, const char *name,
                              uint32_t protocol, uint32_t sq_entries, uint64_t arena_bytes, sp_client_t **c_p,
                              sp_err_t *e);
/* Adopts a client that an spd before this one served (spd.proto, Resume):
 * takes its segment's descriptor `seg_fd` out of it (pidfd_getfd on pidfd),
 * checks the segment (sealed, laid out as this protocol's) and maps it, with a
 * new wake eventfd. The rings go on from the counters the client left there.
 * Caller holds the lock. On success *c_p is linked into the engine. */
spc_status_t sp_client_adopt(sp_engine_t *eng, pid_t pid, int pidfd, uid_t uid, gid_t gid, const char *name,
                             uint32_t protocol, int seg_fd, sp_client_t **c_p, sp_err_t *e);
/* Unlinks and frees a client: its job's groups break (peers get PEER_LOST naming
 * it), its regions and segment go. `why` ends up in the peers' detail. Caller holds the lock. */
void sp_client_destroy(sp_engine_t *eng, sp_client_t *c, const char *why);

/* Fills a zeroed op with its private copy of an SQ entry and of what the entry's
 * argument slot holds for it (at most the slot's tensor refs, params up to the
 * slot's size; an older layout's smaller slot leaves the rest zero): all that
 * validation and the op's execution ever read of what the client wrote. */
void sp_op_copy_in(sp_op_t *op, const struct sp_sqe *sqe, const struct sp_sq_slot *slot);

/* Completes an op: posts its CQE (or queues it when the CQ is full) and frees it. */
void sp_op_complete(sp_engine_t *eng, sp_op_t *op, spc_status_t status, const char *detail);

/* Lets go of a pinned client; frees a zombie with its last pin. Caller holds the lock. */
void sp_client_unpin(sp_engine_t *eng, sp_client_t *c);

#endif /* SP_CORE_CLIENT_H */
