/*
 * resume.c — libspclient's side of a restart of spd. When the connection to
 * spd ends and spd did not say it shut down for good (SIGTERM marks the
 * segment), the client waits up to reconnect_ms for the next spd on the socket
 * and hands itself over (spd.proto, Resume):
 *   - the segment it kept a descriptor of: the arena, and every buffer in it,
 *     stays where it is, shared with the new spd as it was with the old;
 *   - its host regions, under their ids, which its ops name (its GPU regions
 *     follow the Welcome, registered again under theirs);
 *   - its job's ticket (JobJoinRep.resume_ticket) and its rank;
 *   - its groups' sequence numbers on each channel: the next, and the lowest
 *     of the ops it submits again; a mesh's groups with their members;
 *   - its open CUDA streams, after the Welcome, each at its slot from its last
 *     op settled (stream.c); ops whose done the old spd wrote complete here.
 * Then it submits again, in their order, every op still in flight, each with
 * the sequence number it had, marked as taken when the old spd had taken it
 * off the SQ (it may have run) and as aliased when its outputs overlap its
 * inputs: the new spd runs them, but fails with SPC_ERR_RESTARTED a collective
 * that may have run in part and would now read what it wrote.
 * docs/architecture.md, "Restarting spd under running jobs", tells the story.
 */
#include <errno.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "internal.h"

/* How long a failed connect waits before the next: spd is starting. */
#define RECONNECT_PAUSE_MS 20

/* Why this client cannot be handed over to another spd; NULL when it can. */
static const char *resume_refusal(const spc_handle_t *h)
{
    for (uint32_t i = 0; i < h->ngroups; i++) {
        if (!h->groups[i].world && h->groups[i].ranks == NULL)
            return "it made meshes with an spd that did not say their groups' members";
        if (h->ticket_len == 0)
            return "its job has no resume ticket (its spd kept no resume key, or the job spans more daemons "
                   "than a ticket holds)";
    }
    return NULL;
}

/* ================================================================ the ops in flight */

static bool refs_overlap(const struct sp_tensor_ref *a, const struct sp_tensor_ref *b)
{
    return a->region == b->region && a->bytes > 0 && b->bytes > 0 && a->offset < b->offset + b->bytes &&
           b->offset < a->offset + a->bytes;
}

/* Whether an op's outputs overlap its inputs. Every op kind reads the tensors
 * at even places and writes those at odd places (send and receive, or pairs of
 * them), but for a broadcast's one buffer, which a rank either reads or writes. */
static bool op_aliased(const spc_request_t *r)
{
    if (r->sqe.opcode == SP_OP_BROADCAST)
        return false;
    for (uint32_t i = 0; i < r->sqe.ntensors; i += 2)
        for (uint32_t j = 1; j < r->sqe.ntensors; j += 2)
            if (refs_overlap(&r->refs[i], &r->refs[j]))
                return true;
    return false;
}

static int by_sq_pos(const void *a, const void *b)
{
    const spc_request_t *x = *(spc_request_t *const *)a, *y = *(spc_request_t *const *)b;
    int32_t d = (int32_t)(x->sq_pos - y->sq_pos);   /* in flight: within one ring's span of each other */
    return (d > 0) - (d < 0);
}

/* The requests in flight, in the order they were submitted; *n_p of them. */
static spc_request_t **inflight_list(spc_handle_t *h, uint32_t *n_p)
{
    spc_request_t **list = calloc(h->layout.cq_entries, sizeof *list);
    uint32_t n = 0;
    for (uint32_t i = 0; list != NULL && i < h->layout.cq_entries; i++)
        if (h->reqs[i].state == REQ_INFLIGHT || h->reqs[i].state == REQ_ORPHAN)
            list[n++] = &h->reqs[i];
    if (list != NULL)
        qsort(list, n, sizeof *list, by_sq_pos);
    *n_p = n;
    return list;
}

/* ================================================================ the hand-over */

/* A connection to the socket, once something listens there: the descriptor,
 * or -1 once deadline_ns passed. */
