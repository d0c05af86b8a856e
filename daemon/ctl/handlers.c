/*
 * handlers.c — what spd does with each message a session sends: the Hello that
 * makes a session a client's or spctl's, then one handler per request, found in
 * the table at the end by the message's body.
 *
 * A handler answers exactly once, with its reply or an Error naming the status
 * and why (an Ok for requests that have nothing to say); most do their work
 * under the engine lock through answer_locked. A request that needs a client is
 * refused on a control session; a message no handler takes is a protocol
 * error. Nothing acts on a malformed request: its checks come first.
 */
#include "ctl/handlers.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "base/log.h"
#include "gpu/stream.h"
#include "ctl/cluster_jobs.h"
#include "ctl/cluster_names.h"
#include "ctl/query.h"
#include "sp_msg.h"
#include "version.h"
#include "core/client.h"
#include "core/engine.h"
#include "core/job.h"
#include "core/mem.h"
#include "core/mesh.h"

#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438   /* Linux 5.6; the same number on the architectures spd builds for */
#endif

/* ---------------------------------------------------------------- hello */

/* Sends the Welcome and, for a client, its segment and wake eventfd in the same
 * sendmsg(). libuv cannot pass raw descriptors, so this one write bypasses it; it
 * is the session's first write, so nothing of libuv's is queued ahead of it and
 * the socket buffer is empty. */
/* What a Welcome says of a client taken over (hello_resume); NULL: a new client. */
typedef struct resumed {
    uint32_t  world_group;
    uint32_t *group_ids;
    size_t    ngroups;
} resumed_t;

static int send_welcome(sp_session_t *s, uint32_t seq, const resumed_t *resumed)
{
    sp_server_t *srv = s->srv;
    Spd__Msg m = SPD__MSG__INIT;
    Spd__Welcome w = SPD__WELCOME__INIT;
    w.protocol = s->protocol;
    w.version = (char *)SPD_VERSION;
    w.daemon_pid = (int32_t)getpid();
    w.node = srv->node;
    if (s->client != NULL) {
        w.client_id = s->client->id;
        w.segment_bytes = s->client->layout.segment_bytes;
    }
    if (resumed != NULL) {
        w.resumed = true;
        w.world_group = resumed->world_group;
        w.group_ids = resumed->group_ids;
        w.n_group_ids = resumed->ngroups;
    }
    m.seq = seq;
    m.body_case = SPD__MSG__BODY_WELCOME;
    m.welcome = &w;

    uint8_t *buf;
    size_t len;
    if (sp_msg_encode(&m, &buf, &len) != 0)
        return -ENOMEM;

    int fd;
    uv_fileno((uv_handle_t *)&s->pipe, &fd);
    struct iovec iov = { buf, len };
    union {
        struct cmsghdr hdr;
        char space[CMSG_SPACE(2 * sizeof(int))];
    } ctl;
    struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };
    if (s->client != NULL) {
        memset(&ctl, 0, sizeof ctl);
        mh.msg_control = ctl.space;
        mh.msg_controllen = sizeof ctl.space;
        struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(2 * sizeof(int));
        int fds[2] = { s->client->seg_fd, s->client->wake_fd };
        memcpy(CMSG_DATA(c), fds, sizeof fds);
    }
    ssize_t n = sendmsg(fd, &mh, MSG_NOSIGNAL);
    int err = errno;
    free(buf);
    if (n != (ssize_t)len)
        return n < 0 ? -err : -EAGAIN;
    return 0;
}

/* Refuses a hello: the error, counted and logged, then the end of the session. */
static void hello_refuse(sp_session_t *s, uint32_t seq, const sp_err_t *e, unsigned reason, const char *why)
{
    sp_info(CTL, "refusing pid %d: %s", (int)s->pid, e->msg);
    s->srv->refused[reason]++;
    sp_session_reply_err(s, seq, e);
    sp_session_close_after_flush(s, why);
}

/*
 * Everything a resuming client brings (spd.proto, Resume), under the lock,
 * onto the client just adopted: its host regions under their ids, then its
 * place in its job. Each step checks as a fresh request would be checked.
 */
/* A ResumeSeq list as the core takes it; SPC_ERR_INVALID_ARG past SP_CHANNELS. */
static spc_status_t seqs_from(Spd__ResumeSeq *const *in, size_t n, sp_resume_seq_t *out, sp_err_t *e)
{
    if (n > SP_CHANNELS)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "resume: %zu channels of sequence numbers; there are %u", n,
                          SP_CHANNELS);
    for (size_t i = 0; i < n; i++)
        out[i] = (sp_resume_seq_t){ .channel = in[i]->channel, .next = in[i]->next, .first = in[i]->first };
    return SPC_OK;
}

