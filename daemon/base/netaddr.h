/*
 * netaddr.h — a TCP socket's address as the daemon shows it: "ip:port", or
 * "[ip]:port" for IPv6, with the bare ip apart (limits count per ip).
 */
#ifndef SP_NETADDR_H
#define SP_NETADDR_H

#include <arpa/inet.h>
#include <stdio.h>
#include <uv.h>

/* Writes sa's ip (may be NULL) and ip:port; "?" and "?:0" for a family it is not. */
static inline void sp_addr_name(const struct sockaddr_storage *sa, char *ip, size_t iplen, char *addr, size_t addrlen)
{
    char buf[64] = "?";
    int port = 0;
    if (sa->ss_family == AF_INET6) {
        uv_ip6_name((const struct sockaddr_in6 *)sa, buf, sizeof buf);
        port = ntohs(((const struct sockaddr_in6 *)sa)->sin6_port);
    } else if (sa->ss_family == AF_INET) {
        uv_ip4_name((const struct sockaddr_in *)sa, buf, sizeof buf);
        port = ntohs(((const struct sockaddr_in *)sa)->sin_port);
    }
    if (ip != NULL)
        snprintf(ip, iplen, "%s", buf);
    snprintf(addr, addrlen, sa->ss_family == AF_INET6 ? "[%s]:%d" : "%s:%d", buf, port);
}

#endif /* SP_NETADDR_H */
