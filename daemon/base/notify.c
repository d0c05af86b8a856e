/* notify.c — see notify.h. */
#include "base/notify.h"

#include <errno.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

int sp_notify(const char *state)
{
    const char *path = getenv("NOTIFY_SOCKET");
    if (path == NULL || path[0] == '\0')
        return 0;
    size_t plen = strlen(path);
    struct sockaddr_un sa = { .sun_family = AF_UNIX };
    if (plen >= sizeof sa.sun_path || (path[0] != '/' && path[0] != '@'))
        return -EINVAL;
    memcpy(sa.sun_path, path, plen);
    if (path[0] == '@')
        sa.sun_path[0] = '\0';
    socklen_t salen = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + plen + (path[0] == '/'));

    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    ssize_t n = sendto(fd, state, strlen(state), MSG_NOSIGNAL, (struct sockaddr *)&sa, salen);
    int err = errno;
    close(fd);
    return n < 0 ? -err : 1;
}

uint64_t sp_notify_watchdog_usec(void)
{
    const char *usec = getenv("WATCHDOG_USEC");
    const char *pid = getenv("WATCHDOG_PID");
    if (usec == NULL)
        return 0;
    if (pid != NULL && strtol(pid, NULL, 10) != (long)getpid())
        return 0;
    return strtoull(usec, NULL, 10);
}
