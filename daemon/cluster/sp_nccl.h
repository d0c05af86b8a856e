/*
 * sp_nccl.h — device ops whose ranks sit on several daemons: NCCL
 * communicators, one per (group, channel), one NCCL rank per daemon, and the
 * thread that drives them (nccl.c, nccl_work.c). Not "nccl.h": that name is
 * NCCL's own header. Every NCCL call is polled; ops of a communicator go in
 * sequence order with a header that catches daemons out of step. The thread's
 * mutex is taken after the engine lock, never before. The story (ranks, ids,
 * threads, stream order): docs/architecture.md, "GPU memory across daemons".
 */
#ifndef SP_NCCL_H
#define SP_NCCL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "spclient/status.h"
#include "base/err.h"
#include "sp_shm.h"
#include "core/exec.h"
#include "core/engine.h"

typedef struct sp_engine sp_engine_t;
typedef struct sp_task sp_task_t;

#define SP_NCCL_ID_BYTES 128        /* sizeof(ncclUniqueId) */
#define SP_NCCL_NODE_MAX 64         /* SP_NODE_MAX */
#define SP_NCCL_JOB_MAX  128        /* SP_JOB_ID_MAX */

/* One transfer of an op that involves this daemon: it sends `bytes` from ptr
 * to NCCL rank `peer`, or receives them there from it. `index` is the
 * transfer's place in the op's whole list, the same on every daemon. */
typedef struct sp_nccl_xfer {
    uint32_t peer;
    uint32_t send;
    uint32_t index;
    void    *ptr;                   /* device memory of this daemon */
    uint64_t bytes;
} sp_nccl_xfer_t;

/* A rank of this daemon whose client stream orders the op: the device
 * addresses of its semaphores (client memory the daemon registered) and the
 * op's place in its stream. */
typedef struct sp_nccl_sem {
    uint64_t ready, done, seq;
} sp_nccl_sem_t;

/* What one op asks of NCCL. xdev.c fills in who takes part; the NCCL thread
 * has xdev.c fill in the transfers (sp_xdev_plan), runs the op and completes
 * the task (sp_xdev_done) with `status` and `detail` set. */
typedef struct sp_nccl_work {
    struct sp_nccl_work *next;      /* nccl.c's queue */
    sp_task_t      *task;
    char            job[SP_NCCL_JOB_MAX];
    uint32_t        group_index, channel;
    uint64_t        seq;            /* the op's number on its channel */
    unsigned        opcode;
    int             dev;            /* this daemon's GPU for the op: its NCCL rank's */
    uint64_t        gpus;           /* bit g: the op also enqueues on GPU g (its ranks there that dev
                                     * cannot map are staged), on a lane of the communicator's there */
    uint32_t        nranks, me;     /* NCCL ranks: the group's daemons by node name */
    char          (*nodes)[SP_NCCL_NODE_MAX];
    sp_nccl_xfer_t *xfers;          /* by index */
    uint32_t        nxfers;
    uint32_t        nglobal;        /* transfers in the whole op, over every daemon */
    uint64_t        timeout_ns;
    /* A grace is set for peers' restarts (peer_restart_grace_ms): the kernels
     * that write outputs wait on the host for the exchange, so an op whose
     * exchange a restarting daemon broke runs again from the start. */
    bool            rerun;
    char            held_node[SP_NCCL_NODE_MAX];   /* at submit: the job waits for that daemon (nccl.c) */
    spc_status_t    status;
    char            detail[SP_DETAIL_BYTES];
    /* The op failed with its kernels perhaps still running (the lane did not
     * drain after the abort): the task must keep its device memory. */
    bool            leak;
    /* Stream order (stream.c fills sems before the work is submitted). */
    sp_nccl_sem_t  *sems;
    uint32_t        nsems;
    bool            done_enqueued;  /* the lane holds the done writes (read once handed back) */
    bool            after_enqueued; /* the lane holds the kernels that write outputs */
    /* Under the engine lock: a rank's input never came (sp_nccl_give_up); the
     * op's outgoing headers while the lane may still read them. */
    bool            given_up;
    void           *hdr_out;
    uint32_t        hdr_count;
    /* nccl.c's own. */
    int             phase;
    uint32_t        next_group, ngroups;
    uint64_t        deadline_ns, grace_ns;
    spc_status_t    pending;        /* failure found, waiting to name the lost node */
    char            pending_detail[SP_DETAIL_BYTES];
} sp_nccl_work_t;

/* At start-up, before any thread: remembers the library to load, and whether
 * the node has what device ops across daemons need (probe: devices.c's NCCL
 * text; gpus: the GPUs found). Sets NCCL_HOSTID to the node's name unless the
 * environment has it (see nccl.c). */
