/*
 * devplan.h — an op on GPU memory of one node, planned as kernels (devplan.c).
 * Lock held or not; what is enqueued runs before the task completes.
 */
#ifndef SP_GPU_DEVPLAN_H
#define SP_GPU_DEVPLAN_H

#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "core/exec.h"
#include "sp_kern_a2a.h"

/* Enqueues the task's kernels on the current lanes of its ranks' GPUs (every
 * GPU's lane already waiting for every rank's ready); a refusal or a driver
 * error is recorded in the task (sp_task_fail). Inputs staged through pinned
 * host memory (GPUs without peer access) go into *staged_p, to be given back
 * (sp_gpu_hstage_put) once the task has run on every GPU. Lock held. */
struct sp_gpu_hstage;
void sp_devplan_enqueue(sp_task_t *t, struct sp_gpu_hstage **staged_p);

/* For the plans across daemons (cluster/xdev.c), which use the same kernels.
 * ranks_ok: the kernels' limit on the ranks they read, refused before anything
 * is enqueued (SPC_ERR_UNSUPPORTED, the reason in e); a2a_desc: tensor i of the task's
 * all-to-all as the kernel describes it; scatter: a reduce-scatter's blocks of
 * this daemon's ranks, each the all-reduce kernel over the ranks' sends at that
 * block, rank q's tensor i found at at_fn(t, q, i) (its receive: i = 1). */
spc_status_t       sp_devplan_ranks_ok(const sp_task_t *t, sp_err_t *e);
sp_kern_a2a_desc_t sp_devplan_a2a_desc(const sp_task_t *t, uint32_t i);
spc_status_t       sp_devplan_scatter(sp_task_t *t, uint8_t *(*at_fn)(sp_task_t *, uint32_t, uint32_t), sp_err_t *e);

#endif /* SP_GPU_DEVPLAN_H */
