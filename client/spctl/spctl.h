/*
 * spctl.h — what the parts of spctl share: the JSON writers, the attach, and
 * the commands that live in files of their own (plan.c needs no daemon; top.c
 * asks one over and over).
 */
#ifndef SPCTL_H
#define SPCTL_H

#include "spclient/spclient.h"

/* Writes s as a JSON string (quoted and escaped) to stdout. */
void spctl_json_string(const char *s);

/* Writes the records of r (NULL: none) to stdout as JSON objects, in [] when
 * as_array. */
void spctl_json_list(const spc_query_result_t *r, int as_array);

/* A control-only attach to the daemon at socket_path (NULL: $SPC_SOCKET or the
 * default); says why on stderr when it fails. */
spc_status_t spctl_attach(const char *socket_path, spc_handle_t **h);

/* `spctl plan ARGS`: argv[0] is "plan". Returns the exit code. */
int spctl_plan(int argc, char **argv, int json);

typedef struct spctl_top_opts {
    long   count;        /* refreshes before it exits; 0: until interrupted */
    double interval_s;   /* between refreshes */
} spctl_top_opts_t;

/* `spctl top [JOB_ID]` (job: "" for all). Returns the exit code. */
int spctl_top(const char *socket_path, const char *job, int json, const spctl_top_opts_t *o);

#endif /* SPCTL_H */