static int connect_until(const spc_handle_t *h, uint64_t deadline_ns)
{
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    snprintf(sa.sun_path, sizeof sa.sun_path, "%s", h->socket_path);
    for (;;) {
        int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        if (fd >= 0 && connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0)
            return fd;
        if (fd >= 0)
            close(fd);
        if (spc__now_ns() >= deadline_ns)
            return -1;
        poll(NULL, 0, RECONNECT_PAUSE_MS);
    }
}

/* The sequence numbers of the client's ops on group g and channel ch: the
 * next, and the lowest it submits again (the next where it submits none). */
static void seqs_of(const spc__group_t *g, uint32_t ch, spc_request_t **list, uint32_t n, Spd__ResumeSeq *s)
{
    spd__resume_seq__init(s);
    s->channel = ch;
    s->next = s->first = g->next_seq[ch];
    for (uint32_t k = 0; k < n; k++) {
        const struct sp_sqe *e = &list[k]->sqe;
        if (e->opcode != SP_OP_NOOP && e->group == g->wire && e->channel == ch && e->replay_seq < s->first)
            s->first = e->replay_seq;
    }
}

/* What the Resume hello carries of the client's groups: for each, its
 * sequence numbers on every channel, and a mesh's group its members. */
typedef struct resume_groups {
    Spd__ResumeSeq      (*seqs)[SPC_CHANNELS];   /* [ngroups] */
    Spd__ResumeSeq     *(*seq_ptrs)[SPC_CHANNELS];
    Spd__GroupMembers   *members;                /* [ngroups]; the world's unused */
    Spd__ResumeGroup    *groups, **group_ptrs;   /* the meshes' groups */
    size_t               nmesh;
} resume_groups_t;

static void resume_groups_free(resume_groups_t *rg)
{
    free(rg->seqs);
    free(rg->seq_ptrs);
    free(rg->members);
    free(rg->groups);
    free(rg->group_ptrs);
}

static spc_status_t resume_groups_make(spc_handle_t *h, spc_request_t **list, uint32_t n, resume_groups_t *rg)
{
    size_t m = h->ngroups + 1;
    rg->seqs = calloc(m, sizeof *rg->seqs);
    rg->seq_ptrs = calloc(m, sizeof *rg->seq_ptrs);
    rg->members = calloc(m, sizeof *rg->members);
    rg->groups = calloc(m, sizeof *rg->groups);
    rg->group_ptrs = calloc(m, sizeof *rg->group_ptrs);
    if (!rg->seqs || !rg->seq_ptrs || !rg->members || !rg->groups || !rg->group_ptrs)
        return spc__fail(h, SPC_ERR_NO_MEMORY, "out of memory");
    for (uint32_t i = 0; i < h->ngroups; i++) {
        spc__group_t *g = &h->groups[i];
        for (uint32_t ch = 0; ch < SPC_CHANNELS; ch++) {
            seqs_of(g, ch, list, n, &rg->seqs[i][ch]);
            rg->seq_ptrs[i][ch] = &rg->seqs[i][ch];
        }
        if (g->world)
            continue;
        Spd__GroupMembers *gm = &rg->members[i];
        spd__group_members__init(gm);
        gm->index = g->index;
        gm->kind = g->kind;
        gm->ranks = g->ranks;
        gm->n_ranks = g->size;
        Spd__ResumeGroup *r = &rg->groups[rg->nmesh];
        spd__resume_group__init(r);
        r->group = gm;
        r->seqs = rg->seq_ptrs[i];
        r->n_seqs = SPC_CHANNELS;
        rg->group_ptrs[rg->nmesh++] = r;
    }
    return SPC_OK;
}

/* Sends the Resume hello over h->sock and reads the Welcome: SPC_OK with the
 * ids of the client's groups in the new spd (wire[i]: h->groups[i]'s), or the
 * refusal. */
