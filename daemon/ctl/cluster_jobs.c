/*
 * cluster_jobs.c — the control side of jobs: the joins that wait for their
 * world, and the glue between the peer links and the core's jobs when a job
 * spans daemons (PeerJoin, PeerJoinRep, JobReady, NcclId, links up and down).
 *
 * A join is answered once its job's world is complete, for every rank waiting
 * on it at once, always with the engine lock dropped (a failed send closes a
 * session, which takes the lock). The data side across daemons is net.c and
 * nccl.c; this file only carries what their control needs.
 */
#include "ctl/cluster_jobs.h"
#include "ctl/cluster_names.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "cluster/net.h"
#include "cluster/sp_nccl.h"
#include "sp_msg.h"
#include "core/engine.h"
#include "core/job.h"

/* ================================================================ joins that wait */

static void send_join_rep(sp_session_t *s, uint32_t group, uint32_t world_size, const sp_job_ticket_t *ticket)
{
    Spd__Msg m = SPD__MSG__INIT;
    Spd__JobJoinRep rep = SPD__JOB_JOIN_REP__INIT;
    rep.world_group = group;
    rep.world_size = world_size;
    if (ticket != NULL) {
        rep.resume_ticket.data = (uint8_t *)ticket;
        rep.resume_ticket.len = sizeof *ticket;
    }
    rep.rank = s->join_rank;
    m.seq = s->join_seq;
    m.body_case = SPD__MSG__BODY_JOB_JOIN_REP;
    m.job_join_rep = &rep;
    s->join_active = false;
    s->join_job = NULL;
    uv_timer_stop(&s->timer);
    sp_session_send(s, &m);
}

static void on_join_timeout(uv_timer_t *t)
{
    sp_session_t *s = t->data;
    sp_server_t *srv = s->srv;
    char missing[SP_DETAIL_BYTES];

    if (!s->join_active)
        return;
    if (s->join_lookup != NULL) {   /* no daemon said it is the name's home */
        sp_names_expired(s, missing, sizeof missing);
    } else {
        pthread_mutex_lock(&srv->eng->lock);
        sp_job_missing(s->join_job, missing, sizeof missing);
        /* Ranks of a launch over several nodes find each other through peers. */
        size_t n = strlen(missing);
        if (s->join_job->named && !srv->peers.enabled && n < sizeof missing)
            snprintf(missing + n, sizeof missing - n, " (this spd has no peers: ranks that joined on another node's "
                     "spd cannot reach this job)");
        sp_job_join_cancel(srv->eng, s->join_job, s->join_rank);
        pthread_mutex_unlock(&srv->eng->lock);
    }
    s->join_active = false;
    s->join_job = NULL;
    sp_warn(JOB, "pid %d: join timed out: %s", (int)s->pid, missing);
    sp_session_reply_error(s, s->join_seq, SPC_ERR_TIMEOUT, missing);
}

/* Waits timeout_ms for the job of the session's join to complete; past it the
 * join is taken back and answered with SPC_ERR_TIMEOUT, naming who is missing. */
void sp_joins_arm(sp_session_t *s, uint64_t timeout_ms)
{
    uv_timer_start(&s->timer, on_join_timeout, timeout_ms, 0);
}

/* Collects the sessions waiting on the job's joins (under the lock). */
sp_session_t **sp_joins_waiting(sp_job_t *job, uint32_t *n_p)
{
    sp_session_t **waiting = calloc(job->world_size, sizeof *waiting);
    uint32_t n = 0;
    for (uint32_t i = 0; i < job->world_size && waiting != NULL; i++) {
        sp_member_t *mb = &job->members[i];
        if (mb->join_pending != NULL)
            waiting[n++] = mb->join_pending;
        mb->join_pending = NULL;
    }
    *n_p = n;
    return waiting;
}

/* Answers every waiting join of a job that just completed. Call without the lock
 * (a failed send closes a session, which takes it). */
void sp_joins_answer(sp_session_t **waiting, uint32_t n, uint32_t group, uint32_t size,
                     const sp_job_ticket_t *ticket)
{
    for (uint32_t i = 0; i < n; i++)
        send_join_rep(waiting[i], group, size, ticket);
    free(waiting);
}