static spc_status_t resume_take(sp_engine_t *eng, sp_client_t *c, const Spd__Resume *r, resumed_t *out,
                                sp_err_t *e)
{
    sp_resume_seq_t seqs[SP_CHANNELS];

    for (size_t i = 0; i < r->n_regions; i++) {
        uint32_t id;
        const Spd__ResumeRegion *rg = r->regions[i];
        if (rg->id == SP_REGION_ARENA)
            return sp_err_set(e, SPC_ERR_INVALID_ARG, "region id %u is the arena's", rg->id);
        SP_CHECK(sp_region_add(eng, c, rg->addr, rg->length, rg->id, &id, e));
    }
    if (r->ticket.len == 0)
        return SPC_OK;
    SP_CHECK(seqs_from(r->seqs, r->n_seqs, seqs, e));
    /* Bounded by what it is checked against (sp_job_resume): a rank's groups of meshes. */
    if (r->n_groups > (size_t)SP_MAX_MESHES * SP_MESH_KINDS)
        return sp_err_set(e, SPC_ERR_LIMIT, "resume: %zu groups of meshes; a rank has at most %u", r->n_groups,
                          SP_MAX_MESHES * SP_MESH_KINDS);
    sp_resume_group_t *groups = calloc(r->n_groups + 1, sizeof *groups);
    out->group_ids = calloc(r->n_groups + 1, sizeof *out->group_ids);
    if (groups == NULL || out->group_ids == NULL) {
        free(groups);
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    }
    spc_status_t st = SPC_OK;
    for (size_t i = 0; i < r->n_groups && st == SPC_OK; i++) {
        const Spd__ResumeGroup *rg = r->groups[i];
        if (rg->group == NULL) {
            st = sp_err_set(e, SPC_ERR_INVALID_ARG, "resume: group %zu names nothing", i);
            break;
        }
        groups[i] = (sp_resume_group_t){ .index = rg->group->index, .kind = rg->group->kind,
                                         .ranks = rg->group->ranks, .size = (uint32_t)rg->group->n_ranks,
                                         .nseqs = rg->n_seqs };
        if (rg->group->n_ranks > UINT32_MAX)
            st = sp_err_set(e, SPC_ERR_INVALID_ARG, "resume: a group of %zu ranks", rg->group->n_ranks);
        else
            st = seqs_from(rg->seqs, rg->n_seqs, groups[i].seqs, e);
    }
    sp_job_t *job;
    if (st == SPC_OK)
        st = sp_job_resume(eng, c, r->ticket.data, r->ticket.len, r->rank, seqs, r->n_seqs, groups, r->n_groups,
                           out->group_ids, &job, e);
    free(groups);
    if (st != SPC_OK)
        return st;
    out->world_group = job->world->id;
    out->ngroups = r->n_groups;
    return SPC_OK;
}

/*
 * A client whose spd went comes back to this one (spd.proto, Resume): it is
 * adopted with the segment it kept, or refused, saying why, with nothing of it
 * left here. Its uid and pid are the socket's, as for any hello.
 */
static void hello_resume(sp_session_t *s, const Spd__Hello *h, uint32_t protocol, uint32_t seq)
{
    sp_server_t *srv = s->srv;
    sp_engine_t *eng = srv->eng;
    sp_err_t e = SP_ERR_INIT;
    sp_client_t *c = NULL;
    resumed_t resumed = { 0 };

    int pidfd = (int)syscall(SYS_pidfd_open, s->pid, 0);
    if (pidfd < 0) {
        sp_err_set(&e, SPC_ERR_PERMISSION, "cannot watch pid %d: %s", (int)s->pid, strerror(errno));
        hello_refuse(s, seq, &e, SP_REFUSED_REQUEST, "no pidfd");
        return;
    }
    pthread_mutex_lock(&eng->lock);
    /* Whose the job is first: a stranger is refused before spd takes anything of its. */
    sp_job_ticket_t t;
    const Spd__Resume *r = h->resume;
    spc_status_t st = r->ticket.len == 0 ? SPC_OK : sp_job_ticket_check(eng, r->ticket.data, r->ticket.len, s->uid,
                                                                       r->rank, &t, &e);
    if (st == SPC_OK)
        st = sp_client_adopt(eng, s->pid, pidfd, s->uid, s->gid, h->name, protocol, (int)r->seg_fd, &c, &e);
    if (st == SPC_OK && (st = resume_take(eng, c, r, &resumed, &e)) != SPC_OK) {
        sp_client_destroy(eng, c, "its resume was refused");
        c = NULL;
    }
    if (st == SPC_OK)
        eng->clients_resumed++;
    /* A job over daemons goes on once the others take it back from this one. */
    if (st == SPC_OK && c->job != NULL && c->job->nnodes > 1)
        sp_cluster_relink(srv, c->job);
    pthread_mutex_unlock(&eng->lock);
    if (st != SPC_OK) {
        free(resumed.group_ids);
        close(pidfd);
        sp_err_prefix(&e, "resume refused: ");
        if (st == SPC_ERR_PERMISSION)
            sp_warn(JOB, "pid %d (uid %u): %s", (int)s->pid, (unsigned)s->uid, e.msg);
        hello_refuse(s, seq, &e, SP_REFUSED_RESUME, "resume refused");
        return;
    }
    s->client = c;
    s->state = SP_SESSION_CLIENT;
    sp_session_watch_pid(s, pidfd);
    int rc = send_welcome(s, seq, &resumed);
    free(resumed.group_ids);
    if (rc != 0) {
        sp_warn(CTL, "pid %d: welcome not sent: %s", (int)s->pid, strerror(-rc));
        sp_session_close(s, "welcome could not be sent");
        return;
    }
    sp_info(CTL, "client %" PRIu64 " resumed: pid %d, uid %u, '%s', protocol %u, %u regions%s%s", c->id, (int)s->pid,
            (unsigned)s->uid, c->name, protocol, c->nregions, c->job ? ", job " : "", c->job ? c->job->id : "");
}

