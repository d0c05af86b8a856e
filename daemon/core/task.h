/*
 * task.h — a task as the layers above the core see it: what a collective
 * whose ranks all arrived moves, rank by rank and tensor by tensor.
 *
 * The core makes, runs and completes tasks (exec.c). A task on GPU memory is
 * planned by the layers that own the devices and the links, reading this
 * layout: gpu/devplan.c enqueues its kernels on its ranks' GPUs, cluster/xdev.c plans
 * its part across daemons (held in `xd`). They read what sp_task_create set,
 * write only their own (`xd`, the ranks' device outputs) and record a failure
 * through sp_task_fail.
 */
#ifndef SP_CORE_TASK_H
#define SP_CORE_TASK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/client.h"
#include "core/exec.h"
#include "core/ops.h"
#include "sp_ulysses.h"

struct sp_xdev;
struct sp_transport_ops;

/* One rank's tensor as the copy sees it. */
typedef struct sp_task_buf {
    uint8_t *ptr;          /* arena in place, or its slot of the staging; device memory: the daemon's address */
    uint64_t lo;           /* the tensor's byte that ptr holds: the window's start in it (staging) or 0 */
    uint64_t bytes;        /* extent the op reads or writes */
    uint64_t remote;       /* registered memory: the address in the client; 0: arena */
    bool     input, output;
    struct sp_gpu_import *import;   /* device memory: the task's reference to its import */
} sp_task_buf_t;

/* A unit of a task's host work; its meaning per op kind is in exec.c's run_*
 * functions. */
typedef struct sp_chunk {
    uint8_t  kind;         /* exec.c's CH_* */
    uint8_t  t;            /* logical tensor */
    uint32_t dst, src;     /* group ranks */
    uint64_t lo, hi;       /* rows, bytes or elements, by op */
} sp_chunk_t;

struct sp_task {
    sp_task_t   *next;
    uint32_t     size;         /* group size */
    uint32_t     ntensors;     /* tensor refs per op */
    uint32_t     group_id;
    uint32_t     world;        /* the group is the job's world */
    uint32_t    *job_rank;     /* by group rank, for messages */
    bool        *here;         /* by group rank: on this daemon (only their outputs are written) */
    uint64_t     seq;
    sp_op_t    **ops;          /* by group rank */
    sp_task_buf_t *bufs;       /* [rank * ntensors + i] */
    sp_chunk_t  *chunks;
    uint32_t     nchunks, chunks_cap;
    uint64_t     bytes;        /* bytes written, over all ranks */

    /* Registered memory (stage.c): the op's axis runs in windows of `window`
     * units, each the chunks cut to it (wchunks; the whole list when one window
     * covers the axis). */
    uint64_t       stage_bytes;   /* 0: no registered tensor */
    uint64_t       axis, window, unit;   /* unit: bytes of one unit of the axis */
    sp_chunk_t       *wchunks;
    const sp_chunk_t *run;     /* the chunks run_chunk numbers */

    /* Large tasks write with streaming stores (see sp_kern_copy_stream). */
    void               (*copy)(void *dst, const void *src, size_t n);
    bool                 stream;

    bool                 device;   /* every tensor in GPU memory, each rank's on its op's GPU (op->gpu) */
    int                  gpu;      /* its first rank's GPU; ops across daemons: the one GPU of this daemon's ranks */
    /* A device op whose ranks sit on several daemons: the transport that
     * carries it (eng->xdev_ops when it was made) and its part there. NULL: none. */
    const struct sp_transport_ops *xops;
    struct sp_xdev      *xd;

    struct sp_sqe        sqe;  /* rank 0's; the others agree */
    const sp_op_exec_t  *ex;   /* how its kind moves data on the host */
    struct sp_a2a_params a2a;
    sp_heads_plan_t      plan[SP_A2A_MAX_TENSORS];
    size_t               es;

    /* Failures: the rank whose memory failed, and why. */
    spc_status_t status;
    uint32_t     bad_rank;     /* UINT32_MAX: every rank gets status */
    char         detail[SP_DETAIL_BYTES];
    spc_status_t *rank_status; /* per rank, for write-back failures */
};

/* Group rank `rank`'s tensor i. */
static inline sp_task_buf_t *sp_task_buf(const sp_task_t *t, uint32_t rank, uint32_t i)
{
    return &t->bufs[(size_t)rank * t->ntensors + i];
}

#endif /* SP_CORE_TASK_H */
