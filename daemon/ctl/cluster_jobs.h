/*
 * cluster_jobs.h — the joins that wait for their job's world, and the control
 * side of jobs across daemons.
 */
#ifndef SP_CTL_CLUSTER_JOBS_H
#define SP_CTL_CLUSTER_JOBS_H

#include "ctl/session.h"
#include "core/job.h"

/* Arms the deadline of the join session s has in progress (set up under the
 * lock by the JobJoinReq handler): past timeout_ms it is taken back and
 * answered with SPC_ERR_TIMEOUT, naming who is missing. */
void sp_joins_arm(sp_session_t *s, uint64_t timeout_ms);
/* Takes the sessions waiting on the job's joins off its members (under the
 * lock); NULL, leaving them, when out of memory. */
sp_session_t **sp_joins_waiting(sp_job_t *job, uint32_t *n_p);
/* Answers every waiting join of a job that just completed, with the job's
 * ticket (NULL: none, the job cannot be resumed), and frees the array. Call
 * without the lock. */
void sp_joins_answer(sp_session_t **waiting, uint32_t n, uint32_t group, uint32_t size,
                     const sp_job_ticket_t *ticket);

/* Settles a join just tried under the lock (st, from sp_job_join or
 * sp_job_join_named) and drops the lock. Taken (SPC_OK): the session waits on
 * it, with its GPU `bus`; a mirror's join goes to the root; a world it
 * completed answers every waiting rank, this session's too, and the other
 * daemons with ranks hear of it. Returns st, or the error of answering, with
 * its detail in e; the caller answers errors, and arms the join's deadline
 * while s->join_active stays set. */
spc_status_t sp_joins_settle(sp_session_t *s, uint32_t seq, uint32_t rank, const char *bus, spc_status_t st,
                             sp_job_t *job, bool complete, sp_err_t *e);

/* A local rank's join of a job rooted on another daemon goes to the root as a
 * PeerJoin, now if a link is up, else when it comes up. Lock held. */
void sp_cluster_forward_join(sp_server_t *srv, sp_job_t *job, uint32_t rank);
/* Tells the other daemons with ranks in a complete job who is where. Lock held. */
void sp_cluster_job_ready_send(sp_server_t *srv, sp_job_t *job);
/* A job over daemons rebuilt here after a restart: once all its ranks here
 * came back, claims it again on each other daemon with a link up that has
 * not taken it back (PeerJoin with resume); the others when their link comes
 * up. Arms the deadline of those claims. Lock held. */
void sp_cluster_relink(sp_server_t *srv, sp_job_t *job);
/* Sends an NCCL id this daemon made to another daemon of the group (the
 * callback sp_nccl_outbox_drain takes; arg is the server). */
void sp_cluster_send_nccl_id(void *arg, const char *node, const char *job, uint32_t group_index, uint32_t channel,
                             uint64_t seq, const uint8_t *id, size_t len);
/* Starts the links and the data path when the configuration names peers or a
 * peer_listen address (0 at once when it names neither); -1 on failure, with
 * nothing of them left started. */
int sp_cluster_init(sp_server_t *srv);

#endif /* SP_CTL_CLUSTER_JOBS_H */
