/*
 * log.h — the daemon's log.
 *
 * One line per event: time (UTC, microseconds), host:pid:tid, level, subsystem,
 * message; or the same fields as one JSON object per line (log_format json). The
 * level and subsystem are checked before anything is formatted, so a disabled
 * debug line costs one load and a compare. Lines go to stderr or to the
 * configured file (reopened on SIGHUP), each with one write(2) so that lines from
 * the loop and the progress thread never interleave. When stderr is the
 * journal's stream (JOURNAL_STREAM names it), each line starts with its syslog
 * priority, "<3>" to "<7>", which journald takes as the entry's priority.
 */
#ifndef SP_LOG_H
#define SP_LOG_H

#include <stdatomic.h>
#include <stdint.h>

enum sp_log_level {
    SP_LOG_ERROR = 0,
    SP_LOG_WARN  = 1,
    SP_LOG_INFO  = 2,
    SP_LOG_DEBUG = 3,
    SP_LOG_TRACE = 4,
};

/* Subsystems, as bits of the mask (config: log_subsys = "ctl,ring" or "all"). */
#define SP_LOG_SUBSYS_MAP(X) \
    X(CORE, "core")   /* startup, signals, shutdown */           \
    X(CFG,  "cfg")    /* configuration */                        \
    X(CTL,  "ctl")    /* control sessions and their messages */  \
    X(RING, "ring")   /* shared-memory rings, progress thread */ \
    X(JOB,  "job")    /* jobs, groups, collective matching */    \
    X(OP,   "op")     /* operation execution */                  \
    X(MEM,  "mem")    /* segments, arenas, registrations */      \
    X(XPORT,"xport")  /* transports and devices */           \
    X(PEER, "peer")   /* links to the other daemons */

enum sp_log_subsys_bit {
#define SP__LOG_BIT(name, str) SP_LOG_BIT_##name,
    SP_LOG_SUBSYS_MAP(SP__LOG_BIT)
#undef SP__LOG_BIT
    SP_LOG_SUBSYS_COUNT
};
#define SP_LOG_ALL ((1u << SP_LOG_SUBSYS_COUNT) - 1)

enum sp_log_format {
    SP_LOG_TEXT = 0,
    SP_LOG_JSON = 1,
};

extern _Atomic int sp_log_level;
extern _Atomic uint32_t sp_log_mask;
extern _Atomic int sp_log_format;

#define sp_log_enabled(level, subsys)                                             \
    ((level) <= atomic_load_explicit(&sp_log_level, memory_order_relaxed) &&     \
     (atomic_load_explicit(&sp_log_mask, memory_order_relaxed) & (1u << SP_LOG_BIT_##subsys)))

#define SP_LOG(level, subsys, ...)                                                \
    do {                                                                          \
        if (sp_log_enabled(level, subsys))                                        \
            sp_log_emit(level, SP_LOG_BIT_##subsys, __VA_ARGS__);                 \
    } while (0)

#define sp_error(subsys, ...) SP_LOG(SP_LOG_ERROR, subsys, __VA_ARGS__)
#define sp_warn(subsys, ...)  SP_LOG(SP_LOG_WARN, subsys, __VA_ARGS__)
#define sp_info(subsys, ...)  SP_LOG(SP_LOG_INFO, subsys, __VA_ARGS__)
#define sp_debug(subsys, ...) SP_LOG(SP_LOG_DEBUG, subsys, __VA_ARGS__)
#define sp_trace(subsys, ...) SP_LOG(SP_LOG_TRACE, subsys, __VA_ARGS__)

void sp_log_emit(int level, int subsys_bit, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* "error".."trace" → level; -1 when unknown. */
int sp_log_level_parse(const char *s);
const char *sp_log_level_name(int level);
/* "all" or a comma list of subsystem names → mask; returns -1 naming the bad word in *bad. */
int sp_log_mask_parse(const char *s, uint32_t *mask_p, const char **bad_p);
/* "text" or "json" → format; -1 when unknown. */
int sp_log_format_parse(const char *s);
const char *sp_log_format_name(int format);

/* Directs output to `path` ("" = stderr: then priority prefixes when
 * JOURNAL_STREAM names stderr). Returns 0 or -errno. */
int sp_log_open(const char *path);
/* Reopens the current file (after logrotate moved it). Returns 0 or -errno. */
int sp_log_reopen(void);
void sp_log_close(void);

#endif /* SP_LOG_H */