static void handle_hello(sp_session_t *s, const Spd__Msg *req)
{
    sp_server_t *srv = s->srv;
    const Spd__Hello *h = req->hello;
    uint32_t seq = req->seq;
    sp_err_t e = SP_ERR_INIT;

    uv_timer_stop(&s->timer);
    if (s->refusal.status != SPC_OK) {
        sp_session_reply_err(s, seq, &s->refusal);
        sp_session_close_after_flush(s, "refused");
        return;
    }
    uint32_t hi = h->protocol_max > h->protocol ? h->protocol_max : h->protocol;
    uint32_t protocol = sp_protocol_pick(h->protocol, hi, SP_PROTOCOL_MIN, srv->protocol_max);
    if (protocol == 0) {
        char offered[32];
        if (hi == h->protocol)
            snprintf(offered, sizeof offered, "protocol %u", hi);
        else
            snprintf(offered, sizeof offered, "protocols %u to %u", h->protocol, hi);
        sp_err_set(&e, SPC_ERR_PROTOCOL, "client speaks %s, spd %s speaks %u to %u", offered, SPD_VERSION,
                   SP_PROTOCOL_MIN, srv->protocol_max);
        sp_info(CTL, "refusing pid %d: %s", (int)s->pid, e.msg);
        srv->refused[SP_REFUSED_PROTOCOL]++;
        sp_session_reply_err(s, seq, &e);
        sp_session_close_after_flush(s, "protocol version");
        return;
    }
    srv->by_protocol[s->protocol]--;
    srv->by_protocol[protocol]++;
    s->protocol = protocol;
    if (h->role == SPD__HELLO__ROLE__CONTROL) {
        if (send_welcome(s, seq, NULL) != 0) {
            sp_session_close(s, "welcome could not be sent");
            return;
        }
        s->state = SP_SESSION_CONTROL;
        sp_session_idle_arm(s);
        sp_debug(CTL, "control session of pid %d (uid %u)", (int)s->pid, (unsigned)s->uid);
        return;
    }
    if (srv->draining) {
        srv->refused[SP_REFUSED_DRAINING]++;
        sp_session_reply_error(s, seq, SPC_ERR_SHUTTING_DOWN, "spd is shutting down");
        sp_session_close_after_flush(s, "draining");
        return;
    }
    if (h->sq_entries > SP_SQ_MAX_ENTRIES) {
        sp_err_set(&e, SPC_ERR_INVALID_ARG, "sq_entries %u exceeds %u", h->sq_entries, SP_SQ_MAX_ENTRIES);
        sp_info(CTL, "refusing pid %d: %s", (int)s->pid, e.msg);
        srv->refused[SP_REFUSED_REQUEST]++;
        sp_session_reply_err(s, seq, &e);
        sp_session_close_after_flush(s, "hello refused");
        return;
    }

    if (h->resume != NULL) {
        hello_resume(s, h, protocol, seq);
        return;
    }
    int pidfd = (int)syscall(SYS_pidfd_open, s->pid, 0);
    if (pidfd < 0) {
        sp_err_set(&e, SPC_ERR_PERMISSION, "cannot watch pid %d: %s", (int)s->pid, strerror(errno));
        srv->refused[SP_REFUSED_REQUEST]++;
        sp_session_reply_err(s, seq, &e);
        sp_session_close_after_flush(s, "no pidfd");
        return;
    }

    pthread_mutex_lock(&srv->eng->lock);
    sp_client_t *c = NULL;
    spc_status_t st = sp_client_create(srv->eng, s->pid, pidfd, s->uid, s->gid, h->name, protocol, h->sq_entries,
                                       h->arena_bytes, &c, &e);
    pthread_mutex_unlock(&srv->eng->lock);
    if (st != SPC_OK) {
        close(pidfd);
        sp_info(CTL, "refusing pid %d: %s", (int)s->pid, e.msg);
        srv->refused[SP_REFUSED_REQUEST]++;
        sp_session_reply_err(s, seq, &e);
        sp_session_close_after_flush(s, "hello refused");
        return;
    }
    s->client = c;
    s->state = SP_SESSION_CLIENT;
    sp_session_watch_pid(s, pidfd);

    int rc = send_welcome(s, seq, NULL);
    if (rc != 0) {
        sp_warn(CTL, "pid %d: welcome not sent: %s", (int)s->pid, strerror(-rc));
        sp_session_close(s, "welcome could not be sent");
        return;
    }
    sp_info(CTL, "client %" PRIu64 " attached: pid %d, uid %u, '%s', protocol %u", c->id, (int)s->pid,
            (unsigned)s->uid, c->name, protocol);
}