spc_status_t sp_joins_settle(sp_session_t *s, uint32_t seq, uint32_t rank, const char *bus, spc_status_t st,
                             sp_job_t *job, bool complete, sp_err_t *e)
{
    sp_server_t *srv = s->srv;
    sp_session_t **waiting = NULL;
    uint32_t nwaiting = 0, size = 0, group = 0;
    sp_job_ticket_t ticket;
    bool ticketed = false;

    if (st == SPC_OK) {
        snprintf(job->members[rank].gpu_bus, sizeof job->members[rank].gpu_bus, "%s", bus);
        s->join_active = true;
        s->join_seq = seq;
        s->join_rank = rank;
        s->join_job = job;
        if (job->mirror)
            sp_cluster_forward_join(srv, job, rank);
    }
    /* The world is complete: answer every rank that waits, this one included,
     * and tell the other daemons with ranks in it. */
    if (st == SPC_OK && complete) {
        size = job->world_size;
        group = job->world->id;
        ticketed = sp_job_ticket(srv->eng, job, &ticket);
        waiting = sp_joins_waiting(job, &nwaiting);
        sp_cluster_job_ready_send(srv, job);
    }
    pthread_mutex_unlock(&srv->eng->lock);
    if (st != SPC_OK || !complete)
        return st;
    if (waiting == NULL) {
        s->join_active = false;
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory answering the joins");
    }
    sp_joins_answer(waiting, nwaiting, group, size, ticketed ? &ticket : NULL);
    return SPC_OK;
}

/* ================================================================ jobs across daemons */

/*
 * The control side of jobs that span daemons (the data side is net.c). A rank
 * joining a job rooted elsewhere is forwarded to the root with PeerJoin as soon
 * as a link to the root is up; the root answers with JobReady, naming every
 * rank's node, once all have joined, and each daemon then answers its own
 * ranks' joins. A rank lost after that is told to the others on the data
 * stream (net.c), behind its last collectives; a daemon lost is seen by every
 * other through its link. Either way their groups fail at once, naming it.
 * Device ops across daemons go through NCCL communicators (nccl.c), whose ids
 * the group's lowest daemon sends here as NcclId.
 */

/* A job's grants as PeerJoinRep and JobReady carry them; returns how many. */
static size_t access_to_wire(const sp_job_access_t *a, uint32_t allow[SP_JOB_MAX_ALLOW_UIDS])
{
    for (uint32_t i = 0; i < a->nallow; i++)
        allow[i] = a->allow[i];
    return a->nallow;
}

/* The owner and grants a root sends for its job; SPC_ERR_PROTOCOL when they
 * cannot be a job's. */
static spc_status_t access_from_wire(const char *job_id, uint32_t owner, const uint32_t *allow, size_t n,
                                     sp_job_access_t *a, sp_err_t *e)
{
    if (n > SP_JOB_MAX_ALLOW_UIDS)
        return sp_err_set(e, SPC_ERR_PROTOCOL, "job %.128s: its root grants %zu uids; a job admits at most %u", job_id,
                          n, SP_JOB_MAX_ALLOW_UIDS);
    *a = (sp_job_access_t){ .known = true, .owner = owner, .nallow = (uint32_t)n };
    for (size_t i = 0; i < n; i++)
        a->allow[i] = allow[i];
    return SPC_OK;
}

void sp_cluster_forward_join(sp_server_t *srv, sp_job_t *job, uint32_t rank)
{
    sp_member_t *m = &job->members[rank];
    Spd__Msg msg = SPD__MSG__INIT;
    Spd__PeerJoin j = SPD__PEER_JOIN__INIT;
    j.job_id = job->id;
    j.world_size = job->world_size;
    j.rank = rank;
    j.pid = m->pid;
    j.uid = m->client->uid;   /* the root decides whether it may join */
    j.launch = job->launch;   /* a named job's home refuses another launch's rank */
    msg.body_case = SPD__MSG__BODY_PEER_JOIN;
    msg.peer_join = &j;
    /* Without a link yet the join waits: cluster_on_up sends it. */
    if (sp_peers_send(&srv->peers, job->nodes[1], &msg) == 0)
        m->forwarded = true;
}

