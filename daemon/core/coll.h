/*
 * coll.h — collectives (coll.c): ops dispatched to their group, matched by
 * sequence number into one collective, failed at their deadline, and run once
 * every rank arrived and agrees.
 */
#ifndef SP_CORE_COLL_H
#define SP_CORE_COLL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "sp_shm.h"
#include "spclient/status.h"

typedef struct sp_engine sp_engine_t;
typedef struct sp_group sp_group_t;
typedef struct sp_coll sp_coll_t;
typedef struct sp_op sp_op_t;

/* One collective instance: the ops with the same sequence number on a group. */
struct sp_coll {
    sp_coll_t   *next;            /* group->colls[channel], ascending seq */
    uint64_t     seq;
    uint8_t      channel;
    uint64_t     first_ns;        /* first arrival */
    uint32_t     arrived;
    uint32_t     arrived_local;   /* of them, ranks of this daemon */
    uint32_t     sends_pending;   /* messages to other daemons not yet sent off */
    bool         sent;            /* this daemon's ranks were sent to the others */
    uint32_t     passed;          /* ranks done with this seq after it failed */
    uint64_t     deadline_ns;     /* earliest arrival + its timeout */
    spc_status_t failed;          /* SPC_OK while live */
    char         failed_detail[SP_DETAIL_BYTES];
    sp_op_t     *ops[];           /* by group rank; NULL until it arrives */
};

/* Entry point for a consumed op. */
void sp_op_dispatch(sp_engine_t *eng, sp_op_t *op);
/* Fails collectives whose deadline passed; returns the next deadline. */
uint64_t sp_job_check_deadlines(sp_engine_t *eng, uint64_t now);
/* A rank of another daemon arrives at collective `seq` of a group (net.c). */
void sp_coll_arrive_remote(sp_engine_t *eng, sp_group_t *g, unsigned channel, uint64_t seq, uint32_t grank,
                           sp_op_t *op);
/* This daemon's message for a collective could not go: the collective fails here. */
void sp_coll_fail_net(sp_engine_t *eng, sp_group_t *g, sp_coll_t *coll, const char *detail);
/* Whether every rank of this daemon in g is past collective `seq` of channel
 * and nothing of it is left here: it ran or failed, and a message for it
 * comes too late (the other daemon restarted). A rank that came back to a
 * new spd and replays it is not past it. */
bool sp_coll_passed(const sp_group_t *g, unsigned channel, uint64_t seq);
/* This daemon's message for collective `seq` went off (net.c). */
void sp_coll_sent(sp_engine_t *eng, const char *job_id, uint32_t group_index, unsigned channel, uint64_t seq);
/* "3" for a world rank; "1 (job rank 3)" for a rank of another group. */
size_t sp_rank_text(char *buf, size_t len, const sp_group_t *g, uint32_t grank);

/* What jobs (job.c) ask of their groups' collectives when a group loses a
 * member. sp_group_break: g is broken for good, every collective open on it
 * and every later op fails with st and detail. sp_group_break_after: a rank of
 * another daemon left after sending what it sent; the collectives it joined
 * may still finish, the others fail. */
void sp_group_break(sp_engine_t *eng, sp_group_t *g, spc_status_t st, const char *detail);
void sp_group_break_after(sp_engine_t *eng, sp_group_t *g, uint32_t grank, spc_status_t st, const char *detail);

/* A rank of a group rebuilt after a restart came back (sp_job_resume): the
 * collectives it saw complete, which another rank replays, fail now. */
void sp_group_resume_check(sp_engine_t *eng, sp_group_t *g);

#endif /* SP_CORE_COLL_H */