/* ---------------------------------------------------------------- the answer of a request */

/* What a request answers with on success: the message, its body (none: an Ok),
 * and room for a string the body names, copied out before the lock is dropped. */
typedef struct answer {
    Spd__Msg msg;
    union {
        Spd__RegisterRep     region;
        Spd__StreamCreateRep stream;
        Spd__JobCreateRep    job;
        Spd__MeshCreateRep   mesh;
    } body;
    char text[256];   /* a job's id, a mesh's explanation */
    Spd__GroupMembers  members[SP_MESH_KINDS], *member_ptrs[SP_MESH_KINDS];   /* a mesh's groups of the caller */
    uint32_t          *owned;   /* what the body points at beyond this: freed once the answer is sent */
} answer_t;

/* A request's work on the engine, done under its lock: SPC_OK with its answer
 * in *a (left empty for an Ok), or the error in e. */
typedef spc_status_t locked_work_fn(sp_session_t *s, const Spd__Msg *req, answer_t *a, sp_err_t *e);

/* Answers request seq: an Error with e when st failed, else *a. */
static void answer_send(sp_session_t *s, uint32_t seq, spc_status_t st, const sp_err_t *e, answer_t *a)
{
    if (st != SPC_OK) {
        sp_session_reply_err(s, seq, e);
    } else if (a->msg.body_case == SPD__MSG__BODY__NOT_SET) {
        sp_session_reply_ok(s, seq);
    } else {
        a->msg.seq = seq;
        sp_session_send(s, &a->msg);
    }
}

/*
 * What most requests are: their work under the engine lock, then the answer
 * with the lock dropped (a send that fails closes the session, which takes
 * the lock).
 */
static void answer_locked(sp_session_t *s, const Spd__Msg *req, locked_work_fn *work)
{
    sp_engine_t *eng = s->srv->eng;
    answer_t a = { .msg = SPD__MSG__INIT };
    sp_err_t e = SP_ERR_INIT;

    pthread_mutex_lock(&eng->lock);
    spc_status_t st = work(s, req, &a, &e);
    pthread_mutex_unlock(&eng->lock);
    answer_send(s, req->seq, st, &e, &a);
    free(a.owned);
}

static void answer_region(answer_t *a, uint32_t id)
{
    a->body.region = (Spd__RegisterRep)SPD__REGISTER_REP__INIT;
    a->body.region.region = id;
    a->msg.body_case = SPD__MSG__BODY_REGISTER_REP;
    a->msg.register_rep = &a->body.region;
}

/* ---------------------------------------------------------------- requests */

static spc_status_t region_add(sp_session_t *s, const Spd__Msg *req, answer_t *a, sp_err_t *e)
{
    const Spd__RegisterReq *r = req->register_req;
    uint32_t id = 0;

    spc_status_t st = sp_region_add(s->srv->eng, s->client, r->addr, r->length, SP_REGION_ARENA, &id, e);
    if (st == SPC_OK)
        answer_region(a, id);
    return st;
}

static void handle_register(sp_session_t *s, const Spd__Msg *req)
{
    answer_locked(s, req, region_add);
}

/* Closes the daemon's copies of the first n chunks' descriptors. */
static void chunk_fds_close(sp_gpu_chunk_t *ch, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        close(ch[i].fd);
        ch[i].fd = -1;
    }
}

/*
 * Takes a copy of each cuMem chunk's descriptor out of the client with
 * pidfd_getfd(2) on the pidfd spd keeps of it (the ptrace-level access that
 * process_vm_readv already needs), replacing the client's numbers with spd's
 * own (close-on-exec, as pidfd_getfd makes them). On failure closes what it took
 * and says which descriptor and why.
 *
 * pidfd_getfd takes from the process as it is at the call, and descriptors
 * outlive an exec. So before the first and after the last, spd asks whether
 * the program that attached still runs and may be reached (mem.c): if it
 * does after the last, no exec came before, and the descriptors are that
 * program's; if not, they may be another identity's and are closed unused.
 */