void sp_cluster_job_ready_send(sp_server_t *srv, sp_job_t *job)
{
    if (job->nnodes < 2)
        return;
    char **names = calloc(job->world_size, sizeof *names);
    if (names == NULL)
        return;
    for (uint32_t r = 0; r < job->world_size; r++)
        names[r] = job->nodes[job->members[r].node];
    Spd__Msg msg = SPD__MSG__INIT;
    Spd__JobReady jr = SPD__JOB_READY__INIT;
    jr.job_id = job->id;
    jr.world_size = job->world_size;
    jr.n_rank_node = job->world_size;
    jr.rank_node = names;
    uint32_t allow[SP_JOB_MAX_ALLOW_UIDS];
    jr.owner_uid = job->access.owner;
    jr.n_allow_uids = access_to_wire(&job->access, allow);
    jr.allow_uids = allow;
    if (job->has_nonce)
        jr.nonce = (ProtobufCBinaryData){ sizeof job->nonce, job->nonce };
    msg.body_case = SPD__MSG__BODY_JOB_READY;
    msg.job_ready = &jr;
    for (uint32_t k = 1; k < job->nnodes; k++)
        if (sp_peers_send(&srv->peers, job->nodes[k], &msg) != 0)
            sp_warn(JOB, "job %s: no link to node %s to say the world is complete", job->id, job->nodes[k]);
    free(names);
}

static void cluster_waits_expire(sp_server_t *srv);

void sp_cluster_relink(sp_server_t *srv, sp_job_t *job)
{
    sp_relink_t rl;
    sp_relink_seq_t *seqs;
    char **names;

    /* Without peers (a ticket of a job over daemons brought to an spd set up
     * for one node) nothing can take the job back: its other nodes are lost. */
    if (!srv->peers.enabled) {
        for (uint32_t idx = 1; idx < job->nnodes && idx < 32; idx++)
            if (job->relinking & (1u << idx))
                sp_job_relinked(srv->eng, job, job->nodes[idx], SPC_ERR_UNSUPPORTED,
                                "this spd has no peers (peer_listen, peers), so no daemon can take the job back");
        return;
    }
    cluster_waits_expire(srv);   /* the deadline of the claims */
    if ((job->relinking & ~job->relink_sent) == 0 || !sp_job_local_back(job))
        return;
    if (sp_job_relink_make(job, &rl, &seqs, &names) != 0) {
        sp_warn(JOB, "job %s: out of memory for its relink; retried when a link comes up", job->id);
        return;
    }
    Spd__RelinkSeq *wire = calloc(rl.nseqs + 1, sizeof *wire);
    Spd__RelinkSeq **ptrs = calloc(rl.nseqs + 1, sizeof *ptrs);
    if (wire == NULL || ptrs == NULL) {
        sp_warn(JOB, "job %s: out of memory for its relink; retried when a link comes up", job->id);
        goto out;
    }
    for (size_t i = 0; i < rl.nseqs; i++) {
        spd__relink_seq__init(&wire[i]);
        wire[i].group_index = seqs[i].group_index;
        wire[i].rank = seqs[i].rank;
        wire[i].channel = seqs[i].channel;
        wire[i].next = seqs[i].next;
        ptrs[i] = &wire[i];
    }
    Spd__Msg msg = SPD__MSG__INIT;
    Spd__PeerJoin j = SPD__PEER_JOIN__INIT;
    j.resume = true;
    j.job_id = job->id;
    j.launch = job->launch;
    j.world_size = job->world_size;
    j.uid = job->access.owner;
    j.nonce = (ProtobufCBinaryData){ rl.nonce_len, (uint8_t *)rl.nonce };
    j.rank_node = names;
    j.n_rank_node = rl.nrank_node;
    j.seqs = ptrs;
    j.n_seqs = rl.nseqs;
    msg.body_case = SPD__MSG__BODY_PEER_JOIN;
    msg.peer_join = &j;
    for (uint32_t idx = 1; idx < job->nnodes && idx < 32; idx++) {
        if (!(job->relinking & (1u << idx)) || (job->relink_sent & (1u << idx)))
            continue;
        if (sp_peers_send(&srv->peers, job->nodes[idx], &msg) != 0)
            continue;   /* no link yet: cluster_on_up sends it */
        job->relink_sent |= 1u << idx;
        sp_info(JOB, "job %s: asked node %s to take the job back (%zu sequence numbers)", job->id, job->nodes[idx],
                rl.nseqs);
    }
out:
    free(wire);
    free(ptrs);
    free(seqs);
    free(names);
}

/* At a daemon that waits for `node`: the daemon restarted there claims a job
 * back. Answered either way; a refusal is logged, and changes nothing. */
