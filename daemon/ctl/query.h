/*
 * query.h — the answers to spctl's questions (QueryReq).
 */
#ifndef SP_CTL_QUERY_H
#define SP_CTL_QUERY_H

#include "ctl/session.h"

/* Answers the QueryReq in msg on session s with a QueryRep, or an Error: an
 * unknown topic or job, an unknown config key, out of memory. Loop thread;
 * takes the engine lock for each copy. */
void sp_query_answer(sp_session_t *s, const Spd__Msg *msg);

#endif /* SP_CTL_QUERY_H */
