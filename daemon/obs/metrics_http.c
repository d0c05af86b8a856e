/*
 * metrics_http.c — GET /metrics over HTTP/1.0 on the libuv loop, for
 * Prometheus, and GET /healthz for probes; off unless metrics_listen names an
 * address, loopback only unless metrics_allow_remote. One request per
 * connection; every connection's cost is bounded (head size, timeouts,
 * HTTP_CONNS_MAX). It touches the engine only through the renderer's copy and
 * the progress thread's heartbeat; sp_metrics_http_judge alone decides what a
 * head gets (the fuzzer runs it). The bounds, the answers, closing:
 * docs/architecture.md, "The metrics endpoint".
 */
#include "obs/metrics.h"

#include <arpa/inet.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/log.h"
#include "base/netaddr.h"

#define HTTP_TIMEOUT_MS 5000
#define HTTP_CONNS_MAX  16
/* How often the loop looks at the progress thread's heartbeat, kicking it so
 * that an idle thread goes round too (it sleeps up to progress_sleep_ms). */
#define HEALTH_TICK_MS  250

typedef struct http_conn http_conn_t;

struct sp_metrics_http {
    sp_metrics_source_t src;
    uv_tcp_t     listener;
    char         addr[96];      /* as bound */
    http_conn_t *conns;
    uint32_t     nconns;
    uint32_t     handles;       /* the listener's, the beat timer's, and every connection's */
    bool         closing;
    uv_timer_t   beat_timer;
    uint64_t     beat_seen;     /* the heartbeat at the last tick it had moved */
    uint64_t     beat_ns;       /* when that tick was (sp_now_ns) */
};

struct http_conn {
    http_conn_t       *next;
    sp_metrics_http_t *mh;
    uv_tcp_t           tcp;
    uv_timer_t         timer;
    uv_write_t         wreq;
    uv_shutdown_t      sreq;
    int                handles;  /* open of tcp and timer */
    bool               closing;
    bool               answered;
    char              *out;      /* the answer being written */
    size_t             len;      /* bytes of head read */
    char               head[SP_METRICS_HTTP_HEAD_MAX];
};

/* ---------------------------------------------------------------- connections */

static void mh_maybe_free(sp_metrics_http_t *mh)
{
    if (mh->closing && mh->handles == 0)
        free(mh);
}

static void conn_on_closed(uv_handle_t *h)
{
    http_conn_t *c = h->data;
    if (--c->handles > 0)
        return;
    sp_metrics_http_t *mh = c->mh;
    free(c->out);
    free(c);
    mh->handles--;
    mh_maybe_free(mh);
}

static void conn_close(http_conn_t *c)
{
    if (c->closing)
        return;
    c->closing = true;
    http_conn_t **pp = &c->mh->conns;
    while (*pp != NULL && *pp != c)
        pp = &(*pp)->next;
    if (*pp == c) {
        *pp = c->next;
        c->mh->nconns--;
    }
    uv_close((uv_handle_t *)&c->tcp, conn_on_closed);
    uv_close((uv_handle_t *)&c->timer, conn_on_closed);
}

static void conn_on_timeout(uv_timer_t *t)
{
    http_conn_t *c = t->data;
    if (!c->answered)
        sp_debug(CTL, "metrics: a connection sent no complete request in %d ms; closed", HTTP_TIMEOUT_MS);
    conn_close(c);
}

/* After the answer: the client's bytes are dropped until it closes. */
static void conn_on_alloc_drop(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    http_conn_t *c = h->data;
    (void)suggested;
    *buf = uv_buf_init(c->head, sizeof c->head);
}

static void conn_on_read_drop(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    (void)buf;
    if (nread < 0)
        conn_close(s->data);
}

static void conn_on_shutdown(uv_shutdown_t *req, int status)
{
    http_conn_t *c = req->data;
    if (c->closing)
        return;
    if (status != 0 || uv_read_start((uv_stream_t *)&c->tcp, conn_on_alloc_drop, conn_on_read_drop) != 0)
        conn_close(c);
}

static void conn_on_written(uv_write_t *req, int status)
{
    http_conn_t *c = req->data;
    if (c->closing)
        return;
    c->sreq.data = c;
    if (status != 0 || uv_shutdown(&c->sreq, (uv_stream_t *)&c->tcp, conn_on_shutdown) != 0)
        conn_close(c);
}