static void cluster_relink_heard(sp_server_t *srv, const char *node, const Spd__PeerJoin *j)
{
    sp_err_t e = SP_ERR_INIT;
    sp_relink_seq_t *seqs = calloc(j->n_seqs + 1, sizeof *seqs);
    spc_status_t st = SPC_ERR_NO_MEMORY;
    sp_job_t *job = NULL;
    if (seqs == NULL) {
        sp_err_set(&e, st, "out of memory");
    } else {
        for (size_t i = 0; i < j->n_seqs; i++)
            seqs[i] = (sp_relink_seq_t){ .group_index = j->seqs[i]->group_index, .rank = j->seqs[i]->rank,
                                         .channel = j->seqs[i]->channel, .next = j->seqs[i]->next };
        sp_relink_t rl = { .job_id = j->job_id, .launch = j->launch, .world_size = j->world_size, .owner = j->uid,
                           .rank_node = j->rank_node, .nrank_node = j->n_rank_node, .nonce = j->nonce.data,
                           .nonce_len = j->nonce.len, .seqs = seqs, .nseqs = j->n_seqs };
        st = sp_job_relink_accept(srv->eng, node, &rl, &job, &e);
    }
    free(seqs);
    if (st != SPC_OK)
        sp_warn(JOB, "node %s: relink of job %.128s refused: %s", node, j->job_id, e.msg);
    Spd__Msg msg = SPD__MSG__INIT;
    Spd__PeerJoinRep rep = SPD__PEER_JOIN_REP__INIT;
    rep.resume = true;
    rep.job_id = j->job_id;
    rep.status = st;
    rep.detail = e.msg;
    msg.body_case = SPD__MSG__BODY_PEER_JOIN_REP;
    msg.peer_join_rep = &rep;
    sp_peers_send(&srv->peers, node, &msg);
    if (st != SPC_OK)
        return;
    cluster_waits_expire(srv);   /* the grace timer, to the waits left */
    sp_net_resend(srv->eng, job, sp_job_node_index(job, node, false));
}

static void cluster_on_trusted(void *arg, const sp_peer_session_t *s)
{
    sp_server_t *srv = arg;
    pthread_mutex_lock(&srv->eng->lock);
    sp_net_expect(srv->eng, s->node, s->incarnation, s->recv_key);
    pthread_mutex_unlock(&srv->eng->lock);
}

static void cluster_on_up(void *arg, const sp_peer_session_t *s)
{
    sp_server_t *srv = arg;
    const char *node = s->node;
    pthread_mutex_lock(&srv->eng->lock);
    sp_net_connect(srv->eng, node, s->ucx_address, s->ucx_address_len, s->send_key);
    sp_nccl_node_up(srv->eng, node);
    /* Joins that waited for this root go now. */
    for (sp_job_t *job = srv->eng->jobs; job != NULL; job = job->next) {
        if (!job->mirror || job->complete || strcmp(job->nodes[1], node) != 0)
            continue;
        for (uint32_t r = 0; r < job->world_size; r++)
            if (job->members[r].client != NULL && !job->members[r].forwarded)
                sp_cluster_forward_join(srv, job, r);
    }
    /* Jobs rebuilt here that this daemon has not taken back: claim them now. */
    for (sp_job_t *job = srv->eng->jobs; job != NULL; job = job->next)
        if (job->relinking != 0)
            sp_cluster_relink(srv, job);
    pthread_mutex_unlock(&srv->eng->lock);
}

static void on_grace_end(uv_timer_t *t);

/* Loses the ranks of the daemons waited for past their grace, and sets the
 * timer to the next wait's end. Lock held. */
static void cluster_waits_expire(sp_server_t *srv)
{
    uint64_t now = sp_now_ns();
    uint64_t next = sp_job_node_waits_expire(srv->eng, now);
    if (next == UINT64_MAX)
        uv_timer_stop(&srv->grace_timer);
    else
        uv_timer_start(&srv->grace_timer, on_grace_end, (next - now + 999999) / 1000000, 0);
}

static void on_grace_end(uv_timer_t *t)
{
    sp_server_t *srv = t->data;
    /* Late for being held, before the peers' tick: the waits are put off first. */
    sp_peers_awake(&srv->peers, sp_now_ns());
    pthread_mutex_lock(&srv->eng->lock);
    cluster_waits_expire(srv);
    pthread_mutex_unlock(&srv->eng->lock);
    sp_engine_kick(srv->eng);
}

