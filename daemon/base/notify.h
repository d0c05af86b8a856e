/*
 * notify.h — the service manager's notification protocol, without libsystemd.
 *
 * When $NOTIFY_SOCKET is set (systemd Type=notify, or a test), state strings
 * such as "READY=1" go to it as one datagram each. A leading '@' names an
 * abstract socket.
 */
#ifndef SP_NOTIFY_H
#define SP_NOTIFY_H

#include <stdint.h>

/* Returns 1 when sent, 0 when $NOTIFY_SOCKET is unset, -errno on failure. */
int sp_notify(const char *state);

/* The watchdog interval asked for by $WATCHDOG_USEC (for this pid), or 0. */
uint64_t sp_notify_watchdog_usec(void);

#endif /* SP_NOTIFY_H */