/* Writes the whole answer (headers, then body unless NULL) and closes after it. */
static void conn_answer(http_conn_t *c, const char *status, const char *type, const char *extra, const char *body,
                        size_t body_len)
{
    char head[512];
    int hn = snprintf(head, sizeof head,
                      "HTTP/1.0 %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n%sConnection: close\r\n\r\n",
                      status, type, body_len, extra);
    c->answered = true;
    uv_read_stop((uv_stream_t *)&c->tcp);
    c->out = malloc((size_t)hn + body_len);
    if (c->out == NULL) {
        conn_close(c);
        return;
    }
    memcpy(c->out, head, (size_t)hn);
    if (body_len > 0)
        memcpy(c->out + hn, body, body_len);
    uv_buf_t b = uv_buf_init(c->out, (unsigned)((size_t)hn + body_len));
    c->wreq.data = c;
    /* The timer now bounds how long the client may take to read the answer. */
    uv_timer_start(&c->timer, conn_on_timeout, HTTP_TIMEOUT_MS, 0);
    if (uv_write(&c->wreq, (uv_stream_t *)&c->tcp, &b, 1, conn_on_written) != 0)
        conn_close(c);
}

static void conn_error(http_conn_t *c, const char *status, const char *extra)
{
    char body[96];
    int n = snprintf(body, sizeof body, "%s\n", status);
    conn_answer(c, status, "text/plain; charset=utf-8", extra, body, (size_t)n);
}

/* ---------------------------------------------------------------- requests */

/* Whether target[0, len) is path exactly. */
static bool target_is(const char *target, size_t len, const char *path)
{
    return len == strlen(path) && memcmp(target, path, len) == 0;
}

/* The status that request line line[0, len) gets: exactly "method SP target SP
 * version" in printable ASCII, the version HTTP/1.0 or 1.1. Reads nothing past
 * len: the line is not NUL-terminated. */
static int request_line_status(const char *line, size_t len, sp_metrics_route_t *route_p)
{
    for (size_t i = 0; i < len; i++)
        if ((unsigned char)line[i] < 0x20 || (unsigned char)line[i] > 0x7e)
            return 400;
    const char *sp1 = memchr(line, ' ', len);
    if (sp1 == NULL || sp1 == line)
        return 400;
    const char *target = sp1 + 1, *end = line + len;
    const char *sp2 = memchr(target, ' ', (size_t)(end - target));
    if (sp2 == NULL || sp2 == target)
        return 400;
    const char *version = sp2 + 1;
    size_t vlen = (size_t)(end - version);
    /* A third space is left in the version, which then matches neither. */
    if (vlen != 8 || (memcmp(version, "HTTP/1.0", 8) != 0 && memcmp(version, "HTTP/1.1", 8) != 0))
        return 400;
    if ((size_t)(sp1 - line) != 3 || memcmp(line, "GET", 3) != 0)
        return 405;
    /* A query string is ignored. */
    const char *query = memchr(target, '?', (size_t)(sp2 - target));
    size_t tlen = (size_t)((query != NULL ? query : sp2) - target);
    if (target_is(target, tlen, "/metrics")) {
        *route_p = SP_METRICS_ROUTE_METRICS;
        return 200;
    }
    if (target_is(target, tlen, "/healthz")) {
        *route_p = SP_METRICS_ROUTE_HEALTHZ;
        return 200;
    }
    return 404;
}

int sp_metrics_http_judge(const char *head, size_t len, size_t scanned, sp_metrics_route_t *route_p)
{
    if (len > SP_METRICS_HTTP_HEAD_MAX)
        len = SP_METRICS_HTTP_HEAD_MAX;
    /* An end that straddles the last read began at most 3 bytes before it. */
    size_t from = scanned > 3 ? scanned - 3 : 0;
    /* The head ends with an empty line; the request line is its first. */
    for (size_t i = from; i < len; i++) {
        bool crlf = i + 3 < len && memcmp(head + i, "\r\n\r\n", 4) == 0;
        bool lf = i + 1 < len && head[i] == '\n' && head[i + 1] == '\n';
        if (crlf || lf) {
            size_t line = 0;
            while (head[line] != '\r' && head[line] != '\n')
                line++;   /* stops within the head: it holds a newline */
            return request_line_status(head, line, route_p);
        }
    }
    return len == SP_METRICS_HTTP_HEAD_MAX ? 431 : 0;
}

