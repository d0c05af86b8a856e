/*
 * session.c — sessions and framing: accept, credentials, frames in, replies
 * out, backpressure, the hello, idle, join and flush deadlines, close.
 *
 * Framing errors (bad magic or version, a frame over max_frame_bytes) cannot be
 * recovered from on a stream: the session gets an Error and is closed. A frame
 * whose payload does not decode gets an Error and the session goes on. Every
 * message that decodes goes to sp_handler_dispatch (handlers.c).
 */
#include "ctl/session.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/log.h"
#include "core/auth.h"
#include "core/client.h"
#include "core/engine.h"
#include "core/job.h"
#include "ctl/cluster_names.h"
#include "ctl/handlers.h"
#include "sp_msg.h"

#define MAX_PEER_GROUPS  256

typedef struct write_req {
    uv_write_t req;
    uint8_t   *buf;
} write_req_t;

static void session_parse(sp_session_t *s);
static void session_resume(sp_session_t *s);

/* ================================================================ replies */

/*
 * What a session makes spd hold for it is bounded: replies it leaves unread
 * (libuv's write queue) past reply_pause_bytes stop spd reading its requests,
 * frames already read included, until it has read them all. With reading
 * stopped only one more reply, or replies nobody asked for just then (join
 * answers, errors), can add to them; past max_reply_bytes the session is
 * dropped.
 */
static void on_write(uv_write_t *req, int status)
{
    write_req_t *w = (write_req_t *)req;
    uv_stream_t *stream = req->handle;
    sp_session_t *s = stream->data;
    if (status < 0 && status != UV_ECANCELED)
        sp_debug(CTL, "reply write failed: %s", uv_strerror(status));
    free(w->buf);
    free(w);
    if (s->paused && s->state != SP_SESSION_CLOSING && uv_stream_get_write_queue_size(stream) == 0)
        session_resume(s);
}

static void session_backlog_check(sp_session_t *s)
{
    const sp_config_t *cfg = s->srv->cfg;
    size_t queued = uv_stream_get_write_queue_size((uv_stream_t *)&s->pipe);
    char why[96];

    if (queued > (uint64_t)cfg->max_reply_bytes) {
        snprintf(why, sizeof why, "%zu bytes of replies unread, over max_reply_bytes (%" PRId64 ")", queued,
                 cfg->max_reply_bytes);
        sp_warn(CTL, "pid %d: %s; disconnecting", (int)s->pid, why);
        sp_session_close(s, why);
        return;
    }
    if (queued > (uint64_t)cfg->reply_pause_bytes && !s->paused) {
        sp_debug(CTL, "pid %d: %zu bytes of replies unread (reply_pause_bytes %" PRId64 "); not reading its "
                 "requests until it catches up", (int)s->pid, queued, cfg->reply_pause_bytes);
        s->paused = true;
        uv_read_stop((uv_stream_t *)&s->pipe);
    }
}

void sp_session_send(sp_session_t *s, Spd__Msg *msg)
{
    if (s->state == SP_SESSION_CLOSING)
        return;
    write_req_t *w = calloc(1, sizeof *w);
    size_t len;
    if (w == NULL || sp_msg_encode(msg, &w->buf, &len) != 0) {
        sp_error(CTL, "pid %d: cannot encode a %s reply", (int)s->pid, sp_msg_body_name(msg));
        free(w);
        sp_session_close(s, "reply could not be encoded");
        return;
    }
    uv_buf_t b = uv_buf_init((char *)w->buf, (unsigned)len);
    int rc = uv_write(&w->req, (uv_stream_t *)&s->pipe, &b, 1, on_write);
    if (rc < 0) {
        free(w->buf);
        free(w);
        sp_session_close(s, "reply write failed");
        return;
    }
    session_backlog_check(s);
}

void sp_session_reply_error(sp_session_t *s, uint32_t seq, spc_status_t st, const char *detail)
{
    Spd__Msg m = SPD__MSG__INIT;
    Spd__Error e = SPD__ERROR__INIT;
    e.status = st;
    e.detail = (char *)detail;
    m.seq = seq;
    m.body_case = SPD__MSG__BODY_ERROR;
    m.error = &e;
    sp_debug(CTL, "pid %d: -> error %s: %s", (int)s->pid, spc_status_name(st), detail);
    sp_session_send(s, &m);
}

