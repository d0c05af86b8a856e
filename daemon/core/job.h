/*
 * job.h — jobs, their members and their groups (job.c): who joined which job
 * as which rank, on which daemon, and the groups over those ranks that
 * collectives run on (coll.h).
 */
#ifndef SP_CORE_JOB_H
#define SP_CORE_JOB_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "core/auth.h"
#include "sp_msg.h"
#include "sp_shm.h"
#include "sp_topo.h"
#include "spclient/status.h"
#include "base/err.h"

#define SP_JOB_ID_MAX 128
#define SP_NODE_MAX   64
#define SP_MAX_WORLD  65536u   /* most ranks a job may have */

typedef struct sp_engine sp_engine_t;
typedef struct sp_client sp_client_t;
typedef struct sp_job sp_job_t;
typedef struct sp_group sp_group_t;
typedef struct sp_coll sp_coll_t;
typedef struct sp_mesh sp_mesh_t;
typedef struct sp_gstats sp_gstats_t;

/* One group a client belongs to, and its rank there. */
typedef struct sp_membership {
    uint32_t    group_id;
    sp_group_t *group;
    uint32_t    grank;
} sp_membership_t;

struct sp_group {
    sp_group_t   *next;           /* job->groups */
    uint32_t      id;             /* daemon-wide; what clients name in ops */
    uint32_t      size;
    char          kind[12];       /* "world", "dp", "sp", "ulysses", "ring" */
    sp_job_t     *job;
    uint32_t     *ranks;          /* job rank of each group rank */
    uint32_t      index;          /* creation order in the job: the same on every daemon */
    uint32_t      nlocal;         /* ranks on this daemon */
    uint32_t     *remote;         /* the other daemons with ranks in it (job node indices) */
    uint32_t      nremote;
    uint64_t     *next_seq;       /* [channel * size + group rank]: seq of its next op */
    /* A group rebuilt by a new spd (sp_job_resume): [channel * size + group
     * rank], the lowest seq each rank that came back replays there. Below it,
     * that rank saw the collectives complete. NULL: a group this spd made. */
    uint64_t     *resume_first;
    sp_coll_t    *colls[SP_CHANNELS];
    uint64_t      ops_done, bytes_done;
    sp_gstats_t  *stats;          /* its counters and flight recorder (stats.c); NULL: none here */
    spc_status_t  broken;         /* once a member is lost, every op fails with this */
    char          broken_detail[SP_DETAIL_BYTES];
};

typedef struct sp_member {
    sp_client_t *client;          /* NULL: not joined yet, gone, or on another daemon */
    uint32_t     node;            /* index in job->nodes: 0 is this daemon */
    bool         present;         /* joined (here or elsewhere) and not lost */
    bool         forwarded;       /* a mirror's rank: its join reached the root */
    pid_t        pid;             /* kept for messages after the client is gone */
    void        *join_pending;    /* the loop's pending join reply (cluster_jobs.c) */
    uint32_t     meshes_seen;     /* mesh creations this rank made: its next is mesh #meshes_seen */
    char         gpu_bus[SP_TOPO_BUS_MAX];   /* its GPU, a local rank's (sp_topo_bus_id); "": none or unknown */
} sp_member_t;

struct sp_job {
    sp_job_t    *next;            /* engine->jobs */
    char         id[SP_JOB_ID_MAX];
    uint64_t     creator_id;      /* client that created it; 0 once it left, or none: named */
    bool         named;           /* made by the first join of a name (id "uid/name"), no creator */
    char         launch[SP_JOB_LAUNCH_MAX];   /* a named job's launch: joins of another are refused */
    uint32_t     world_size;      /* 0 until the first join sets it */
    uint32_t     joined;
    bool         complete;        /* every rank joined at least once */
    uint64_t     complete_ns;     /* when it became so, or whole again (a relink): a node wait covers
                                     the jobs complete before it */
    uint64_t     created_ns;
    sp_job_access_t access;       /* who may join it and see it (auth.h) */
    sp_member_t *members;
    sp_group_t  *world;
    sp_group_t  *groups;          /* every group of the job, the world included */
    sp_mesh_t   *meshes;
    uint32_t     nmeshes;
    uint32_t     ngroups;         /* groups made so far: the next one's index */

    /* Daemons with ranks in the job: nodes[0] is this one. A job created on
     * another daemon is a mirror here: ranks join through its root (nodes[1]),
     * which says when the world is complete. */
    char       (*nodes)[SP_NODE_MAX];
    uint32_t     nnodes;
    bool         mirror;