/* spd was held: a daemon waited for had no fair chance to come back meanwhile
 * (its claim waits unread here, or the machine held it too). */
static void cluster_on_held(void *arg, uint64_t held_ns)
{
    sp_server_t *srv = arg;
    pthread_mutex_lock(&srv->eng->lock);
    sp_job_node_waits_defer(srv->eng, held_ns);
    cluster_waits_expire(srv);
    pthread_mutex_unlock(&srv->eng->lock);
}

static void cluster_on_down(void *arg, const char *node, const char *why)
{
    sp_server_t *srv = arg;
    /* A link whose end is read after spd was held: the waits begun before are
     * put off by that time, not the one this begins. */
    sp_peers_awake(&srv->peers, sp_now_ns());
    pthread_mutex_lock(&srv->eng->lock);
    sp_net_disconnect(srv->eng, node);
    sp_job_node_down(srv->eng, node, why, (uint64_t)srv->cfg->peer_restart_grace_ms * 1000000);
    cluster_waits_expire(srv);
    for (sp_job_t *job = srv->eng->jobs; job != NULL; job = job->next) {
        if (job->mirror && !job->complete && strcmp(job->nodes[1], node) == 0)
            for (uint32_t r = 0; r < job->world_size; r++)
                job->members[r].forwarded = false;   /* to be sent again if it comes back */
        uint32_t idx = job->relinking != 0 ? sp_job_node_index(job, node, false) : UINT32_MAX;
        if (idx < 32)
            job->relink_sent &= ~(1u << idx);   /* a relink not answered goes again over the next link */
    }
    pthread_mutex_unlock(&srv->eng->lock);
    sp_engine_kick(srv->eng);
}

/* Takes back a forwarded join whose member record is already cleared. */
static void cluster_forward_cancel(sp_server_t *srv, sp_job_t *job, uint32_t rank)
{
    Spd__Msg msg = SPD__MSG__INIT;
    Spd__PeerJoin j = SPD__PEER_JOIN__INIT;
    j.job_id = job->id;
    j.rank = rank;
    j.cancel = true;
    msg.body_case = SPD__MSG__BODY_PEER_JOIN;
    msg.peer_join = &j;
    sp_peers_send(&srv->peers, job->nodes[1], &msg);
}

/* A local rank of a multi-daemon job left (engine hook; lock held). */
static void cluster_member_left(void *arg, sp_job_t *job, uint32_t rank, bool complete, const char *why)
{
    sp_server_t *srv = arg;
    if (!complete) {
        if (job->mirror)   /* its join reached the root (or is about to): take it back there */
            cluster_forward_cancel(srv, job, rank);
        return;
    }
    sp_net_send_rank_lost(srv->eng, job, rank, why);
}

/* At the root: a rank of daemon `node` joins (or takes its join back). A join
 * that completes the world announces it to every daemon and answers the local
 * ranks' waiting joins, the lock dropped for the sends. Lock held on entry. */
static void cluster_peer_join(sp_server_t *srv, const char *node, const Spd__PeerJoin *j)
{
    sp_err_t e = SP_ERR_INIT;
    if (j->resume) {
        cluster_relink_heard(srv, node, j);
        return;
    }
    sp_job_t *job = sp_job_find(srv->eng, j->job_id);
    if (j->cancel) {
        if (job != NULL)
            sp_job_join_remote_cancel(srv->eng, job, j->rank, node);
        return;
    }
    bool complete = false;
    spc_status_t st = sp_job_join_remote(srv->eng, j->job_id, j->launch, j->world_size, j->rank, j->pid, j->uid,
                                         node, &job, &complete, &e);
    if (st == SPC_ERR_PERMISSION)
        sp_warn(JOB, "node %s: rank %u (pid %d, uid %u) refused: %s", node, j->rank, (int)j->pid, j->uid, e.msg);
    else if (st != SPC_OK)
        sp_info(JOB, "node %s: rank %u refused: %s", node, j->rank, e.msg);
    /* Refused, or taken: then the job's owner and grants go with it. */
    Spd__Msg msg = SPD__MSG__INIT;
    Spd__PeerJoinRep rep = SPD__PEER_JOIN_REP__INIT;
    uint32_t allow[SP_JOB_MAX_ALLOW_UIDS];
    rep.job_id = j->job_id;
    rep.rank = j->rank;
    rep.status = st;
    rep.detail = e.msg;
    if (st == SPC_OK) {
        rep.owner_uid = job->access.owner;
        rep.n_allow_uids = access_to_wire(&job->access, allow);
        rep.allow_uids = allow;
    }
    msg.body_case = SPD__MSG__BODY_PEER_JOIN_REP;
    msg.peer_join_rep = &rep;
    sp_peers_send(&srv->peers, node, &msg);
    if (st != SPC_OK || !complete)
        return;
    uint32_t n;
    sp_job_ticket_t ticket;
    bool ticketed = sp_job_ticket(srv->eng, job, &ticket);
    sp_session_t **waiting = sp_joins_waiting(job, &n);
    uint32_t group = job->world->id, size = job->world_size;
    sp_cluster_job_ready_send(srv, job);
    pthread_mutex_unlock(&srv->eng->lock);
    if (waiting != NULL)
        sp_joins_answer(waiting, n, group, size, ticketed ? &ticket : NULL);
    pthread_mutex_lock(&srv->eng->lock);
}

