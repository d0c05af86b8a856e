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

#include "server.h"

/* Renders the whole exposition into a malloc'd, NUL-terminated text (*len_p
 * bytes). Loop thread; takes the engine lock for a copy. 0, or -1 when out of
 * memory. */
int sp_metrics_render(sp_server_t *srv, char **text_p, size_t *len_p);

typedef struct sp_metrics_http sp_metrics_http_t;

/* Serves GET /metrics on metrics_listen, on the loop. *mh_p is NULL when the
 * option is empty. -1 (logged) when the address is malformed, is not loopback
 * and metrics_allow_remote is 0, or cannot be bound. */
int  sp_metrics_http_start(sp_server_t *srv, sp_metrics_http_t **mh_p);
/* Closes the listener and every connection; the memory goes with the last
 * handle. Accepts NULL. */
void sp_metrics_http_close(sp_metrics_http_t *mh);
/* The address bound, with its real port; "" when there is no endpoint. */
const char *sp_metrics_http_addr(const sp_metrics_http_t *mh);

#endif /* SP_METRICS_H */
