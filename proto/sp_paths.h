/*
 * sp_paths.h — where the daemon's socket lives by default. The daemon and the
 * client library must agree without talking, so the rule lives here, once:
 *
 *   root:   /run/spd/spd.sock
 *   others: $XDG_RUNTIME_DIR/spd/spd.sock, or /tmp/spd-<uid>/spd.sock without it
 *
 * SPD_SOCKET (daemon) and SPC_SOCKET (client) override it.
 */
#ifndef SP_PATHS_H
#define SP_PATHS_H

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define SP_SOCKET_NAME "spd.sock"

/* Writes the default socket path into buf; returns snprintf's result. */
static inline int sp_default_socket_path(char *buf, size_t len)
{
    uid_t uid = geteuid();
    const char *xdg = getenv("XDG_RUNTIME_DIR");

    if (uid == 0)
        return snprintf(buf, len, "/run/spd/" SP_SOCKET_NAME);
    if (xdg != NULL && xdg[0] == '/')
        return snprintf(buf, len, "%s/spd/" SP_SOCKET_NAME, xdg);
    return snprintf(buf, len, "/tmp/spd-%u/" SP_SOCKET_NAME, (unsigned)uid);
}

#endif /* SP_PATHS_H */