static void cluster_on_msg(void *arg, const char *node, const Spd__Msg *msg)
{
    sp_server_t *srv = arg;
    sp_err_t e = SP_ERR_INIT;
    sp_job_t *job;

    if (msg->body_case == SPD__MSG__BODY_PEER_NAME_REP) {   /* it may settle joins: the lock is its own */
        sp_names_heard(srv, node, msg->peer_name_rep);
        return;
    }
    pthread_mutex_lock(&srv->eng->lock);
    switch (msg->body_case) {
    case SPD__MSG__BODY_PEER_JOIN:
        cluster_peer_join(srv, node, msg->peer_join);
        break;
    case SPD__MSG__BODY_PEER_NAME_QUERY:
        sp_names_answer(srv, node, msg->peer_name_query);
        break;
    case SPD__MSG__BODY_PEER_JOIN_REP: {
        const Spd__PeerJoinRep *rep = msg->peer_join_rep;
        job = sp_job_find(srv->eng, rep->job_id);
        if (job != NULL && rep->resume) {   /* the answer to this daemon's relink */
            uint32_t idx = sp_job_node_index(job, node, false);
            bool was = idx < 32 && (job->relinking & (1u << idx));
            sp_job_relinked(srv->eng, job, node, rep->status, rep->detail);
            if (was && rep->status == SPC_OK)
                sp_net_resend(srv->eng, job, idx);
            break;
        }
        if (job == NULL || !job->mirror || rep->rank >= job->world_size)
            break;
        if (rep->status == SPC_OK) {   /* taken: from now on this daemon knows whose the job is */
            if (!job->access.known && access_from_wire(rep->job_id, rep->owner_uid, rep->allow_uids,
                                                       rep->n_allow_uids, &job->access, &e) != SPC_OK)
                sp_error(JOB, "node %s: %s", node, e.msg);
            break;
        }
        sp_session_t *s = job->members[rep->rank].join_pending;
        if (s == NULL)
            break;
        job->members[rep->rank].forwarded = false;   /* the root holds nothing of it */
        sp_job_join_cancel(srv->eng, job, rep->rank);
        s->join_active = false;
        s->join_job = NULL;
        uv_timer_stop(&s->timer);
        sp_err_set(&e, rep->status, "root node %s: %s", node, rep->detail);
        if (rep->status == SPC_ERR_PERMISSION)
            sp_warn(JOB, "pid %d (uid %u) refused: %s", (int)s->pid, (unsigned)s->uid, e.msg);
        pthread_mutex_unlock(&srv->eng->lock);
        sp_session_reply_err(s, s->join_seq, &e);
        return;
    }
    case SPD__MSG__BODY_JOB_READY: {
        const Spd__JobReady *jr = msg->job_ready;
        job = sp_job_find(srv->eng, jr->job_id);
        if (job == NULL)
            break;   /* every rank of ours left meanwhile */
        sp_job_access_t access;
        if (access_from_wire(jr->job_id, jr->owner_uid, jr->allow_uids, jr->n_allow_uids, &access, &e) != SPC_OK ||
            sp_job_ready(srv->eng, job, jr->world_size, jr->rank_node, jr->n_rank_node, &access, jr->nonce.data,
                         jr->nonce.len, &e) != SPC_OK) {
            sp_error(JOB, "node %s: %s", node, e.msg);
            break;
        }
        uint32_t n;
        sp_job_ticket_t ticket;
        bool ticketed = sp_job_ticket(srv->eng, job, &ticket);
        sp_session_t **waiting = sp_joins_waiting(job, &n);
        uint32_t group = job->world->id, size = job->world_size;
        pthread_mutex_unlock(&srv->eng->lock);
        if (waiting != NULL)
            sp_joins_answer(waiting, n, group, size, ticketed ? &ticket : NULL);
        sp_engine_kick(srv->eng);   /* messages parked for this job can land now */
        return;
    }
    case SPD__MSG__BODY_NCCL_ID: {
        const Spd__NcclId *ni = msg->nccl_id;
        sp_nccl_id_arrived(srv->eng, node, ni->job_id, ni->group_index, ni->channel, ni->seq, ni->unique_id.data,
                           ni->unique_id.len);
        break;
    }
    default:
        sp_debug(PEER, "node %s: ignoring %s", node, sp_msg_body_name(msg));
        break;
    }
    pthread_mutex_unlock(&srv->eng->lock);
    sp_engine_kick(srv->eng);
}