/* GET /healthz: whether the progress thread went round lately (the beat
 * timer keeps when it last did), and spd is not draining. No session, no
 * engine lock: it answers even when max_clients sessions are taken or a
 * thread holds the lock. */
static void conn_health(http_conn_t *c)
{
    const sp_metrics_http_t *mh = c->mh;
    sp_engine_t *eng = mh->src.eng;
    uint64_t since_ms = (sp_now_ns() - mh->beat_ns) / 1000000u;
    char body[160];
    int n;

    if (atomic_load(&eng->draining)) {
        n = snprintf(body, sizeof body, "draining\n");
        conn_answer(c, "503 Service Unavailable", "text/plain; charset=utf-8", "", body, (size_t)n);
    } else if (since_ms >= SP_METRICS_HEALTH_STALE_MS) {
        n = snprintf(body, sizeof body, "stale: the progress thread has not gone round for %" PRIu64 " ms\n",
                     since_ms);
        conn_answer(c, "503 Service Unavailable", "text/plain; charset=utf-8", "", body, (size_t)n);
    } else {
        n = snprintf(body, sizeof body, "ok: the progress thread went round %" PRIu64 " ms ago\n", since_ms);
        conn_answer(c, "200 OK", "text/plain; charset=utf-8", "", body, (size_t)n);
    }
}

/* Answers a judged request: the metrics, the health, or the refusal its status names. */
static void conn_respond(http_conn_t *c, int status, sp_metrics_route_t route)
{
    switch (status) {
    case 200:
        break;
    case 400:
        conn_error(c, "400 Bad Request", "");
        return;
    case 404:
        conn_error(c, "404 Not Found", "");
        return;
    case 405:
        conn_error(c, "405 Method Not Allowed", "Allow: GET\r\n");
        return;
    default:
        conn_error(c, "431 Request Header Fields Too Large", "");
        return;
    }
    if (route == SP_METRICS_ROUTE_HEALTHZ) {
        conn_health(c);
        return;
    }
    char *text;
    size_t len;
    if (sp_metrics_render(&c->mh->src, NULL, &text, &len) != 0) {
        sp_error(CTL, "metrics: out of memory rendering the metrics");
        conn_error(c, "500 Internal Server Error", "");
        return;
    }
    conn_answer(c, "200 OK", "text/plain; version=0.0.4; charset=utf-8", "", text, len);
    free(text);
}

static void conn_on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf)
{
    http_conn_t *c = h->data;
    (void)suggested;
    /* Room left for the head; none left reads as UV_ENOBUFS. */
    *buf = uv_buf_init(c->head + c->len, (unsigned)(sizeof c->head - c->len));
}

static void conn_on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf)
{
    http_conn_t *c = s->data;
    (void)buf;
    sp_metrics_route_t route = SP_METRICS_ROUTE_METRICS;
    if (nread == UV_ENOBUFS) {   /* a full head is judged 431 first; kept for safety */
        conn_respond(c, 431, route);
        return;
    }
    if (nread < 0) {   /* gone before asking */
        conn_close(c);
        return;
    }
    size_t scanned = c->len;
    c->len += (size_t)nread;
    int status = sp_metrics_http_judge(c->head, c->len, scanned, &route);
    if (status != 0)
        conn_respond(c, status, route);
}

static void on_connection(uv_stream_t *listener, int status)
{
    sp_metrics_http_t *mh = listener->data;
    if (status != 0 || mh->closing)
        return;
    http_conn_t *c = calloc(1, sizeof *c);
    if (c == NULL) {
        sp_error(CTL, "metrics: out of memory taking a connection");
        return;
    }
    c->mh = mh;
    uv_tcp_init(listener->loop, &c->tcp);
    uv_timer_init(listener->loop, &c->timer);
    c->tcp.data = c->timer.data = c;
    c->handles = 2;
    mh->handles++;
    c->next = mh->conns;
    mh->conns = c;
    mh->nconns++;
    if (uv_accept(listener, (uv_stream_t *)&c->tcp) != 0) {
        conn_close(c);
        return;
    }
    if (mh->nconns > HTTP_CONNS_MAX) {   /* the newest is at the head: the oldest goes */
        http_conn_t *oldest = mh->conns;
        while (oldest->next != NULL)
            oldest = oldest->next;
        sp_debug(CTL, "metrics: %d connections open already; the oldest closed", HTTP_CONNS_MAX);
        conn_close(oldest);
    }
    uv_timer_start(&c->timer, conn_on_timeout, HTTP_TIMEOUT_MS, 0);
    if (uv_read_start((uv_stream_t *)&c->tcp, conn_on_alloc, conn_on_read) != 0)
        conn_close(c);
}