void sp_session_reply_ok(sp_session_t *s, uint32_t seq)
{
    Spd__Msg m = SPD__MSG__INIT;
    Spd__Ok ok = SPD__OK__INIT;
    m.seq = seq;
    m.body_case = SPD__MSG__BODY_OK;
    m.ok = &ok;
    sp_session_send(s, &m);
}

/* ================================================================ sockets and sessions */

static void on_handle_closed(uv_handle_t *h)
{
    sp_session_t *s = h->data;
    if (--s->open_handles == 0) {
        free(s->rbuf);
        free(s);
    }
}

static void session_unlink(sp_session_t *s)
{
    sp_server_t *srv = s->srv;
    sp_session_t **pp = &srv->sessions;
    while (*pp != NULL && *pp != s)
        pp = &(*pp)->next;
    if (*pp == s) {
        *pp = s->next;
        srv->nsessions--;
        srv->by_protocol[s->protocol]--;
    }
}

/* Tears a session down: its engine client goes (peers see it leave), its handles close. */
void sp_session_close(sp_session_t *s, const char *why)
{
    sp_server_t *srv = s->srv;

    if (s->state == SP_SESSION_CLOSING)
        return;
    if (s->client != NULL) {
        sp_info(CTL, "client %" PRIu64 " (pid %d) detached: %s", s->client->id, (int)s->pid, why);
        pthread_mutex_lock(&srv->eng->lock);
        if (s->join_active && s->join_job != NULL)
            sp_job_join_cancel(srv->eng, s->join_job, s->join_rank);
        sp_client_destroy(srv->eng, s->client, why);
        pthread_mutex_unlock(&srv->eng->lock);
        s->client = NULL;
        /* Peers' ops may have completed just now, freeing room they wait for. */
        sp_engine_kick(srv->eng);
    } else {
        sp_debug(CTL, "session of pid %d closed: %s", (int)s->pid, why);
    }
    s->state = SP_SESSION_CLOSING;
    if (s->join_lookup != NULL)
        sp_names_forget(s);
    s->join_active = false;
    session_unlink(s);

    uv_close((uv_handle_t *)&s->pipe, on_handle_closed);
    uv_close((uv_handle_t *)&s->timer, on_handle_closed);
    if (s->pidfd >= 0) {
        uv_close((uv_handle_t *)&s->pidfd_poll, on_handle_closed);
        /* libuv does not own the descriptor of a poll handle. */
        close(s->pidfd);
        s->pidfd = -1;
    }
}

static void on_shutdown(uv_shutdown_t *req, int status)
{
    (void)status;
    sp_session_t *s = req->data;
    free(req);
    sp_session_close(s, s->close_why);
}

static void on_flush_timeout(uv_timer_t *t)
{
    sp_session_t *s = t->data;
    sp_debug(CTL, "pid %d: replies still unread after %" PRId64 " ms", (int)s->pid, s->srv->cfg->session_idle_ms);
    sp_session_close(s, s->close_why);
}

/* Closes once the replies queued so far have been written, or after
 * session_idle_ms if the peer does not read them. */
void sp_session_close_after_flush(sp_session_t *s, const char *why)
{
    if (s->state == SP_SESSION_CLOSING || s->flushing)
        return;
    sp_debug(CTL, "pid %d: closing after flush: %s", (int)s->pid, why);
    snprintf(s->close_why, sizeof s->close_why, "%s", why);
    s->flushing = true;
    uv_read_stop((uv_stream_t *)&s->pipe);
    uv_shutdown_t *req = calloc(1, sizeof *req);
    if (req == NULL || uv_shutdown(req, (uv_stream_t *)&s->pipe, on_shutdown) != 0) {
        free(req);
        sp_session_close(s, why);
        return;
    }
    req->data = s;
    uv_timer_start(&s->timer, on_flush_timeout, (uint64_t)s->srv->cfg->session_idle_ms, 0);
}