/* An NCCL id this daemon made goes to another daemon of the group (nccl.c). */
void sp_cluster_send_nccl_id(void *arg, const char *node, const char *job, uint32_t group_index, uint32_t channel,
                             uint64_t seq, const uint8_t *id, size_t len)
{
    sp_server_t *srv = arg;
    Spd__Msg msg = SPD__MSG__INIT;
    Spd__NcclId ni = SPD__NCCL_ID__INIT;
    ni.job_id = (char *)job;
    ni.group_index = group_index;
    ni.channel = channel;
    ni.seq = seq;
    ni.unique_id = (ProtobufCBinaryData){ len, (uint8_t *)id };
    msg.body_case = SPD__MSG__BODY_NCCL_ID;
    msg.nccl_id = &ni;
    if (sp_peers_send(&srv->peers, node, &msg) != 0)
        sp_warn(XPORT, "job %s group %u: no link to node %s for its NCCL id; its op will fail there", job, group_index,
                node);
}

/* The UCX worker stirred while the progress thread may sleep: progress it here,
 * at once, rather than wake that thread to do it (a hop that costs more than a
 * small collective). Data copies it queues go to the progress thread. */
static void on_net_event(uv_poll_t *h, int status, int events)
{
    (void)status;
    (void)events;
    sp_server_t *srv = h->data;
    pthread_mutex_lock(&srv->eng->lock);
    sp_net_poll_locked(srv->eng);
    bool tasks = srv->eng->ready != NULL;
    pthread_mutex_unlock(&srv->eng->lock);
    if (tasks)
        sp_engine_kick(srv->eng);
}

/* Starts the data path and the links when the configuration asks for peers. */
int sp_cluster_init(sp_server_t *srv)
{
    const sp_config_t *cfg = srv->cfg;
    if (cfg->peer_listen[0] == '\0' && cfg->peers[0] == '\0' && cfg->peers_dns[0] == '\0')
        return 0;
    if (sp_peers_init(&srv->peers, srv->loop, cfg, srv->node) != 0)
        return -1;
    if (sp_net_init(srv->eng, srv->peers.incarnation) != 0) {
        sp_peers_close(&srv->peers);
        return -1;
    }
    srv->peers.ucx_address_len = sp_net_address(srv->eng, &srv->peers.ucx_address);
    srv->peers.on_trusted = cluster_on_trusted;
    srv->peers.on_up = cluster_on_up;
    srv->peers.on_down = cluster_on_down;
    srv->peers.on_msg = cluster_on_msg;
    srv->peers.on_held = cluster_on_held;
    srv->peers.hook_arg = srv;
    srv->eng->on_member_left = cluster_member_left;
    srv->eng->hook_arg = srv;
    uv_poll_init(srv->loop, &srv->net_poll, sp_net_efd(srv->eng));
    srv->net_poll.data = srv;
    srv->net_polling = true;
    uv_poll_start(&srv->net_poll, UV_READABLE, on_net_event);
    uv_timer_init(srv->loop, &srv->grace_timer);
    srv->grace_timer.data = srv;
    sp_names_init(srv);
    return 0;
}