    /* Rebuilt from its ranks' tickets after spd restarted (sp_job_resume):
     * the ticket's MAC, which every rank that comes back must bring. */
    bool         resumed;
    uint8_t      ticket_mac[SP_AUTH_MAC_BYTES];

    /* Over several daemons: the nonce its root drew when the world completed
     * (sent in JobReady), which its tickets carry and a relink must bring;
     * has_nonce false from a root that sent none (no ticket then). */
    uint8_t      nonce[SP_JOB_NONCE_BYTES];
    bool         has_nonce;
    /* Rebuilt over several daemons: the other daemons (bits by node index)
     * that have not accepted its relink yet, to which nothing is sent for the
     * job meanwhile, and those a relink went to over the current link. */
    uint32_t     relinking, relink_sent;
    uint64_t     relink_until_ns;   /* past it, those not relinked are lost (peer_restart_grace_ms) */
    char         lost_why[SP_DETAIL_BYTES];   /* why a node's ranks were lost: a group made later breaks so */
};

/* One channel's sequence numbers a rank brings back (spd.proto, ResumeSeq). */
typedef struct sp_resume_seq {
    uint32_t channel;
    uint64_t next, first;
} sp_resume_seq_t;

/* A group of a mesh a rank brings back (spd.proto, ResumeGroup), and its
 * sequence numbers there. */
typedef struct sp_resume_group {
    uint32_t        index;
    const char     *kind;
    const uint32_t *ranks;
    uint32_t        size;
    sp_resume_seq_t seqs[SP_CHANNELS];
    size_t          nseqs;
} sp_resume_group_t;

/* Creates a job named after this node with a random 128-bit token, owned by
 * the creator's uid; the `nallow` uids of `allow` may join it too. */
spc_status_t sp_job_create(sp_engine_t *eng, sp_client_t *creator, const uint32_t *allow, size_t nallow,
                           sp_job_t **job_p, sp_err_t *e);
/* Whether `viewer` (NULL: anyone) may see the job: it may see its access
 * (auth.h), or has a rank of it on this daemon (a mirror's ranks, before the
 * root said whose the job is). */
bool sp_job_visible(const sp_job_t *job, const sp_viewer_t *viewer);
/* Records `c` as `rank` of the job, when its uid may join it (else
 * SPC_ERR_PERMISSION; a mirror that does not know whose the job is yet leaves
 * that to its root). *complete_p says whether the world is now complete (then
 * every pending join can be answered). */
spc_status_t sp_job_join(sp_engine_t *eng, sp_client_t *c, const char *job_id, uint32_t world_size,
                         uint32_t rank, void *join_pending, sp_job_t **job_p, bool *complete_p,
                         sp_err_t *e);
/* A named join (spd.proto, JobJoinReq): records `c` as `rank` of the live job
 * `name` of c's uid, made now when there is none, as sp_job_join does. Refused
 * when the name or launch is malformed, when the job that holds the name is of
 * another launch or world size or has started, and past max_named_jobs_per_user. */
spc_status_t sp_job_join_named(sp_engine_t *eng, sp_client_t *c, const char *name, const char *launch,
                               uint32_t world_size, uint32_t rank, void *join_pending, sp_job_t **job_p,
                               bool *complete_p, sp_err_t *e);
/* The checks of a named join that need no job: the name, the launch id, a
 * client not in a job yet, a rank below a world size of [1, SP_MAX_WORLD]. */
spc_status_t sp_job_named_check(const sp_client_t *c, const char *name, const char *launch, uint32_t world_size,
                                uint32_t rank, sp_err_t *e);
/* The id of c's named job `name`: "uid/name". */
void sp_job_named_id(uid_t uid, const char *name, char id[SP_JOB_ID_MAX]);
/* Makes the mirror of the named job `name` of `uid` whose home is daemon `home`
 * (ctl/cluster_names.c found it there), for sp_job_join_named to join: SPC_OK,
 * SPC_ERR_LIMIT past max_named_jobs_per_user, SPC_ERR_NO_MEMORY. Lock held;
 * the job must not be here yet. */
spc_status_t sp_job_mirror_named(sp_engine_t *eng, uid_t uid, const char *name, const char *launch, const char *home,
                                 sp_err_t *e);
/* Fills *t with the job's ticket (auth.h), which its ranks keep to come back
 * to the next spd: false where this spd has no resume key, or the job spans
 * daemons without a nonce or beyond what a ticket holds. */
