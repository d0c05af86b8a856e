/*
 * transport.h — how the core reaches the layers above it without naming them:
 * a table of ops per transport (eng->gpu_ops, net_ops, xdev_ops), filled in by
 * the layer when it starts. A NULL table (transport absent) or op (no part in
 * it) is skipped by SP_TRANSPORT_CALL; ops that answer or take something over
 * must be filled in. Ops run under the engine lock unless they say otherwise.
 * The story: docs/architecture.md, "How the core reaches up: transport ops".
 */
#ifndef SP_TRANSPORT_H
#define SP_TRANSPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "core/engine.h"

typedef struct sp_coll sp_coll_t;
typedef struct sp_group sp_group_t;
typedef struct sp_op sp_op_t;
typedef struct sp_region sp_region_t;
struct sp_gpu_import;

typedef struct sp_transport_ops {
    /* Life cycle. shutdown: spd is going, nothing more starts and nothing may
     * wait for what will not come. stop: after the progress thread stopped,
     * lock not held; what still runs fails, or runs out, and completes.
     * cleanup: frees the rest, the transport's state with it. progress: one
     * pass of the progress thread; the events handled. busy: whether the
     * transport has work whose end nothing rings for, so that the progress
     * thread keeps polling (gpu_ops: progress is called only then). */
    void (*shutdown)(sp_engine_t *eng);
    void (*stop)(sp_engine_t *eng);
    void (*cleanup)(sp_engine_t *eng);
    int  (*progress)(sp_engine_t *eng, uint64_t now);
    bool (*busy)(sp_engine_t *eng);

    /* Clients and their memory. client_gone: its end (nothing of the transport
     * waits for it now); client_free: what it held of the client goes (nothing
     * of it runs). region_drop: a device region goes, and its hold on the
     * memory; regions_gone: after the last, the client's memory is found
     * through it no more (a running task may still hold some). */
    void (*client_gone)(sp_engine_t *eng, sp_client_t *c);
    void (*client_free)(sp_client_t *c);
    void (*region_drop)(sp_engine_t *eng, sp_region_t *r);
    void (*regions_gone)(sp_client_t *c);

    /* Ops and tasks. op_consume: a stream-ordered op taken from the SQ takes
     * its place, or records why not (op->local); op_validate: after
     * sp_op_validate, the transport's own checks; op_unstarted: an op completes
     * without having started; op_release: a rank of another daemon's op
     * completes, its inputs go; task_ready: a matched device task is the
     * transport's to start and complete. */
    void (*op_consume)(sp_engine_t *eng, sp_op_t *op);
    void (*op_validate)(sp_op_t *op);
    void (*op_unstarted)(sp_engine_t *eng, sp_op_t *op);
    void (*op_release)(sp_op_t *op);
    void (*task_ready)(sp_engine_t *eng, sp_task_t *t);

    /* Device tasks (core/task.h). import_ref, import_unref: a task's hold on
     * the imported memory of a rank's device region, taken when it is made and
     * dropped when it is freed, so that a client that dies meanwhile does not
     * take the memory out from under a kernel (gpu_ops). A task whose ranks
     * sit on several daemons has its part in xdev_ops: task_attach, when it is
     * made (false: out of memory), task_detach, when it is freed; task_ready
     * hands it to the transport's thread. task_stream: one of its ranks here
     * follows a client stream, whose semaphores (device addresses) it waits on
     * and writes at seq; task_give_up: a rank's input will not come, its ready
     * is about to be poisoned. task_back: in stream order, the transport has
     * handed it back; task_wrote_done: its ranks' done were written on the
     * device (else the host writes them), once back; task_leaks: its device
     * work did not drain after a failure, so it keeps its memory. */
    void (*import_ref)(struct sp_gpu_import *imp);
    void (*import_unref)(sp_engine_t *eng, struct sp_gpu_import *imp);
    bool (*task_attach)(sp_engine_t *eng, sp_task_t *t, const sp_group_t *g, sp_op_t *const *ops);
    void (*task_detach)(sp_task_t *t);
    void (*task_stream)(sp_task_t *t, uint64_t ready_dptr, uint64_t done_dptr, uint64_t seq);
    void (*task_give_up)(sp_task_t *t);
    bool (*task_back)(const sp_task_t *t);
    bool (*task_wrote_done)(const sp_task_t *t);
    bool (*task_leaks)(const sp_task_t *t);

    /* Across daemons. send_coll: every rank of this daemon arrived at coll;
     * its descriptors and inputs go to the group's other daemons (-1: they
     * could not, coll failed and may be gone). usable: whether the transport
     * can carry ops now, why not in e (any thread). node_lost: a daemon is
     * gone; group_gone: a group spanning daemons ended. A peer's restart
     * (peer_restart_grace_ms): node_held, a daemon went and its jobs wait for
     * it; job_node_back, it took the job back (or, restarted here, the job
     * was taken back from it); job_node_lost, the job's ranks there are lost
     * (its wait ended without it, or the grace is 0). */
    int  (*send_coll)(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll);
    bool (*usable)(sp_engine_t *eng, sp_err_t *e);
    void (*node_lost)(sp_engine_t *eng, const char *node, const char *why);
    void (*node_held)(sp_engine_t *eng, const char *node, const char *why);
    /* Stopping for a restart (lock not held): lets the ops whose exchange
     * with other daemons is under way finish, for a while, and starts none. */
    void (*halt)(sp_engine_t *eng);
    void (*job_node_back)(sp_engine_t *eng, const char *job, const char *node);
    void (*job_node_lost)(sp_engine_t *eng, const char *job, const char *node, const char *why);
    void (*group_gone)(sp_engine_t *eng, const char *job, uint32_t group_index);
} sp_transport_ops_t;

/* Calls `op` of a transport's table when there is the table and the op. */
#define SP_TRANSPORT_CALL(ops, op, ...)                                       \
    do {                                                                      \
        const sp_transport_ops_t *ops_ = (ops);                               \
        if (ops_ != NULL && ops_->op != NULL)                                 \
            ops_->op(__VA_ARGS__);                                            \
    } while (0)

#endif /* SP_TRANSPORT_H */