static spc_status_t chunk_fds_take(sp_session_t *s, sp_gpu_chunk_t *ch, uint32_t n, sp_err_t *e)
{
    spc_status_t st = sp_mem_reachable(s->client, e);
    if (st != SPC_OK)   /* not even which numbers another program has open */
        goto refused;
    for (uint32_t i = 0; i < n; i++) {
        int fd = (int)syscall(SYS_pidfd_getfd, s->pidfd, ch[i].fd, 0);
        if (fd >= 0) {
            ch[i].fd = fd;
            continue;
        }
        int en = errno;
        if (en == EBADF)
            st = sp_err_set(e, SPC_ERR_INVALID_ARG, "chunk %u: pid %d has no descriptor %d", i, (int)s->pid, ch[i].fd);
        else if (en == ENOSYS)
            st = sp_err_set(e, SPC_ERR_UNSUPPORTED, "this kernel lacks pidfd_getfd (Linux 5.6 or later), which spd "
                            "needs to receive cuMem memory");
        else if (en == EMFILE || en == ENFILE)
            st = sp_err_set(e, SPC_ERR_LIMIT, "spd is out of descriptors (%s) taking chunk %u of %u", strerror(en), i,
                            n);
        else
            st = sp_err_set(e, SPC_ERR_PERMISSION, "spd may not take descriptor %d of pid %d (pidfd_getfd: %s): it "
                            "needs ptrace access to the client (the same user, or CAP_SYS_PTRACE; where Yama restricts "
                            "ptrace the client's consent, which libspclient gives with PR_SET_PTRACER)", ch[i].fd,
                            (int)s->pid, strerror(en));
        sp_warn(MEM, "pid %d: %s", (int)s->pid, e->msg);
        chunk_fds_close(ch, i);
        return st;
    }
    st = sp_mem_reachable(s->client, e);
    if (st == SPC_OK)
        return SPC_OK;
    chunk_fds_close(ch, n);
refused:
    sp_warn(MEM, "client %" PRIu64 ": %s", s->client->id, e->msg);
    return st;
}

/* The chunk list of a cuMem registration as the daemon's type, the descriptor
 * numbers still the client's; NULL with the error in e when it is refused. */
static sp_gpu_chunk_t *chunks_from(const Spd__RegisterDeviceReq *r, sp_err_t *e)
{
    /* Refused before anything is allocated for it; gpu/region.c checks the rest. */
    if (r->n_chunks > SP_DEVICE_MAX_CHUNKS) {
        sp_err_set(e, SPC_ERR_LIMIT, "%zu chunks in one cuMem registration: at most %u (register a shorter range)",
                   r->n_chunks, SP_DEVICE_MAX_CHUNKS);
        return NULL;
    }
    sp_gpu_chunk_t *ch = calloc(r->n_chunks, sizeof *ch);
    if (ch == NULL) {
        sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
        return NULL;
    }
    for (size_t i = 0; i < r->n_chunks; i++)
        ch[i] = (sp_gpu_chunk_t){ .offset = r->chunks[i]->offset, .size = r->chunks[i]->size,
                                  .buffer_id = r->chunks[i]->buffer_id, .block_id = r->chunks[i]->block_id,
                                  .fd = r->chunks[i]->fd };
    return ch;
}

spc_status_t sp_server_check_register_device(const Spd__RegisterDeviceReq *r, sp_gpu_export_t *x,
                                             sp_gpu_chunk_t **chunks_p, sp_err_t *e)
{
    const bool vmm = r->n_chunks > 0;

    /* The driver must not see a malformed handle or device name. */
    if (r->ipc_handle.len != (vmm ? 0 : SP_GPU_IPC_HANDLE_BYTES) || r->uuid.len != SP_GPU_UUID_BYTES ||
        r->pci_bus_id == NULL || r->pci_bus_id[0] == '\0' || strlen(r->pci_bus_id) >= 32) {
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "RegisterDeviceReq: an IPC handle of %zu bytes (want %s), a UUID of "
                          "%zu bytes (want %d) and a PCI bus id of %zu characters (want 1 to 31)", r->ipc_handle.len,
                          vmm ? "none beside cuMem chunks" : "64", r->uuid.len, SP_GPU_UUID_BYTES, r->pci_bus_id ?
                          strlen(r->pci_bus_id) : 0);
    }
    sp_gpu_chunk_t *chunks = NULL;
    if (vmm && (chunks = chunks_from(r, e)) == NULL)
        return e->status;
    *x = (sp_gpu_export_t){ .ipc_handle = vmm ? NULL : r->ipc_handle.data, .chunks = chunks,
                            .nchunks = (uint32_t)r->n_chunks, .base = r->alloc_base, .size = r->alloc_size,
                            .buffer_id = r->buffer_id, .pci_bus_id = r->pci_bus_id, .uuid = r->uuid.data,
                            .device = r->device };
    spc_status_t st = sp_region_check_device(x, r->offset, r->length, e);
    if (st != SPC_OK) {
        free(chunks);
        return st;
    }
    *chunks_p = chunks;
    return SPC_OK;
}

/*
 * Device registration, in this order, so that nothing acts on a malformed
 * request: the handle, UUID and bus id lengths; the range and chunk list
 * (gpu/region.c); for cuMem memory the chunks' descriptors, taken from the client;
 * then the import, under the lock. The daemon's descriptors are closed once
 * the import has them (or the request failed).
 */