bool sp_job_ticket(const sp_engine_t *eng, const sp_job_t *job, sp_job_ticket_t *t);
/* Whether a process of `uid` may come back as `rank` of the job `ticket`
 * names: the ticket opens under this spd's key (auth.h) and its job admits
 * uid. Nothing else is looked at, so that a stranger is refused before spd
 * touches anything it brought. *t_p: the ticket, on success. */
spc_status_t sp_job_ticket_check(const sp_engine_t *eng, const uint8_t *ticket, size_t ticket_len, uid_t uid,
                                 uint32_t rank, sp_job_ticket_t *t_p, sp_err_t *e);
/* Makes c `rank` of the job its ticket names, as the spd before this one held
 * it (docs/architecture.md, "Restarting spd under running jobs"): the first of
 * its ranks to come back makes the job and its world group, the first to bring
 * a group of a mesh back makes that group; every rank sets its sequence numbers
 * in each from `seqs` (at most one per channel). ids[i] is groups[i]'s id here.
 * Refused, with nothing changed, when the ticket does not open, c's uid may
 * not join the job, the job is live here and was not resumed or was resumed
 * from another ticket, the rank came back already, a group is not one of the
 * rank's or another rank brought it with other members, or a named job would
 * pass max_named_jobs_per_user. */
spc_status_t sp_job_resume(sp_engine_t *eng, sp_client_t *c, const uint8_t *ticket, size_t ticket_len, uint32_t rank,
                           const sp_resume_seq_t *seqs, size_t nseqs, const sp_resume_group_t *groups,
                           size_t ngroups, uint32_t *ids, sp_job_t **job_p, sp_err_t *e);
/* Whether every rank a rebuilt job has on this daemon came back: its relink
 * can then say their sequence numbers. */
bool sp_job_local_back(const sp_job_t *job);

/* A sequence number a relink carries: job rank `rank`'s next op on `channel`
 * of the group of index group_index. */
typedef struct sp_relink_seq {
    uint32_t group_index, rank, channel;
    uint64_t next;
} sp_relink_seq_t;

/* What a restarted daemon claims of a job (spd.proto, PeerJoin with resume). */
typedef struct sp_relink {
    const char            *job_id, *launch;
    uint32_t               world_size, owner;
    char *const           *rank_node;   /* [nrank_node]: each rank's node */
    size_t                 nrank_node;
    const uint8_t         *nonce;
    size_t                 nonce_len;
    const sp_relink_seq_t *seqs;
    size_t                 nseqs;
} sp_relink_t;

/* Fills *rl with the job's relink, its seqs in *seqs_p (the caller frees them
 * and names[]: the rank_node array, borrowed from the job): -1 out of memory. */
int sp_job_relink_make(const sp_job_t *job, sp_relink_t *rl, sp_relink_seq_t **seqs_p, char ***names_p);
/* At a daemon that waits for `node` (peer_restart_grace_ms): takes the relink
 * of the daemon restarted there, once it checks (the job complete here, node
 * one of its daemons with ranks still waited for, every field what this
 * daemon holds, the nonce included); the wait then ends for the job. Refused,
 * with nothing changed: SPC_ERR_NOT_FOUND (no such job), SPC_ERR_PERMISSION
 * (not from the node waited for, or a wrong nonce), SPC_ERR_BUSY (not
 * waiting), SPC_ERR_MISMATCH (another job's fields). */
spc_status_t sp_job_relink_accept(sp_engine_t *eng, const char *node, const sp_relink_t *rl, sp_job_t **job_p,
                                  sp_err_t *e);
/* At the restarted daemon: node `node` answered the job's relink. Accepted,
 * the job sends there again; refused, the ranks there are lost, naming why. */
void sp_job_relinked(sp_engine_t *eng, sp_job_t *job, const char *node, spc_status_t st, const char *why);

/* Takes back a join that timed out, or whose client left, before the world was
 * complete; frees the job when its creator has left too and nobody else holds it. */
void sp_job_join_cancel(sp_engine_t *eng, sp_job_t *job, uint32_t rank);

/* Jobs across daemons. The node a job id names as its root (the part before ':'). */
void sp_job_root_node(const char *job_id, char node[SP_NODE_MAX]);
/* The mirror of a job rooted on another daemon, made on first use. NULL: out of memory. */
sp_job_t *sp_job_mirror(sp_engine_t *eng, const char *job_id, const char *root);
/* At the root: rank `rank` of another daemon `node`, a process `pid` of `uid`,
 * joins (or, with cancel, takes it back); refused like a local join, a named
 * job's also when `launch` is not its launch. */
