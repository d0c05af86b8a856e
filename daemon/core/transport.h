/*
 * transport.h — how the core reaches the layers above it without naming them.
 *
 * Part of what the engine does is carried out by layers built on it: the GPU
 * layer (clients' GPU memory imported into spd, stream order, kernels) and the
 * cluster layer (the data path to other daemons, NCCL across daemons). Each
 * fills in a table of these ops when it starts, and the engine calls through
 * it, as NCCL's transports (struct ncclTransport) and UCX's uct_iface_ops_t
 * are called: the core includes no header of theirs. The engine holds one
 * table per transport:
 *
 *   eng->gpu_ops   gpu/: imports and client streams (set at server start-up);
 *   eng->net_ops   cluster/net.c: host data across daemons (sp_net_init);
 *   eng->xdev_ops  cluster/nccl.c: device data across daemons (sp_nccl_setup).
 *
 * A table is NULL while its transport is absent (no peers configured, or an
 * engine run without its layers), and an op a transport has no part in is
 * NULL: SP_TRANSPORT_CALL skips both. The ops that answer (progress,
 * send_coll, usable) or take an op or task over (op_consume, task_ready) are
 * filled in by each table the engine asks them of. Ops run under the engine
 * lock unless they say otherwise.
 */
#ifndef SP_TRANSPORT_H
#define SP_TRANSPORT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "core/engine.h"

typedef struct sp_transport_ops {
    /* Life cycle. shutdown: spd is going, nothing more starts and nothing may
     * wait for what will not come. stop: after the progress thread stopped,
     * lock not held; what still runs fails and completes. cleanup: frees the
     * rest. progress: one pass of the progress thread; the events handled. */
    void (*shutdown)(sp_engine_t *eng);
    void (*stop)(sp_engine_t *eng);
    void (*cleanup)(sp_engine_t *eng);
    int  (*progress)(sp_engine_t *eng, uint64_t now);

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
     * its place, or records why not (op->stream_status); op_validate: after
     * sp_op_validate, the transport's own checks; op_unstarted: an op completes
     * without having started; op_release: a rank of another daemon's op
     * completes, its inputs go; task_ready: a matched device task is the
     * transport's to start and complete. */
    void (*op_consume)(sp_engine_t *eng, sp_op_t *op);
    void (*op_validate)(sp_op_t *op);
    void (*op_unstarted)(sp_engine_t *eng, sp_op_t *op);
    void (*op_release)(sp_op_t *op);
    void (*task_ready)(sp_engine_t *eng, sp_task_t *t);

    /* Across daemons. send_coll: every rank of this daemon arrived at coll;
     * its descriptors and inputs go to the group's other daemons (-1: they
     * could not, coll failed and may be gone). usable: whether the transport
     * can carry ops now, why not in `why` (any thread). node_lost: a daemon is
     * gone; group_gone: a group spanning daemons ended. */
    int  (*send_coll)(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll);
    bool (*usable)(sp_engine_t *eng, char *why, size_t len);
    void (*node_lost)(sp_engine_t *eng, const char *node, const char *why);
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