static void on_pidfd(uv_poll_t *h, int status, int events)
{
    (void)status;
    (void)events;
    sp_session_close(h->data, "process exited");
}

void sp_session_watch_pid(sp_session_t *s, int pidfd)
{
    s->pidfd = pidfd;
    uv_poll_init(s->srv->loop, &s->pidfd_poll, pidfd);
    s->pidfd_poll.data = s;
    s->open_handles++;
    uv_poll_start(&s->pidfd_poll, UV_READABLE, on_pidfd);
}

static void on_hello_timeout(uv_timer_t *t)
{
    sp_session_t *s = t->data;
    char why[96];
    snprintf(why, sizeof why, "no hello within %" PRId64 " ms (session_idle_ms)", s->srv->cfg->session_idle_ms);
    sp_info(CTL, "pid %d: %s; closing", (int)s->pid, why);
    sp_session_close(s, why);
}

/* A control session holds one of max_clients while it lives: one that asks
 * nothing for session_idle_ms gives it back. */
static void on_idle_timeout(uv_timer_t *t)
{
    sp_session_t *s = t->data;
    char why[128];
    snprintf(why, sizeof why, "control session sent nothing for %" PRId64 " ms (session_idle_ms); attach again",
             s->srv->cfg->session_idle_ms);
    sp_info(CTL, "pid %d: %s; closing", (int)s->pid, why);
    sp_session_reply_error(s, 0, SPC_ERR_TIMEOUT, why);
    sp_session_close_after_flush(s, "idle");
}

void sp_session_idle_arm(sp_session_t *s)
{
    uv_timer_start(&s->timer, on_idle_timeout, (uint64_t)s->srv->cfg->session_idle_ms, 0);
}

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    (void)suggested;
    sp_session_t *s = h->data;
    /* The parser refuses a frame over the limit as soon as its header is here, so
     * the buffer never holds more than one maximal frame plus one read. */
    const size_t chunk = 64 * 1024;
    if (s->rcap - s->rlen < chunk) {
        size_t cap = s->rcap ? s->rcap * 2 : chunk * 2;
        while (cap - s->rlen < chunk)
            cap *= 2;
        uint8_t *p = realloc(s->rbuf, cap);
        if (p == NULL) {
            *buf = uv_buf_init(NULL, 0);
            return;
        }
        s->rbuf = p;
        s->rcap = cap;
    }
    *buf = uv_buf_init((char *)s->rbuf + s->rlen, (unsigned)(s->rcap - s->rlen));
}

static void on_read(uv_stream_t *stream, ssize_t nread, const uv_buf_t *buf)
{
    (void)buf;
    sp_session_t *s = stream->data;

    if (nread == UV_ENOBUFS) {
        sp_session_close(s, "out of memory for its frames");
        return;
    }
    if (nread < 0) {
        if (s->rlen > 0) {
            sp_warn(CTL, "pid %d: connection ended inside a frame (%zu bytes buffered): truncated frame",
                    (int)s->pid, s->rlen);
            sp_session_close(s, "truncated frame");
        } else {
            sp_session_close(s, nread == UV_EOF ? "connection closed" : uv_strerror((int)nread));
        }
        return;
    }
    s->rlen += (size_t)nread;
    session_parse(s);
}