static void handle_register_device(sp_session_t *s, const Spd__Msg *req)
{
    sp_server_t *srv = s->srv;
    const Spd__RegisterDeviceReq *r = req->register_device_req;
    uint32_t seq = req->seq;
    answer_t a = { .msg = SPD__MSG__INIT };
    sp_err_t e = SP_ERR_INIT;
    uint32_t id = 0;
    sp_gpu_export_t x;
    sp_gpu_chunk_t *chunks = NULL;

    spc_status_t st = sp_server_check_register_device(r, &x, &chunks, &e);
    if (st != SPC_OK) {
        sp_session_reply_err(s, seq, &e);
        return;
    }
    if (x.nchunks > 0)
        st = chunk_fds_take(s, chunks, x.nchunks, &e);
    if (st == SPC_OK) {
        pthread_mutex_lock(&srv->eng->lock);
        st = sp_region_add_device(srv->eng, s->client, &x, r->offset, r->length, r->region, &id, &e);
        pthread_mutex_unlock(&srv->eng->lock);
        chunk_fds_close(chunks, x.nchunks);
    }
    free(chunks);
    if (st == SPC_OK)
        answer_region(&a, id);
    answer_send(s, seq, st, &e, &a);
    pthread_mutex_lock(&srv->eng->lock);
    sp_mem_drop_if_gone(srv->eng, s->client);
    pthread_mutex_unlock(&srv->eng->lock);
}

spc_status_t sp_server_check_stream_create(const Spd__StreamCreateReq *r, sp_err_t *e)
{
    if (r->uuid.len != SP_GPU_UUID_BYTES || r->pci_bus_id == NULL || r->pci_bus_id[0] == '\0' ||
        strlen(r->pci_bus_id) >= 32)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "StreamCreateReq: a UUID of %zu bytes (want %d) and a PCI bus id of "
                          "%zu characters (want 1 to 31)", r->uuid.len, SP_GPU_UUID_BYTES, r->pci_bus_id ?
                          strlen(r->pci_bus_id) : 0);
    if (r->resume && r->slot >= SP_STREAMS_MAX)
        return sp_err_set(e, SPC_ERR_INVALID_ARG, "StreamCreateReq: slot %u back; there are %d", r->slot,
                          SP_STREAMS_MAX);
    return SPC_OK;
}

static spc_status_t stream_open(sp_session_t *s, const Spd__Msg *req, answer_t *a, sp_err_t *e)
{
    const Spd__StreamCreateReq *r = req->stream_create_req;
    uint32_t slot = 0;

    spc_status_t st = r->resume ? sp_stream_resume(s->srv->eng, s->client, r->pci_bus_id, r->uuid.data, r->device,
                                                   r->slot, r->ready, r->done, r->settled, r->n_settled, e)
                                : sp_stream_open(s->srv->eng, s->client, r->pci_bus_id, r->uuid.data, r->device,
                                                 &slot, e);
    if (st != SPC_OK)
        return st;
    a->body.stream = (Spd__StreamCreateRep)SPD__STREAM_CREATE_REP__INIT;
    a->body.stream.slot = r->resume ? r->slot : slot;
    a->body.stream.resumed = r->resume;
    a->msg.body_case = SPD__MSG__BODY_STREAM_CREATE_REP;
    a->msg.stream_create_rep = &a->body.stream;
    return SPC_OK;
}

static void handle_stream_create(sp_session_t *s, const Spd__Msg *req)
{
    sp_err_t e = SP_ERR_INIT;

    if (sp_server_check_stream_create(req->stream_create_req, &e) != SPC_OK) {
        sp_session_reply_err(s, req->seq, &e);
        return;
    }
    answer_locked(s, req, stream_open);
}

static spc_status_t stream_close(sp_session_t *s, const Spd__Msg *req, answer_t *a, sp_err_t *e)
{
    (void)a;
    return sp_stream_close(s->srv->eng, s->client, req->stream_destroy_req->slot, e);
}

static void handle_stream_destroy(sp_session_t *s, const Spd__Msg *req)
{
    answer_locked(s, req, stream_close);
}

static spc_status_t region_remove(sp_session_t *s, const Spd__Msg *req, answer_t *a, sp_err_t *e)
{
    (void)a;
    return sp_region_remove(s->srv->eng, s->client, req->deregister_req->region, e);
}

static void handle_deregister(sp_session_t *s, const Spd__Msg *req)
{
    answer_locked(s, req, region_remove);
}

