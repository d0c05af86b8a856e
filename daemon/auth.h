/*
 * auth.h — who may attach. A peer may when its uid is the daemon's, or when it
 * belongs (primary or supplementary group) to the configured allow_group. The
 * decision is a pure function so that it is tested without other users.
 */
#ifndef SP_AUTH_H
#define SP_AUTH_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#define SP_AUTH_NO_GROUP ((long)-1)

bool sp_auth_allowed(uid_t self_uid, uid_t peer_uid, gid_t peer_gid, const gid_t *groups, int ngroups,
                     long allow_gid, char *why, size_t len);

/* Resolves a group name or number. Returns 0, or -1 when unknown. "" gives SP_AUTH_NO_GROUP. */
int sp_auth_resolve_group(const char *spec, long *gid_p);

/* Reads SO_PEERCRED and SO_PEERGROUPS of a connected Unix socket. Returns 0 or -errno. */
int sp_auth_peer(int fd, pid_t *pid_p, uid_t *uid_p, gid_t *gid_p, gid_t *groups, int *ngroups_p);

#endif /* SP_AUTH_H */