static spc_status_t resume_hello(spc_handle_t *h, spc_request_t **list, uint32_t n, spc_group_t *wire)
{
    extern char *program_invocation_short_name;
    Spd__Msg req = SPD__MSG__INIT, *rep = NULL;
    Spd__Hello hello = SPD__HELLO__INIT;
    Spd__Resume rs = SPD__RESUME__INIT;
    resume_groups_t rg = { 0 };
    spc_status_t st;

    Spd__ResumeRegion *regions = calloc(h->nregions + 1, sizeof *regions);
    Spd__ResumeRegion **region_ptrs = calloc(h->nregions + 1, sizeof *region_ptrs);
    if (regions == NULL || region_ptrs == NULL) {
        st = spc__fail(h, SPC_ERR_NO_MEMORY, "out of memory");
        goto out;
    }
    if ((st = resume_groups_make(h, list, n, &rg)) != SPC_OK)
        goto out;
    size_t nhost = 0;
    for (uint32_t i = 0; i < h->nregions; i++) {
        if (h->regions[i].device)
            continue;   /* registered again as they were first (resume_devices) */
        spd__resume_region__init(&regions[nhost]);
        regions[nhost].id = h->regions[i].id;
        regions[nhost].addr = h->regions[i].addr;
        regions[nhost].length = h->regions[i].length;
        region_ptrs[nhost] = &regions[nhost];
        nhost++;
    }
    rs.seg_fd = (uint32_t)h->seg_fd;
    rs.n_regions = nhost;
    rs.regions = region_ptrs;
    int world = -1;
    for (uint32_t i = 0; i < h->ngroups; i++)
        if (h->groups[i].world)
            world = (int)i;
    if (h->ticket_len > 0 && world >= 0) {
        rs.ticket.data = h->ticket;
        rs.ticket.len = h->ticket_len;
        rs.rank = h->rank;
        rs.n_seqs = SPC_CHANNELS;
        rs.seqs = rg.seq_ptrs[world];
        rs.n_groups = rg.nmesh;
        rs.groups = rg.group_ptrs;
    }
    /* The same protocol as before: it chose the segment's layout. */
    hello.protocol = hello.protocol_max = h->protocol;
    hello.role = SPD__HELLO__ROLE__CLIENT;
    hello.name = program_invocation_short_name;
    hello.sq_entries = h->layout.sq_entries;
    hello.arena_bytes = h->layout.arena_bytes;
    hello.resume = &rs;
    req.body_case = SPD__MSG__BODY_HELLO;
    req.hello = &hello;

    /* The new spd takes the segment's descriptor out of this process with
     * pidfd_getfd, which Yama's ptrace scope 1 lets it do only with consent. */
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(h->sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) == 0)
        prctl(PR_SET_PTRACER, (unsigned long)cred.pid, 0, 0, 0);

    int fds[2] = { -1, -1 }, nfds = 2;
    st = spc__call_fds(h, &req, 0, &rep, fds, &nfds);
    if (st != SPC_OK)
        goto out;
    if (rep->body_case != SPD__MSG__BODY_WELCOME || !rep->welcome->resumed || rep->welcome->protocol != h->protocol ||
        nfds != 2 || rep->welcome->n_group_ids != rs.n_groups) {
        st = spc__fail(h, SPC_ERR_PROTOCOL, "spd %s answered the resume without taking this client over (an spd "
                       "from before restarts were survived?)", rep->body_case == SPD__MSG__BODY_WELCOME ?
                       rep->welcome->version : "?");
        goto out_fds;
    }
    const Spd__Welcome *w = rep->welcome;
    h->client_id = w->client_id;
    h->daemon_pid = w->daemon_pid;
    snprintf(h->daemon_version, sizeof h->daemon_version, "%s", w->version);
    for (uint32_t i = 0, k = 0; i < h->ngroups; i++)
        wire[i] = h->groups[i].world ? w->world_group : w->group_ids[k++];
    close(fds[0]);   /* spd's copy of the segment we hold */
    close(h->wake_fd);
    h->wake_fd = fds[1];
    st = SPC_OK;
    goto out;

out_fds:
    for (int i = 0; i < nfds; i++)
        close(fds[i]);
