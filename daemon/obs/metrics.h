/*
 * metrics.h — spd in the Prometheus text exposition format (0.0.4), and the
 * opt-in HTTP endpoint that serves it.
 *
 * One renderer (metrics.c) writes the text for both `spctl metrics` (query
 * topic "metrics") and GET /metrics on metrics_listen (metrics_http.c), so the
 * two never differ. Names are in base units: counters end in _total, durations
 * are _seconds histograms, sizes _bytes. Job ids appear as label job_id (not
 * `job`, which Prometheus keeps for its scrape job), their token cut to 16 hex
 * digits: the endpoint may be read by users who could not attach to spd, and
 * the whole id is what a rank joins with.
 */
#ifndef SP_METRICS_H
#define SP_METRICS_H

#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "base/config.h"
#include "base/err.h"
#include "core/auth.h"
#include "core/engine.h"
#include "gpu/devices.h"
#include "cluster/peer.h"

/* Why a session's hello was refused: the reason label of spd_attach_refused_total. */
typedef enum sp_refusal {
    SP_REFUSED_USER,       /* its credentials could not be read, or its user may not attach */
    SP_REFUSED_LIMIT,      /* max_clients sessions were open */
    SP_REFUSED_PROTOCOL,   /* no protocol in common */
    SP_REFUSED_DRAINING,   /* spd was shutting down */
    SP_REFUSED_REQUEST,    /* it asked for what spd cannot give: a ring or arena size, a pid to watch */
    SP_REFUSED_RESUME,     /* a client of the spd before this one was not taken over: its ticket, uid or segment */
    SP_REFUSED_REASONS
} sp_refusal_t;

/* What the metrics are read from: the daemon's parts, which the control plane
 * hands over and which outlive the endpoint. Each rendering reads them afresh
 * (the engine under its lock; the rest on the loop thread). */
typedef struct sp_metrics_source {
    sp_engine_t        *eng;         /* node, draining, clients, jobs, ops, GPU counters */
    const sp_peers_t   *peers;       /* the other daemons and their links */
    const sp_devices_t *devices;     /* the GPUs found */
    const sp_config_t  *cfg;         /* max_clients, metrics_per_group, metrics_per_peer */
    const uint32_t     *sessions;    /* sessions open: trainers and spctl */
    const uint32_t     *name_lookups;   /* named joins looking for their job's home (ctl/cluster_names.c) */
    const uint64_t     *refused;     /* [SP_REFUSED_REASONS]: hellos refused, by reason */
    uint32_t            protocol_max;   /* the highest client protocol served (protocol_max) */
    const uint32_t     *by_protocol; /* [SP_PROTOCOL_VERSION + 1]: sessions by the protocol their hello chose */
    uv_loop_t          *loop;        /* the endpoint's */
    uint64_t            started_ns;  /* when the control plane started (CLOCK_MONOTONIC) */
} sp_metrics_source_t;

/* Renders the whole exposition into a malloc'd, NUL-terminated text (*len_p
 * bytes), with the per-group series of the jobs `viewer` may see (NULL: every
 * job, for the endpoint, whose labels never hold a whole id). Loop thread;
 * takes the engine lock for a copy. 0, or -1 when out of memory. */
int sp_metrics_render(const sp_metrics_source_t *src, const sp_viewer_t *viewer, char **text_p, size_t *len_p);

typedef struct sp_metrics_http sp_metrics_http_t;

/* Serves GET /metrics and GET /healthz on metrics_listen, on the loop, from a copy of *src. *mh_p is NULL when the
 * option is empty. An error (logged, and in e) when the address is malformed, is not loopback
 * and metrics_allow_remote is 0, or cannot be bound. */
spc_status_t sp_metrics_http_start(const sp_metrics_source_t *src, sp_metrics_http_t **mh_p, sp_err_t *e);
/* Closes the listener and every connection; the memory goes with the last
 * handle. Accepts NULL. */
void sp_metrics_http_close(sp_metrics_http_t *mh);
/* The address bound, with its real port; "" when there is no endpoint. */
const char *sp_metrics_http_addr(const sp_metrics_http_t *mh);

/* The most bytes of request head (request line and headers) a connection reads. */
#define SP_METRICS_HTTP_HEAD_MAX 4096

/* What a GET asks for: the metrics, or whether the data path is alive
 * (/healthz: 200 while the progress thread goes round, 503 once it has not for
 * SP_METRICS_HEALTH_STALE_MS, or while spd drains). */
typedef enum sp_metrics_route {
    SP_METRICS_ROUTE_METRICS = 0,
    SP_METRICS_ROUTE_HEALTHZ = 1,
} sp_metrics_route_t;

#define SP_METRICS_HEALTH_STALE_MS 5000

/*
 * Judges the request head read so far, head[0, len), of which head[0, scanned)
 * held no end of head when judged before (0 the first time). Returns 0 while
 * the head has not ended and may still grow, else the HTTP status to answer:
 * 200 for GET /metrics or GET /healthz (any query string; *route_p says which,
 * set only then), 400 for a request line that is not "method SP target SP
 * HTTP/1.x" in printable ASCII, 405 for another method, 404 for another path,
 * 431 for SP_METRICS_HTTP_HEAD_MAX bytes without an end. The head ends at the
 * first empty line (CRLF CRLF, or LF LF). Reads no byte past len, nor past
 * SP_METRICS_HTTP_HEAD_MAX. Pure: any thread.
 */
int sp_metrics_http_judge(const char *head, size_t len, size_t scanned, sp_metrics_route_t *route_p);

#endif /* SP_METRICS_H */
