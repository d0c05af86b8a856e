/*
 * handlers.h — what spd does with each message a session sends.
 *
 * The first message of a session must be Hello, which makes it a client's
 * (an engine client, passed its segment with the Welcome) or spctl's. Each
 * later message is a request that the table in handlers.c answers, exactly
 * once; session.c only reads and writes the frames.
 */
#ifndef SP_CTL_HANDLERS_H
#define SP_CTL_HANDLERS_H

#include "ctl/session.h"

/* Handles one decoded message of session s: the Hello of a new session, else
 * the request, answered on the session (or closing it). Loop thread. */
void sp_handler_dispatch(sp_session_t *s, const Spd__Msg *msg);

#endif /* SP_CTL_HANDLERS_H */