out:
    sp_msg_free(rep);
    resume_groups_free(&rg);
    free(regions);
    free(region_ptrs);
    return st;
}

/* GPU memory goes to the new spd as it went to the old, exported again
 * (CUDA IPC handles, cuMem chunks' descriptors), each registration under the
 * id it had, which the ops and the registration cache name. */
static spc_status_t resume_devices(spc_handle_t *h)
{
    for (uint32_t i = 0; i < h->nregions; i++) {
        const spc__region_t *r = &h->regions[i];
        spc_region_t id;
        if (!r->device)
            continue;
        spc_status_t st = spc__register_device_as(h, (const void *)r->addr, r->length, r->id, &id);
        if (st != SPC_OK)
            return spc__fail(h, st, "GPU region %u at 0x%llx: %s", r->id, (unsigned long long)r->addr,
                             spc_last_error(h));
    }
    return SPC_OK;
}

/* Writes r's op on the SQ again, as a replay (sp_shm.h, SP_REPLAY_*), waiting
 * for room until deadline_ns (the new spd takes entries as it goes). */
static spc_status_t replay(spc_handle_t *h, spc_request_t *r, uint8_t flags, spc_group_t wire, uint64_t deadline_ns)
{
    while (sp_ring_used(h->v.sq, h->sq_tail) >= h->layout.sq_entries) {
        if (spc__now_ns() >= deadline_ns)
            return spc__fail(h, SPC_ERR_TIMEOUT, "the new spd took no ops off the submission ring");
        sched_yield();
    }
    uint32_t idx = h->sq_tail & h->sq_mask;
    r->sqe.replay = flags;
    r->sqe.group = wire;
    h->v.sqes[idx] = r->sqe;
    if (r->sqe.ntensors > 0)
        memcpy(sp_seg_slot_tensor(&h->v, idx), r->refs, r->sqe.ntensors * sizeof r->refs[0]);
    if (r->sqe.param_bytes > 0)
        memcpy(sp_seg_slot_params(&h->v, idx), r->params, r->sqe.param_bytes);
    r->sq_pos = h->sq_tail++;
    /* Release: the entry and its arguments before the tail; then, as submit does, the wake-up. */
    sp_store_release(&h->v.sq->tail, h->sq_tail);
    sp_smp_mb();
    if (sp_load_relaxed(&h->v.wake->sq_need_wakeup))
        spc__wake_daemon(h);
    return SPC_OK;
}

/* Hands the client over to the spd on the socket, within deadline_ns. */
static spc_status_t resume(spc_handle_t *h, uint64_t deadline_ns)
{
    uint32_t n;
    spc__streams_settle(h);   /* stream ops that ran are not submitted again */
    spc_request_t **list = inflight_list(h, &n);
    spc_group_t *wire = calloc(h->ngroups + 1, sizeof *wire);
    if (list == NULL || wire == NULL) {
        free(list);
        free(wire);
        return spc__fail(h, SPC_ERR_NO_MEMORY, "out of memory");
    }

    /* Nobody takes from the SQ now. What the old spd had not taken goes again
     * with the rest; the new spd goes on from the counters left here. */
    uint32_t taken_upto = sp_load_acquire(&h->v.sq->head);
    sp_store_release(&h->v.sq->head, h->sq_tail);
    sp_store_release(&h->v.cq->tail, h->cq_head);

    spc_status_t st = SPC_ERR_CONNECT;
    while (st == SPC_ERR_CONNECT || st == SPC_ERR_DAEMON_LOST) {
        close(h->sock);
        h->sock = connect_until(h, deadline_ns);
        if (h->sock < 0) {
            st = spc__fail(h, SPC_ERR_TIMEOUT, "no spd took it over within %d ms (SPC_RECONNECT_MS)",
                           h->reconnect_ms);
            break;
        }
        h->lost = false;
        st = resume_hello(h, list, n, wire);
        /* A connection that ended before its answer: an spd that went again, or
         * the one that went still closing. Until the deadline, the next one. */
        if (st == SPC_ERR_DAEMON_LOST && spc__now_ns() >= deadline_ns)
            break;
        if (st == SPC_ERR_DAEMON_LOST)
            poll(NULL, 0, RECONNECT_PAUSE_MS);
    }
    if (st == SPC_OK)
        st = resume_devices(h);
    if (st == SPC_OK)
        st = spc__streams_resume(h);
    for (uint32_t k = 0; k < n && st == SPC_OK; k++) {
        spc_request_t *r = list[k];
        /* Its group, by the id the old spd gave it; the new spd's in wire[]. */
        const spc__group_t *g = NULL;
        for (uint32_t i = 0; i < h->ngroups && r->sqe.opcode != SP_OP_NOOP; i++)
            if (h->groups[i].wire == r->sqe.group)
                g = &h->groups[i];
        bool taken = (int32_t)(r->sq_pos - taken_upto) < 0;
        uint8_t flags = (g != NULL ? SP_REPLAY_SEQ : 0) | (taken ? SP_REPLAY_TAKEN : 0) |
                        (taken && op_aliased(r) ? SP_REPLAY_ALIASED : 0);
        st = replay(h, r, flags, g != NULL ? wire[g - h->groups] : r->sqe.group, deadline_ns);
        h->replayed++;
        h->retried += taken;
    }
    /* From now on the caller's ids name the new spd's groups. */
    for (uint32_t i = 0; i < h->ngroups && st == SPC_OK; i++)
        h->groups[i].wire = wire[i];
    free(wire);
    free(list);
    return st;
}

