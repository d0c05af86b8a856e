/* log.c — see log.h. */
#include "base/log.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

_Atomic int sp_log_level = SP_LOG_INFO;
_Atomic uint32_t sp_log_mask = SP_LOG_ALL;
_Atomic int sp_log_format = SP_LOG_TEXT;

static const char *const level_names[] = { "error", "warn", "info", "debug", "trace" };
/* syslog's priorities (err, warning, info, debug) for journald's "<N>" prefix. */
static const char level_prio[] = { '3', '4', '6', '7', '7' };
static const char *const format_names[] = { "text", "json" };
static const char *const subsys_names[] = {
#define SP__LOG_NAME(name, str) str,
    SP_LOG_SUBSYS_MAP(SP__LOG_NAME)
#undef SP__LOG_NAME
};

/* The output descriptor changes only on open/reopen. Writers hold log_fd_lock
 * for reading from loading it to the end of their write, and open/reopen swap
 * it and close the old one holding it for writing: a descriptor is never closed
 * under a write, where its number could already name another file (a client's
 * socket, say) when the write lands. */
static int log_fd = STDERR_FILENO;
static bool log_journal;   /* log_fd is the journal's stream: prefix priorities */
static pthread_rwlock_t log_fd_lock = PTHREAD_RWLOCK_INITIALIZER;
static pthread_mutex_t log_path_lock = PTHREAD_MUTEX_INITIALIZER;
static char log_path[4096];
static pthread_once_t log_host_once = PTHREAD_ONCE_INIT;
static char log_host[64];

int sp_log_level_parse(const char *s)
{
    for (int i = 0; i <= SP_LOG_TRACE; i++)
        if (strcasecmp(s, level_names[i]) == 0)
            return i;
    return -1;
}

const char *sp_log_level_name(int level)
{
    return level >= 0 && level <= SP_LOG_TRACE ? level_names[level] : "?";
}

int sp_log_mask_parse(const char *s, uint32_t *mask_p, const char **bad_p)
{
    static __thread char bad[32];
    uint32_t mask = 0;
    const char *p = s;

    if (strcasecmp(s, "all") == 0 || *s == '\0') {
        *mask_p = SP_LOG_ALL;
        return 0;
    }
    while (*p) {
        size_t n = strcspn(p, ",");
        int found = 0;
        for (int i = 0; i < SP_LOG_SUBSYS_COUNT; i++) {
            if (strlen(subsys_names[i]) == n && strncasecmp(p, subsys_names[i], n) == 0) {
                mask |= 1u << i;
                found = 1;
            }
        }
        if (!found && n > 0) {
            snprintf(bad, sizeof bad, "%.*s", (int)(n < 31 ? n : 31), p);
            *bad_p = bad;
            return -1;
        }
        p += n;
        if (*p == ',')
            p++;
    }
    *mask_p = mask;
    return 0;
}

int sp_log_format_parse(const char *s)
{
    for (int i = 0; i <= SP_LOG_JSON; i++)
        if (strcasecmp(s, format_names[i]) == 0)
            return i;
    return -1;
}

const char *sp_log_format_name(int format)
{
    return format >= 0 && format <= SP_LOG_JSON ? format_names[format] : "?";
}

/* Whether stderr is the stream systemd connected to the journal: it sets
 * JOURNAL_STREAM to that stream's "device:inode" (systemd.exec(5)), and a
 * stderr redirected elsewhere since no longer matches. */
static bool stderr_is_journal(void)
{
    const char *js = getenv("JOURNAL_STREAM");
    unsigned long long dev, ino;
    struct stat st;
    if (js == NULL || sscanf(js, "%llu:%llu", &dev, &ino) != 2 || fstat(STDERR_FILENO, &st) != 0)
        return false;
    return (unsigned long long)st.st_dev == dev && (unsigned long long)st.st_ino == ino;
}

static int open_file(const char *path)
{
    return open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);
}

/* Makes fd the output and closes the one before (stderr stays open). */
static void log_fd_swap(int fd)
{
    bool journal = fd == STDERR_FILENO && stderr_is_journal();
    pthread_rwlock_wrlock(&log_fd_lock);
    int old = log_fd;
    log_fd = fd;
    log_journal = journal;
    if (old != STDERR_FILENO)
        close(old);
    pthread_rwlock_unlock(&log_fd_lock);
}

int sp_log_open(const char *path)
{
    pthread_mutex_lock(&log_path_lock);
    int fd = STDERR_FILENO;
    if (path != NULL && *path != '\0') {
        fd = open_file(path);
        if (fd < 0) {
            int err = errno;
            pthread_mutex_unlock(&log_path_lock);
            return -err;
        }
        snprintf(log_path, sizeof log_path, "%s", path);
    } else {
        log_path[0] = '\0';
    }
    log_fd_swap(fd);
    pthread_mutex_unlock(&log_path_lock);
    return 0;
}

