/*
 * stats.h — what the daemon counts about its ops (per op kind, daemon-wide
 * and per group: ends, failures by status, bytes, a duration histogram), and
 * the flight recorder: each group's last op_history collectives. A collective
 * counts once on this daemon. Everything is written by the thread completing
 * the op, under the engine lock, into fixed arrays: nothing is allocated after
 * the group is made. The unit, the cost, the buckets: docs/architecture.md,
 * "Counters and the flight recorder".
 */
#ifndef SP_STATS_H
#define SP_STATS_H

#include <stdbool.h>
#include <stdint.h>

#include "core/auth.h"
#include "core/job.h"
#include "sp_shm.h"
#include "spclient/status.h"

typedef struct sp_engine sp_engine_t;
typedef struct sp_group sp_group_t;
typedef struct sp_op sp_op_t;
typedef struct sp_task sp_task_t;

#define SP_STATS_KINDS   10u    /* opcodes SP_OP_NOOP .. SP_OP_ALLTOALLV, then "unknown" */
#define SP_LAT_BUCKETS   32u    /* upper bounds 2^10 .. 2^40 ns, then +Inf */
#define SP_LAT_SHIFT     10u    /* bucket 0's upper bound is 2^SP_LAT_SHIFT ns */
#define SP_REC_MISSING   8u     /* missing ranks a record names (the count is exact) */
#define SP_STATS_ENDED_MAX 64u  /* records of groups whose job ended, newest kept */

/* Statuses as dense indices, from the one table in spclient/status.h. */
enum {
#define SP__STATUS_INDEX(name, value, msg) SP_STATUS_IDX_##name,
    SPC_STATUS_MAP(SP__STATUS_INDEX)
#undef SP__STATUS_INDEX
    SP_STATUS_COUNT
};

/* The counters of one op kind. */
typedef struct sp_opstats {
    uint64_t ops;                           /* ended, ok or not */
    uint64_t failed;
    uint64_t bytes;                         /* written into ranks' buffers, successful ops */
    uint64_t sum_ns, max_ns;                /* of the successful ops' durations */
    uint64_t lat[SP_LAT_BUCKETS];           /* successful ops by duration (not cumulative) */
    uint64_t failed_by[SP_STATUS_COUNT + 1];/* by status index; the last: a status not in the table */
} sp_opstats_t;

/* One collective in the flight recorder. Times are CLOCK_MONOTONIC ns; 0: the
 * op never reached that phase. Ranks are group ranks. */
typedef struct sp_oprec {
    uint64_t     seq;
    uint64_t     first_ns;      /* first rank's arrival */
    uint64_t     last_ns;       /* last arrival (of those that came) */
    uint64_t     start_ns;      /* data movement taken up by the progress thread */
    uint64_t     end_ns;
    uint64_t     bytes;
    spc_status_t status;
    uint32_t     arrived;
    uint32_t     first_rank, last_rank;
    uint32_t     nmissing;
    uint32_t     missing[SP_REC_MISSING];
    uint8_t      channel, opcode;
    char         detail[SP_DETAIL_BYTES];
} sp_oprec_t;

/* A group's accounting. Held by the group while it lives, by each of its ops
 * in flight, and by the list of ended groups; freed with the last holder. */
typedef struct sp_gstats {
    struct sp_gstats *next;          /* engine->stats.ended */
    uint32_t     refs;
    bool         ended;              /* the group is gone */
    char         job[SP_JOB_ID_MAX];
    uint64_t     job_created_ns;
    sp_job_access_t access;          /* the job's, kept for its history after it ended */
    uint32_t     group_id, size;
    bool         world;
    char         kind[12];
    uint32_t    *ranks;              /* [size]: job rank of each group rank */
    sp_opstats_t op[SP_STATS_KINDS];
    uint64_t     nrecs;              /* records ever written; the last min(nrecs, cap) are kept */
    uint32_t     cap;
    sp_oprec_t   recs[];
} sp_gstats_t;

