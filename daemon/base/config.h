/*
 * config.h — the daemon's options.
 *
 * One table (config.c) describes every option: name, type, default, limits and a
 * sentence of documentation. Everything else is generated from it:
 *
 *   the config file     `name value` lines, '#' comments (deploy/spd.conf)
 *   the environment     SPD_<NAME> (upper case), e.g. SPD_SOCKET, SPD_LOG_LEVEL
 *   the command line    --set name=value (repeatable)
 *   --dump-config       the resolved configuration, as a config file
 *   spctl config        the same over the control socket, with each value's source
 *
 * Later sources win: default < file < environment < --set. Options that must
 * agree with each other are checked together (sp_config_check) once every
 * source is read; the options marked live change on SIGHUP, the others at
 * the next start.
 */
#ifndef SP_CONFIG_H
#define SP_CONFIG_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "base/err.h"

typedef enum sp_opt_type {
    SP_OPT_STRING,
    SP_OPT_INT,      /* decimal integer within [min, max] */
    SP_OPT_SIZE,     /* bytes; suffixes K, M, G, T (powers of 1024) */
    SP_OPT_LEVEL,    /* log level name */
    SP_OPT_SUBSYS,   /* log subsystem list */
    SP_OPT_FORMAT,   /* log format name */
} sp_opt_type_t;

typedef enum sp_opt_source {
    SP_SRC_DEFAULT = 0,
    SP_SRC_FILE,
    SP_SRC_ENV,
    SP_SRC_CMDLINE,
} sp_opt_source_t;

typedef struct sp_config {
    char    *socket;
    char    *node_name;
    char    *allow_group;
    int64_t  max_clients;
    int64_t  protocol_max;
    int64_t  session_idle_ms;
    int64_t  max_frame_bytes;
    int64_t  reply_pause_bytes;
    int64_t  max_reply_bytes;
    int64_t  sq_entries;
    int64_t  arena_bytes;
    int64_t  max_arena_bytes;
    int64_t  max_registrations;
    int64_t  max_jobs_per_client;
    int64_t  max_named_jobs_per_user;
    int64_t  staging_bytes;
    int64_t  gpu_host_staging_bytes;
    int64_t  gpu_device_staging_bytes;
    int64_t  gpu_lanes_max;
    int64_t  op_timeout_ms;
    int64_t  op_history;
    int64_t  progress_spin_us;
    int64_t  progress_sleep_ms;
    int64_t  progress_cpu;
    int64_t  copy_threads;
    int64_t  drain_timeout_ms;
    char    *peer_listen;
    char    *peers;
    char    *peers_dns;
    int64_t  peers_dns_interval_ms;
    int64_t  peers_dns_max;
    char    *cluster_secret_file;
    char    *cluster_secret_next_file;
    int64_t  peer_heartbeat_ms;
    int64_t  peer_redial_max_ms;
    int64_t  peer_timeout_ms;
    int64_t  peer_restart_grace_ms;
    int64_t  peer_restart_keep_bytes;
    int64_t  peer_max_pending;
    int64_t  peer_max_pending_per_addr;
    int64_t  peer_inbox_msgs;
    int64_t  peer_inbox_bytes;
    int64_t  max_name_lookups;
    int64_t  name_lookup_ms;
    int64_t  fd_reserve;
    char    *metrics_listen;
    int64_t  metrics_allow_remote;
    int64_t  metrics_per_group;
    int64_t  metrics_per_peer;
    char    *log_file;
    int64_t  log_level;
    int64_t  log_subsys;
    int64_t  log_format;
    char    *topology_file;
    char    *nccl_library;
    /* Bookkeeping, not options. */
    uint8_t  source[64];
    char     file[4096];        /* the config file read, if any */
} sp_config_t;

typedef struct sp_option {
    const char   *name;
    sp_opt_type_t type;
    size_t        offset;       /* into sp_config_t */
    const char   *def;          /* default, as it would be written in the file */
    int64_t       min, max;     /* SP_OPT_INT / SP_OPT_SIZE */
    const char   *doc;
    int           live;         /* a reload (SIGHUP) changes it in the running daemon */
} sp_option_t;

/* Where a configuration comes from besides the defaults and the environment:
 * kept by the daemon so that a reload resolves it again the same way. */
typedef struct sp_config_args {
    const char        *file;    /* NULL or "": none */
    const char *const *sets;    /* "name=value", in order; the last of a name wins */
    int                nsets;
} sp_config_args_t;

/* The table, and its length. */
const sp_option_t *sp_config_options(size_t *count_p);
const sp_option_t *sp_config_find(const char *name, size_t *index_p);

/* Sets every option to its default. */
void sp_config_init(sp_config_t *cfg);
void sp_config_cleanup(sp_config_t *cfg);

/* Parses and stores one value. SPC_OK, SPC_ERR_NOT_FOUND (no such option),
 * SPC_ERR_INVALID_ARG (a value it cannot take) or SPC_ERR_NO_MEMORY, the reason in e. */
spc_status_t sp_config_set(sp_config_t *cfg, const char *name, const char *value, sp_opt_source_t src, sp_err_t *e);

/* Reads a config file. SPC_OK, or the error with "path:line: reason" in e. */
spc_status_t sp_config_load_file(sp_config_t *cfg, const char *path, sp_err_t *e);

/* Applies SPD_<NAME> variables found in the environment; an error names the variable. */
spc_status_t sp_config_load_env(sp_config_t *cfg, sp_err_t *e);

/* Sets every option from the defaults, args->file, SPD_* variables and
 * args->sets, in that order. An error names the file and line, the variable or
 * the --set, and leaves cfg holding what was read before it (cleaned up by the
 * caller either way). The options are not checked against each other here. */
spc_status_t sp_config_resolve(sp_config_t *cfg, const sp_config_args_t *args, sp_err_t *e);

/* The options that must agree with each other, checked together. Returns how
 * many disagreements there are, and writes them to out[0, len), one line each
 * naming its options (out is "" with 0). Reads nothing but cfg. */
int sp_config_check(const sp_config_t *cfg, char *out, size_t len);

/* Copies the live options of `from` that differ into `to` (with their source).
 * Returns how many changed, or -1 when out of memory (then some may have).
 * The names of the options that differ but are not live go to
 * restart_only[0, len), comma separated ("" when none). */
int sp_config_apply_live(sp_config_t *to, const sp_config_t *from, char *restart_only, size_t len);

/* Writes option i's current value into buf, as it would be written in the file. */
void sp_config_format(const sp_config_t *cfg, size_t i, char *buf, size_t len);

const char *sp_config_source_name(sp_opt_source_t src);

/* Writes the whole configuration in config-file syntax, each option preceded by
 * its documentation when `with_doc`. */
void sp_config_dump(const sp_config_t *cfg, FILE *out, int with_doc);

#endif /* SP_CONFIG_H */