int sp_log_reopen(void)
{
    pthread_mutex_lock(&log_path_lock);
    int rc = 0;
    if (log_path[0] != '\0') {
        int fd = open_file(log_path);
        if (fd < 0) {
            rc = -errno;
        } else {
            log_fd_swap(fd);
        }
    }
    pthread_mutex_unlock(&log_path_lock);
    return rc;
}

void sp_log_close(void)
{
    sp_log_open(NULL);
}

static void log_host_init(void)
{
    if (gethostname(log_host, sizeof log_host - 1) != 0)
        strcpy(log_host, "?");
}

/* The length of the well-formed UTF-8 sequence at p (1 to 4), or 0 when the
 * bytes there are not one (RFC 3629: no overlongs, no surrogates, at most
 * U+10FFFF). */
static size_t utf8_len(const unsigned char *p)
{
    size_t n = p[0] < 0xc2 ? 0 : p[0] < 0xe0 ? 2 : p[0] < 0xf0 ? 3 : p[0] < 0xf5 ? 4 : 0;
    for (size_t i = 1; i < n; i++)
        if ((p[i] & 0xc0) != 0x80)
            return 0;
    if ((n == 3 && p[0] == 0xe0 && p[1] < 0xa0) || (n == 3 && p[0] == 0xed && p[1] >= 0xa0) ||
        (n == 4 && p[0] == 0xf0 && p[1] < 0x90) || (n == 4 && p[0] == 0xf4 && p[1] >= 0x90))
        return 0;
    return n;
}

/* Appends msg to buf[*n, len) as the inside of a JSON string; what does not
 * fit is dropped whole (no half escape). Messages carry what clients and files
 * named (process names, paths), so a byte that is not UTF-8 becomes U+FFFD and
 * every line stays valid JSON. */
static void json_escape(char *buf, size_t len, size_t *n, const char *msg)
{
    static const char hex[] = "0123456789abcdef";
    size_t o = *n;
    for (const unsigned char *p = (const unsigned char *)msg; *p != '\0';) {
        char esc[6];
        size_t k = 0, take = 1;
        if (*p == '"' || *p == '\\') {
            esc[k++] = '\\';
            esc[k++] = (char)*p;
        } else if (*p < 0x20) {
            memcpy(esc, "\\u00", 4);
            esc[4] = hex[*p >> 4];
            esc[5] = hex[*p & 15];
            k = 6;
        } else if (*p < 0x80) {
            esc[k++] = (char)*p;
        } else if ((take = utf8_len(p)) > 0) {
            memcpy(esc, p, take);
            k = take;
        } else {
            memcpy(esc, "\\ufffd", 6);
            k = 6;
            take = 1;
        }
        if (o + k > len)
            break;
        memcpy(buf + o, esc, k);
        o += k;
        p += take;
    }
    *n = o;
}

void sp_log_emit(int level, int subsys_bit, const char *fmt, ...)
{
    char line[1024], msg[900];
    struct timespec ts;
    struct tm tm;
    char when[32];
    const char *subsys = subsys_bit >= 0 && subsys_bit < SP_LOG_SUBSYS_COUNT ? subsys_names[subsys_bit] : "?";

    pthread_once(&log_host_once, log_host_init);
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    snprintf(when, sizeof when, "%04d-%02d-%02dT%02d:%02d:%02d.%06ldZ", tm.tm_year + 1900, tm.tm_mon + 1,
             tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);

    /* Room is kept for the priority, which is known only under the lock. */
    size_t n;
    const size_t at = 3;
    if (atomic_load_explicit(&sp_log_format, memory_order_relaxed) == SP_LOG_JSON) {
        n = at + (size_t)snprintf(line + at, sizeof line - at,
                                  "{\"time\":\"%s\",\"host\":\"%s\",\"pid\":%d,\"tid\":%ld,\"level\":\"%s\","
                                  "\"subsys\":\"%s\",\"msg\":\"", when, log_host, (int)getpid(),
                                  (long)syscall(SYS_gettid), sp_log_level_name(level), subsys);
        json_escape(line, sizeof line - 3, &n, msg);
        memcpy(line + n, "\"}", 2);
        n += 2;
    } else {
        int m = snprintf(line + at, sizeof line - at - 1, "%s %s:%d:%ld %-5s %-5s %s", when, log_host, (int)getpid(),
                         (long)syscall(SYS_gettid), sp_log_level_name(level), subsys, msg);
        n = at + (m < 0 ? 0 : (size_t)m);
        if (n > sizeof line - 1)
            n = sizeof line - 1;   /* truncated: keep the newline */
    }
    line[n++] = '\n';
    pthread_rwlock_rdlock(&log_fd_lock);
    size_t from = at;
    if (log_journal) {
        from = 0;
        line[0] = '<';
        line[1] = level_prio[level >= 0 && level <= SP_LOG_TRACE ? level : SP_LOG_TRACE];
        line[2] = '>';
    }
    ssize_t w = write(log_fd, line + from, n - from);
    pthread_rwlock_unlock(&log_fd_lock);
    (void)w;   /* nowhere left to report a failed log write */
}
