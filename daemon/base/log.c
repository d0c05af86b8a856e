/* log.c — see log.h. */
#include "base/log.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

_Atomic int sp_log_level = SP_LOG_INFO;
_Atomic uint32_t sp_log_mask = SP_LOG_ALL;

static const char *const level_names[] = { "error", "warn", "info", "debug", "trace" };
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

static int open_file(const char *path)
{
    return open(path, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0640);
}

/* Makes fd the output and closes the one before (stderr stays open). */
static void log_fd_swap(int fd)
{
    pthread_rwlock_wrlock(&log_fd_lock);
    int old = log_fd;
    log_fd = fd;
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

void sp_log_emit(int level, int subsys_bit, const char *fmt, ...)
{
    char line[1024];
    struct timespec ts;
    struct tm tm;

    pthread_once(&log_host_once, log_host_init);
    clock_gettime(CLOCK_REALTIME, &ts);
    gmtime_r(&ts.tv_sec, &tm);
    int n = snprintf(line, sizeof line, "%04d-%02d-%02dT%02d:%02d:%02d.%06ldZ %s:%d:%ld %-5s %-5s ",
                     tm.tm_year + 1900, tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min,
                     tm.tm_sec, ts.tv_nsec / 1000, log_host, (int)getpid(),
                     (long)syscall(SYS_gettid), sp_log_level_name(level),
                     subsys_bit >= 0 && subsys_bit < SP_LOG_SUBSYS_COUNT ? subsys_names[subsys_bit] : "?");
    va_list ap;
    va_start(ap, fmt);
    int m = vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    size_t len = (size_t)n + (m < 0 ? 0 : (size_t)m);
    if (len > sizeof line - 2)
        len = sizeof line - 2;   /* truncated: keep the newline */
    line[len++] = '\n';
    pthread_rwlock_rdlock(&log_fd_lock);
    ssize_t w = write(log_fd, line, len);
    pthread_rwlock_unlock(&log_fd_lock);
    (void)w;   /* nowhere left to report a failed log write */
}
