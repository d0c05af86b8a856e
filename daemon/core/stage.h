/*
 * stage.h — registered memory through the engine's staging buffer, window by
 * window (stage.c), for exec.c's tasks.
 */
#ifndef SP_CORE_STAGE_H
#define SP_CORE_STAGE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/err.h"
#include "core/engine.h"

struct sp_chunk;

/* Lock held, at sp_task_create: sizes the windows and places each registered
 * tensor's slot in the staging. SPC_OK (also when there is none),
 * SPC_ERR_LIMIT (detail set, logged) when no window fits, SPC_ERR_NO_MEMORY. */
spc_status_t sp_stage_plan(sp_engine_t *eng, sp_task_t *t, sp_err_t *e);
/* Lock dropped, from here on, per task: points its registered tensors at their
 * slots of the engine's staging, which grows if it must (false: the task
 * failed, out of memory); then per window [u0, u1): in, the registered inputs
 * (false: the task failed, naming the rank whose memory is gone); clip, chunk c
 * cut to the window (false: none of it is there); out, the registered outputs
 * back (a failure is that rank's alone). */
bool sp_stage_alloc(sp_engine_t *eng, sp_task_t *t);
bool sp_stage_in(sp_task_t *t, uint64_t u0, uint64_t u1, sp_err_t *e);
bool sp_stage_clip(sp_task_t *t, struct sp_chunk *c, uint64_t u0, uint64_t u1);
void sp_stage_out(sp_task_t *t, uint64_t u0, uint64_t u1, sp_err_t *e);

/* Frees the staging of registered memory once no task has used it for a while
 * (now: sp_now_ns()), or at once when `all`. Progress thread, or once it stopped. */
void sp_task_stage_trim(sp_engine_t *eng, uint64_t now, bool all);

#endif /* SP_CORE_STAGE_H */