/* The engine's part (engine->stats). */
typedef struct sp_stats {
    sp_opstats_t total[SP_STATS_KINDS];   /* daemon-wide, since start */
    sp_gstats_t *ended, *ended_tail;      /* groups of ended jobs, oldest first */
    uint32_t     nended;
    uint64_t     clock_ns;                /* the engine's latest clock reading (arrivals, ends) */
} sp_stats_t;

/* ---- the op path (engine lock held) */

/* Makes a group's record, when it has ranks on this daemon; NULL when not (or
 * out of memory: the group then goes uncounted, with a warning). */
sp_gstats_t *sp_stats_group_new(sp_engine_t *eng, const sp_group_t *g);
/* The group is destroyed: its record joins the ended groups. Accepts NULL. */
void sp_stats_group_gone(sp_engine_t *eng, sp_gstats_t *gs);
/* An op joins a collective of the group: it holds the record until it completes. */
void sp_stats_hold(sp_op_t *op, sp_gstats_t *gs);
/* sp_op_complete: the op lets go of its group's record. */
void sp_stats_release(sp_engine_t *eng, sp_op_t *op);
/* The progress thread takes a matched collective up (host: its copy begins;
 * device: it goes to stream order). */
void sp_stats_task_started(sp_engine_t *eng, sp_task_t *t);
/*
 * A collective ended: counts it and records it. ops[n] by group rank, NULL
 * for ranks that never came; gs NULL: the record the ops hold. bytes: what
 * the collective wrote over all its ranks (this daemon counts its ranks'
 * share). rank_status (may be NULL): per rank, a failure of that rank alone
 * that makes the collective fail when st is SPC_OK. Call before completing
 * the ops.
 */
void sp_stats_coll_done(sp_engine_t *eng, sp_gstats_t *gs, sp_op_t *const *ops, uint32_t n, uint64_t bytes,
                        spc_status_t st, const char *detail, const spc_status_t *rank_status);
/* A request ended on its own, outside any collective (g NULL: before it
 * reached a group). Call before completing it. */
void sp_stats_request_done(sp_engine_t *eng, const sp_group_t *g, const sp_op_t *op, spc_status_t st);

/* ---- reading (queries, metrics) */

/* Copies of the records, taken under the lock and read without it. */
typedef struct sp_stats_copy {
    char         job[SP_JOB_ID_MAX];
    uint64_t     job_created_ns;
    uint32_t     group_id, size;
    bool         world, ended;
    char         kind[12];
    sp_opstats_t op[SP_STATS_KINDS];
    uint32_t    *ranks;          /* with history: [size] */
    sp_oprec_t  *recs;           /* with history: oldest first */
    uint32_t     nrecs;
} sp_stats_copy_t;

/*
 * Copies the daemon's totals into total[] and the records of job `job`'s
 * groups (NULL or "": every job), in job creation then group order; with
 * `history` their flight recorders too, and the groups of ended jobs. Only
 * jobs `viewer` may see are copied (NULL: every job). *found_p says whether
 * such a job exists, or has a record kept, that viewer may see. Caller holds
 * the lock. Returns 0, or -1 when out of memory (nothing to free then).
 */
int  sp_stats_copy(sp_engine_t *eng, const char *job, const sp_viewer_t *viewer, bool history,
                   sp_opstats_t total[SP_STATS_KINDS], sp_stats_copy_t **copies_p, size_t *n_p, bool *found_p);
void sp_stats_copies_free(sp_stats_copy_t *c, size_t n);
/* Frees the ended groups' records (daemon exit). */
void sp_stats_cleanup(sp_engine_t *eng);

/* "alltoall", ... for kind k; "unknown" for the last. */
const char  *sp_stats_kind_name(unsigned k);
/* The status of index i; SPC_OK for the last (a status not in the table). */
spc_status_t sp_stats_status_of(unsigned i);
/* The bucket a duration of ns falls in. */
unsigned     sp_stats_bucket_of(uint64_t ns);
/* Bucket k's upper bound in ns (UINT64_MAX for the last). */
uint64_t     sp_stats_bucket_le_ns(unsigned k);
/* Quantile q in [0, 1] of the successful ops' durations, in ns (see the top). 0 with no op. */
double       sp_stats_quantile_ns(const sp_opstats_t *s, double q);

#endif /* SP_STATS_H */
