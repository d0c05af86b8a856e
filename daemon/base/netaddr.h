/*
 * netaddr.h — a TCP socket's address as the daemon shows it: "ip:port", or
 * "[ip]:port" for IPv6, with the bare ip apart (limits count per ip); and the
 * numeric addresses options name (metrics_listen), read back.
 */
#ifndef SP_NETADDR_H
#define SP_NETADDR_H

#include <arpa/inet.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
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

/* "127.0.0.1:9464" or "[::1]:9464" into a socket address. -1 when malformed. */
static inline int sp_addr_parse(const char *s, struct sockaddr_storage *sa)
{
    char host[64];
    const char *colon;
    if (s[0] == '[') {
        const char *close = strchr(s, ']');
        if (close == NULL || close[1] != ':' || (size_t)(close - s - 1) >= sizeof host)
            return -1;
        snprintf(host, sizeof host, "%.*s", (int)(close - s - 1), s + 1);
        colon = close + 1;
    } else {
        colon = strrchr(s, ':');
        if (colon == NULL || (size_t)(colon - s) >= sizeof host)
            return -1;
        snprintf(host, sizeof host, "%.*s", (int)(colon - s), s);
    }
    char *end;
    long port = strtol(colon + 1, &end, 10);
    if (colon[1] == '\0' || *end != '\0' || port < 0 || port > 65535)
        return -1;
    if (uv_ip4_addr(host, (int)port, (struct sockaddr_in *)sa) == 0)
        return 0;
    return uv_ip6_addr(host, (int)port, (struct sockaddr_in6 *)sa) == 0 ? 0 : -1;
}

static inline bool sp_addr_is_loopback(const struct sockaddr *sa)
{
    if (sa->sa_family == AF_INET)
        return (ntohl(((const struct sockaddr_in *)sa)->sin_addr.s_addr) >> 24) == 127;
    const struct in6_addr *a = &((const struct sockaddr_in6 *)sa)->sin6_addr;
    return IN6_IS_ADDR_LOOPBACK(a) || (IN6_IS_ADDR_V4MAPPED(a) && a->s6_addr[12] == 127);
}

#endif /* SP_NETADDR_H */
