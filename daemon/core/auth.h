/*
 * auth.h — who may attach, and who may join and see a job. A peer may attach
 * when its uid is the daemon's, or when it belongs (primary or supplementary
 * group) to the configured allow_group. Users admitted that way share spd but
 * not their jobs: a job belongs to the uid that created it, and only that uid
 * and the uids its creator granted may join it or see its id; spd's own uid
 * and root, the operators, see every job but join none of another's. The
 * decisions are pure functions so that they are tested without other users.
 */
#ifndef SP_AUTH_H
#define SP_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include "base/err.h"
#include "sp_msg.h"

#define SP_AUTH_NO_GROUP ((long)-1)

/* Who a job belongs to. A mirror of a job rooted on another daemon learns it
 * from the root's JobReady; until then it is not `known`. */
typedef struct sp_job_access {
    bool     known;
    uid_t    owner;
    uint32_t nallow;
    uid_t    allow[SP_JOB_MAX_ALLOW_UIDS];   /* the creator's grants */
} sp_job_access_t;

spc_status_t sp_auth_allowed(uid_t self_uid, uid_t peer_uid, gid_t peer_gid, const gid_t *groups, int ngroups,
                             long allow_gid, sp_err_t *e);

/* Resolves a group name or number. Returns 0, or -1 when unknown. "" gives SP_AUTH_NO_GROUP. */
int sp_auth_resolve_group(const char *spec, long *gid_p);

/* Reads SO_PEERCRED and SO_PEERGROUPS of a connected Unix socket. Returns 0 or -errno. */
int sp_auth_peer(int fd, pid_t *pid_p, uid_t *uid_p, gid_t *gid_p, gid_t *groups, int *ngroups_p);

/* Who asks a question of spd (a query): spd's own uid and the asker's. */
typedef struct sp_viewer {
    uid_t self;
    uid_t uid;
} sp_viewer_t;

/* Whether processes of `uid` may join a job: its owner's and the granted
 * uids'. SPC_OK, or SPC_ERR_PERMISSION saying why and what to do. */
spc_status_t sp_auth_may_join(const sp_job_access_t *a, const char *job_id, uid_t uid, sp_err_t *e);

/* Whether `uid` may read what spd holds of every user: spd's own uid (self_uid) and root. */
bool sp_auth_operator(uid_t self_uid, uid_t uid);

/* Whether `uid` may see a job's id: an operator, its owner, or a granted uid. */
bool sp_auth_may_see(const sp_job_access_t *a, uid_t self_uid, uid_t uid);

/*
 * Tickets: how a rank claims its place again from the spd that replaces the
 * one it joined through (job.c, sp_job_resume). The new spd knows nothing of
 * the job; the rank's word alone would let anyone admitted to spd name a job
 * id and make it theirs while its ranks come back. So each join's answer
 * carries the job as spd holds it (id, owner, grants, world size) under an
 * HMAC-SHA256 of the node's resume key, a secret only spd reads (a file of
 * its own beside the socket, which outlives its restarts: ctl/server.c). A
 * claim must carry a ticket whose MAC checks, and come from a uid the ticket's
 * job admits: a stranger can neither forge a ticket naming itself nor use a
 * job's own ticket. The key's holder is spd's uid, which may do anything to
 * spd anyway.
 *
 * A job over several daemons: each seals its own ranks' tickets under its own
 * key, adding the job's daemons (nodes[0] the sealing one, as the job lists
 * them), the node of every rank (as runs of consecutive ranks on one node) and
 * the job's nonce, which its root drew when the world completed. A job over
 * more daemons, or whose ranks change node more often, than a ticket holds
 * gets none.
 */
#define SP_AUTH_KEY_BYTES     32u
#define SP_AUTH_MAC_BYTES     32u
#define SP_JOB_TICKET_VERSION 2u
#define SP_JOB_NONCE_BYTES    16u
#define SP_TICKET_NODES       16u    /* daemons a ticket's job may span */
#define SP_TICKET_RUNS        64u    /* runs of ranks on one daemon it may have */
#define SP_TICKET_NODE_MAX    64u    /* SP_NODE_MAX, NUL-terminated */

typedef struct sp_job_ticket {
    uint32_t version;             /* SP_JOB_TICKET_VERSION */
    uint32_t world_size;
    uint32_t owner;
    uint32_t nallow;
    uint32_t allow[SP_JOB_MAX_ALLOW_UIDS];
    uint32_t named;               /* 1: a named job ("uid/name"), joined by name and launch */
    uint32_t reserved;
    char     id[128];             /* SP_JOB_ID_MAX, NUL-terminated */
    char     launch[SP_JOB_LAUNCH_MAX];
    uint8_t  nonce[SP_JOB_NONCE_BYTES];   /* zero on one daemon */
    uint32_t nnodes;              /* 1: the job is on this daemon alone */
    uint32_t root;                /* index in nodes of the job's root (its home) */
    uint32_t nruns;
    uint32_t run_first[SP_TICKET_RUNS];   /* run i: ranks [run_first[i], run_first[i+1] or world_size) */
    uint8_t  run_node[SP_TICKET_RUNS];    /* ... on nodes[run_node[i]] */
    char     nodes[SP_TICKET_NODES][SP_TICKET_NODE_MAX];
    uint8_t  mac[SP_AUTH_MAC_BYTES];   /* of every byte before it */
} sp_job_ticket_t;

/* Sets t->mac under key. */
void sp_auth_ticket_seal(const uint8_t key[SP_AUTH_KEY_BYTES], sp_job_ticket_t *t);

/* Reads the `len` bytes a client handed back into *t, once their MAC checks
 * under key and they are a ticket this spd writes (version, strings ended,
 * counts in range): SPC_OK; SPC_ERR_INVALID_ARG for a wrong size,
 * SPC_ERR_PERMISSION for a MAC that does not check, SPC_ERR_PROTOCOL for a
 * sealed ticket that makes no sense. *t is set only on success. */
spc_status_t sp_auth_ticket_open(const uint8_t key[SP_AUTH_KEY_BYTES], const uint8_t *bytes, size_t len,
                                 sp_job_ticket_t *t, sp_err_t *e);

#endif /* SP_AUTH_H */