static spc_status_t job_create(sp_session_t *s, const Spd__Msg *req, answer_t *a, sp_err_t *e)
{
    const Spd__JobCreateReq *r = req->job_create_req;
    sp_job_t *job;

    spc_status_t st = sp_job_create(s->srv->eng, s->client, r->allow_uids, r->n_allow_uids, &job, e);
    if (st != SPC_OK) {
        sp_info(JOB, "pid %d: %s", (int)s->pid, e->msg);
        return st;
    }
    snprintf(a->text, sizeof a->text, "%s", job->id);
    a->body.job = (Spd__JobCreateRep)SPD__JOB_CREATE_REP__INIT;
    a->body.job.job_id = a->text;
    a->msg.body_case = SPD__MSG__BODY_JOB_CREATE_REP;
    a->msg.job_create_rep = &a->body.job;
    return SPC_OK;
}

static void handle_job_create(sp_session_t *s, const Spd__Msg *req)
{
    answer_locked(s, req, job_create);
}

static void handle_job_join(sp_session_t *s, const Spd__Msg *req)
{
    sp_server_t *srv = s->srv;
    const Spd__JobJoinReq *r = req->job_join_req;
    uint32_t seq = req->seq;
    char root[SP_NODE_MAX];
    sp_err_t e = SP_ERR_INIT;
    sp_job_t *job = NULL;
    bool complete = false;

    if (s->join_active) {
        sp_session_reply_error(s, seq, SPC_ERR_BUSY, "a join is already in progress on this connection");
        return;
    }
    /* The rank's GPU, for placement; one this node's topology lacks stays unknown there. */
    char bus[SP_TOPO_BUS_MAX] = "";
    if (r->pci_bus_id[0] != '\0' && !sp_topo_bus_id(r->pci_bus_id, bus)) {
        sp_err_set(&e, SPC_ERR_INVALID_ARG, "pci_bus_id '%.40s' is not a PCI bus id", r->pci_bus_id);
        sp_session_reply_err(s, seq, &e);
        return;
    }
    bool named = r->name[0] != '\0';
    if (named && r->job_id[0] != '\0') {
        sp_session_reply_error(s, seq, SPC_ERR_INVALID_ARG, "a join names a job id or a job name, not both");
        return;
    }
    pthread_mutex_lock(&srv->eng->lock);
    /* A name this daemon does not hold may have its home on another: found by
     * asking them (cluster_names.c). */
    if (named && srv->peers.enabled && sp_names_must_look(srv, s->uid, r->name)) {
        pthread_mutex_unlock(&srv->eng->lock);
        sp_names_join(s, seq, r, bus);
        return;
    }
    /* A job rooted on another daemon is joined through a mirror of it here. */
    sp_job_root_node(r->job_id, root);
    if (!named && srv->peers.enabled && strcmp(root, srv->node) != 0 && sp_job_find(srv->eng, r->job_id) == NULL &&
        sp_job_mirror(srv->eng, r->job_id, root) == NULL) {
        pthread_mutex_unlock(&srv->eng->lock);
        sp_session_reply_error(s, seq, SPC_ERR_NO_MEMORY, "out of memory");
        return;
    }
    spc_status_t st = named ? sp_job_join_named(srv->eng, s->client, r->name, r->launch, r->world_size, r->rank, s,
                                                &job, &complete, &e)
                            : sp_job_join(srv->eng, s->client, r->job_id, r->world_size, r->rank, s, &job, &complete,
                                          &e);
    st = sp_joins_settle(s, seq, r->rank, bus, st, job, complete, &e);   /* unlocks */
    if (st == SPC_ERR_PERMISSION || (named && st != SPC_OK))
        sp_warn(JOB, "pid %d (uid %u) refused: %s", (int)s->pid, (unsigned)s->uid, e.msg);
    if (st != SPC_OK) {
        sp_session_reply_err(s, seq, &e);
        return;
    }
    if (s->join_active) {   /* not answered yet: the world is not complete */
        uint64_t timeout = r->timeout_ms ? r->timeout_ms : (uint64_t)srv->cfg->op_timeout_ms;
        sp_joins_arm(s, timeout);
    }
}