void sp_nccl_setup(sp_engine_t *eng, const char *library, const char *probe, int gpus);
/* Frees what setup made (after sp_nccl_stop). */
void sp_nccl_cleanup(sp_engine_t *eng);
/* Whether device ops across daemons can run here; why not in e (SPC_ERR_NO_DEVICE). Any thread. */
bool sp_nccl_usable(sp_engine_t *eng, sp_err_t *e);
/* Fails whatever is still running with SPC_ERR_SHUTTING_DOWN, completes it
 * and stops the thread. After the progress thread has stopped; the engine
 * lock is not held (the thread takes it to complete tasks). */
void sp_nccl_stop(sp_engine_t *eng);

/* Stopping for a restart, after the progress thread; the engine lock not
 * held. Waits, at most SP_NCCL_HALT_MS, until no work is in its exchange with
 * the other daemons (they may complete it, so it completes here too, its
 * ranks told); from then on the thread starts no work and completes none
 * that waits for another daemon: their ranks replay them to the next spd. */
#define SP_NCCL_HALT_MS 5000
void sp_nccl_halt(sp_engine_t *eng);

/* Hands a work to the thread (started on first use); where it cannot go, its
 * task is completed here with the reason. Engine lock held. */
void sp_nccl_submit(sp_engine_t *eng, sp_nccl_work_t *w);

/* Engine lock held, before the poisoned ready is stored: the work's input
 * from a rank of this daemon will not come. Its headers tell the others (now,
 * or when they are written). */
void sp_nccl_give_up(sp_nccl_work_t *w);

/* Loop thread, engine lock held. An id from daemon `from`; a daemon gone (its
 * communicators fail their ops naming it) or back; a group that ended. */
void sp_nccl_id_arrived(sp_engine_t *eng, const char *from, const char *job, uint32_t group_index, uint32_t channel,
                        uint64_t seq, const void *id, size_t len);
void sp_nccl_node_lost(sp_engine_t *eng, const char *node, const char *why);
void sp_nccl_node_up(sp_engine_t *eng, const char *node);
void sp_nccl_group_gone(sp_engine_t *eng, const char *job, uint32_t group_index);

/* Engine lock held: a peer's restart (peer_restart_grace_ms). node_held: a
 * daemon whose jobs wait for it went: its communicators are aborted, and the
 * op running on each is held to run again from the start on a new one (or
 * fails, PEER_LOST, where it cannot). job_node_back: it took the job back:
 * the job's communicators with it are made again, at the op each holds.
 * job_node_lost: the job's ranks there are lost: what it holds fails. */
void sp_nccl_node_held(sp_engine_t *eng, const char *node, const char *why);
/* Whether op `seq` of that channel is with NCCL here, not handed back: a
 * restarted daemon that replays it finds it still to run here. */
bool sp_nccl_has_op(sp_engine_t *eng, const char *job, uint32_t group_index, uint32_t channel, uint64_t seq);
void sp_nccl_job_node_back(sp_engine_t *eng, const char *job, const char *node);
void sp_nccl_job_node_lost(sp_engine_t *eng, const char *job, const char *node, const char *why);

/* Loop thread: sends the ids the thread made (it wakes the loop through the
 * engine's notify hook). */
typedef void (*sp_nccl_send_fn)(void *arg, const char *node, const char *job, uint32_t group_index, uint32_t channel,
                                uint64_t seq, const uint8_t *id, size_t len);
void sp_nccl_outbox_drain(sp_engine_t *eng, sp_nccl_send_fn fn, void *arg);

/* For spctl status: a line on NCCL. */
void sp_nccl_status(sp_engine_t *eng, const char *probe, char *text, size_t len);

/* What status and metrics show of device ops across daemons; zeros where NCCL
 * is absent. A held op ends run again or failed, so held - rerun - held_failed
 * are held now. Any thread. */
typedef struct sp_nccl_counts {
    uint32_t comms;                  /* NCCL communicators alive */
    uint32_t inflight;               /* works submitted and not handed back */
    uint64_t held;                   /* ops held as a peer daemon restarted (sp_nccl_node_held), ever */
    uint64_t rerun;                  /* of them, run again on a new communicator once it took the job back */
    uint64_t held_failed;            /* failed while held: the grace passed, the job not taken back, their
                                      * deadline, or spd stopping */
} sp_nccl_counts_t;
sp_nccl_counts_t sp_nccl_counts(sp_engine_t *eng);

#endif /* SP_NCCL_H */
