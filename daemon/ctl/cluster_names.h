/*
 * cluster_names.h — named jobs across daemons: finding the daemon that is a
 * name's home, with no id passed between the ranks (cluster_names.c).
 */
#ifndef SP_CTL_CLUSTER_NAMES_H
#define SP_CTL_CLUSTER_NAMES_H

#include "ctl/session.h"

typedef struct sp_name_lookup sp_name_lookup_t;

/* A named join (JobJoinReq with a name) on a daemon with peers whose name it
 * does not hold: checks it as a join is checked, then waits in a lookup for the
 * name's home, the join's deadline armed. Answers the session itself when the
 * join is refused or, later, decided. Lock not held. */
void sp_names_join(sp_session_t *s, uint32_t seq, const Spd__JobJoinReq *r, const char *bus);
/* Whether this daemon holds no job of the name a named join asks for, so the
 * join waits for a lookup. Lock held. */
bool sp_names_must_look(sp_server_t *srv, uid_t uid, const char *name);
/* Another daemon asks whether this one is a name's home: answered at once. Lock held. */
void sp_names_answer(sp_server_t *srv, const char *node, const Spd__PeerNameQuery *q);
/* Another daemon's answer. Lock not held. */
void sp_names_heard(sp_server_t *srv, const char *node, const Spd__PeerNameRep *rep);
/* The session's join reached its deadline while it looked: writes why into
 * detail and forgets the lookup. */
void sp_names_expired(sp_session_t *s, char *detail, size_t len);
/* The session closes while it looks: forgets the lookup. */
void sp_names_forget(sp_session_t *s);
/* Starts the lookups' clock (sp_cluster_init) and stops it (shutdown). */
void sp_names_init(sp_server_t *srv);
void sp_names_close(sp_server_t *srv);

#endif /* SP_CTL_CLUSTER_NAMES_H */
