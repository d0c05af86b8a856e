/*
 * xdev.h — this daemon's part of a device op whose ranks sit on several
 * daemons (xdev.c). The core reaches the task's life here through the NCCL
 * transport's ops (core/transport.h: task_attach, task_detach, task_ready,
 * task_stream, task_give_up, task_back, task_wrote_done, task_leaks); the
 * NCCL thread (nccl.c) calls the rest.
 */
#ifndef SP_CLUSTER_XDEV_H
#define SP_CLUSTER_XDEV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "core/client.h"
#include "core/engine.h"
#include "core/exec.h"
#include "core/job.h"

/* The task's life, lock held (the ops of the same names).
 *   attach     at sp_task_create: numbers the group's daemons (NCCL ranks,
 *              by node name) and fills in what NCCL needs of the op (false:
 *              out of memory); detach frees it, with the task;
 *   stream     one of its ranks here follows a client stream: its
 *              semaphores' device addresses and the op's seq there;
 *   submit     to the NCCL thread (may complete it at once);
 *   give_up    a rank's input will not come: its ready is about to be
 *              poisoned (see sp_nccl.h);
 *   back       in stream order: handed back by the NCCL thread;
 *   wrote_done whether the lane wrote its ranks' done (else the host must),
 *              once back;
 *   leaks      whether its lane did not drain after a failure (the task
 *              keeps its device memory). */
bool sp_xdev_attach(sp_engine_t *eng, sp_task_t *t, const sp_group_t *g, sp_op_t *const *ops);
void sp_xdev_detach(sp_task_t *t);
void sp_xdev_stream(sp_task_t *t, uint64_t ready_dptr, uint64_t done_dptr, uint64_t seq);
void sp_xdev_submit(sp_engine_t *eng, sp_task_t *t);
void sp_xdev_give_up(sp_task_t *t);
bool sp_xdev_back(const sp_task_t *t);
bool sp_xdev_wrote_done(const sp_task_t *t);
bool sp_xdev_leaks(const sp_task_t *t);

/* The NCCL thread, lock not held:
 *   plan    staging and the op's transfer list, and work.gpus, the other
 *           GPUs it enqueues on: SPC_OK, or the error in e saying why this
 *           daemon cannot run it (SPC_ERR_LIMIT naming the staging option);
 *   before  the copies in from the other GPUs, then the kernels that come
 *           before the transfers;
 *   after   the kernels that read what came, then the copies out to the
 *           other GPUs, the NCCL GPU waiting for them (all on the calling
 *           thread's lanes of each GPU, every one already past the ranks'
 *           ready; a failure in e).
 * Then, lock held, done: its work's status taken, completes its ops
 * (sp_task_finish); a task in stream order is only marked back, and stream.c
 * completes it in its streams' order. */
spc_status_t sp_xdev_plan(sp_task_t *t, sp_err_t *e);
spc_status_t sp_xdev_before(sp_task_t *t, sp_err_t *e);
spc_status_t sp_xdev_after(sp_task_t *t, sp_err_t *e);
void         sp_xdev_done(sp_engine_t *eng, sp_task_t *t);

#endif /* SP_CLUSTER_XDEV_H */
