/*
 * nccl_int.h — what the two files of device ops across daemons share
 * (sp_nccl.h says how they work): the module's state, under its mutex, and
 * the communicators it drives. nccl.c sets up, starts and stops the thread
 * and takes what the other threads hand it; nccl_work.c loads NCCL and runs
 * each work on its communicator, phase by phase, on the thread.
 */
#ifndef SP_NCCL_INT_H
#define SP_NCCL_INT_H

#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>

#include "cluster/sp_nccl.h"
#include "core/engine.h"
#include "core/job.h"
#include "gpu/gpu.h"
#include "sp_topo.h"

#if defined(SP_HAVE_CUDA) && defined(SP_HAVE_NCCL)
#define SP_NCCL_BUILT 1
#include <dlfcn.h>
#include <nccl.h>
_Static_assert(sizeof(ncclUniqueId) == SP_NCCL_ID_BYTES, "ncclUniqueId is SP_NCCL_ID_BYTES");
#endif
_Static_assert(SP_NCCL_NODE_MAX == SP_NODE_MAX && SP_NCCL_JOB_MAX == SP_JOB_ID_MAX, "sp_nccl.h's sizes are job.h's");

/* An id rank 0 made, received here. */
typedef struct mbox {
    struct mbox *next;
    char         job[SP_JOB_ID_MAX];
    uint32_t     group_index, channel;
    uint64_t     seq;
    uint8_t      id[SP_NCCL_ID_BYTES];
} mbox_t;

/* An id this daemon made, for the loop to send to `node`. */
typedef struct outmsg {
    struct outmsg *next;
    char           node[SP_NODE_MAX];
    char           job[SP_JOB_ID_MAX];
    uint32_t       group_index, channel;
    uint64_t       seq;
    uint8_t        id[SP_NCCL_ID_BYTES];
} outmsg_t;

/* A daemon whose link is down, and why. */
typedef struct lostnode {
    struct lostnode *next;
    char             node[SP_NODE_MAX];
    char             why[160];
} lostnode_t;

typedef struct comm comm_t;

struct sp_nccl {
    pthread_mutex_t lock;
    pthread_cond_t  wake;
    pthread_t       thread;
    bool            started, stopping;
    bool            halting, quiet;   /* sp_nccl_halt: asked; no work in its exchange since */
    sp_engine_t    *eng;
    char            library[256];     /* nccl_library; "" for the default list */
    char            why[200];         /* why ops across daemons cannot run; "" when they can */
    bool            why_is_probe;     /* it only says what the start-up probe said */
    int             version;          /* NCCL's, once loaded */
    comm_t         *comms;
    uint32_t        ncomms;           /* NCCL communicators alive */
    uint32_t        inflight;         /* works submitted and not handed back */
    uint64_t        held, rerun, held_failed;   /* ever (sp_nccl_counts_t) */
    mbox_t         *mbox;
    outmsg_t       *outbox;
    lostnode_t     *lost;
};

#ifdef SP_NCCL_BUILT

/* What each daemon tells each other one before an op's data: the op it runs,
 * and what it sends that daemon. */
typedef struct hdr {
    uint32_t magic, opcode;
    uint32_t group_index, channel;
    uint64_t seq;
    uint64_t bytes;
    uint32_t nglobal, flags;
    uint8_t  pad[24];
} hdr_t;
#define HDR_GIVEN_UP  1u   /* an input of the sender's ranks never came (sp_nccl_give_up) */
_Static_assert(sizeof(hdr_t) == 64, "a header is 64 bytes");

enum comm_state { C_NONE, C_INIT, C_READY };

struct comm {
    comm_t         *next;             /* n->comms */
    char            job[SP_JOB_ID_MAX];
    uint32_t        group_index, channel;
    uint32_t        nranks, me;
    char          (*nodes)[SP_NODE_MAX];
    /* Shared, under n->lock. */
    sp_nccl_work_t *queue, *queue_tail;
    bool            gone;             /* the group ended */
    char            lost[SP_DETAIL_BYTES - 32];   /* "node X lost: why"; "" while they all live */
    char            held[SP_NODE_MAX];            /* a daemon restarting (sp_nccl_node_held); "" when none */
    sp_nccl_work_t *work;             /* running: set and cleared under n->lock, by the thread */
    /* The thread's own. */
    enum comm_state state;
    ncclComm_t      nc;
    int             dev;
    sp_gpu_lane_t  *lane;             /* its ops' kernels and transfers, on dev */
    sp_gpu_lane_t  *lanes[SP_TOPO_MAX_GPUS];   /* on this daemon's other GPUs, for its ops' ranks there */
    sp_gpu_stage_t *hdr_dev;          /* [2 * nranks] headers on the GPU: out, then in */
    hdr_t          *hdr_host;         /* likewise, pinned */
};

/* Where a work is (sp_nccl_work_t.phase); from W_LAUNCH on, the lane may hold
 * its work. W_HELD: its communicator was aborted as a daemon restarts, and it
 * waits to run again from the start; W_XFER (a work that can run again): its
 * transfers are on the lane, the kernels that write outputs not yet. */
enum work_phase { W_START, W_WAIT_ID, W_HELD, W_INIT, W_LAUNCH, W_ENQUEUE, W_XFER, W_RUN, W_GRACE };

/* nccl_work.c, on the thread: one step of c's running work (taking the next
 * when none): 0 when there was none, 1 when it still waits as it did, 2 when
 * it moved on. */
int  sp_nccl_comm_step(sp_nccl_t *n, comm_t *c);
/* Frees the communicators of ended groups once idle; aborts idle ones with a
 * daemon lost or restarting. */
void sp_nccl_reap(sp_nccl_t *n);
/* Shutdown: every work fails, every communicator goes. */
void sp_nccl_drain_all(sp_nccl_t *n);
/* Sleeps between polls, longer as `round` grows. */
void sp_nccl_nap(unsigned round);

#endif /* SP_NCCL_BUILT */

#endif /* SP_NCCL_INT_H */
