/*
 * sp_err.h — the detail text of an error, written where it is first seen.
 */
#ifndef SP_ERR_H
#define SP_ERR_H

#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>

/* printf into err[len]: the caller's detail for the status it returns. */
static inline void sp_errf(char *err, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static inline void sp_errf(char *err, size_t len, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
}

#endif /* SP_ERR_H */
