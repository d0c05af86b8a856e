/*
 * exec.h — tasks (exec.c): a collective whose ranks all arrived and agree,
 * made, run and completed. Their layout is in core/task.h, for the code that
 * plans them; the rest of the daemon holds them by these functions.
 */
#ifndef SP_CORE_EXEC_H
#define SP_CORE_EXEC_H

#include <stdbool.h>
#include <stdint.h>

#include "spclient/status.h"

typedef struct sp_engine sp_engine_t;
typedef struct sp_group sp_group_t;
typedef struct sp_op sp_op_t;
typedef struct sp_task sp_task_t;

/*
 * Turns a collective whose ops have all arrived and agree into a task on the
 * ready list (pinning its clients), or completes it at once when there is
 * nothing to move (barrier) or it cannot start. Takes the ops out of `ops`.
 * Caller holds the lock.
 */
void sp_task_create(sp_engine_t *eng, sp_group_t *g, sp_op_t **ops);
/* Moves the data (lock not held). */
void sp_task_run(sp_engine_t *eng, sp_task_t *t);
/* Completes the task's ops, unpins and frees it. Caller holds the lock. */
void sp_task_finish(sp_engine_t *eng, sp_task_t *t);
/* Completes a task that will not run with st. Caller holds the lock. */
void sp_task_abort(sp_engine_t *eng, sp_task_t *t, spc_status_t st, const char *detail);
/* Pops the oldest ready task; NULL when none. Caller holds the lock. */
sp_task_t *sp_task_next(sp_engine_t *eng);

/* Device tasks, for stream.c. */
bool     sp_task_device(const sp_task_t *t);
int      sp_task_gpu(const sp_task_t *t);
uint32_t sp_task_size(const sp_task_t *t);
sp_op_t *sp_task_op(const sp_task_t *t, uint32_t grank);   /* NULL once finished */
/* Records a failure (the first one stands). bad_rank UINT32_MAX: every rank's. */
void     sp_task_fail(sp_task_t *t, spc_status_t st, uint32_t bad_rank, const char *detail);
spc_status_t sp_task_status(const sp_task_t *t);

/*
 * Device tasks whose ranks sit on several daemons. The progress thread hands
 * them to stream.c, which starts them in their ranks' stream order (at once
 * for those in no stream's) and hands them to the NCCL thread, which runs this
 * daemon's part of the op (cluster/xdev.c) and hands them back. Stream.c asks
 * the task's transport (t->xops, core/transport.h) through these, lock held:
 *   sp_task_xdev         whether t is one;
 *   sp_task_xdev_stream  one of its ranks here follows a client stream: its
 *                        semaphores' device addresses and the op's seq there
 *                        (before the submit);
 *   sp_task_xdev_submit  to the NCCL thread, which completes it
 *                        (sp_task_finish); a task in stream order is only
 *                        marked back (sp_task_xdev_back), and stream.c
 *                        completes it in its streams' order;
 *   sp_task_xdev_give_up a rank's input will not come: its ready is about to
 *                        be poisoned (see sp_nccl.h);
 *   sp_task_xdev_wrote_done  whether the lane wrote its ranks' done (else the
 *                        host must), once back;
 *   sp_task_xdev_leaks   whether its lane did not drain after a failure.
 */
bool         sp_task_xdev(const sp_task_t *t);
void         sp_task_xdev_stream(sp_task_t *t, uint64_t ready_dptr, uint64_t done_dptr, uint64_t seq);
void         sp_task_xdev_submit(sp_engine_t *eng, sp_task_t *t);
bool         sp_task_xdev_back(const sp_task_t *t);
void         sp_task_xdev_give_up(sp_task_t *t);
bool         sp_task_xdev_wrote_done(const sp_task_t *t);
bool         sp_task_xdev_leaks(const sp_task_t *t);

#endif /* SP_CORE_EXEC_H */
