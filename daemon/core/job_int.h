/*
 * job_int.h — what jobs (job.c) ask of the collectives of their groups
 * (coll.c): a group that loses a member breaks, failing its collectives.
 */
#ifndef SP_JOB_INT_H
#define SP_JOB_INT_H

#include "core/job.h"

/* Breaks g for good: every collective open on it, and every later op, fails
 * with st and detail. */
void sp_group_break(sp_engine_t *eng, sp_group_t *g, spc_status_t st, const char *detail);
/* Breaks g for a rank of another daemon that left after sending what it sent:
 * the collectives it joined may still finish, the others fail. */
void sp_group_break_after(sp_engine_t *eng, sp_group_t *g, uint32_t grank, spc_status_t st, const char *detail);

#endif /* SP_JOB_INT_H */