/* ---------------------------------------------------------------- the endpoint */

static void mh_handle_on_closed(uv_handle_t *h)
{
    sp_metrics_http_t *mh = h->data;
    mh->handles--;
    mh_maybe_free(mh);
}

static void on_beat_tick(uv_timer_t *t)
{
    sp_metrics_http_t *mh = t->data;
    uint64_t beat = atomic_load_explicit(&mh->src.eng->heartbeat, memory_order_relaxed);
    if (beat != mh->beat_seen) {
        mh->beat_seen = beat;
        mh->beat_ns = sp_now_ns();
    }
    sp_engine_kick(mh->src.eng);   /* an idle thread goes round before the next tick */
}

spc_status_t sp_metrics_http_start(const sp_metrics_source_t *src, sp_metrics_http_t **mh_p, sp_err_t *e)
{
    const char *addr = src->cfg->metrics_listen;
    struct sockaddr_storage sa;

    if (addr[0] == '\0') {
        *mh_p = NULL;   /* off */
        return SPC_OK;
    }
    if (sp_addr_parse(addr, &sa) != 0) {
        sp_err_set(e, SPC_ERR_INVALID_ARG, "metrics_listen '%s': give a numeric address and a port (127.0.0.1:9464, "
                   "[::1]:9464)", addr);
        sp_error(CFG, "%s", e->msg);
        return e->status;
    }
    if (!sp_addr_is_loopback((struct sockaddr *)&sa) && !src->cfg->metrics_allow_remote) {
        sp_err_set(e, SPC_ERR_PERMISSION, "metrics_listen '%s' is not a loopback address, and the endpoint has no "
                   "authentication; set metrics_allow_remote 1 to serve other machines anyway", addr);
        sp_error(CFG, "%s", e->msg);
        return e->status;
    }
    sp_metrics_http_t *mh = calloc(1, sizeof *mh);
    if (mh == NULL) {
        sp_err_set(e, SPC_ERR_NO_MEMORY, "metrics: out of memory");
        sp_error(CTL, "%s", e->msg);
        return e->status;
    }
    mh->src = *src;
    uv_tcp_init(src->loop, &mh->listener);
    mh->listener.data = mh;
    mh->handles = 1;
    int rc = uv_tcp_bind(&mh->listener, (struct sockaddr *)&sa, 0);
    if (rc == 0)
        rc = uv_listen((uv_stream_t *)&mh->listener, 64, on_connection);
    if (rc != 0) {
        sp_err_set(e, SPC_ERR_BUSY, "metrics: cannot listen on %s: %s", addr, uv_strerror(rc));
        sp_error(CTL, "%s", e->msg);
        mh->closing = true;
        uv_close((uv_handle_t *)&mh->listener, mh_handle_on_closed);
        return e->status;
    }
    uv_timer_init(src->loop, &mh->beat_timer);
    mh->beat_timer.data = mh;
    mh->handles++;
    mh->beat_seen = atomic_load(&src->eng->heartbeat);
    mh->beat_ns = sp_now_ns();
    uv_timer_start(&mh->beat_timer, on_beat_tick, HEALTH_TICK_MS, HEALTH_TICK_MS);
    int len = sizeof sa;
    uv_tcp_getsockname(&mh->listener, (struct sockaddr *)&sa, &len);
    sp_addr_name(&sa, NULL, 0, mh->addr, sizeof mh->addr);
    sp_info(CTL, "metrics: serving GET /metrics and /healthz on http://%s%s", mh->addr,
            sp_addr_is_loopback((struct sockaddr *)&sa) ? "" : " (not loopback: metrics_allow_remote is set)");
    *mh_p = mh;
    return SPC_OK;
}

void sp_metrics_http_close(sp_metrics_http_t *mh)
{
    if (mh == NULL || mh->closing)
        return;
    mh->closing = true;
    while (mh->conns != NULL)
        conn_close(mh->conns);
    uv_close((uv_handle_t *)&mh->beat_timer, mh_handle_on_closed);
    uv_close((uv_handle_t *)&mh->listener, mh_handle_on_closed);
}

const char *sp_metrics_http_addr(const sp_metrics_http_t *mh)
{
    return mh != NULL ? mh->addr : "";
}