spc_status_t sp_job_join_remote(sp_engine_t *eng, const char *job_id, const char *launch, uint32_t world_size,
                                uint32_t rank, pid_t pid, uid_t uid, const char *node, sp_job_t **job_p,
                                bool *complete_p, sp_err_t *e);
void sp_job_join_remote_cancel(sp_engine_t *eng, sp_job_t *job, uint32_t rank, const char *node);
/* At a mirror: the root says the world is complete, where each rank is,
 * whose the job is, and its nonce (nonce_len 0 from a root that sends none). */
spc_status_t sp_job_ready(sp_engine_t *eng, sp_job_t *job, uint32_t world_size, char *const *rank_node,
                          size_t n, const sp_job_access_t *access, const uint8_t *nonce, size_t nonce_len,
                          sp_err_t *e);
/* A rank of another daemon was lost: its groups break, naming it. */
void sp_job_remote_rank_lost(sp_engine_t *eng, sp_job_t *job, uint32_t rank, const char *why);
/*
 * A daemon whose link dropped, waited for (peer_restart_grace_ms) before the
 * ranks it has in complete jobs are lost. Jobs that completed later (with the
 * daemon back) are not its concern.
 */
typedef struct sp_node_wait {
    struct sp_node_wait *next;    /* engine->node_waits */
    char         node[SP_NODE_MAX];
    char         why[SP_DETAIL_BYTES / 2];
    uint64_t     since_ns, until_ns;
} sp_node_wait_t;

/* A daemon's link dropped. The joins in progress there are dealt with at once,
 * and so are the ops with NCCL; every group of a complete job with ranks there
 * breaks now (grace_ns 0), or once the grace passes (sp_job_node_waits_expire). */
void sp_job_node_down(sp_engine_t *eng, const char *node, const char *why, uint64_t grace_ns);
/* Loses the ranks of every daemon waited for past its grace, and of every
 * daemon that did not take a rebuilt job back within it. Returns when the
 * next wait ends (UINT64_MAX: none is left). */
uint64_t sp_job_node_waits_expire(sp_engine_t *eng, uint64_t now_ns);
/* spd was held for ns (sp_peers_awake): every wait, for a daemon that went and
 * for the daemons to take a rebuilt job back, ends that much later. */
void sp_job_node_waits_defer(sp_engine_t *eng, uint64_t ns);
/* Whether the job waits for node idx: nothing is sent there for it meanwhile. */
bool sp_job_node_waited(const sp_engine_t *eng, const sp_job_t *job, uint32_t idx);
/* The wait that ends first of those the job is in (for spctl jobs); NULL: none. */
const sp_node_wait_t *sp_job_node_wait(const sp_engine_t *eng, const sp_job_t *job);
/* Index of node `name` in the job, added when `add`; UINT32_MAX when absent (or out of memory). */
uint32_t sp_job_node_index(sp_job_t *job, const char *name, bool add);
sp_group_t *sp_job_group_by_index(const sp_job_t *job, uint32_t index);
/* Writes "ranks 2, 5 (of 8) have not joined" style text. */
void sp_job_missing(const sp_job_t *job, char *buf, size_t len);
/* A member left (detach or death): its groups break, naming it. */
void sp_job_member_lost(sp_engine_t *eng, sp_client_t *c, const char *why);
/* Forgets a client that created a job (freeing the job if nobody is in it). */
void sp_job_creator_gone(sp_engine_t *eng, uint64_t client_id);
/* Frees every job (daemon exit, after every client is gone). */
void sp_jobs_cleanup(sp_engine_t *eng);
sp_job_t *sp_job_find(sp_engine_t *eng, const char *id);
/* Ops waiting in collectives of this group (for spctl and drain). */
uint32_t sp_group_pending_ops(const sp_group_t *g);
void sp_job_fail_all(sp_engine_t *eng, spc_status_t st, const char *detail);
/* A new group of the job over the given job ranks; every member client learns
 * its membership. NULL when out of memory. */
sp_group_t *sp_group_create(sp_engine_t *eng, sp_job_t *job, const char *kind, const uint32_t *ranks,
                            uint32_t size);
/* The group `id` as seen by client c, and c's rank in it; NULL when c is not in it. */
sp_group_t *sp_client_group(const sp_client_t *c, uint32_t id, uint32_t *grank_p);

#endif /* SP_CORE_JOB_H */