static spc_status_t mesh_create(sp_session_t *s, const Spd__Msg *req, answer_t *a, sp_err_t *e)
{
    const Spd__MeshCreateReq *r = req->mesh_create_req;
    sp_mesh_t *mesh;
    sp_mesh_spec_t spec = { .sp = r->sp, .ulysses = r->ulysses, .ring = r->ring, .heads = r->heads,
                            .kv_heads = r->kv_heads };
    Spd__MeshCreateRep *rep = &a->body.mesh;

    spc_status_t st = sp_mesh_create(s->srv->eng, s->client, &spec, &mesh, e);
    if (st != SPC_OK) {
        sp_info(JOB, "pid %d: %s", (int)s->pid, e->msg);
        return st;
    }
    *rep = (Spd__MeshCreateRep)SPD__MESH_CREATE_REP__INIT;
    sp_group_t *dp, *sp, *u, *ring;
    sp_mesh_coords(mesh, s->client->rank, &rep->dp_rank, &rep->sp_rank, &rep->ulysses_rank, &rep->ring_rank, &dp, &sp,
                   &u, &ring);
    rep->mesh_id = mesh->id;
    rep->dp = mesh->dp;
    rep->sp = mesh->sp;
    rep->ulysses = mesh->ulysses;
    rep->ring = mesh->ring;
    rep->dp_group = dp->id;
    rep->sp_group = sp->id;
    rep->ulysses_group = u->id;
    rep->ring_group = ring->id;
    /* Their members, which the caller brings back should spd restart (Resume):
     * copied, as the answer goes after the lock is dropped. */
    static const char *const kind_names[SP_MESH_KINDS] = { "dp", "sp", "ulysses", "ring" };
    const sp_group_t *mine[SP_MESH_KINDS] = { dp, sp, u, ring };
    uint32_t total = dp->size + sp->size + u->size + ring->size, off = 0;
    if ((a->owned = malloc(total * sizeof *a->owned)) == NULL)
        return sp_err_set(e, SPC_ERR_NO_MEMORY, "out of memory");
    for (unsigned k = 0; k < SP_MESH_KINDS; k++) {
        Spd__GroupMembers *gm = &a->members[k];
        spd__group_members__init(gm);
        gm->id = mine[k]->id;
        gm->index = mine[k]->index;
        gm->kind = (char *)kind_names[k];
        gm->ranks = a->owned + off;
        gm->n_ranks = mine[k]->size;
        memcpy(gm->ranks, mine[k]->ranks, mine[k]->size * sizeof *gm->ranks);
        off += mine[k]->size;
        a->member_ptrs[k] = gm;
    }
    rep->groups = a->member_ptrs;
    rep->n_groups = SP_MESH_KINDS;
    snprintf(a->text, sizeof a->text, "%s", mesh->explain);
    rep->explain = a->text;
    a->msg.body_case = SPD__MSG__BODY_MESH_CREATE_REP;
    a->msg.mesh_create_rep = rep;
    return SPC_OK;
}

static void handle_mesh_create(sp_session_t *s, const Spd__Msg *req)
{
    answer_locked(s, req, mesh_create);
}

static void handle_bye(sp_session_t *s, const Spd__Msg *req)
{
    sp_session_reply_ok(s, req->seq);
    sp_session_close_after_flush(s, "detached");
}

/* ---------------------------------------------------------------- the table */

/* Every request a session may send once its Hello is answered. */
static const struct handler {
    Spd__Msg__BodyCase body;
    bool               needs_client;   /* refused on a control session */
    void             (*handle)(sp_session_t *s, const Spd__Msg *req);
} handlers[] = {
    { SPD__MSG__BODY_QUERY_REQ,           false, sp_query_answer },
    { SPD__MSG__BODY_BYE,                 false, handle_bye },
    { SPD__MSG__BODY_REGISTER_REQ,        true,  handle_register },
    { SPD__MSG__BODY_REGISTER_DEVICE_REQ, true,  handle_register_device },
    { SPD__MSG__BODY_STREAM_CREATE_REQ,   true,  handle_stream_create },
    { SPD__MSG__BODY_STREAM_DESTROY_REQ,  true,  handle_stream_destroy },
    { SPD__MSG__BODY_DEREGISTER_REQ,      true,  handle_deregister },
    { SPD__MSG__BODY_JOB_CREATE_REQ,      true,  handle_job_create },
    { SPD__MSG__BODY_JOB_JOIN_REQ,        true,  handle_job_join },
    { SPD__MSG__BODY_MESH_CREATE_REQ,     true,  handle_mesh_create },
};

void sp_handler_dispatch(sp_session_t *s, const Spd__Msg *msg)
{
    sp_err_t e = SP_ERR_INIT;
    uint32_t seq = msg->seq;
    const struct handler *h = NULL;

    sp_trace(CTL, "pid %d: <- %s seq %u", (int)s->pid, sp_msg_body_name(msg), seq);
    if (s->state == SP_SESSION_NEW) {
        if (msg->body_case != SPD__MSG__BODY_HELLO) {
            sp_session_reply_error(s, seq, SPC_ERR_PROTOCOL, "the first message must be hello");
            sp_session_close_after_flush(s, "no hello");
            return;
        }
        handle_hello(s, msg);
        return;
    }
    bool client = s->state == SP_SESSION_CLIENT;
    if (!client)
        sp_session_idle_arm(s);
    for (size_t i = 0; i < sizeof handlers / sizeof handlers[0] && h == NULL; i++)
        if (handlers[i].body == msg->body_case)
            h = &handlers[i];
    if (h == NULL) {
        sp_err_set(&e, SPC_ERR_PROTOCOL, "unexpected message '%s'", sp_msg_body_name(msg));
        sp_session_reply_err(s, seq, &e);
        return;
    }
    if (h->needs_client && !client) {
        sp_err_set(&e, SPC_ERR_INVALID_ARG, "'%s' needs a client session, not a control one", sp_msg_body_name(msg));
        sp_session_reply_err(s, seq, &e);
        return;
    }
    h->handle(s, msg);
}