bool spc__conn_lost(spc_handle_t *h, const char *why)
{
    char detail[SP_DETAIL_BYTES];
    uint64_t t0 = spc__now_ns();

    /* Completions posted before spd went are good: take them first. */
    spc__reap(h);
    const char *refusal = resume_refusal(h);
    bool for_good = h->seg != NULL && sp_load_acquire(&h->v.wake->daemon_state) == SP_DAEMON_GONE;
    if (h->seg == NULL || for_good) {
        snprintf(detail, sizeof detail, "%s", why);
    } else if (h->reconnect_ms <= 0) {
        snprintf(detail, sizeof detail, "%s; reconnecting is off (SPC_RECONNECT_MS=0)", why);
    } else if (refusal != NULL) {
        snprintf(detail, sizeof detail, "%s; no other spd can take this client over: %s", why, refusal);
    } else {
        h->resuming = true;
        spc_status_t st = resume(h, t0 + (uint64_t)h->reconnect_ms * 1000000ull);
        h->resuming = false;
        if (st == SPC_OK) {
            h->resumes++;
            h->last_gap_ms = (spc__now_ns() - t0) / 1000000ull;
            spc__log(2, "spd went (%s); spd %s (pid %d) took this client over in %llu ms, %u ops again", why,
                     h->daemon_version, h->daemon_pid, (unsigned long long)h->last_gap_ms, h->inflight);
            return true;
        }
        snprintf(detail, sizeof detail, "%s; %s%s", why, st == SPC_ERR_TIMEOUT ? "" : "the next spd did not take "
                 "this client over: ", h->last_error);
    }
    h->lost = true;
    spc__fail(h, SPC_ERR_DAEMON_LOST, "%s", detail);
    if (h->reqs != NULL)
        spc__fail_all_inflight(h, SPC_ERR_DAEMON_LOST, detail);
    return false;
}

_Static_assert(sizeof(spc_resume_info_t) % _Alignof(spc_resume_info_t) == 0, "struct_size rule");

spc_status_t spc_resume_info(const spc_handle_t *h, spc_resume_info_t *info)
{
    if (h == NULL)
        return SPC_ERR_INVALID_ARG;
    spc_resume_info_t out = { .struct_size = sizeof out, .resumes = h->resumes, .replayed = h->replayed,
                              .retried = h->retried, .last_gap_ms = h->last_gap_ms };
    return spc__struct_put((spc_handle_t *)h, "spc_resume_info_t", info, spc__field_end(spc_resume_info_t,
                           last_gap_ms), sizeof out, _Alignof(spc_resume_info_t), &out);
}