/* Handles the whole frames buffered, until the session pauses or closes. */
static void session_parse(sp_session_t *s)
{
    sp_server_t *srv = s->srv;
    char detail[256];
    size_t off = 0;

    while (s->state != SP_SESSION_CLOSING && !s->flushing && !s->paused) {
        sp_frame_t f;
        sp_frame_result_t r = sp_frame_parse(s->rbuf + off, s->rlen - off, (uint32_t)srv->cfg->max_frame_bytes, &f);
        if (r == SP_FRAME_NEED_MORE)
            break;
        if (r != SP_FRAME_OK) {
            if (r == SP_FRAME_TOO_BIG)
                snprintf(detail, sizeof detail, "frame of %u bytes exceeds max_frame_bytes (%" PRId64 ")",
                         f.length, srv->cfg->max_frame_bytes);
            else
                snprintf(detail, sizeof detail, "%s", sp_frame_result_str(r));
            sp_warn(CTL, "pid %d: %s; disconnecting", (int)s->pid, detail);
            sp_session_reply_error(s, 0, SPC_ERR_PROTOCOL, detail);
            sp_session_close_after_flush(s, detail);
            return;
        }
        Spd__Msg *msg = sp_msg_decode(&f);
        off += f.frame_bytes;
        if (msg == NULL) {
            sp_warn(CTL, "pid %d: undecodable %u-byte message", (int)s->pid, f.length);
            sp_session_reply_error(s, 0, SPC_ERR_PROTOCOL, "message does not decode as spd.Msg");
            continue;
        }
        sp_handler_dispatch(s, msg);
        sp_msg_free(msg);
    }
    if (s->state != SP_SESSION_CLOSING && off > 0) {
        memmove(s->rbuf, s->rbuf + off, s->rlen - off);
        s->rlen -= off;
    }
}

static void session_resume(sp_session_t *s)
{
    s->paused = false;
    if (s->flushing)
        return;
    sp_debug(CTL, "pid %d: replies read; reading its requests again", (int)s->pid);
    uv_read_start((uv_stream_t *)&s->pipe, on_alloc, on_read);
    session_parse(s);
}

void sp_session_accept(uv_stream_t *listener, int status)
{
    sp_server_t *srv = listener->data;
    if (status < 0) {
        sp_warn(CTL, "accept: %s", uv_strerror(status));
        return;
    }
    sp_session_t *s = calloc(1, sizeof *s);
    if (s == NULL) {
        sp_error(CTL, "out of memory accepting a connection");
        return;
    }
    s->srv = srv;
    s->pidfd = -1;
    uv_pipe_init(srv->loop, &s->pipe, 0);
    s->pipe.data = s;
    s->open_handles = 1;
    if (uv_accept(listener, (uv_stream_t *)&s->pipe) != 0) {
        uv_close((uv_handle_t *)&s->pipe, on_handle_closed);
        return;
    }
    uv_timer_init(srv->loop, &s->timer);
    s->timer.data = s;
    s->open_handles++;
    s->next = srv->sessions;
    srv->sessions = s;
    srv->nsessions++;
    srv->by_protocol[0]++;   /* until its hello chooses one */

    /* Credentials come from the kernel, never from what the peer says. */
    int fd;
    gid_t groups[MAX_PEER_GROUPS];
    int ngroups = MAX_PEER_GROUPS;
    uv_fileno((uv_handle_t *)&s->pipe, &fd);
    int rc = sp_auth_peer(fd, &s->pid, &s->uid, &s->gid, groups, &ngroups);
    if (rc != 0) {
        sp_err_set(&s->refusal, SPC_ERR_PERMISSION, "cannot read peer credentials: %s", strerror(-rc));
        srv->refused[SP_REFUSED_USER]++;
    } else if (sp_auth_allowed(geteuid(), s->uid, s->gid, groups, ngroups, srv->allow_gid, &s->refusal) != SPC_OK) {
        sp_warn(CTL, "refusing pid %d: %s", (int)s->pid, s->refusal.msg);
        srv->refused[SP_REFUSED_USER]++;
    } else if (srv->nsessions > (uint32_t)srv->cfg->max_clients) {
        sp_err_set(&s->refusal, SPC_ERR_LIMIT, "spd already has %" PRId64 " sessions (max_clients)",
                   srv->cfg->max_clients);
        sp_warn(CTL, "refusing pid %d: %s", (int)s->pid, s->refusal.msg);
        srv->refused[SP_REFUSED_LIMIT]++;
    }
    /* The refusal is answered to the Hello, so the client reads a reason rather
     * than a reset connection. */
    uv_timer_start(&s->timer, on_hello_timeout, (uint64_t)srv->cfg->session_idle_ms, 0);
    uv_read_start((uv_stream_t *)&s->pipe, on_alloc, on_read);
}
