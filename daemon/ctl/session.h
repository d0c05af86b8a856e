/*
 * session.h — one connection on the Unix socket, from accept to close.
 *
 * A session starts NEW; its first message must be Hello. A CLIENT session then
 * owns an engine client and a pidfd that says when the process is gone; a
 * CONTROL session (spctl) only asks questions, and is closed when idle. Each
 * whole frame read goes to sp_handler_dispatch; replies go out in order through
 * sp_session_send, bounded by reply_pause_bytes and max_reply_bytes. Loop
 * thread only; a session's memory goes with its last handle.
 */
#ifndef SP_CTL_SESSION_H
#define SP_CTL_SESSION_H

#include "ctl/server.h"
#include "core/client.h"
#include "core/job.h"

typedef enum sp_session_state {
    SP_SESSION_NEW, SP_SESSION_CLIENT, SP_SESSION_CONTROL, SP_SESSION_CLOSING
} sp_session_state_t;

struct sp_session {
    sp_session_t      *next;
    sp_server_t       *srv;
    sp_session_state_t state;
    uv_pipe_t          pipe;
    uv_timer_t         timer;          /* hello, idle, join or flush deadline */
    uv_poll_t          pidfd_poll;
    int                pidfd;
    int                open_handles;   /* freed when the last one has closed */

    pid_t              pid;
    uid_t              uid;
    gid_t              gid;
    sp_err_t           refusal;        /* SPC_OK when the peer may attach */
    uint32_t           protocol;       /* chosen at its hello (proto/sp_msg.h); 0 before */

    sp_client_t       *client;         /* SP_SESSION_CLIENT; valid until the session closes */

    uint8_t           *rbuf;
    size_t             rlen, rcap;

    char               close_why[96];  /* reason kept for the deferred close */
    bool               flushing;       /* closing once its replies are written */
    bool               paused;         /* not read until its replies are */

    bool               join_active;
    uint32_t           join_seq;
    uint32_t           join_rank;
    sp_job_t          *join_job;      /* NULL while the join looks for its name's home: */
    struct sp_name_lookup *join_lookup;   /* that lookup (cluster_names.c) */
};

/* The listener's connection callback: reads the peer's credentials from the
 * kernel and waits session_idle_ms for its Hello. */
void sp_session_accept(uv_stream_t *listener, int status);

/* Queues msg to be written; a session that leaves too much unread is paused,
 * then dropped. Does nothing once the session is closing. */
void sp_session_send(sp_session_t *s, Spd__Msg *msg);
void sp_session_reply_error(sp_session_t *s, uint32_t seq, spc_status_t st, const char *detail);
/* Answers request seq with the error e carries. */
static inline void sp_session_reply_err(sp_session_t *s, uint32_t seq, const sp_err_t *e)
{
    sp_session_reply_error(s, seq, e->status, e->msg);
}
void sp_session_reply_ok(sp_session_t *s, uint32_t seq);

/* Restarts the idle deadline of a control session. */
void sp_session_idle_arm(sp_session_t *s);
/* Closes the session when process pidfd exits; the session owns pidfd from now on. */
void sp_session_watch_pid(sp_session_t *s, int pidfd);

/* Tears a session down now: its engine client goes (peers see it leave), its handles close. */
void sp_session_close(sp_session_t *s, const char *why);
/* Closes once the replies queued so far have been written, or after
 * session_idle_ms if the peer does not read them. */
void sp_session_close_after_flush(sp_session_t *s, const char *why);

#endif /* SP_CTL_SESSION_H */
